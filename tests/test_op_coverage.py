"""Gradient coverage of every ONNX op (default domain, opsets 18-21, and the opset 23 ops torch writes) and the
ai.onnx.ml ops skl2onnx emits.

Each op becomes a one-node float64 model (random inputs, valid attributes); the gradient of
sum(output · cotangent) with respect to every float input, built by onnxopt, is checked against central
finite differences of the original model run by onnxruntime. The measured status of each op makes the
table of docs/ops.md, which must be equal: regenerate it with ``python tests/test_op_coverage.py --write``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx
import onnx.defs
import onnx.helper as oh
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from helpers import finite_differences
import onnxopt
from onnxopt.autodiff import load_rewrites, load_rules
from onnxopt.autodiff.rewrite import REWRITES
from onnxopt.errors import NotDifferentiableError
from onnxopt.gradient import gradient_ir, has_training_build

TRAINING_BUILD = has_training_build()
from onnxopt.modelio import load_model, runtime_limits
from onnxopt.passes.decompose import GRADIENTS, RULES
from onnxopt.passes.modes import apply_mode
from onnxopt.rules import lower_for_gradient

DOCS = Path(__file__).resolve().parents[1] / "docs" / "ops.md"
ML = "ai.onnx.ml"
I64 = np.int64

# Ops measured as "not differentiable" without a gradient check, with the reason (no float input is found
# from the schema, so these are the ops that take floats but have no gradient by nature).
NATURE = {
    **{op: "random, no input" for op in ("RandomNormal", "RandomUniform")},
    **{op: "sequence / optional" for op in ("SequenceEmpty", "SequenceErase", "SequenceLength", "SequenceMap",
                                            "Optional", "OptionalGetElement", "OptionalHasElement")},
    "QLinearMatMul": "quantized, no opset-21 CPU kernel",
    "Constant": "no input",
    "ImageDecoder": "encoded image input",
}
# Ops with subgraphs or sequences, whose rules are checked against torch and finite differences on whole models
ELSEWHERE = {op: "onnxopt rule, checked in tests/test_grad_control.py" for op in (
    "If", "Loop", "Scan", "ConcatFromSequence", "SequenceAt", "SequenceConstruct", "SequenceInsert", "SplitToSequence")}
# NOTE: onnx's reference computes these in float32 (erf) or rounds their output to float32
ROUNDED = {"Erf", "Gelu", "AffineGrid", "DynamicQuantizeLinear",
           "GridSample"}  # NOTE: onnx's reference GridSample differs from onnxruntime's on this grid
# Random ops of a float input: seeded, each finite difference runs in a new session (the same draw)
RANDOM = {"Bernoulli", "Multinomial", "RandomNormalLike", "RandomUniformLike"}
# Ops whose derivative is zero wherever it exists: checked as y = x + ΣCast(op(x)) (gradient = cotangent).
ZERO = {"Floor", "Ceil", "Round", "Sign", "Hardmax", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual",
        "IsNaN", "IsInf", "ArgMax", "ArgMin", "Shape", "Size", "NonZero", "EyeLike", "QuantizeLinear",
        "NonMaxSuppression", "MelWeightMatrix", "QLinearConv", *RANDOM}


@dataclass
class Case:
    """One node: ``inputs`` are "kind:shape" strings (float, differentiated), arrays (constants) or None."""

    op: str
    inputs: list
    attrs: dict = field(default_factory=dict)
    outputs: int = 1
    domain: str = ""
    dtype: int = TensorProto.DOUBLE
    opset: int = 21


def c(op, *inputs, outputs=1, domain="", opset=21, **attrs) -> Case:
    return Case(op, list(inputs), attrs, outputs, domain, opset=opset)


X = "n:2,3"
IMG = "n:1,2,4,4"
W = "n:2,2,3,3"
SEQ = "n:3,2,4"  # seq_length, batch, input_size
CASES = [
    c("Abs", X), c("Acos", "u:2,3"), c("Acosh", "g:2,3"), c("Add", X, "n:3"), c("Asin", "u:2,3"), c("Asinh", X),
    c("Atan", X), c("Atanh", "u:2,3"), c("Bernoulli", "u:2,3", seed=1.0),
    c("Multinomial", X, sample_size=2, seed=1.0), c("RandomNormalLike", X, seed=1.0),
    c("RandomUniformLike", X, seed=1.0),
    c("NonMaxSuppression", "n:1,3,4", "u:1,1,3", np.array([2], I64), np.array([0.5]), np.array([0.0])),
    c("AffineGrid", "n:2,2,3", np.array([2, 1, 3, 4], I64)),
    c("ArgMax", X, axis=1), c("ArgMin", X, axis=1),
    c("AveragePool", IMG, kernel_shape=[2, 2]), c("BatchNormalization", IMG, "n:2", "n:2", np.array([0.1, -0.2]), np.array([0.5, 2.0])),
    c("Cast", X, to=TensorProto.DOUBLE), c("CastLike", X, np.zeros(1)), c("Ceil", X), c("Celu", X, alpha=0.8),
    c("CenterCropPad", "n:4,5", np.array([3, 6], I64)), c("Clip", X, np.array(-0.5), np.array(0.6)),
    c("Col2Im", "n:1,4,4", np.array([3, 3], I64), np.array([2, 2], I64)),
    c("Compress", "n:3,2", np.array([True, False, True]), axis=0), c("Concat", X, "n:2,2", axis=1),
    c("Conv", IMG, W, "n:2", pads=[1, 1, 1, 1]), c("ConvTranspose", IMG, W, "n:2"), c("Cos", X), c("Cosh", X),
    c("CumSum", X, np.array(1, I64)), c("DFT", "n:1,4,1", None, np.array(1, I64)),
    c("DeformConv", IMG, W, "n:1,18,2,2"), c("DepthToSpace", "n:1,4,2,3", blocksize=2),
    c("DequantizeLinear", np.array([[3, 7, 9]], np.uint8), "p:1", np.array(4, np.uint8)), c("Det", "n:3,3"),
    c("Div", X, "p:2,3"), c("Dropout", X), c("DynamicQuantizeLinear", X, outputs=3),
    c("Einsum", X, "n:3,2", equation="ij,jk->ik"), c("Elu", X, alpha=0.7), c("Equal", X, "n:2,3"), c("Erf", X),
    c("Exp", X), c("Expand", "n:3,1", np.array([2, 3, 2], I64)), c("EyeLike", "n:3,3"), c("Flatten", IMG),
    c("Floor", X), c("GRU", SEQ, "n:1,9,4", "n:1,9,3", "n:1,18", hidden_size=3, outputs=2),
    c("Gather", "n:4,3", np.array([0, 2, 2], I64)), c("GatherElements", X, np.array([[0, 2], [1, 0]], I64), axis=1),
    c("GatherND", X, np.array([[1, 0], [0, 2]], I64)), c("Gelu", X), c("Gemm", X, "n:4,3", "n:4", transB=1),
    c("GlobalAveragePool", IMG), c("GlobalLpPool", IMG), c("GlobalMaxPool", IMG), c("Greater", X, "n:2,3"),
    c("GreaterOrEqual", X, "n:2,3"), c("GridSample", IMG, "u:1,3,3,2"),
    c("GroupNormalization", "n:2,4,3", "n:4", "n:4", num_groups=2, stash_type=TensorProto.DOUBLE), c("HardSigmoid", X, alpha=0.3),
    c("HardSwish", "n:4,5"), c("Hardmax", X), c("Identity", X), c("InstanceNormalization", IMG, "n:2", "n:2"),
    c("IsInf", X), c("IsNaN", X), c("LRN", IMG, size=3), c("LSTM", SEQ, "n:1,12,4", "n:1,12,3", "n:1,24",
                                                            hidden_size=3, outputs=3),
    c("LayerNormalization", "n:2,3,4", "n:4", "n:4"), c("LeakyRelu", X, alpha=0.2), c("Less", X, "n:2,3"),
    c("LessOrEqual", X, "n:2,3"), c("Log", "p:2,3"), c("LogSoftmax", X), c("LpNormalization", X),
    c("LpPool", IMG, kernel_shape=[2, 2]), c("MatMul", X, "n:3,4"), c("Max", X, "n:2,3", "n:3"),
    c("MaxPool", IMG, kernel_shape=[2, 2]), c("MaxRoiPool", IMG, np.array([[0, 0, 0, 2, 2]], np.float64),
                                                  pooled_shape=[2, 2]),
    c("MaxUnpool", "n:1,1,2,2", np.array([[[[0, 3], [9, 14]]]], I64), kernel_shape=[2, 2], strides=[2, 2]),
    c("Mean", X, "n:2,3", "n:3"), c("MeanVarianceNormalization", "n:2,2,3,3"), c("Min", X, "n:2,3", "n:3"),
    c("MelWeightMatrix", np.array(4, I64), np.array(8, I64), np.array(800, I64), "p:", np.array(300.0)),
    c("Mish", X), c("Mod", "w:2,3", "p:2,3", fmod=1), c("Mul", X, "n:2,3"), c("Neg", X),
    c("NegativeLogLikelihoodLoss", "n:3,4", np.array([1, 0, 3], I64), reduction="mean"),
    c("NonZero", X), c("OneHot", np.array([1, 0], I64), np.array(3, I64), "n:2"), c("PRelu", X, "n:3"),
    c("Pad", X, np.array([0, 1, 1, 0], I64), np.array(0.5)), c("Pow", "p:2,3", np.array(2.5)),
    c("QuantizeLinear", X, np.array(0.1)),
    c("QLinearConv", np.arange(16, dtype=np.uint8).reshape(1, 1, 4, 4) * 9, "p:", np.array(3, np.uint8),
      np.array([[[[1, 5], [9, 2]]]], np.uint8), "p:", np.array(4, np.uint8), "p:", np.array(2, np.uint8)),
    c("RNN", SEQ, "n:1,3,4", "n:1,3,3", "n:1,6", hidden_size=3, outputs=2),
    c("Range", np.array(1.0), np.array(5.0), "p:"), c("Reciprocal", "p:2,3"),
    *[c(op, "p:2,3,2", np.array([1], I64)) for op in ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp",
                                                      "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd",
                                                      "ReduceSum", "ReduceSumSquare")],
    c("Relu", X), c("Reshape", X, np.array([3, 2], I64)),
    c("Resize", "n:1,1,3,4", None, np.array([1, 1, 2, 3], np.float32)),  # NOTE: small: the reference loops
    c("ReverseSequence", "n:3,2", np.array([2, 3], I64), batch_axis=1, time_axis=0),
    c("RoiAlign", IMG, np.array([[0, 0, 3, 3]], np.float64), np.array([0], I64), output_height=2, output_width=2),
    c("Round", X), c("STFT", "n:1,8,1", np.array(2, I64), None, np.array(4, I64)),
    c("ScatterElements", X, np.array([[1], [0]], I64), "n:2,1", axis=1),
    c("ScatterND", X, np.array([[1]], I64), "n:1,3"), c("Selu", X), c("Shape", X), c("Shrink", X, bias=0.1),
    c("Sigmoid", X), c("Sign", X), c("Sin", X), c("Sinh", X), c("Size", X),
    c("Slice", "n:3,4", np.array([1], I64), np.array([3], I64), np.array([1], I64)), c("Softmax", X),
    c("SoftmaxCrossEntropyLoss", "n:3,4", np.array([1, 0, 3], I64)), c("Softplus", X), c("Softsign", X),
    c("SpaceToDepth", "n:1,1,4,4", blocksize=2), c("Split", "n:4,3", outputs=2, num_outputs=2, axis=0),
    c("Sqrt", "p:2,3"), c("Squeeze", "n:2,1,3", np.array([1], I64)), c("Sub", X, "n:2,3"),
    c("Sum", X, "n:2,3", "n:3"), c("Tan", "u:2,3"), c("Tanh", X), c("ThresholdedRelu", X, alpha=0.3),
    c("Tile", X, np.array([2, 1], I64)), c("TopK", "n:2,5", np.array([2], I64), outputs=2), c("Transpose", X),
    c("Trilu", "n:3,4"), c("Unique", "n:2,3", outputs=4), c("Unsqueeze", X, np.array([1], I64)),
    c("Where", np.array([[True, False, True]]), X, "n:2,3"),
    # opset 23-24 forms torch's exporter writes (nn.TransformerEncoderLayer, F.scaled_dot_product_attention,
    # nn.RMSNorm); attribute variants: tests/test_opset23.py. Grouped-query heads, a float mask, causal:
    c("Attention", "n:1,2,3,4", "n:1,1,4,4", "n:1,1,4,3", "n:3,4", is_causal=1, opset=23),
    c("RMSNormalization", "n:2,3,4", "n:4", stash_type=TensorProto.DOUBLE, opset=23),
    c("RotaryEmbedding", "n:1,2,3,4", np.cos(np.arange(6.0)).reshape(1, 3, 2),
      np.sin(np.arange(6.0)).reshape(1, 3, 2), opset=23),
    c("Swish", X, alpha=0.7, opset=24),
    # ai.onnx.ml ops skl2onnx emits for differentiable models (LinearRegressor/Classifier: see test_ml_rules.py)
    # NOTE: their outputs are float32 whatever the input: checked in float32
    Case("Normalizer", ["p:2,3"], {"norm": "L2"}, 1, ML, TensorProto.FLOAT),
    Case("Scaler", [X], {"offset": [0.1, 0.2, 0.3], "scale": [2.0, 0.5, 1.5]}, 1, ML, TensorProto.FLOAT),
    Case("ArrayFeatureExtractor", [X, np.array([2, 0], I64)], {}, 1, ML, TensorProto.FLOAT),
]


def _value(kind_shape: str, rng) -> np.ndarray:
    kind, shape = kind_shape.split(":")
    shape = tuple(int(s) for s in shape.split(",") if s)
    low, high = {"u": (-0.9, 0.9), "p": (0.5, 2.0), "g": (1.2, 3.0), "w": (-4.0, 4.0)}.get(kind, (None, None))
    return rng.normal(size=shape) if kind == "n" else rng.uniform(low, high, size=shape)


def _opsets(case: Case) -> list:
    opsets = [oh.make_opsetid("", case.opset)]
    return opsets + [oh.make_opsetid(ML, 3)] if case.domain == ML else opsets


def _model(case: Case, feeds: dict, zero: bool):
    """The one-node model (float inputs are graph inputs, the rest initializers), plus its float output names."""
    names, inits, inputs = [], [], []
    for i, value in enumerate(case.inputs):
        if value is None:
            names.append("")
        elif isinstance(value, str):
            names.append(f"x{i}")
            inputs.append(oh.make_tensor_value_info(f"x{i}", case.dtype, feeds[f"x{i}"].shape))
        else:
            names.append(f"c{i}")
            value = np.asarray(value)
            if value.dtype == np.float64:  # NOTE: float64 constants follow the case's type, float32 ones stay
                value = value.astype(np.float64 if case.dtype == TensorProto.DOUBLE else np.float32)
            inits.append(numpy_helper.from_array(value, f"c{i}"))
    outs = [f"y{i}" for i in range(case.outputs)]
    nodes = [oh.make_node(case.op, names, outs, domain=case.domain, name="node", **case.attrs)]
    if zero:  # z = ΣReduceSum(float inputs) + ΣReduceSum(Cast(outputs)): the gradient is the cotangent
        terms = []
        for n in names:
            if n.startswith("x"):
                nodes.append(oh.make_node("ReduceSum", [n], [n + "s"], keepdims=0))
                terms.append(n + "s")
        for o in outs:
            nodes += [oh.make_node("Cast", [o], [o + "c"], to=case.dtype),
                      oh.make_node("ReduceSum", [o + "c"], [o + "s"], keepdims=0)]
            terms.append(o + "s")
        nodes.append(oh.make_node("Sum", terms, ["z"]))
        outs = ["z"]
    graph = oh.make_graph(nodes, "one", inputs, [oh.make_value_info(o, onnx.TypeProto()) for o in outs], inits)
    model = oh.make_model(graph, opset_imports=_opsets(case), ir_version=10)
    return model


def _session(model) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


class NoForwardKernel(Exception):
    """onnxruntime cannot run the forward model (no kernel for this type)."""


def _check(case: Case, zero: bool) -> None:
    """Raises unless onnxopt's gradient (its own rules) equals central finite differences."""
    rng = np.random.default_rng(0)
    float_np = np.float64 if case.dtype == TensorProto.DOUBLE else np.float32
    feeds = {f"x{i}": _value(v, rng).astype(float_np) for i, v in enumerate(case.inputs) if isinstance(v, str)}
    model = _model(case, feeds, zero)
    try:
        forward = _session(model)
    except Exception as exc:
        raise NoForwardKernel(str(exc)) from exc
    try:
        forward.run(None, feeds)
    except Exception as exc:
        raise NoForwardKernel(str(exc)) from exc
    outputs = forward.run(None, feeds)
    names = [o.name for o in forward.get_outputs()]
    cot = {n: rng.normal(size=o.shape).astype(o.dtype) for n, o in zip(names, outputs)
           if o.dtype.kind == "f"}

    run, eps = forward.run, 1e-6
    rtol = 1e-5 if float_np is np.float64 else 1e-4
    if case.op in RANDOM:  # NOTE: a seeded session draws anew at each run; a new one repeats the first draw
        def run(names, values):
            return _session(model).run(names, values)
        eps, rtol = (1e-6, rtol) if float_np is np.float64 else (1e-3, 5e-3)
    if float_np is np.float32 and case.op not in RANDOM:  # NOTE: no float64 kernel: onnx's reference in float64
        try:
            if case.op in ROUNDED:
                raise NotImplementedError
            run = _reference(case, feeds, zero)
            run(None, {k: v.astype(np.float64) for k, v in feeds.items()})
        except Exception:  # NOTE: the reference lacks the op: float32 differences of onnxruntime, looser
            run, eps, rtol = forward.run, 1e-3, 5e-3

    grad, _ = gradient_ir(load_model(model), [], list(feeds), gradient="onnxopt")
    sess = _session(onnx.load_from_string(onnx_ir_to_bytes(grad)))
    wanted = {i.name for i in sess.get_inputs()}
    run_feeds = {**feeds, **{n + "_grad": g for n, g in cot.items() if n + "_grad" in wanted}}
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, run_feeds)))
    feeds = {k: v.astype(np.float64) for k, v in feeds.items()}  # NOTE: a float32 x + 1e-6 would round

    own_run = run if case.op in RANDOM else forward.run

    def compare(run, eps, rtol):
        def loss(values):
            if run in (forward.run, own_run):
                values = {k: v.astype(float_np) for k, v in values.items()}
            return sum(float((o * cot[n]).sum()) for n, o in zip(names, run(None, values)) if n in cot)

        for name, expected in finite_differences(loss, feeds, list(feeds), eps).items():
            np.testing.assert_allclose(got[name + "_grad"], expected, rtol=rtol, atol=rtol,
                                       err_msg=f"{case.op}: gradient of input {name}")

    try:
        compare(run, eps, rtol)
    except AssertionError:
        if float_np is np.float32:
            raise
        # NOTE: onnxruntime computes some float64 ops in float32 (Shrink): onnx's float64 reference decides
        compare(_reference(case, feeds, zero), eps, rtol)


def _reference(case: Case, feeds: dict, zero: bool):
    """``run`` of onnx's reference runtime on the float64 version of the model."""
    from onnx.reference import ReferenceEvaluator

    case64 = replace(case, dtype=TensorProto.DOUBLE)
    return ReferenceEvaluator(_model(case64, {k: v.astype(np.float64) for k, v in feeds.items()}, zero)).run


def onnx_ir_to_bytes(model) -> bytes:
    import onnx_ir as ir

    return ir.to_proto(model).SerializeToString()


def _rewritten(case: Case) -> bool:
    """True when onnxopt's lowering (after the mode pass: Dropout, BatchNormalization) replaces the node
    (float64), also by a form that keeps an op of the same type (ReduceMax's tie mask, Range's integer index
    range, DynamicQuantizeLinear's integer outputs)."""
    rng = np.random.default_rng(0)
    feeds = {f"x{i}": _value(v, rng) for i, v in enumerate(case.inputs) if isinstance(v, str)}
    model = load_model(_model(case, feeds, False))
    apply_mode(model, None)
    lowered = lower_for_gradient(model, gradient="onnxopt")
    ops = [n.op_type for n in lowered.graph]
    return case.op not in ops or (case.op in RULES and ops != [case.op])


def _failure(exc: Exception) -> str:
    """The status of an op whose float32 check raised."""
    text = str(exc)
    if isinstance(exc, NoForwardKernel):
        return "not differentiable (no onnxruntime CPU kernel)"
    if "Could not find an implementation for" in text and "Grad" in text:
        return "not differentiable (builder gradient has no CPU kernel)"
    if "could not differentiate" in text:
        return "not differentiable (rule error)"
    return f"fails: {type(exc).__name__}: {text.splitlines()[0][:100]}"


EXACT = ("onnxopt rule", "onnxopt rewrite")


def measure(case: Case) -> str:
    """The status of ``case.op`` as docs/ops.md names it."""
    zero = case.op in ZERO
    try:
        _check(case, zero)
    except NotDifferentiableError as exc:
        assert case.op in str(exc) and "'node'" in str(exc), str(exc)  # the error names the op and the node
        return "not differentiable (no gradient)"
    except Exception as exc:
        if case.dtype == TensorProto.FLOAT:
            return _failure(exc)
        status = measure(replace(case, dtype=TensorProto.FLOAT))
        if status not in EXACT and status != "zero gradient":
            return status
        # NOTE: no float64 forward kernel in onnxruntime: float64 models cannot hold the op at all
        return f"{status}, float32 (no float64 {'kernel' if isinstance(exc, NoForwardKernel) else 'gradient kernel'})"
    if zero:
        return "zero gradient"
    return "onnxopt rewrite" if _rewritten(case) else "onnxopt rule"


# Second order: ``grad`` of the op's first-order gradient graph (``onnxopt.grad``, seeded by a cotangent of its
# first output), of s = Σ (x_grad · r) for random r, with respect to every float input and the seed, against central
# differences of s. Ops whose first-order gradient graph has ops without a rule, with the reason:
SECOND_ORDER_EXCEPTIONS = {
    "Attention": "its rule recomputes Attention with its qk_matmul_output, which has no rule of its own",
    "Det": "its rule writes com.microsoft's Inverse",
    "DynamicQuantizeLinear": "its first output is an integer",
}


def _with_dot(first: onnx.ModelProto, floats: list[str], case: Case, rng) -> onnx.ModelProto:
    """``first`` plus output s = Σ_i sum(x_i_grad · r_i), r_i random constants."""
    m = onnx.ModelProto()
    m.CopyFrom(first)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(case.dtype)
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in first.graph.input}
    for x in floats:
        m.graph.initializer.append(numpy_helper.from_array(rng.normal(size=shapes[x]).astype(dtype), f"r_{x}"))
        m.graph.node.extend([oh.make_node("Mul", [f"{x}_grad", f"r_{x}"], [f"m_{x}"]),
                             oh.make_node("ReduceSum", [f"m_{x}"], [f"s_{x}"], keepdims=0)])
    m.graph.node.append(oh.make_node("Sum", [f"s_{x}" for x in floats], ["s"]))
    m.graph.output.append(oh.make_tensor_value_info("s", case.dtype, []))
    return m


def _second_order_models(case: Case):
    """(feeds, the first-order model with s, its gradient) of ``case`` in the case's type."""
    rng = np.random.default_rng(0)
    float_np = np.float64 if case.dtype == TensorProto.DOUBLE else np.float32
    feeds = {f"x{i}": _value(v, rng).astype(float_np) for i, v in enumerate(case.inputs) if isinstance(v, str)}
    model = _model(case, feeds, False)
    floats = list(feeds)
    first = onnxopt.grad(model, floats, of="y0", seed=True)
    try:
        out = _session(model).run(["y0"], feeds)[0]
    except Exception:  # noqa: BLE001 (no kernel in this type: the seed's shape from onnx's reference)
        try:
            out = _reference(case, feeds, False)(["y0"], feeds)[0]
        except Exception as exc:  # NOTE: onnx's reference lacks the op
            raise NoForwardKernel(str(exc)) from exc
    feeds["y0_grad"] = rng.normal(size=out.shape).astype(float_np)
    with_dot = _with_dot(first, floats, case, np.random.default_rng(1))
    return feeds, with_dot, onnxopt.grad(with_dot, [*floats, "y0_grad"], of="s")


def second_order(case: Case) -> str:
    """The second-order status of an op whose first-order status is exact: "exact" (float64 central
    differences of the first-order gradient agree; float32 ops: onnx's float64 reference runs the first-order
    graph), or why not."""
    try:
        feeds, with_dot, second = _second_order_models(case)
    except NotDifferentiableError as exc:
        return "no rule: " + ", ".join(sorted({op for op, _ in exc.nodes}))
    except NoForwardKernel:
        return "not checked (neither onnxruntime nor onnx's reference runs the float64 op)"
    except Exception as exc:  # noqa: BLE001 (the status names the failure)
        return f"fails: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    names = [o.name for o in second.graph.output][-len(feeds):]
    try:
        got = dict(zip(feeds, _session(second).run(names, feeds)))
        run, rtol = _session(with_dot).run, 1e-5
    except Exception:  # noqa: BLE001 (no float64 kernel: float32 gradients against the float64 reference)
        from onnx.reference import ReferenceEvaluator

        feeds32, _, second = _second_order_models(replace(case, dtype=TensorProto.FLOAT))
        got = dict(zip(feeds32, _session(second).run(names, feeds32)))
        try:
            run, rtol = ReferenceEvaluator(with_dot).run, 1e-3
            run(["s"], feeds)
        except Exception:  # noqa: BLE001 (the reference lacks an op of the graph)
            return "not checked (onnx's reference cannot run the float64 first-order graph)"
    try:
        fd = finite_differences(lambda p: float(run(["s"], p)[0]), feeds, list(feeds), 1e-5)
        for name, expected in fd.items():
            np.testing.assert_allclose(got[name], expected, rtol=rtol, atol=rtol)
    except AssertionError as exc:
        return f"fails: {str(exc).strip().splitlines()[0][:80]}"
    return "exact"


def _has_float_input(op: str) -> bool:
    schema = onnx.defs.get_schema(op, 21, "")
    floats = {"tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"}
    allowed = {tc.type_param_str: set(tc.allowed_type_strs) for tc in schema.type_constraints}
    return any(floats & allowed.get(i.type_str, {i.type_str}) for i in schema.inputs)


def default_ops() -> list[str]:
    ops = set()
    for schema in onnx.defs.get_all_schemas_with_history():
        for version in (18, 19, 20, 21):
            try:
                if schema.domain == "" and not onnx.defs.get_schema(schema.name, version, "").deprecated:
                    ops.add(schema.name)
            except onnx.defs.SchemaError:
                pass
    return sorted(ops)


# Ops of opsets the training build's onnxruntime (1.19) cannot load: their status as measured on stock
# onnxruntime >= 1.32 (Python 3.13), where test_newer_opset_statuses_are_measured checks it.
NEWER_OPSET = {"Attention": "onnxopt rule", "RMSNormalization": "onnxopt rule",
               "RotaryEmbedding": "onnxopt rule, float32 (no float64 kernel)", "Swish": "onnxopt rule"}


def _newer(case: Case, status: str) -> str:
    return status if case.opset <= 21 else f"{status}, opset {case.opset} (onnxruntime >= 1.32)"


def table() -> dict[tuple[str, str], str]:
    """(domain, op) -> status for every op (opsets the installed onnxruntime cannot load: ``NEWER_OPSET``)."""
    cases = {(case.domain, case.op): case for case in CASES}
    out = {}
    for op in default_ops():
        if op in NATURE:
            out["", op] = f"not differentiable ({NATURE[op]})"
        elif op in ELSEWHERE:
            out["", op] = ELSEWHERE[op]
        elif ("", op) not in cases:
            assert not _has_float_input(op), f"{op} takes float inputs but has no case"
            out["", op] = "not differentiable (no float input)"
    for key, case in cases.items():
        if VERBOSE:
            print(case.op, end=" ", flush=True)
        out[key] = _newer(case, NEWER_OPSET[case.op] if case.opset > runtime_limits()[1] else measure(case))
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0], kv[0][1])))


def second_orders(statuses: dict[tuple[str, str], str]) -> dict[tuple[str, str], str]:
    """(domain, op) -> second-order status of every default-domain op whose first order is exact."""
    cases = {(case.domain, case.op): case for case in CASES}
    out = {}
    for key, status in statuses.items():
        if key in cases and not key[0] and status.split(",")[0] in EXACT:
            case = cases[key]
            out[key] = "opset 23 (not measured here)" if case.opset > runtime_limits()[1] else second_order(case)
    return out


def family(domain: str, op: str, status: str) -> str:
    """The op family that differentiates the op: its rule's (``onnxopt.autodiff.RULES``), or, for an op rewritten
    into others, its rewrite's (``onnxopt.autodiff.rewrite.REWRITES``); 'rewrite' for the rewrites of other
    passes (RNN's unrolling, modes, the float64 forms of ``onnxopt.rules``, the ai.onnx.ml lowering)."""
    rule = load_rules().get((domain, op))
    if status.startswith("onnxopt rule"):
        return rule.family
    if status.startswith("onnxopt rewrite"):
        rewrite = REWRITES.get(op) if domain == "" else None
        return rewrite.family if rewrite is not None else "rewrite"
    return ""


def render(statuses: dict[tuple[str, str], str], second: dict[tuple[str, str], str]) -> str:
    lines = [row for (domain, op), status in statuses.items()
             for row in [(f"| {op} | {domain or 'ai.onnx'} | {status} | {family(domain, op, status)} | "
                          f"{second.get((domain, op), '')} |")]]
    counts: dict[str, int] = {}
    for status in statuses.values():
        counts[status] = counts.get(status, 0) + 1
    summary = [f"| {status} | {n} |" for status, n in sorted(counts.items())]
    kinds = [f"| {kind} | {n} |" for kind, n in kind_counts(statuses).items()]
    return "\n".join(["| kind | ops |", "|---|---|", *kinds, "", "| status | ops |", "|---|---|", *summary, "",
                      "| op | domain | status | rule family | second order |", "|---|---|---|---|---|", *lines])


def kind_counts(statuses: dict[tuple[str, str], str]) -> dict[str, int]:
    """How many ops have an exact derivative, a zero one, none (of which how many take no float input)."""
    exact = sum(s.split(",")[0] in EXACT for s in statuses.values())
    zero = sum(s.startswith("zero gradient") for s in statuses.values())
    no_float = sum(s == "not differentiable (no float input)" for s in statuses.values())
    return {"exact derivative": exact, "zero gradient (a float input, derivative zero almost everywhere)": zero,
            "not differentiable": len(statuses) - exact - zero,
            "of which no float input (no gradient path)": no_float}


VERBOSE = False
BEGIN, END = "<!-- ops-table: begin -->", "<!-- ops-table: end -->"


def documented() -> str:
    text = DOCS.read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()


@pytest.fixture(scope="module")
def statuses():
    return table()


@pytest.fixture(scope="module")
def seconds(statuses):
    return second_orders(statuses)


def documented_statuses() -> dict[str, str]:
    """op -> status, as docs/ops.md's table says."""
    rows = [line.split("|") for line in documented().splitlines() if line.count("|") == 6]
    return {r[1].strip(): r[3].strip() for r in rows[2:] if r[1].strip() != "op"}


def test_docs_table_is_measured(statuses, seconds):
    """The page is measured with the training build's onnxruntime (1.19.2); with another onnxruntime, whose
    kernels differ (a float64 kernel more, DeformConv), every op documented exact or zero stays so."""
    if TRAINING_BUILD:
        assert render(statuses, seconds) == documented(), "docs/ops.md is stale: run python tests/test_op_coverage.py --write"
        return
    measured = {op: status.split(",")[0] for (_, op), status in statuses.items()}
    for op, status in documented_statuses().items():
        if status.split(",")[0] in (*EXACT, "zero gradient"):
            assert measured[op] == status.split(",")[0], (op, status, measured[op])


@pytest.mark.skipif(runtime_limits()[1] < 23, reason="this onnxruntime loads opset <= 21 (the training build)")
def test_newer_opset_statuses_are_measured():
    """What the training build's table says of the opset 23 ops is what stock onnxruntime measures."""
    newer = [case for case in CASES if case.opset > 21]
    assert sorted(case.op for case in newer) == sorted(NEWER_OPSET)
    for case in newer:
        assert measure(case) == NEWER_OPSET[case.op], case.op


def test_no_failures_and_counts(statuses):
    failing = {k: s for k, s in statuses.items() if s.startswith("fails")}
    assert not failing
    counts = kind_counts(statuses)
    exact, zero = counts["exact derivative"], counts["zero gradient (a float input, derivative zero almost everywhere)"]
    assert exact >= 126 and zero >= 26, (exact, zero)  # NOTE: measured on 2026-11-23; onnx-ad: 113 + 37


def test_every_rewrite_and_gradient_definition_has_a_case():
    """The families' tables (rules, rewrites, gradient definitions) drive the op tests: each rewrite and gradient
    definition the family modules register is measured by a case of ``CASES``, so it is in docs/ops.md."""
    load_rewrites()
    covered = {case.op for case in CASES if case.domain == ""}
    assert sorted((set(REWRITES) | set(GRADIENTS)) - covered) == []
    assert set(RULES) - set(REWRITES) <= {"RNN"}  # NOTE: passes.decompose adds RNN's unrolling at most


RULED = [case for case in CASES if case.op not in ZERO and case.op not in NATURE and case.domain == ""
         and documented_statuses().get(case.op, "").split(",")[0] in EXACT]


def test_gradient_graphs_differentiate_again(seconds):
    """The walk of the rule table: for every op with an exact first-order gradient, that gradient graph's ops
    all have rules (``grad`` applies to it) and its gradient equals central differences, unless the op is listed
    in SECOND_ORDER_EXCEPTIONS with its reason."""
    bad = {op: s for (_, op), s in seconds.items() if s != "exact" and not s.startswith("not checked")
           and not s.startswith("opset 23") and op not in SECOND_ORDER_EXCEPTIONS}
    assert not bad
    listed = {op for (_, op), s in seconds.items() if s != "exact"}
    assert set(SECOND_ORDER_EXCEPTIONS) - listed == set(), "an exception that no longer fails: drop it"


@pytest.mark.parametrize("case", RULED, ids=lambda case: case.op)
def test_float32_gradient_matches_finite_differences(case):
    """Every exact op in float32 too: onnxopt's float32 gradient against float64 finite differences of onnx's
    reference (or, where the reference lacks the op, float32 differences of onnxruntime)."""
    case32 = replace(case, dtype=TensorProto.FLOAT)
    try:
        _check(case32, False)
    except NoForwardKernel as exc:
        pytest.skip(f"onnxruntime has no float32 kernel: {exc}")


def _gradients(case: Case, gradient: str) -> dict:
    rng = np.random.default_rng(0)
    float_np = np.float64 if case.dtype == TensorProto.DOUBLE else np.float32
    feeds = {f"x{i}": _value(v, rng).astype(float_np) for i, v in enumerate(case.inputs) if isinstance(v, str)}
    model = _model(case, feeds, False)
    outputs = _session(model).run(None, feeds)
    grad, _ = gradient_ir(load_model(model), [], list(feeds), gradient=gradient)
    sess = _session(onnx.load_from_string(onnx_ir_to_bytes(grad)))
    cot = {f"y{i}_grad": rng.normal(size=o.shape).astype(o.dtype) for i, o in enumerate(outputs)}
    run_feeds = {**feeds, **{i.name: cot[i.name] for i in sess.get_inputs() if i.name in cot}}
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, run_feeds)))


@pytest.mark.skipif(not TRAINING_BUILD, reason="the training build's gradient builder is the oracle here")
@pytest.mark.parametrize("case", RULED, ids=lambda case: case.op)
def test_rules_match_the_builder(case):
    """Where onnxruntime-training's builder differentiates the op (and has a kernel for its gradient), onnxopt's
    rules give the same gradients on the same model, in float64 and float32 (the builder's float64 ReduceMean
    gradient is off by ~3e-8 relative: 1e-6)."""
    compared = 0
    for dtype, rtol in ((TensorProto.DOUBLE, 1e-6), (TensorProto.FLOAT, 1e-5)):
        typed = replace(case, dtype=dtype)
        try:
            expected = _gradients(typed, "builder")
        except Exception:  # NOTE: no builder gradient, or no kernel for it or for the forward in this type
            continue
        got = _gradients(typed, "onnxopt")
        assert sorted(got) == sorted(expected)
        for name, value in expected.items():
            np.testing.assert_allclose(got[name], value, rtol=rtol, atol=rtol, err_msg=f"{case.op}: {name}")
        compared += 1
    if not compared:
        pytest.skip(f"the builder has no gradient for {case.op} in float32 or float64")


if __name__ == "__main__" and "--write" in sys.argv:
    text = DOCS.read_text()
    measured = table()
    DOCS.write_text(text[:text.index(BEGIN) + len(BEGIN)] + "\n" + render(measured, second_orders(measured)) + "\n" +
                    text[text.index(END):])
elif __name__ == "__main__":
    VERBOSE = True
    for (domain, op), status in table().items():
        print(f"{op:28s} {status}")
