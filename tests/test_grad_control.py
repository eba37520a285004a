"""Gradients through If, Loop and Scan (and nested control flow) against torch autograd and float64 finite
differences: ``torch.cond`` exported by the dynamo exporter (If), loops written with onnxscript (Loop with an
If inside), a TorchScript export of a scripted loop, a hand-written Scan RNN; and training: compile_train_step
on models with If and Loop/Scan, Runner steps against torch.optim.SGD."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from helpers import finite_differences, importorskip, session
from onnx import TensorProto
from onnx import numpy_helper as nh

import onnxopt

torch = importorskip("torch")
onnxscript = importorskip("onnxscript")
from onnxscript import DOUBLE, FLOAT, script
from onnxscript import opset18 as op

D = TensorProto.DOUBLE


def run(model, **feeds) -> dict[str, np.ndarray]:
    sess = session(model)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def assert_grad_matches_finite_differences(model, feeds: dict[str, np.ndarray]) -> None:
    """``onnxopt.grad(model, feeds)``'s gradient of the sum of the first output against float64 central
    differences of the model itself (onnxruntime, float64 feeds)."""
    out = run(onnxopt.grad(model, list(feeds)), **feeds)
    sess = session(model)
    fd = finite_differences(lambda p: float(sess.run(None, p)[0].sum()), feeds, list(feeds))
    for name in feeds:
        np.testing.assert_allclose(out[f"{name}_grad"], fd[name], rtol=1e-6, atol=1e-8, err_msg=name)


def ops(graph) -> set[str]:
    found = set()
    for node in graph.node:
        found.add(node.op_type)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                found |= ops(attr.g)
    return found


class Cond(torch.nn.Module):
    """A data-dependent branch (torch.cond) whose then branch reads a parameter of the module (no x·sigmoid(x):
    onnxruntime 1.19 fuses it into QuickGelu, which has no float64 kernel)."""

    def __init__(self):
        super().__init__()
        self.lin, self.w = torch.nn.Linear(3, 3), torch.nn.Parameter(torch.randn(3))

    def forward(self, x):
        h = self.lin(x)
        return torch.cond(h.sum() > 0, lambda h: torch.tanh(h) * self.w, lambda h: torch.sigmoid(h) + h * h, (h,))


def export_cond(module, x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.onnx.export(module, (x,), dynamo=True, input_names=["X"], output_names=["Y"],
                                 verbose=False).model_proto


@pytest.mark.parametrize("scale", [1.0, -3.0], ids=["then", "else"])
def test_torch_cond_matches_torch(scale):
    torch.manual_seed(0)
    module = Cond().double()
    x = torch.randn(2, 3, dtype=torch.float64)
    x = x if (module.lin(x).sum() > 0) == (scale > 0) else -x
    proto = export_cond(module, x)
    assert "If" in ops(proto.graph)
    g = onnxopt.grad(proto, ["X", "w", "lin.weight", "lin.bias"])
    out = run(g, X=x.numpy())
    xx = x.clone().requires_grad_()
    expected = torch.autograd.grad(module(xx).sum(), [xx, module.w, module.lin.weight, module.lin.bias])
    for name, e in zip(["X", "w", "lin.weight", "lin.bias"], expected):
        np.testing.assert_allclose(out[f"{name}_grad"], e.numpy(), rtol=1e-12, atol=1e-14)


@script()
def loop_with_if(X: DOUBLE[2, 3], W: DOUBLE[3, 3]) -> DOUBLE[2, 3]:
    h = X
    for i in range(4):
        h = op.Tanh(op.MatMul(h, W)) + h
        if op.ReduceSum(h) > 0.0:
            h = h * 0.5
        else:
            h = op.Sigmoid(h)
    return h


def loop_with_if_torch(x, w):
    h = x
    for _ in range(4):
        h = torch.tanh(h @ w) + h
        h = h * 0.5 if h.sum() > 0 else torch.sigmoid(h)
    return h


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_onnxscript_loop_with_if_matches_torch(seed):
    m = loop_with_if.to_model_proto()
    assert {"Loop", "If"} <= ops(m.graph)
    g = onnxopt.grad(m, ["X", "W"])
    rng = np.random.default_rng(seed)
    X, W = rng.normal(size=(2, 3)) * (1 if seed % 2 else -3), rng.normal(size=(3, 3))
    out = run(g, X=X, W=W)
    tx, tw = torch.tensor(X, requires_grad=True), torch.tensor(W, requires_grad=True)
    gx, gw = torch.autograd.grad(loop_with_if_torch(tx, tw).sum(), [tx, tw])
    np.testing.assert_allclose(out["X_grad"], gx.numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(out["W_grad"], gw.numpy(), rtol=1e-12, atol=1e-14)


@script()
def while_loop(X: DOUBLE[3], W: DOUBLE[3]) -> DOUBLE[3]:
    """Doubles-and-squashes until the norm passes 4: a data-dependent number of iterations."""
    h = X
    going = op.ReduceSum(h * h, keepdims=0) < 16.0
    while going:
        h = op.Tanh(h * W) * 3.0 + h
        going = op.ReduceSum(h * h, keepdims=0) < 16.0
    return h


def test_while_loop_matches_finite_differences():
    m = while_loop.to_model_proto()
    assert "Loop" in ops(m.graph)
    rng = np.random.default_rng(3)
    assert_grad_matches_finite_differences(m, {"X": rng.uniform(0.1, 0.3, size=3), "W": rng.uniform(0.5, 1.0, size=3)})


class ScriptedLoop(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        h = x
        for i in range(x.shape[0]):
            h = torch.tanh(self.lin(h)) + x[i]
        return h


def test_torchscript_scripted_loop_matches_torch():
    """A TorchScript export of a scripted loop: a Loop whose body reads the loop's input X (outer scope) and
    the Linear's weights."""
    torch.manual_seed(4)
    module = ScriptedLoop()
    x = torch.randn(4, 3)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(torch.jit.script(module), (x,), f, dynamo=False, input_names=["X"], output_names=["Y"])
    proto = onnx.load_from_string(f.getvalue())
    assert "Loop" in ops(proto.graph)
    out = run(onnxopt.grad(proto, ["X", "lin.weight", "lin.bias"]), X=x.numpy())
    xx = x.clone().requires_grad_()
    expected = torch.autograd.grad(module(xx).sum(), [xx, module.lin.weight, module.lin.bias])
    for name, e in zip(["X", "lin.weight", "lin.bias"], expected):
        np.testing.assert_allclose(out[f"{name}_grad"], e.numpy(), rtol=1e-5, atol=1e-6)


def scan_rnn(direction: int, dtype=D, hidden=3, features=4, batch=2, steps=5, seed=0,
             state_input: bool = True) -> onnx.ModelProto:
    """h_t = tanh(x_t W + h_{t-1} U + b) over axis 1 of X (batch, time, features); outputs Y (the h_t stacked)
    and L = sum(Y) + sum(h_T²); H0 an input, or (``state_input=False``) an initializer of zeros."""
    body = oh.make_graph([
        oh.make_node("MatMul", ["x_t", "W"], ["xw"]), oh.make_node("MatMul", ["h_in", "U"], ["hu"]),
        oh.make_node("Add", ["xw", "hu"], ["s"]), oh.make_node("Add", ["s", "b"], ["s2"]),
        oh.make_node("Tanh", ["s2"], ["h_out"]), oh.make_node("Identity", ["h_out"], ["y_t"])],
        "body", [oh.make_tensor_value_info("h_in", dtype, [batch, hidden]),
                 oh.make_tensor_value_info("x_t", dtype, [batch, features])],
        [oh.make_tensor_value_info("h_out", dtype, [batch, hidden]),
         oh.make_tensor_value_info("y_t", dtype, [batch, hidden])])
    rng = np.random.default_rng(seed)
    np_type = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    inits = [nh.from_array(a.astype(np_type), n) for n, a in (
        ("W", rng.normal(size=(features, hidden))), ("U", rng.normal(size=(hidden, hidden)) * 0.5),
        ("b", rng.normal(size=(hidden,))))]
    graph = oh.make_graph([
        oh.make_node("Scan", ["H0", "X"], ["HT", "Y"], body=body, num_scan_inputs=1,
                     scan_input_directions=[direction], scan_input_axes=[1], scan_output_axes=[1]),
        oh.make_node("ReduceSum", ["Y"], ["ys"], keepdims=0), oh.make_node("Mul", ["HT", "HT"], ["h2"]),
        oh.make_node("ReduceSum", ["h2"], ["hs"], keepdims=0), oh.make_node("Add", ["ys", "hs"], ["L"])],
        "rnn", [oh.make_tensor_value_info("H0", dtype, [batch, hidden])] * state_input +
        [oh.make_tensor_value_info("X", dtype, [batch, steps, features])],
        [oh.make_tensor_value_info("L", dtype, []), oh.make_tensor_value_info("Y", dtype, [batch, steps, hidden])],
        inits + [nh.from_array(np.zeros((batch, hidden), np_type), "H0")] * (not state_input))
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=10)


def scan_rnn_torch(x, h, w, u, b, direction):
    ys = []
    for t in (range(x.shape[1]) if direction == 0 else reversed(range(x.shape[1]))):
        h = torch.tanh(x[:, t] @ w + h @ u + b)
        ys.append(h)
    return torch.stack(ys).sum() + (h * h).sum()


def _weights(model):
    return {i.name: nh.to_array(i) for i in model.graph.initializer}


@pytest.mark.parametrize("direction", [0, 1])
def test_scan_rnn_matches_torch(direction):
    m = scan_rnn(direction)
    g = onnxopt.grad(m, ["X", "H0", "W", "U", "b"], of="L")
    rng = np.random.default_rng(5)
    X, H0 = rng.normal(size=(2, 5, 4)), rng.normal(size=(2, 3))
    out = run(g, X=X, H0=H0)
    w = _weights(m)
    args = [torch.tensor(a, requires_grad=True) for a in (X, H0, w["W"], w["U"], w["b"])]
    expected = torch.autograd.grad(scan_rnn_torch(*args, direction), args)
    for name, e in zip(["X", "H0", "W", "U", "b"], expected):
        np.testing.assert_allclose(out[f"{name}_grad"], e.numpy(), rtol=1e-11, atol=1e-13)


def test_hessian_vector_product_through_scan_matches_torch():
    """grad of grad through a Scan: the reverse Scan is differentiated again."""
    m = scan_rnn(0)
    g = onnxopt.grad(m, ["X"], of="L")
    dot = onnx.ModelProto()
    dot.CopyFrom(g)
    dot.graph.node.extend([oh.make_node("Mul", ["X_grad", "V"], ["xv"]),
                           oh.make_node("ReduceSum", ["xv"], ["dot"], keepdims=0)])
    dot.graph.input.append(oh.make_tensor_value_info("V", D, [2, 5, 4]))
    dot.graph.output.append(oh.make_tensor_value_info("dot", D, []))
    h = onnxopt.grad(dot, ["X", "W"], of="dot")
    rng = np.random.default_rng(6)
    X, H0, V = rng.normal(size=(2, 5, 4)), rng.normal(size=(2, 3)), rng.normal(size=(2, 5, 4))
    out = run(h, X=X, H0=H0, V=V)
    w = _weights(m)
    tw = torch.tensor(w["W"], requires_grad=True)
    rest = [torch.tensor(a) for a in (H0, w["U"], w["b"])]
    _, hv = torch.autograd.functional.hvp(lambda x: scan_rnn_torch(x, rest[0], tw, *rest[1:], 0), torch.tensor(X),
                                          torch.tensor(V))
    np.testing.assert_allclose(out["X_grad2"], hv.numpy(), rtol=1e-10, atol=1e-12)
    tx = torch.tensor(X, requires_grad=True)
    gx, = torch.autograd.grad(scan_rnn_torch(tx, rest[0], tw, *rest[1:], 0), tx, create_graph=True)
    gw, = torch.autograd.grad((gx * torch.tensor(V)).sum(), tw)
    np.testing.assert_allclose(out["W_grad"], gw.numpy(), rtol=1e-10, atol=1e-12)


def test_torch_cond_trains_like_torch_sgd():
    torch.manual_seed(7)
    module = Cond()
    X, y = torch.randn(8, 3), torch.randn(8, 3)
    step = onnxopt.compile_train_step(export_cond(module, X), loss="square", update="sgd", learning_rate=0.1)
    runner = onnxopt.Runner(step)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    branches = set()
    for k in range(6):
        # NOTE: a batch taking the then branch at even steps and the else branch at odd ones
        xb = next(c for c in (X * a + b for b in (0.0, 2.0, -2.0, 5.0, -5.0) for a in (1.0, -1.0))
                  if bool(module.lin(c).sum() > 0) == (k % 2 == 0))
        branches.add(bool(module.lin(xb).sum() > 0))
        loss = runner.step(xb.numpy(), y.numpy())
        opt.zero_grad()
        expected = torch.nn.functional.mse_loss(module(xb), y)
        expected.backward()
        opt.step()
        assert loss == pytest.approx(expected.item(), rel=1e-5)
    assert branches == {True, False}, "both branches must have trained"
    got, params = runner.get_weights(), dict(module.named_parameters())
    for name in ("w", "lin.weight", "lin.bias"):
        np.testing.assert_allclose(got[name], params[name].detach().numpy(), rtol=1e-4, atol=1e-6)


def test_scan_rnn_trains_like_torch_sgd():
    m = scan_rnn(0, dtype=TensorProto.FLOAT, state_input=False)
    # NOTE: the step trains on output Y (the hidden states) with a square loss against a target sequence
    step = onnxopt.compile_train_step(m, loss="square", output="Y", update="sgd", learning_rate=0.05,
                                      weights=["W", "U", "b"])
    runner = onnxopt.Runner(step)
    w = {k: torch.tensor(v, requires_grad=True) for k, v in _weights(m).items() if k != "H0"}
    opt = torch.optim.SGD(list(w.values()), lr=0.05)
    rng = np.random.default_rng(8)
    H0 = np.zeros((2, 3), np.float32)
    for _ in range(4):
        X, target = rng.normal(size=(2, 5, 4)).astype(np.float32), rng.normal(size=(2, 5, 3)).astype(np.float32)
        loss = runner.step(X, target)
        h, ys = torch.tensor(H0), []
        for t in range(5):
            h = torch.tanh(torch.tensor(X[:, t]) @ w["W"] + h @ w["U"] + w["b"])
            ys.append(h)
        expected = torch.nn.functional.mse_loss(torch.stack(ys, 1), torch.tensor(target))
        opt.zero_grad()
        expected.backward()
        opt.step()
        assert loss == pytest.approx(expected.item(), rel=1e-5)
    got = runner.get_weights()
    for name in ("W", "U", "b"):
        np.testing.assert_allclose(got[name], w[name].detach().numpy(), rtol=1e-4, atol=1e-6)


@script()
def loop_model(X: FLOAT[4, 3], W: FLOAT[3, 3]) -> FLOAT[4, 3]:
    h = X
    for i in range(3):
        h = op.Tanh(op.MatMul(h, W)) + h
    return h


def test_loop_trains_like_torch_sgd():
    m = loop_model.to_model_proto()
    w0 = np.random.default_rng(9).normal(size=(3, 3)).astype(np.float32) * 0.5
    # NOTE: W made an initializer (a weight)
    m.graph.input.pop(1)
    m.graph.initializer.append(nh.from_array(w0, "W"))
    step = onnxopt.compile_train_step(m, loss="square", update="sgd", learning_rate=0.1, weights=["W"])
    runner = onnxopt.Runner(step)
    tw = torch.tensor(w0, requires_grad=True)
    opt = torch.optim.SGD([tw], lr=0.1)
    rng = np.random.default_rng(10)
    for _ in range(4):
        X, y = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(4, 3)).astype(np.float32)
        loss = runner.step(X, y)
        h = torch.tensor(X)
        for _ in range(3):
            h = torch.tanh(h @ tw) + h
        expected = torch.nn.functional.mse_loss(h, torch.tensor(y))
        opt.zero_grad()
        expected.backward()
        opt.step()
        assert loss == pytest.approx(expected.item(), rel=1e-5)
    np.testing.assert_allclose(runner.get_weights()["W"], tw.detach().numpy(), rtol=1e-4, atol=1e-6)


def test_onnx_module_trains_through_torch_cond():
    """The partial-training path: OnnxModule (ForwardBackward's split forward and backward models) on a model
    with an If, its parameter gradients against torch's for batches taking each branch."""
    from onnxopt.torch import OnnxModule

    torch.manual_seed(11)
    module = Cond().double()
    X = torch.randn(4, 3, dtype=torch.float64)
    wrapped = OnnxModule(export_cond(module, X))
    for xb in (X, -X - 3.0, X + 3.0):
        wrapped.zero_grad()
        module.zero_grad()
        xo, xt = xb.clone().requires_grad_(), xb.clone().requires_grad_()
        (wrapped(xo) ** 2).sum().backward()
        (module(xt) ** 2).sum().backward()
        np.testing.assert_allclose(xo.grad.numpy(), xt.grad.numpy(), rtol=1e-10, atol=1e-12)
        params = dict(module.named_parameters())
        for name, safe in wrapped.param_names.items():
            np.testing.assert_allclose(getattr(wrapped, safe).grad.numpy(), params[name].grad.numpy(),
                                       rtol=1e-10, atol=1e-12)


def test_forward_backward_through_scan():
    m = scan_rnn(1)
    fb = onnxopt.ForwardBackward(m, weights=["W", "U"], inputs=["X"])
    rng = np.random.default_rng(12)
    X, H0 = rng.normal(size=(2, 5, 4)), rng.normal(size=(2, 3))
    outputs = fb.forward({"H0": H0, "X": X})
    grads = fb.backward([np.ones(()), None], outputs)
    expected = run(onnxopt.grad(m, ["X", "W", "U"], of="L"), X=X, H0=H0)
    for name in ("X", "W", "U"):
        np.testing.assert_allclose(grads[name], expected[f"{name}_grad"], rtol=1e-12, atol=1e-14)


def test_sequence_ops_match_finite_differences():
    """SplitToSequence, SequenceAt (a sequence read twice: the gradients summed as sequences), SequenceInsert,
    SequenceConstruct, ConcatFromSequence (stacking and concatenating) in float64."""
    i64 = np.int64
    nodes = [oh.make_node("SplitToSequence", ["X"], ["s"], axis=0, keepdims=0),
             oh.make_node("Constant", [], ["i0"], value=nh.from_array(np.array(0, i64))),
             oh.make_node("Constant", [], ["i2"], value=nh.from_array(np.array(-2, i64))),
             oh.make_node("SequenceAt", ["s", "i0"], ["a"]), oh.make_node("SequenceAt", ["s", "i2"], ["b"]),
             oh.make_node("Mul", ["a", "b"], ["ab"]), oh.make_node("Tanh", ["ab"], ["t"]),
             oh.make_node("SequenceInsert", ["s", "t", "i0"], ["s2"]),
             oh.make_node("SequenceConstruct", ["Y0", "t"], ["s3"]),
             oh.make_node("ConcatFromSequence", ["s2"], ["c"], axis=0, new_axis=1),
             oh.make_node("ConcatFromSequence", ["s3"], ["c3"], axis=0),
             oh.make_node("SplitToSequence", ["c", "sp"], ["s4"], axis=1),
             oh.make_node("ConcatFromSequence", ["s4"], ["c4"], axis=1),
             oh.make_node("Mul", ["c4", "c4"], ["c5"]), oh.make_node("ReduceSum", ["c5"], ["r1"], keepdims=0),
             oh.make_node("ReduceSum", ["c3"], ["r2"], keepdims=0), oh.make_node("Mul", ["r2", "r2"], ["r3"]),
             oh.make_node("Add", ["r1", "r3"], ["L"])]
    graph = oh.make_graph(nodes, "seq", [oh.make_tensor_value_info("X", D, [4, 3]),
                                         oh.make_tensor_value_info("Y0", D, [3])],
                          [oh.make_tensor_value_info("L", D, [])], [nh.from_array(np.array([1, 2], i64), "sp")])
    m = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=10)
    rng = np.random.default_rng(13)
    assert_grad_matches_finite_differences(m, {"X": rng.normal(size=(4, 3)), "Y0": rng.normal(size=3)})


class ListLoop(torch.nn.Module):
    """TorchScript's list pattern: a Loop appending to a list (a sequence state), stacked after the loop."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        h = x[0]
        outs: list[torch.Tensor] = []
        for i in range(x.shape[0]):
            h = torch.tanh(self.lin(h)) + x[i]
            outs.append(h)
        return torch.stack(outs)


def test_torchscript_loop_appending_to_a_list_matches_torch():
    torch.manual_seed(14)
    module = ListLoop()
    x = torch.randn(4, 3)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(torch.jit.script(module), (x,), f, dynamo=False, input_names=["X"], output_names=["Y"])
    proto = onnx.load_from_string(f.getvalue())
    assert {"Loop", "SequenceEmpty", "SequenceInsert", "ConcatFromSequence"} <= ops(proto.graph)
    out = run(onnxopt.grad(proto, ["X", "lin.bias"]), X=x.numpy())
    np.testing.assert_allclose(out["Y"], module(x).detach().numpy(), rtol=1e-6, atol=1e-6)
    xx = x.clone().requires_grad_()
    expected = torch.autograd.grad(module(xx).sum(), [xx, module.lin.bias])
    for name, e in zip(["X", "lin.bias"], expected):
        np.testing.assert_allclose(out[f"{name}_grad"], e.numpy(), rtol=1e-5, atol=1e-6)


@script()
def loop_in_if(X: DOUBLE[2, 3], W: DOUBLE[3, 3]) -> DOUBLE[2, 3]:
    if op.ReduceSum(X) > 0.0:
        h = X
        for i in range(3):
            h = op.Sigmoid(op.MatMul(h, W)) + h
    else:
        h = op.Tanh(op.MatMul(X, W)) * X
    return h


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["loop branch", "plain branch"])
def test_loop_inside_if_matches_torch(sign):
    m = loop_in_if.to_model_proto()
    rng = np.random.default_rng(15)
    X, W = np.abs(rng.normal(size=(2, 3))) * sign, rng.normal(size=(3, 3))
    out = run(onnxopt.grad(m, ["X", "W"]), X=X, W=W)
    tx, tw = torch.tensor(X, requires_grad=True), torch.tensor(W, requires_grad=True)
    if tx.sum() > 0:
        h = tx
        for _ in range(3):
            h = torch.sigmoid(h @ tw) + h
    else:
        h = torch.tanh(tx @ tw) * tx
    gx, gw = torch.autograd.grad(h.sum(), [tx, tw])
    np.testing.assert_allclose(out["X_grad"], gx.numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(out["W_grad"], gw.numpy(), rtol=1e-12, atol=1e-14)
