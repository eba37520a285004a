"""Learning-rate schedules computed inside the fused graph from the 1-based step number t."""

from __future__ import annotations


from onnxopt.dsl.core import DOMAIN, Schedule, op, script
from onnxopt.errors import DslError

__all__ = ["constant", "invscaling", "step", "exponential", "cosine", "SCHEDULES"]


@script(DOMAIN)
def constant_schedule(step, eta0: float = 0.01):
    """lr = eta0."""
    return op.CastLike(eta0, step)


@script(DOMAIN)
def invscaling_schedule(step, eta0: float = 0.01, power_t: float = 0.25):
    """lr = eta0 / t^power_t (scikit-learn's 'invscaling', t counting steps)."""
    return op.Div(op.CastLike(eta0, step), op.Pow(step, op.CastLike(power_t, step)))


@script(DOMAIN)
def step_schedule(step, eta0: float = 0.01, step_size: float = 100.0, gamma: float = 0.1):
    """lr = eta0·gamma^floor((t−1)/step_size) (torch's StepLR, counted in steps)."""
    k = op.Floor(op.Div(op.Sub(step, op.CastLike(1.0, step)), op.CastLike(step_size, step)))
    return op.Mul(op.CastLike(eta0, step), op.Pow(op.CastLike(gamma, step), k))


@script(DOMAIN)
def exponential_schedule(step, eta0: float = 0.01, gamma: float = 0.99):
    """lr = eta0·gamma^(t−1)."""
    return op.Mul(op.CastLike(eta0, step), op.Pow(op.CastLike(gamma, step), op.Sub(step, op.CastLike(1.0, step))))


@script(DOMAIN)
def cosine_schedule(step, eta0: float = 0.01, total: float = 1000.0, warmup: float = 0.0, eta_min: float = 0.0):
    """lr = eta0·t/warmup for t <= warmup, then eta_min + (eta0 − eta_min)·(1 + cos(π·(t−1−warmup)/(total−warmup)))/2."""
    one = op.CastLike(1.0, step)
    w = op.CastLike(warmup, step)
    e0 = op.CastLike(eta0, step)
    emin = op.CastLike(eta_min, step)
    warm = op.Div(op.Mul(e0, step), op.Max(w, one))
    # NOTE: like torch's CosineAnnealingLR, the first step after warm-up uses eta0 (t - 1 - warmup = 0)
    frac = op.Min(op.Div(op.Sub(op.Sub(step, one), w), op.Max(op.Sub(op.CastLike(total, step), w), one)), one)
    # NOTE: onnxruntime's CPU Cos is float32 only; the schedule needs no more precision than that.
    angle = op.Cast(op.Mul(op.CastLike(3.141592653589793, step), frac), to=1)
    half_cos = op.Div(op.Add(one, op.CastLike(op.Cos(angle), step)), op.CastLike(2.0, step))
    cos = op.Add(emin, op.Mul(op.Sub(e0, emin), half_cos))
    return op.Where(op.LessOrEqual(step, w), warm, cos)


def _positive(name: str, **values: float) -> None:
    for key, value in values.items():
        if not isinstance(value, (int, float)) or not value > 0:
            raise DslError(f"{name}: {key} must be a number > 0, got {value!r}")


def constant(eta0: float = 0.01) -> Schedule:
    """A constant learning rate; a plain float ``learning_rate=`` means this."""
    _positive("constant", eta0=eta0)
    return Schedule("constant", constant_schedule)(eta0=eta0)


def invscaling(eta0: float = 0.01, power_t: float = 0.25) -> Schedule:
    """eta0 / t^power_t."""
    _positive("invscaling", eta0=eta0)
    return Schedule("invscaling", invscaling_schedule)(eta0=eta0, power_t=power_t)


def step(eta0: float = 0.01, step_size: int = 100, gamma: float = 0.1) -> Schedule:
    """Multiply by gamma every step_size steps."""
    _positive("step", eta0=eta0, step_size=step_size, gamma=gamma)
    return Schedule("step", step_schedule)(eta0=eta0, step_size=float(step_size), gamma=gamma)


def exponential(eta0: float = 0.01, gamma: float = 0.99) -> Schedule:
    """Multiply by gamma every step."""
    _positive("exponential", eta0=eta0, gamma=gamma)
    return Schedule("exponential", exponential_schedule)(eta0=eta0, gamma=gamma)


def cosine(eta0: float = 0.01, total: int = 1000, warmup: int = 0, eta_min: float = 0.0) -> Schedule:
    """Cosine decay over ``total`` steps after a linear warm-up of ``warmup`` steps."""
    _positive("cosine", eta0=eta0, total=total)
    if warmup < 0 or warmup >= total:
        raise DslError(f"cosine: warmup must be in [0, total={total}), got {warmup!r}")
    return Schedule("cosine", cosine_schedule)(eta0=eta0, total=float(total), warmup=float(warmup), eta_min=eta_min)


SCHEDULES = {"constant": constant, "invscaling": invscaling, "step": step, "exponential": exponential,
             "cosine": cosine}
