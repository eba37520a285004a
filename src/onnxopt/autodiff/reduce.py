"""Reductions: the output gradient broadcast back over the reduced axes (times the local derivative)."""

from __future__ import annotations

import onnx_ir as ir

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
    count = c.Div(c.Size(x), c.Size(y))
    count.type = ir.TensorType(ir.DataType.INT64)  # NOTE: so Ctx.CastLike writes the Cast folding would make
    return c.CastLike(count, x)


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


# ==== rewrites ===========================================================================================
# This family's ops rewritten before differentiation into ops that have rules (``passes.decompose`` applies
# them for both gradient sources), and its gradient definitions given to the training build's builder too
# (``autodiff.rewrite``). The rules above do not depend on this section.

import onnx_ir as ir  # noqa: E402

from onnxopt.autodiff.rewrite import _has_rank, _k, _rank, rewrite  # noqa: E402


def _reduce_attrs(node: ir.Node, keepdims: int | None = None) -> dict:
    return {"keepdims": node.attributes.get_int("keepdims", 1) if keepdims is None else keepdims,
            "noop_with_empty_axes": node.attributes.get_int("noop_with_empty_axes", 0)}


def _reduce_sum_rewrite(op, node, x, axes=None, keepdims=None):
    args = [x] if axes is None else [x, axes]
    return op.ReduceSum(*args, **_reduce_attrs(node, keepdims))


def _reduce_extreme_rewrite(reduce: str):
    """ReduceMax/ReduceMin as Σ(x where x is extreme) / count: the gradient goes evenly to ties (as torch's amax)."""
    def build(op, node, x, axes=None):
        args = [x] if axes is None else [x, axes]
        extreme = getattr(op, reduce)(*args, **_reduce_attrs(node, 1))
        mask = op.Equal(x, extreme)
        count = _reduce_sum_rewrite(op, node, op.Cast(mask, to=x.dtype), axes)
        return op.Div(_reduce_sum_rewrite(op, node, op.Where(mask, x, _k(op, 0.0, x)), axes), count)
    return build


def _prod_axes(node: ir.Node, rank: int) -> list[int]:
    axes = node.inputs[1] if len(node.inputs) > 1 else None
    if axes is None:
        return [] if node.attributes.get_int("noop_with_empty_axes", 0) else list(range(rank))
    return sorted(int(a) % rank for a in axes.const_value.numpy().reshape(-1))


def _reduce_prod_check(node: ir.Node) -> str | None:
    shape, axes = node.inputs[0].shape, node.inputs[1] if len(node.inputs) > 1 else None
    if shape is None or (axes is not None and axes.const_value is None):
        return "the rank or the axes are unknown"
    if any(not isinstance(shape[a], int) for a in _prod_axes(node, len(shape))):
        return "a reduced axis has no static size"
    return None


@rewrite("ReduceProd", family=F, check=_reduce_prod_check)
def _reduce_prod(op, node, x, axes=None):
    """The product as a chain of Mul over slices, one reduced axis at a time: its gradient (products of the
    other factors) is exact where x has zeros, which ``prod / x`` is not. Needs static sizes (checked)."""
    rank, shape = len(x.shape), x.shape
    for axis in _prod_axes(node, rank):
        parts = op.Split(x, axis=axis, num_outputs=shape[axis], _outputs=shape[axis]) if shape[axis] > 1 else [x]
        x = parts[0]
        for part in list(parts)[1:]:
            x = op.Mul(x, part)
    keep = node.attributes.get_int("keepdims", 1)
    return x if keep else op.Squeeze(x, op.Constant(value_ints=_prod_axes(node, rank)))


def _extreme_check(node: ir.Node) -> str | None:
    # NOTE: the rewrite itself holds a ReduceMax/Min read by an Equal (the mask): never rewrite that one again
    if any(user.op_type == "Equal" for user, _ in node.outputs[0].uses()):
        return "already decomposed (read by the tie mask)"
    return None


rewrite("ReduceMax", family=F, check=_extreme_check)(_reduce_extreme_rewrite("ReduceMax"))


rewrite("ReduceMin", family=F, check=_extreme_check)(_reduce_extreme_rewrite("ReduceMin"))


@rewrite("ReduceL1", family=F)
def _reduce_l1(op, node, x, axes=None):
    return _reduce_sum_rewrite(op, node, op.Abs(x), axes)


@rewrite("ReduceSumSquare", family=F)
def _reduce_sum_square(op, node, x, axes=None):
    return _reduce_sum_rewrite(op, node, op.Mul(x, x), axes)


@rewrite("ReduceLogSum", family=F)
def _reduce_log_sum(op, node, x, axes=None):
    return op.Log(_reduce_sum_rewrite(op, node, x, axes))


def _cumsum_check(node: ir.Node) -> str | None:
    axis = node.inputs[1]
    return "the axis is not a constant" if axis is None or axis.const_value is None else _has_rank(node, 1)


@rewrite("CumSum", family=F, check=_cumsum_check)
def _cumsum(op, node, x, axis):
    """x moved so ``axis`` is last, times a 0/1 triangular matrix built at run time, moved back."""
    rank = _rank(node)
    axis = int(axis.const_value.numpy().reshape(-1)[0]) % rank
    perm = list(range(rank))
    perm[axis], perm[-1] = perm[-1], perm[axis]
    n = op.Squeeze(op.Slice(op.Shape(x), op.Constant(value_ints=[axis]), op.Constant(value_ints=[axis + 1])))
    steps = op.Range(op.Constant(value_int=0), n, op.Constant(value_int=1))
    rows, cols = op.Unsqueeze(steps, op.Constant(value_ints=[1])), steps
    exclusive, reverse = node.attributes.get_int("exclusive", 0), node.attributes.get_int("reverse", 0)
    compare = {(0, 0): op.LessOrEqual, (1, 0): op.Less, (0, 1): op.GreaterOrEqual, (1, 1): op.Greater}
    triangle = op.Cast(compare[exclusive, reverse](rows, cols), to=x.dtype)
    if axis == rank - 1:  # NOTE: no identity Transpose: ORT's GemmTransposeFusion folds it as a transpose
        return op.MatMul(x, triangle)
    return op.Transpose(op.MatMul(op.Transpose(x, perm=perm), triangle), perm=perm)
