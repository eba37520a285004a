"""Models converted by skl2onnx (float32 and float64) train as scikit-learn defines them.

References are scikit-learn's: the first loss is ``log_loss`` / ``mean_squared_error`` of the estimator's own
predictions, the gradient is a central finite difference (float64) of that loss in the estimator's
coefficients, and the trained weights are exactly ``coefs_``/``intercepts_`` or ``coef_``/``intercept_``.
The estimators are fitted briefly (or strongly regularized) so that onnxopt's training has room to improve.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import onnx.numpy_helper
import pytest
from sklearn.datasets import make_classification, make_regression
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression, Ridge, SGDRegressor
from sklearn.metrics import log_loss, mean_squared_error
from sklearn.neural_network import MLPClassifier, MLPRegressor
from skl2onnx import to_onnx

import onnxopt
from onnxopt import dsl
from zoo.common import (assert_gradients, assert_one_to_one, assert_same_outputs, central_differences, first_step,
                         locate, predict)

OPSET = 18  # NOTE: skl2onnx's default opset is newer than onnxruntime 1.19 loads
N_TRAIN = 200


def _mlp_classifier():
    return MLPClassifier(hidden_layer_sizes=(8,), max_iter=5, random_state=0)


def _mlp_regressor():
    return MLPRegressor(hidden_layer_sizes=(8,), max_iter=5, random_state=0)


CASES = {  # name: (estimator factory, classifier, converter options, learning rate)
    "mlp_classifier": (_mlp_classifier, True, None, 0.1),
    "mlp_classifier_nozipmap": (_mlp_classifier, True, {"zipmap": False}, 0.1),
    "logistic_regression": (lambda: LogisticRegression(C=0.01), True, None, 0.1),
    "logistic_regression_nozipmap": (lambda: LogisticRegression(C=0.01), True, {"zipmap": False}, 0.1),
    "sgd_regressor": (lambda: SGDRegressor(max_iter=2, tol=None, random_state=0), False, None, 0.05),
    "ridge": (lambda: Ridge(alpha=300.0), False, None, 0.05),
    "mlp_regressor": (_mlp_regressor, False, None, 0.05),
}
LOSS = dsl.losses.cross_entropy(from_logits=False)  # NOTE: skl2onnx classifiers output probabilities


@functools.cache
def data(classifier: bool):
    if classifier:
        X, y = make_classification(300, 6, n_informative=4, n_classes=3, random_state=0)
    else:
        X, y = make_regression(300, 6, noise=5.0, random_state=0)
        y = y / y.std()
    return X, y


@functools.cache
def fitted(name: str):
    factory, classifier, _, _ = CASES[name]
    X, y = data(classifier)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return factory().fit(X[:N_TRAIN], y[:N_TRAIN])


def converted(name: str, dtype) -> onnx.ModelProto:
    _, classifier, options, _ = CASES[name]
    return to_onnx(fitted(name), data(classifier)[0][:1].astype(dtype), target_opset=OPSET, options=options)


def sk_loss(name: str, est, X, y) -> float:
    if CASES[name][1]:
        return log_loss(y, est.predict_proba(X), labels=est.classes_)
    return mean_squared_error(y, est.predict(X))


def sk_params(est) -> dict[str, np.ndarray]:
    """The estimator's trainable coefficients, by attribute name."""
    if hasattr(est, "coefs_"):
        return {**{f"coefs_[{i}]": c for i, c in enumerate(est.coefs_)},
                **{f"intercepts_[{i}]": b for i, b in enumerate(est.intercepts_)}}
    return {"coef_": np.asarray(est.coef_), "intercept_": np.atleast_1d(est.intercept_)}


def sk_assign(est, flat: np.ndarray) -> None:
    """Writes the concatenated coefficients ``flat`` (``sk_params`` order) into ``est``."""
    params, start = sk_params(est), 0
    values = {}
    for pname, p in params.items():
        values[pname] = flat[start:start + p.size].reshape(p.shape)
        start += p.size
    if hasattr(est, "coefs_"):
        est.coefs_ = [values[f"coefs_[{i}]"] for i in range(len(est.coefs_))]
        est.intercepts_ = [values[f"intercepts_[{i}]"] for i in range(len(est.intercepts_))]
    else:
        est.coef_ = values["coef_"]
        est.intercept_ = values["intercept_"] if np.ndim(est.intercept_) else values["intercept_"][0]


def _output(model: onnx.ModelProto) -> str:
    return model.graph.output[-1].name  # NOTE: probabilities (ZipMap or tensor) or the regression


def _loss(name: str):
    return LOSS if CASES[name][1] else "square"


@functools.cache
def _first(name: str, dtype):
    """(onnxopt loss, gradients, weight locations, scikit-learn loss) on the first 32 training rows."""
    model = converted(name, dtype)
    X, y = data(CASES[name][1])
    Xb, yb = X[:32].astype(dtype), y[:32] if CASES[name][1] else y[:32].astype(dtype)
    loss, grads, weights = first_step(model, "eval", Xb, yb, loss=_loss(name), output=_output(model))
    initial = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name in weights}
    if not initial:  # NOTE: coefficients held in attributes (float32 LinearRegressor/Classifier) are lowered
        initial = onnxopt.train_initializers(model)
    where = locate(sk_params(fitted(name)), {n: initial[n] for n in weights})
    return loss, grads, where, sk_loss(name, fitted(name), X[:32], y[:32])


@pytest.fixture(params=list(CASES))
def case(request):
    return request.param


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_first_loss_equals_sklearn(case, dtype):
    loss, _, _, ref = _first(case, dtype)
    np.testing.assert_allclose(loss, ref, rtol=1e-5 if dtype == np.float32 else 1e-10)


def test_gradient_equals_finite_differences(case):
    """float64: the step's gradient against central differences of scikit-learn's loss."""
    _, grads, where, _ = _first(case, np.float64)
    est = fitted(case)
    X, y = data(CASES[case][1])
    flat = np.concatenate([p.ravel() for p in sk_params(est).values()]).astype(np.float64)
    fd = central_differences(flat, lambda v: sk_assign(est, v), lambda: sk_loss(case, est, X[:32], y[:32]))
    assert_gradients(grads, fd, where, rtol=1e-5, atol=1e-8 * np.abs(fd).max())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_only_coefficients_are_trained(case, dtype):
    _, _, where, _ = _first(case, dtype)
    assert_one_to_one(where, sk_params(fitted(case)))


@functools.cache
def _trained(name: str, dtype):
    model = converted(name, dtype)
    X, y = data(CASES[name][1])
    y = y[:N_TRAIN] if CASES[name][1] else y[:N_TRAIN].astype(dtype)
    est = onnxopt.Trainer(model, loss=_loss(name), output=_output(model), learning_rate=CASES[name][3],
                          batch_size=32, max_iter=8, random_state=0)
    return est.fit(X[:N_TRAIN].astype(dtype), y), model


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_training_lowers_the_loss(case, dtype):
    est, _ = _trained(case, dtype)
    assert est.train_losses_[-1] < 0.95 * est.train_losses_[0], est.train_losses_


# NOTE: skl2onnx's float64 classifiers with ZipMap do not load in onnxruntime (ZipMap takes float only)
RUNNABLE = [(name, dtype) for name in CASES for dtype in (np.float32, np.float64)
            if dtype == np.float32 or not CASES[name][1] or (CASES[name][2] or {}).get("zipmap") is False]


@pytest.mark.parametrize(("case", "dtype"), RUNNABLE, ids=lambda v: getattr(v, "__name__", v))
def test_exported_model_predicts_better(case, dtype):
    """The trained model, run by a plain InferenceSession, beats the estimator on held-out rows."""
    est, model = _trained(case, dtype)
    classifier = CASES[case][1]
    X, y = data(classifier)
    X, y = X[N_TRAIN:].astype(dtype), y[N_TRAIN:]
    assert_same_outputs(model, est.trained_model_)
    output = len(model.graph.output) - 1
    before, after = (predict(m, X, output) for m in (model, est.trained_model_))
    if classifier:
        held_out = [log_loss(y, p, labels=fitted(case).classes_) for p in (before, after)]
    else:
        held_out = [mean_squared_error(y, p.ravel()) for p in (before, after)]
    np.testing.assert_allclose(before if classifier else before.ravel(),
                               fitted(case).predict_proba(X) if classifier else fitted(case).predict(X),
                               rtol=1e-4, atol=1e-5)  # NOTE: the converted model is the estimator
    assert held_out[1] < 0.95 * held_out[0], held_out
