"""Step-by-step parity with torch.optim (in the spirit of tinygrad's test_optim).

The same small MLP (built with ``examples.mlp``) is trained for N steps twice on the same batch: once by the
fused onnxopt step run in a loop with a plain InferenceSession (every ``*.new`` output fed back), once by a
``torch.nn.Module`` holding identical initial weights and a ``torch.optim`` optimizer with the same
hyper-parameters. Weights (and, for the loss tests, the loss value) are compared after every step.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import importorskip  # NOTE: fails instead of skipping under CI=true
torch = importorskip("torch")

import onnxopt  # noqa: E402
from onnxopt import dsl  # noqa: E402
from onnxopt.examples import mlp  # noqa: E402
from helpers import session  # noqa: E402

N_STEPS = 10
N_SAMPLES = 16
REG_SIZES = [5, 8, 3, 1]
CLS_SIZES = [5, 8, 3]
TOL = {np.float32: dict(rtol=1e-5, atol=1e-7), np.float64: dict(rtol=1e-10, atol=1e-13)}

torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------------------
# the two trainers


def _data(kind: str, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(N_SAMPLES, REG_SIZES[0])).astype(dtype)
    if kind == "regression":
        y = rng.normal(size=N_SAMPLES).astype(dtype)
    elif kind == "binary":
        y = rng.integers(0, 2, size=N_SAMPLES).astype(dtype)
    elif kind == "classes":
        y = rng.integers(0, CLS_SIZES[-1], size=N_SAMPLES).astype(np.int64)
    else:  # pragma: no cover
        raise ValueError(kind)
    return X, y


def run_onnxopt(step: onnxopt.TrainStep, X: np.ndarray, y: np.ndarray, n: int = N_STEPS):
    """N runs of the fused model, each output ``W.new`` / ``W.<state>.new`` / ``optim.step.new`` fed back."""
    sess = session(step.model)
    out_names = [o.name for o in sess.get_outputs()]
    weights = step.initial_weights()
    feeds = {step.inputs[0]: X, **weights}
    if step.target:
        feeds[step.target] = y
    if step.sample_weight:
        feeds[step.sample_weight] = np.ones(len(X), X.dtype)
    for name in step.state:
        if name == "optim.step":
            feeds[name] = np.array(0, np.int64)
        else:
            feeds[name] = np.zeros_like(weights[name.rsplit(".", 1)[0]])
    history = []
    for i in range(n):
        out = dict(zip(out_names, sess.run(None, feeds)))
        for src, dst in step.carry.items():
            feeds[src] = out[dst]
        assert int(out["optim.step.new"]) == i + 1
        history.append((float(out["loss"]), {w: out[w + ".new"] for w in step.weights}))
    return history


class TorchMLP(torch.nn.Module):
    """``examples.mlp`` in torch: Linear + ReLU layers, weights copied from the ONNX initializers."""

    def __init__(self, weights: dict[str, np.ndarray], n_layers: int):
        super().__init__()
        self.n_layers = n_layers
        self.layers = torch.nn.ModuleList()
        for i in range(n_layers):
            coef, bias = weights[f"coef_{i}"], weights[f"bias_{i}"]
            layer = torch.nn.Linear(coef.shape[0], coef.shape[1], dtype=torch.from_numpy(coef.copy()).dtype)
            with torch.no_grad():
                layer.weight.copy_(torch.from_numpy(coef.T.copy()))  # torch stores (n_out, n_in)
                layer.bias.copy_(torch.from_numpy(bias.copy()))
            self.layers.append(layer)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < self.n_layers - 1:
                x = torch.relu(x)
        return x

    def onnx_weights(self) -> dict[str, np.ndarray]:
        out = {}
        for i, layer in enumerate(self.layers):
            out[f"coef_{i}"] = layer.weight.detach().numpy().T.copy()
            out[f"bias_{i}"] = layer.bias.detach().numpy().copy()
        return out


def run_torch(net: TorchMLP, make_opt, loss_fn, X, y, n: int = N_STEPS, clip_norm=None, make_sched=None):
    opt = make_opt(net.parameters())
    sched = make_sched(opt) if make_sched is not None else None
    Xt, yt = torch.from_numpy(X), torch.from_numpy(y)
    history = []
    for _ in range(n):
        opt.zero_grad()
        loss = loss_fn(net(Xt), yt)
        loss.backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip_norm)
        opt.step()
        if sched is not None:
            sched.step()
        history.append((float(loss.detach()), net.onnx_weights()))
    return history


def compare(sizes, dtype, make_opt, torch_loss, kind="regression", loss="square", update="sgd", penalty=None,
            learning_rate=1e-2, clip_norm=None, make_sched=None, check_loss=False, tol=None):
    """Trains both for N_STEPS and compares the weights (and the loss) after every step."""
    model = mlp(sizes, activation="Relu", dtype=dtype, seed=0)
    step = onnxopt.compile_train_step(model, loss=loss, update=update, penalty=penalty, learning_rate=learning_rate)
    assert step.weights == [n for i in range(len(sizes) - 1) for n in (f"coef_{i}", f"bias_{i}")]
    X, y = _data(kind, dtype)
    ours = run_onnxopt(step, X, y)
    net = TorchMLP(step.initial_weights(), len(sizes) - 1)
    theirs = run_torch(net, make_opt, torch_loss, X, y, clip_norm=clip_norm, make_sched=make_sched)
    tol = tol or TOL[dtype]
    moved = False
    for i, ((l1, w1), (l2, w2)) in enumerate(zip(ours, theirs)):
        if check_loss:
            np.testing.assert_allclose(l1, l2, rtol=tol["rtol"], err_msg=f"loss at step {i + 1}")
        for name in step.weights:
            assert w1[name].dtype == dtype
            np.testing.assert_allclose(w1[name], w2[name], **tol, err_msg=f"{name} after step {i + 1}")
        moved = moved or any(not np.array_equal(w1[n], step.initial_weights()[n]) for n in step.weights)
    assert moved, "the weights never changed: the comparison would prove nothing"
    # the trajectory must not be trivially flat: the loss has changed over the run
    assert ours[0][0] != ours[-1][0]
    return ours, theirs


def _mse_col(out, y):
    return torch.nn.functional.mse_loss(out, y.reshape(-1, 1))


SGD = lambda lr: (lambda p: torch.optim.SGD(p, lr=lr))  # noqa: E731


# ---------------------------------------------------------------------------------------------------------
# update rules, float32, MSE on a 5-8-3-1 ReLU MLP

OPTIMIZERS = {
    "sgd": (dsl.updates.sgd(), 0.05, lambda p: torch.optim.SGD(p, lr=0.05), None),
    "momentum": (dsl.updates.momentum(momentum=0.9), 0.02, lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9), None),
    "nesterov": (dsl.updates.nesterov(momentum=0.9), 0.02,
                 lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9, nesterov=True), None),
    "adam": (dsl.updates.adam(), 0.01, lambda p: torch.optim.Adam(p, lr=0.01), None),
    "adam_betas": (dsl.updates.adam(beta1=0.5, beta2=0.9, eps=1e-6), 0.01,
                   lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.5, 0.9), eps=1e-6), None),
    "adamw": (dsl.updates.adamw(weight_decay=0.1), 0.01,
              lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1), None),
    "rmsprop": (dsl.updates.rmsprop(), 0.001, lambda p: torch.optim.RMSprop(p, lr=0.001), None),
    "rmsprop_alpha": (dsl.updates.rmsprop(alpha=0.9, eps=1e-6), 0.001,
                      lambda p: torch.optim.RMSprop(p, lr=0.001, alpha=0.9, eps=1e-6), None),
    "adagrad": (dsl.updates.adagrad(), 0.05, lambda p: torch.optim.Adagrad(p, lr=0.05), None),
    # eps comparable to √v: where eps enters the denominator shows at float32 precision only then
    "adam_large_eps": (dsl.updates.adam(eps=0.1), 0.01, lambda p: torch.optim.Adam(p, lr=0.01, eps=0.1), None),
    "rmsprop_large_eps": (dsl.updates.rmsprop(eps=0.1), 0.001, lambda p: torch.optim.RMSprop(p, lr=0.001, eps=0.1),
                          None),
    "adagrad_large_eps": (dsl.updates.adagrad(eps=0.1), 0.05, lambda p: torch.optim.Adagrad(p, lr=0.05, eps=0.1),
                          None),
    "sgd_clip_norm": (dsl.updates.sgd(clip_norm=0.1), 0.05, lambda p: torch.optim.SGD(p, lr=0.05), 0.1),
    "momentum_clip_norm": (dsl.updates.momentum(momentum=0.9, clip_norm=0.1), 0.05,
                           lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), 0.1),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_update_rule_matches_torch_optim(name):
    update, lr, make_opt, clip = OPTIMIZERS[name]
    compare(REG_SIZES, np.float32, make_opt, _mse_col, update=update, learning_rate=lr, clip_norm=clip,
            check_loss=True)


def test_clip_norm_is_active():
    """The clip tests above only mean something if the global gradient norm exceeds clip_norm."""
    X, y = _data("regression", np.float32)
    step = onnxopt.compile_train_step(mlp(REG_SIZES, dtype=np.float32, seed=0), loss="square")
    net = TorchMLP(step.initial_weights(), len(REG_SIZES) - 1)
    _mse_col(net(torch.from_numpy(X)), torch.from_numpy(y)).backward()
    norm = torch.sqrt(sum((p.grad ** 2).sum() for p in net.parameters()))
    assert norm > 0.1 * 2


def test_momentum_with_l2_penalty_matches_torch_weight_decay():
    """penalty l2(alpha) adds alpha·Σw² to the loss: gradient 2·alpha·w, torch's weight_decay=2·alpha."""
    alpha = 0.05
    ours, _ = compare(REG_SIZES, np.float32, lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9, weight_decay=2 * alpha),
                      _mse_col, update=dsl.updates.momentum(momentum=0.9), penalty=dsl.penalties.l2(alpha),
                      learning_rate=0.02)
    # the reported loss includes the penalty (on the weights before the update)
    model = mlp(REG_SIZES, dtype=np.float32, seed=0)
    w0 = onnxopt.train_initializers(model)
    X, y = _data("regression", np.float32)
    net = TorchMLP(w0, len(REG_SIZES) - 1)
    with torch.no_grad():
        expected = float(_mse_col(net(torch.from_numpy(X)), torch.from_numpy(y)))
    expected += alpha * sum(float((v.astype(np.float64) ** 2).sum()) for v in w0.values())
    np.testing.assert_allclose(ours[0][0], expected, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# losses, each with sgd; loss values compared too

LOSSES = {
    "square": ("regression", REG_SIZES, dsl.losses.square(), _mse_col),
    "absolute": ("regression", REG_SIZES, dsl.losses.absolute(),
                 lambda out, y: torch.nn.functional.l1_loss(out, y.reshape(-1, 1))),
    "huber": ("regression", REG_SIZES, dsl.losses.huber(delta=0.5),
              lambda out, y: torch.nn.functional.huber_loss(out, y.reshape(-1, 1), delta=0.5)),
    "log_from_logits": ("binary", REG_SIZES, dsl.losses.log(from_logits=True),
                        lambda out, y: torch.nn.functional.binary_cross_entropy_with_logits(out, y.reshape(-1, 1))),
    "cross_entropy_index": ("classes", CLS_SIZES, dsl.losses.cross_entropy(),
                            lambda out, y: torch.nn.functional.cross_entropy(out, y)),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_matches_torch(name):
    kind, sizes, loss, torch_loss = LOSSES[name]
    compare(sizes, np.float32, SGD(0.1), torch_loss, kind=kind, loss=loss, update="sgd", learning_rate=0.1,
            check_loss=True)


def test_huber_uses_both_branches():
    """The huber test is only meaningful if some residuals lie on each side of delta."""
    X, y = _data("regression", np.float32)
    net = TorchMLP(onnxopt.train_initializers(mlp(REG_SIZES, dtype=np.float32, seed=0)), len(REG_SIZES) - 1)
    with torch.no_grad():
        d = np.abs(net(torch.from_numpy(X)).numpy()[:, 0] - y)
    assert (d <= 0.5).any() and (d > 0.5).any()


# ---------------------------------------------------------------------------------------------------------
# learning-rate schedules vs torch.optim.lr_scheduler (scheduler.step() after every optimizer step)

SCHEDULES = {
    "step_sgd": (dsl.schedules.step(eta0=0.05, step_size=3, gamma=0.5), "sgd", SGD(0.05),
                 lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)),
    "exponential_sgd": (dsl.schedules.exponential(eta0=0.05, gamma=0.8), "sgd", SGD(0.05),
                        lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8)),
    "step_momentum": (dsl.schedules.step(eta0=0.02, step_size=4, gamma=0.1), dsl.updates.momentum(momentum=0.9),
                      lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9),
                      lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.1)),
    "exponential_adam": (dsl.schedules.exponential(eta0=0.01, gamma=0.7), "adam", lambda p: torch.optim.Adam(p, lr=0.01),
                         lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.7)),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_matches_torch_lr_scheduler(name):
    schedule, update, make_opt, make_sched = SCHEDULES[name]
    compare(REG_SIZES, np.float32, make_opt, _mse_col, update=update, learning_rate=schedule, make_sched=make_sched,
            check_loss=True)


# ---------------------------------------------------------------------------------------------------------
# float64: hyper-parameters reach a double graph as exact doubles, so parity holds to ~1e-10


FLOAT64 = {
    "sgd": (dsl.updates.sgd(), 0.05, lambda p: torch.optim.SGD(p, lr=0.05)),
    "momentum": (dsl.updates.momentum(momentum=0.9), 0.02, lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9)),
    "adam": (dsl.updates.adam(), 0.01, lambda p: torch.optim.Adam(p, lr=0.01)),
    "adamw_clip": (dsl.updates.adamw(beta1=0.8, beta2=0.99, weight_decay=0.1, clip_norm=0.1), 0.01,
                   lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.99), weight_decay=0.1)),
}


@pytest.mark.parametrize("name", list(FLOAT64))
def test_float64_matches_torch(name):
    update, lr, make_opt = FLOAT64[name]
    compare(REG_SIZES, np.float64, make_opt, _mse_col, update=update, learning_rate=lr, check_loss=True,
            clip_norm=update.clip_norm)


def test_float64_exponential_schedule_and_l2_penalty_match_torch():
    compare(REG_SIZES, np.float64, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.02),
            _mse_col, update=dsl.updates.nesterov(momentum=0.9), penalty=dsl.penalties.l2(0.01),
            learning_rate=dsl.schedules.exponential(eta0=0.05, gamma=0.9),
            make_sched=lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9))


def test_float64_cross_entropy_matches_torch():
    compare(CLS_SIZES, np.float64, SGD(0.1), lambda out, y: torch.nn.functional.cross_entropy(out, y), kind="classes",
            loss=dsl.losses.cross_entropy(), learning_rate=0.1, check_loss=True)
