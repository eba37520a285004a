"""The DSL's built-in onnxscript functions, run eagerly, against NumPy versions of their documented formulas.

Every built-in is reached through its public declaration (``dsl.losses.huber(delta=...)``...): the test calls
``decl.fn(*inputs, **decl.call_attrs())`` so the attribute values the fuser would put on the call node are
the ones evaluated. References below are written from the formulas in the docstrings (and torch.optim's /
scikit-learn's definitions they cite), not from the library code.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from onnxopt import dsl
from onnxopt.dsl import FLOAT, op
from onnxopt.dsl.losses import weighted_mean, weighted_sum
from onnxopt.errors import DslError
from onnxopt.resolve import resolve_loss, resolve_penalty, resolve_schedule, resolve_update

N, K, C = 6, 3, 4


def _run(decl, *inputs):
    out = decl.fn(*inputs, **decl.call_attrs())
    return out if isinstance(out, tuple) else (out,)


# ---------------------------------------------------------------------------------------------------------
# NumPy references
# ---------------------------------------------------------------------------------------------------------

def _softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def _huber(d, delta):
    a = np.abs(d)
    return np.where(a <= delta, 0.5 * d * d, delta * (a - 0.5 * delta))


# Each case: (rng, dtype) -> (actual outputs, expected outputs). Inputs are drawn in float64 then cast, and
# the reference is computed in float64 from the cast inputs.

def _reg_data(rng, dtype, flat_target=False):
    y = rng.normal(size=(N, K)) * 2
    t = rng.normal(size=(N, K)) * 2
    if flat_target:
        y, t = y[:, :1], t[:, 0]
    return y.astype(dtype), t.astype(dtype)


def case_square_mean(rng, dtype):
    y, t = _reg_data(rng, dtype)
    d = y.astype(np.float64) - t
    return _run(dsl.losses.square(), y, t), ((d ** 2).mean(axis=1),)


def case_square_sum(rng, dtype):
    y, t = _reg_data(rng, dtype)
    d = y.astype(np.float64) - t
    return _run(dsl.losses.square(reduction="sum"), y, t), ((d ** 2).sum(axis=1),)


def case_square_flat_target(rng, dtype):
    y, t = _reg_data(rng, dtype, flat_target=True)  # y (N, 1), t (N,)
    d = y[:, 0].astype(np.float64) - t
    return _run(dsl.losses.square(), y, t), (d ** 2,)


def case_absolute_mean(rng, dtype):
    y, t = _reg_data(rng, dtype)
    return _run(dsl.losses.absolute(), y, t), (np.abs(y.astype(np.float64) - t).mean(axis=1),)


def case_absolute_sum(rng, dtype):
    y, t = _reg_data(rng, dtype)
    return _run(dsl.losses.absolute(reduction="sum"), y, t), (np.abs(y.astype(np.float64) - t).sum(axis=1),)


def case_elastic(rng, dtype):
    y, t = _reg_data(rng, dtype)
    d = y.astype(np.float64) - t
    return _run(dsl.losses.elastic(l1=0.25, l2=0.75), y, t), ((0.25 * np.abs(d) + 0.75 * d * d).mean(axis=1),)


def _huber_case(delta):
    def case(rng, dtype):
        y, t = _reg_data(rng, dtype)
        d = y.astype(np.float64) - t
        assert (np.abs(d) <= delta).any() and (np.abs(d) > delta).any()  # both branches are exercised
        return _run(dsl.losses.huber(delta=delta), y, t), (_huber(d, delta).mean(axis=1),)
    return case


def case_log_logits(rng, dtype):
    s = (rng.normal(size=(N, 1)) * 3).astype(dtype)
    t = (rng.random(N) > 0.5).astype(dtype)
    p = _sigmoid(s[:, 0].astype(np.float64))
    return _run(dsl.losses.log(from_logits=True), s, t), (-(t * np.log(p) + (1 - t) * np.log(1 - p)),)


def case_log_logits_large_scores(rng, dtype):
    s = np.array([[-60.0], [-5.0], [0.0], [5.0], [60.0], [30.0]], dtype)
    t = np.array([1, 0, 1, 1, 0, 1], dtype)
    # log(1 + exp(-|s|)) written differently: softplus(s) - s*t with softplus via logaddexp
    ref = np.logaddexp(0.0, s[:, 0].astype(np.float64)) - s[:, 0] * t
    return _run(dsl.losses.log(from_logits=True), s, t), (ref,)


def case_log_proba_one_column(rng, dtype):
    p = rng.uniform(0.05, 0.95, size=(N, 1)).astype(dtype)
    t = (rng.random(N) > 0.5).astype(dtype)
    q = p[:, 0].astype(np.float64)
    return _run(dsl.losses.log(from_logits=False), p, t), (-(t * np.log(q) + (1 - t) * np.log(1 - q)),)


def case_log_proba_two_columns(rng, dtype):
    q = rng.uniform(0.05, 0.95, size=N)
    p = np.stack([1 - q, q], axis=1).astype(dtype)
    t = (rng.random(N) > 0.5).astype(dtype)
    q = p[:, 1].astype(np.float64)
    return _run(dsl.losses.log(from_logits=False), p, t), (-(t * np.log(q) + (1 - t) * np.log(1 - q)),)


def case_log_proba_clipped(rng, dtype):
    eps = 1e-3
    p = np.array([[0.0], [1.0], [0.5]], dtype)
    t = np.array([1, 0, 1], dtype)
    return _run(dsl.losses.log(from_logits=False, eps=eps), p, t), (np.array([-np.log(eps), -np.log(eps), np.log(2)]),)


def _class_data(rng, dtype):
    y = (rng.normal(size=(N, C)) * 2).astype(dtype)
    idx = rng.integers(0, C, size=N).astype(np.int64)
    return y, idx, np.eye(C)[idx].astype(dtype)


def case_cross_entropy_index(rng, dtype):
    y, idx, _ = _class_data(rng, dtype)
    p = _softmax(y.astype(np.float64))
    return _run(dsl.losses.cross_entropy(), y, idx), (-np.log(p[np.arange(N), idx]),)


def case_cross_entropy_onehot(rng, dtype):
    y, _, onehot = _class_data(rng, dtype)
    # soft labels too: rows of a one-hot mixed with a uniform distribution
    soft = (0.8 * onehot + 0.2 / C).astype(dtype)
    p = _softmax(y.astype(np.float64))
    return _run(dsl.losses.cross_entropy(one_hot=True), y, soft), (-(soft * np.log(p)).sum(axis=1),)


def case_nll_index(rng, dtype):
    y, idx, _ = _class_data(rng, dtype)
    p = _softmax(y.astype(np.float64)).astype(dtype)
    p[0, idx[0]] = 0.0  # clipped to eps
    ref = -np.log(np.maximum(p.astype(np.float64)[np.arange(N), idx], 1e-7))
    return _run(dsl.losses.cross_entropy(from_logits=False), p, idx), (ref,)


def case_nll_onehot(rng, dtype):
    y, idx, onehot = _class_data(rng, dtype)
    p = _softmax(y.astype(np.float64)).astype(dtype)
    ref = -np.log(p.astype(np.float64)[np.arange(N), idx])
    return _run(dsl.losses.cross_entropy(from_logits=False, one_hot=True), p, onehot), (ref,)


def case_weighted_mean(rng, dtype):
    per, s = rng.random(N).astype(dtype), rng.uniform(0.1, 3, N).astype(dtype)
    ref = (per.astype(np.float64) * s).sum() / s.astype(np.float64).sum()
    return (weighted_mean(per, s),), (ref,)


def case_weighted_mean_scalar_weight(rng, dtype):
    per = rng.random(N).astype(dtype)
    return (weighted_mean(per, np.array(1, dtype)),), (per.astype(np.float64).mean(),)


def case_weighted_sum(rng, dtype):
    per, s = rng.random(N).astype(dtype), rng.uniform(0.1, 3, N).astype(dtype)
    return (weighted_sum(per, s),), ((per.astype(np.float64) * s).sum(),)


# penalties: value and hand-written gradient

def _penalty_case(make, l1, l2):
    def case(rng, dtype):
        w = rng.normal(size=(3, 4)).astype(dtype)
        decl = make()
        w64 = w.astype(np.float64)
        value = l1 * np.abs(w64).sum() + l2 * (w64 ** 2).sum()
        grad = l1 * np.sign(w64) + 2 * l2 * w64
        got = (_run(decl, w)[0], decl.grad(w, **decl.call_attrs()))
        return got, (value, grad)
    return case


# update rules: torch.optim formulas

def _rule_inputs(rng, dtype, n_state):
    w, g = rng.normal(size=(3, 2)), rng.normal(size=(3, 2))
    states = [rng.uniform(0.1, 1.0, size=(3, 2)) for _ in range(n_state)]  # non-zero: a later step
    return [a.astype(dtype) for a in (w, g, *states)], np.array(0.25, dtype)


def case_sgd(rng, dtype):
    (w, g), lr = _rule_inputs(rng, dtype, 0)
    return _run(dsl.updates.sgd(), w, g, lr), (w - 0.25 * g.astype(np.float64),)


def case_momentum(rng, dtype):
    (w, g, v), lr = _rule_inputs(rng, dtype, 1)
    v_new = 0.5 * v.astype(np.float64) + g
    return _run(dsl.updates.momentum(momentum=0.5), w, g, lr, v), (w - 0.25 * v_new, v_new)


def case_nesterov(rng, dtype):
    (w, g, v), lr = _rule_inputs(rng, dtype, 1)
    v_new = 0.75 * v.astype(np.float64) + g
    return _run(dsl.updates.nesterov(momentum=0.75), w, g, lr, v), (w - 0.25 * (g + 0.75 * v_new), v_new)


def case_rmsprop(rng, dtype):
    (w, g, s), lr = _rule_inputs(rng, dtype, 1)
    alpha, eps = 0.875, 2.0 ** -10
    s_new = alpha * s.astype(np.float64) + (1 - alpha) * g.astype(np.float64) ** 2
    return (_run(dsl.updates.rmsprop(alpha=alpha, eps=eps), w, g, lr, s),
            (w - 0.25 * g / (np.sqrt(s_new) + eps), s_new))


def case_adagrad(rng, dtype):
    (w, g, s), lr = _rule_inputs(rng, dtype, 1)
    eps = 2.0 ** -10
    s_new = s.astype(np.float64) + g.astype(np.float64) ** 2
    return _run(dsl.updates.adagrad(eps=eps), w, g, lr, s), (w - 0.25 * g / (np.sqrt(s_new) + eps), s_new)


def _adam_ref(w, g, lr, m, v, t, b1, b2, eps, wd):
    w, g, m, v = (a.astype(np.float64) for a in (w, g, m, v))
    w = w * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    step_size = lr / (1 - b1 ** t)
    denom = np.sqrt(v) / math.sqrt(1 - b2 ** t) + eps
    return w - step_size * m / denom, m, v


def case_adam(rng, dtype):
    (w, g, m, v), lr = _rule_inputs(rng, dtype, 2)
    b1, b2, eps = 0.875, 0.96875, 2.0 ** -12
    got = _run(dsl.updates.adam(beta1=b1, beta2=b2, eps=eps), w, g, lr, m, v, np.array(3.0, dtype))
    return got, _adam_ref(w, g, 0.25, m, v, 3, b1, b2, eps, 0.0)


def case_adamw(rng, dtype):
    (w, g, m, v), lr = _rule_inputs(rng, dtype, 2)
    b1, b2, eps, wd = 0.75, 0.875, 2.0 ** -12, 0.125
    got = _run(dsl.updates.adamw(beta1=b1, beta2=b2, eps=eps, weight_decay=wd), w, g, lr, m, v, np.array(2.0, dtype))
    return got, _adam_ref(w, g, 0.25, m, v, 2, b1, b2, eps, wd)


def case_adam_defaults_step1(rng, dtype):
    (w, g, m, v), lr = _rule_inputs(rng, dtype, 2)
    zero = np.zeros_like(m)
    got = _run(dsl.updates.adam(), w, g, lr, zero, zero, np.array(1.0, dtype))
    # torch's first Adam step: m̂ = g, v̂ = g², so w moves by lr·g/(|g| + eps) whatever the betas. The moments
    # themselves carry (1 - beta): ONNX float attributes are 32-bit, so beta2 = 0.999 is float32(0.999) and
    # 1 - beta2 is 1.3e-5 off in relative terms; the reference uses the rounded betas for the moments.
    b1, b2 = float(np.float32(0.9)), float(np.float32(0.999))
    g64 = g.astype(np.float64)
    return got, (w - 0.25 * g64 / (np.abs(g64) + 1e-8), (1 - b1) * g64, (1 - b2) * g64 ** 2)


# schedules: lr as a function of the 1-based step t

def _schedule_case(decl, ref, ts=(1, 2, 3, 7, 10, 25, 40)):
    def case(rng, dtype):
        got = tuple(_run(decl, np.array(float(t), dtype))[0] for t in ts)
        return got, tuple(ref(t) for t in ts)
    return case


from helpers import cosine_ref as _cosine_ref  # noqa: E402


CASES = {
    "square_mean": case_square_mean,
    "square_sum": case_square_sum,
    "square_flat_target": case_square_flat_target,
    "absolute_mean": case_absolute_mean,
    "absolute_sum": case_absolute_sum,
    "elastic": case_elastic,
    **{f"huber_delta{d}": _huber_case(d) for d in (0.5, 1.0, 2.0)},
    "log_logits": case_log_logits,
    "log_logits_large_scores": case_log_logits_large_scores,
    "log_proba_one_column": case_log_proba_one_column,
    "log_proba_two_columns": case_log_proba_two_columns,
    "log_proba_clipped": case_log_proba_clipped,
    "cross_entropy_index": case_cross_entropy_index,
    "cross_entropy_onehot": case_cross_entropy_onehot,
    "nll_index": case_nll_index,
    "nll_onehot": case_nll_onehot,
    "weighted_mean": case_weighted_mean,
    "weighted_mean_scalar_weight": case_weighted_mean_scalar_weight,
    "weighted_sum": case_weighted_sum,
    "penalty_l1": _penalty_case(lambda: dsl.penalties.l1(alpha=0.25), 0.25, 0.0),
    "penalty_l2": _penalty_case(lambda: dsl.penalties.l2(alpha=0.375), 0.0, 0.375),
    "penalty_elastic": _penalty_case(lambda: dsl.penalties.elastic(l1=0.125, l2=0.625), 0.125, 0.625),
    "sgd": case_sgd,
    "momentum": case_momentum,
    "nesterov": case_nesterov,
    "rmsprop": case_rmsprop,
    "adagrad": case_adagrad,
    "adam": case_adam,
    "adamw": case_adamw,
    "adam_defaults_step1": case_adam_defaults_step1,
    "schedule_constant": _schedule_case(dsl.schedules.constant(eta0=0.125), lambda t: 0.125),
    "schedule_invscaling": _schedule_case(dsl.schedules.invscaling(eta0=0.5, power_t=0.25),
                                          lambda t: 0.5 / t ** 0.25),
    "schedule_step": _schedule_case(dsl.schedules.step(eta0=0.5, step_size=3, gamma=0.5),
                                    lambda t: 0.5 * 0.5 ** ((t - 1) // 3)),
    "schedule_exponential": _schedule_case(dsl.schedules.exponential(eta0=0.5, gamma=0.875),
                                           lambda t: 0.5 * 0.875 ** (t - 1)),
    "schedule_cosine": _schedule_case(dsl.schedules.cosine(eta0=0.5, total=30),
                                      lambda t: _cosine_ref(t, 0.5, 30, 0, 0.0)),
    "schedule_cosine_warmup": _schedule_case(dsl.schedules.cosine(eta0=0.5, total=30, warmup=5, eta_min=0.0625),
                                             lambda t: _cosine_ref(t, 0.5, 30, 5, 0.0625)),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", list(CASES))
def test_builtin_matches_numpy(name, dtype):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    got, expected = CASES[name](rng, dtype)
    assert len(got) == len(expected), f"{name}: {len(got)} outputs, expected {len(expected)}"
    # float32: the inputs are exact float32 values, only the arithmetic rounds; the cosine schedule's
    # Cos runs in float32 (a documented NOTE) so it gets an absolute tolerance in float64 too.
    rtol = 1e-6 if dtype == np.float64 else 2e-5
    atol = 1e-7 if name.startswith("schedule_cosine") else (1e-12 if dtype == np.float64 else 1e-6)
    for i, (a, e) in enumerate(zip(got, expected)):
        a = np.asarray(a)
        assert a.dtype == dtype, f"{name} output {i}: dtype {a.dtype}, expected {np.dtype(dtype)}"
        np.testing.assert_allclose(a, np.asarray(e, dtype=np.float64), rtol=rtol, atol=atol,
                                   err_msg=f"{name} output {i}")


def test_every_builtin_is_in_the_table():
    """The table above keeps up with the registries: every built-in name has at least one case."""
    covered = " ".join(CASES)
    for registry in (dsl.losses.LOSSES, dsl.penalties.PENALTIES, dsl.updates.UPDATES, dsl.schedules.SCHEDULES):
        for name in registry:
            assert name in covered, f"built-in {name!r} has no case in test_dsl.CASES"


def test_declarations_copy_and_keep_parameters():
    base = dsl.updates.momentum()
    changed = base(momentum=0.25)
    assert base.call_attrs() == {"momentum": 0.9}
    assert changed.call_attrs() == {"momentum": 0.25}
    assert changed.state == ("velocity",) and changed.clip_norm is None
    assert dsl.updates.sgd(clip_norm=0.5).clip_norm == 0.5
    assert dsl.updates.adam().uses_step and not dsl.updates.rmsprop().uses_step
    assert dsl.updates.adamw(weight_decay=0.5).call_attrs()["weight_decay"] == 0.5
    assert dsl.updates.adamw().name == "adamw" and dsl.updates.adamw().state == ("exp_avg", "exp_avg_sq")
    assert dsl.losses.cross_entropy().target == "index"
    assert dsl.losses.cross_entropy(one_hot=True).target == "float"
    assert dsl.losses.square().weighted and dsl.losses.square(reduction="sum").reduction == "sum"


def test_resolve_spec_strings():
    rule = resolve_update("nesterov:momentum=0.5")
    assert rule.name == "nesterov" and rule.call_attrs() == {"momentum": 0.5}
    pen = resolve_penalty("elastic:l1=0.25,l2=0.5")
    assert pen.call_attrs() == {"l1": 0.25, "l2": 0.5}
    assert resolve_schedule(0.125).call_attrs() == {"eta0": 0.125}
    assert resolve_loss("huber:delta=2").call_attrs() == {"delta": 2}
    assert resolve_penalty(None) is None


# ---------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------

def test_unknown_parameter_on_a_declaration():
    with pytest.raises(DslError, match="unknown parameter 'betta'.*momentum"):
        dsl.updates.momentum()(betta=0.5)


def test_unknown_parameter_in_a_spec_string():
    with pytest.raises(DslError, match="momentum"):
        resolve_update("momentum:betta=0.5")


def test_non_numeric_parameter():
    with pytest.raises(DslError, match="must be a number"):
        dsl.updates.momentum()(momentum="fast")


@pytest.mark.parametrize("make", [
    lambda: dsl.updates.momentum(momentum=1.5),
    lambda: dsl.updates.nesterov(momentum=-0.1),
    lambda: dsl.updates.adam(beta1=1.0),
    lambda: dsl.updates.rmsprop(alpha=2.0),
    lambda: dsl.updates.adamw(weight_decay=-1.0),
    lambda: dsl.updates.sgd(clip_norm=0.0),
    lambda: dsl.penalties.l2(alpha=-1.0),
    lambda: dsl.penalties.l1(alpha=-0.5),
    lambda: dsl.penalties.elastic(l1=0.5, l2=-0.5),
    lambda: dsl.losses.huber(delta=0.0),
    lambda: dsl.losses.square(reduction="max"),
    lambda: dsl.schedules.constant(eta0=-0.1),
    lambda: dsl.schedules.cosine(total=10, warmup=10),
], ids=["momentum", "nesterov", "adam_beta1", "rmsprop_alpha", "adamw_decay", "clip_norm", "l2", "l1",
        "elastic", "huber_delta", "reduction", "constant", "cosine_warmup"])
def test_bad_values_raise(make):
    with pytest.raises(DslError):
        make()


def test_update_rule_outputs_must_match_state():
    with pytest.raises(DslError, match="returns 1 tensors, expected 2"):
        @dsl.update_rule(state=["velocity"])
        def forgets_state(w, g, lr, velocity):
            return op.Sub(w, op.Mul(lr, op.Add(g, velocity)))


def test_update_rule_inputs_must_match_state():
    with pytest.raises(DslError, match="expected inputs"):
        @dsl.update_rule(state=["velocity"])
        def wrong_name(w, g, lr, speed):
            return op.Sub(w, op.Mul(lr, speed)), speed


def test_update_rule_too_many_outputs():
    with pytest.raises(DslError, match="expected 1"):
        @dsl.update_rule
        def extra(w, g, lr):
            return op.Sub(w, op.Mul(lr, g)), g


def test_loss_with_wrong_inputs():
    with pytest.raises(DslError, match="expected tensor inputs"):
        @dsl.loss
        def one_input(y: FLOAT) -> FLOAT:
            return op.ReduceMean(op.Mul(y, y))


def test_loss_with_too_many_inputs():
    with pytest.raises(DslError, match="expected tensor inputs"):
        @dsl.loss
        def four_inputs(y, t, s, extra):
            return op.ReduceMean(op.Mul(op.Sub(y, t), op.Add(s, extra)))


def test_loss_returning_two_tensors():
    with pytest.raises(DslError, match="must return one tensor"):
        @dsl.loss
        def two(y, t):
            d = op.Sub(y, t)
            return op.ReduceMean(d), d


def test_loss_bad_target_kind():
    with pytest.raises(DslError, match="target"):
        dsl.loss(target="labels")


def test_penalty_with_wrong_inputs():
    with pytest.raises(DslError, match="expected tensor inputs"):
        @dsl.penalty
        def two(w, v):
            return op.ReduceSum(op.Mul(w, v))


def test_not_an_onnxscript_function():
    with pytest.raises(DslError, match="not a valid onnxscript function"):
        @dsl.loss
        def uses_numpy(y, t):
            return np.mean((y - t) ** 2)  # not expressible with op


def test_function_without_source_is_a_dsl_error():
    namespace = {"op": op}
    exec("def no_source(y, t):\n    return op.ReduceMean(op.Sub(y, t))\n", namespace)  # noqa: S102
    with pytest.raises(DslError, match="no_source"):
        dsl.loss(namespace["no_source"])


def test_not_a_function():
    with pytest.raises(DslError, match="expected a function"):
        dsl.loss(42)


@pytest.mark.parametrize("resolve, expected", [
    (resolve_update, ["adam", "adamw", "momentum", "nesterov", "sgd"]),
    (resolve_loss, ["absolute", "cross_entropy", "huber", "square"]),
    (resolve_penalty, ["elastic", "l1", "l2"]),
    (resolve_schedule, ["constant", "cosine", "invscaling"]),
], ids=["update", "loss", "penalty", "schedule"])
def test_unknown_name_lists_the_known_ones(resolve, expected):
    with pytest.raises(DslError) as info:
        resolve("nope")
    msg = str(info.value)
    assert "'nope'" in msg
    for name in expected:
        assert repr(name) in msg, f"{name!r} missing from {msg!r}"


def test_resolve_rejects_other_types():
    with pytest.raises(DslError, match="expected a name or a UpdateRule"):
        resolve_update(dsl.losses.square())
