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
    return [c.Mul(c.Sub(c.Exp(log_prob), onehot), c.Unsqueeze(g, c.ints([1])))]
