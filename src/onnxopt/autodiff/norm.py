"""Normalizations and probabilities: Softmax, LogSoftmax, LayerNormalization, SoftmaxCrossEntropyLoss.

BatchNormalization and Dropout are rewritten before (``passes.modes``): BatchNormalization into standard ops
for the mode, Dropout with its mask output.
"""

from __future__ import annotations

from onnxopt.autodiff.engine import rule
from onnxopt.passes.lower import layer_norm_grad

F = "normalization"


def _softmax_axes(c) -> list[int]:
    """The axes Softmax normalizes over: one axis from opset 13, the flattened tail before."""
    axis = c.attr("axis", -1 if c.node.graph is None or c.node.graph.opset_imports.get("", 18) >= 13 else 1)
    if c.node.graph is not None and c.node.graph.opset_imports.get("", 18) < 13:
        r = c.rank(c.I(0))
        return list(range(axis % r, r))
    return [axis]


@rule("Softmax", family=F)
def _softmax(c):
    """dx = y·(dy - Σ dy·y)."""
    y, dy = c.O(0), c.go(0)
    return [c.Mul(y, c.Sub(dy, c.ReduceSum(c.Mul(dy, y), c.ints(_softmax_axes(c)), keepdims=1)))]


@rule("LogSoftmax", family=F)
def _log_softmax(c):
    """dx = dy - exp(y)·Σ dy."""
    y, dy = c.O(0), c.go(0)
    return [c.Sub(dy, c.Mul(c.Exp(y), c.ReduceSum(dy, c.ints(_softmax_axes(c)), keepdims=1)))]


@rule("LayerNormalization", family=F)
def _layer_norm(c):
    """x̂ = (x - mean)·inv_std; dx = inv_std·(ĝ - mean(ĝ) - x̂·mean(ĝ·x̂)), ĝ = dy·scale; dscale = Σ dy·x̂,
    dbias = Σ dy (the node's Mean and InvStdDev outputs, completed before)."""
    node = c.node
    if len(node.outputs) < 3:
        node.resize_outputs(3)
    scale = c.I(1)
    for out in node.outputs[1:]:
        out.type = scale.type
    dx, dscale, dbias = layer_norm_grad(c, c.go(0), c.I(0), scale, node.outputs[1], node.outputs[2],
                                        axis=c.attr("axis", -1))
    return [dx, dscale, dbias]


@rule("SoftmaxCrossEntropyLoss", family=F, inputs=(0,))
def _softmax_cross_entropy(c):
    """d scores = w_n·g_n·(softmax - onehot(label)), g_n the output gradient (÷ Σ w_n for reduction 'mean');
    rows with ignore_index weigh 0."""
    node = c.node
    if len(node.outputs) < 2:
        node.resize_outputs(2)
        node.outputs[1].type = c.I(0).type
    scores, labels, weight = c.I(0), c.I(1), c.I(2)
    log_prob, dy = node.outputs[1], c.go(0)
    ignore = c.attr("ignore_index", None)
    safe = labels
    keep = None
    if ignore is not None:
        keep = c.Not(c.Equal(labels, c.Constant(value_int=ignore)))
        safe = c.Where(keep, labels, c.Constant(value_int=0))
    depth = c.Shape(scores, start=1, end=2)
    onehot = c.CastLike(c.OneHot(safe, depth, c.ints([0, 1]), axis=1), scores)
    w = c.Gather(weight, safe, axis=0) if weight is not None else None
    if keep is not None:
        kept = c.CastLike(keep, scores)
        w = kept if w is None else c.Mul(w, kept)
    reduction = c.attr("reduction", "mean")
    if reduction == "none":
        g = dy
    elif reduction == "sum":
        g = c.Expand(dy, c.Shape(labels))
    else:
        total = c.ReduceSum(w, keepdims=0) if w is not None else c.CastLike(c.Size(labels), scores)
        g = c.Expand(c.Div(dy, total), c.Shape(labels))
    g = c.Mul(g, w) if w is not None else g
    dx = c.Mul(c.Sub(c.Exp(log_prob), onehot), c.Unsqueeze(g, c.ints([1])))
    if c.GO(1) is not None:  # NOTE: log_prob read by a gradient graph (this rule's): log_softmax's rule on axis 1
        dlp = c.GO(1)
        dx = c.Add(dx, c.Sub(dlp, c.Mul(c.Exp(log_prob), c.ReduceSum(dlp, c.ints([1]), keepdims=1))))
    return [dx]


# ==== rewrites ===========================================================================================
# This family's ops rewritten before differentiation into ops that have rules (``passes.decompose`` applies
# them for both gradient sources), and its gradient definitions given to the training build's builder too
# (``autodiff.rewrite``). The rules above do not depend on this section.

import onnx_ir as ir  # noqa: E402

from onnxopt.autodiff.rewrite import _ZERO, _f, _has_rank, _k, _rank, rewrite, template  # noqa: E402


@rewrite("LpNormalization", family=F)
def _lp_normalization(op, node, x):
    axes = op.Constant(value_ints=[node.attributes.get_int("axis", -1)])
    p = node.attributes.get_int("p", 2)
    # NOTE: Sqrt(ReduceSum(x²)), not ReduceL2: onnxruntime has no float64 ReduceL2
    norm = op.Sqrt(op.ReduceSum(op.Mul(x, x), axes, keepdims=1)) if p == 2 else op.ReduceSum(op.Abs(x), axes, keepdims=1)
    return op.Div(x, norm)


def _normalize(op, x, axes, epsilon: float, like=None):
    """(x - E[x]) / sqrt(Var[x] + epsilon) over ``axes`` (``like``: a value of the same type, when x is new)."""
    centred = op.Sub(x, op.ReduceMean(x, axes, keepdims=1))
    variance = op.ReduceMean(op.Mul(centred, centred), axes, keepdims=1)
    return op.Div(centred, op.Sqrt(op.Add(variance, _k(op, epsilon, x if like is None else like))))


@rewrite("MeanVarianceNormalization", family=F)
def _mvn(op, node, x):
    """The ONNX function of MeanVarianceNormalization: (x - E[x]) / (sqrt(E[x²] - E[x]²) + 1e-9)."""
    axes = op.Constant(value_ints=list(node.attributes.get_ints("axes", [0, 2, 3])))
    mean = op.ReduceMean(x, axes, keepdims=1)
    variance = op.Sub(op.ReduceMean(op.Mul(x, x), axes, keepdims=1), op.Mul(mean, mean))
    return op.Div(op.Sub(x, mean), op.Add(op.Sqrt(variance), _k(op, 1e-9, x)))


def _channel(op, v, rank: int):
    """A (C,) vector shaped (C, 1, ..., 1) to broadcast over an (N, C, ...) tensor of ``rank``."""
    return op.Reshape(v, op.Constant(value_ints=[-1] + [1] * (rank - 2)))


@rewrite("InstanceNormalization", family=F, check=_has_rank)
def _instance_norm(op, node, x, scale, bias):
    rank = len(x.shape)
    y = _normalize(op, x, op.Constant(value_ints=list(range(2, rank))), _f(node, "epsilon", 1e-5))
    return op.Add(op.Mul(y, _channel(op, scale, rank)), _channel(op, bias, rank))


def _double_check(node: ir.Node) -> str | None:
    if node.inputs[0].dtype != ir.DataType.DOUBLE or len(node.outputs) != 1:
        return "only float64 single-output LayerNormalization is rewritten (LayerNormalizationGrad is float)"
    return _has_rank(node)


@rewrite("LayerNormalization", family=F, check=_double_check)
def _layer_norm_rewrite(op, node, x, scale, bias=None):
    rank = len(x.shape)
    axis = node.attributes.get_int("axis", -1) % rank
    y = op.Mul(_normalize(op, x, op.Constant(value_ints=list(range(axis, rank))), _f(node, "epsilon", 1e-5)), scale)
    return y if bias is None else op.Add(y, bias)


@rewrite("GroupNormalization", family=F, check=_has_rank)
def _group_norm(op, node, x, scale, bias):
    """Normalizes (N, groups, -1), then scale and bias per channel (opset 21) or per group (opset 18)."""
    groups = node.attributes.get_int("num_groups")
    grouped = op.Reshape(x, op.Constant(value_ints=[0, groups, -1]))
    y = _normalize(op, grouped, op.Constant(value_ints=[2]), _f(node, "epsilon", 1e-5), like=x)
    if node.graph is not None and node.graph.opset_imports.get("", 21) < 21:
        per_group = op.Constant(value_ints=[1, groups, 1])
        y = op.Add(op.Mul(y, op.Reshape(scale, per_group)), op.Reshape(bias, per_group))
        return op.Reshape(y, op.Shape(x))
    rank = _rank(node)
    return op.Add(op.Mul(op.Reshape(y, op.Shape(x)), _channel(op, scale, rank)), _channel(op, bias, rank))


@rewrite("LRN", family=F, check=lambda node: _has_rank(node, 3))
def _lrn(op, node, x):
    """x / (bias + alpha/size · Σ_window x²)^beta, the window sum over channels an AveragePool times its size."""
    size = node.attributes.get_int("size")
    alpha, beta, bias = _f(node, "alpha", 1e-4), _f(node, "beta", 0.75), _f(node, "bias", 1.0)
    squares = op.Reshape(op.Mul(x, x), op.Constant(value_ints=[0, 1, 0, -1]))
    pads = [(size - 1) // 2, 0, size - 1 - (size - 1) // 2, 0]
    window = op.AveragePool(squares, kernel_shape=[size, 1], pads=pads, count_include_pad=1)
    total = op.Reshape(op.Mul(window, _k(op, float(size), x)), op.Shape(x))
    scale = op.Add(_k(op, bias, x), op.Mul(_k(op, alpha / size, x), total))
    return op.Div(x, op.Pow(scale, _k(op, beta, x)))


@rewrite("NegativeLogLikelihoodLoss", family=F)
def _nll_loss(op, node, x, target, weight=None):
    """-x[n, t_n]·w[t_n], then none / sum / mean (Σ loss / Σ w); ignore_index rows weigh 0."""
    ignore = node.attributes.get_int("ignore_index", None)
    keep = None
    if ignore is not None:
        keep = op.Not(op.Equal(target, op.Constant(value_int=ignore)))
        target = op.Where(keep, target, op.Constant(value_int=0))
    picked = op.GatherElements(x, op.Unsqueeze(target, op.Constant(value_ints=[1])), axis=1)
    picked = op.Squeeze(picked, op.Constant(value_ints=[1]))
    w = op.Gather(weight, target, axis=0) if weight is not None else None
    if keep is not None:
        w = op.Cast(keep, to=x.dtype) if w is None else op.Where(keep, w, _k(op, 0.0, x))
    loss = op.Neg(picked if w is None else op.Mul(picked, w))
    reduction = node.attributes.get_string("reduction", "mean")
    if reduction == "none":
        return loss
    total = op.ReduceSum(loss, keepdims=0)
    if reduction == "sum":
        return total
    return op.Div(total, op.ReduceSum(w, keepdims=0) if w is not None else op.Cast(op.Size(target), to=x.dtype))


# ---- gradient definitions: (op_type, inputs, outputs[, {attribute: value}]) per node, GI(0) = dL/dI(0)


for _op in ("Hardmax",):
    template(_op, _ZERO, family=F)
