"""Convolutions and pooling, written with the forward kernels stock onnxruntime optimizes (Conv, ConvTranspose)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxopt.autodiff.engine import rule
from onnxopt.errors import ModelError
from onnxopt.passes.lower import _conv_transpose_to, conv_grad, conv_weight_grad, divide_by_window_counts

F = "conv/pool"
_CONV = ("kernel_shape", "strides", "pads", "dilations", "group", "auto_pad")


def _explicit_pads(c, what: str) -> list[int]:
    """The node's pads; auto_pad SAME_* is refused by name (its pads depend on the input size)."""
    auto = c.attr("auto_pad", "NOTSET")
    if auto not in ("NOTSET", "VALID"):
        raise ModelError(f"model: {what} node {c.node.name!r} has auto_pad={auto!r}; expected NOTSET or VALID "
                         "(export the model with explicit pads)")
    r = c.rank(c.I(0))
    if r is None:
        r = 2 + len(c.attr("kernel_shape", []))
    return list(c.attr("pads", [0] * (2 * (r - 2))))


@rule("Conv", family=F)
def _conv(c):
    """dX, dW, dB as ``passes.lower.conv_grad`` writes them (the ConvGrad lowering shares it)."""
    _explicit_pads(c, "Conv")
    dx, dw, db = conv_grad(c, c.go(0), c.I(0), c.I(1), **c.attrs(*_CONV))
    return [dx, dw, db]


@rule("ConvTranspose", family=F)
def _conv_transpose(c):
    """ConvTranspose(X, W) is the adjoint of Conv(·, W) (same strides, pads, dilations, group): dX = Conv(dY, W),
    dW = that Conv's weight gradient with dY its input and X its output gradient (``conv_weight_grad``: im2col,
    no zeros inserted), dB = dY summed but over channels."""
    if "output_shape" in c.node.attributes or c.attr("auto_pad", "NOTSET") != "NOTSET":
        raise ValueError("ConvTranspose with output_shape or auto_pad has no rule")
    x, w, dy = c.I(0), c.I(1), c.go(0)
    r = c.rank(x) if c.rank(x) is not None else c.rank(c.O(0))
    attrs = {"strides": [1] * (r - 2), "pads": [0] * (2 * r - 4), "dilations": [1] * (r - 2), "group": 1,
             **c.attrs("strides", "pads", "dilations", "group")}
    dx = c.Conv(dy, w, **attrs) if c.need(0) else None
    dw = None
    if c.need(1):
        kernel = list(c.attr("kernel_shape", None) or (c.dims(w) or [None] * r)[2:])
        ys, xs = c.dims(c.O(0)) or (None,) * r, c.dims(x) or (None,) * r
        # NOTE: channels and sizes from the forward values: dY, a value a rule wrote, has no shape of its own
        dw = conv_weight_grad(c, x, dy, w, r - 2, None if None in kernel else kernel, ys[1], xs[1], list(xs[2:]),
                              list(attrs["strides"]), list(attrs["pads"]), list(attrs["dilations"]), attrs["group"])
    db = c.ReduceSum(dy, c.ints([0, *range(2, r)]), keepdims=0) if c.need(2) else None
    return [dx, dw, db]


@rule("MaxPool", family=F, inputs=(0,))
def _max_pool(c):
    """dX = dY scatter-added at the positions MaxPool took (its Indices output, added when missing)."""
    node = c.node
    if c.attr("storage_order", 0):
        raise ModelError(f"model: MaxPool node {node.name!r} has storage_order=1; expected 0")
    if len(node.outputs) < 2:
        node.resize_outputs(2)
    indices = node.outputs[1]
    indices.type, indices.shape = ir.TensorType(ir.DataType.INT64), node.outputs[0].shape
    x, dy = c.I(0), c.go(0)
    shape = c.Shape(x)
    flat = c.Expand(c.const(0.0, dy), c.ReduceProd(shape, keepdims=1))
    flat = c.ScatterElements(flat, c.Reshape(indices, c.ints([-1])), c.Reshape(dy, c.ints([-1])), axis=0,
                             reduction="add")
    return [c.Reshape(flat, shape)]


def _windows(c, r: int) -> tuple[list, list, list, list]:
    kernel = list(c.attr("kernel_shape"))
    strides = list(c.attr("strides", [1] * r))
    dilations = list(c.attr("dilations", [1] * r))
    pads = _explicit_pads(c, c.node.op_type)
    return kernel, strides, dilations, pads


@rule("AveragePool", family=F)
def _average_pool(c):
    """Each dY ÷ its window's divisor, spread over the window: a ConvTranspose by ones. The divisor is the
    kernel size, or (pads not counted, ceil_mode) as the forward counts (``passes.lower.divide_by_window_counts``,
    which the lowered AveragePoolGrad uses too)."""
    x, dy = c.I(0), c.go(0)
    r = c.rank(x) - 2
    kernel, strides, dilations, pads = _windows(c, r)
    ceil, include = c.attr("ceil_mode", 0), c.attr("count_include_pad", 0)
    flat = c.Reshape(dy, c.Concat(c.ints([-1, 1]), c.Shape(dy, start=2), axis=0))
    ones_kernel = c.Expand(c.const(1.0, dy), c.ints([1, 1, *kernel]))
    flat = divide_by_window_counts(c, flat, x, dy, ones_kernel, kernel, strides, pads, dilations, ceil, include)
    dx = _conv_transpose_to(c, flat, ones_kernel, x, r, strides=strides, pads=pads, dilations=dilations)
    return [c.Reshape(dx, c.shape_of(x))]


@rule("GlobalAveragePool", family=F)
def _global_average_pool(c):
    """dX = dY / (spatial size), broadcast over the spatial axes."""
    x, dy = c.I(0), c.go(0)
    n = c.CastLike(c.ReduceProd(c.Shape(x, start=2), keepdims=0), dy)
    return [c.Expand(c.Div(dy, n), c.Shape(x))]


# ==== rewrites ===========================================================================================
# This family's ops rewritten before differentiation into ops that have rules (``passes.decompose`` applies
# them for both gradient sources), and its gradient definitions given to the training build's builder too
# (``autodiff.rewrite``). The rules above do not depend on this section.

from onnxopt.autodiff.reduce import _reduce_extreme_rewrite  # noqa: E402
from onnxopt.autodiff.rewrite import (  # noqa: E402
    _consts, _f, _has_rank, _int_input, _k, _needs, _rank, _static, _table, rewrite,
)


def _spatial(op, node):
    return op.Constant(value_ints=list(range(2, _rank(node))))


@rewrite("GlobalMaxPool", family=F, check=_has_rank)
def _global_max_pool(op, node, x):
    return _reduce_extreme_rewrite("ReduceMax")(op, node, x, _spatial(op, node))


@rewrite("GlobalLpPool", family=F, check=_has_rank)
def _global_lp_pool(op, node, x):
    p = node.attributes.get_int("p", 2)
    if p == 1:
        return op.ReduceSum(op.Abs(x), _spatial(op, node), keepdims=1)
    total = op.ReduceSum(op.Mul(x, x) if p == 2 else op.Pow(op.Abs(x), _k(op, float(p), x)), _spatial(op, node), keepdims=1)
    return op.Sqrt(total) if p == 2 else op.Pow(total, _k(op, 1.0 / p, x))


@rewrite("LpPool", family=F)
def _lp_pool(op, node, x):
    """(AveragePool(|x|^p, count_include_pad) · window size)^(1/p): LpPool pads with zeros too."""
    p = node.attributes.get_int("p", 2)
    keep = ("kernel_shape", "pads", "strides", "auto_pad", "dilations", "ceil_mode")
    attrs = {k: node.attributes[k].value for k in keep if k in node.attributes}
    powered = op.Mul(x, x) if p == 2 else op.Pow(op.Abs(x), _k(op, float(p), x))
    window = float(np.prod(node.attributes.get_ints("kernel_shape")))
    total = op.Mul(op.AveragePool(powered, count_include_pad=1, **attrs), _k(op, window, x))
    return op.Sqrt(total) if p == 2 else op.Pow(total, _k(op, 1.0 / p, x))


def _same_pads(node: ir.Node) -> list[int] | None:
    """The explicit pads of a Conv with auto_pad SAME_UPPER/SAME_LOWER (torch's ``padding="same"`` as TorchScript
    writes it): by the kernel alone when every stride is 1, else by the static spatial size; None if unknown."""
    x, w = node.inputs[0], node.inputs[1]
    kernel = list(node.attributes.get_ints("kernel_shape", []))
    if not kernel and w.shape is not None and all(isinstance(d, int) for d in w.shape[2:]):
        kernel = list(w.shape[2:])
    if not kernel:
        return None
    n = len(kernel)
    strides = list(node.attributes.get_ints("strides", [1] * n))
    dilations = list(node.attributes.get_ints("dilations", [1] * n))
    sizes = list(x.shape[2:]) if x.shape is not None and len(x.shape) == n + 2 else [None] * n
    begins, ends = [], []
    for k, s, d, size in zip(kernel, strides, dilations, sizes):
        if s == 1:
            total = (k - 1) * d
        elif isinstance(size, int):
            total = max((-(-size // s) - 1) * s + (k - 1) * d + 1 - size, 0)
        else:
            return None
        small = total // 2
        upper = node.attributes.get_string("auto_pad") == "SAME_UPPER"
        begins.append(small if upper else total - small)
        ends.append(total - small if upper else small)
    return begins + ends


def _conv_same_check(node: ir.Node) -> str | None:
    if node.attributes.get_string("auto_pad", "NOTSET") not in ("SAME_UPPER", "SAME_LOWER"):
        return "only auto_pad SAME_UPPER/SAME_LOWER is rewritten"
    return None if _same_pads(node) is not None else "auto_pad SAME with a stride > 1 needs a static spatial shape"


@rewrite("Conv", family=F, check=_conv_same_check)
def _conv_same(op, node, x, w, b=None):
    """Conv with auto_pad SAME_*: the same Conv with the pads written out (the rule needs explicit pads)."""
    attrs = {k: node.attributes[k].value for k in ("kernel_shape", "strides", "dilations", "group")
             if k in node.attributes}
    return op.Conv(*([x, w] if b is None else [x, w, b]), pads=_same_pads(node), **attrs)


def _resize_factors(node: ir.Node) -> list[int] | None:
    """The integer factor of each axis of a nearest Resize given constant scales or sizes, else None."""
    x = node.inputs[0]
    scales = node.inputs[2] if len(node.inputs) > 2 else None
    sizes = node.inputs[3] if len(node.inputs) > 3 else None
    if x.shape is None:
        return None
    if scales is not None and scales.const_value is not None and scales.const_value.size:
        factors = scales.const_value.numpy().astype(np.float64)
    elif sizes is not None and sizes.const_value is not None and all(isinstance(d, int) for d in x.shape):
        factors = sizes.const_value.numpy() / np.array(list(x.shape), dtype=np.float64)
    else:
        return None
    if len(factors) != len(x.shape) or not np.all((factors >= 1) & (factors == np.round(factors))):
        return None
    return [int(f) for f in factors]


def _spatial_sizes(node: ir.Node) -> list[int] | None:
    """The output sizes of a Resize's axes >= 2 given by its ``sizes`` input: a constant, or the exporters'
    ``Concat(Shape(x)[:2], constant)`` (batch and channels kept, whatever the batch)."""
    x, sizes = node.inputs[0], node.inputs[3] if len(node.inputs) > 3 else None
    if sizes is None or x.shape is None:
        return None
    if sizes.const_value is not None:
        return [int(v) for v in sizes.const_value.numpy()[2:]] if sizes.const_value.size == len(x.shape) else None
    concat = sizes.producer()
    if concat is None or concat.op_type != "Concat" or len(concat.inputs) != 2:
        return None
    head, tail = concat.inputs
    if tail is None or tail.const_value is None or tail.const_value.size != len(x.shape) - 2:
        return None
    shape = head.producer() if head is not None else None
    if shape is not None and shape.op_type == "Slice" and all(
            v is not None and v.const_value is not None for v in shape.inputs[1:3]):
        start, end = (int(v.const_value.numpy().reshape(-1)[0]) for v in shape.inputs[1:3])
        axes = shape.inputs[3] if len(shape.inputs) > 3 else None
        if (start, end) != (0, 2) or (axes is not None and (axes.const_value is None or
                                                            axes.const_value.numpy().reshape(-1).tolist() != [0])):
            return None
        shape = shape.inputs[0].producer()
    elif shape is not None and shape.op_type == "Shape" and (shape.attributes.get_int("start", 0),
                                                               shape.attributes.get_int("end", -99)) != (0, 2):
        return None
    if shape is None or shape.op_type != "Shape" or shape.inputs[0] is not x:
        return None
    return [int(v) for v in tail.const_value.numpy()]


def _linear_scales(node: ir.Node) -> list[tuple[float, int]] | None:
    """(scale, output size) of each axis of a linear or cubic Resize given constant scales, or sizes of its axes
    >= 2 (``_spatial_sizes``), when only static axes >= 2 change."""
    x, scales = node.inputs[0], node.inputs[2] if len(node.inputs) > 2 else None
    if x.shape is None:
        return None
    if scales is not None and scales.const_value is not None and scales.const_value.size:
        if scales.const_value.size != len(x.shape):
            return None
        factors = [float(f) for f in scales.const_value.numpy()]
        moved = [k for k, f in enumerate(factors) if f != 1.0]
        if not all(k >= 2 and isinstance(x.shape[k], int) for k in moved):
            return None
        return [(f, int(np.floor(x.shape[k] * f)) if k in moved else None) for k, f in enumerate(factors)]
    sizes = _spatial_sizes(node)
    if sizes is None or not all(isinstance(d, int) for d in x.shape[2:]):
        return None
    return [(1.0, None), (1.0, None)] + [(n / d, n) if n != d else (1.0, None) for n, d in zip(sizes, x.shape[2:])]


def _cubic_weights(t: np.ndarray, a: float) -> np.ndarray:
    """(len(t), 4) weights of the neighbours -1, 0, 1, 2 of the cubic convolution at fractions ``t``."""
    s = np.abs(t[:, None] - np.array([-1.0, 0.0, 1.0, 2.0]))
    near = ((a + 2) * s - (a + 3)) * s * s + 1
    far = ((a * s - 5 * a) * s + 8 * a) * s - 4 * a
    return np.where(s <= 1, near, np.where(s < 2, far, 0.0))


def _interpolation(n_in: int, scale: float, mode: str, n_out: int | None = None,
                   cubic: float | None = None) -> np.ndarray:
    """(n_in, n_out) matrix of 1-D linear (or, ``cubic`` its coefficient a, cubic) interpolation, source
    coordinates as onnxruntime computes them (cubic: neighbours outside clamped to the edge, as torch's
    bicubic)."""
    n_out = int(np.floor(n_in * scale)) if n_out is None else n_out
    i = np.arange(n_out, dtype=np.float64)
    if mode == "align_corners":
        x = i * (n_in - 1) / (n_out - 1) if n_out > 1 else np.zeros(n_out)
    elif mode == "asymmetric":
        x = i / scale
    else:  # half_pixel; pytorch_half_pixel differs only for one output
        x = (i + 0.5) / scale - 0.5 if n_out > 1 or mode == "half_pixel" else np.zeros(n_out)
    a = np.zeros((n_in, n_out))
    if cubic is not None:
        lo = np.floor(x).astype(np.int64)
        weights = _cubic_weights(x - lo, cubic)
        for k in range(4):
            np.add.at(a, (np.clip(lo - 1 + k, 0, n_in - 1), np.arange(n_out)), weights[:, k])
        return a
    x = np.clip(x, 0, n_in - 1)
    lo = np.floor(x).astype(np.int64)
    hi, frac = np.minimum(lo + 1, n_in - 1), x - lo
    np.add.at(a, (lo, np.arange(n_out)), 1 - frac)
    np.add.at(a, (hi, np.arange(n_out)), frac)
    return a


def _resize_linear(op, node, x):
    """Linear or cubic Resize as one MatMul per resized axis by its constant interpolation matrix (ResizeGrad
    has no CPU kernel)."""
    mode = node.attributes.get_string("coordinate_transformation_mode", "half_pixel")
    cubic = node.attributes.get_float("cubic_coeff_a", -0.75) if node.attributes.get_string("mode") == "cubic" \
        else None
    rank, y = len(x.shape), x
    for k, (f, n_out) in enumerate(_linear_scales(node)):
        if f == 1.0:
            continue
        perm = list(range(rank))
        perm[k], perm[-1] = perm[-1], perm[k]
        a = op.CastLike(op.Constant(value=ir.tensor(_interpolation(x.shape[k], f, mode, n_out, cubic))), x)
        if k == rank - 1:
            y = op.MatMul(y, a)
        else:
            y = op.Transpose(op.MatMul(op.Transpose(y, perm=perm), a), perm=perm)
    return y


def _resize_check(node: ir.Node) -> str | None:
    if node.attributes.get_string("mode", "nearest") in ("linear", "cubic"):
        if node.attributes.get_int("antialias", 0) or _linear_scales(node) is None:
            return ("only linear or cubic Resize by constant scales or sizes of static axes >= 2, no antialias, "
                    "is rewritten")
        if node.attributes.get_int("exclude_outside", 0):
            return "cubic Resize with exclude_outside=1 is not rewritten"
        mode = node.attributes.get_string("coordinate_transformation_mode", "half_pixel")
        modes = ("half_pixel", "pytorch_half_pixel", "asymmetric", "align_corners")
        return None if mode in modes else f"coordinate_transformation_mode {mode!r} is not rewritten"
    if node.attributes.get_string("mode", "nearest") != "nearest" or _resize_factors(node) is None:
        return "only nearest Resize by constant integer scales (or sizes of a static shape) is rewritten"
    # NOTE: with integer factors, these modes all pick source index floor(i / factor)
    if node.attributes.get_string("coordinate_transformation_mode", "half_pixel") not in (
            "asymmetric", "half_pixel", "pytorch_half_pixel"):
        return "this coordinate_transformation_mode is not rewritten"
    if node.attributes.get_string("nearest_mode", "round_prefer_floor") not in ("floor", "round_prefer_floor"):
        return "this nearest_mode is not rewritten"
    return None


@rewrite("Resize", family=F, check=_resize_check)
def _resize(op, node, x, *_):
    """Nearest Resize by integer factors: each element repeated (Unsqueeze, Expand, Reshape), a copy; linear and
    cubic: one constant interpolation matrix per resized axis."""
    if node.attributes.get_string("mode", "nearest") in ("linear", "cubic"):
        return _resize_linear(op, node, x)
    factors = _resize_factors(node)
    y = op.Unsqueeze(x, op.Constant(value_ints=[2 * i + 1 for i in range(len(factors))]))
    # NOTE: shapes computed at run time: exported models have a dynamic batch axis
    y = op.Expand(y, op.Constant(value_ints=[v for f in factors for v in (1, f)]))
    return op.Reshape(y, op.Mul(op.Shape(x), op.Constant(value_ints=factors)))


def _conv_transpose_check(node: ir.Node) -> str | None:
    x, w = node.inputs[0], node.inputs[1]
    if x.shape is None or w.shape is None or not all(isinstance(d, int) for d in list(x.shape[2:]) + list(w.shape)):
        return "the spatial shape or the kernel shape is not static"
    if node.attributes.get_int("group", 1) != 1 or any(d != 1 for d in node.attributes.get_ints("dilations", [1])):
        return "groups and dilations are not rewritten"
    if node.attributes.get_string("auto_pad", "NOTSET") != "NOTSET" or "output_shape" in node.attributes:
        return "auto_pad and output_shape are not rewritten"
    kernel, pads = list(w.shape[2:]), list(node.attributes.get_ints("pads", [0] * 2 * len(w.shape[2:])))
    if any(p > kernel[i % len(kernel)] - 1 for i, p in enumerate(pads)):
        return "pads larger than kernel - 1 are not rewritten"
    return None


@rewrite("ConvTranspose", family=F, check=_conv_transpose_check)
def _conv_transpose(op, node, x, w, b=None):
    """ConvTranspose as a Conv: zeros inserted between the inputs (stride), borders padded by k - 1 - pad, the
    kernel flipped and its channel axes swapped."""
    dims, kernel = list(x.shape), list(w.shape[2:])
    rank = len(dims)
    strides = list(node.attributes.get_ints("strides", [1] * (rank - 2)))
    pads = list(node.attributes.get_ints("pads", [0] * 2 * (rank - 2)))
    extra = list(node.attributes.get_ints("output_padding", [0] * (rank - 2)))
    y = x
    for i, axis in enumerate(range(2, rank)):
        n, stride = dims[axis], strides[i]
        if stride > 1:  # NOTE: (.., n, 1, ..) padded to (.., n, stride, ..), reshaped, the trailing zeros cut
            y = op.Unsqueeze(y, op.Constant(value_ints=[axis + 1]))
            widths = [0] * 2 * (len(dims) + 1)
            widths[len(dims) + 1 + axis + 1] = stride - 1
            y = op.Pad(y, op.Constant(value_ints=widths))
            shape = [0, 0] + dims[2:]
            shape[axis] = n * stride
            y = op.Reshape(y, op.Constant(value_ints=shape))
            y = op.Slice(y, op.Constant(value_ints=[0]), op.Constant(value_ints=[(n - 1) * stride + 1]),
                         op.Constant(value_ints=[axis]))
            dims[axis] = (n - 1) * stride + 1
    k = [kernel[i] - 1 for i in range(rank - 2)]
    borders = [0, 0] + [k[i] - pads[i] for i in range(rank - 2)] + [0, 0] + [
        k[i] - pads[rank - 2 + i] + extra[i] for i in range(rank - 2)]
    y = op.Pad(y, op.Constant(value_ints=borders))
    flipped = op.Transpose(w, perm=[1, 0] + list(range(2, rank)))
    for axis in range(2, rank):
        flipped = op.Gather(flipped, op.Constant(value_ints=list(range(kernel[axis - 2] - 1, -1, -1))), axis=axis)
    return op.Conv(y, flipped) if b is None else op.Conv(y, flipped, b)


def _max_unpool_check(node: ir.Node) -> str | None:
    x = node.inputs[0]
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        return "output_shape is not rewritten"
    return None if x.shape is not None and all(isinstance(d, int) for d in x.shape) else "the shape is not static"


@rewrite("MaxUnpool", family=F, check=_max_unpool_check)
def _max_unpool(op, node, x, indices):
    """Zeros of the output's size, x scattered at the (whole-tensor flat) indices, reshaped."""
    dims, rank = list(x.shape), len(x.shape)
    kernel = list(node.attributes.get_ints("kernel_shape"))
    strides = list(node.attributes.get_ints("strides", [1] * (rank - 2)))
    pads = list(node.attributes.get_ints("pads", [0] * 2 * (rank - 2)))
    out = dims[:2] + [(dims[2 + i] - 1) * strides[i] - pads[i] - pads[rank - 2 + i] + kernel[i] for i in range(rank - 2)]
    flat = op.Constant(value_ints=[-1])
    zeros = op.Expand(_k(op, 0.0, x), op.Constant(value_ints=[int(np.prod(out))]))
    y = op.ScatterElements(zeros, op.Reshape(indices, flat), op.Reshape(x, flat), axis=0)
    return op.Reshape(y, op.Constant(value_ints=out))


@rewrite("AffineGrid", family=F, check=_needs(1, reason="the size is not a constant"))
def _affine_grid(op, node, theta, size):
    """theta (N, k, k+1) times the constant base grid (..., x, y[, z], 1) of the output's spatial size."""
    spatial, align = _int_input(node, 1)[2:], node.attributes.get_int("align_corners", 0)
    axes = [np.linspace(-1, 1, n) if align else (np.arange(n) * 2 + 1) / n - 1 for n in spatial]
    mesh = np.meshgrid(*axes, indexing="ij")[::-1]  # NOTE: x varies along the last axis (W), then y, z
    base = np.stack([*(m.reshape(-1) for m in mesh), np.ones(mesh[0].size)], axis=1)
    # NOTE: 2-D MatMuls: the builder's batched MatMul gradient (FusedMatMul) has no float64 kernel
    k = len(spatial)
    grid = op.MatMul(op.Reshape(theta, op.Constant(value_ints=[-1, k + 1])), _table(op, base.T, theta))
    grid = op.Transpose(op.Reshape(grid, op.Constant(value_ints=[-1, k, base.shape[0]])), perm=[0, 2, 1])
    return op.Reshape(grid, op.Constant(value_ints=[-1, *spatial, k]))


def _sparse_sum(op, values, rank: int, size: int, sources: list, like, maximum: ir.Node | None = None):
    """out[..., p] = Σ w·values[..., i] over the (i, w) of sources[p], for values (..., size) of ``rank``: a Gather
    by a constant index table (short rows point at a zero padded at ``size``), times the weights, summed; with
    ``maximum`` (the node), the max of values[..., i] instead (short rows repeat their first index), 0 if none."""
    index = np.full((len(sources), max(1, max(len(s) for s in sources))), size, dtype=np.int64)
    weight = np.zeros(index.shape)
    for p, found in enumerate(sources):
        index[p, :] = found[0][0] if found and maximum is not None else size
        for t, (i, w) in enumerate(found):
            index[p, t], weight[p, t] = i, w
    # NOTE: a Pad, not a Concat: the builder's Concat gradient has no float64 kernel
    padded = op.Pad(values, op.Constant(value_ints=[0] * (2 * rank - 1) + [1]))
    picked = op.Gather(padded, op.Constant(value=ir.tensor(index)), axis=rank - 1)
    if maximum is not None:  # NOTE: ties (a repeated index too) share the gradient, summed back by the Gather
        picked.dtype = like.dtype
        return _reduce_extreme_rewrite("ReduceMax")(op, maximum, picked, op.Constant(value_ints=[rank]))
    if np.any(weight[index < size] != 1):
        picked = op.Mul(picked, _table(op, weight, like))
    return op.ReduceSum(picked, op.Constant(value_ints=[-1]), keepdims=0)


@rewrite("Col2Im", family=F, check=_needs(1, 2, reason="image_shape and block_shape are not constants"))
def _col2im(op, node, x, image, block):
    """Each output pixel sums the column entries that land on it (``_sparse_sum``)."""
    (h, w), (kh, kw) = _int_input(node, 1), _int_input(node, 2)
    dh, dw = node.attributes.get_ints("dilations", [1, 1])
    sh, sw = node.attributes.get_ints("strides", [1, 1])
    top, left, bottom, right = node.attributes.get_ints("pads", [0, 0, 0, 0])
    oh, ow = (h + top + bottom - dh * (kh - 1) - 1) // sh + 1, (w + left + right - dw * (kw - 1) - 1) // sw + 1
    sources: list[list] = [[] for _ in range(h * w)]
    for i, j, r, s in np.ndindex(kh, kw, oh, ow):
        row, col = r * sh - top + i * dh, s * sw - left + j * dw
        if 0 <= row < h and 0 <= col < w:
            sources[row * w + col].append(((i * kw + j) * oh * ow + r * ow + s, 1.0))
    cols = op.Reshape(x, op.Constant(value_ints=[0, -1, kh * kw * oh * ow]))
    summed = _sparse_sum(op, cols, 3, kh * kw * oh * ow, sources, x)
    return op.Reshape(summed, op.Constant(value_ints=[0, -1, h, w]))


def _corners(t: float, size: int) -> tuple[int, int, float]:
    """Low and high neighbours of coordinate ``t`` and the high one's weight (onnxruntime's RoiAlign clamping)."""
    low = int(t)
    return (size - 1, size - 1, 0.0) if low >= size - 1 else (low, low + 1, t - low)


def _roi_align_check(node: ir.Node) -> str | None:
    if not _consts(node, 1, 2) or not _static(node.inputs[0]) or len(node.inputs[0].shape) != 4:
        return "the boxes or batch indices are not constants, or the input shape is not static"
    return None if node.attributes.get_string("mode", "avg") == "avg" else "max mode is not rewritten"


@rewrite("RoiAlign", family=F, check=_roi_align_check)
def _roi_align(op, node, x, rois, batch):
    """Average RoiAlign of constant boxes: each output a fixed weighted sum of pixels (``_sparse_sum``), the
    samples and bilinear weights computed as onnxruntime does."""
    (n, c, h, w), scale = x.shape, _f(node, "spatial_scale", 1.0)
    oh, ow, ratio = (node.attributes.get_int(k, d) for k, d in (("output_height", 1), ("output_width", 1),
                                                                  ("sampling_ratio", 0)))
    half = node.attributes.get_string("coordinate_transformation_mode", "half_pixel") == "half_pixel"
    sources = []
    for box, b in zip(rois.const_value.numpy().astype(np.float64), batch.const_value.numpy().reshape(-1)):
        sx, sy, ex, ey = box * scale - (0.5 if half else 0.0)
        rh, rw = (ey - sy, ex - sx) if half else (max(ey - sy, 1.0), max(ex - sx, 1.0))
        gh, gw = ratio or int(np.ceil(rh / oh)), ratio or int(np.ceil(rw / ow))
        for ph, pw in np.ndindex(oh, ow):
            found = []
            for iy, ix in np.ndindex(gh, gw):
                y, xx = sy + (ph + (iy + 0.5) / gh) * rh / oh, sx + (pw + (ix + 0.5) / gw) * rw / ow
                if -1.0 <= y <= h and -1.0 <= xx <= w:
                    (y0, y1, ly), (x0, x1, lx) = _corners(max(y, 0.0), h), _corners(max(xx, 0.0), w)
                    found += [(int(b) * h * w + yy * w + xc, wy * wx / max(gh * gw, 1)) for yy, wy in ((y0, 1 - ly), (y1, ly))
                              for xc, wx in ((x0, 1 - lx), (x1, lx))]
            sources.append(found)
    flat = op.Reshape(op.Transpose(x, perm=[1, 0, 2, 3]), op.Constant(value_ints=[c, n * h * w]))
    y = op.Reshape(_sparse_sum(op, flat, 2, n * h * w, sources, x), op.Constant(value_ints=[c, -1, oh, ow]))
    return op.Transpose(y, perm=[1, 0, 2, 3])


@rewrite("MaxRoiPool", family=F,
         check=_needs(1, static=True, reason="the boxes are not constants or the input shape is not static"))
def _max_roi_pool(op, node, x, rois):
    """MaxRoiPool of constant boxes: the max over each bin's pixels (``_sparse_sum``), bins as onnxruntime's."""
    (n, c, h, w), scale = x.shape, _f(node, "spatial_scale", 1.0)
    oh, ow = node.attributes.get_ints("pooled_shape")
    sources = []
    for b, *box in rois.const_value.numpy().astype(np.float64):
        sx, sy, ex, ey = (int(np.sign(v) * np.floor(abs(v) * scale + 0.5)) for v in box)  # NOTE: C's round()
        bh, bw = max(ey - sy + 1, 1) / oh, max(ex - sx + 1, 1) / ow
        for ph, pw in np.ndindex(oh, ow):
            rows = range(min(max(int(np.floor(ph * bh)) + sy, 0), h), min(max(int(np.ceil((ph + 1) * bh)) + sy, 0), h))
            cols = range(min(max(int(np.floor(pw * bw)) + sx, 0), w), min(max(int(np.ceil((pw + 1) * bw)) + sx, 0), w))
            sources.append([(int(b) * h * w + r * w + q, 1.0) for r in rows for q in cols])
    flat = op.Reshape(op.Transpose(x, perm=[1, 0, 2, 3]), op.Constant(value_ints=[c, n * h * w]))
    y = _sparse_sum(op, flat, 2, n * h * w, sources, x, maximum=node)
    return op.Transpose(op.Reshape(y, op.Constant(value_ints=[c, -1, oh, ow])), perm=[1, 0, 2, 3])


def _grid_sample_check(node: ir.Node) -> str | None:
    x, grid = node.inputs[0], node.inputs[1]
    if x.shape is None or grid.shape is None or len(x.shape) != 4 or not all(
            isinstance(d, int) for d in [*x.shape[1:], *grid.shape[1:]]):
        return "only 4-D inputs of static shape (but the batch size) are rewritten"
    if node.attributes.get_string("mode", "linear") not in ("linear", "bilinear", "nearest"):
        return "cubic mode is not rewritten"
    return None if node.attributes.get_string("padding_mode", "zeros") in ("zeros", "border") else \
        "reflection padding is not rewritten"


@rewrite("GridSample", family=F, check=_grid_sample_check)
def _grid_sample(op, node, x, grid):
    """Bilinear (or nearest) sampling as GatherElements of the corners, weighted by their distances: exact in
    x and, through the weights, in the grid (the corners' indices have a zero derivative)."""
    (_, c, h, w), (_, ho, wo, _) = x.shape, grid.shape  # NOTE: the batch size may be dynamic
    align, border = node.attributes.get_int("align_corners", 0), node.attributes.get_string("padding_mode", "zeros") == "border"
    nearest = node.attributes.get_string("mode", "linear") == "nearest"
    flat = op.Reshape(x, op.Constant(value_ints=[0, c, h * w]))
    g = op.Reshape(grid, op.Constant(value_ints=[0, 1, ho * wo, 2]))
    batch = op.Slice(op.Shape(x), op.Constant(value_ints=[0]), op.Constant(value_ints=[1]))

    def coordinate(axis: int, size: int):
        t = op.Gather(g, op.Constant(value_int=axis), axis=3)
        one = _k(op, 1.0, x)
        t = op.Mul(op.Add(t, one), _k(op, (size - 1) / 2, x)) if align else \
            op.Div(op.Sub(op.Mul(op.Add(t, one), _k(op, float(size), x)), one), _k(op, 2.0, x))
        return op.Clip(t, _k(op, 0.0, x), _k(op, size - 1.0, x)) if border else t

    ix, iy = coordinate(0, w), coordinate(1, h)

    def corner(cx, cy):
        inside = op.And(op.And(op.GreaterOrEqual(cx, _k(op, 0.0, x)), op.LessOrEqual(cx, _k(op, w - 1.0, x))),
                        op.And(op.GreaterOrEqual(cy, _k(op, 0.0, x)), op.LessOrEqual(cy, _k(op, h - 1.0, x))))
        cx, cy = (op.Clip(v, _k(op, 0.0, x), _k(op, m - 1.0, x)) for v, m in ((cx, w), (cy, h)))
        index = op.Cast(op.Add(op.Mul(cy, _k(op, float(w), x)), cx), to=ir.DataType.INT64)
        values = op.GatherElements(flat, op.Expand(index, op.Concat(batch, op.Constant(value_ints=[c, ho * wo]), axis=0)),
                                   axis=2)
        return values, op.Cast(inside, to=x.dtype)

    if nearest:
        values, inside = corner(op.Round(ix), op.Round(iy))
        # NOTE: + 0·(ix + iy): the grid stays on the gradient path with its zero derivative (else "unreachable")
        y = op.Add(op.Mul(values, inside), op.Mul(op.Add(ix, iy), _k(op, 0.0, x)))
    else:
        x0, y0 = op.Floor(ix), op.Floor(iy)
        x1, y1 = op.Add(x0, _k(op, 1.0, x)), op.Add(y0, _k(op, 1.0, x))
        wx1, wy1 = op.Sub(ix, x0), op.Sub(iy, y0)
        wx0, wy0 = op.Sub(_k(op, 1.0, x), wx1), op.Sub(_k(op, 1.0, x), wy1)
        y = None
        for cx, cy, wx, wy in ((x0, y0, wx0, wy0), (x1, y0, wx1, wy0), (x0, y1, wx0, wy1), (x1, y1, wx1, wy1)):
            values, inside = corner(cx, cy)
            term = op.Mul(values, op.Mul(op.Mul(wx, wy), inside))
            y = term if y is None else op.Add(y, term)
    return op.Reshape(y, op.Constant(value_ints=[0, c, ho, wo]))
