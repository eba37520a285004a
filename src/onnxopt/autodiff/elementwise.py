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


@rule("CastLike", family=F, inputs=(0,))
def _cast_like(c):
    """dx = dy cast back to x's type; ``like`` gives only a type (the rules write CastLike of constants)."""
    return [c.CastLike(c.go(0), c.I(0))]


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
    a, b = c.I(0), c.I(1)
    if a is b:  # NOTE: a square: 2·a·dy in two kernels, where two parts and their sum take three
        dy = c.go_against(0, a)
        return [c.Mul(a, c.Add(dy, dy)) if dy is not c.GO(0) else c.Mul(dy, c.Add(a, a)), None]
    return [c.unbroadcast(c.Mul(c.go_against(0, b), b), 0) if c.need(0) else None,
            c.unbroadcast(c.Mul(c.go_against(0, a), a), 1) if c.need(1) else None]


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


# ==== rewrites ===========================================================================================
# This family's ops rewritten before differentiation into ops that have rules (``passes.decompose`` applies
# them for both gradient sources), and its gradient definitions given to the training build's builder too
# (``autodiff.rewrite``). The rules above do not depend on this section.

import numpy as np  # noqa: E402
import onnx_ir as ir  # noqa: E402

from onnxopt.autodiff.reduce import _reduce_extreme_rewrite  # noqa: E402
from onnxopt.autodiff.rewrite import (  # noqa: E402
    _X2, _ZERO, _c, _divide_by, _f, _k, _unbroadcast, rewrite, template,
)


def _negative_branch(op, x, negative):
    """``Where(x > 0, x, negative(x'))`` with x' = min(x, 0): the untaken branch never overflows."""
    positive = op.Greater(x, _k(op, 0.0, x))
    return op.Where(positive, x, negative(op.Where(positive, _k(op, 0.0, x), x)))


@rewrite("Elu", family=F)
def _elu(op, node, x):
    alpha = _f(node, "alpha", 1.0)
    return _negative_branch(op, x, lambda n: op.Mul(_k(op, alpha, x), op.Sub(op.Exp(n), _k(op, 1.0, x))))


@rewrite("Selu", family=F)
def _selu(op, node, x):
    alpha, gamma = _f(node, "alpha", 1.67326319217681884765625), _f(node, "gamma", 1.05070102214813232421875)
    y = _negative_branch(op, x, lambda n: op.Mul(_k(op, alpha, x), op.Sub(op.Exp(n), _k(op, 1.0, x))))
    return op.Mul(_k(op, gamma, x), y)


@rewrite("Celu", family=F)
def _celu(op, node, x):
    alpha = _f(node, "alpha", 1.0)
    return _negative_branch(op, x, lambda n: op.Mul(_k(op, alpha, x),
                                                    op.Sub(op.Exp(op.Div(n, _k(op, alpha, x))), _k(op, 1.0, x))))


@rewrite("HardSigmoid", family=F)
def _hard_sigmoid(op, node, x):
    t = op.Add(op.Mul(_k(op, _f(node, "alpha", 0.2), x), x), _k(op, _f(node, "beta", 0.5), x))
    zero, one = _k(op, 0.0, x), _k(op, 1.0, x)
    return op.Where(op.Less(t, zero), zero, op.Where(op.Greater(t, one), one, t))


@rewrite("ThresholdedRelu", family=F)
def _thresholded_relu(op, node, x):
    return op.Where(op.Greater(x, _k(op, _f(node, "alpha", 1.0), x)), x, _k(op, 0.0, x))


@rewrite("Shrink", family=F)
def _shrink(op, node, x):
    bias, lambd = _f(node, "bias", 0.0), _f(node, "lambd", 0.5)
    inner = op.Where(op.Greater(x, _k(op, lambd, x)), op.Sub(x, _k(op, bias, x)), _k(op, 0.0, x))
    return op.Where(op.Less(x, _k(op, -lambd, x)), op.Add(x, _k(op, bias, x)), inner)


def _gelu_check(node: ir.Node) -> str | None:
    return None if node.attributes.get_string("approximate", "none") == "tanh" else "erf Gelu has an exact builder gradient"


@rewrite("Gelu", family=F, check=_gelu_check)
def _gelu_tanh(op, node, x):
    """0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))."""
    inner = op.Mul(_k(op, np.sqrt(2.0 / np.pi), x), op.Add(x, op.Mul(_k(op, 0.044715, x), op.Mul(x, op.Mul(x, x)))))
    return op.Mul(op.Mul(_k(op, 0.5, x), x), op.Add(_k(op, 1.0, x), op.Tanh(inner)))


@rewrite("PRelu", family=F)
def _prelu(op, node, x, slope):
    return op.Where(op.Less(x, _k(op, 0.0, x)), op.Mul(slope, x), x)


@rewrite("Sum", family=F)
def _sum_rewrite(op, node, *xs):
    total = xs[0]
    for x in xs[1:]:
        total = op.Add(total, x)
    return total if len(xs) > 1 else op.Identity(total)


@rewrite("Mean", family=F)
def _mean(op, node, *xs):
    return op.Div(_sum_rewrite(op, node, *xs), _k(op, float(len(xs)), xs[0]))


def _dequantize_check(node: ir.Node) -> str | None:
    x, scale = node.inputs[0], node.inputs[1]
    if node.attributes.get_int("block_size", 0) or scale.shape is None or len(scale.shape) > 1:
        return "blocked quantization is not rewritten"
    return None if x.shape is not None or len(scale.shape) == 0 else "the rank of the input is unknown"


@rewrite("DequantizeLinear", family=F, check=_dequantize_check)
def _dequantize(op, node, x, scale, zero_point=None):
    y = op.Cast(x, to=scale.dtype)
    if zero_point is not None:
        y = op.Sub(y, op.Cast(zero_point, to=scale.dtype))
    if scale.shape is not None and len(scale.shape) == 1 and len(x.shape) > 1:
        axis = node.attributes.get_int("axis", 1) % len(x.shape)
        scale = op.Reshape(scale, op.Constant(value_ints=[-1] + [1] * (len(x.shape) - axis - 1)))
    return op.Mul(y, scale)


def _dynamic_quantize_check(node: ir.Node) -> str | None:
    scale = node.outputs[1]
    return None if scale.uses() or scale.is_graph_output() else "the scale is not read"


@rewrite("DynamicQuantizeLinear", family=F, check=_dynamic_quantize_check, outputs=(3,))
def _dynamic_quantize(op, node, x):
    """The scale output as (max(x, 0) - min(x, 0)) / 255 in standard ops (onnxruntime's bit for bit, within an
    ulp when the max or min repeats), so it has a gradient; the quantized values and zero point stay the op's."""
    y, _, zero_point = op.DynamicQuantizeLinear(x, _outputs=3)
    scalar = op.Constant(value=ir.tensor(np.zeros(0, np.int64)))  # NOTE: ties share the gradient, as ReduceMax's rewrite does
    top = op.Max(op.Reshape(_reduce_extreme_rewrite("ReduceMax")(op, node, x), scalar), _k(op, 0.0, x))
    bottom = op.Min(op.Reshape(_reduce_extreme_rewrite("ReduceMin")(op, node, x), scalar), _k(op, 0.0, x))
    return y, op.Div(op.Sub(top, bottom), _k(op, 255.0, x)), zero_point


def _mod_check(node: ir.Node) -> str | None:
    if node.inputs[1].const_value is not None:
        return "the divisor is a constant (the dividend's gradient alone builds)"
    add = node.inputs[0].producer()
    mul = add.inputs[1].producer() if add is not None and add.op_type == "Add" else None
    sign = mul.inputs[0].producer() if mul is not None and mul.op_type == "Mul" else None
    return "already rewritten" if sign is not None and sign.op_type == "Sign" else None


@rewrite("Mod", family=F, check=_mod_check)
def _mod(op, node, a, b):
    """Mod(a + 0·Sign(b), b), exactly Mod(a, b): the dividend then depends on the divisor, so the builder asks for
    both gradients of Mod's definition (it fails on the definition when only the divisor's is asked for)."""
    return op.Mod(op.Add(a, op.Mul(op.Sign(b), _k(op, 0.0, b))), b, fmod=node.attributes.get_int("fmod", 0))


# ---- gradient definitions: (op_type, inputs, outputs[, {attribute: value}]) per node, GI(0) = dL/dI(0)

template("Asin", _divide_by([*_c("one", 1.0), *_X2, ("Sub", ["one", "x2"], ["t"]), ("Sqrt", ["t"], ["d"])]), family=F)
template("Acos", [*_c("one", 1.0), *_X2, ("Sub", ["one", "x2"], ["t"]), ("Sqrt", ["t"], ["s"]), ("Neg", ["s"], ["d"]),
                  ("Div", ["GO(0)", "d"], ["GI(0)"])], family=F)
template("Atan", _divide_by([*_c("one", 1.0), *_X2, ("Add", ["one", "x2"], ["d"])]), family=F)
template("Asinh", _divide_by([*_c("one", 1.0), *_X2, ("Add", ["x2", "one"], ["t"]), ("Sqrt", ["t"], ["d"])]), family=F)
# NOTE: sqrt(x-1)·sqrt(x+1), not sqrt(x²-1): no cancellation near x = 1
template("Acosh", _divide_by([*_c("one", 1.0), ("Sub", ["I(0)", "one"], ["a"]), ("Add", ["I(0)", "one"], ["b"]),
                              ("Sqrt", ["a"], ["sa"]), ("Sqrt", ["b"], ["sb"]), ("Mul", ["sa", "sb"], ["d"])]), family=F)
template("Atanh", _divide_by([*_c("one", 1.0), *_X2, ("Sub", ["one", "x2"], ["d"])]), family=F)
template("Sinh", [("Cosh", ["I(0)"], ["c"]), ("Mul", ["GO(0)", "c"], ["GI(0)"])], family=F)
template("Cosh", [("Sinh", ["I(0)"], ["s"]), ("Mul", ["GO(0)", "s"], ["GI(0)"])], family=F)
template("Tan", [*_c("one", 1.0), ("Mul", ["O(0)", "O(0)"], ["y2"]), ("Add", ["one", "y2"], ["d"]),
                 ("Mul", ["GO(0)", "d"], ["GI(0)"])], family=F)
template("Softplus", [("Sigmoid", ["I(0)"], ["s"]), ("Mul", ["GO(0)", "s"], ["GI(0)"])], family=F)
template("Softsign", _divide_by([*_c("one", 1.0), ("Abs", ["I(0)"], ["a"]), ("Add", ["one", "a"], ["t"]),
                                 ("Mul", ["t", "t"], ["d"])]), family=F)
# Mish: y = x·tanh(sp), sp = softplus(x); dy/dx = tanh(sp) + x·(1 − tanh²(sp))·sigmoid(x)
template("Mish", [*_c("one", 1.0), ("Softplus", ["I(0)"], ["sp"]), ("Tanh", ["sp"], ["t"]), ("Mul", ["t", "t"], ["t2"]),
                  ("Sub", ["one", "t2"], ["u"]), ("Sigmoid", ["I(0)"], ["s"]), ("Mul", ["u", "s"], ["us"]),
                  ("Mul", ["I(0)", "us"], ["xus"]), ("Add", ["t", "xus"], ["d"]), ("Mul", ["GO(0)", "d"], ["GI(0)"])], family=F)
# HardSwish: y = x·clip(x/6 + 1/2, 0, 1); dy/dx = 0 below -3, 1 above 3, x/3 + 1/2 between (as torch)
template("HardSwish", [*_c("three", 3.0), *_c("mthree", -3.0), *_c("half", 0.5), *_c("zero", 0.0), *_c("one", 1.0),
                       ("Div", ["I(0)", "three"], ["x3"]), ("Add", ["x3", "half"], ["mid"]),
                       ("Greater", ["I(0)", "three"], ["hi"]), ("Less", ["I(0)", "mthree"], ["lo"]),
                       ("Where", ["hi", "one", "mid"], ["d1"]), ("Where", ["lo", "zero", "d1"], ["d"]),
                       ("Mul", ["GO(0)", "d"], ["GI(0)"])], family=F)
# Mod (fmod=1, the only form for floats): a - b·trunc(a/b); d/da = 1, d/db = -trunc(a/b)
template("Mod", [("Div", ["I(0)", "I(1)"], ["q"]), ("Abs", ["q"], ["aq"]), ("Floor", ["aq"], ["fq"]),
                 ("Sign", ["q"], ["sq"]), ("Mul", ["sq", "fq"], ["t"]), ("Mul", ["GO(0)", "t"], ["gt"]),
                 ("Neg", ["gt"], ["gb"]), *_unbroadcast("GO(0)", 0), *_unbroadcast("gb", 1)], family=F)
for _op in ("Floor", "Ceil", "Round", "Sign"):
    template(_op, _ZERO, family=F)
# NOTE: random draws do not move with their float input (*Like: only its shape; Bernoulli: a.e.)
for _op in ("Bernoulli", "RandomNormalLike", "RandomUniformLike"):
    template(_op, _ZERO, family=F)
