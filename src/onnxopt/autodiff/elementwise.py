"""Elementwise ops: arithmetic (broadcast undone), activations, comparisons' selections, casts."""

from __future__ import annotations

import math

from onnxopt.autodiff.engine import rule
from onnxopt.passes.lower import gelu_grad, relu_grad

F = "elementwise"


@rule("Identity", family=F)
def _identity(c):
    """dx = dy."""
    return [c.go(0)]


@rule("Neg", family=F)
def _neg(c):
    """dx = -dy."""
    return [c.Neg(c.go(0))]


@rule("Abs", family=F)
def _abs(c):
    """dx = dy·sign(x) (0 at 0, as torch)."""
    return [c.Mul(c.go(0), c.Sign(c.I(0)))]


@rule("Exp", family=F)
def _exp(c):
    """dx = dy·y."""
    return [c.Mul(c.go(0), c.O(0))]


@rule("Log", family=F)
def _log(c):
    """dx = dy / x."""
    return [c.Div(c.go(0), c.I(0))]


@rule("Sqrt", family=F)
def _sqrt(c):
    """dx = dy / (2·y)."""
    return [c.Div(c.go(0), c.Mul(c.O(0), c.const(2.0, c.O(0))))]


@rule("Reciprocal", family=F)
def _reciprocal(c):
    """dx = -dy·y²."""
    y = c.O(0)
    return [c.Neg(c.Mul(c.go(0), c.Mul(y, y)))]


@rule("Sin", family=F)
def _sin(c):
    """dx = dy·cos(x)."""
    return [c.Mul(c.go(0), c.Cos(c.I(0)))]


@rule("Cos", family=F)
def _cos(c):
    """dx = -dy·sin(x)."""
    return [c.Neg(c.Mul(c.go(0), c.Sin(c.I(0))))]


@rule("Tanh", family=F)
def _tanh(c):
    """dx = dy·(1 - y²)."""
    y = c.O(0)
    return [c.Mul(c.go(0), c.Sub(c.const(1.0, y), c.Mul(y, y)))]


@rule("Sigmoid", family=F)
def _sigmoid(c):
    """dx = dy·y·(1 - y)."""
    y = c.O(0)
    return [c.Mul(c.go(0), c.Mul(y, c.Sub(c.const(1.0, y), y)))]


@rule("Relu", family=F)
def _relu(c):
    """dx = dy where y > 0 (0 at 0, as torch)."""
    return [relu_grad(c, c.go(0), c.O(0))]


@rule("LeakyRelu", family=F)
def _leaky_relu(c):
    """dx = dy where x > 0, else alpha·dy."""
    x, dy = c.I(0), c.go(0)
    return [c.Where(c.Greater(x, c.const(0.0, x)), dy, c.Mul(dy, c.const(c.attr("alpha", 0.01), dy)))]


@rule("Erf", family=F)
def _erf(c):
    """dx = dy·2/√π·exp(-x²)."""
    x = c.I(0)
    return [c.Mul(c.go(0), c.Mul(c.const(2 / math.sqrt(math.pi), x), c.Exp(c.Neg(c.Mul(x, x)))))]


@rule("Gelu", family=F)
def _gelu(c):
    """dx = dy·(Φ(x) + x·φ(x)) (approximate='none'; 'tanh' is decomposed before)."""
    return [gelu_grad(c, c.go(0), c.I(0))]


@rule("Cast", family=F)
def _cast(c):
    """dx = dy cast back to x's type (float to float only)."""
    return [c.Cast(c.go(0), to=c.dtype(c.I(0)))]


@rule("Add", "Sub", family=F)
def _add_sub(c):
    """da = dy, db = ±dy, each summed over its broadcast axes."""
    dy = c.go(0)
    da = c.unbroadcast(dy, 0) if c.need(0) else None
    db = c.unbroadcast(dy, 1) if c.need(1) else None
    if db is not None and c.node.op_type == "Sub":  # NOTE: negated after the sum: over b's size, not dy's
        db = c.Neg(db)
    return [da, db]


@rule("Sum", family=F)
def _sum(c):
    """dx_i = dy summed over x_i's broadcast axes."""
    return [c.unbroadcast(c.go(0), i) if c.need(i) else None for i in range(len(c.node.inputs))]


@rule("Mul", family=F)
def _mul(c):
    """da = dy·b, db = dy·a."""
    dy, a, b = c.go(0), c.I(0), c.I(1)
    if a is b:  # NOTE: a square: 2·a·dy in two kernels, where two parts and their sum take three
        return [c.Mul(dy, c.Add(a, a)), None]
    return [c.unbroadcast(c.Mul(dy, b), 0) if c.need(0) else None,
            c.unbroadcast(c.Mul(dy, a), 1) if c.need(1) else None]


@rule("Div", family=F)
def _div(c):
    """da = dy / b, db = -dy·y / b."""
    dy, b = c.go(0), c.I(1)
    da = c.unbroadcast(c.Div(dy, b), 0) if c.need(0) else None
    db = c.Neg(c.unbroadcast(c.Div(c.Mul(dy, c.O(0)), b), 1)) if c.need(1) else None
    return [da, db]


@rule("Pow", family=F)
def _pow(c):
    """dx = dy·p·x^(p-1), dp = dy·y·ln(x)."""
    dy, x, p = c.go(0), c.I(0), c.I(1)
    dx = dp = None
    if c.need(0):
        pc = p if c.dtype(p) == c.dtype(x) else c.CastLike(p, x)
        dx = c.unbroadcast(c.Mul(dy, c.Mul(pc, c.Pow(x, c.Sub(pc, c.const(1.0, pc))))), 0)
    if c.need(1):
        dp = c.unbroadcast(c.Mul(dy, c.Mul(c.O(0), c.Log(x))), 1)
    return [dx, dp]


@rule("Where", family=F, inputs=(1, 2))
def _where(c):
    """da = dy where cond, db = dy elsewhere."""
    dy, cond = c.go(0), c.I(0)
    zero = c.const(0.0, dy)
    return [None, c.unbroadcast(c.Where(cond, dy, zero), 1) if c.need(1) else None,
            c.unbroadcast(c.Where(cond, zero, dy), 2) if c.need(2) else None]


@rule("Max", "Min", family=F)
def _extreme(c):
    """dx_i = dy where x_i is the extreme, shared evenly between ties (as torch.maximum)."""
    dy, y = c.go(0), c.O(0)
    masks = [c.CastLike(c.Equal(x, y), y) for x in c.node.inputs]
    count = masks[0]
    for m in masks[1:]:
        count = c.Add(count, m)
    share = c.Div(dy, count) if len(masks) > 1 else dy
    return [c.unbroadcast(c.Mul(share, m), i) if c.need(i) else None for i, m in enumerate(masks)]


@rule("Clip", family=F, inputs=(0,))
def _clip(c):
    """dx = dy where min <= x <= max (as torch.clamp)."""
    x, dy = c.I(0), c.go(0)
    inside = None
    for bound, compare in ((c.I(1), c.GreaterOrEqual), (c.I(2), c.LessOrEqual)):
        if bound is not None:
            test = compare(x, bound)
            inside = test if inside is None else c.And(inside, test)
    return [dy if inside is None else c.Where(inside, dy, c.const(0.0, dy))]


@rule("Expand", family=F, inputs=(0,))
def _expand(c):
    """dx = dy summed over the broadcast axes."""
    return [c.unbroadcast(c.go(0), 0)]


@rule("Dropout", family=F, inputs=(0,))
def _dropout(c):
    """dx = dy·mask / (1 - ratio) in training mode, dy otherwise."""
    from onnxopt.passes.lower import dropout_grad

    training = c.I(2)
    active = training is not None and (training.const_value is None or bool(training.const_value.numpy()))
    if not active or len(c.node.outputs) < 2:
        return [c.go(0)]
    return [dropout_grad(c, c.go(0), c.O(1), c.I(1))]
