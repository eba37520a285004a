"""passes/decompose on models written by torch.onnx.export: weight gradients equal torch autograd."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest

import onnxopt

torch = pytest.importorskip("torch")
nn = torch.nn

ACTIVATIONS = {
    "elu": lambda: nn.ELU(alpha=0.7), "softplus": nn.Softplus, "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "layernorm": lambda: nn.LayerNorm(5), "prelu": nn.PReLU, "silu": nn.SiLU, "mish": nn.Mish,
    "hardswish": nn.Hardswish, "selu": nn.SELU,
}


def _export(module, x, dynamo: bool) -> onnx.ModelProto:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            return torch.onnx.export(module, (x,), dynamo=True, opset_version=18, verbose=False).model_proto
        torch.onnx.export(module, (x,), buffer, dynamo=False, opset_version=18, input_names=["x"])
    return onnx.load_from_string(buffer.getvalue())


def _match(array: np.ndarray, params: dict) -> str | None:
    """The torch parameter holding ``array`` (maybe transposed): exporters rename and transpose weights."""
    for name, p in params.items():
        if p.size == array.size and np.array_equal(p.reshape(-1), array.reshape(-1)) and (p.ndim < 2 or p.shape == array.shape):
            return name
        if p.ndim == 2 and p.T.shape == array.shape and np.array_equal(p.T, array):
            return name + ".T"
    return None


def _mlp():
    """One MLP holding every activation (an export costs seconds), each between two Linear layers."""
    layers = [nn.Linear(4, 5)]
    for act in sorted(ACTIVATIONS):
        layers += [ACTIVATIONS[act](), nn.Linear(5, 5)]
    return nn.Sequential(*layers, nn.Linear(5, 3)), torch.randn(6, 4)


def _decoder():
    """ConvTranspose (no CPU gradient kernel in onnxruntime) and nearest Upsample (no ResizeGrad either)."""
    return nn.Sequential(nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1), nn.Tanh(),
                         nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(3, 1, 3), nn.Flatten(),
                         nn.Linear(196, 3)), torch.randn(6, 2, 4, 4)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
@pytest.mark.parametrize("build", [_mlp, _decoder], ids=["activations", "decoder"])
def test_weight_gradient_equals_torch(build, dynamo):
    torch.manual_seed(0)
    module, x = build()
    module.eval()
    model = _export(module, x, dynamo)
    weights = onnxopt.train_initializers(model)
    grad = onnxopt.gradient_model(model, weights=sorted(weights))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(grad.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    feed_names = [i.name for i in sess.get_inputs()]
    cot = np.random.default_rng(0).normal(size=(len(x), 3)).astype(np.float32)
    feeds = {feed_names[0]: x.numpy(), **weights}
    feeds[next(n for n in feed_names if n.endswith("_grad"))] = cot
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))

    (module(x) * torch.from_numpy(cot)).sum().backward()
    params = {n: p.detach().numpy() for n, p in module.named_parameters()}
    grads = {n: p.grad.numpy() for n, p in module.named_parameters()}
    matched = 0
    for name, value in weights.items():
        which = _match(value, params)
        if which is None:
            continue
        expected = grads[which[:-2]].T if which.endswith(".T") else grads[which].reshape(value.shape)
        np.testing.assert_allclose(got[name + "_grad"], expected, rtol=1e-4, atol=1e-5, err_msg=name)
        matched += 1
    assert matched == len(params), (sorted(weights), sorted(params))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_zipmap_dropped_for_training_and_restored_on_export(dtype):
    """skl2onnx's default classifier output (ZipMap) trains on its probabilities and comes back on export."""
    from skl2onnx import to_onnx
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    X, y = load_iris(return_X_y=True)
    X = X.astype(dtype)
    est = LogisticRegression(max_iter=200).fit(X, y)
    onx = to_onnx(est, X[:1])
    assert "ZipMap" in [n.op_type for n in onx.graph.node]
    step = onnxopt.compile_train_step(onx, loss=onnxopt.dsl.losses.cross_entropy(from_logits=False),
                                      output="output_probability", learning_rate=0.01)
    runner = onnxopt.Runner(step)
    first = float(runner.step(X, y.astype(np.int64)))
    log_loss = -np.mean(np.log(est.predict_proba(X)[np.arange(len(y)), y]))
    np.testing.assert_allclose(first, log_loss, rtol=1e-4)
    exported = runner.export()
    assert "ZipMap" in [n.op_type for n in exported.graph.node]
    assert exported.graph.output[1].type.HasField("sequence_type")
    probabilities = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"X": X[:3]})[1]
    assert sorted(probabilities[0]) == [0, 1, 2]
    np.testing.assert_allclose([list(p.values()) for p in probabilities], est.predict_proba(X[:3]), rtol=1e-3)


@pytest.mark.parametrize("shape", [(1,), (3,), (1, 3)])
def test_where_branch_broadcast_weight_gets_its_own_shape_gradient(shape):
    # NOTE: ORT's Where gradient does not sum a broadcast branch back; decompose expands such branches first
    from onnx import TensorProto

    rng = np.random.default_rng(1)
    w0 = rng.normal(size=shape)
    nodes = [oh.make_node("Greater", ["X", "zero"], ["c"]), oh.make_node("Where", ["c", "X", "w"], ["Y"])]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("X", TensorProto.DOUBLE, [None, 3])],
                          [oh.make_tensor_value_info("Y", TensorProto.DOUBLE, [None, 3])],
                          [onh.from_array(np.array(0.0), "zero"), onh.from_array(w0, "w")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 10
    X, y = rng.normal(size=(5, 3)), rng.normal(size=(5, 3))

    def loss(w):
        return np.mean((np.where(X > 0, X, w) - y) ** 2)

    step = onnxopt.compile_train_step(model, weights=["w"], learning_rate=1.0)
    runner = onnxopt.Runner(step)
    assert runner.step(X, y) == pytest.approx(loss(w0), rel=1e-12)
    eps, fd = 1e-6, np.zeros(shape)
    for i in np.ndindex(*shape):
        d = np.zeros(shape)
        d[i] = eps
        fd[i] = (loss(w0 + d) - loss(w0 - d)) / (2 * eps)
    np.testing.assert_allclose(w0 - runner.get_weights()["w"], fd, rtol=1e-6)
