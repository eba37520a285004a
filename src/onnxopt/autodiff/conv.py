"""Convolutions and pooling, written with the forward kernels stock onnxruntime optimizes (Conv, ConvTranspose)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxopt.autodiff.engine import rule
from onnxopt.errors import ModelError
from onnxopt.passes.lower import _conv_transpose_to, conv_grad

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
    """dX = ConvTranspose(dY, W) cut to X's size; dW = a grouped Conv of X by dY (batch as channels); dB = Σ dY."""
    _explicit_pads(c, "Conv")
    dx, dw, db = conv_grad(c, c.go(0), c.I(0), c.I(1), **c.attrs(*_CONV))
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
    kernel size, or (pads not counted, ceil_mode) SumPool(1) / AveragePool(1), as the forward counts."""
    x, dy = c.I(0), c.go(0)
    r = c.rank(x) - 2
    kernel, strides, dilations, pads = _windows(c, r)
    ceil, include = c.attr("ceil_mode", 0), c.attr("count_include_pad", 0)
    flat = c.Reshape(dy, c.Concat(c.ints([-1, 1]), c.Shape(dy, start=2), axis=0))
    ones_kernel = c.Expand(c.const(1.0, dy), c.ints([1, 1, *kernel]))
    if not ceil and (include or not any(pads)):
        flat = c.Div(flat, c.const(float(np.prod(kernel)), dy))
    else:
        ones = c.Expand(c.const(1.0, dy), c.Concat(c.ints([1, 1]), c.Shape(x, start=2), axis=0))
        window = {"kernel_shape": kernel, "strides": strides, "pads": pads, "ceil_mode": ceil,
                  **({"dilations": dilations} if any(d != 1 for d in dilations) else {})}
        mean = c.AveragePool(ones, count_include_pad=include, **window)
        end = [p + s if ceil else p for p, s in zip(pads[r:], strides)]  # NOTE: room for ceil_mode's last window
        counts = c.Conv(ones, ones_kernel, strides=strides,
                        pads=[*pads[:r], *end], dilations=dilations)
        counts = c.Slice(counts, c.ints([0] * r), c.Shape(mean, start=2), c.ints(range(2, r + 2)))
        flat = c.Div(c.Mul(flat, mean), counts)
    dx = _conv_transpose_to(c, flat, ones_kernel, x, r, strides=strides, pads=pads, dilations=dilations)
    return [c.Reshape(dx, c.Shape(x))]


@rule("GlobalAveragePool", family=F)
def _global_average_pool(c):
    """dX = dY / (spatial size), broadcast over the spatial axes."""
    x, dy = c.I(0), c.go(0)
    n = c.CastLike(c.ReduceProd(c.Shape(x, start=2), keepdims=0), dy)
    return [c.Expand(c.Div(dy, n), c.Shape(x))]
