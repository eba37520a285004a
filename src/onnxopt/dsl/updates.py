"""Built-in update rules, following torch.optim's formulas so runs can be compared step by step.

Sorted by increasing complexity. Every state tensor starts at zero; ``step`` is the 1-based step number t.
"""

from __future__ import annotations

from onnxopt.dsl.core import DOMAIN, UpdateRule, op, script
from onnxopt.errors import DslError

__all__ = ["sgd", "momentum", "nesterov", "rmsprop", "adagrad", "adam", "adamw", "UPDATES"]


@script(DOMAIN)
def sgd_rule(w, g, lr):
    """w ← w − lr·g."""
    return op.Sub(w, op.Mul(lr, g))


@script(DOMAIN)
def momentum_rule(w, g, lr, velocity, momentum: float = 0.9):
    """v ← μ·v + g; w ← w − lr·v (torch.optim.SGD, dampening 0). NOTE: v is zero on step 1, so v = g there."""
    v = op.Add(op.Mul(op.CastLike(momentum, w), velocity), g)
    return op.Sub(w, op.Mul(lr, v)), v


@script(DOMAIN)
def nesterov_rule(w, g, lr, velocity, momentum: float = 0.9):
    """v ← μ·v + g; w ← w − lr·(g + μ·v) (torch.optim.SGD with nesterov=True)."""
    mu = op.CastLike(momentum, w)
    v = op.Add(op.Mul(mu, velocity), g)
    return op.Sub(w, op.Mul(lr, op.Add(g, op.Mul(mu, v)))), v


@script(DOMAIN)
def rmsprop_rule(w, g, lr, square_avg, alpha: float = 0.99, eps: float = 1e-8):
    """s ← α·s + (1−α)·g²; w ← w − lr·g / (√s + eps) (torch.optim.RMSprop)."""
    a = op.CastLike(alpha, w)
    s = op.Add(op.Mul(a, square_avg), op.Mul(op.Sub(op.CastLike(1.0, w), a), op.Mul(g, g)))
    return op.Sub(w, op.Div(op.Mul(lr, g), op.Add(op.Sqrt(s), op.CastLike(eps, w)))), s


@script(DOMAIN)
def adagrad_rule(w, g, lr, sum_squares, eps: float = 1e-10):
    """s ← s + g²; w ← w − lr·g / (√s + eps) (torch.optim.Adagrad)."""
    s = op.Add(sum_squares, op.Mul(g, g))
    return op.Sub(w, op.Div(op.Mul(lr, g), op.Add(op.Sqrt(s), op.CastLike(eps, w)))), s


@script(DOMAIN)
def adam_rule(w, g, lr, exp_avg, exp_avg_sq, step, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
              weight_decay: float = 0.0):
    """w ← w·(1 − lr·λ); m ← β1·m + (1−β1)·g; v ← β2·v + (1−β2)·g²;
    w ← w − (lr / (1−β1ᵗ))·m / (√v / √(1−β2ᵗ) + eps) (torch.optim.Adam / AdamW's decoupled decay λ)."""
    one = op.CastLike(1.0, w)
    b1 = op.CastLike(beta1, w)
    b2 = op.CastLike(beta2, w)
    w0 = op.Mul(w, op.Sub(one, op.Mul(lr, op.CastLike(weight_decay, w))))
    m = op.Add(op.Mul(b1, exp_avg), op.Mul(op.Sub(one, b1), g))
    v = op.Add(op.Mul(b2, exp_avg_sq), op.Mul(op.Sub(one, b2), op.Mul(g, g)))
    t = op.CastLike(step, w)
    step_size = op.Div(lr, op.Sub(one, op.Pow(b1, t)))
    denom = op.Add(op.Div(op.Sqrt(v), op.Sqrt(op.Sub(one, op.Pow(b2, t)))), op.CastLike(eps, w))
    return op.Sub(w0, op.Mul(step_size, op.Div(m, denom))), m, v


_SGD = UpdateRule("sgd", sgd_rule)
_MOMENTUM = UpdateRule("momentum", momentum_rule, state=("velocity",))
_NESTEROV = UpdateRule("nesterov", nesterov_rule, state=("velocity",))
_RMSPROP = UpdateRule("rmsprop", rmsprop_rule, state=("square_avg",))
_ADAGRAD = UpdateRule("adagrad", adagrad_rule, state=("sum_squares",))
_ADAM = UpdateRule("adam", adam_rule, state=("exp_avg", "exp_avg_sq"))


def _check(name: str, low: float, high: float, **values: float) -> None:
    for key, value in values.items():
        if not isinstance(value, (int, float)) or not low <= value < high:
            raise DslError(f"{name}: {key} must be in [{low}, {high}), got {value!r}")


def sgd(clip_norm: float | None = None) -> UpdateRule:
    """Plain stochastic gradient descent."""
    return _SGD(clip_norm=clip_norm)


def momentum(momentum: float = 0.9, clip_norm: float | None = None) -> UpdateRule:
    """SGD with heavy-ball momentum."""
    _check("momentum", 0.0, 1.0, momentum=momentum)
    return _MOMENTUM(momentum=momentum, clip_norm=clip_norm)


def nesterov(momentum: float = 0.9, clip_norm: float | None = None) -> UpdateRule:
    """SGD with Nesterov momentum."""
    _check("nesterov", 0.0, 1.0, momentum=momentum)
    return _NESTEROV(momentum=momentum, clip_norm=clip_norm)


def rmsprop(alpha: float = 0.99, eps: float = 1e-8, clip_norm: float | None = None) -> UpdateRule:
    """RMSprop without momentum, not centered."""
    _check("rmsprop", 0.0, 1.0, alpha=alpha)
    _check("rmsprop", 0.0, float("inf"), eps=eps)
    return _RMSPROP(alpha=alpha, eps=eps, clip_norm=clip_norm)


def adagrad(eps: float = 1e-10, clip_norm: float | None = None) -> UpdateRule:
    """Adagrad (lr_decay: use a schedule)."""
    _check("adagrad", 0.0, float("inf"), eps=eps)
    return _ADAGRAD(eps=eps, clip_norm=clip_norm)


def adam(beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, clip_norm: float | None = None) -> UpdateRule:
    """Adam."""
    _check("adam", 0.0, 1.0, beta1=beta1, beta2=beta2)
    _check("adam", 0.0, float("inf"), eps=eps)
    return _ADAM(beta1=beta1, beta2=beta2, eps=eps, clip_norm=clip_norm)


def adamw(beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.01,
          clip_norm: float | None = None) -> UpdateRule:
    """AdamW: Adam with decoupled weight decay (w shrinks by lr·weight_decay before the Adam step)."""
    _check("adamw", 0.0, float("inf"), weight_decay=weight_decay)
    rule = adam(beta1, beta2, eps, clip_norm)(weight_decay=weight_decay)
    return UpdateRule("adamw", rule.fn, rule.attrs, state=rule.state, clip_norm=rule.clip_norm)


UPDATES = {"sgd": sgd, "momentum": momentum, "nesterov": nesterov, "rmsprop": rmsprop, "adagrad": adagrad,
           "adam": adam, "adamw": adamw}
