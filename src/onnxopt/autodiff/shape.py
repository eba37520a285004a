"""Shape and indexing ops: the output gradient moved, cut, padded or scatter-added back to the input."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxopt.autodiff.engine import rule
from onnxopt.errors import ModelError
from onnxopt.passes.lower import gather_elements_grad, gather_grad, slice_grad

F = "shape/indexing"


@rule("Reshape", "Flatten", "Squeeze", "Unsqueeze", family=F, inputs=(0,))
def _reshape(c):
    """dx = dy reshaped to x's shape."""
    return [c.Reshape(c.go(0), c.Shape(c.I(0)))]


@rule("Transpose", family=F)
def _transpose(c):
    """dx = dy transposed by the inverse permutation."""
    perm = c.attr("perm", None)
    if perm is None:
        perm = list(range(c.rank(c.I(0))))[::-1]
    return [c.Transpose(c.go(0), perm=[int(i) for i in np.argsort(perm)])]


@rule("Concat", family=F)
def _concat(c):
    """dx_i = the slice of dy that x_i filled."""
    axis = c.attr("axis")
    xs = list(c.node.inputs)
    sizes = c.Concat(*[c.Shape(x, start=axis, end=axis + 1) if axis != -1 else c.Shape(x, start=-1) for x in xs],
                     axis=0)
    parts = c.Split(c.go(0), sizes, axis=axis, _outputs=len(xs)) if len(xs) > 1 else [c.Identity(c.go(0))]
    return [p if c.need(i) else None for i, p in enumerate(parts)]


@rule("Split", family=F, inputs=(0,))
def _split(c):
    """dx = the output gradients concatenated (zeros for an output no gradient reaches)."""
    return [c.Concat(*[c.go(i) for i in range(len(c.node.outputs))], axis=c.attr("axis", 0))]


@rule("Slice", family=F, inputs=(0,))
def _slice(c):
    """dx = dy padded back where the steps are 1, else written into zeros at the sliced positions."""
    x, dy = c.I(0), c.go(0)
    padded = _slice_as_pad(c, x, dy)
    if padded is not None:
        return [padded]
    return [slice_grad(c, dy, c.Shape(x), *c.node.inputs[1:])]


def _const(v):
    return None if v is None or v.const_value is None else v.const_value.numpy().reshape(-1).astype(np.int64)


def _slice_as_pad(c, x, dy):
    """A Pad of dy by (start, size - end) per axis, when starts, ends, axes and steps are constants, the steps
    1 and the sliced axes' sizes static."""
    ins = list(c.node.inputs) + [None] * (5 - len(c.node.inputs))
    starts, ends, axes, steps = (_const(v) for v in ins[1:5])
    dims = c.static_dims(x)
    if starts is None or ends is None or dims is None or (ins[3] is not None and axes is None) \
            or (ins[4] is not None and (steps is None or (steps != 1).any())):
        return None
    r = len(dims)
    axes = np.arange(len(starts)) if axes is None else axes % r
    pads = [0] * (2 * r)
    for a, s, e in zip(axes, starts, ends):
        n = dims[a]
        if not isinstance(n, int):
            return None
        s, e = (min(max(int(v) + n if v < 0 else int(v), 0), n) for v in (s, e))
        pads[a], pads[r + a] = s, n - max(e, s)
    return c.Pad(dy, c.ints(pads))


@rule("Gather", family=F, inputs=(0,))
def _gather(c):
    """dx = dy scatter-added into zeros at the gathered indices (an embedding's rows)."""
    x, idx = c.I(0), c.I(1)
    axis = c.attr("axis", 0)
    dims = c.static_dims(x)
    if dims is not None and axis < 0:
        axis += len(dims)
    n = c.Gather(c.Shape(x), c.ints([axis]))
    shape = idx.shape or (ir.Shape(c.dims(idx)) if c.dims(idx) is not None else None)
    if not _non_negative(idx):
        idx = c.Where(c.Less(idx, c.Constant(value=_zero_like(c, idx))), c.Add(idx, c.CastLike(c.Squeeze(n), idx)), idx)
    if c.dtype(idx) != ir.DataType.INT64:
        idx = c.Cast(idx, to=ir.DataType.INT64)
    idx.shape = shape  # NOTE: gather_grad reads the rank of the indices
    return [gather_grad(c, c.Shape(x), idx, c.go(0), axis=axis)]


def _non_negative(idx) -> bool:
    return idx.const_value is not None and bool((idx.const_value.numpy() >= 0).all())


def _zero_like(c, v):
    dtype = c.dtype(v)
    return ir.tensor(np.array(0, dtype=dtype.numpy() if dtype is not None else np.int64))


@rule("GatherElements", family=F, inputs=(0,))
def _gather_elements(c):
    """dx = dy scatter-added into zeros along ``axis``."""
    x, idx = c.I(0), c.I(1)
    axis = c.attr("axis", 0)
    if not _non_negative(idx):  # NOTE: as Gather's: constant indices need no run-time normalization
        n = c.Gather(c.Shape(x), c.ints([axis]))
        idx = c.Where(c.Less(idx, c.Constant(value=_zero_like(c, idx))), c.Add(idx, c.CastLike(n, idx)), idx)
    return [gather_elements_grad(c, c.go(0), c.Shape(x), idx, axis=axis)]


@rule("GatherND", family=F, inputs=(0,))
def _gather_nd(c):
    """dx = dy scatter-added into zeros at the gathered slices (batch_dims 0)."""
    if c.attr("batch_dims", 0):
        raise ValueError(f"GatherND node {c.node.name!r}: batch_dims > 0 has no rule")
    x, dy = c.I(0), c.go(0)
    return [c.ScatterND(c.Expand(c.const(0.0, dy), c.Shape(x)), c.I(1), dy, reduction="add")]


@rule("Tile", family=F, inputs=(0,))
def _tile(c):
    """dx = dy reshaped (r_0, n_0, r_1, n_1, ...) and summed over the repeats."""
    x, dy = c.I(0), c.go(0)
    r = c.rank(x)
    shape = c.Shape(x)
    pairs = c.Reshape(c.Concat(c.Unsqueeze(c.I(1), c.ints([1])), c.Unsqueeze(shape, c.ints([1])), axis=1),
                      c.ints([-1]))
    return [c.ReduceSum(c.Reshape(dy, pairs), c.ints(range(0, 2 * r, 2)), keepdims=0)]


@rule("Pad", family=F, inputs=(0,))
def _pad(c):
    """dx = dy cut where the constant pad added (mode constant)."""
    if c.attr("mode", "constant") != "constant":
        raise ModelError(f"model: Pad node {c.node.name!r} has mode {c.attr('mode')!r} and needs a gradient; "
                         "its rule handles constant mode only: pad with a constant where a gradient flows (torch: "
                         "padding_mode='zeros', F.pad(..., mode='constant'))")
    dy = c.go(0)
    pads = c.node.inputs[1]
    axes = c.node.inputs[3] if len(c.node.inputs) > 3 else None
    const = _const(pads)
    r = 0 if const is None else len(const) // 2
    if const is not None and axes is None and (const >= 0).all():  # NOTE: a Slice: onnx.reference refuses crops
        ends = [-e if e > 0 else np.iinfo(np.int64).max for e in const[r:]]
        return [c.Slice(dy, c.ints(const[:r]), c.ints(ends), c.ints(range(r)))]
    r = c.rank(c.I(0))
    if const is None and axes is None and r is not None:  # NOTE: pads computed in the graph (TorchScript)
        zero = c.Constant(value_int=0)
        begin, end = c.Slice(pads, c.ints([0]), c.ints([r])), c.Slice(pads, c.ints([r]), c.ints([2 * r]))
        cut = c.Slice(dy, c.Max(begin, zero), c.Sub(c.Shape(dy), c.Max(end, zero)), c.ints(range(r)))
        return [c.Pad(cut, c.Max(c.Neg(pads), zero))]  # NOTE: where the forward cropped, zeros
    negated = c.ints(-const) if const is not None else c.Neg(pads)
    return [c.Pad(dy, negated, *([None, axes] if axes is not None else []))]


@rule("TopK", family=F, inputs=(0,))
def _topk(c):
    """dx = dy scatter-added at the indices TopK took."""
    x = c.I(0)
    axis = c.attr("axis", -1)
    zeros = c.Expand(c.const(0.0, x), c.Shape(x))
    return [c.ScatterElements(zeros, c.O(1), c.go(0), axis=axis, reduction="add")]


@rule("ScatterND", "ScatterElements", family=F, inputs=(0, 2))
def _scatter(c):
    """d data = dy with the written positions zeroed; d updates = dy gathered there (no reduction)."""
    if c.attr("reduction", "none") not in ("none", None):
        raise ValueError(f"{c.node.op_type} node {c.node.name!r}: reduction {c.attr('reduction')!r} has no rule")
    dy, idx = c.go(0), c.I(1)
    nd = c.node.op_type == "ScatterND"
    axis = {} if nd else {"axis": c.attr("axis", 0)}
    scatter = c.ScatterND if nd else c.ScatterElements
    gather = c.GatherND if nd else c.GatherElements
    d_data = scatter(dy, idx, c.Expand(c.const(0.0, dy), c.Shape(c.I(2))), **axis) if c.need(0) else None
    d_updates = gather(dy, idx, **axis) if c.need(2) else None
    return [d_data, None, d_updates]
