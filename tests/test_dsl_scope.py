"""DSL rules written where users write them: inside functions, factories and closures, annotated or not,
used on float32 and float64 models. Each rule's effect is checked against the same formula in NumPy."""

import numpy as np
import onnx_ir as ir
import pytest

import onnxopt
from onnxopt.errors import DslError
from onnxopt.examples import linear_regression

DTYPES = [np.float32, np.float64]


def _data(dtype, n=16):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, 2)).astype(dtype)
    return X, (X @ np.array([1.5, -2.0]) + 0.3).astype(dtype)


def _weights(model):
    inits = ir.from_proto(model).graph.initializers
    return {n: inits[n].const_value.numpy().astype(np.float64) for n in ("coef", "bias")}


def _pred(w, X):
    return X.astype(np.float64) @ w["coef"] + w["bias"]


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)


def make_scaled_loss(scale):
    """A factory: the loss captures ``scale`` (a closure cell) and imports its names locally."""
    from onnxopt.dsl import FLOAT, loss, op

    @loss
    def scaled_square(y: FLOAT, t: FLOAT) -> FLOAT:
        d = op.Sub(y, op.Reshape(t, op.Shape(y)))
        return op.Mul(op.CastLike(scale, d), op.ReduceMean(op.Mul(d, d)))

    return scaled_square


@pytest.mark.parametrize("dtype", DTYPES)
def test_loss_from_a_factory_with_a_closure_and_local_imports(dtype):
    model = linear_regression(2, dtype=dtype)
    X, y = _data(dtype)
    runner = onnxopt.Runner(onnxopt.compile_train_step(model, loss=make_scaled_loss(3.0), learning_rate=1e-3))
    expected = 3.0 * np.mean((_pred(_weights(model), X).ravel() - y) ** 2)
    np.testing.assert_allclose(runner.step(X, y), expected, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_update_rule_and_penalty_defined_in_the_test_using_local_names(dtype):
    from onnxopt import dsl
    from onnxopt.dsl import DOUBLE as REAL  # NOTE: local names, unknown to the module's globals; an annotation
    from onnxopt.dsl import op as o         # alone is no closure cell, so onnxscript could not see REAL

    half = 0.5  # a local constant read by the rule

    @dsl.update_rule(state=["velocity"])
    def damped(w: REAL, g: REAL, lr, velocity, momentum: float = 0.25):
        v = o.Add(o.Mul(o.CastLike(momentum, w), velocity), g)
        return o.Sub(w, o.Mul(o.Mul(o.CastLike(half, w), lr), v)), v

    @dsl.penalty
    def quartic(w):
        return o.ReduceSum(o.Mul(o.Mul(w, w), o.Mul(w, w)), keepdims=0)

    model = linear_regression(2, dtype=dtype)
    X, y = _data(dtype)
    lr = 0.125
    step = onnxopt.compile_train_step(model, loss="square", update=damped, penalty=quartic, learning_rate=lr)
    runner = onnxopt.Runner(step)
    w = _weights(model)
    r = _pred(w, X).ravel() - y
    loss = runner.step(X, y)
    np.testing.assert_allclose(loss, np.mean(r**2) + sum(np.sum(v**4) for v in w.values()), **_tol(dtype))
    grads = {"coef": (2 * X.T.astype(np.float64) @ r / len(y)).reshape(2, 1) + 4 * w["coef"] ** 3,
             "bias": np.array([2 * r.mean()]) + 4 * w["bias"] ** 3}
    got = runner.get_weights()
    for name in ("coef", "bias"):  # velocity starts at 0: v = g, w -= half * lr * g
        np.testing.assert_allclose(got[name], w[name] - half * lr * grads[name], **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_schedule_in_a_function_reads_a_captured_hyper_parameter(dtype):
    from onnxopt.dsl import op, schedule

    def constant_rate(rate):
        @schedule
        def fixed(step):
            return op.CastLike(rate, step)

        return fixed

    model = linear_regression(2, dtype=dtype)
    X, y = _data(dtype)
    # NOTE: 0.0625 is exact in float32: onnxscript stores Python floats read from a scope as float32 constants
    runner = onnxopt.Runner(onnxopt.compile_train_step(model, loss="square", learning_rate=constant_rate(0.0625)))
    w = _weights(model)
    r = _pred(w, X).ravel() - y
    runner.step(X, y)
    np.testing.assert_allclose(runner.get_weights()["bias"], w["bias"] - 0.0625 * 2 * r.mean(), **_tol(dtype))


def test_float_annotated_loss_runs_on_a_float64_model():
    from onnxopt.dsl import FLOAT, loss, op

    @loss
    def mse(y: FLOAT, t: FLOAT) -> FLOAT:
        d = op.Sub(y, op.Reshape(t, op.Shape(y)))
        return op.ReduceMean(op.Mul(d, d))

    model = linear_regression(2, dtype=np.float64)
    X, y = _data(np.float64)
    runner = onnxopt.Runner(onnxopt.compile_train_step(model, loss=mse, learning_rate=1e-3))
    np.testing.assert_allclose(runner.step(X, y), np.mean((_pred(_weights(model), X).ravel() - y) ** 2), rtol=1e-12)


def test_a_name_defined_nowhere_is_reported():
    from onnxopt.dsl import loss, op

    with pytest.raises(DslError, match="not a valid onnxscript function"):
        @loss
        def broken(y, t):
            return op.ReduceMean(op.Mul(op.CastLike(undefined_constant, y), y))  # noqa: F821
