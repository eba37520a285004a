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

from helpers import importorskip  # NOTE: fails instead of skipping under CI=true
torch = importorskip("torch")
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


class _SpatialTransformer(nn.Module):
    """affine_grid, grid_sample, fmod and det: AffineGrid, GridSample, Mod and Det in the TorchScript export."""

    def __init__(self):
        super().__init__()
        self.theta = nn.Linear(16, 6)
        self.divisor = nn.Parameter(torch.tensor([1.7]))

    def forward(self, x):
        theta = self.theta(x.flatten(1)).view(-1, 2, 3)
        grid = nn.functional.affine_grid(theta, [x.shape[0], 1, 3, 3], align_corners=False)
        y = nn.functional.grid_sample(x, grid, align_corners=False)
        # NOTE: det of a near-identity matrix: Det's gradient det(A)·A⁻ᵀ is NaN where A is singular
        return torch.fmod(y.flatten(1) * 3, self.divisor) + torch.det(y[:, 0] * 0.2 + torch.eye(3))[:, None]


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_spatial_transformer_gradient_equals_torch(dynamo):
    torch.manual_seed(3)
    net, x = _SpatialTransformer(), torch.randn(2, 1, 4, 4)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            model = torch.onnx.export(net, (x,), dynamo=True, opset_version=20, verbose=False).model_proto
        else:
            torch.onnx.export(net, (x,), buffer, dynamo=False, opset_version=20, input_names=["x"])
            model = onnx.load_from_string(buffer.getvalue())
    ops = {n.op_type for n in model.graph.node}
    assert {"GridSample", "Mod", "Det"} <= ops and (dynamo or "AffineGrid" in ops)
    fb = onnxopt.ForwardBackward(model)
    out = fb.forward(x.numpy())[0].copy()  # NOTE: ORT may reuse the output's memory in backward
    cot = np.random.default_rng(0).normal(size=out.shape).astype(np.float32)
    got = fb.backward(cot)
    expected = net(x.requires_grad_())
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-5, atol=1e-5)
    (expected * torch.from_numpy(cot)).sum().backward()
    np.testing.assert_allclose(got[fb.input_names[0]], x.grad.numpy(), rtol=1e-4, atol=1e-5)  # GridSample's image
    params = dict(net.named_parameters())
    for name, grad in got.items():
        if name in params:
            np.testing.assert_allclose(grad, params[name].grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
    assert {"theta.weight", "divisor"} <= set(got)


def _forms():
    from test_op_coverage import c

    i64, rois = np.int64, np.array([[0.5, 0.2, 3.1, 2.8], [-1.0, 1.0, 6.0, 3.5], [1.0, 0.0, 2.0, 1.5]])
    return [
        c("Mod", "w:2,3", "p:3", fmod=1), c("Mod", "w:3", "p:2,1", fmod=1), c("Det", "n:2,3,3"),
        c("Mod", np.array([[7.5, -9.1, 4.2]]), "p:2,3", fmod=1),  # NOTE: a constant dividend, a divisor to train
        c("Unique", "n:4,2", axis=1, sorted=0, outputs=2), c("Unique", "n:5"),
        c("AffineGrid", "n:2,3,4", np.array([2, 1, 2, 3, 2], i64), align_corners=1),
        c("CenterCropPad", "n:2,5,3", np.array([4, 6], i64), axes=[1, 2]),
        c("Col2Im", "n:1,8,12", np.array([4, 5], i64), np.array([2, 2], i64), strides=[2, 1], pads=[1, 0, 1, 1],
          dilations=[1, 2]),
        *[c("GridSample", "n:2,2,3,4", "n:2,3,2,2", mode=m, padding_mode=p, align_corners=a)
          for m, p, a in (("linear", "border", 1), ("linear", "zeros", 1), ("nearest", "zeros", 0))],
        c("DFT", "n:2,5,2", None, np.array(1, i64), inverse=1), c("DFT", "n:3,4,1", np.array(6, i64), np.array(0, i64)),
        c("DFT", "n:2,6,1", np.array(4, i64), np.array(1, i64), onesided=1),
        c("STFT", "n:2,9,1", np.array(3, i64), "n:4"), c("STFT", "n:1,8,2", np.array(2, i64), "n:4", onesided=0),
        c("RoiAlign", "n:2,2,5,4", rois, np.array([0, 1, 1], i64), output_height=2, output_width=3,
          sampling_ratio=2, spatial_scale=0.8),
        c("RoiAlign", "n:2,1,4,4", rois, np.array([1, 0, 0], i64), coordinate_transformation_mode="output_half_pixel"),
        c("MaxRoiPool", "n:2,2,5,6", np.array([[0, 0.6, 1.2, 4.4, 3.0], [1, -2, 1, 3, 7], [1, 8, 8, 9, 9]]),
          pooled_shape=[2, 3], spatial_scale=0.9),  # NOTE: the third box is outside the image: zeros
    ]


@pytest.mark.parametrize("case", _forms(), ids=lambda case: case.op)
def test_more_forms_of_new_rules_match_finite_differences(case):
    """Forms the coverage table does not measure (broadcasting, strides, paddings, modes, complex input...): the
    gradient equals finite differences, and the lowered model computes the op's values."""
    import onnx_ir as ir
    from onnx.reference import ReferenceEvaluator
    from test_op_coverage import EXACT, Case, _model, _session, _value, measure

    from onnxopt.modelio import load_model
    from onnxopt.rules import lower_for_gradient

    status = measure(case)
    assert status.split(",")[0] in EXACT
    if "float32" in status:
        case = Case(case.op, case.inputs, case.attrs, case.outputs, case.domain, onnx.TensorProto.FLOAT)
    rng = np.random.default_rng(1)
    feeds = {f"x{i}": _value(v, rng).astype(np.float32 if "float32" in status else np.float64)
             for i, v in enumerate(case.inputs) if isinstance(v, str)}
    model = _model(case, feeds, False)
    lowered = ir.to_proto(lower_for_gradient(load_model(model)))
    # NOTE: against onnx's reference (onnxruntime 1.19's STFT of a complex signal returns garbage, 1e119), or
    # onnxruntime where the reference lacks the op (MaxRoiPool) or is wrong (Unique along an axis, unsorted)
    run = _session(model).run if case.op in ("MaxRoiPool", "Unique") else ReferenceEvaluator(model).run
    for got, expected in zip(_session(lowered).run(None, feeds), run(None, feeds)):
        np.testing.assert_allclose(got, expected, rtol=1e-5 if "float32" in status else 1e-7, atol=1e-6)


def test_grid_sample_with_a_dynamic_batch_matches_finite_differences():
    """The GridSample rewrite leaves the batch size dynamic: one gradient model serves batches of 1 and 3."""
    from onnx import TensorProto

    g = oh.make_graph([oh.make_node("Mul", ["x", "w"], ["xw"]), oh.make_node("GridSample", ["xw", "grid"], ["y"])],
                      "gs", [oh.make_tensor_value_info("x", TensorProto.DOUBLE, ["N", 2, 3, 4]),
                             oh.make_tensor_value_info("grid", TensorProto.DOUBLE, ["N", 2, 3, 2])],
                      [oh.make_tensor_value_info("y", TensorProto.DOUBLE, ["N", 2, 2, 3])],
                      [onh.from_array(np.array([[[[1.5]], [[-0.5]]]]), "w")])
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 20)], ir_version=10)
    fb = onnxopt.ForwardBackward(model)
    forward = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(4)
    for n in (1, 3):
        feeds = {"x": rng.normal(size=(n, 2, 3, 4)), "grid": rng.uniform(-1.2, 1.2, size=(n, 2, 3, 2))}
        cot = rng.normal(size=(n, 2, 2, 3))
        fb.forward(feeds)
        got = fb.backward(cot)
        for name, base in feeds.items():
            expected = np.zeros_like(base)
            for i in np.ndindex(base.shape):
                d = np.zeros_like(base)
                d[i] = 1e-6
                plus, minus = (forward.run(None, {**feeds, name: base + s * d})[0] for s in (1, -1))
                expected[i] = ((plus - minus) * cot).sum() / 2e-6
            np.testing.assert_allclose(got[name], expected, rtol=1e-6, atol=1e-7, err_msg=f"{name}, batch {n}")


@pytest.mark.parametrize("op, direction, attrs, extras", [
    ("GRU", "forward", {"linear_before_reset": 0}, ("B", "h0")),
    ("GRU", "reverse", {"linear_before_reset": 1}, ("B",)),
    ("GRU", "bidirectional", {}, ()),
    ("LSTM", "forward", {}, ("B", "h0", "c0", "P")),
    ("LSTM", "bidirectional", {"activations": ["Sigmoid", "Tanh", "Relu"] * 2}, ("B", "P")),
])
def test_unrolled_recurrent_layers_compute_what_the_kernels_do(op, direction, attrs, extras):
    """Portable steps unroll GRU and LSTM (``decompose(unroll_recurrent=True)``): the ONNX equations, forms
    torch does not export included (linear_before_reset=0, peepholes, reverse, other activations)."""
    from onnx import TensorProto

    import onnx_ir as ir

    from onnxopt.passes.decompose import decompose

    rng = np.random.default_rng(0)
    seq, batch, size, hidden, dirs = 4, 3, 5, 6, 2 if direction == "bidirectional" else 1
    gates = 3 if op == "GRU" else 4
    shapes = {"W": (dirs, gates * hidden, size), "R": (dirs, gates * hidden, hidden), "B": (dirs, 2 * gates * hidden),
              "h0": (dirs, batch, hidden), "c0": (dirs, batch, hidden), "P": (dirs, 3 * hidden)}
    names = ["x", "W", "R", "B" if "B" in extras else "", "", "h0" if "h0" in extras else ""]
    if op == "LSTM":
        names += ["c0" if "c0" in extras else "", "P" if "P" in extras else ""]
    outs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    node = oh.make_node(op, names, outs, hidden_size=hidden, direction=direction, **attrs)
    inits = [onh.from_array((rng.normal(size=shapes[n]) * 0.5).astype(np.float32), n) for n in names[1:] if n]
    graph = oh.make_graph([node], "rnn", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [seq, batch, size])],
                          [oh.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=9)
    unrolled = ir.from_proto(model)
    decompose(unrolled, unroll_recurrent=True)
    unrolled = ir.to_proto(unrolled)
    assert op not in {n.op_type for n in unrolled.graph.node}
    feeds = {"x": rng.normal(size=(seq, batch, size)).astype(np.float32)}
    run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
           for m in (unrolled, model)]
    for got, expected, name in zip(*run, outs):
        assert got.shape == expected.shape, name
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=name)
