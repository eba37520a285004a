"""Portable steps: the training-only ops of the builder's backward graph lowered to standard ONNX.

- every node whose (domain, op_type) is in ``LOWERINGS`` (``com.microsoft`` gradient kernels such as
  ReluGrad, SoftmaxGrad_13, ConvGrad, and the default-domain MaxPoolGrad/AveragePoolGrad that only
  onnxruntime-training knows) is replaced by ai.onnx ops computing the same outputs at the model's opset;
- any other op outside ai.onnx / ai.onnx.ml raises ``ModelError`` naming the op and the node;
- ``check_portable`` asserts a model holds standard ops only (stock onnxruntime, onnx.reference).

Each lowering is a function ``(op, *inputs, **attributes)`` written with ``op.<OpType>(...)`` calls, the way
onnxscript's rewrite rules write replacements; it returns the node's outputs (None for an unused one).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir

from onnxopt.errors import ModelError

__all__ = ["LOWERINGS", "LowerTrainingOpsPass", "lower_training_ops", "check_portable", "crops_as_slices",
           "STANDARD_DOMAINS", "BROKEN_KERNELS", "BROKEN_FLOAT64_KERNELS", "broken_kernels"]

MS = "com.microsoft"
STANDARD_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")


class _Op:
    """``op.Add(a, b)``, ``op.Split(x, s, axis=1, _outputs=2)``: nodes recorded on a tape, for one lowered node."""

    def __init__(self, node: ir.Node, inferred: dict[str, tuple] | None = None, mode: str = "portable"):
        self.tape = ir.tape.Tape()
        self.node = node
        self.inferred = inferred or {}
        self.mode = mode  # NOTE: what an error names: "portable", or the default step replacing a kernel

    def dims(self, value: ir.Value) -> tuple | None:
        """``value``'s dimensions (ints, or None where unknown): its own shape, else ONNX shape inference's."""
        if value.shape is not None:
            return tuple(d if isinstance(d, int) else None for d in value.shape)
        return self.inferred.get(value.name)

    def rank(self, value: ir.Value) -> int | None:
        dims = self.dims(value)
        return None if dims is None else len(dims)

    def __getattr__(self, op_type: str):
        def make(*inputs, _outputs: int = 1, **attributes):
            attributes = {k: v for k, v in attributes.items() if v is not None}
            if op_type == "Transpose" and "perm" in attributes and list(attributes["perm"]) == sorted(attributes["perm"]):
                # NOTE: no identity Transpose: onnxruntime's GemmTransposeFusion swaps a Gemm's output through
                # one as if it were a real transpose (GatherGrad of a scalar index after a Gemm)
                return inputs[0]
            attributes = {k: _attribute(k, v) for k, v in attributes.items()}
            if _outputs == 1:
                return self.tape.op(op_type, list(inputs), attributes)
            return self.tape.op_multi_out(op_type, list(inputs), attributes, num_outputs=_outputs)
        return make

    def const(self, value: float, like: ir.Value) -> ir.Value:
        """A scalar of ``like``'s type (CastLike of a float64 constant, folded when the step is finished)."""
        return self.CastLike(self.Constant(value=ir.Tensor(np.array(value, np.float64))), like)

    def ints(self, values) -> ir.Value:
        return self.Constant(value_ints=[int(v) for v in values])

    def shape_of(self, x: ir.Value) -> ir.Value:
        """``x``'s shape as a Reshape target: its constant when static (what constant folding makes of the Shape
        node, at a cost per node), else a Shape node."""
        if x.shape is not None and all(isinstance(d, int) for d in x.shape):
            return self.ints(list(x.shape))
        return self.Shape(x)

    def wanted(self, i: int) -> bool:
        """Whether output ``i`` of the node exists and is read."""
        outs = self.node.outputs
        return i < len(outs) and bool(outs[i].name) and (bool(list(outs[i].uses())) or outs[i].is_graph_output())

    def forward_input(self, grad: ir.Value) -> ir.Value:
        """The forward value whose gradient ``grad`` is: the builder names it ``<value>_grad`` (followed by a
        suffix when the value has several consumers whose gradients are summed)."""
        graph = self.node.graph
        name = grad.name.rsplit("_grad", 1)[0] if "_grad" in (grad.name or "") else None
        for node in graph:
            for out in node.outputs:
                if out.name == name:
                    return out
        for value in graph.inputs:
            if value.name == name:
                return value
        raise ModelError(f"portable: cannot find the input of {self.node.op_type} node {self.node.name!r} "
                         f"(expected a value {name!r} named after its output {grad.name!r})")


def _attribute(name: str, value):
    """``value`` as the ``ir.Attr`` onnx_ir's ``convert_attribute`` makes of it, built directly for the common
    kinds (a non-empty list of ints or floats, a tensor): onnx_ir reaches them after ``isinstance`` checks
    against runtime protocols, ~0.15 ms per attribute on Python 3.11, for each of the hundreds of nodes the
    rules and lowerings write. Other values are left to onnx_ir."""
    if isinstance(value, (list, tuple)) and value:
        if all(isinstance(v, int) for v in value):
            return ir.AttrInt64s(name, value)
        if all(isinstance(v, float) for v in value):
            return ir.AttrFloat32s(name, value)
    elif isinstance(value, ir.Tensor):
        return ir.AttrTensor(name, value)
    return value


def _unbroadcast(op: _Op, g: ir.Value, target: ir.Value) -> ir.Value:
    """Sums ``g`` over the axes along which ``target`` was broadcast (any ranks, shapes known at run time)."""
    g_shape, t_shape = op.Shape(g), op.Shape(target)
    missing = op.Reshape(op.Sub(op.Size(g_shape), op.Size(t_shape)), op.ints([1]))
    padded = op.Concat(op.ConstantOfShape(missing, value=ir.tensor(np.array([1], np.int64))), t_shape, axis=0)
    axes = op.Reshape(op.NonZero(op.Less(padded, g_shape)), op.ints([-1]))
    return op.Reshape(op.ReduceSum(g, axes, keepdims=1, noop_with_empty_axes=1), t_shape)


def _conv_transpose_to(op, dy, w, x, r: int, kernel=None, **attrs) -> ir.Value:
    """ConvTranspose of dy by w cut or zero-padded to x's spatial size: windows cover the end padding only in
    part when (size + pads − window) is not a multiple of the stride, so only the begin pads are cropped. With
    the sizes of x and dy and the ``kernel`` static, one ConvTranspose whose output_padding gives x's size (no
    Slice or Pad: their second-order gradients, scatters of a dynamic Slice, cost more than the step)."""
    pads = attrs.pop("pads")
    size, n = (op.dims(x) or (None,) * (r + 2))[2:], (op.dims(dy) or (None,) * (r + 2))[2:]
    if kernel is not None and None not in size and None not in n:
        s, d = attrs["strides"], attrs.get("dilations") or [1] * r
        extra = [size[i] + pads[i] + pads[r + i] - d[i] * (kernel[i] - 1) - 1 - s[i] * (n[i] - 1) for i in range(r)]
        if all(0 <= e < s[i] for i, e in enumerate(extra)):
            return op.ConvTranspose(dy, w, pads=pads, output_padding=extra if any(extra) else None, **attrs)
    dx = op.ConvTranspose(dy, w, pads=[*pads[:r], *[0] * r], **attrs)
    dx = op.Slice(dx, op.ints([0] * r), op.Shape(x, start=2), op.ints(range(2, r + 2)))
    missing = op.Sub(op.Shape(x, start=2), op.Shape(dx, start=2))
    return op.Pad(dx, op.Concat(op.ints([0] * (r + 2)), op.ints([0, 0]), missing, axis=0))


def divide_by_window_counts(op, flat, x, dy, ones, kernel_shape, strides, pads, dilations, ceil_mode: int,
                            count_include_pad: int) -> ir.Value:
    """``flat`` (AveragePool's output gradient dy as (N·C, 1, *S)) ÷ the divisor of each window, as the forward
    AveragePool of ``x`` counts it; ``ones``: the (1, 1, *kernel_shape) kernel of ones. The divisor is the kernel's
    size, or (pads not counted, ceil_mode) the inputs each window covers: a Conv of ones by ``ones`` over x,
    zero-padded by the pads and by what ceil_mode's last windows reach past them. With count_include_pad=1 and
    ceil_mode the last windows' divisor differs between onnxruntime versions (1.19 divides by the kernel's
    size, newer ones clip the window to the pads): there it is read from the forward op, the covered inputs ÷
    AveragePool(ones) (a window's mean of ones is covered / divisor)."""
    r = len(kernel_shape)
    if not ceil_mode and (count_include_pad or not any(pads)):
        return op.Div(flat, op.const(float(np.prod(kernel_shape)), dy))
    size = op.Shape(x, start=2)
    reach = [(k - 1) * d + 1 for k, d in zip(kernel_shape, dilations)]  # NOTE: a window's extent
    end = op.Add(op.Mul(op.Sub(op.Shape(dy, start=2), op.ints([1] * r)), op.ints(strides)), op.ints(reach))
    extra = op.Max(op.Sub(end, op.Add(size, op.ints([b + e for b, e in zip(pads[:r], pads[r:])]))), op.ints([0] * r))
    count = op.Expand(op.const(1.0, dy), op.Concat(op.ints([1, 1]), size, axis=0))
    covered = op.Pad(count, op.Concat(op.ints([0, 0, *pads[:r], 0, 0]), op.Add(extra, op.ints(pads[r:])), axis=0))
    covered = op.Conv(covered, ones, strides=strides, dilations=dilations)
    if not count_include_pad:
        return op.Div(flat, covered)
    window = {"kernel_shape": list(kernel_shape), "strides": strides, "pads": pads, "ceil_mode": ceil_mode,
              **({"dilations": dilations} if any(d != 1 for d in dilations) else {})}
    mean = op.AveragePool(count, count_include_pad=1, **window)
    return op.Div(op.Mul(flat, mean), covered)


def relu_grad(op, dy, y):
    """dy where y > 0, else 0; dy·Sign(y) when y is a Relu's output (what the builder passes)."""
    source = y.producer()
    if source is not None and source.op_type == "Relu" and source.domain in ("", "ai.onnx"):
        # NOTE: y >= 0 makes Sign(y) a 0/1 mask; Sign + Mul (same shapes) take 6-13% less of a W1 step than
        # Greater + Where (two scalar broadcasts), docs/portable.md. They differ only where dy or y is not finite
        return op.Mul(dy, op.Sign(y))
    return op.Where(op.Greater(y, op.const(0.0, y)), dy, op.const(0.0, dy))


def sigmoid_grad(op, dy, y):
    return op.Mul(dy, op.Mul(y, op.Sub(op.const(1.0, y), y)))


def tanh_grad(op, dy, y):
    return op.Mul(dy, op.Sub(op.const(1.0, y), op.Mul(y, y)))


def leaky_relu_grad(op, dy, y, alpha: float = 0.01):
    return op.Where(op.Greater(y, op.const(0.0, y)), dy, op.Mul(dy, op.const(alpha, dy)))


def gelu(op, x):
    """0.5·x·(1 + erf(x/√2))."""
    return op.Mul(op.Mul(op.const(0.5, x), x), op.Add(op.const(1.0, x), op.Erf(op.Mul(x, op.const(math.sqrt(0.5), x)))))


def gelu_grad(op, dy, x):
    """dy·(Φ(x) + x·φ(x)), Φ and φ the normal CDF and density."""
    cdf = op.Mul(op.const(0.5, x), op.Add(op.const(1.0, x), op.Erf(op.Mul(x, op.const(math.sqrt(0.5), x)))))
    pdf = op.Mul(op.const(1 / math.sqrt(2 * math.pi), x), op.Exp(op.Mul(op.const(-0.5, x), op.Mul(x, x))))
    return op.Mul(dy, op.Add(cdf, op.Mul(x, pdf)))


def _tanh_gelu_inner(op, x) -> ir.Value:
    """tanh(√(2/π)·(x + 0.044715·x³)), the tanh approximation of GELU (GPT-2's ``NewGELU``)."""
    cube = op.Mul(op.const(0.044715, x), op.Mul(x, op.Mul(x, x)))
    return op.Tanh(op.Mul(op.const(math.sqrt(2 / math.pi), x), op.Add(x, cube)))


def fast_gelu(op, x, bias=None):
    """0.5·x·(1 + t), t = tanh(√(2/π)·(x + 0.044715·x³)), x plus the optional bias (FastGeluFusion's)."""
    x = x if bias is None else op.Add(x, bias)
    return op.Mul(op.Mul(op.const(0.5, x), x), op.Add(op.const(1.0, x), _tanh_gelu_inner(op, x)))


def fast_gelu_grad(op, dy, x):
    """dy·0.5·(1 + t + x·(1 − t²)·√(2/π)·(1 + 3·0.044715·x²))."""
    t = _tanh_gelu_inner(op, x)
    slope = op.Mul(op.const(math.sqrt(2 / math.pi), x), op.Add(op.const(1.0, x), op.Mul(op.const(3 * 0.044715, x),
                                                                                         op.Mul(x, x))))
    dt = op.Mul(x, op.Mul(op.Sub(op.const(1.0, x), op.Mul(t, t)), slope))
    return op.Mul(dy, op.Mul(op.const(0.5, x), op.Add(op.Add(op.const(1.0, x), t), dt)))


def bias_gelu(op, a, b):
    return gelu(op, op.Add(a, b))


def bias_gelu_grad(op, dy, x, b):
    return gelu_grad(op, dy, op.Add(x, b))


def bias_fast_gelu_grad(op, dy, x, b):
    return fast_gelu_grad(op, dy, op.Add(x, b))


def quick_gelu(op, x, alpha: float = 1.702):
    """x·σ(α·x) (SiLU for α = 1), which the builder fuses from x·Sigmoid(x)."""
    return op.Mul(x, op.Sigmoid(op.Mul(x, op.const(alpha, x))))


def quick_gelu_grad(op, dy, x, alpha: float = 1.702):
    """dy·(s + α·x·s·(1 − s)), s = σ(α·x)."""
    s = op.Sigmoid(op.Mul(x, op.const(alpha, x)))
    ds = op.Mul(op.Mul(op.const(alpha, x), x), op.Mul(s, op.Sub(op.const(1.0, x), s)))
    return op.Mul(dy, op.Add(s, ds))


def softmax_grad(op, dy, y, axis: int = -1):
    """y·(dy − Σ_axis dy·y)."""
    return op.Mul(y, op.Sub(dy, op.ReduceSum(op.Mul(dy, y), op.ints([axis]), keepdims=1)))


def log_softmax_grad(op, dy, y, axis: int = -1):
    """dy − exp(y)·Σ_axis dy, y the log-probabilities."""
    return op.Sub(dy, op.Mul(op.Exp(y), op.ReduceSum(dy, op.ints([axis]), keepdims=1)))


def scale(op, x, s, scale_down: int = 0):
    s = op.CastLike(s, x)
    return op.Div(x, s) if scale_down else op.Mul(x, s)


def div_grad(op, dy, a, b):
    """d(a/b): dy/b and −dy·a/b², each summed back to its input's shape."""
    da = _unbroadcast(op, op.Div(dy, b), a) if op.wanted(0) else None
    db = _unbroadcast(op, op.Neg(op.Div(op.Mul(dy, a), op.Mul(b, b))), b) if op.wanted(1) else None
    return da, db


def gather_elements_grad(op, dy, shape, indices, axis: int = 0):
    zeros = op.Expand(op.const(0.0, dy), shape)
    return op.ScatterElements(zeros, indices, dy, axis=axis, reduction="add")


def gather_grad(op, shape, indices, dy, axis: int = 0):
    """Scatter-add of dy into zeros(shape) along ``axis`` (moved to the front, then back)."""
    if axis == 0:  # NOTE: the embedding case needs no rank
        return op.ScatterND(op.Expand(op.const(0.0, dy), shape), op.Unsqueeze(indices, op.ints([-1])), dy,
                            reduction="add")
    source = shape.producer()
    r = (op.dims(shape) or (None,))[0]
    if r is None and source is not None and source.op_type == "Shape":
        r = op.rank(source.inputs[0])
    q = op.rank(indices)
    if q is None and op.rank(dy) is not None and r is not None:
        q = op.rank(dy) - r + 1
    if r is None or q is None:
        raise ModelError(f"portable: GatherGrad node {op.node.name!r} (axis={axis}) needs the ranks of its data "
                         "and indices, got unknown ones")
    axis = axis + r if axis < 0 else axis
    zeros = op.Expand(op.const(0.0, dy), op.Gather(shape, op.ints([axis, *range(axis), *range(axis + 1, r)])))
    dy = op.Transpose(dy, perm=[*range(axis, axis + q), *range(axis), *range(axis + q, r + q - 1)])
    out = op.ScatterND(zeros, op.Unsqueeze(indices, op.ints([-1])), dy, reduction="add")
    return op.Transpose(out, perm=[*range(1, axis + 1), 0, *range(axis + 1, r)])


def slice_grad(op, dy, shape, starts, ends, axes=None, steps=None):
    """dy written into zeros(shape) where Slice read: the positions come from slicing an iota of ``shape``."""
    n = op.ReduceProd(shape, keepdims=1)
    iota = op.Reshape(op.Range(op.Constant(value_int=0), op.Squeeze(n), op.Constant(value_int=1)), shape)
    positions = op.Reshape(op.Slice(iota, starts, ends, axes, steps), op.ints([-1]))
    flat = op.ScatterElements(op.Expand(op.const(0.0, dy), n), positions, op.Reshape(dy, op.ints([-1])), axis=0)
    return op.Reshape(flat, shape)


def concat_training(op, *xs, axis: int = 0):
    """Concat, and the length of every input along ``axis`` (int64), which SplitTraining reads."""
    out = op.Concat(*xs, axis=axis)
    lengths = op.Concat(*[op.Gather(op.Shape(x), op.ints([axis])) for x in xs], axis=0) if op.wanted(1) else None
    return out, lengths


def split_training(op, x, split, axis: int = 0, num_outputs: int | None = None):
    n = len(op.node.outputs)
    outs = op.Split(x, split, axis=axis, _outputs=n)
    return outs if n > 1 else [outs]


# NOTE: the largest im2col matrix (floats per sample) the weight gradient builds; above, it is a Conv of X by dY
IM2COL_FLOATS = 1 << 21


def _conv_output_size(op, dy, x, r: int, kernel, strides, pads, dilations) -> list:
    """The spatial size of a Conv's output: dY's, else computed from X's (None where unknown)."""
    known = (op.dims(dy) or (None,) * (r + 2))[2:]
    size = (op.dims(x) or (None,) * (r + 2))[2:]
    if None not in known or kernel is None:
        return list(known)
    return [(n + pads[i] + pads[i + r] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1 if n else None
            for i, n in enumerate(size)]


def _conv_input_grad(op, dy, w, r: int, flip_pads: list, dilations: list, group: int) -> ir.Value:
    """dX of a stride-1 convolution as a Conv of dY by the flipped kernel, its in and out channels swapped per
    group, padded by each side's window reach less the forward's pad (``flip_pads``): the forward kernel
    onnxruntime optimizes (its ConvTranspose costs more), no crop or pad after."""
    g = op.Reshape(w, op.Concat(op.ints([group, -1]), op.Shape(w, start=1), axis=0))  # (g, O/g, C/g, *k)
    g = op.Transpose(g, perm=[0, 2, 1, *range(3, r + 3)])
    g = op.Reshape(g, op.Concat(op.ints([-1]), op.Shape(g, start=2), axis=0))  # (C, O/g, *k)
    flipped = op.Slice(g, op.ints([-1] * r), op.ints([-(1 << 62)] * r), op.ints(range(2, r + 2)), op.ints([-1] * r))
    return op.Conv(dy, flipped, pads=flip_pads, dilations=dilations, group=group)


def _conv_weight_grad(op, dy, x, w, r: int, kernel: list, channels: int, outputs: int, strides: list, pads: list,
                      dilations: list, group: int) -> ir.Value:
    """dW as im2col and one batched MatMul: a depthwise Conv of X by one-hot kernels lays out every window
    (N, C·K, L), times dY (N, O, L) transposed it sums over the positions, ReduceSum over the batch. One GEMM of
    C·K × L × O per sample, where a Conv of X by dY runs a GEMM of O × (N·L) × K per channel (1.7-3× slower on
    3x3 kernels). With stride 1 and fewer outputs than channels, the windows of dY instead (N, O·K, S), padded
    as dX's Conv, kernel positions flipped, times X: O·K rows, not C·K (a gradient penalty's dX Conv, O = 1)."""
    k = int(np.prod(kernel))
    flip = [d * (n - 1) - p for d, n, p in zip(dilations * 2, kernel * 2, pads)]
    by_dy = k > 1 and outputs < channels and all(s == 1 for s in strides) and min(flip) >= 0
    n, m, src, other = (outputs, channels, dy, x) if by_dy else (channels, outputs, x, dy)
    if k == 1 and all(s == 1 for s in strides) and not any(pads):
        cols = x
    else:
        eye = np.zeros((n * k, k), np.float32)  # NOTE: kernel c·K + j is 1 at window position j (K-1-j for dY)
        eye[np.arange(n * k), np.tile(np.arange(k)[::-1] if by_dy else np.arange(k), n)] = 1.0
        ones = op.CastLike(op.Constant(value=ir.Tensor(eye.reshape(n * k, 1, *kernel))), dy)
        cols = op.Conv(src, ones, strides=[1] * r if by_dy else strides, pads=flip if by_dy else pads,
                       dilations=dilations, group=n)
    cols = op.Reshape(cols, op.ints([0, group, n // group * k, -1]))  # (N, g, n·K/g, L)
    rows = op.Reshape(other, op.ints([0, group, m // group, -1]))  # (N, g, m/g, L)
    # NOTE: windows × dYᵀ (C·K/g rows) runs 1.4× faster than dY × windowsᵀ (O/g rows) in onnxruntime 1.32
    summed = op.ReduceSum(op.MatMul(cols, op.Transpose(rows, perm=[0, 1, 3, 2])), op.ints([0]), keepdims=0)
    if by_dy:  # NOTE: (g, O/g·K, C/g) -> (g, O/g, C/g, K)
        dw = op.Transpose(op.Reshape(summed, op.ints([group, n // group, k, m // group])), perm=[0, 1, 3, 2])
    else:  # NOTE: (g, C·K/g, O/g) -> (g, O/g, C·K/g)
        dw = op.Transpose(summed, perm=[0, 2, 1])
    return op.Reshape(dw, op.shape_of(w))


def conv_grad(op, dy, x, w, kernel_shape=None, strides=None, pads=None, dilations=None, group: int = 1,
              auto_pad: str = "NOTSET"):
    """dX: a Conv of dy by the flipped kernel (stride 1), else ConvTranspose(dy, W) cut or padded to X's size;
    dW: im2col and a batched MatMul (``_conv_weight_grad``), else (a window matrix over ``IM2COL_FLOATS`` per
    sample, or sizes unknown) a grouped Conv of X by dy, the batch as channels; dB = Σ dy."""
    if auto_pad not in ("NOTSET", "VALID"):
        raise ModelError(f"portable: ConvGrad node {op.node.name!r} has auto_pad={auto_pad!r}; expected NOTSET or "
                         "VALID (export the model with explicit pads)")
    # NOTE: the number of spatial axes, from whichever of the weight, kernel_shape, X and dY says it (a weight
    # computed in the graph, such as a ConvTranspose's flipped kernel, may have no shape)
    known = [op.rank(v) - 2 for v in (w, x, dy) if v is not None and op.rank(v) is not None]
    r = len(kernel_shape) if kernel_shape else (known[0] if known else None)
    if r is None:
        raise ModelError(f"portable: ConvGrad node {op.node.name!r} needs the rank of its weight, X or dY, or its "
                         "kernel_shape; got none")
    strides, dilations = list(strides or [1] * r), list(dilations or [1] * r)
    pads = list(pads or [0] * (2 * r))
    dx = dw = db = None
    kernel = list(kernel_shape or (op.dims(w) or [None, None])[2:]) or None
    if kernel is not None and None in kernel:
        kernel = None
    if op.wanted(0):
        flip_pads = None if kernel is None else [d * (k - 1) - p for d, k, p in zip(dilations * 2, kernel * 2, pads)]
        if flip_pads is not None and all(s == 1 for s in strides) and min(flip_pads) >= 0:
            dx = _conv_input_grad(op, dy, w, r, flip_pads, dilations, group)
        else:
            dx = _conv_transpose_to(op, dy, w, x, r, kernel, strides=strides, pads=pads, dilations=dilations,
                                    group=group)
    if op.wanted(1):
        channels = (op.dims(x) or (None, None))[1]
        outputs = (op.dims(dy) or (None, None))[1] or (op.dims(w) or (None,))[0]
        spatial = _conv_output_size(op, dy, x, r, kernel, strides, pads, dilations)
        dw = conv_weight_grad(op, dy, x, w, r, kernel, channels, outputs, spatial, strides, pads, dilations, group)
    if op.wanted(2):
        db = op.ReduceSum(dy, op.ints([0, *range(2, r + 2)]), keepdims=0)
    return dx, dw, db


def conv_weight_grad(op, dy, x, w, r: int, kernel, channels, outputs, spatial: list, strides: list, pads: list,
                     dilations: list, group: int) -> ir.Value:
    """dW of a Conv of ``x`` giving ``dy``: im2col and a batched MatMul (``_conv_weight_grad``) when the kernel,
    the channels, the outputs and dy's ``spatial`` size are known and the window matrix is within
    ``IM2COL_FLOATS`` per sample, else a grouped Conv of X by dy, the batch as channels."""
    col = None if kernel is None or not channels or not outputs or None in spatial else (
        channels * int(np.prod(kernel)) * int(np.prod(spatial)))
    if col is not None and col <= IM2COL_FLOATS:
        return _conv_weight_grad(op, dy, x, w, r, kernel, channels, outputs, strides, pads, dilations, group)
    # NOTE: X (N, g·C, *S) -> (C, g·N, *S) and dy (N, O, *T) -> (O, N, *T): a Conv with `group` groups sums
    # over the batch, strides and dilations trade places; windows past the kernel are cut
    xs = op.Reshape(x, op.Concat(op.Shape(x, start=0, end=1), op.ints([group, -1]), op.Shape(x, start=2), axis=0))
    xs = op.Transpose(xs, perm=[2, 1, 0, *range(3, r + 3)])
    xs = op.Reshape(xs, op.Concat(op.ints([0, -1]), op.Shape(x, start=2), axis=0))
    dyt = op.Transpose(dy, perm=[1, 0, *range(2, r + 2)])
    full = op.Conv(xs, dyt, strides=dilations, dilations=strides, pads=pads, group=group)
    return op.Slice(op.Transpose(full, perm=[1, 0, *range(2, r + 2)]), op.ints([0] * r), op.Shape(w, start=2),
                    op.ints(range(2, r + 2)))


def max_pool_grad(op, dy, indices, **_):
    """Scatter-add of dy at MaxPool's flat indices into zeros of the pooled input's shape."""
    pool = indices.producer()
    shape = op.Shape(pool.inputs[0] if pool is not None and pool.op_type == "MaxPool"
                     else op.forward_input(op.node.outputs[0]))
    flat = op.Expand(op.const(0.0, dy), op.ReduceProd(shape, keepdims=1))
    flat = op.ScatterElements(flat, op.Reshape(indices, op.ints([-1])), op.Reshape(dy, op.ints([-1])), axis=0,
                              reduction="add")
    return op.Reshape(flat, shape)


def average_pool_grad(op, dy, kernel_shape, strides=None, pads=None, count_include_pad: int = 0, ceil_mode: int = 0,
                      auto_pad: str = "NOTSET", dilations=None):
    """Each dy ÷ its window's count spread over the window: a ConvTranspose by ones on (N·C, 1, *S), the counts
    as the forward AveragePool takes them (``divide_by_window_counts``)."""
    if auto_pad not in ("NOTSET", "VALID"):
        raise ModelError(f"{op.mode}: AveragePoolGrad node {op.node.name!r} has auto_pad={auto_pad!r}; expected "
                         "NOTSET or VALID (export the model with explicit pads)")
    r = len(kernel_shape)
    strides, dilations = list(strides or [1] * r), list(dilations or [1] * r)
    pads = list(pads or [0] * (2 * r))
    x = op.forward_input(op.node.outputs[0])
    ones = op.Expand(op.const(1.0, dy), op.ints([1, 1, *kernel_shape]))
    flat = op.Reshape(dy, op.Concat(op.ints([-1, 1]), op.Shape(dy, start=2), axis=0))
    flat = divide_by_window_counts(op, flat, x, dy, ones, kernel_shape, strides, pads, dilations, ceil_mode,
                                   count_include_pad)
    dx = _conv_transpose_to(op, flat, ones, x, r, strides=strides, pads=pads, dilations=dilations)
    return op.Reshape(dx, op.Shape(x))


def fused_mat_mul(op, a, b, alpha: float = 1.0, transA: int = 0, transB: int = 0, transBatchA: int = 0,
                  transBatchB: int = 0):
    """α·A'·B' with MatMul: A' is A with its first axis moved before the last (transBatchA), then its last two
    axes swapped (transA); B' likewise. The builder emits it for MatMul gradients of batched operands."""
    a = _matmul_operand(op, a, transA, transBatchA)
    b = _matmul_operand(op, b, transB, transBatchB)
    y = op.MatMul(a, b)
    return y if alpha == 1.0 else op.Mul(y, op.const(alpha, y))


def _matmul_operand(op, x, trans: int, trans_batch: int) -> ir.Value:
    if not trans and not trans_batch:
        return x
    r = op.rank(x)
    if r is None or r < (3 if trans_batch else 2):
        raise ModelError(f"portable: FusedMatMul node {op.node.name!r} transposes {x.name!r}, whose rank is "
                         f"{r if r is not None else 'unknown'}; expected a known rank >= {3 if trans_batch else 2}")
    perm = [*range(1, r - 1), 0, r - 1] if trans_batch else list(range(r))
    if trans:
        perm[-2], perm[-1] = perm[-1], perm[-2]
    return op.Transpose(x, perm=perm)


def broadcast_gradient_args(op, a_shape, b_shape):
    """The axes of the broadcast output over which A's (B's) gradient is summed: the leading axes A lacks, and
    those where A's dimension is 1 and B's is not. Ascending where the kernel lists them descending: the
    builder only passes them to ReduceSum."""
    ra, rb = op.Size(a_shape), op.Size(b_shape)
    n = op.Max(ra, rb)
    k = op.Range(op.Constant(value_int=0), n, op.Constant(value_int=1))

    def padded(shape, r):
        ones = op.ConstantOfShape(op.Reshape(op.Sub(n, r), op.ints([1])), value=ir.tensor(np.array([1], np.int64)))
        return op.Concat(ones, shape, axis=0)

    pa, pb = padded(a_shape, ra), padded(b_shape, rb)
    one = op.Constant(value_int=1)

    def axes(p, q, r):
        summed = op.Or(op.Less(k, op.Sub(n, r)), op.And(op.Equal(p, one), op.Not(op.Equal(p, q))))
        return op.Reshape(op.NonZero(summed), op.ints([-1]))

    return (axes(pa, pb, ra) if op.wanted(0) else None), (axes(pb, pa, rb) if op.wanted(1) else None)


def dropout_grad(op, dy, mask, ratio=None, training_mode=None, **_):
    """dy·mask / (1 − ratio), the ratio 0.5 when absent and 1 − ratio taken in float32, as the kernel does (it
    does not read training_mode: outside training the forward's mask is all true)."""
    keep = op.Constant(value=ir.tensor(np.array(0.5, np.float32))) if ratio is None else op.Sub(
        op.Constant(value=ir.tensor(np.array(1.0, np.float32))), op.Cast(ratio, to=ir.DataType.FLOAT))
    return op.Div(op.Mul(op.CastLike(mask, dy), dy), op.CastLike(keep, dy))


def _normalized_axes(op, scale, axis: int) -> ir.Value:
    """The trailing axes a (Simplified)LayerNormalization normalizes: from ``axis`` < 0, else the scale's rank."""
    k = -axis if axis < 0 else op.rank(scale)
    if k is None:
        raise ModelError(f"{op.mode}: {op.node.op_type} node {op.node.name!r} needs the rank of its scale")
    return op.ints(range(-k, 0))


def layer_norm_grad(op, dy, x, scale, mean, inv_std, axis: int = -1, **_):
    """x̂ = (x − mean)·inv_std; dx = inv_std·(ĝ − mean(ĝ) − x̂·mean(ĝ·x̂)) with ĝ = dy·scale, means over the
    normalized axes; dscale = Σ dy·x̂ and dbias = Σ dy over the others."""
    axes = _normalized_axes(op, scale, axis)
    xhat = op.Mul(op.Sub(x, mean), inv_std)
    g = op.Mul(dy, scale)
    inner = op.Sub(op.Sub(g, op.ReduceMean(g, axes, keepdims=1)),
                   op.Mul(xhat, op.ReduceMean(op.Mul(g, xhat), axes, keepdims=1)))
    rows = op.Concat(op.ints([-1]), op.Shape(scale), axis=0)
    dx = op.Mul(inv_std, inner) if op.wanted(0) else None
    dscale = op.ReduceSum(op.Reshape(op.Mul(dy, xhat), rows), op.ints([0]), keepdims=0) if op.wanted(1) else None
    dbias = op.ReduceSum(op.Reshape(dy, rows), op.ints([0]), keepdims=0) if op.wanted(2) else None
    return dx, dscale, dbias


def simplified_layer_norm(op, x, scale, axis: int = -1, epsilon: float = 1e-5, **_):
    """RMS normalization (SimplifiedLayerNormFusion's): y = x·inv·scale, inv = 1/√(mean(x²) + ε) (output 2)."""
    inv = op.Reciprocal(op.Sqrt(op.Add(op.ReduceMean(op.Mul(x, x), _normalized_axes(op, scale, axis), keepdims=1),
                                       op.const(epsilon, x))))
    return op.Mul(op.Mul(x, inv), scale), (inv if op.wanted(1) else None)


def simplified_layer_norm_grad(op, dy, x, scale, inv_std, axis: int = -1, **_):
    """x̂ = x·inv; dx = inv·(ĝ − x̂·mean(ĝ·x̂)), ĝ = dy·scale; dscale = Σ dy·x̂ over the other axes."""
    xhat, g = op.Mul(x, inv_std), op.Mul(dy, scale)
    dx = op.Mul(inv_std, op.Sub(g, op.Mul(xhat, op.ReduceMean(op.Mul(g, xhat), _normalized_axes(op, scale, axis),
                                                                keepdims=1)))) if op.wanted(0) else None
    rows = op.Concat(op.ints([-1]), op.Shape(scale), axis=0)
    dscale = op.ReduceSum(op.Reshape(op.Mul(dy, xhat), rows), op.ints([0]), keepdims=0) if op.wanted(1) else None
    return dx, dscale


def _sce_weights(op, label, weight, ignore_index):
    """Each sample's weight (``weight[label]``, None without weights), the labels to one-hot (0 where ignored)
    and the mask of the samples kept (None without ``ignore_index``)."""
    keep = None
    if ignore_index is not None:
        keep = op.Not(op.Equal(label, op.CastLike(op.Constant(value_int=int(ignore_index)), label)))
        label = op.Where(keep, label, op.CastLike(op.Constant(value_int=0), label))
    return (op.Gather(weight, label, axis=0) if weight is not None else None), label, keep


def _const_int(value) -> int | None:
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None:
        raise ModelError(f"portable: ignore_index {value.name!r} of SoftmaxCrossEntropyLossInternal must be a constant")
    return int(tensor.numpy().reshape(-1)[0])


def softmax_cross_entropy_loss_grad(op, dy, log_prob, label, weight=None, ignore_index_input=None, reduction="mean",
                                    ignore_index=None, **_):
    """d scores of SoftmaxCrossEntropyLoss: (softmax - onehot(label)) * w, times dY (per sample for 'none', a
    scalar for 'sum', divided by the sum of the weights for 'mean')."""
    ignore_index = _const_int(ignore_index_input) if ignore_index_input is not None else ignore_index
    w, label, keep = _sce_weights(op, label, weight, ignore_index)
    if w is None:
        w = op.CastLike(op.Expand(op.Constant(value_float=1.0), op.Shape(label)), log_prob)
    if keep is not None:
        w = op.Mul(w, op.CastLike(keep, w))
    # NOTE: one-hot as label == class index, broadcast: onnxruntime has no float64 OneHot
    depth = op.Slice(op.Shape(log_prob), op.ints([1]), op.ints([2]))
    scalar = op.Constant(value=ir.tensor(np.array(0, np.int64))), op.Constant(value=ir.tensor(np.array(1, np.int64)))
    ones = op.ConstantOfShape(op.Sub(op.Shape(op.Shape(label)), op.ints([1])), value=ir.tensor(np.array([1], np.int64)))
    classes = op.Reshape(op.Range(scalar[0], op.Squeeze(depth, op.ints([0])), scalar[1]),
                         op.Concat(op.ints([1]), depth, ones, axis=0))
    label64 = op.Cast(label, to=ir.DataType.INT64)
    onehot = op.CastLike(op.Equal(op.Unsqueeze(label64, op.ints([1])), classes), log_prob)
    per = op.Unsqueeze(w, op.ints([1]))
    if reduction == "none":
        scale = op.Unsqueeze(op.Mul(dy, w), op.ints([1]))
    elif reduction == "sum":
        scale = op.Mul(per, dy)
    else:
        scale = op.Mul(per, op.Div(dy, op.ReduceSum(w, keepdims=0)))
    return op.Mul(op.Sub(op.Exp(log_prob), onehot), scale)


def softmax_cross_entropy_loss_internal(op, scores, label, weight=None, ignore_index=None, reduction="mean",
                                        output_type=None, **_):
    """onnxruntime's SoftmaxCrossEntropyLossInternal (ignore_index as an input) as the standard op."""
    index = _const_int(ignore_index)
    attrs = {"reduction": reduction} | ({"ignore_index": index} if index is not None else {})
    outs = op.SoftmaxCrossEntropyLoss(scores, label, *([weight] if weight is not None else []), _outputs=2, **attrs)
    return outs


def softmax_cross_entropy_loss_internal_grad(op, dy, log_prob, label, weight=None, ignore_index=None,
                                             bias=None, reduction="mean", output_type=None, **_):
    if bias is not None:
        raise ModelError("portable: SoftmaxCrossEntropyLossInternalGrad with a bias input has no lowering yet")
    return softmax_cross_entropy_loss_grad(op, dy, log_prob, label, weight, ignore_index, reduction)


# NOTE: found by compiling steps for the models onnxopt supports (MLPs with every activation, losses, updates,
# penalties, float32/64, torch.onnx exports of CNNs, LayerNorm, Gather/Slice/Concat models): see docs/portable.md
LOWERINGS = {
    (MS, "ReluGrad"): relu_grad,
    (MS, "SigmoidGrad"): sigmoid_grad,
    (MS, "TanhGrad"): tanh_grad,
    (MS, "LeakyReluGrad"): leaky_relu_grad,
    (MS, "Gelu"): gelu,
    (MS, "GeluGrad"): gelu_grad,
    (MS, "FastGelu"): fast_gelu,
    (MS, "FastGeluGrad"): fast_gelu_grad,
    (MS, "BiasGelu"): bias_gelu,
    (MS, "BiasGeluGrad_dX"): bias_gelu_grad,
    (MS, "BiasFastGeluGrad_dX"): bias_fast_gelu_grad,
    ("", "SimplifiedLayerNormalization"): simplified_layer_norm,
    (MS, "SimplifiedLayerNormalizationGrad"): simplified_layer_norm_grad,
    (MS, "QuickGelu"): quick_gelu,
    (MS, "QuickGeluGrad"): quick_gelu_grad,
    (MS, "SoftmaxGrad_13"): softmax_grad,
    (MS, "LogSoftmaxGrad_13"): log_softmax_grad,
    (MS, "Scale"): scale,
    (MS, "DivGrad"): div_grad,
    (MS, "GatherGrad"): gather_grad,
    (MS, "GatherElementsGrad"): gather_elements_grad,
    (MS, "SliceGrad"): slice_grad,
    (MS, "ConcatTraining"): concat_training,
    (MS, "SplitTraining"): split_training,
    (MS, "ConvGrad"): conv_grad,
    (MS, "LayerNormalizationGrad"): layer_norm_grad,
    (MS, "FusedMatMul"): fused_mat_mul,
    (MS, "BroadcastGradientArgs"): broadcast_gradient_args,
    (MS, "DropoutGrad"): dropout_grad,
    ("", "MaxPoolGrad"): max_pool_grad,
    ("", "AveragePoolGrad"): average_pool_grad,
    (MS, "SoftmaxCrossEntropyLossGrad"): softmax_cross_entropy_loss_grad,
    (MS, "SoftmaxCrossEntropyLossInternal"): softmax_cross_entropy_loss_internal,
    (MS, "SoftmaxCrossEntropyLossInternalGrad"): softmax_cross_entropy_loss_internal_grad,
}


def _is_standard(node: ir.Node) -> bool:
    domain = "" if node.domain == "ai.onnx" else node.domain
    return domain in STANDARD_DOMAINS and onnx.defs.has(node.op_type, domain)


def _inferred_dims(model: ir.Model) -> dict[str, tuple]:
    """Every value's dimensions by ONNX shape inference on a copy (training-only ops are skipped, so values
    after them stay unknown); the lowerings read them where the builder left a value without a shape."""
    try:
        proto = onnx.shape_inference.infer_shapes(ir.to_proto(model), strict_mode=False)
    except Exception:  # NOTE: e.g. a model over protobuf's 2 GB: the lowerings then say which rank they lack
        return {}
    return {v.name: tuple(d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim)
            for v in [*proto.graph.value_info, *proto.graph.output, *proto.graph.input]
            if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")}


def _lower(node: ir.Node, inferred: dict[str, tuple], mode: str = "portable") -> None:
    fn = LOWERINGS.get((node.domain, node.op_type))
    if fn is None:
        rnn = ("; a portable step unrolls GRU and LSTM (passes.decompose) with a static sequence length up to 64, "
               "layout 0, activations among Sigmoid, Tanh and Relu, no clip, input_forget or sequence_lens") \
            if node.op_type in ("GRUTraining", "LSTMTraining", "GRUGrad", "LSTMGrad") else ""
        raise ModelError(f"portable: op {node.domain or 'ai.onnx'}::{node.op_type} (node {node.name!r}) has no "
                         f"lowering to standard ONNX yet (lowered ops: {sorted(op for _, op in LOWERINGS)}){rnn}; "
                         "compile with portable=False and train with onnxruntime-training")
    op = _Op(node, inferred, mode)
    attrs = {name: attr.value for name, attr in node.attributes.items()}
    outs = fn(op, *node.inputs, **attrs)
    outs = [outs] if isinstance(outs, ir.Value) else list(outs)
    graph = node.graph
    graph.insert_before(node, op.tape.nodes)
    for new in op.tape.nodes:
        new.metadata_props.update(node.metadata_props)
    for old, new in zip(node.outputs, outs):
        if new is None or not old.name:
            continue
        if old.is_graph_output() or list(old.uses()):
            if new.type is None:
                new.type, new.shape = old.type, old.shape
            ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
            name, old.name = old.name, None
            new.name = name
    graph.remove(node, safe=True)


class LowerTrainingOpsPass(ir.passes.InPlacePass):
    """Replaces every training-only node of the main graph by standard ops (``LOWERINGS``)."""

    def __init__(self, ops: set[tuple[str, str]] | None = None):
        super().__init__()
        self.ops = ops  # NOTE: None = every training-only op; a set = only those (domain, op_type)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        # NOTE: calls of model functions (the DSL's, inlined later) are not ops; check_portable sees their bodies
        todo = [n for n in model.graph if not _is_standard(n) and n.op_identifier() not in model.functions
                and (self.ops is None or (n.domain, n.op_type) in self.ops)]
        inferred = _inferred_dims(model) if todo else {}
        # NOTE: a set of ops is the default step replacing broken kernels (BROKEN_KERNELS), not a portable one
        mode = "portable" if self.ops is None else "compile_train_step (replacing a training-build kernel)"
        for node in todo:
            _lower(node, inferred, mode)
        if todo and not any(n.domain == MS for n in model.graph):
            model.opset_imports.pop(MS, None)
        return ir.passes.PassResult(model, modified=bool(todo))


# Training-build kernels that are wrong to run even when the step need not be portable: AveragePoolGrad
# kills the process (SIGFPE) with a dynamic batch length in onnxruntime-training 1.19.2; LeakyReluGrad has no
# float64 kernel.
BROKEN_KERNELS = {("", "AveragePoolGrad")}
BROKEN_FLOAT64_KERNELS = {(MS, "LeakyReluGrad")}


def broken_kernels(dtype: ir.DataType | None) -> set[tuple[str, str]]:
    """The training-build kernels to lower in a graph whose weights are ``dtype``."""
    return BROKEN_KERNELS | (BROKEN_FLOAT64_KERNELS if dtype == ir.DataType.DOUBLE else set())


def lower_training_ops(model: ir.Model, ops: set[tuple[str, str]] | None = None) -> ir.Model:
    """Lowers the training-only ops of ``model`` in place (only ``ops`` when given, see the module docstring)
    and returns it."""
    return LowerTrainingOpsPass(ops)(model).model


def crops_as_slices(model: ir.Model) -> int:
    """Rewrites each ``Pad`` (mode constant) whose constant pads crop, such as the gradient of a ``Pad`` that
    the builder writes as a Pad by the negated pads, into a ``Slice`` (then a ``Pad`` by what is left to add):
    the same values; ``onnx.reference`` pads with ``numpy.pad``, which refuses negative widths. Returns how many."""
    done = 0
    for node in list(model.graph):
        if node.op_type != "Pad" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2 or node.inputs[1] is None:
            continue
        pads = ir.convenience.get_const_tensor(node.inputs[1])
        axes = node.inputs[3] if len(node.inputs) > 3 else None
        mode = node.attributes.get("mode")
        if pads is None or axes is not None or (mode is not None and mode.value != "constant"):
            continue
        pads = pads.numpy().astype(np.int64)
        if (pads >= 0).all():
            continue
        r = len(pads) // 2
        tape = ir.tape.Tape()

        def const(values):
            return tape.op("Constant", [], {"value": ir.tensor(np.asarray(list(values), np.int64))})

        ends = [e if e < 0 else np.iinfo(np.int64).max for e in np.minimum(pads[r:], 0)]
        out = tape.op("Slice", [node.inputs[0], const(-np.minimum(pads[:r], 0)), const(ends), const(range(r))])
        if (pads > 0).any():
            out = tape.op("Pad", [out, const(np.maximum(pads, 0)), *node.inputs[2:3]])
        model.graph.insert_before(node, tape.nodes)
        for new in tape.nodes:
            new.metadata_props.update(node.metadata_props)
        old = node.outputs[0]
        out.type, out.shape = old.type, old.shape
        ir.convenience.replace_all_uses_with(old, out, replace_graph_outputs=True)
        name, old.name = old.name, None
        out.name = name
        model.graph.remove(node, safe=True)
        done += 1
    return done


def check_portable(model: onnx.ModelProto | ir.Model) -> None:
    """Raises ModelError if ``model`` holds an op outside the standard domains (or one onnx does not define)."""
    m = ir.serde.deserialize_model(model) if isinstance(model, onnx.ModelProto) else model
    odd = [(n.domain, n.op_type, n.name) for n in ir.traversal.RecursiveGraphIterator(m.graph) if not _is_standard(n)]
    if odd:
        raise ModelError(f"portable: the step holds ops outside {list(STANDARD_DOMAINS)} (domain, op, node): "
                         f"{odd[:10]}; expected standard ONNX only")
