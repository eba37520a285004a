"""gradient_model: ORT-built gradients against central finite differences of the forward model.

The reference never goes through onnxopt: the original model is run with a plain InferenceSession whose
initializers were turned into inputs, and derivatives come from perturbing those inputs.
"""

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

import onnxopt
from helpers import finite_differences
from onnxopt.examples import linear_regression, mlp, polynomial

FLOATS = (TensorProto.FLOAT, TensorProto.DOUBLE)


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


class Forward:
    """The original model with its float initializers as inputs: ``self(feeds, weights)`` -> first output."""

    def __init__(self, model: onnx.ModelProto):
        m = onnx.ModelProto()
        m.CopyFrom(model)
        floats = [t for t in m.graph.initializer if t.data_type in FLOATS]
        self.weights = {t.name: numpy_helper.to_array(t).copy() for t in floats}
        for t in floats:
            m.graph.input.append(oh.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        kept = [t for t in m.graph.initializer if t.data_type not in FLOATS]
        del m.graph.initializer[:]
        m.graph.initializer.extend(kept)
        self.sess = _session(m)

    def __call__(self, feeds, weights=None):
        return self.sess.run(None, {**feeds, **self.weights, **(weights or {})})[0]


def _run_gradient(grad_model, feeds) -> dict[str, np.ndarray]:
    sess = _session(grad_model)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def _check_weight_gradients(model, X, rng, fill_grad=False, rtol=1e-6, atol=1e-8):
    fwd = Forward(model)
    out_name = model.graph.output[0].name
    y = fwd({"X": X})
    G = np.ones_like(y) if fill_grad else rng.normal(size=y.shape).astype(y.dtype)
    grad_model = onnxopt.gradient_model(model, fill_grad=fill_grad)
    input_names = {i.name for i in grad_model.graph.input}
    assert (out_name + "_grad" in input_names) is not fill_grad
    names = [i.name for i in grad_model.graph.input if i.name in fwd.weights]
    assert sorted(names) == sorted(onnxopt.train_initializers(model))
    feeds = {"X": X, **{n: fwd.weights[n] for n in names}}
    if not fill_grad:
        feeds[out_name + "_grad"] = G
    got = _run_gradient(grad_model, feeds)
    expected = finite_differences(lambda w: float((fwd({"X": X}, w) * G).sum()), fwd.weights, names)
    assert sorted(got) == sorted(n + "_grad" for n in names)
    for name, g in expected.items():
        assert np.abs(g).max() > 1e-6, f"{name}: degenerate reference gradient"
        np.testing.assert_allclose(got[name + "_grad"], g, rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("fill_grad", [False, True])
def test_linear_regression_matches_finite_differences(rng, fill_grad):
    model = linear_regression(3, dtype=np.float64, seed=1)
    _check_weight_gradients(model, rng.normal(size=(7, 3)), rng, fill_grad=fill_grad)


def test_mlp_relu_tanh_sigmoid_matches_finite_differences(rng):
    model = mlp([3, 5, 4, 4, 2], activation=["Relu", "Tanh", "Sigmoid"], dtype=np.float64, seed=2)
    assert [n.op_type for n in model.graph.node if n.op_type in ("Relu", "Tanh", "Sigmoid")] == ["Relu", "Tanh", "Sigmoid"]
    _check_weight_gradients(model, rng.normal(size=(6, 3)), rng)


def test_softmax_classifier_matches_finite_differences(rng):
    model = mlp([4, 6, 3], activation="Tanh", dtype=np.float64, seed=3, final="Softmax")
    X = rng.normal(size=(5, 4))
    np.testing.assert_allclose(Forward(model)({"X": X}).sum(axis=1), 1.0, rtol=1e-12)  # really a softmax
    _check_weight_gradients(model, X, rng)


def test_softmax_classifier_float32_matches_float64_reference(rng):
    """The float32 model keeps ORT's float SoftmaxGrad: same gradient as the double model, to float precision."""
    X = rng.normal(size=(5, 4))
    G = rng.normal(size=(5, 3))
    grads = {}
    for dtype in (np.float32, np.float64):
        model = mlp([4, 6, 3], activation="Tanh", dtype=dtype, seed=3, final="Softmax")
        w = Forward(model).weights
        grads[dtype] = _run_gradient(onnxopt.gradient_model(model), {"X": X.astype(dtype), **w, "Y_grad": G.astype(dtype)})
    for name, g in grads[np.float64].items():
        np.testing.assert_allclose(grads[np.float32][name], g, rtol=1e-4, atol=1e-5, err_msg=name)


NOTEBOOK_X = np.array([[0, 0], [1, 0], [0, 1], [1, 1], [2, 2]], dtype=np.float32)
NOTEBOOK_WEIGHTS = {
    "init": np.array([[2, 3]], dtype=np.float32),
    "init_1": np.array([[0.5, 0.33333]], dtype=np.float32),
    "init_b10": np.array([1], dtype=np.float32),
}


def test_polynomial_reproduces_the_seed_notebook():
    model = polynomial()
    fwd = Forward(model)
    label = fwd({"x": NOTEBOOK_X})  # the original weights' prediction
    pred = fwd({"x": NOTEBOOK_X}, NOTEBOOK_WEIGHTS)
    np.testing.assert_allclose(((pred - label) ** 2).sum(), 532.5546, rtol=1e-5)
    got = _run_gradient(onnxopt.gradient_model(model),
                        {"x": NOTEBOOK_X, **NOTEBOOK_WEIGHTS, "y_grad": 2 * (pred - label)})
    np.testing.assert_allclose(got["init_grad"], [[193.33, 186.67]], rtol=1e-3)
    np.testing.assert_allclose(got["init_1_grad"], [[109.33, 102.67]], rtol=1e-3)
    np.testing.assert_allclose(got["init_b10_grad"], [76.67], rtol=1e-3)


def test_polynomial_float64_matches_finite_differences(rng):
    model = polynomial(dtype=np.float64)
    fwd = Forward(model)
    x = rng.normal(size=(6, 2))
    G = rng.normal(size=(6, 1))
    got = _run_gradient(onnxopt.gradient_model(model), {"x": x, **fwd.weights, "y_grad": G})
    expected = finite_differences(lambda w: float((fwd({"x": x}, w) * G).sum()), fwd.weights, list(fwd.weights))
    assert sorted(got) == ["init_1_grad", "init_b10_grad", "init_grad"]
    for name, g in expected.items():
        np.testing.assert_allclose(got[name + "_grad"], g, rtol=1e-6, atol=1e-8, err_msg=name)


def test_input_gradient_matches_finite_differences(rng):
    model = mlp([3, 4, 2], activation="Tanh", dtype=np.float64, seed=4)
    fwd = Forward(model)
    X = rng.normal(size=(5, 3))
    G = rng.normal(size=(5, 2))
    grad_model = onnxopt.gradient_model(model, inputs=["X"])
    got = _run_gradient(grad_model, {"X": X, **fwd.weights, "Y_grad": G})
    assert [o.name for o in grad_model.graph.output][0] == "X_grad"
    expected = finite_differences(lambda f: float((fwd({"X": f["X"]}) * G).sum()), {"X": X}, ["X"])["X"]
    np.testing.assert_allclose(got["X_grad"], expected, rtol=1e-6, atol=1e-8)


def test_keep_outputs_returns_the_forward_prediction(rng):
    model = mlp([3, 4, 2], activation="Sigmoid", dtype=np.float64, seed=5)
    fwd = Forward(model)
    X = rng.normal(size=(5, 3))
    plain = onnxopt.gradient_model(model)
    kept = onnxopt.gradient_model(model, keep_outputs=True)
    assert "Y" not in [o.name for o in plain.graph.output]
    feeds = {"X": X, **fwd.weights, "Y_grad": rng.normal(size=(5, 2))}
    got, ref = _run_gradient(kept, feeds), _run_gradient(plain, feeds)
    np.testing.assert_allclose(got["Y"], fwd({"X": X}), rtol=1e-12)
    for name, g in ref.items():
        np.testing.assert_allclose(got[name], g, rtol=1e-12)


def test_train_initializers_excludes_int_and_shape_constants():
    model = polynomial()
    ints = sorted(t.name for t in model.graph.initializer if t.data_type == TensorProto.INT64)
    assert ints == ["init_2", "init_3", "init_5", "init_b11"]
    weights = onnxopt.train_initializers(model)
    assert sorted(weights) == ["init", "init_1", "init_b10"]
    np.testing.assert_array_equal(weights["init_b10"], np.array([-1.0], np.float32))


def test_float_shape_constant_is_not_a_weight():
    """A float initializer used only as Clip bounds or Resize scales is a constant, one used in Mul a weight."""
    nodes = [oh.make_node("Mul", ["X", "w"], ["h"]), oh.make_node("Clip", ["h", "lo", "hi"], ["Y"])]
    graph = oh.make_graph(
        nodes, "g", [oh.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
        [oh.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 2])],
        [numpy_helper.from_array(np.array([2.0, 3.0], np.float32), "w"),
         numpy_helper.from_array(np.array(-1.0, np.float32), "lo"),
         numpy_helper.from_array(np.array(1.0, np.float32), "hi")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=10)
    assert sorted(onnxopt.train_initializers(model)) == ["w"]


def test_unknown_weight_name_suggests_close_names():
    with pytest.raises(onnxopt.ModelError, match="did you mean") as info:
        onnxopt.gradient_model(linear_regression(3), weights=["coeff"])
    assert "'coef'" in str(info.value) and "'coeff'" in str(info.value)


def test_non_float_weight_is_refused():
    with pytest.raises(onnxopt.ModelError, match="not a float initializer") as info:
        onnxopt.gradient_model(polynomial(), weights=["init", "init_2"])
    assert "init_2" in str(info.value)


def test_explicit_weights_subset(rng):
    model = linear_regression(3, dtype=np.float64)
    grad_model = onnxopt.gradient_model(model, weights=["coef"])
    assert [o.name for o in grad_model.graph.output] == ["coef_grad"]
    assert "bias" not in [i.name for i in grad_model.graph.input]  # stays a constant initializer
    fwd = Forward(model)
    X, G = rng.normal(size=(4, 3)), rng.normal(size=(4, 1))
    sess = _session(grad_model)
    got = sess.run(None, {"X": X, "coef": fwd.weights["coef"], "Y_grad": G})[0]
    np.testing.assert_allclose(got, X.T @ G, rtol=1e-12)


def _not_differentiable_model() -> onnx.ModelProto:
    nodes = [
        oh.make_node("MatMul", ["X", "W"], ["h"], name="dense"),
        # NOTE: CenterCropPad to a size known only at run time (onnxopt rewrites it for constant sizes only)
        oh.make_node("Shape", ["h"], ["hs"], name="shape"),
        oh.make_node("CenterCropPad", ["h", "hs"], ["e"], name="crop_a"),
        oh.make_node("CenterCropPad", ["e", "hs"], ["s"], name="crop_b"),
        oh.make_node("Tanh", ["s"], ["t"], name="act_tanh"),
        oh.make_node("ReduceProd", ["t", "axes"], ["Y"], name="pool_prod", keepdims=1),
    ]
    graph = oh.make_graph(
        nodes, "nd", [oh.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])],
        [oh.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 3])],
        [numpy_helper.from_array(np.arange(9, dtype=np.float32).reshape(3, 3) / 10, "W"),
         # NOTE: ReduceProd over the batch axis, whose length is not static: onnxopt rewrites it only over
         # static axes
         numpy_helper.from_array(np.array([0], np.int64), "axes")])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=10)


def test_not_differentiable_error_lists_every_node_at_once():
    model = _not_differentiable_model()
    _session(model).run(None, {"X": np.ones((2, 3), np.float32)})  # the model itself is valid
    with pytest.raises(onnxopt.NotDifferentiableError) as info:
        onnxopt.gradient_model(model)
    err = info.value
    assert isinstance(err, onnxopt.ModelError)
    assert sorted(err.nodes) == [("CenterCropPad", "crop_a"), ("CenterCropPad", "crop_b"), ("ReduceProd", "pool_prod")]
    for op_type, name in err.nodes:
        assert op_type in str(err) and name in str(err)
    assert "Tanh" not in str(err) and "dense" not in str(err)


def test_not_differentiable_error_from_compile_train_step():
    with pytest.raises(onnxopt.NotDifferentiableError) as info:
        onnxopt.compile_train_step(_not_differentiable_model(), loss="square")
    assert sorted(info.value.nodes) == [("CenterCropPad", "crop_a"), ("CenterCropPad", "crop_b"), ("ReduceProd", "pool_prod")]


def test_float64_concat_matches_finite_differences(rng):
    """Concat's ORT gradient (SplitTraining) has no double kernel: the rewritten graph must still be exact."""
    nodes = [
        oh.make_node("MatMul", ["X", "W"], ["h"]),
        oh.make_node("Sigmoid", ["h"], ["p"]),
        oh.make_node("Sub", ["one", "p"], ["q"]),
        oh.make_node("Concat", ["q", "h", "p"], ["Y"], axis=-1),
    ]
    graph = oh.make_graph(
        nodes, "cat", [oh.make_tensor_value_info("X", TensorProto.DOUBLE, ["N", 3])],
        [oh.make_tensor_value_info("Y", TensorProto.DOUBLE, ["N", 6])],
        [numpy_helper.from_array(rng.normal(size=(3, 2)), "W"),
         numpy_helper.from_array(np.array([1.0]), "one")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=10)
    assert sorted(onnxopt.train_initializers(model)) == ["W"]
    _check_weight_gradients(model, rng.normal(size=(6, 3)), rng)


@pytest.mark.parametrize("rows, n, scatters", [((0, 1, 3), 4, 1), ((0, 2, 0), 4, 1), ((-1, 0, 2), 4, 1), ((1,), 4, 1),
                                               ((2, 1, 0), 3, 0), ((0, 1, 2), 4, 0)])
def test_gathered_rows_gradient_is_one_scatter(rng, rows, n, scatters):
    """Rows of one weight gathered by scalar indices (an exporter's unpacking of packed q, k, v): their
    gradients are written by one ScatterND, not one per row and a Sum, and rows 0..k-1 (torch's q, k, v, in
    any order) by a Concat; exact for distinct, repeated and negative indices, and a row no Gather reads gets
    none."""
    nodes, parts = [], []
    for k, i in enumerate(rows):
        nodes += [oh.make_node("Constant", [], [f"i{k}"], value=numpy_helper.from_array(np.array(i, np.int64))),
                  oh.make_node("Gather", ["W", f"i{k}"], [f"r{k}"], axis=0),
                  oh.make_node("Mul", ["X", f"r{k}"], [f"p{k}"])]
        parts.append(f"p{k}")
    nodes.append(oh.make_node("Concat", parts, ["Y"], axis=1))
    graph = oh.make_graph(
        nodes, "rows", [oh.make_tensor_value_info("X", TensorProto.DOUBLE, ["N", 3])],
        [oh.make_tensor_value_info("Y", TensorProto.DOUBLE, ["N", 3 * len(rows)])],
        [numpy_helper.from_array(rng.normal(size=(n, 3)), "W")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=10)
    fwd = Forward(model)
    X = rng.normal(size=(5, 3))
    G = rng.normal(size=fwd({"X": X}).shape)
    grad_model = onnxopt.gradient_model(model, gradient="onnxopt")
    assert [n.op_type for n in grad_model.graph.node].count("ScatterND") == scatters
    got = _run_gradient(grad_model, {"X": X, "W": fwd.weights["W"], "Y_grad": G})["W_grad"]
    expected = finite_differences(lambda w: float((fwd({"X": X}, w) * G).sum()), fwd.weights, ["W"])["W"]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-8)
    untouched = sorted(set(range(n)) - {i % n for i in rows})
    assert not got[untouched].any()


def test_missing_gradient_kernel_names_the_forward_node():
    """A linear Resize of unknown spatial size is not rewritten (its interpolation matrix needs the size), and
    onnxruntime-training has no CPU ResizeGrad: the Runner's error names the Resize node, not ORT's grad node."""
    nodes = [oh.make_node("Conv", ["X", "W"], ["c"], name="conv"),
             oh.make_node("Resize", ["c", "", "scales"], ["r"], name="up", mode="linear"),
             oh.make_node("ReduceMean", ["r", "axes"], ["Y"], keepdims=0, name="pool")]
    graph = oh.make_graph(
        nodes, "up", [oh.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 1, "H", "W"])],
        [oh.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 2])],
        [numpy_helper.from_array(np.ones((2, 1, 3, 3), np.float32), "W"),
         numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
         numpy_helper.from_array(np.array([2, 3], np.int64), "axes")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=10)
    # NOTE: onnxopt's rules refuse it at compile time, naming the node; the builder's step at the Runner
    with pytest.raises(onnxopt.NotDifferentiableError) as info:
        onnxopt.compile_train_step(model, loss="square", gradient="onnxopt")
    assert info.value.nodes == [("Resize", "up")] and "'up'" in str(info.value) and "['c']" in str(info.value)
    if not onnxopt.gradient.has_training_build():
        return
    step = onnxopt.compile_train_step(model, loss="square", gradient="builder")
    with pytest.raises(onnxopt.NotDifferentiableError) as info:
        onnxopt.Runner(step)
    assert info.value.nodes == [("Resize", "up")]
    assert "ResizeGrad" in str(info.value) and "'up'" in str(info.value)


def test_gradient_sources_train_the_same_and_bad_names_are_refused(rng, tmp_path, monkeypatch):
    """gradient= picks the backward graph's source on compile_train_step, Trainer and the CLI; onnxopt's rules
    and (where installed) the builder give the same steps; $ONNXOPT_GRADIENT sets the default."""
    from onnxopt.cli import main
    from onnxopt.gradient import gradient_source, has_training_build

    model = mlp([4, 6, 3])
    X, y = rng.normal(size=(16, 4)).astype(np.float32), rng.integers(0, 3, 16)
    kwargs = dict(loss="cross_entropy", update="adam", learning_rate=0.01)
    sources = ["onnxopt", "builder"] if has_training_build() else ["onnxopt"]
    losses = {}
    for source in sources:
        runner = onnxopt.Runner(onnxopt.compile_train_step(model, gradient=source, **kwargs))
        losses[source] = [runner.step(X[i:i + 8], y[i:i + 8]) for i in (0, 8, 0, 8)]
        est = onnxopt.Trainer(model, gradient=source, batch_size=8, max_iter=2, shuffle=False, tol=None, **kwargs)
        assert est.fit(X, y).train_step_ is not None and est.get_params()["gradient"] == source
    for source in sources[1:]:
        np.testing.assert_allclose(losses[source], losses["onnxopt"], rtol=1e-5)
    assert gradient_source(None) == "onnxopt"
    monkeypatch.setenv("ONNXOPT_GRADIENT", sources[-1])
    assert gradient_source("auto") == sources[-1]
    with pytest.raises(ValueError, match=r"gradient: expected one of \['onnxopt', 'builder'\] or 'auto', got 'tape'"):
        onnxopt.compile_train_step(model, gradient="tape")
    onnx.save(model, tmp_path / "m.onnx")
    assert main(["compile", str(tmp_path / "m.onnx"), "--gradient", "onnxopt", "-o", str(tmp_path / "s.onnx")]) == 0
    assert {n.domain for n in onnx.load(tmp_path / "s.onnx").graph.node} <= {"", "ai.onnx"} or has_training_build()


def _dims(value: onnx.ValueInfoProto) -> list:
    return [d.dim_value or None for d in value.type.tensor_type.shape.dim]


@pytest.mark.parametrize("source", ["onnxopt", "builder"])
def test_gradient_inputs_and_outputs_declare_every_static_dim_of_the_model(rng, source):
    """onnxcustom's test_grad_helper fed ``Y_grad`` a random input of its declared shape, 1 for a free dim."""
    if source == "builder" and not onnxopt.gradient.has_training_build():
        pytest.skip("needs onnxruntime-training (Python <= 3.12)")
    add = oh.make_model(oh.make_graph(  # NOTE: skl2onnx's OnnxAdd('X', [1.0]) of test_grad_helper
        [oh.make_node("Add", ["X", "one"], ["Y"])], "add",
        [oh.make_tensor_value_info("X", TensorProto.FLOAT, [None, 10])],
        [oh.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 10])],
        [numpy_helper.from_array(np.ones(1, np.float32), "one")]), opset_imports=[oh.make_opsetid("", 18)])
    for model in [add, mlp([3, 4, 2], activation="Tanh", seed=4)]:
        declared = {v.name: _dims(v) for v in [*model.graph.input, *model.graph.output]}
        declared.update({t.name: list(t.dims) for t in model.graph.initializer})
        grad = onnxopt.gradient_model(model, inputs=["X"], keep_outputs=True, gradient=source)
        for value in [*grad.graph.input, *grad.graph.output]:
            want = declared[value.name.removesuffix("_grad")]
            got = _dims(value)
            assert len(got) == len(want) and all(w is None or g == w for g, w in zip(got, want)), \
                (model.graph.name, value.name, got, want)
        feeds = {v.name: rng.normal(size=[d or 1 for d in _dims(v)]).astype(np.float32) for v in grad.graph.input}
        feeds["X"] = rng.normal(size=[7, *_dims(grad.graph.input[0])[1:]]).astype(np.float32)
        feeds[f"{model.graph.output[0].name}_grad"] = rng.normal(size=[7, *_dims(model.graph.output[0])[1:]]
                                                                  ).astype(np.float32)
        _run_gradient(grad, feeds)
