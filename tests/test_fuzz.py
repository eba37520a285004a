"""Fuzz tests (hypothesis): random shapes, dtypes and values fed to ``Runner.step`` and ``Trainer.fit``.

Every outcome must be a correct result or an onnxopt error. A result is checked against a NumPy float64
SGD step of the square loss on ``examples.linear_regression(3)`` (``Y = X @ coef + bias``), with a
tolerance scaled by the magnitudes each step adds up; an error must be the one the input calls for
(``DataError`` for data the step cannot take, ``ConvergenceError`` for a NaN or infinite loss) and leave the
weights and the step count as they were (or at the weights that gave the last finite loss).
"""

from __future__ import annotations

import functools
import os
import re
import warnings

import numpy as np
import onnx_ir as ir
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import onnxopt
from onnxopt.errors import ConvergenceError, DataError, OnnxoptError
from onnxopt.examples import linear_regression

N_FEATURES, LR = 3, 0.05
SPECIAL = [np.nan, np.inf, -np.inf, 1e300, -1e300, 1e154, 1e10, 65504.0, 1e-154, 1e-300, 5e-324, -0.0]
VALID_KINDS = ["float64"] * 6 + ["float32", "float16", "int8", "int32", "int64", "bool", "object", "list"]
BAD_KINDS = ["complex", "str", "ragged", "bigint", "pyint", "none"]  # NOTE: "none" holds None: NaN, refused by fit
FAULTS = ["n", "x_shape", "x_kind", "x_special", "y_shape", "y_kind", "y_special", "y_none", "w_shape", "w_kind",
          "w_values"]
RTOL = {np.float64: 1e-10, np.float32: 1e-5}
SAFE = {np.float64: 1e300, np.float32: 1e35}  # NOTE: above this, rounding order decides between overflow or not
FLOOR = {np.float64: 1e-290, np.float32: 1e-30}  # NOTE: absolute noise of results that underflow
TINY = {np.float64: 2.3e-308, np.float32: 1.2e-38}  # NOTE: what one underflowing operation may lose
# NOTE: derandomized (the same examples every run, no example database written): 300 and 150 examples keep the
# suite's time; ONNXOPT_FUZZ_EXAMPLES=N draws N for the Runner (N/2 for the Trainer) to explore
_EXAMPLES = int(os.environ.get("ONNXOPT_FUZZ_EXAMPLES", 300))
RUNNER_FUZZ = settings(max_examples=_EXAMPLES, deadline=None, derandomize=True, database=None,
                       suppress_health_check=[HealthCheck.too_slow])
TRAINER_FUZZ = settings(RUNNER_FUZZ, max_examples=max(1, _EXAMPLES // 2))
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e300 to float32


@functools.cache
def _runner(dtype) -> onnxopt.Runner:
    """One compiled step and Runner per dtype for the whole module; examples reset its weights."""
    step = onnxopt.compile_train_step(linear_regression(N_FEATURES, dtype=dtype), loss="square", update="sgd",
                                      learning_rate=LR)
    return onnxopt.Runner(step)


# -- inputs: what the user passes, and what the step must see (None: the input must be refused) ---------------
def _encode(a: np.ndarray, kind: str, dtype) -> tuple[object, np.ndarray | None]:
    """``a`` (float64) turned into ``kind``; returns (value passed, array the model must compute with or None)."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind.startswith("float"):
            v = a.astype(kind)
            return v, v.astype(dtype)  # NOTE: float data of another precision is cast, as scikit-learn does
        if kind.startswith("int") or kind == "bool":
            v = (a != 0) if kind == "bool" else np.where(np.isfinite(a), np.clip(np.round(a), -100, 100), 7).astype(kind)
            return v, v.astype(dtype)  # NOTE: small integers survive the cast exactly
        if kind in ("complex", "str"):
            return a.astype(kind), None
        if kind == "object":
            return a.astype(object), a.astype(dtype)
        if kind == "list":
            v = a.tolist()
            return v, np.asarray(v, np.float64).astype(dtype)  # NOTE: a list of shape (0, k) reads as (0,)
        if kind == "ragged":
            return [a.tolist(), 1.0, [1.0, 2.0]], None
        big = {"bigint": 10**400, "pyint": 2**53 + 1, "none": None}[kind]  # NOTE: no float, a lossy one, NaN
        v = a.astype(object)
        if not v.size:
            return v, a.astype(dtype)
        v.flat[0] = big
        if kind == "bigint":
            return v.tolist(), None
        if kind == "pyint":  # NOTE: as an object array: np.asarray([2**53 + 1, 0.0]) already rounds to float64
            return v, None
        expected = a.astype(dtype)
        expected.flat[0] = np.nan
        return v, expected


def _specials(draw, a: np.ndarray, count: int) -> np.ndarray:
    """``a`` with ``count`` values replaced by NaN, inf, huge, tiny or subnormal ones."""
    for _ in range(count if a.size else 0):
        a.flat[draw(st.integers(0, a.size - 1))] = draw(st.sampled_from(SPECIAL))
    return a


@st.composite
def batches(draw):
    """(dtype, (X, y, sample_weight) as passed, their expected arrays (None: refused)).

    Each example breaks 0 to 2 things of a valid batch (``FAULTS``), so that about half of them run the
    step; the oracle reads the arrays, not these labels.
    """
    count = draw(st.sampled_from([0, 0, 0, 1, 1, 2]))
    broken = set(draw(st.lists(st.sampled_from(FAULTS), min_size=count, max_size=count, unique=True)))
    dtype = draw(st.sampled_from([np.float64, np.float64, np.float32]))
    n = 0 if "n" in broken else draw(st.integers(1, 20))
    kind = {part: draw(st.sampled_from(BAD_KINDS if part + "_kind" in broken else VALID_KINDS)) for part in "xyw"}
    x_shape = draw(st.sampled_from([(), (n,), (n, 1), (n, 2), (n, 4), (n, 5), (n, 3, 1), (n, 3, 2)]
                                   if "x_shape" in broken else [(n, N_FEATURES)]))
    y_shape = draw(st.sampled_from([(n + 1,), (max(n - 1, 0),), (n + 5, 1), (n, 2), (1, n), (), (n, 1, 1)]
                                   if "y_shape" in broken else [(n,), (n,), (n, 1)]))
    x, y = (_specials(draw, draw(hnp.arrays(np.float64, shape, elements=st.floats(-10, 10))),
                      draw(st.integers(1, 2)) if part + "_special" in broken else 0)
            for part, shape in (("x", x_shape), ("y", y_shape)))
    X, x_ref = _encode(x, kind["x"], dtype)
    y, y_ref = _encode(y, kind["y"], dtype)
    if "y_none" in broken:
        y, y_ref = None, None
    sw, sw_ref = None, np.ones(n, dtype)
    if draw(st.booleans()) or broken & {"w_kind", "w_shape", "w_values"}:
        w_shape = draw(st.sampled_from([(n + 1,), (max(n - 1, 0),), (1,), (n, 1), ()] if "w_shape" in broken else [(n,)]))
        w = draw(hnp.arrays(np.float64, w_shape, elements=st.one_of(st.floats(0, 5), st.sampled_from([0.0, 1e-300]))))
        if "w_values" in broken and w.size:
            w.flat[draw(st.integers(0, w.size - 1))] = draw(st.sampled_from([-1.0, -1e-300, np.nan, np.inf, 1e300]))
        sw, sw_ref = _encode(w, kind["w"], dtype)
    return dtype, (X, y, sw), (x_ref, y_ref, sw_ref)


def _batch_is_valid(x, y, sw) -> bool:
    """The Runner contract: X (n, 3) with n >= 1; y with n rows of one value; sample_weight (n,)."""
    if x is None or y is None or sw is None or x.ndim != 2 or x.shape[1] != N_FEATURES or x.shape[0] == 0:
        return False
    n = x.shape[0]
    return y.ndim >= 1 and y.shape[0] == n and y.size == n and sw.shape == (n,)


# -- the NumPy reference -----------------------------------------------------------------------------------
def _reference(w: dict, X: np.ndarray, y: np.ndarray, s: np.ndarray, dtype):
    """Loss, new weights and per-value tolerances of one SGD step of Σ s·(X@coef + bias - y)² / Σ s, in float64.

    Weights are normalised first (q = s / Σs, as onnxruntime's gradient does), so that nothing overflows or
    underflows in one and not in the other far from the float limits. Tolerances bound the rounding:
    RTOL times the sum of the magnitudes each value adds up, more when Σs cancels (negative weights), plus
    TINY times how much an underflow in any product can move the result.
    """
    X, y, s = (np.asarray(v, np.float64) for v in (X, y, s))
    coef, bias = w["coef"].astype(np.float64)[:, 0], w["bias"].astype(np.float64)
    with np.errstate(all="ignore"):
        d = X @ coef + bias[0] - y.reshape(-1)
        total = s.sum()
        q = s * (1 / total)
        loss = (q * (d * d)).sum()
        g = 2 * q * d
        new = {"coef": (coef - LR * (X.T @ g))[:, None], "bias": bias - LR * g.sum()}
        size = np.abs(X) @ np.abs(coef) + abs(bias[0]) + np.abs(y.reshape(-1))  # bounds |d| and its rounding
        cond = np.abs(s).sum() / abs(total)
        qa = np.abs(q) * cond
        scale = {"loss": cond * (np.abs(q) * size**2).sum(), "d²": size**2,  # NOTE: d² alone must not overflow
                 "coef": (np.abs(coef) + LR * np.abs(X.T) @ (2 * qa * size))[:, None],
                 "bias": abs(bias) + LR * (2 * qa * size).sum()}
        n, xa, tiny = len(s), np.abs(X), 8 * TINY[dtype]
        under = {"loss": tiny * (n / abs(total) + (size**2 + 2 * np.abs(q) * size + 1).sum()),
                 "coef": tiny * (1 + LR * xa.T @ (1 + 2 * size + 2 * np.abs(q) * (1 + xa.sum(axis=1))))[:, None],
                 "bias": tiny * (1 + LR * (1 + 2 * size + 8 * np.abs(q)).sum())}
    tol = {k: RTOL[dtype] * scale[k] + under[k] + FLOOR[dtype] for k in under}
    # NOTE: "safe": the outcome does not hang on rounding. A NaN or inf input always gives a NaN or inf loss;
    # finite ones are safe while every magnitude stays far from the float limit
    finite = all(np.isfinite(v).all() for v in (X, y, s, coef, bias))
    safe = not finite or all(np.all(v < SAFE[dtype]) for v in scale.values())
    return loss, new, tol, safe


def _close(got, ref, tol) -> bool:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    with np.errstate(invalid="ignore"):
        return bool(np.all((np.abs(got - ref) <= tol) | (got == ref) | np.isinf(tol)))


def _weights(draw) -> dict[str, np.ndarray]:
    """Initial weights: small, with now and then a zero, a huge or a tiny one."""
    w = {"coef": draw(hnp.arrays(np.float64, (N_FEATURES, 1), elements=st.floats(-2, 2))),
         "bias": draw(hnp.arrays(np.float64, (1,), elements=st.floats(-2, 2)))}
    if draw(st.integers(0, 3)) == 0:
        w[draw(st.sampled_from(["coef", "bias"]))].flat[0] = draw(st.sampled_from([0.0, 1e154, -1e10, 1e-300, 1.5]))
    return w


def _same_weights(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)


# -- Runner.step ---------------------------------------------------------------------------------------------
@RUNNER_FUZZ
@given(data=st.data())
def test_runner_step_gives_the_numpy_result_or_an_onnxopt_error(data):
    dtype, (X, y, sw), (x_ref, y_ref, sw_ref) = data.draw(batches())
    runner = _runner(dtype)
    runner.set_weights(_weights(data.draw))
    before, count = runner.get_weights(), runner.step_count
    try:
        loss = runner.step(X, y, sample_weight=sw)
    except OnnxoptError as exc:
        error = exc
    else:
        error = None
    event(type(error).__name__ if error is not None else "result")
    if not _batch_is_valid(x_ref, y_ref, sw_ref):
        assert isinstance(error, DataError), f"expected a DataError, got {error!r}"
        assert re.match(r"(X|y|sample_weight|batch): ", str(error)), str(error)
        assert _same_weights(runner.get_weights(), before) and runner.step_count == count
        return
    ref_loss, ref_new, tol, safe = _reference(before, x_ref, y_ref, sw_ref, dtype)
    if (safe and not np.isfinite(ref_loss)) or error is not None:  # NOTE: unsafe: overflow may go either way
        assert isinstance(error, ConvergenceError), f"loss {ref_loss}: expected a ConvergenceError, got {error!r}"
        assert _same_weights(runner.get_weights(), before) and runner.step_count == count
        return
    assert isinstance(loss, float) and np.isfinite(loss) and runner.step_count == count + 1
    after = runner.get_weights()
    # NOTE: unsafe: only the values whose magnitudes stay far from the limit are compared
    limit = {k: v if safe else np.where(np.isfinite(v) & (v < RTOL[dtype] * SAFE[dtype]), v, np.inf) for k, v in tol.items()}
    assert _close(loss, ref_loss, limit["loss"]), (loss, ref_loss)
    for name, value in after.items():
        assert value.dtype == dtype and _close(value, ref_new[name], limit[name]), (name, value, ref_new[name])
    if not all(np.isfinite(v).all() for v in after.values()):
        # NOTE: a finite loss whose update overflowed: the next step must fail and restore the weights
        with pytest.raises(ConvergenceError):
            runner.step(np.ones((2, N_FEATURES)), np.ones(2))
        assert _same_weights(runner.get_weights(), before)


# -- Trainer.fit ---------------------------------------------------------------------------------------------
BATCH_SIZES = [0, -1, 1.5, 10**9, True, np.int64(3), "4", None]


def _model(dtype, weights: dict):
    """linear_regression(3) starting from ``weights``."""
    model = linear_regression(N_FEATURES, dtype=dtype)
    for init in model.graph.initializer:
        init.CopyFrom(ir.serde.serialize_tensor(ir.tensor(weights[init.name].astype(dtype), name=init.name)))
    return model


def _trainer_data_is_valid(x, y, sw) -> bool:
    """The Trainer contract: finite X (n, 3), n >= 1; finite y (n,) or (n, 1); sample_weight (n,) or (n, 1) (as
    onnxcustom took them, docs/migration.md), finite, >= 0, not all 0."""
    if x is None or y is None or sw is None or x.ndim != 2 or x.shape[1] != N_FEATURES or x.shape[0] == 0:
        return False
    n = x.shape[0]
    return (y.shape in ((n,), (n, 1)) and sw.shape in ((n,), (n, 1)) and np.isfinite(x).all() and np.isfinite(y).all()
            and np.isfinite(sw).all() and (sw >= 0).all() and sw.any())


def _reference_fit(w: dict, X, y, s, batch: int, max_iter: int, dtype):
    """Minibatch SGD in order (shuffle=False): (epoch losses, final weights, error bound, safe, failure).

    ``failure`` is None, or the weights that gave the last finite loss when a loss or the weights became
    NaN or infinite. The error bound follows |e'| <= (1 + 2·lr·Σ q·|x|²)·|e| + tol of the step.
    """
    n, losses, err, safe, previous = X.shape[0], [], 0.0, True, None
    for _ in range(max_iter):
        total = 0.0
        for start in range(0, n, batch):
            sl = slice(start, start + batch)
            loss, new, tol, ok = _reference(w, X[sl], y[sl], s[sl], dtype)
            safe &= ok
            if not np.isfinite(loss):
                return losses, w, err, safe, previous if previous is not None else w
            with np.errstate(all="ignore"):
                q = np.abs(s[sl]) / abs(s[sl].sum())
                grow = 1 + 2 * LR * (q * ((X[sl].astype(np.float64) ** 2).sum(axis=1) + 1)).sum()
                err = grow * err + max(tol["coef"].max(), tol["bias"].max())
            total += loss * (len(X[sl]) / n)
            previous, w = w, {k: v.astype(dtype).astype(np.float64) for k, v in new.items()}
            if not all(np.isfinite(v).all() for v in w.values()) and start + batch >= n:
                return losses, w, err, safe, previous  # NOTE: found at the end of the epoch
        losses.append(total)
    return losses, w, err, safe, None


@TRAINER_FUZZ
@given(data=st.data())
def test_trainer_fit_gives_finite_numpy_weights_or_an_onnxopt_error(data):
    dtype, (X, y, sw), (x_ref, y_ref, sw_ref) = data.draw(batches())
    batch_size = data.draw(st.one_of(st.integers(1, 25), st.sampled_from(BATCH_SIZES)))
    max_iter, shuffle = data.draw(st.integers(1, 2)), data.draw(st.booleans())
    w0 = {k: v.astype(dtype).astype(np.float64) for k, v in _weights(data.draw).items()}
    est = onnxopt.Trainer(_model(dtype, w0), learning_rate=LR, batch_size=batch_size, max_iter=max_iter,
                          shuffle=shuffle, tol=None, update="sgd", scale="never")  # NOTE: the reference is plain SGD
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            est.fit(X, y, sample_weight=sw)
        except OnnxoptError as exc:
            error = exc
        else:
            error = None
    event(type(error).__name__ if error is not None else "result")
    valid_batch = not isinstance(batch_size, bool) and isinstance(batch_size, (int, np.integer)) and batch_size >= 1
    if not _trainer_data_is_valid(x_ref, y_ref, sw_ref) or not valid_batch:
        assert isinstance(error, DataError), f"expected a DataError, got {error!r}"
        assert re.match(r"(X|y|sample_weight|batch_size): ", str(error)), str(error)
        return
    n = x_ref.shape[0]
    assert any("clipped" in str(w.message) for w in caught) == (batch_size > n)
    batch = min(int(batch_size), n)
    losses, ref_w, err, safe, failure = _reference_fit(w0, x_ref, y_ref, sw_ref.reshape(n), batch, max_iter, dtype)
    weights = est.runner_.get_weights()
    if not safe or shuffle and n > batch:
        # NOTE: another order of the samples, or overflow close to the float limit: either outcome, but clean
        event("not compared: shuffled batches or overflow near the float limit")
        assert error is None or isinstance(error, ConvergenceError), f"expected a result, got {error!r}"
        assert all(np.isfinite(v).all() for v in weights.values()) or error is not None and _same_weights(
            weights, {k: v.astype(dtype) for k, v in w0.items()}), weights
        assert error is not None or np.isfinite(est.train_losses_).all() and len(est.train_losses_) == max_iter
        return
    if failure is not None:
        assert isinstance(error, ConvergenceError), f"expected a ConvergenceError, got {error!r}"
        assert all(_close(weights[k], failure[k], 100 * err + FLOOR[dtype]) for k in weights), (weights, failure)
        return
    assert error is None, f"expected a result, got {error!r}"
    assert all(v.dtype == dtype and np.isfinite(v).all() for v in weights.values()), weights
    assert len(est.train_losses_) == est.n_iter_ == max_iter and np.isfinite(est.train_losses_).all()
    assert all(_close(weights[k], ref_w[k], 100 * err + FLOOR[dtype]) for k in weights), (weights, ref_w)
    scale = max(abs(v) for v in losses)
    assert _close(est.train_losses_, losses, 1e3 * RTOL[dtype] * scale + 100 * err * (1 + scale)), (est.train_losses_, losses)


# -- regressions: what the fuzzing found -----------------------------------------------------------------------
@pytest.mark.parametrize("y, sw", [(np.ones((1, 4)), None), (np.ones((2, 2)), None), (np.ones(4), np.ones(1)),
                                   (np.ones(4), np.ones(2))], ids=["y-row", "y-square", "w-one", "w-short"])
def test_runner_refuses_targets_and_weights_the_loss_would_broadcast(y, sw):
    runner = _runner(np.float64)  # NOTE: the loss reshapes y like the prediction and broadcasts sample_weight
    before, count = runner.get_weights(), runner.step_count
    with pytest.raises(DataError, match=r"^batch: (y|sample_weight): expected .* got X\(4, 3\) float64"):
        runner.step(np.ones((4, N_FEATURES)), y, sample_weight=sw)
    assert _same_weights(runner.get_weights(), before) and runner.step_count == count


def test_scalars_stay_scalars_and_one_sample_needs_a_row():
    runner = _runner(np.float64)
    assert onnxopt.data.as_array(np.float64(2.0), np.float64, "y").shape == ()  # NOTE: not (1,)
    with pytest.raises(DataError, match=r"^batch: y: expected one row per sample of X, got shape \(\);"):
        runner.step(np.ones((1, N_FEATURES)), 2.0)
    with pytest.raises(DataError, match=r"^batch: sample_weight: expected shape \(1,\) .* got \(\);"):
        runner.step(np.ones((1, N_FEATURES)), [2.0], sample_weight=1.0)


@pytest.mark.parametrize("value, message", [
    ([10**400, 1.0], "int too large"), (np.array([2**53 + 1, 0.5], dtype=object), "integers that change"),
    ([2**64 + 1], "integers that change"), (np.array(["1.5"], dtype=object), "read as <U3"),
], ids=["huge-int", "lossy-int-with-floats", "int-beyond-64-bits", "string-object"])
def test_object_data_is_cast_only_when_lossless(value, message):
    with pytest.raises(DataError, match=message):  # NOTE: OverflowError or a silent rounding before
        onnxopt.data.as_array(value, np.float64, "X")
    np.testing.assert_array_equal(onnxopt.data.as_array([None, 2**60, 1.5], np.float64, "X"), [np.nan, 2.0**60, 1.5])


def test_finite_loss_whose_update_overflows_is_a_convergence_error():
    X, y = np.array([[1e300, 0.0, 0.0]]), np.array([1e10])  # NOTE: loss 1e20, gradient -2e310
    zeros = {"coef": np.zeros((N_FEATURES, 1)), "bias": np.zeros(1)}
    runner = _runner(np.float64)
    runner.set_weights(zeros)
    runner.step(np.ones((2, N_FEATURES)), np.zeros(2))  # a finite step: its weights gave the next finite loss
    kept = runner.get_weights()
    assert runner.step(X, y) == 1e20 and np.isinf(runner.get_weights()["coef"][0, 0])
    with pytest.raises(ConvergenceError, match=r"weights: \['coef'\] became NaN or infinite at step \d+ "):
        runner.check_weights()
    assert _same_weights(runner.get_weights(), kept)
    est = onnxopt.Trainer(_model(np.float64, zeros), learning_rate=LR, batch_size=1, max_iter=1, update="sgd",
                          scale="never")
    with pytest.raises(ConvergenceError, match=r"^epoch 1, batch 1: weights: \['coef'\]"):
        est.fit(X, y)
    assert _same_weights(est.runner_.get_weights(), zeros)  # NOTE: fit used to return the infinite weights


def test_epoch_loss_close_to_the_float_limit_does_not_overflow():
    est = onnxopt.Trainer(_model(np.float64, {"coef": np.zeros((N_FEATURES, 1)), "bias": np.array([1e154])}),
                          learning_rate=LR, batch_size=1, max_iter=1, shuffle=False, update="sgd", scale="never")
    est.fit(np.zeros((2, N_FEATURES)), np.zeros(2))  # NOTE: batch losses 1e308 and 0.81e308: their sum is inf
    np.testing.assert_allclose(est.train_losses_, [(1 + 0.81) / 2 * 1e308], rtol=1e-12)


def test_refused_batch_is_a_data_error_without_an_onnxruntime_log_line(capfd):
    runner = _runner(np.float64)
    with pytest.raises(DataError, match=r"^batch: onnxruntime refused it"):
        runner.step(np.ones((4, 2)), np.ones(4))
    with pytest.raises(DataError, match=r"^X: expected at least one sample, got shape \(0, 3\)"):
        runner.step(np.ones((0, N_FEATURES)), np.ones(0))
    assert "onnxruntime" not in capfd.readouterr().err  # NOTE: log severity 4 (fatal) in default_session_options
