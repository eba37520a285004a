"""Reductions: the output gradient broadcast back over the reduced axes (times the local derivative)."""

from __future__ import annotations

from onnxopt.autodiff.engine import rule

F = "reduction"


def _axes(c):
    """The reduced axes as a value (input or attribute), or None for every axis."""
    if len(c.node.inputs) > 1 and c.I(1) is not None:
        return c.I(1)
    attr = c.attr("axes", None)
    return None if attr is None else c.ints(attr)


def _spread(c, g):
    """``g`` with the reduced axes back (keepdims=0) and broadcast to the input's shape."""
    x, axes = c.I(0), _axes(c)
    if axes is None and c.attr("noop_with_empty_axes", 0):
        return g
    if not c.attr("keepdims", 1):
        if axes is None:
            g = c.Reshape(g, c.Expand(c.ints([1]), c.Shape(c.Shape(x))))
        else:
            g = c.Unsqueeze(g, axes)
    return c.Expand(g, c.Shape(x))


def _count(c):
    """How many elements each output reduces, in the input's type."""
    x, y = c.I(0), c.O(0)
    return c.CastLike(c.Div(c.Size(x), c.Size(y)), x)


@rule("ReduceSum", family=F, inputs=(0,))
def _reduce_sum(c):
    """dx = dy broadcast over the reduced axes."""
    return [_spread(c, c.go(0))]


@rule("ReduceMean", family=F, inputs=(0,))
def _reduce_mean(c):
    """dx = dy / n broadcast over the reduced axes."""
    return [_spread(c, c.Div(c.go(0), _count(c)))]


@rule("ReduceLogSumExp", family=F, inputs=(0,))
def _reduce_log_sum_exp(c):
    """dx = dy·exp(x - y), y broadcast back."""
    x = c.I(0)
    return [c.Mul(_spread(c, c.go(0)), c.Exp(c.Sub(x, _spread(c, c.O(0)))))]


@rule("ReduceL2", family=F, inputs=(0,))
def _reduce_l2(c):
    """dx = dy·x / y (0 where y = 0)."""
    x, y = c.I(0), c.O(0)
    safe = c.Where(c.Equal(y, c.const(0.0, y)), c.const(1.0, y), y)
    return [c.Mul(x, _spread(c, c.Div(c.go(0), safe)))]


@rule("ReduceMax", "ReduceMin", family=F, inputs=(0,))
def _reduce_extreme(c):
    """dx = dy shared evenly between the positions equal to the extreme (as torch.amax)."""
    x = c.I(0)
    mask = c.CastLike(c.Equal(x, _spread(c, c.O(0))), x)
    axes = _axes(c)
    args = [mask] if axes is None else [mask, axes]
    count = c.ReduceSum(*args, keepdims=c.attr("keepdims", 1))
    return [c.Mul(mask, _spread(c, c.Div(c.go(0), count)))]
