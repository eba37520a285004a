"""One fused training step (forward + loss + backward + penalty + update) against NumPy references.

The references never use the library: a NumPy forward of ``examples.mlp`` (written from its docstring), NumPy
losses written from the documented formulas, gradients by central finite differences in float64 on the whole
NumPy forward + loss (checked against an analytic gradient below), and update rules written from
torch.optim's formulas. Hyper-parameters are mostly dyadic numbers (exact in float32 as well as float64).
"""

from __future__ import annotations

import collections
import functools
import math

import numpy as np
import pytest

import onnxopt
from onnxopt import dsl
from onnxopt.dsl import op
from onnxopt.examples import linear_regression, mlp
from helpers import run_once, session

N = 10
LR = 0.5
TOL64 = dict(rtol=1e-6, atol=1e-9)
TOL32 = dict(rtol=1e-4, atol=2e-5)


# ---------------------------------------------------------------------------------------------------------
# NumPy reference: forward, losses, finite-difference gradient, one SGD step
# ---------------------------------------------------------------------------------------------------------

def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def _softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


ACTIVATIONS = {"Relu": lambda z: np.maximum(z, 0.0), "Tanh": np.tanh, "Sigmoid": _sigmoid}
FINALS = {None: lambda z: z, "Sigmoid": _sigmoid, "Softmax": _softmax}


@functools.lru_cache(maxsize=None)
def _model(sizes: tuple, activation: str, final: str | None, dtype):
    return mlp(list(sizes), activation=activation, final=final, dtype=dtype, seed=1)


def forward(w, X, sizes, activation="Tanh", final=None):
    """examples.mlp: MatMul + Add per layer, ``activation`` between layers, ``final`` at the end."""
    n_layers = len(sizes) - 1
    h = X
    for i in range(n_layers):
        sfx = f"_{i}" if n_layers > 1 else ""
        h = h @ w["coef" + sfx] + w["bias" + sfx]
        if i < n_layers - 1:
            h = ACTIVATIONS[activation](h)
    return FINALS[final](h)


def _wavg(per_sample, s, reduction):
    return (per_sample * s).sum() / s.sum() if reduction == "mean" else (per_sample * s).sum()


def _huber(d, delta):
    a = np.abs(d)
    return np.where(a <= delta, 0.5 * d * d, delta * (a - 0.5 * delta))


def np_loss(kind, y, t, s, **p):
    """The documented built-in losses: per-sample values, then Σ s·l / Σ s (mean) or Σ s·l (sum)."""
    red = p.get("reduction", "mean")
    if kind in ("square", "absolute", "elastic", "huber"):
        d = y - t.reshape(y.shape)
        e = {"square": lambda: d * d, "absolute": lambda: np.abs(d),
             "elastic": lambda: p["l1"] * np.abs(d) + p["l2"] * d * d,
             "huber": lambda: _huber(d, p["delta"])}[kind]()
        per = e.sum(axis=1) if red == "sum" and kind in ("square", "absolute") else e.mean(axis=1)
        return _wavg(per, s, red)
    if kind == "log_logits":
        q = _sigmoid(y[:, -1])
        return _wavg(-(t * np.log(q) + (1 - t) * np.log(1 - q)), s, red)
    if kind == "log_proba":
        q = np.clip(y[:, -1], 1e-7, 1 - 1e-7)
        return _wavg(-(t * np.log(q) + (1 - t) * np.log(1 - q)), s, red)
    if kind == "ce_index":
        return _wavg(-np.log(_softmax(y)[np.arange(len(y)), t]), s, red)
    if kind == "ce_onehot":
        return _wavg(-(t * np.log(_softmax(y))).sum(axis=1), s, red)
    if kind == "nll_index":
        return _wavg(-np.log(np.maximum(y[np.arange(len(y)), t], 1e-7)), s, red)
    if kind == "nll_onehot":
        return _wavg(-(t * np.log(np.maximum(y, 1e-7))).sum(axis=1), s, red)
    raise AssertionError(kind)


def fd_grad(f, w, h=1e-6):
    """Central finite differences of the scalar ``f(weights)`` w.r.t. every weight entry, in float64."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    grads = {}
    for name, value in w.items():
        g = np.zeros_like(value)
        for idx in np.ndindex(value.shape):
            plus, minus = {**w, name: value.copy()}, {**w, name: value.copy()}
            plus[name][idx] += h
            minus[name][idx] -= h
            g[idx] = (f(plus) - f(minus)) / (2 * h)
        grads[name] = g
    return grads


def _f64(d):
    return {k: np.asarray(v, np.float64) for k, v in d.items()}


# ---------------------------------------------------------------------------------------------------------
# a loop that feeds the step's outputs back as inputs
# ---------------------------------------------------------------------------------------------------------

class Loop:
    def __init__(self, step):
        self.step = step
        self.sess = session(step.model)
        self.out_names = [o.name for o in self.sess.get_outputs()]
        w = step.initial_weights()
        self.carried = dict(w)
        for name in step.state:
            if name == "optim.step":
                self.carried[name] = np.array(0, np.int64)
            else:
                self.carried[name] = np.zeros_like(w[name.rsplit(".", 1)[0]])

    def run(self, X, y, sample_weight=None):
        feeds = {self.step.inputs[0]: X, self.step.target: y, **self.carried}
        if self.step.sample_weight:
            feeds[self.step.sample_weight] = (np.ones(len(X), X.dtype) if sample_weight is None else sample_weight)
        out = dict(zip(self.out_names, self.sess.run(None, feeds)))
        for src, dst in self.step.carry.items():
            self.carried[src] = out[dst]
        return out


# ---------------------------------------------------------------------------------------------------------
# the reference machinery itself
# ---------------------------------------------------------------------------------------------------------

def test_finite_differences_match_an_analytic_gradient(rng):
    """Weighted squared error of a linear regression: dL/dcoef = 2·Xᵀ(s·d)/Σs, dL/dbias = 2·Σ s·d/Σs."""
    X, y, s = rng.normal(size=(N, 3)), rng.normal(size=N), rng.uniform(0.2, 2, N)
    w = {"coef": rng.normal(size=(3, 1)), "bias": rng.normal(size=1)}
    g = fd_grad(lambda w: np_loss("square", forward(w, X, [3, 1]), y, s), w)
    d = (X @ w["coef"] + w["bias"])[:, 0] - y
    np.testing.assert_allclose(g["coef"][:, 0], 2 * X.T @ (s * d) / s.sum(), rtol=1e-8)
    np.testing.assert_allclose(g["bias"], [2 * (s * d).sum() / s.sum()], rtol=1e-8)


def test_numpy_forward_matches_the_model(rng):
    """The NumPy forward used by every reference computes what the ONNX models compute."""
    X = rng.normal(size=(N, 3))
    for sizes, act, final in [((3, 5, 2), "Tanh", None), ((3, 5, 4), "Relu", "Softmax"), ((3, 1), "Tanh", None)]:
        model = _model(sizes, act, final, np.float64)
        got = session(model).run(None, {"X": X})[0]
        w = onnxopt.train_initializers(model)
        np.testing.assert_allclose(got, forward(w, X, sizes, act, final), rtol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# every built-in loss, with and without sample weights, float64 (tight) and float32 (loose)
# ---------------------------------------------------------------------------------------------------------

REG, BIN, CLS = (3, 5, 2), (3, 5, 1), (3, 5, 4)

# name -> (loss declaration, reference kind, reference params, model (sizes, activation, final), target kind)
LOSS_CASES = {
    "square_mean": (dsl.losses.square(), "square", {}, (REG, "Tanh", None), "reg"),
    "square_sum": (dsl.losses.square(reduction="sum"), "square", {"reduction": "sum"}, (REG, "Tanh", None), "reg"),
    "square_by_name_relu": ("square", "square", {}, (REG, "Relu", None), "reg"),
    "square_flat_target": (dsl.losses.square(), "square", {}, ((3, 1), "Tanh", None), "flat"),
    "absolute_mean": (dsl.losses.absolute(), "absolute", {}, (REG, "Tanh", None), "reg"),
    "absolute_sum": (dsl.losses.absolute(reduction="sum"), "absolute", {"reduction": "sum"}, (REG, "Tanh", None),
                     "reg"),
    "elastic": (dsl.losses.elastic(l1=0.25, l2=0.75), "elastic", {"l1": 0.25, "l2": 0.75}, (REG, "Tanh", None),
                "reg"),
    "huber": (dsl.losses.huber(delta=0.5), "huber", {"delta": 0.5}, (REG, "Tanh", None), "reg"),
    "huber_sum": (dsl.losses.huber(delta=0.5, reduction="sum"), "huber", {"delta": 0.5, "reduction": "sum"},
                  (REG, "Tanh", None), "reg"),
    "log_logits": (dsl.losses.log(from_logits=True), "log_logits", {}, (BIN, "Tanh", None), "binary"),
    "log_proba_sigmoid": (dsl.losses.log(from_logits=False), "log_proba", {}, (BIN, "Tanh", "Sigmoid"), "binary"),
    "log_proba_softmax": (dsl.losses.log(from_logits=False), "log_proba", {}, ((3, 5, 2), "Tanh", "Softmax"),
                          "binary"),
    "cross_entropy_index": (dsl.losses.cross_entropy(), "ce_index", {}, (CLS, "Tanh", None), "index"),
    "cross_entropy_onehot": (dsl.losses.cross_entropy(one_hot=True), "ce_onehot", {}, (CLS, "Tanh", None),
                             "onehot"),
    "cross_entropy_proba_index": (dsl.losses.cross_entropy(from_logits=False), "nll_index", {},
                                  (CLS, "Relu", "Softmax"), "index"),
    "cross_entropy_proba_onehot": (dsl.losses.cross_entropy(from_logits=False, one_hot=True), "nll_onehot", {},
                                   (CLS, "Tanh", "Softmax"), "onehot"),
}


def _targets(kind, rng, dtype, n_out):
    if kind == "reg":
        return (rng.normal(size=(N, n_out)) * 1.5).astype(dtype)
    if kind == "flat":
        return rng.normal(size=N).astype(dtype)
    if kind == "binary":
        return np.tile([0.0, 1.0], N // 2).astype(dtype)
    idx = np.arange(N) % n_out
    return idx.astype(np.int64) if kind == "index" else np.eye(n_out)[idx].astype(dtype)


@functools.lru_cache(maxsize=None)
def _compiled_loss_step(name, dtype):
    decl, _, _, (sizes, act, final), _ = LOSS_CASES[name]
    return onnxopt.compile_train_step(_model(sizes, act, final, dtype), loss=decl, update="sgd", learning_rate=LR)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("name", list(LOSS_CASES))
def test_builtin_loss_one_step(name, weighted, dtype, rng):
    _, kind, params, (sizes, act, final), target_kind = LOSS_CASES[name]
    step = _compiled_loss_step(name, dtype)
    assert step.sample_weight == "sample_weight" and step.target == "target"
    X = rng.normal(size=(N, sizes[0])).astype(dtype)
    t = _targets(target_kind, rng, dtype, sizes[-1])
    s = rng.uniform(0.2, 2.0, N).astype(dtype) if weighted else None
    out = run_once(step, X, t, sample_weight=s)

    w0 = _f64(step.initial_weights())
    s64 = np.ones(N) if s is None else s.astype(np.float64)
    t64 = t if t.dtype == np.int64 else t.astype(np.float64)

    def f(w):
        return np_loss(kind, forward(w, X.astype(np.float64), sizes, act, final), t64, s64, **params)

    grads = fd_grad(f, w0)
    tol = TOL64 if dtype == np.float64 else TOL32
    assert out["loss"].dtype == dtype and out["loss"].shape == ()
    np.testing.assert_allclose(out["loss"], f(w0), **tol)
    for wname in step.weights:
        assert out[wname + ".new"].dtype == dtype
        np.testing.assert_allclose(out[wname + ".new"], w0[wname] - LR * grads[wname], **tol, err_msg=wname)
    assert out["optim.step.new"] == 1


def test_cross_entropy_on_indices_runs_its_written_gradient():
    """cross_entropy on class indices gives its loss and gradient in its own nodes (``elementwise``: the
    finite-difference checks above cover them); one-hot targets keep the builder's derivation."""
    ops = lambda name: collections.Counter(n.op_type for n in _compiled_loss_step(name, np.float32).model.graph.node)  # noqa: E731
    index, onehot = ops("cross_entropy_index"), ops("cross_entropy_onehot")
    assert index["ScatterElements"] == 1 and index["GatherElementsGrad"] == 0
    assert sum(index.values()) + 5 < sum(onehot.values())


def test_sample_weights_change_the_step(rng):
    """Guards the weighted cases: a non-uniform weight really changes loss and update."""
    step = _compiled_loss_step("square_mean", np.float64)
    X, t = rng.normal(size=(N, 3)), rng.normal(size=(N, 2))
    a = run_once(step, X, t)
    b = run_once(step, X, t, sample_weight=np.linspace(0.1, 3, N))
    c = run_once(step, X, t, sample_weight=np.full(N, 3.0))  # a uniform weight is a plain mean
    assert abs(a["loss"] - b["loss"]) > 1e-3
    np.testing.assert_allclose(c["loss"], a["loss"], rtol=1e-12)
    np.testing.assert_allclose(c["coef_1.new"], a["coef_1.new"], rtol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# penalties
# ---------------------------------------------------------------------------------------------------------

PENALTY_CASES = {
    "l1": (dsl.penalties.l1(alpha=0.0625), 0.0625, 0.0),
    "l2": (dsl.penalties.l2(alpha=0.125), 0.0, 0.125),
    "elastic": (dsl.penalties.elastic(l1=0.0625, l2=0.125), 0.0625, 0.125),
    "l2_by_name": ("l2", 0.0, 1e-4),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", list(PENALTY_CASES))
def test_builtin_penalty_one_step(name, dtype, rng):
    decl, l1, l2 = PENALTY_CASES[name]
    step = onnxopt.compile_train_step(_model(REG, "Tanh", None, dtype), loss="square", penalty=decl,
                                      update="sgd", learning_rate=LR)
    X, t = rng.normal(size=(N, 3)).astype(dtype), rng.normal(size=(N, 2)).astype(dtype)
    out = run_once(step, X, t)
    w0 = _f64(step.initial_weights())

    def f(w):
        data = np_loss("square", forward(w, X.astype(np.float64), REG), t.astype(np.float64), np.ones(N))
        return data + sum(l1 * np.abs(v).sum() + l2 * (v * v).sum() for v in w.values())

    grads = fd_grad(f, w0)
    tol = TOL64 if dtype == np.float64 else TOL32
    np.testing.assert_allclose(out["loss"], f(w0), **tol)
    for wname in step.weights:
        np.testing.assert_allclose(out[wname + ".new"], w0[wname] - LR * grads[wname], **tol, err_msg=wname)


# ---------------------------------------------------------------------------------------------------------
# update rules over 3 consecutive steps
# ---------------------------------------------------------------------------------------------------------

def _torch_update(rule, p, w, g, state, t, lr):
    """torch.optim's formulas for one parameter; ``state`` is updated in place, returns the new weight."""
    if rule == "sgd":
        return w - lr * g
    if rule in ("momentum", "nesterov"):
        v = p["momentum"] * state["velocity"] + g
        state["velocity"] = v
        return w - lr * v if rule == "momentum" else w - lr * (g + p["momentum"] * v)
    if rule == "rmsprop":
        s = p["alpha"] * state["square_avg"] + (1 - p["alpha"]) * g * g
        state["square_avg"] = s
        return w - lr * g / (np.sqrt(s) + p["eps"])
    if rule == "adagrad":
        s = state["sum_squares"] + g * g
        state["sum_squares"] = s
        return w - lr * g / (np.sqrt(s) + p["eps"])
    if rule in ("adam", "adamw"):
        if rule == "adamw":
            w = w * (1 - lr * p["weight_decay"])
        m = p["beta1"] * state["exp_avg"] + (1 - p["beta1"]) * g
        v = p["beta2"] * state["exp_avg_sq"] + (1 - p["beta2"]) * g * g
        state["exp_avg"], state["exp_avg_sq"] = m, v
        bc1, bc2 = 1 - p["beta1"] ** t, 1 - p["beta2"] ** t
        return w - (lr / bc1) * m / (np.sqrt(v) / math.sqrt(bc2) + p["eps"])
    raise AssertionError(rule)


UPDATE_CASES = {
    "sgd": ({}, ()),
    "momentum": ({"momentum": 0.75}, ("velocity",)),
    "nesterov": ({"momentum": 0.5}, ("velocity",)),
    "rmsprop": ({"alpha": 0.875, "eps": 2.0 ** -12}, ("square_avg",)),
    "adagrad": ({"eps": 2.0 ** -12}, ("sum_squares",)),
    "adam": ({"beta1": 0.875, "beta2": 0.984375, "eps": 2.0 ** -20}, ("exp_avg", "exp_avg_sq")),
    "adamw": ({"beta1": 0.75, "beta2": 0.9375, "eps": 2.0 ** -20, "weight_decay": 0.25}, ("exp_avg", "exp_avg_sq")),
    "adam_defaults": (None, ("exp_avg", "exp_avg_sq")),
    "momentum_defaults": (None, ("velocity",)),
}
DEFAULTS = {"adam": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8}, "momentum": {"momentum": 0.9}}


def _three_steps(step, rule, params, lr, clip=None, n_steps=3, seed=0):
    """Runs ``step`` n_steps times on fresh batches; compares with the NumPy reference after each step."""
    rng = np.random.default_rng(seed)
    loop = Loop(step)
    w = _f64(step.initial_weights())
    state = {n: {s: np.zeros_like(w[n]) for s in UPDATE_CASES[rule][1]} if rule in UPDATE_CASES else {}
             for n in step.weights}
    for k in range(1, n_steps + 1):
        X, t = rng.normal(size=(N, 3)), rng.normal(size=(N, 2))
        out = loop.run(X, t)

        def f(ww):
            return np_loss("square", forward(ww, X, REG), t, np.ones(N))

        np.testing.assert_allclose(out["loss"], f(w), **TOL64, err_msg=f"loss at step {k}")
        grads = fd_grad(f, w)
        if clip is not None:
            norm = math.sqrt(sum((g * g).sum() for g in grads.values()))
            grads = {n: g * min(1.0, clip / (norm + 1e-6)) for n, g in grads.items()}
        base = rule.split("_")[0]
        w = {n: _torch_update(base, params, w[n], grads[n], state[n], k, lr) for n in step.weights}
        for n in step.weights:
            np.testing.assert_allclose(out[n + ".new"], w[n], **TOL64, err_msg=f"{n} at step {k}")
            for s, value in state[n].items():
                np.testing.assert_allclose(out[f"{n}.{s}.new"], value, **TOL64, err_msg=f"{n}.{s} at step {k}")
        assert out["optim.step.new"] == k
    return w


@pytest.mark.parametrize("rule", list(UPDATE_CASES))
def test_update_rule_three_steps(rule):
    params, state_names = UPDATE_CASES[rule]
    base = rule.split("_")[0]
    decl = getattr(dsl.updates, base)(**params) if params is not None else base
    params = params if params is not None else DEFAULTS[base]
    step = onnxopt.compile_train_step(_model(REG, "Tanh", None, np.float64), loss="square", update=decl,
                                      learning_rate=0.125)
    expected_state = [f"{w}.{s}" for w in step.weights for s in state_names]
    assert sorted(step.state) == sorted(expected_state + ["optim.step"])
    _three_steps(step, rule, params, 0.125)


@pytest.mark.parametrize("clip", [0.1, 1e3], ids=["clipped", "not_clipped"])
def test_global_norm_clipping(clip):
    step = onnxopt.compile_train_step(_model(REG, "Tanh", None, np.float64), loss="square",
                                      update=dsl.updates.sgd(clip_norm=clip), learning_rate=LR)
    _three_steps(step, "sgd", {}, LR, clip=clip, n_steps=2)


def test_clipping_changes_the_update(rng):
    """Guards the clipped case: with clip_norm=0.1 the update is far smaller than plain SGD's."""
    X, t = rng.normal(size=(N, 3)), rng.normal(size=(N, 2))
    model = _model(REG, "Tanh", None, np.float64)
    plain = run_once(onnxopt.compile_train_step(model, update="sgd", learning_rate=LR), X, t)
    clipped = run_once(onnxopt.compile_train_step(model, update=dsl.updates.sgd(clip_norm=0.1), learning_rate=LR), X, t)
    w0 = onnxopt.train_initializers(model)
    moved = lambda out: math.sqrt(sum(((out[n + ".new"] - w0[n]) ** 2).sum() for n in w0))  # noqa: E731
    assert moved(clipped) == pytest.approx(LR * 0.1, rel=1e-4)
    assert moved(plain) > 2 * moved(clipped)


def test_clipping_with_momentum():
    step = onnxopt.compile_train_step(_model(REG, "Tanh", None, np.float64), loss="square",
                                      update=dsl.updates.momentum(momentum=0.5, clip_norm=0.25), learning_rate=LR)
    _three_steps(step, "momentum", {"momentum": 0.5}, LR, clip=0.25)


# ---------------------------------------------------------------------------------------------------------
# learning-rate schedules, observed through an SGD step
# ---------------------------------------------------------------------------------------------------------

from helpers import cosine_ref as _cosine  # noqa: E402


SCHEDULE_CASES = {
    "float": (0.25, lambda t: 0.25),
    "constant": (dsl.schedules.constant(eta0=0.375), lambda t: 0.375),
    "invscaling": (dsl.schedules.invscaling(eta0=0.5, power_t=0.5), lambda t: 0.5 / t ** 0.5),
    "invscaling_by_name": ("invscaling", lambda t: 0.01 / t ** 0.25),
    "step": (dsl.schedules.step(eta0=0.5, step_size=4, gamma=0.25), lambda t: 0.5 * 0.25 ** ((t - 1) // 4)),
    "exponential": (dsl.schedules.exponential(eta0=0.5, gamma=0.75), lambda t: 0.5 * 0.75 ** (t - 1)),
    "cosine": (dsl.schedules.cosine(eta0=0.5, total=20), lambda t: _cosine(t, 0.5, 20, 0, 0.0)),
    "cosine_warmup": (dsl.schedules.cosine(eta0=0.5, total=20, warmup=4, eta_min=0.125),
                      lambda t: _cosine(t, 0.5, 20, 4, 0.125)),
}
STEPS_DONE = [0, 1, 3, 4, 8, 15, 19, 30]


@pytest.mark.parametrize("name", list(SCHEDULE_CASES))
def test_schedule_through_sgd(name, rng):
    sched, ref = SCHEDULE_CASES[name]
    step = onnxopt.compile_train_step(linear_regression(3, dtype=np.float64, seed=2), loss="square", update="sgd",
                                      learning_rate=sched)
    X, t = rng.normal(size=(N, 3)), rng.normal(size=N)
    w0 = _f64(step.initial_weights())
    grads = fd_grad(lambda w: np_loss("square", forward(w, X, [3, 1]), t, np.ones(N)), w0)
    lrs = []
    for done in STEPS_DONE:
        out = run_once(step, X, t, step_count=done)
        assert out["optim.step.new"] == done + 1
        lr = ref(done + 1)  # the schedule sees the 1-based number of the step being taken
        lrs.append(lr)
        for n in step.weights:
            # Cos runs in float32 inside the cosine schedule (documented), hence the absolute tolerance
            np.testing.assert_allclose(out[n + ".new"], w0[n] - lr * grads[n], rtol=1e-6, atol=1e-7,
                                       err_msg=f"{n} after {done} steps")
    if name not in ("float", "constant"):
        assert len(set(np.round(lrs, 12))) > 2, "the schedule must vary over these steps"


# ---------------------------------------------------------------------------------------------------------
# float32 models with stateful rules, and a save/load round trip
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", ["momentum", "adam"])
def test_float32_stateful_rule_runs_and_matches(rule, rng):
    params = {"momentum": {"momentum": 0.5}, "adam": {"beta1": 0.875, "beta2": 0.984375, "eps": 2.0 ** -20}}[rule]
    step = onnxopt.compile_train_step(_model(REG, "Tanh", None, np.float32), loss="square",
                                      update=getattr(dsl.updates, rule)(**params), learning_rate=0.125)
    loop = Loop(step)
    w = _f64(step.initial_weights())
    state = {n: {s: np.zeros_like(w[n]) for s in UPDATE_CASES[rule][1]} for n in step.weights}
    for k in range(1, 4):
        X, t = rng.normal(size=(N, 3)).astype(np.float32), rng.normal(size=(N, 2)).astype(np.float32)
        out = loop.run(X, t)
        grads = fd_grad(lambda ww: np_loss("square", forward(ww, X.astype(np.float64), REG),
                                           t.astype(np.float64), np.ones(N)), w)
        w = {n: _torch_update(rule, params, w[n], grads[n], state[n], k, 0.125) for n in step.weights}
        for n in step.weights:
            assert out[n + ".new"].dtype == np.float32
            np.testing.assert_allclose(out[n + ".new"], w[n], **TOL32, err_msg=f"{n} at step {k}")


def test_saved_step_runs_the_same(tmp_path, rng):
    step = onnxopt.compile_train_step(_model(REG, "Tanh", None, np.float64), loss="huber", update="adam",
                                      learning_rate=0.125)
    path = tmp_path / "step.onnx"
    step.save(path)
    loaded = onnxopt.TrainStep.load(path)
    assert loaded.weights == step.weights and loaded.state == step.state
    X, t = rng.normal(size=(N, 3)), rng.normal(size=(N, 2))
    a, b = run_once(step, X, t), run_once(loaded, X, t)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


# ---------------------------------------------------------------------------------------------------------
# user-defined loss, update rule and penalty
# ---------------------------------------------------------------------------------------------------------

@dsl.loss
def user_huber(y, t, delta: float = 1.0):
    d = op.Sub(y, op.Reshape(op.CastLike(t, y), op.Shape(y)))
    a = op.Abs(d)
    dl = op.CastLike(delta, d)
    half = op.CastLike(0.5, d)
    e = op.Where(op.LessOrEqual(a, dl), op.Mul(half, op.Mul(d, d)), op.Mul(dl, op.Sub(a, op.Mul(half, dl))))
    return op.ReduceMean(e)


def user_huber_grad(y, t, delta: float = 1.0):
    d = op.Sub(y, op.Reshape(op.CastLike(t, y), op.Shape(y)))
    dl = op.CastLike(delta, d)
    return op.Div(op.Clip(d, op.Neg(dl), dl), op.CastLike(op.Size(d), d))


# NOTE: the same loss declared again, with its hand-written gradient
user_huber_with_grad = dsl.loss(grad=user_huber_grad)(user_huber.fn)


@dsl.update_rule(state=["velocity"])
def heavy_ball(w, g, lr, velocity, momentum: float = 0.9):
    v = op.Sub(op.Mul(op.CastLike(momentum, w), velocity), op.Mul(lr, g))
    return op.Add(w, v), v


@dsl.update_rule(state=["avg"])
def averaged_sign(w, g, lr, avg, step, beta: float = 0.5):
    """A made-up rule reading the step number: avg ← β·avg + g; w ← w − lr·sign(avg)/√t."""
    a = op.Add(op.Mul(op.CastLike(beta, w), avg), g)
    return op.Sub(w, op.Div(op.Mul(lr, op.Sign(a)), op.Sqrt(step))), a


@dsl.penalty
def user_l2(w, alpha: float = 0.5):
    return op.Mul(op.CastLike(alpha, w), op.ReduceSum(op.Mul(w, w), keepdims=0))


def _regression_batches(seed, dtype, n_batches, n=32):
    """A learnable target: a fixed random MLP-ish function of X plus small noise."""
    rng = np.random.default_rng(seed)
    A = rng.normal(size=(3, 2))
    for _ in range(n_batches):
        X = rng.normal(size=(n, 3))
        yield X.astype(dtype), (np.tanh(X @ A) * 2 + 0.05 * rng.normal(size=(n, 2))).astype(dtype)


def _train(step, n_steps=50, dtype=np.float64):
    loop = Loop(step)
    return [float(loop.run(X, t)["loss"]) for X, t in _regression_batches(3, dtype, n_steps)]


def _assert_decreases(losses):
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert np.all(np.isfinite(losses))
    assert last < 0.7 * first, f"loss went from {first:.4g} to {last:.4g}"


@pytest.mark.parametrize("with_grad", [False, True], ids=["derived_grad", "hand_grad"])
def test_user_loss_one_step_and_training(with_grad, rng):
    decl = (user_huber_with_grad if with_grad else user_huber)(delta=0.5)
    assert (decl.grad is not None) == with_grad
    step = onnxopt.compile_train_step(_model(REG, "Tanh", None, np.float64), loss=decl, update="sgd",
                                      learning_rate=LR)
    assert step.sample_weight is None  # a two-input loss takes no sample weight
    X, t = rng.normal(size=(N, 3)), rng.normal(size=(N, 2)) * 1.5
    out = run_once(step, X, t)
    w0 = _f64(step.initial_weights())

    def f(w):
        return _huber(forward(w, X, REG) - t, 0.5).mean()

    grads = fd_grad(f, w0)
    np.testing.assert_allclose(out["loss"], f(w0), **TOL64)
    for n in step.weights:
        np.testing.assert_allclose(out[n + ".new"], w0[n] - LR * grads[n], **TOL64, err_msg=n)
    _assert_decreases(_train(step))


def test_user_loss_with_sample_weight(rng):
    @dsl.loss
    def weighted_sq(y, t, sample_weight):
        d = op.Sub(y, t)
        per = op.ReduceSum(op.Mul(d, d), op.Constant(value_ints=[1]), keepdims=0)
        return op.Div(op.ReduceSum(op.Mul(per, sample_weight), keepdims=0), op.ReduceSum(sample_weight, keepdims=0))

    step = onnxopt.compile_train_step(_model(REG, "Tanh", None, np.float64), loss=weighted_sq, update="sgd",
                                      learning_rate=LR)
    assert step.sample_weight == "sample_weight"
    X, t, s = rng.normal(size=(N, 3)), rng.normal(size=(N, 2)), rng.uniform(0.2, 2, N)
    out = run_once(step, X, t, sample_weight=s)
    w0 = _f64(step.initial_weights())

    def f(w):
        return (((forward(w, X, REG) - t) ** 2).sum(axis=1) * s).sum() / s.sum()

    grads = fd_grad(f, w0)
    np.testing.assert_allclose(out["loss"], f(w0), **TOL64)
    for n in step.weights:
        np.testing.assert_allclose(out[n + ".new"], w0[n] - LR * grads[n], **TOL64, err_msg=n)


def test_user_update_rule_steps_and_training():
    rule = heavy_ball(momentum=0.5)
    step = onnxopt.compile_train_step(_model(REG, "Tanh", None, np.float64), loss="square", update=rule,
                                      learning_rate=0.0625)
    assert sorted(step.state) == sorted([f"{w}.velocity" for w in step.weights] + ["optim.step"])
    loop = Loop(step)
    w = _f64(step.initial_weights())
    v = {n: np.zeros_like(w[n]) for n in w}
    for k, (X, t) in enumerate(_regression_batches(5, np.float64, 2), start=1):
        out = loop.run(X, t)
        grads = fd_grad(lambda ww: np_loss("square", forward(ww, X, REG), t, np.ones(len(X))), w)
        for n in step.weights:
            v[n] = 0.5 * v[n] - 0.0625 * grads[n]
            w[n] = w[n] + v[n]
            np.testing.assert_allclose(out[n + ".new"], w[n], **TOL64, err_msg=f"{n} at step {k}")
            np.testing.assert_allclose(out[n + ".velocity.new"], v[n], **TOL64, err_msg=f"{n} at step {k}")
    _assert_decreases(_train(step))


def test_user_update_rule_reading_the_step_number():
    step = onnxopt.compile_train_step(_model(REG, "Tanh", None, np.float64), loss="square",
                                      update=averaged_sign(beta=0.25), learning_rate=0.03125)
    assert averaged_sign.uses_step
    loop = Loop(step)
    w = _f64(step.initial_weights())
    avg = {n: np.zeros_like(w[n]) for n in w}
    for k, (X, t) in enumerate(_regression_batches(6, np.float64, 3), start=1):
        out = loop.run(X, t)
        grads = fd_grad(lambda ww: np_loss("square", forward(ww, X, REG), t, np.ones(len(X))), w)
        for n in step.weights:
            avg[n] = 0.25 * avg[n] + grads[n]
            w[n] = w[n] - 0.03125 * np.sign(avg[n]) / math.sqrt(k)
            np.testing.assert_allclose(out[n + ".new"], w[n], **TOL64, err_msg=f"{n} at step {k}")
    _assert_decreases(_train(step))


def test_user_penalty_derived_gradient(rng):
    step = onnxopt.compile_train_step(_model(REG, "Tanh", None, np.float64), loss="square",
                                      penalty=user_l2(alpha=0.25), update="sgd", learning_rate=LR)
    X, t = rng.normal(size=(N, 3)), rng.normal(size=(N, 2))
    out = run_once(step, X, t)
    w0 = _f64(step.initial_weights())

    def f(w):
        return np_loss("square", forward(w, X, REG), t, np.ones(N)) + sum(0.25 * (v * v).sum() for v in w.values())

    grads = fd_grad(f, w0)
    np.testing.assert_allclose(out["loss"], f(w0), **TOL64)
    for n in step.weights:
        np.testing.assert_allclose(out[n + ".new"], w0[n] - LR * grads[n], **TOL64, err_msg=n)


def test_weight_used_twice_by_one_node(rng):
    """Y = X @ (W*W) + b: a node reading the same weight twice (the builder needs it split, see rules.py)."""
    import onnx
    from onnx import helper as oh, numpy_helper as nh

    W, b = rng.normal(size=(3, 2)), rng.normal(size=2)
    graph = oh.make_graph(
        [oh.make_node("Mul", ["W", "W"], ["W2"]), oh.make_node("MatMul", ["X", "W2"], ["h"]),
         oh.make_node("Add", ["h", "b"], ["Y"])], "sq",
        [oh.make_tensor_value_info("X", onnx.TensorProto.DOUBLE, ["N", 3])],
        [oh.make_tensor_value_info("Y", onnx.TensorProto.DOUBLE, ["N", 2])],
        [nh.from_array(W, "W"), nh.from_array(b, "b")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=10)
    step = onnxopt.compile_train_step(model, loss="square", update="sgd", learning_rate=LR)
    X, t = rng.normal(size=(N, 3)), rng.normal(size=(N, 2))
    out = run_once(step, X, t)

    def f(w):
        return np_loss("square", X @ (w["W"] * w["W"]) + w["b"], t, np.ones(N))

    w0 = {"W": W, "b": b}
    grads = fd_grad(f, w0)
    np.testing.assert_allclose(out["loss"], f(w0), **TOL64)
    for n in ("W", "b"):
        np.testing.assert_allclose(out[n + ".new"], w0[n] - LR * grads[n], **TOL64, err_msg=n)


def test_user_pieces_together_in_float32():
    step = onnxopt.compile_train_step(_model(REG, "Tanh", None, np.float32), loss=user_huber_with_grad,
                                      update=heavy_ball(momentum=0.5), penalty=user_l2(alpha=1e-4),
                                      learning_rate=dsl.schedules.exponential(eta0=0.0625, gamma=0.995))
    losses = _train(step, dtype=np.float32)
    _assert_decreases(losses)
