"""Built-in losses, written in onnxscript. Each returns per-sample losses; the fuser applies ``reduction``.

Per sample i (mean over the K outputs of that sample unless said otherwise), with weights s_i:
``mean`` = Σ s_i·l_i / Σ s_i, ``sum`` = Σ s_i·l_i (for ``square``/``absolute``, summed over outputs too).
"""

from __future__ import annotations

from onnxopt.dsl.core import DOMAIN, Loss, op, script
from onnxopt.errors import DslError

__all__ = ["square", "absolute", "elastic", "huber", "log", "cross_entropy", "LOSSES"]


@script(DOMAIN)
def weighted_mean(per_sample, sample_weight):
    """Σ s·l / Σ s; ``sample_weight`` broadcasts, so a single 1 means an unweighted mean."""
    w = op.Expand(op.CastLike(sample_weight, per_sample), op.Shape(per_sample))
    return op.Div(op.ReduceSum(op.Mul(per_sample, w), keepdims=0), op.ReduceSum(w, keepdims=0))


@script(DOMAIN)
def weighted_sum(per_sample, sample_weight):
    """Σ s·l."""
    w = op.Expand(op.CastLike(sample_weight, per_sample), op.Shape(per_sample))
    return op.ReduceSum(op.Mul(per_sample, w), keepdims=0)


@script(DOMAIN)
def _residual(y, t):
    """(y - t) as (N, K): targets shaped (N,) are accepted for predictions shaped (N, 1)."""
    d = op.Sub(y, op.Reshape(op.CastLike(t, y), op.Shape(y)))
    return op.Reshape(d, op.Constant(value_ints=[0, -1]))


@script(DOMAIN)
def square_mean(y, t):
    d = _residual(y, t)
    return op.ReduceMean(op.Mul(d, d), op.Constant(value_ints=[1]), keepdims=0)


@script(DOMAIN)
def square_sum(y, t):
    d = _residual(y, t)
    return op.ReduceSum(op.Mul(d, d), op.Constant(value_ints=[1]), keepdims=0)


@script(DOMAIN)
def absolute_mean(y, t):
    return op.ReduceMean(op.Abs(_residual(y, t)), op.Constant(value_ints=[1]), keepdims=0)


@script(DOMAIN)
def absolute_sum(y, t):
    return op.ReduceSum(op.Abs(_residual(y, t)), op.Constant(value_ints=[1]), keepdims=0)


@script(DOMAIN)
def elastic_per_sample(y, t, l1: float = 0.5, l2: float = 0.5):
    """l1·|d| + l2·d², onnxcustom's ElasticLearningLoss."""
    d = _residual(y, t)
    e = op.Add(op.Mul(op.CastLike(l1, d), op.Abs(d)), op.Mul(op.CastLike(l2, d), op.Mul(d, d)))
    return op.ReduceMean(e, op.Constant(value_ints=[1]), keepdims=0)


@script(DOMAIN)
def huber_per_sample(y, t, delta: float = 1.0):
    """torch's HuberLoss: ½d² where |d| <= delta, else delta·(|d| - ½delta)."""
    d = _residual(y, t)
    a = op.Abs(d)
    dl = op.CastLike(delta, d)
    half = op.CastLike(0.5, d)
    e = op.Where(op.LessOrEqual(a, dl), op.Mul(half, op.Mul(d, d)), op.Mul(dl, op.Sub(a, op.Mul(half, dl))))
    return op.ReduceMean(e, op.Constant(value_ints=[1]), keepdims=0)


@script(DOMAIN)
def flat_pair(y, t):
    """y as (N, K) and t shaped like it: the form ``elementwise`` functions read."""
    y2 = op.Reshape(y, op.Constant(value_ints=[0, -1]))
    return y2, op.Reshape(op.CastLike(t, y), op.Shape(y2))


@script(DOMAIN)
def square_elementwise(y, t, c):
    d = op.Sub(y, t)
    e = op.Mul(d, c)
    return op.ReduceSum(op.Mul(e, d), keepdims=0), op.Add(e, e)


@script(DOMAIN)
def absolute_elementwise(y, t, c):
    d = op.Sub(y, t)
    return op.ReduceSum(op.Mul(op.Abs(d), c), keepdims=0), op.Mul(op.Sign(d), c)


@script(DOMAIN)
def elastic_elementwise(y, t, c, l1: float = 0.5, l2: float = 0.5):
    d = op.Sub(y, t)
    a, b = op.CastLike(l1, d), op.CastLike(l2, d)
    e = op.Add(op.Mul(a, op.Abs(d)), op.Mul(b, op.Mul(d, d)))
    g = op.Add(op.Mul(a, op.Sign(d)), op.Mul(op.Add(b, b), d))
    return op.ReduceSum(op.Mul(e, c), keepdims=0), op.Mul(g, c)


@script(DOMAIN)
def huber_elementwise(y, t, c, delta: float = 1.0):
    d = op.Sub(y, t)
    a = op.Abs(d)
    dl = op.CastLike(delta, d)
    half = op.CastLike(0.5, d)
    inside = op.LessOrEqual(a, dl)
    e = op.Where(inside, op.Mul(half, op.Mul(d, d)), op.Mul(dl, op.Sub(a, op.Mul(half, dl))))
    g = op.Where(inside, d, op.Mul(dl, op.Sign(d)))
    return op.ReduceSum(op.Mul(e, c), keepdims=0), op.Mul(g, c)


@script(DOMAIN)
def _last_column(y):
    """The positive-class column: y itself for (N, 1) or (N,), column 1 for (N, 2) probabilities."""
    y2 = op.Reshape(y, op.Concat(op.Shape(y, end=1), op.Constant(value_ints=[-1]), axis=0))
    return op.Reshape(op.Slice(y2, op.Constant(value_ints=[-1]), op.Constant(value_ints=[2147483647]),
                               op.Constant(value_ints=[1])), op.Constant(value_ints=[-1]))


@script(DOMAIN)
def log_logits(y, t):
    """Binary log loss on a raw score s: max(s, 0) - s·t + log(1 + exp(-|s|)) (torch's BCEWithLogitsLoss)."""
    s = _last_column(y)
    tt = op.Reshape(op.CastLike(t, s), op.Constant(value_ints=[-1]))
    zero = op.CastLike(0.0, s)
    one = op.CastLike(1.0, s)
    return op.Add(op.Sub(op.Max(s, zero), op.Mul(s, tt)), op.Log(op.Add(one, op.Exp(op.Neg(op.Abs(s))))))


@script(DOMAIN)
def log_logits_elementwise(y, t, c):
    """``log_logits`` and its gradient sigmoid(s) - t, for one score per sample. log(1 + exp(-|s|)) is a
    Softplus of a non-positive value (no overflow in any runtime): one kernel instead of three."""
    zero = op.CastLike(0.0, y)
    e = op.Add(op.Sub(op.Max(y, zero), op.Mul(y, t)), op.Softplus(op.Neg(op.Abs(y))))
    return op.ReduceSum(op.Mul(e, c), keepdims=0), op.Mul(op.Sub(op.Sigmoid(y), t), c)


@script(DOMAIN)
def log_proba(y, t, eps: float = 1e-7):
    """Binary log loss on a probability p: -(t·log p + (1 - t)·log(1 - p)), p clipped to [eps, 1 - eps]."""
    p0 = _last_column(y)
    e = op.CastLike(eps, p0)
    one = op.CastLike(1.0, p0)
    p = op.Min(op.Max(p0, e), op.Sub(one, e))
    tt = op.Reshape(op.CastLike(t, p), op.Constant(value_ints=[-1]))
    return op.Neg(op.Add(op.Mul(tt, op.Log(p)), op.Mul(op.Sub(one, tt), op.Log(op.Sub(one, p)))))


@script(DOMAIN)
def _log_softmax(y):
    """y − logΣexp(y) over the last axis: onnxruntime has no double kernel for LogSoftmax's gradient."""
    return op.Sub(y, op.ReduceLogSumExp(y, op.Constant(value_ints=[-1]), keepdims=1))


@script(DOMAIN)
def cross_entropy_index(y, t):
    """Softmax cross-entropy on raw scores (N, C) with int64 class indices (N,) (torch's CrossEntropyLoss)."""
    logp = _log_softmax(y)
    idx = op.Reshape(t, op.Constant(value_ints=[-1, 1]))
    return op.Neg(op.Reshape(op.GatherElements(logp, idx, axis=1), op.Constant(value_ints=[-1])))


@script(DOMAIN)
def cross_entropy_index_elementwise(y, t, c):
    """``cross_entropy_index`` weighted by c (N, 1), and its gradient c·(softmax(y) − onehot(t)): the builder's
    derivation of the same formula, without its bookkeeping (~10 kernels against ~25)."""
    logp = _log_softmax(y)
    idx = op.Reshape(t, op.Constant(value_ints=[-1, 1]))
    value = op.Neg(op.ReduceSum(op.Mul(op.GatherElements(logp, idx, axis=1), c), keepdims=0))
    return value, op.ScatterElements(op.Mul(op.Exp(logp), c), idx, op.Neg(c), axis=1, reduction="add")


@script(DOMAIN)
def cross_entropy_onehot(y, t):
    logp = _log_softmax(y)
    return op.Neg(op.ReduceSum(op.Mul(op.CastLike(t, logp), logp), op.Constant(value_ints=[1]), keepdims=0))


@script(DOMAIN)
def nll_index(y, t, eps: float = 1e-7):
    """Cross-entropy on probabilities (N, C) with class indices: -log(max(p[t], eps))."""
    p = op.Max(y, op.CastLike(eps, y))
    idx = op.Reshape(t, op.Constant(value_ints=[-1, 1]))
    return op.Neg(op.Reshape(op.Log(op.GatherElements(p, idx, axis=1)), op.Constant(value_ints=[-1])))


@script(DOMAIN)
def nll_onehot(y, t, eps: float = 1e-7):
    logp = op.Log(op.Max(y, op.CastLike(eps, y)))
    return op.Neg(op.ReduceSum(op.Mul(op.CastLike(t, logp), logp), op.Constant(value_ints=[1]), keepdims=0))


def _reduction(name: str, reduction: str) -> str:
    if reduction not in ("mean", "sum"):
        raise DslError(f"{name}: reduction must be 'mean' or 'sum', got {reduction!r}")
    return reduction


def square(reduction: str = "mean") -> Loss:
    """Squared error (y - t)²: mean over every element (torch's MSELoss) or their ``sum``."""
    mean = _reduction("square", reduction) == "mean"
    return Loss("square", square_mean if mean else square_sum, reduction=reduction,
                elementwise=square_elementwise, per_output="mean" if mean else "sum")


def absolute(reduction: str = "mean") -> Loss:
    """Absolute error |y - t| (torch's L1Loss)."""
    mean = _reduction("absolute", reduction) == "mean"
    return Loss("absolute", absolute_mean if mean else absolute_sum, reduction=reduction,
                elementwise=absolute_elementwise, per_output="mean" if mean else "sum")


def elastic(l1: float = 0.5, l2: float = 0.5, reduction: str = "mean") -> Loss:
    """l1·|y - t| + l2·(y - t)²."""
    return Loss("elastic", elastic_per_sample, reduction=_reduction("elastic", reduction),
                elementwise=elastic_elementwise)(l1=l1, l2=l2)


def huber(delta: float = 1.0, reduction: str = "mean") -> Loss:
    """Huber loss with threshold ``delta`` (torch's HuberLoss)."""
    if not delta > 0:
        raise DslError(f"huber: delta must be > 0, got {delta!r}")
    return Loss("huber", huber_per_sample, reduction=_reduction("huber", reduction),
                elementwise=huber_elementwise)(delta=delta)


def log(from_logits: bool = True, eps: float = 1e-7, reduction: str = "mean") -> Loss:
    """Binary log loss, targets in {0, 1}: on a raw score (``from_logits``) or on a probability."""
    _reduction("log", reduction)
    if from_logits:
        return Loss("log", log_logits, reduction=reduction, elementwise=log_logits_elementwise, per_output="one")
    return Loss("log", log_proba, reduction=reduction)(eps=eps)


def cross_entropy(from_logits: bool = True, one_hot: bool = False, eps: float = 1e-7, reduction: str = "mean") -> Loss:
    """Softmax cross-entropy on raw scores (or on probabilities), integer class or one-hot targets."""
    _reduction("cross_entropy", reduction)
    target = "float" if one_hot else "index"
    if from_logits:
        if one_hot:
            return Loss("cross_entropy", cross_entropy_onehot, reduction=reduction, target=target)
        return Loss("cross_entropy", cross_entropy_index, reduction=reduction, target=target,
                    elementwise=cross_entropy_index_elementwise, per_output="sample")
    fn = nll_onehot if one_hot else nll_index
    return Loss("cross_entropy", fn, reduction=reduction, target=target)(eps=eps)


LOSSES = {"square": square, "absolute": absolute, "elastic": elastic, "huber": huber, "log": log,
          "cross_entropy": cross_entropy}
