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
    return [c.Reshape(c.go(0), c.shape_of(c.I(0)))]


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
    """dx = dy scatter-added into zeros at the gathered slices; batch_dims 1 (TorchScript's torch.diagonal of a
    batch) by the batch index prepended to each index tuple."""
    x, dy, idx = c.I(0), c.go(0), c.I(1)
    batch_dims = c.attr("batch_dims", 0)
    if batch_dims > 1:
        raise ValueError(f"GatherND node {c.node.name!r}: batch_dims > 1 has no rule")
    if batch_dims == 1:
        q = c.rank(idx)
        if q is None:
            raise ValueError(f"GatherND node {c.node.name!r}: batch_dims 1 needs the rank of the indices")
        shape = c.Shape(idx)
        n = c.Gather(shape, c.ints([0]))
        rows = c.Reshape(c.Range(c.Constant(value=ir.tensor(np.array(0, np.int64))), c.Squeeze(n),
                                 c.Constant(value=ir.tensor(np.array(1, np.int64)))), c.ints([-1] + [1] * (q - 1)))
        rows = c.Expand(rows, c.Concat(c.Slice(shape, c.ints([0]), c.ints([-1])), c.ints([1]), axis=0))
        idx = c.Concat(c.CastLike(rows, idx), idx, axis=-1)
    return [c.ScatterND(c.Expand(c.const(0.0, dy), c.Shape(x)), idx, dy, reduction="add")]


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
    """d data = dy with the written positions zeroed (reduction "add": dy); d updates = dy gathered there
    (the gradients of the rules of Gather, GatherND, GatherElements, TopK, MaxPool are such scatters)."""
    add = c.attr("reduction", "none") == "add"
    if c.attr("reduction", "none") not in ("none", "add", None):
        raise ValueError(f"{c.node.op_type} node {c.node.name!r}: reduction {c.attr('reduction')!r} has no rule")
    dy, idx = c.go(0), c.I(1)
    nd = c.node.op_type == "ScatterND"
    axis = {} if nd else {"axis": c.attr("axis", 0)}
    scatter = c.ScatterND if nd else c.ScatterElements
    gather = c.GatherND if nd else c.GatherElements
    d_data = None if not c.need(0) else dy if add else \
        scatter(dy, idx, c.Expand(c.const(0.0, dy), c.Shape(c.I(2))), **axis)
    d_updates = gather(dy, idx, **axis) if c.need(2) else None
    return [d_data, None, d_updates]


# ==== rewrites ===========================================================================================
# This family's ops rewritten before differentiation into ops that have rules (``passes.decompose`` applies
# them for both gradient sources), and its gradient definitions given to the training build's builder too
# (``autodiff.rewrite``). The rules above do not depend on this section.

from onnxopt.autodiff.rewrite import (  # noqa: E402
    _ZERO, _has_rank, _int_input, _k, _needs, _rank, rewrite, template,
)


@rewrite("Range", family=F)
def _range(op, node, start, limit, delta):
    """start + i·delta for i < max(ceil((limit - start) / delta), 0), as the spec defines it: the builder
    differentiates it in start and delta (limit only moves the length: zero gradient)."""
    n = op.Cast(op.Max(op.Ceil(op.Div(op.Sub(limit, start), delta)), _k(op, 0.0, start)), to=ir.DataType.INT64)
    i = op.Range(op.Constant(value_int=0), n, op.Constant(value_int=1))
    return op.Add(start, op.Mul(op.CastLike(i, start), delta))


def _transpose_check(node: ir.Node) -> str | None:
    # NOTE: the builder's Transpose gradient reads 'perm' and fails (unordered_map::at) when it is omitted;
    # an identity perm becomes Identity: ORT's GemmTransposeFusion folds it into a Gemm as a 2-D transpose
    if "perm" in node.attributes:
        perm = list(node.attributes.get_ints("perm"))
        return None if perm == list(range(len(perm))) else "perm is given"
    return _has_rank(node, 1)


@rewrite("Transpose", family=F, check=_transpose_check)
def _transpose_rewrite(op, node, x):
    if "perm" in node.attributes:  # NOTE: the identity (_transpose_check)
        return op.Identity(x)
    return op.Transpose(x, perm=list(range(len(x.shape)))[::-1])


@rewrite("Compress", family=F)
def _compress(op, node, x, condition):
    index = op.Reshape(op.NonZero(condition), op.Constant(value_ints=[-1]))
    if "axis" not in node.attributes:
        return op.Gather(op.Reshape(x, op.Constant(value_ints=[-1])), index, axis=0)
    return op.Gather(x, index, axis=node.attributes.get_int("axis"))


@rewrite("OneHot", family=F)
def _one_hot(op, node, indices, depth, values):
    code = op.OneHot(indices, depth, op.Constant(value_ints=[0, 1]), axis=node.attributes.get_int("axis", -1))
    on, off = op.Gather(values, op.Constant(value_int=1)), op.Gather(values, op.Constant(value_int=0))
    # NOTE: on·m + off·(1 - m), m in {0, 1}, is exact; the builder's Where gradient does not reduce broadcasts
    m = op.Cast(code, to=values.dtype)
    return op.Add(op.Mul(on, m), op.Mul(off, op.Sub(op.CastLike(op.Constant(value_int=1), values), m)))


def _dims(op, x, blocks: int):
    """N, C, H, W of a 4-D ``x`` as 1-element int64 tensors, and ``blocks`` as one."""
    shape = op.Shape(x)
    dims = [op.Slice(shape, op.Constant(value_ints=[i]), op.Constant(value_ints=[i + 1])) for i in range(4)]
    return dims, op.Constant(value_ints=[blocks])


@rewrite("DepthToSpace", family=F, check=lambda node: _has_rank(node, 4))
def _depth_to_space(op, node, x):
    b = node.attributes.get_int("blocksize")
    (n, c, h, w), bb = _dims(op, x, b)
    depth = op.Div(c, op.Constant(value_ints=[b * b]))
    if node.attributes.get_string("mode", "DCR") == "DCR":
        split, perm = [n, bb, bb, depth, h, w], [0, 3, 4, 1, 5, 2]
    else:
        split, perm = [n, depth, bb, bb, h, w], [0, 1, 4, 2, 5, 3]
    y = op.Transpose(op.Reshape(x, op.Concat(*split, axis=0)), perm=perm)
    return op.Reshape(y, op.Concat(n, depth, op.Mul(h, bb), op.Mul(w, bb), axis=0))


@rewrite("SpaceToDepth", family=F, check=lambda node: _has_rank(node, 4))
def _space_to_depth(op, node, x):
    b = node.attributes.get_int("blocksize")
    (n, c, h, w), bb = _dims(op, x, b)
    h2, w2 = op.Div(h, bb), op.Div(w, bb)
    y = op.Transpose(op.Reshape(x, op.Concat(n, c, h2, bb, w2, bb, axis=0)), perm=[0, 3, 5, 1, 2, 4])
    return op.Reshape(y, op.Concat(n, op.Mul(c, op.Constant(value_ints=[b * b])), h2, w2, axis=0))


@rewrite("ReverseSequence", family=F, check=_has_rank)
def _reverse_sequence(op, node, x, lengths):
    """GatherElements along the time axis with index lengths - 1 - t where t < lengths, else t."""
    time_axis, rank = node.attributes.get_int("time_axis", 0), _rank(node)
    steps = op.Squeeze(op.Slice(op.Shape(x), op.Constant(value_ints=[time_axis]), op.Constant(value_ints=[time_axis + 1])))
    t = op.Range(op.Constant(value_int=0), steps, op.Constant(value_int=1))
    t = op.Unsqueeze(t, op.Constant(value_ints=[1 - time_axis]))  # (T, 1) or (1, T)
    lengths = op.Unsqueeze(lengths, op.Constant(value_ints=[time_axis]))  # (1, B) or (B, 1)
    index = op.Where(op.Less(t, lengths), op.Sub(op.Sub(lengths, op.Constant(value_int=1)), t), t)
    if rank > 2:
        index = op.Unsqueeze(index, op.Constant(value_ints=list(range(2, rank))))
    return op.GatherElements(x, op.Expand(index, op.Shape(x)), axis=time_axis)


@rewrite("CenterCropPad", family=F,
         check=_needs(1, static=True, reason="the target shape is not a constant or the input shape is not static"))
def _center_crop_pad(op, node, x, shape):
    """A Slice of the centred window where the input is larger, a zero Pad where it is smaller."""
    dims, target = list(x.shape), _int_input(node, 1)
    axes = [a % len(dims) for a in node.attributes.get_ints("axes", list(range(len(dims))))]
    starts, ends, pads = [0] * len(dims), list(dims), [0] * 2 * len(dims)
    for axis, size in zip(axes, target):
        if size < dims[axis]:
            starts[axis] = (dims[axis] - size) // 2
            ends[axis] = starts[axis] + size
        else:
            pads[axis] = (size - dims[axis]) // 2
            pads[len(dims) + axis] = size - dims[axis] - pads[axis]
    y = op.Slice(x, op.Constant(value_ints=starts), op.Constant(value_ints=ends))
    return op.Pad(y, op.Constant(value_ints=pads))


@rewrite("Unique", family=F, outputs=(1, 2, 3, 4),
         check=lambda node: None if node.outputs[0].uses() or node.outputs[0].is_graph_output() else
         "the values are not read")
def _unique(op, node, x):
    """The values as a Gather of the input at their first occurrences (the op's ``indices``): the same values,
    differentiable (a.e.: a tie changes the output's shape); the other outputs stay the op's."""
    axis = node.attributes.get_int("axis", None)
    outs = op.Unique(x, _outputs=4, **({} if axis is None else {"axis": axis}), sorted=node.attributes.get_int("sorted", 1))
    source = op.Reshape(x, op.Constant(value_ints=[-1])) if axis is None else x
    return (op.Gather(source, outs[1], axis=axis or 0), *outs[1:])[:len(node.outputs)]


# ---- gradient definitions: (op_type, inputs, outputs[, {attribute: value}]) per node, GI(0) = dL/dI(0)


for _op in ("EyeLike",):
    template(_op, _ZERO, family=F)
