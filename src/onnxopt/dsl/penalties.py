"""Built-in penalties on each trained weight w, added to the loss: their gradient joins the weight's gradient."""

from __future__ import annotations

from onnxopt.dsl.core import DOMAIN, Penalty, op, script
from onnxopt.errors import DslError

__all__ = ["l1", "l2", "elastic", "PENALTIES"]


@script(DOMAIN)
def elastic_penalty(w, l1: float = 0.5, l2: float = 0.5):
    """l1·Σ|w| + l2·Σw²."""
    a = op.Mul(op.CastLike(l1, w), op.ReduceSum(op.Abs(w), keepdims=0))
    b = op.Mul(op.CastLike(l2, w), op.ReduceSum(op.Mul(w, w), keepdims=0))
    return op.Add(a, b)


@script(DOMAIN)
def elastic_penalty_grad(w, l1: float = 0.5, l2: float = 0.5):
    """l1·sign(w) + 2·l2·w."""
    return op.Add(op.Mul(op.CastLike(l1, w), op.Sign(w)), op.Mul(op.CastLike(2.0, w), op.Mul(op.CastLike(l2, w), w)))


def _check(name: str, **values: float) -> None:
    for key, value in values.items():
        if not isinstance(value, (int, float)) or value < 0:
            raise DslError(f"{name}: {key} must be a number >= 0, got {value!r}")


def elastic(l1: float = 0.5, l2: float = 0.5) -> Penalty:
    """l1·Σ|w| + l2·Σw² (onnxcustom's ElasticLearningPenalty). torch's ``weight_decay=λ`` is ``l2=λ/2``."""
    _check("elastic", l1=l1, l2=l2)
    return Penalty("elastic", elastic_penalty, grad=elastic_penalty_grad)(l1=l1, l2=l2)


def l1(alpha: float = 1e-4) -> Penalty:
    """alpha·Σ|w|."""
    _check("l1", alpha=alpha)
    return Penalty("l1", elastic_penalty, grad=elastic_penalty_grad)(l1=alpha, l2=0.0)


def l2(alpha: float = 1e-4) -> Penalty:
    """alpha·Σw²."""
    _check("l2", alpha=alpha)
    return Penalty("l2", elastic_penalty, grad=elastic_penalty_grad)(l1=0.0, l2=alpha)


PENALTIES = {"l1": l1, "l2": l2, "elastic": elastic}
