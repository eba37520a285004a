"""ml_rules: ai.onnx.ml LinearRegressor / LinearClassifier lowered to MatMul + Add give the same outputs
as onnxruntime's own kernels (the reference), and their coefficients become trainable initializers."""

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto

import onnxopt
from onnxopt.modelio import load_model
from onnxopt.ml_rules import lower_ml_ops, ml_rules

N_FEATURES = 3


def _session(model):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _model(node, x_type, outputs):
    graph = oh.make_graph([node], "ml", [oh.make_tensor_value_info("X", x_type, ["N", N_FEATURES])], outputs)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid("ai.onnx.ml", 1)],
                         ir_version=9)


def regressor(targets=1, x_type=TensorProto.FLOAT, intercepts=True, seed=0):
    rng = np.random.default_rng(seed)
    attrs = dict(coefficients=rng.normal(size=targets * N_FEATURES).tolist(), targets=targets)
    if intercepts:
        attrs["intercepts"] = rng.normal(size=targets).tolist()
    node = oh.make_node("LinearRegressor", ["X"], ["Y"], domain="ai.onnx.ml", name="linreg", **attrs)
    return _model(node, x_type, [oh.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", targets])])


def classifier(n_scores, labels, post_transform="NONE", x_type=TensorProto.FLOAT, seed=0):
    rng = np.random.default_rng(seed)
    key = "classlabels_strings" if isinstance(labels[0], str) else "classlabels_ints"
    node = oh.make_node("LinearClassifier", ["X"], ["label", "scores"], domain="ai.onnx.ml", name="linclf",
                        coefficients=rng.normal(size=n_scores * N_FEATURES).tolist(),
                        intercepts=rng.normal(size=n_scores).tolist(), post_transform=post_transform,
                        **{key: labels})
    label_type = TensorProto.STRING if key == "classlabels_strings" else TensorProto.INT64
    return _model(node, x_type, [oh.make_tensor_value_info("label", label_type, ["N"]),
                                 oh.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", None])])


def _inputs(x_type, rng):
    X = rng.normal(size=(40, N_FEATURES)) * 2
    X[0] = 0.0  # a zero score for the intercept-only row
    if x_type == TensorProto.DOUBLE:
        return X
    if x_type == TensorProto.INT64:
        return np.round(X).astype(np.int64)
    return X.astype(np.float32)


def _compare(model, x_type, rng):
    lowered = ir.to_proto(load_model(model))
    assert {n.op_type for n in lowered.graph.node}.isdisjoint({"LinearRegressor", "LinearClassifier"})
    X = _inputs(x_type, rng)
    expected, got = _session(model).run(None, {"X": X}), _session(lowered).run(None, {"X": X})
    assert len(got) == len(expected)
    for e, g in zip(expected, got):
        assert e.dtype == g.dtype and e.shape == g.shape
        if e.dtype == object:
            np.testing.assert_array_equal(g, e)
        else:
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    return lowered


@pytest.mark.parametrize("targets", [1, 2])
def test_linear_regressor_lowered_matches_onnxruntime(rng, targets):
    lowered = _compare(regressor(targets), TensorProto.FLOAT, rng)
    weights = onnxopt.train_initializers(lowered)
    assert sorted(weights) == ["linreg_coef", "linreg_intercept"]
    assert weights["linreg_coef"].shape == (N_FEATURES, targets)


@pytest.mark.parametrize("x_type", [TensorProto.DOUBLE, TensorProto.INT64])
def test_linear_regressor_lowered_casts_other_inputs_to_float(rng, x_type):
    """onnxruntime 1.19 has a float kernel only; the reference is the operator's definition in numpy."""
    model = regressor(2, x_type)
    attrs = {a.name: oh.get_attribute_value(a) for a in model.graph.node[0].attribute}
    coef = np.array(attrs["coefficients"], np.float32).reshape(2, N_FEATURES)
    X = _inputs(x_type, rng)
    got = _session(ir.to_proto(load_model(model))).run(None, {"X": X})[0]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, X.astype(np.float32) @ coef.T + np.array(attrs["intercepts"], np.float32),
                               rtol=1e-5, atol=1e-6)


def test_linear_regressor_without_intercepts(rng):
    lowered = _compare(regressor(2, intercepts=False), TensorProto.FLOAT, rng)
    assert sorted(onnxopt.train_initializers(lowered)) == ["linreg_coef"]


@pytest.mark.parametrize("post_transform", ["NONE", "LOGISTIC", "SOFTMAX"])
@pytest.mark.parametrize("labels", [[0, 1], ["no", "yes"]])
def test_linear_classifier_binary_one_score(rng, post_transform, labels):
    """One score, two labels: onnxruntime outputs (1 - s, s), s through the sigmoid with LOGISTIC (since 1.20;
    onnxruntime-training 1.19 ignores LOGISTIC there, the lowering follows the later releases)."""
    import onnxruntime

    if post_transform == "LOGISTIC" and tuple(map(int, onnxruntime.__version__.split(".")[:2])) < (1, 20):
        pytest.skip(f"onnxruntime {onnxruntime.__version__} ignores LOGISTIC for one score")
    _compare(classifier(1, labels, post_transform), TensorProto.FLOAT, rng)


@pytest.mark.parametrize("post_transform", ["NONE", "LOGISTIC", "SOFTMAX"])
@pytest.mark.parametrize("labels", [[3, 7, 9], ["a", "b", "c"]])
@pytest.mark.parametrize("x_type", [TensorProto.FLOAT, TensorProto.DOUBLE])
def test_linear_classifier_multiclass(rng, post_transform, labels, x_type):
    _compare(classifier(3, labels, post_transform, x_type), x_type, rng)


def test_linear_classifier_probit_is_left_alone():
    model = ir.from_proto(classifier(3, [0, 1, 2], "PROBIT"))
    assert ml_rules.apply_to_model(model) == 0
    with pytest.raises(onnxopt.ModelError, match="no float initializer"):
        onnxopt.gradient_model(classifier(3, [0, 1, 2], "PROBIT"))


def test_lowering_keeps_initializer_names_unique():
    model = regressor(1)
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros(1, np.float32), "linreg_coef"))
    m = lower_ml_ops(ir.from_proto(model))
    assert sorted(m.graph.initializers) == ["linreg_coef", "linreg_coef_1", "linreg_intercept"]


def test_lowered_regressor_gradient_is_the_least_squares_gradient(rng):
    model = regressor(1)
    X = rng.normal(size=(10, N_FEATURES)).astype(np.float32)
    G = rng.normal(size=(10, 1)).astype(np.float32)
    lowered = ir.to_proto(load_model(model))
    w = onnxopt.train_initializers(lowered)
    grad = onnxopt.gradient_model(model)  # the ai.onnx.ml model itself: lowered on load
    out = dict(zip([o.name for o in grad.graph.output],
                   _session(grad).run(None, {"X": X, **w, "Y_grad": G})))
    np.testing.assert_allclose(out["linreg_coef_grad"], X.T @ G, rtol=1e-5)
    np.testing.assert_allclose(out["linreg_intercept_grad"], G.sum(0), rtol=1e-5)
