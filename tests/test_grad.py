"""``onnxopt.grad``: gradients of gradients of torch-exported models (both exporters) against torch autograd
(``create_graph=True``, ``torch.autograd.functional.hvp``) and float64 finite differences; a gradient-penalty
training step compiled by ``compile_train_step(loss=None)`` against torch's SGD on the same penalty."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from helpers import finite_differences, importorskip, session
from onnx import TensorProto

import onnxopt
from onnxopt.errors import ModelError

torch = importorskip("torch")

F64 = TensorProto.DOUBLE


def export(module, x: torch.Tensor, dynamo: bool) -> onnx.ModelProto:
    """``module`` exported with input X and output Y, by the dynamo exporter or the TorchScript one."""
    module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            proto = torch.onnx.export(module, (x,), dynamo=True, input_names=["X"], output_names=["Y"],
                                      verbose=False).model_proto
        else:
            f = io.BytesIO()
            torch.onnx.export(module, (x,), f, dynamo=False, input_names=["X"], output_names=["Y"])
            proto = onnx.load_from_string(f.getvalue())
    return proto


def extend(model: onnx.ModelProto, nodes, outputs, inputs=()) -> onnx.ModelProto:
    """``model`` with ``nodes`` appended, new graph ``inputs`` and ``outputs`` (name, elem type, shape)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.node.extend(nodes)
    m.graph.input.extend(oh.make_tensor_value_info(*i) for i in inputs)
    m.graph.output.extend(oh.make_tensor_value_info(*o) for o in outputs)
    return m


def run(model: onnx.ModelProto, **feeds) -> dict[str, np.ndarray]:
    sess = session(model)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def hvp_model(model: onnx.ModelProto, weights: list[str], shape, dtype=F64) -> onnx.ModelProto:
    """grad(grad(model, X) · V, [X, *weights]): Hessian-vector products in X (``X_grad2``) and the mixed
    second derivatives in the weights (``<w>_grad``)."""
    g = onnxopt.grad(model, ["X"])
    dot = extend(g, [oh.make_node("Mul", ["X_grad", "V"], ["XV"]),
                     oh.make_node("ReduceSum", ["XV"], ["dot"], keepdims=0)],
                 [("dot", dtype, [])], [("V", dtype, list(shape))])
    return onnxopt.grad(dot, ["X", *weights], of="dot")


def torch_hvp(module, x, v, weights):
    xx = x.clone().requires_grad_()
    gx, = torch.autograd.grad(module(xx).sum(), xx, create_graph=True)
    params = dict(module.named_parameters())
    return torch.autograd.grad((gx * v).sum(), [xx, *(params[w] for w in weights)])


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.l3(torch.nn.functional.silu(self.l2(torch.tanh(self.l1(x)))))


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(3, 4, 3, stride=2)
        self.fc = torch.nn.Linear(4 * 2 * 2, 2)

    def forward(self, x):
        h = torch.nn.functional.avg_pool2d(torch.tanh(self.conv(x)), 2, 1)
        h = torch.sigmoid(self.conv2(h))
        return self.fc(h.flatten(1))


class Attention(torch.nn.Module):
    """One pre-norm self-attention block with a GELU feed-forward (tanh: onnxruntime has no float64 Erf)."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads, self.norm = heads, torch.nn.LayerNorm(d)
        self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.ff = torch.nn.Sequential(torch.nn.Linear(d, 16), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(16, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1) @ v
        h = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        return h + self.ff(h)


# NOTE: float32 for the CNN: onnxruntime has no float64 Conv kernel
CASES = {"mlp": (MLP, (5, 4), ["l1.weight", "l2.bias"], torch.float64),
         "cnn": (CNN, (2, 2, 6, 6), ["conv.weight", "conv2.weight", "fc.weight"], torch.float32),
         "attention": (Attention, (2, 3, 8), ["qkv.weight", "norm.weight"], torch.float64)}


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_hessian_vector_products_match_torch(case, dynamo):
    make, shape, weights, dtype = CASES[case]
    torch.manual_seed(0)
    module = make().to(dtype)
    x, v = torch.randn(*shape, dtype=dtype), torch.randn(*shape, dtype=dtype)
    proto = export(module, x, dynamo)
    names = {i.name for i in proto.graph.initializer}
    weights = [w for w in weights if w in names]  # NOTE: the dynamo exporter may fold a weight (transposed)
    elem = F64 if dtype == torch.float64 else TensorProto.FLOAT
    out = run(hvp_model(proto, weights, shape, elem), X=x.numpy(), V=v.numpy())
    expected = torch_hvp(module, x, v, weights)
    _, hv = torch.autograd.functional.hvp(lambda z: module(z).sum(), x, v)
    tol = {"rtol": 1e-9, "atol": 1e-11} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    np.testing.assert_allclose(out["X_grad2"], hv.numpy(), **tol)
    for w, e in zip(weights, expected[1:]):
        np.testing.assert_allclose(out[f"{w}_grad"], e.numpy(), **tol)
    np.testing.assert_allclose(out["Y"], module(x).detach().numpy(), **tol)


def test_third_order_matches_finite_differences():
    """grad applied three times: d/dX of sum(d/dX of sum(d/dX of sum(Y))), against central differences of the
    second-order model's output in float64."""
    torch.manual_seed(1)
    module = MLP().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    m = export(module, x, dynamo=False)
    g2 = onnxopt.grad(onnxopt.grad(m, ["X"]), ["X"], of="X_grad")
    g3 = onnxopt.grad(g2, ["X", "l1.weight"], of="X_grad2")
    assert [o.name for o in g3.graph.output] == ["Y", "X_grad", "X_grad2", "X_grad3", "l1.weight_grad"]
    sess = session(g2)
    w = {i.name: onnx.numpy_helper.to_array(i) for i in m.graph.initializer}

    def total(p):
        g2w = onnx.ModelProto()
        g2w.CopyFrom(g2)
        for init in g2w.graph.initializer:
            if init.name == "l1.weight":
                init.CopyFrom(onnx.numpy_helper.from_array(p["l1.weight"], "l1.weight"))
        s = session(g2w) if "l1.weight" in p and p["l1.weight"] is not w["l1.weight"] else sess
        return float(s.run(["X_grad2"], {"X": p["X"]})[0].sum())

    out = run(g3, X=x.numpy())
    fd = finite_differences(total, {"X": x.numpy(), "l1.weight": w["l1.weight"]}, ["X", "l1.weight"], eps=1e-5)
    np.testing.assert_allclose(out["X_grad3"], fd["X"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out["l1.weight_grad"], fd["l1.weight"], rtol=1e-5, atol=1e-7)


def test_seed_weights_the_sum():
    torch.manual_seed(2)
    module = MLP().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    g = onnxopt.grad(export(module, x, dynamo=True), ["X", "l3.bias"], seed=True)
    assert [i.name for i in g.graph.input][-1] == "Y_grad"
    s = torch.randn(3, 1, dtype=torch.float64)
    out = run(g, X=x.numpy(), Y_grad=s.numpy())
    xx = x.clone().requires_grad_()
    gx, gb = torch.autograd.grad((module(xx) * s).sum(), [xx, module.l3.bias])
    np.testing.assert_allclose(out["X_grad"], gx.numpy(), rtol=1e-12)
    np.testing.assert_allclose(out["l3.bias_grad"], gb.numpy(), rtol=1e-12)
    # NOTE: the initializer stays one: the model's inputs are X and the seed only
    assert [i.name for i in g.graph.input] == ["X", "Y_grad"]


def test_bad_arguments_name_the_argument():
    m = export(MLP(), torch.randn(2, 4), dynamo=False)
    with pytest.raises(ModelError, match="wrt: 'Z' is not a graph input or initializer"):
        onnxopt.grad(m, ["Z"])
    with pytest.raises(ModelError, match="of: 'nope' is not an output"):
        onnxopt.grad(m, ["X"], of="nope")


def penalty_model(critic: onnx.ModelProto, lam: float, dtype=TensorProto.FLOAT) -> onnx.ModelProto:
    """WGAN-GP's critic loss on a batch X: mean(Y) + lam · mean((||dY/dX||_2 - 1)^2), per-sample norms."""
    g = onnxopt.grad(critic, ["X"])
    np_type = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    c = [oh.make_node("Constant", [], [n], value=onnx.numpy_helper.from_array(np.array(v, np_type)))
         for n, v in (("one", 1.0), ("lam", lam))]
    nodes = [*c, oh.make_node("Mul", ["X_grad", "X_grad"], ["sq"]),
             oh.make_node("ReduceSum", ["sq", "axes"], ["n2"], keepdims=0),
             oh.make_node("Sqrt", ["n2"], ["norm"]), oh.make_node("Sub", ["norm", "one"], ["d"]),
             oh.make_node("Mul", ["d", "d"], ["d2"]), oh.make_node("ReduceMean", ["d2"], ["gp"], keepdims=0),
             oh.make_node("Mul", ["gp", "lam"], ["gpl"]), oh.make_node("ReduceMean", ["Y"], ["ym"], keepdims=0),
             oh.make_node("Add", ["ym", "gpl"], ["loss"])]
    m = extend(g, nodes, [("loss", dtype, [])])
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1], np.int64), "axes"))
    return m


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_gradient_penalty_sgd_steps_match_torch(dynamo):
    torch.manual_seed(3)
    critic = MLP()
    X = torch.randn(16, 4)
    proto = penalty_model(export(critic, X, dynamo), lam=10.0)
    step = onnxopt.compile_train_step(proto, loss=None, loss_output="loss", update="sgd", learning_rate=0.05)
    runner = onnxopt.Runner(step)
    opt = torch.optim.SGD(critic.parameters(), lr=0.05)
    for k in range(5):
        xb = X + 0.1 * k
        loss = runner.step(xb.numpy())
        xx = xb.clone().requires_grad_()
        y = critic(xx)
        gx, = torch.autograd.grad(y.sum(), xx, create_graph=True)
        expected = y.mean() + 10.0 * ((gx.norm(dim=1) - 1) ** 2).mean()
        opt.zero_grad()
        expected.backward()
        opt.step()
        assert loss == pytest.approx(expected.item(), rel=1e-5)
    got = runner.get_weights()
    params = dict(critic.named_parameters())
    compared = [n for n in got if n in params]
    assert compared
    for name in compared:
        np.testing.assert_allclose(got[name], params[name].detach().numpy(), rtol=1e-4, atol=1e-6)
