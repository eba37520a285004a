"""Ops onnxruntime-training's gradient builder lacks or gets wrong, made differentiable before it runs.

- ``GRADIENTS``: gradient definitions (standard ONNX nodes over ``I(i)``, ``O(i)``, ``GO(i)``) registered with
  the builder for attribute-free ops it lacks: the forward kernel stays, only the backward is supplied
  (Asin, Sinh, Softplus, Mish, Mod, Det, ...; Floor, Ceil, Round, Sign, Hardmax, random draws get a zero
  gradient).
- ``RULES``: one rewrite per op type into standard ops with exact builder gradients, for ops whose
  gradient depends on attributes (Elu, Selu, HardSigmoid, ``Gelu(approximate="tanh")``, ...), variadic
  and reduction ops (Sum, Mean, ReduceMax, ReduceL1, ...), normalizations (InstanceNormalization, ...),
  layout ops (DepthToSpace, CumSum, Einsum, ReverseSequence...) and,
  given constants and static shapes, AffineGrid, CenterCropPad, Col2Im, GridSample, DFT, STFT, RoiAlign,
  MaxRoiPool (constant index tables, MatMuls), DynamicQuantizeLinear's scale and Unique's values.
- Completed nodes: LayerNormalization gets its optional Mean/InvStdDev outputs (the builder's gradient
  reads them), SoftmaxCrossEntropyLoss its log-probabilities; float64 LayerNormalization is rewritten (its
  gradient kernel is float only).
- RNN/GRU/LSTM: ``autodiff.recurrent.lower_recurrent`` (directions split, initial states, unrollings for the
  builder; onnxopt's rules keep the nodes).
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRule, RewriteRuleSet

__all__ = ["GRADIENTS", "RULES", "decompose", "register_gradients"]

_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


# ---- gradient definitions: (op_type, inputs, outputs[, {attribute: value}]) per node, GI(0) = dL/dI(0)

def _c(name: str, value: float) -> list[tuple]:
    """A constant ``name`` equal to ``value`` in the type of ``I(0)``."""
    return [("Constant", [], [name + "_f"], {"value": np.float32(value)}), ("CastLike", [name + "_f", "I(0)"], [name])]


def _divide_by(expr: list[tuple]) -> list[tuple]:
    """GI(0) = GO(0) / d, with d computed by ``expr`` (whose last node writes ``d``)."""
    return [*expr, ("Div", ["GO(0)", "d"], ["GI(0)"])]


def _unbroadcast(grad: str, i: int) -> list[tuple]:
    """GI(i) = ``grad`` summed over the axes along which I(i) was broadcast, reshaped to I(i)'s shape."""
    p = f"u{i}_"
    return [("Shape", [f"I({i})"], [p + "sa"]), ("Shape", [grad], [p + "sg"]), ("Size", [p + "sa"], [p + "ra"]),
            ("Size", [p + "sg"], [p + "rg"]), ("Sub", [p + "rg", p + "ra"], [p + "d"]),
            ("Constant", [], [p + "one"], {"value": np.array([1])}), ("Reshape", [p + "d", p + "one"], [p + "d1"]),
            ("Expand", [p + "one", p + "d1"], [p + "ones"]), ("Concat", [p + "ones", p + "sa"], [p + "full"], {"axis": 0}),
            ("Equal", [p + "full", p + "sg"], [p + "same"]), ("Not", [p + "same"], [p + "bc"]),
            ("NonZero", [p + "bc"], [p + "nz"]), ("Constant", [], [p + "flat"], {"value": np.array([-1])}),
            ("Reshape", [p + "nz", p + "flat"], [p + "axes"]),
            ("ReduceSum", [grad, p + "axes"], [p + "sum"], {"keepdims": 1, "noop_with_empty_axes": 1}),
            ("Reshape", [p + "sum", p + "sa"], [f"GI({i})"])]


_X2 = [("Mul", ["I(0)", "I(0)"], ["x2"])]
_ZERO = [*_c("zero", 0.0), ("Shape", ["I(0)"], ["shape"]), ("Expand", ["zero", "shape"], ["GI(0)"])]

GRADIENTS: dict[str, list[tuple]] = {
    "Asin": _divide_by([*_c("one", 1.0), *_X2, ("Sub", ["one", "x2"], ["t"]), ("Sqrt", ["t"], ["d"])]),
    "Acos": [*_c("one", 1.0), *_X2, ("Sub", ["one", "x2"], ["t"]), ("Sqrt", ["t"], ["s"]), ("Neg", ["s"], ["d"]),
             ("Div", ["GO(0)", "d"], ["GI(0)"])],
    "Atan": _divide_by([*_c("one", 1.0), *_X2, ("Add", ["one", "x2"], ["d"])]),
    "Asinh": _divide_by([*_c("one", 1.0), *_X2, ("Add", ["x2", "one"], ["t"]), ("Sqrt", ["t"], ["d"])]),
    # NOTE: sqrt(x-1)·sqrt(x+1), not sqrt(x²-1): no cancellation near x = 1
    "Acosh": _divide_by([*_c("one", 1.0), ("Sub", ["I(0)", "one"], ["a"]), ("Add", ["I(0)", "one"], ["b"]),
                         ("Sqrt", ["a"], ["sa"]), ("Sqrt", ["b"], ["sb"]), ("Mul", ["sa", "sb"], ["d"])]),
    "Atanh": _divide_by([*_c("one", 1.0), *_X2, ("Sub", ["one", "x2"], ["d"])]),
    "Sinh": [("Cosh", ["I(0)"], ["c"]), ("Mul", ["GO(0)", "c"], ["GI(0)"])],
    "Cosh": [("Sinh", ["I(0)"], ["s"]), ("Mul", ["GO(0)", "s"], ["GI(0)"])],
    "Tan": [*_c("one", 1.0), ("Mul", ["O(0)", "O(0)"], ["y2"]), ("Add", ["one", "y2"], ["d"]),
            ("Mul", ["GO(0)", "d"], ["GI(0)"])],
    "Softplus": [("Sigmoid", ["I(0)"], ["s"]), ("Mul", ["GO(0)", "s"], ["GI(0)"])],
    "Softsign": _divide_by([*_c("one", 1.0), ("Abs", ["I(0)"], ["a"]), ("Add", ["one", "a"], ["t"]),
                            ("Mul", ["t", "t"], ["d"])]),
    # Mish: y = x·tanh(sp), sp = softplus(x); dy/dx = tanh(sp) + x·(1 − tanh²(sp))·sigmoid(x)
    "Mish": [*_c("one", 1.0), ("Softplus", ["I(0)"], ["sp"]), ("Tanh", ["sp"], ["t"]), ("Mul", ["t", "t"], ["t2"]),
             ("Sub", ["one", "t2"], ["u"]), ("Sigmoid", ["I(0)"], ["s"]), ("Mul", ["u", "s"], ["us"]),
             ("Mul", ["I(0)", "us"], ["xus"]), ("Add", ["t", "xus"], ["d"]), ("Mul", ["GO(0)", "d"], ["GI(0)"])],
    # HardSwish: y = x·clip(x/6 + 1/2, 0, 1); dy/dx = 0 below -3, 1 above 3, x/3 + 1/2 between (as torch)
    "HardSwish": [*_c("three", 3.0), *_c("mthree", -3.0), *_c("half", 0.5), *_c("zero", 0.0), *_c("one", 1.0),
                  ("Div", ["I(0)", "three"], ["x3"]), ("Add", ["x3", "half"], ["mid"]),
                  ("Greater", ["I(0)", "three"], ["hi"]), ("Less", ["I(0)", "mthree"], ["lo"]),
                  ("Where", ["hi", "one", "mid"], ["d1"]), ("Where", ["lo", "zero", "d1"], ["d"]),
                  ("Mul", ["GO(0)", "d"], ["GI(0)"])],
    **{op: _ZERO for op in ("Floor", "Ceil", "Round", "Sign", "Hardmax", "EyeLike")},
    # NOTE: random draws do not move with their float input (*Like: only its shape; Bernoulli: a.e.)
    **{op: _ZERO for op in ("Bernoulli", "RandomNormalLike", "RandomUniformLike")},
    # MelWeightMatrix: its triangles are built from integer bins (floors) of the edge frequencies; NOTE: the
    # builder asks for no GI (the schema marks every input non-differentiable): an empty definition
    "MelWeightMatrix": [],
    # Mod (fmod=1, the only form for floats): a - b·trunc(a/b); d/da = 1, d/db = -trunc(a/b)
    "Mod": [("Div", ["I(0)", "I(1)"], ["q"]), ("Abs", ["q"], ["aq"]), ("Floor", ["aq"], ["fq"]),
            ("Sign", ["q"], ["sq"]), ("Mul", ["sq", "fq"], ["t"]), ("Mul", ["GO(0)", "t"], ["gt"]),
            ("Neg", ["gt"], ["gb"]), *_unbroadcast("GO(0)", 0), *_unbroadcast("gb", 1)],
    # Det: d det(A)/dA = det(A)·A⁻ᵀ (NaN at a singular A, where the adjugate would be right)
    "Det": [("com.microsoft:Inverse", ["I(0)"], ["inv"]), ("Mul", ["GO(0)", "O(0)"], ["g"]),
            ("Einsum", ["g", "inv"], ["GI(0)"], {"equation": "...,...ij->...ji"})],
}


def _attribute(name: str, value) -> tuple[str, str, str, bool]:
    if isinstance(value, np.floating):
        return name, json.dumps(float(value)), "float", True
    if isinstance(value, str):
        return name, json.dumps(value), "string", False
    if isinstance(value, np.ndarray):  # NOTE: a 1-D int64 tensor ('value' of a Constant)
        return name, json.dumps(value.tolist()), "int", True
    return name, json.dumps(value), "int" if isinstance(value, int) else "float", False


_registered = False


def register_gradients(C) -> None:
    """Registers ``GRADIENTS`` with onnxruntime-training (``C`` = its ``_pybind_state``), once per process."""
    global _registered
    if _registered:
        return
    for op_type, nodes in GRADIENTS.items():
        defs = []
        for op, inputs, outputs, *attrs in nodes:
            d = C.GradientNodeDefinition()
            domain, _, op = op.rpartition(":")  # NOTE: "com.microsoft:Inverse" names a contrib op
            d.op_type, d.domain, d.inputs, d.outputs = op, domain, list(inputs), list(outputs)
            attributes = []
            for name, value in (attrs[0] if attrs else {}).items():
                a = C.GradientNodeAttributeDefinition()
                a.name, a.value_json, a.dtype, a.is_tensor = _attribute(name, value)
                attributes.append(a)
            d.attributes = attributes
            defs.append(d)
        C.register_gradient_definition(f"::{op_type}", defs)
    _registered = True


# ---- rewrites: build(op, node, *inputs) -> output value(s) of standard ops

def _k(op, value: float, like: ir.Value):
    return op.Constant(value=ir.tensor(np.array(value, dtype=like.dtype.numpy())))


def _f(node: ir.Node, name: str, default: float) -> float:
    return node.attributes.get_float(name, default)


def _negative_branch(op, x, negative):
    """``Where(x > 0, x, negative(x'))`` with x' = min(x, 0): the untaken branch never overflows."""
    positive = op.Greater(x, _k(op, 0.0, x))
    return op.Where(positive, x, negative(op.Where(positive, _k(op, 0.0, x), x)))


def _elu(op, node, x):
    alpha = _f(node, "alpha", 1.0)
    return _negative_branch(op, x, lambda n: op.Mul(_k(op, alpha, x), op.Sub(op.Exp(n), _k(op, 1.0, x))))


def _selu(op, node, x):
    alpha, gamma = _f(node, "alpha", 1.67326319217681884765625), _f(node, "gamma", 1.05070102214813232421875)
    y = _negative_branch(op, x, lambda n: op.Mul(_k(op, alpha, x), op.Sub(op.Exp(n), _k(op, 1.0, x))))
    return op.Mul(_k(op, gamma, x), y)


def _celu(op, node, x):
    alpha = _f(node, "alpha", 1.0)
    return _negative_branch(op, x, lambda n: op.Mul(_k(op, alpha, x),
                                                    op.Sub(op.Exp(op.Div(n, _k(op, alpha, x))), _k(op, 1.0, x))))


def _hard_sigmoid(op, node, x):
    t = op.Add(op.Mul(_k(op, _f(node, "alpha", 0.2), x), x), _k(op, _f(node, "beta", 0.5), x))
    zero, one = _k(op, 0.0, x), _k(op, 1.0, x)
    return op.Where(op.Less(t, zero), zero, op.Where(op.Greater(t, one), one, t))


def _thresholded_relu(op, node, x):
    return op.Where(op.Greater(x, _k(op, _f(node, "alpha", 1.0), x)), x, _k(op, 0.0, x))


def _shrink(op, node, x):
    bias, lambd = _f(node, "bias", 0.0), _f(node, "lambd", 0.5)
    inner = op.Where(op.Greater(x, _k(op, lambd, x)), op.Sub(x, _k(op, bias, x)), _k(op, 0.0, x))
    return op.Where(op.Less(x, _k(op, -lambd, x)), op.Add(x, _k(op, bias, x)), inner)


def _gelu_tanh(op, node, x):
    """0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))."""
    inner = op.Mul(_k(op, np.sqrt(2.0 / np.pi), x), op.Add(x, op.Mul(_k(op, 0.044715, x), op.Mul(x, op.Mul(x, x)))))
    return op.Mul(op.Mul(_k(op, 0.5, x), x), op.Add(_k(op, 1.0, x), op.Tanh(inner)))


def _prelu(op, node, x, slope):
    return op.Where(op.Less(x, _k(op, 0.0, x)), op.Mul(slope, x), x)


def _sum(op, node, *xs):
    total = xs[0]
    for x in xs[1:]:
        total = op.Add(total, x)
    return total if len(xs) > 1 else op.Identity(total)


def _mean(op, node, *xs):
    return op.Div(_sum(op, node, *xs), _k(op, float(len(xs)), xs[0]))


def _reduce_attrs(node: ir.Node, keepdims: int | None = None) -> dict:
    return {"keepdims": node.attributes.get_int("keepdims", 1) if keepdims is None else keepdims,
            "noop_with_empty_axes": node.attributes.get_int("noop_with_empty_axes", 0)}


def _reduce_sum(op, node, x, axes=None, keepdims=None):
    args = [x] if axes is None else [x, axes]
    return op.ReduceSum(*args, **_reduce_attrs(node, keepdims))


def _reduce_extreme(reduce: str):
    """ReduceMax/ReduceMin as Σ(x where x is extreme) / count: the gradient goes evenly to ties (as torch's amax)."""
    def build(op, node, x, axes=None):
        args = [x] if axes is None else [x, axes]
        extreme = getattr(op, reduce)(*args, **_reduce_attrs(node, 1))
        mask = op.Equal(x, extreme)
        count = _reduce_sum(op, node, op.Cast(mask, to=x.dtype), axes)
        return op.Div(_reduce_sum(op, node, op.Where(mask, x, _k(op, 0.0, x)), axes), count)
    return build


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


def _range(op, node, start, limit, delta):
    """start + i·delta for i < max(ceil((limit - start) / delta), 0), as the spec defines it: the builder
    differentiates it in start and delta (limit only moves the length: zero gradient)."""
    n = op.Cast(op.Max(op.Ceil(op.Div(op.Sub(limit, start), delta)), _k(op, 0.0, start)), to=ir.DataType.INT64)
    i = op.Range(op.Constant(value_int=0), n, op.Constant(value_int=1))
    return op.Add(start, op.Mul(op.CastLike(i, start), delta))


def _reduce_l1(op, node, x, axes=None):
    return _reduce_sum(op, node, op.Abs(x), axes)


def _reduce_sum_square(op, node, x, axes=None):
    return _reduce_sum(op, node, op.Mul(x, x), axes)


def _reduce_log_sum(op, node, x, axes=None):
    return op.Log(_reduce_sum(op, node, x, axes))


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


def _mvn(op, node, x):
    """The ONNX function of MeanVarianceNormalization: (x - E[x]) / (sqrt(E[x²] - E[x]²) + 1e-9)."""
    axes = op.Constant(value_ints=list(node.attributes.get_ints("axes", [0, 2, 3])))
    mean = op.ReduceMean(x, axes, keepdims=1)
    variance = op.Sub(op.ReduceMean(op.Mul(x, x), axes, keepdims=1), op.Mul(mean, mean))
    return op.Div(op.Sub(x, mean), op.Add(op.Sqrt(variance), _k(op, 1e-9, x)))


def _channel(op, v, rank: int):
    """A (C,) vector shaped (C, 1, ..., 1) to broadcast over an (N, C, ...) tensor of ``rank``."""
    return op.Reshape(v, op.Constant(value_ints=[-1] + [1] * (rank - 2)))


def _instance_norm(op, node, x, scale, bias):
    rank = len(x.shape)
    y = _normalize(op, x, op.Constant(value_ints=list(range(2, rank))), _f(node, "epsilon", 1e-5))
    return op.Add(op.Mul(y, _channel(op, scale, rank)), _channel(op, bias, rank))


def _layer_norm(op, node, x, scale, bias=None):
    rank = len(x.shape)
    axis = node.attributes.get_int("axis", -1) % rank
    y = op.Mul(_normalize(op, x, op.Constant(value_ints=list(range(axis, rank))), _f(node, "epsilon", 1e-5)), scale)
    return y if bias is None else op.Add(y, bias)


def _trilu(op, node, x, k=None):
    """Trilu as ``Where(mask, x, 0)`` with the mask built from row and column indices at run time."""
    shape = op.Shape(x)
    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    n_rows = op.Squeeze(op.Slice(shape, op.Constant(value_ints=[-2]), op.Constant(value_ints=[-1])))
    n_cols = op.Squeeze(op.Slice(shape, op.Constant(value_ints=[-1]), op.Constant(value_ints=[2**62])))
    rows = op.Unsqueeze(op.Range(zero, n_rows, one), op.Constant(value_ints=[1]))
    cols = op.Range(zero, n_cols, one)
    offset = op.Sub(cols, rows)
    k = zero if k is None else k
    mask = op.GreaterOrEqual(offset, k) if node.attributes.get_int("upper", 1) else op.LessOrEqual(offset, k)
    return op.Where(mask, x, _k(op, 0.0, x))


def _transpose(op, node, x):
    if "perm" in node.attributes:  # NOTE: the identity (_transpose_check)
        return op.Identity(x)
    return op.Transpose(x, perm=list(range(len(x.shape)))[::-1])


def _transpose_check(node: ir.Node) -> str | None:
    # NOTE: the builder's Transpose gradient reads 'perm' and fails (unordered_map::at) when it is omitted;
    # an identity perm becomes Identity: ORT's GemmTransposeFusion folds it into a Gemm as a 2-D transpose
    if "perm" in node.attributes:
        perm = list(node.attributes.get_ints("perm"))
        return None if perm == list(range(len(perm))) else "perm is given"
    return _has_rank(node, 1)


def _rank(node: ir.Node) -> int:
    return len(node.inputs[0].shape)


def _spatial(op, node):
    return op.Constant(value_ints=list(range(2, _rank(node))))


def _global_max_pool(op, node, x):
    return _reduce_extreme("ReduceMax")(op, node, x, _spatial(op, node))


def _global_lp_pool(op, node, x):
    p = node.attributes.get_int("p", 2)
    if p == 1:
        return op.ReduceSum(op.Abs(x), _spatial(op, node), keepdims=1)
    total = op.ReduceSum(op.Mul(x, x) if p == 2 else op.Pow(op.Abs(x), _k(op, float(p), x)), _spatial(op, node), keepdims=1)
    return op.Sqrt(total) if p == 2 else op.Pow(total, _k(op, 1.0 / p, x))


def _lp_pool(op, node, x):
    """(AveragePool(|x|^p, count_include_pad) · window size)^(1/p): LpPool pads with zeros too."""
    p = node.attributes.get_int("p", 2)
    keep = ("kernel_shape", "pads", "strides", "auto_pad", "dilations", "ceil_mode")
    attrs = {k: node.attributes[k].value for k in keep if k in node.attributes}
    powered = op.Mul(x, x) if p == 2 else op.Pow(op.Abs(x), _k(op, float(p), x))
    window = float(np.prod(node.attributes.get_ints("kernel_shape")))
    total = op.Mul(op.AveragePool(powered, count_include_pad=1, **attrs), _k(op, window, x))
    return op.Sqrt(total) if p == 2 else op.Pow(total, _k(op, 1.0 / p, x))


def _compress(op, node, x, condition):
    index = op.Reshape(op.NonZero(condition), op.Constant(value_ints=[-1]))
    if "axis" not in node.attributes:
        return op.Gather(op.Reshape(x, op.Constant(value_ints=[-1])), index, axis=0)
    return op.Gather(x, index, axis=node.attributes.get_int("axis"))


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


def _dequantize(op, node, x, scale, zero_point=None):
    y = op.Cast(x, to=scale.dtype)
    if zero_point is not None:
        y = op.Sub(y, op.Cast(zero_point, to=scale.dtype))
    if scale.shape is not None and len(scale.shape) == 1 and len(x.shape) > 1:
        axis = node.attributes.get_int("axis", 1) % len(x.shape)
        scale = op.Reshape(scale, op.Constant(value_ints=[-1] + [1] * (len(x.shape) - axis - 1)))
    return op.Mul(y, scale)


def _dequantize_check(node: ir.Node) -> str | None:
    x, scale = node.inputs[0], node.inputs[1]
    if node.attributes.get_int("block_size", 0) or scale.shape is None or len(scale.shape) > 1:
        return "blocked quantization is not rewritten"
    return None if x.shape is not None or len(scale.shape) == 0 else "the rank of the input is unknown"


def _one_hot(op, node, indices, depth, values):
    code = op.OneHot(indices, depth, op.Constant(value_ints=[0, 1]), axis=node.attributes.get_int("axis", -1))
    on, off = op.Gather(values, op.Constant(value_int=1)), op.Gather(values, op.Constant(value_int=0))
    # NOTE: on·m + off·(1 - m), m in {0, 1}, is exact; the builder's Where gradient does not reduce broadcasts
    m = op.Cast(code, to=values.dtype)
    return op.Add(op.Mul(on, m), op.Mul(off, op.Sub(op.CastLike(op.Constant(value_int=1), values), m)))


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


def _cumsum_check(node: ir.Node) -> str | None:
    axis = node.inputs[1]
    return "the axis is not a constant" if axis is None or axis.const_value is None else _has_rank(node, 1)


def _dims(op, x, blocks: int):
    """N, C, H, W of a 4-D ``x`` as 1-element int64 tensors, and ``blocks`` as one."""
    shape = op.Shape(x)
    dims = [op.Slice(shape, op.Constant(value_ints=[i]), op.Constant(value_ints=[i + 1])) for i in range(4)]
    return dims, op.Constant(value_ints=[blocks])


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


def _space_to_depth(op, node, x):
    b = node.attributes.get_int("blocksize")
    (n, c, h, w), bb = _dims(op, x, b)
    h2, w2 = op.Div(h, bb), op.Div(w, bb)
    y = op.Transpose(op.Reshape(x, op.Concat(n, c, h2, bb, w2, bb, axis=0)), perm=[0, 3, 5, 1, 2, 4])
    return op.Reshape(y, op.Concat(n, op.Mul(c, op.Constant(value_ints=[b * b])), h2, w2, axis=0))


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


def _einsum_terms(node: ir.Node) -> tuple[list[str], str]:
    equation = node.attributes.get_string("equation").replace(" ", "")
    inputs, _, output = equation.partition("->")
    terms = inputs.split(",")
    if "->" not in equation:  # NOTE: implicit output: the letters seen once, in alphabetical order
        letters = "".join(terms)
        output = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return terms, output


def _einsum(op, node, *xs):
    """Each operand transposed to one letter order and unsqueezed to every letter, multiplied (broadcast),
    summed over the letters the output drops, transposed to the output's order."""
    terms, output = _einsum_terms(node)
    letters = list(dict.fromkeys("".join(terms)))
    product = None
    for x, term in zip(xs, terms):
        ordered = sorted(term, key=letters.index)
        y = op.Transpose(x, perm=[term.index(c) for c in ordered]) if list(term) != ordered else x
        missing = [i for i, c in enumerate(letters) if c not in term]
        y = op.Unsqueeze(y, op.Constant(value_ints=missing)) if missing else y
        product = y if product is None else op.Mul(product, y)
    summed = [i for i, c in enumerate(letters) if c not in output]
    if summed:
        product = op.ReduceSum(product, op.Constant(value_ints=summed), keepdims=0)
    kept = [c for c in letters if c in output]
    return op.Transpose(product, perm=[kept.index(c) for c in output]) if kept != list(output) else op.Identity(product)


def _einsum_check(node: ir.Node) -> str | None:
    terms, output = _einsum_terms(node)
    if "." in "".join(terms) + output or any(len(set(t)) != len(t) for t in terms):
        return "ellipsis and repeated letters in one operand (diagonals) are not rewritten"
    return None


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


def _linear_scales(node: ir.Node) -> list[float] | None:
    """The scale of each axis of a linear Resize given constant scales, when only static axes >= 2 change."""
    x, scales = node.inputs[0], node.inputs[2] if len(node.inputs) > 2 else None
    if x.shape is None or scales is None or scales.const_value is None:
        return None
    if scales.const_value.size != len(x.shape):
        return None
    factors = [float(f) for f in scales.const_value.numpy()]
    moved = [k for k, f in enumerate(factors) if f != 1.0]
    return factors if all(k >= 2 and isinstance(x.shape[k], int) for k in moved) else None


def _interpolation(n_in: int, scale: float, mode: str) -> np.ndarray:
    """(n_in, n_out) matrix of 1-D linear interpolation, source coordinates as onnxruntime computes them."""
    n_out = int(np.floor(n_in * scale))
    i = np.arange(n_out, dtype=np.float64)
    if mode == "align_corners":
        x = i * (n_in - 1) / (n_out - 1) if n_out > 1 else np.zeros(n_out)
    elif mode == "asymmetric":
        x = i / scale
    else:  # half_pixel; pytorch_half_pixel differs only for one output
        x = (i + 0.5) / scale - 0.5 if n_out > 1 or mode == "half_pixel" else np.zeros(n_out)
    x = np.clip(x, 0, n_in - 1)
    lo = np.floor(x).astype(np.int64)
    hi, frac = np.minimum(lo + 1, n_in - 1), x - lo
    a = np.zeros((n_in, n_out))
    np.add.at(a, (lo, np.arange(n_out)), 1 - frac)
    np.add.at(a, (hi, np.arange(n_out)), frac)
    return a


def _resize_linear(op, node, x):
    """Linear Resize as one MatMul per resized axis by its constant interpolation matrix (ResizeGrad has no
    CPU kernel)."""
    mode = node.attributes.get_string("coordinate_transformation_mode", "half_pixel")
    rank, y = len(x.shape), x
    for k, f in enumerate(_linear_scales(node)):
        if f == 1.0:
            continue
        perm = list(range(rank))
        perm[k], perm[-1] = perm[-1], perm[k]
        a = op.CastLike(op.Constant(value=ir.tensor(_interpolation(x.shape[k], f, mode))), x)
        if k == rank - 1:
            y = op.MatMul(y, a)
        else:
            y = op.Transpose(op.MatMul(op.Transpose(y, perm=perm), a), perm=perm)
    return y


def _resize(op, node, x, *_):
    """Nearest Resize by integer factors: each element repeated (Unsqueeze, Expand, Reshape), a copy."""
    if node.attributes.get_string("mode", "nearest") == "linear":
        return _resize_linear(op, node, x)
    factors = _resize_factors(node)
    y = op.Unsqueeze(x, op.Constant(value_ints=[2 * i + 1 for i in range(len(factors))]))
    # NOTE: shapes computed at run time: exported models have a dynamic batch axis
    y = op.Expand(y, op.Constant(value_ints=[v for f in factors for v in (1, f)]))
    return op.Reshape(y, op.Mul(op.Shape(x), op.Constant(value_ints=factors)))


def _resize_check(node: ir.Node) -> str | None:
    if node.attributes.get_string("mode", "nearest") == "linear":
        if node.attributes.get_int("antialias", 0) or _linear_scales(node) is None:
            return "only linear Resize by constant scales of static axes >= 2, no antialias, is rewritten"
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


def _max_unpool_check(node: ir.Node) -> str | None:
    x = node.inputs[0]
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        return "output_shape is not rewritten"
    return None if x.shape is not None and all(isinstance(d, int) for d in x.shape) else "the shape is not static"


def _static(*values: ir.Value) -> bool:
    return all(v.shape is not None and all(isinstance(d, int) for d in v.shape) for v in values)


def _consts(node: ir.Node, *slots: int) -> bool:
    return all(len(node.inputs) <= i or node.inputs[i] is None or node.inputs[i].const_value is not None for i in slots)


def _int_input(node: ir.Node, slot: int, default=None):
    value = node.inputs[slot] if len(node.inputs) > slot else None
    return default if value is None else value.const_value.numpy().reshape(-1).tolist()


def _table(op, values: np.ndarray, like: ir.Value):
    """A constant array in the type of ``like``."""
    return op.Constant(value=ir.tensor(np.asarray(values, dtype=like.dtype.numpy())))


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
        return _reduce_extreme("ReduceMax")(op, maximum, picked, op.Constant(value_ints=[rank]))
    if np.any(weight[index < size] != 1):
        picked = op.Mul(picked, _table(op, weight, like))
    return op.ReduceSum(picked, op.Constant(value_ints=[-1]), keepdims=0)


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


def _corners(t: float, size: int) -> tuple[int, int, float]:
    """Low and high neighbours of coordinate ``t`` and the high one's weight (onnxruntime's RoiAlign clamping)."""
    low = int(t)
    return (size - 1, size - 1, 0.0) if low >= size - 1 else (low, low + 1, t - low)


def _roi_align_check(node: ir.Node) -> str | None:
    if not _consts(node, 1, 2) or not _static(node.inputs[0]) or len(node.inputs[0].shape) != 4:
        return "the boxes or batch indices are not constants, or the input shape is not static"
    return None if node.attributes.get_string("mode", "avg") == "avg" else "max mode is not rewritten"


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


def _grid_sample_check(node: ir.Node) -> str | None:
    x, grid = node.inputs[0], node.inputs[1]
    if x.shape is None or grid.shape is None or len(x.shape) != 4 or not all(
            isinstance(d, int) for d in [*x.shape[1:], *grid.shape[1:]]):
        return "only 4-D inputs of static shape (but the batch size) are rewritten"
    if node.attributes.get_string("mode", "linear") not in ("linear", "bilinear", "nearest"):
        return "cubic mode is not rewritten"
    return None if node.attributes.get_string("padding_mode", "zeros") in ("zeros", "border") else \
        "reflection padding is not rewritten"


def _dft_core(op, x, length: int, bins: int, inverse: bool, like):
    """The DFT of x (..., length, 1 or 2: ``like``'s last axis) along axis -2 as MatMuls with constant cos/sin
    tables: (..., bins, 2)."""
    angle = 2 * np.pi * np.outer(np.arange(length), np.arange(bins)) / length
    cos, sin = _table(op, np.cos(angle), like), _table(op, np.sin(angle) * (1 if inverse else -1), like)
    last = op.Constant(value_ints=[-1])
    real = op.Squeeze(op.Slice(x, op.Constant(value_ints=[0]), op.Constant(value_ints=[1]), last), last)
    lead = op.Concat(op.Slice(op.Shape(real), op.Constant(value_ints=[0]), last), op.Constant(value_ints=[bins]), axis=0)

    def times(v, table):  # NOTE: as a 2-D MatMul: the batched MatMul gradient (FusedMatMul) is float only
        return op.Reshape(op.MatMul(op.Reshape(v, op.Constant(value_ints=[-1, length])), table), lead)

    re, im = times(real, cos), times(real, sin)
    if like.shape[-1] == 2:  # (a + ib)(cos + i·sin) = a·cos - b·sin + i(b·cos + a·sin)
        imag = op.Squeeze(op.Slice(x, op.Constant(value_ints=[1]), op.Constant(value_ints=[2]), last), last)
        re, im = op.Sub(re, times(imag, sin)), op.Add(im, times(imag, cos))
    if inverse:
        re, im = (op.Div(v, _k(op, float(length), like)) for v in (re, im))
    # NOTE: re·[1, 0] + im·[0, 1], not a Concat: the builder's Concat gradient has no float64 kernel
    return op.Add(op.Mul(op.Unsqueeze(re, last), _table(op, [1.0, 0.0], like)),
                  op.Mul(op.Unsqueeze(im, last), _table(op, [0.0, 1.0], like)))


def _dft(op, node, x, dft_length=None, axis=None):
    rank = len(x.shape)
    a = (_int_input(node, 2, [-2])[0] if node.graph is None or node.graph.opset_imports.get("", 21) >= 20
         else node.attributes.get_int("axis", 1)) % rank
    perm = [i for i in range(rank - 1) if i != a] + [a, rank - 1]
    y = op.Transpose(x, perm=perm) if a != rank - 2 else x
    n = x.shape[a]
    length = _int_input(node, 1, [n])[0]
    if length != n:  # NOTE: the signal is cut or padded with zeros to dft_length
        y = op.Slice(y, op.Constant(value_ints=[0]), op.Constant(value_ints=[length]), op.Constant(value_ints=[-2])) \
            if length < n else op.Pad(y, op.Constant(value_ints=[0] * (rank - 2) + [0, 0] + [0] * (rank - 2) + [length - n, 0]))
    bins = length // 2 + 1 if node.attributes.get_int("onesided", 0) else length
    y = _dft_core(op, y, length, bins, bool(node.attributes.get_int("inverse", 0)), x)
    return op.Transpose(y, perm=[int(i) for i in np.argsort(perm)]) if a != rank - 2 else y


def _dft_check(node: ir.Node) -> str | None:
    opset = node.graph.opset_imports.get("", 21) if node.graph is not None else 21
    if not _consts(node, 1, 2) or (opset < 20 and len(node.inputs) > 1 and node.inputs[1] is not None):
        return "dft_length and axis are not constants"
    return None if _static(node.inputs[0]) else "the shape is not static"


def _stft(op, node, signal, step, window=None, frame_length=None):
    """Frames gathered by a constant index table, windowed, then the DFT of each frame (``_dft_core``)."""
    n, hop = signal.shape[1], _int_input(node, 1)[0]
    length = _int_input(node, 3, [window.shape[0]] if window is not None else None)[0]
    frames = (n - length) // hop + 1
    index = np.arange(frames)[:, None] * hop + np.arange(length)[None, :]
    y = op.Gather(signal, op.Constant(value=ir.tensor(index.astype(np.int64))), axis=1)
    if window is not None:
        y = op.Mul(y, op.Reshape(window, op.Constant(value_ints=[length, 1])))
    bins = length // 2 + 1 if node.attributes.get_int("onesided", 1) else length
    return _dft_core(op, y, length, bins, False, signal)


def _stft_check(node: ir.Node) -> str | None:
    if not _consts(node, 1, 3) or not _static(node.inputs[0]):
        return "frame_step and frame_length are not constants or the shape is not static"
    window, length = node.inputs[2] if len(node.inputs) > 2 else None, node.inputs[3] if len(node.inputs) > 3 else None
    return None if window is not None or length is not None else "neither window nor frame_length is given"


def _mod(op, node, a, b):
    """Mod(a + 0·Sign(b), b), exactly Mod(a, b): the dividend then depends on the divisor, so the builder asks for
    both gradients of Mod's definition (it fails on the definition when only the divisor's is asked for)."""
    return op.Mod(op.Add(a, op.Mul(op.Sign(b), _k(op, 0.0, b))), b, fmod=node.attributes.get_int("fmod", 0))


def _mod_check(node: ir.Node) -> str | None:
    if node.inputs[1].const_value is not None:
        return "the divisor is a constant (the dividend's gradient alone builds)"
    add = node.inputs[0].producer()
    mul = add.inputs[1].producer() if add is not None and add.op_type == "Add" else None
    sign = mul.inputs[0].producer() if mul is not None and mul.op_type == "Mul" else None
    return "already rewritten" if sign is not None and sign.op_type == "Sign" else None


def _unique(op, node, x):
    """The values as a Gather of the input at their first occurrences (the op's ``indices``): the same values,
    differentiable (a.e.: a tie changes the output's shape); the other outputs stay the op's."""
    axis = node.attributes.get_int("axis", None)
    outs = op.Unique(x, _outputs=4, **({} if axis is None else {"axis": axis}), sorted=node.attributes.get_int("sorted", 1))
    source = op.Reshape(x, op.Constant(value_ints=[-1])) if axis is None else x
    return (op.Gather(source, outs[1], axis=axis or 0), *outs[1:])[:len(node.outputs)]


def _dynamic_quantize(op, node, x):
    """The scale output as (max(x, 0) - min(x, 0)) / 255 in standard ops (onnxruntime's bit for bit, within an
    ulp when the max or min repeats), so it has a gradient; the quantized values and zero point stay the op's."""
    y, _, zero_point = op.DynamicQuantizeLinear(x, _outputs=3)
    scalar = op.Constant(value=ir.tensor(np.zeros(0, np.int64)))  # NOTE: ties share the gradient, as ReduceMax's rewrite does
    top = op.Max(op.Reshape(_reduce_extreme("ReduceMax")(op, node, x), scalar), _k(op, 0.0, x))
    bottom = op.Min(op.Reshape(_reduce_extreme("ReduceMin")(op, node, x), scalar), _k(op, 0.0, x))
    return y, op.Div(op.Sub(top, bottom), _k(op, 255.0, x)), zero_point


def _dynamic_quantize_check(node: ir.Node) -> str | None:
    scale = node.outputs[1]
    return None if scale.uses() or scale.is_graph_output() else "the scale is not read"


def _has_rank(node: ir.Node, least: int = 2) -> str | None:
    shape = node.inputs[0].shape
    return None if shape is not None and len(shape) >= least else "the rank of the input is unknown"


def _extreme_check(node: ir.Node) -> str | None:
    # NOTE: the rewrite itself holds a ReduceMax/Min read by an Equal (the mask): never rewrite that one again
    if any(user.op_type == "Equal" for user, _ in node.outputs[0].uses()):
        return "already decomposed (read by the tie mask)"
    return None


def _gelu_check(node: ir.Node) -> str | None:
    return None if node.attributes.get_string("approximate", "none") == "tanh" else "erf Gelu has an exact builder gradient"


def _double_check(node: ir.Node) -> str | None:
    if node.inputs[0].dtype != ir.DataType.DOUBLE or len(node.outputs) != 1:
        return "only float64 single-output LayerNormalization is rewritten (LayerNormalizationGrad is float)"
    return _has_rank(node)


# op_type -> (build, check); check returns the reason not to rewrite, or None
RULES: dict[str, tuple] = {
    "Elu": (_elu, None), "Selu": (_selu, None), "Celu": (_celu, None), "HardSigmoid": (_hard_sigmoid, None),
    "ThresholdedRelu": (_thresholded_relu, None), "Shrink": (_shrink, None), "Gelu": (_gelu_tanh, _gelu_check),
    "PRelu": (_prelu, None), "Sum": (_sum, None), "Mean": (_mean, None), "Range": (_range, None),
    "ReduceProd": (_reduce_prod, _reduce_prod_check),
    "ReduceMax": (_reduce_extreme("ReduceMax"), _extreme_check),
    "ReduceMin": (_reduce_extreme("ReduceMin"), _extreme_check),
    "ReduceL1": (_reduce_l1, None), "ReduceSumSquare": (_reduce_sum_square, None),
    "ReduceLogSum": (_reduce_log_sum, None), "LpNormalization": (_lp_normalization, None),
    "MeanVarianceNormalization": (_mvn, None), "InstanceNormalization": (_instance_norm, _has_rank),
    "LayerNormalization": (_layer_norm, _double_check), "Trilu": (_trilu, None),
    "Transpose": (_transpose, _transpose_check), "GlobalMaxPool": (_global_max_pool, _has_rank),
    "GlobalLpPool": (_global_lp_pool, _has_rank), "LpPool": (_lp_pool, None), "Compress": (_compress, None),
    "GroupNormalization": (_group_norm, _has_rank), "DequantizeLinear": (_dequantize, _dequantize_check),
    "OneHot": (_one_hot, None), "CumSum": (_cumsum, _cumsum_check),
    "DepthToSpace": (_depth_to_space, lambda node: _has_rank(node, 4)),
    "SpaceToDepth": (_space_to_depth, lambda node: _has_rank(node, 4)),
    "NegativeLogLikelihoodLoss": (_nll_loss, None), "Einsum": (_einsum, _einsum_check),
    "ReverseSequence": (_reverse_sequence, _has_rank), "Resize": (_resize, _resize_check),
    "ConvTranspose": (_conv_transpose, _conv_transpose_check), "MaxUnpool": (_max_unpool, _max_unpool_check), "LRN": (_lrn, lambda node: _has_rank(node, 3)),
    "AffineGrid": (_affine_grid, lambda node: None if _consts(node, 1) else "the size is not a constant"),
    "CenterCropPad": (_center_crop_pad, lambda node: None if _consts(node, 1) and _static(node.inputs[0]) else
                      "the target shape is not a constant or the input shape is not static"),
    "Col2Im": (_col2im, lambda node: None if _consts(node, 1, 2) else "image_shape and block_shape are not constants"),
    "GridSample": (_grid_sample, _grid_sample_check), "DFT": (_dft, _dft_check), "STFT": (_stft, _stft_check),
    "RoiAlign": (_roi_align, _roi_align_check),
    "MaxRoiPool": (_max_roi_pool, lambda node: None if _consts(node, 1) and _static(node.inputs[0]) else
                   "the boxes are not constants or the input shape is not static"),
    "DynamicQuantizeLinear": (_dynamic_quantize, _dynamic_quantize_check),
    "Mod": (_mod, _mod_check),
    "Unique": (_unique, lambda node: None if node.outputs[0].uses() or node.outputs[0].is_graph_output() else
               "the values are not read"),
}


_OUTPUTS = {"DynamicQuantizeLinear": (3,), "Unique": (1, 2, 3, 4)}


def _rule(op_type: str, build, check, n_outputs: int = 1) -> RewriteRule:
    names = ["out"] if n_outputs == 1 else [f"out{i}" for i in range(n_outputs)]

    def pattern(op, x):
        return getattr(op, op_type)(x, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=names)

    def condition(context, x, **outs) -> MatchResult:
        result = MatchResult()
        node = outs[names[0]].producer()
        if node.domain not in ("", "ai.onnx") or not any(v is not None and v.dtype in _FLOATS for v in node.inputs):
            return result.fail(f"{op_type}: only nodes of the default domain with a float input are rewritten")
        if len(node.outputs) != n_outputs:
            return result.fail(f"{op_type}: the rule is for {n_outputs} output(s)")
        reason = check(node) if check is not None else None
        return result.fail(f"{op_type}: {reason}") if reason else result

    def replacement(op, x, **outs):
        node = outs[names[0]].producer()
        inputs = list(node.inputs)
        while inputs and inputs[-1] is None:
            inputs.pop()
        return build(op, node, *inputs)

    return RewriteRule(pattern, replacement, condition, name=f"Decompose{op_type}{n_outputs}")


# NOTE: one rule per output count for the ops whose rewrite returns several outputs
_RULE_SET = {op_type: [_rule(op_type, build, check, n) for n in _OUTPUTS.get(op_type, (1,))]
             for op_type, (build, check) in RULES.items()}
# op_type -> number of outputs the builder's gradient reads
_COMPLETE = {"LayerNormalization": 3, "SoftmaxCrossEntropyLoss": 2}


def _complete_outputs(graph: ir.Graph) -> None:
    """Gives nodes the optional outputs their builder gradient reads (exporters omit them)."""
    for node in list(graph):
        want = _COMPLETE.get(node.op_type)
        if want is None or node.domain not in ("", "ai.onnx"):
            continue
        inputs = list(node.inputs)
        if node.op_type == "LayerNormalization" and (len(inputs) < 3 or inputs[2] is None):
            # NOTE: LayerNormalizationGrad reads a bias (torch's elementwise_affine=False / bias=False omit it)
            dtype = inputs[1].dtype or inputs[0].dtype
            if dtype is None:
                continue  # NOTE: left to the builder, which names the node in its error
            tape = ir.tape.Tape()  # NOTE: zeros shaped like the scale, outside the gradient path
            zeros = tape.op("ConstantOfShape", [tape.op("Shape", [inputs[1]])],
                            attributes={"value": ir.tensor(np.zeros(1, dtype.numpy()))})
            zeros.dtype = dtype
            graph.insert_before(node, tape.nodes)
            inputs = [*inputs[:2], zeros]
        elif len(node.outputs) >= want:
            continue
        _rebuild(graph, node, inputs, max(want, len(node.outputs)))


def _rebuild(graph: ir.Graph, node: ir.Node, inputs: list, n_outputs: int) -> None:
    """Replaces ``node`` by the same op on ``inputs`` with ``n_outputs`` outputs, keeping names and uses."""
    new = ir.node(node.op_type, inputs, attributes=dict(node.attributes), num_outputs=n_outputs,
                  name=node.name, metadata_props=dict(node.metadata_props))
    graph.insert_before(node, new)
    for old, value in zip(node.outputs, new.outputs):
        value.name, value.type, value.shape = old.name, old.type, old.shape
        old.name = None
        ir.convenience.replace_all_uses_with(old, value, replace_graph_outputs=True)
    graph.remove(node, safe=True)


def _expand_where_branches(graph: ir.Graph) -> None:
    """``Where(c, a, b)`` -> ``Where(c, Expand(a, s), Expand(b, s))`` for a branch not known to have the output's
    shape: ORT's Where gradient does not sum a broadcast branch back to its shape (a trained (1,) tensor would
    get a full-shaped gradient); Expand's does. ``s`` is the shape of a copy of the node (no cycle)."""
    for node in list(graph):
        if node.op_type != "Where" or node.domain not in ("", "ai.onnx") or node.outputs[0].dtype not in _FLOATS:
            continue
        out = node.outputs[0]
        todo = [i for i in (1, 2) if node.inputs[i] is not None and not _same_shape(node.inputs[i], out)
                and (node.inputs[i].producer() is None or node.inputs[i].producer().op_type != "Constant")]
        if not todo:
            continue
        tape = ir.tape.Tape()
        shape = tape.op("Shape", [tape.op("Where", list(node.inputs))])
        inputs = list(node.inputs)
        for i in todo:
            inputs[i] = tape.op("Expand", [inputs[i], shape])
            inputs[i].dtype = out.dtype
        graph.insert_before(node, tape.nodes)
        for i in todo:
            node.replace_input_with(i, inputs[i])


def _same_shape(value: ir.Value, out: ir.Value) -> bool:
    a, b = value.shape, out.shape
    return a is not None and b is not None and len(a) == len(b) and all(
        isinstance(x, int) and x == y for x, y in zip(a, b))


def decompose(model: ir.Model, unroll_recurrent: bool = False, gradient: str = "builder") -> ir.Model:
    """Applies ``RULES`` to the ops of ``model`` that have one, completes nodes, names the unnamed nodes whose
    gradient comes from ``GRADIENTS`` (the builder prefixes their gradient nodes by name); returns ``model``.
    RNN/GRU/LSTM nodes are prepared for ``gradient`` by ``autodiff.recurrent.lower_recurrent`` (for the
    builder: split directions, explicit initial states, RNN unrolled, GRU and LSTM too if ``unroll_recurrent``)."""
    from onnxopt.autodiff.recurrent import lower_recurrent

    # NOTE: on the model's own Where nodes (typed by shape inference), before the rules add theirs
    _expand_where_branches(model.graph)
    present = {n.op_type for n in model.graph if n.domain in ("", "ai.onnx")}
    rules = [rule for op in sorted(present & set(_RULE_SET)) for rule in _RULE_SET[op]]
    if rules:
        RewriteRuleSet(rules).apply_to_model(model)
    _complete_outputs(model.graph)
    lower_recurrent(model, gradient, unroll_recurrent)
    for i, node in enumerate(model.graph):
        if node.op_type in GRADIENTS and not node.name:
            node.name = f"{node.op_type}_{i}"
    return model
