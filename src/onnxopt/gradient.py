"""Gradient graphs from onnxruntime-training's builder: the only module that touches its private bindings.

``gradient_model`` reproduces onnxcustom's ``onnx_derivative``: ORT's ``OrtModuleGraphBuilder`` (the builder
behind ``TrainingAgent``) returns forward + ``YieldOp`` + backward; the ``YieldOp`` is then rewritten so the
output gradient becomes a graph input (or ones with ``fill_grad``). Swap the builder here and nothing else moves.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as passes

from onnxopt.errors import ModelError, NotDifferentiableError, WeightError
from onnxopt.modelio import ModelLike, check_protobuf_size, load_model, require_training_build
from onnxopt.passes.modes import apply_mode

__all__ = ["train_initializers", "gradient_model", "gradient_ir", "FLOAT_TYPES", "agent_model", "TrainingAgent",
           "GRADIENT_SOURCES", "gradient_source"]

logger = logging.getLogger(__name__)

FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
# Inputs (op_type -> positions) that carry shapes, indices, bounds, statistics, ratios, exponents, thresholds
# or initial states: a float initializer used only there is a constant, not a weight.
_COMPARE = {0, 1}
_NON_WEIGHT_SLOTS = {
    "Reshape": {1}, "Expand": {1}, "Tile": {1}, "Slice": {1, 2, 3, 4}, "Pad": {1, 2, 3}, "Resize": {1, 2, 3},
    "Upsample": {1}, "Clip": {1, 2}, "ConstantOfShape": {0}, "Range": {0, 1, 2}, "OneHot": {1, 2},
    "TopK": {1}, "Squeeze": {1}, "Unsqueeze": {1}, "Gather": {1}, "GatherElements": {1}, "ScatterND": {1},
    "GatherND": {1}, "ScatterElements": {1}, "Shape": {0}, "Size": {0}, "CumSum": {1}, "Trilu": {1},
    "BatchNormalization": {3, 4}, "Dropout": {1, 2}, "Pow": {1}, "Where": {0},
    "Greater": _COMPARE, "Less": _COMPARE, "Equal": _COMPARE, "GreaterOrEqual": _COMPARE, "LessOrEqual": _COMPARE,
    "RNN": {4, 5}, "GRU": {4, 5}, "LSTM": {4, 5, 6},  # NOTE: sequence lengths and initial states (torch: zeros)
}
# NOTE: the dynamo exporter (onnxscript's optimizer) records what it folded an initializer from; one folded
# only from its temporaries (``val_12``) or the graph's values (a shape) is a computed constant (attention
# scale, RNN initial state), and so is one folded through torch's ``cos``/``sin`` (a rotary table);
# one folded from a parameter (``linear1.weight`` transposed) a weight.
_FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"
_TEMPORARY = re.compile(r"val_\d+")
_TRIG = re.compile(r"(cos|sin)(_\d+)?")
# NOTE: the dynamo exporter records what each lifted input of torch.export was: a registered buffer or a
# tensor constant of forward is never trained by torch (only PARAMETER is), whatever op reads it
_INPUT_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
_NOT_PARAMETER = {"BUFFER", "CONSTANT_TENSOR"}
_UNREACHABLE = re.compile(r"partial derivative for '([^']+)' as it's unreachable")
_MISSING = re.compile(r"gradient builder has not been registered:\s*(\S+?)(?: for node (\S*))?\s*$", re.M)


def _is_unit_constant(value: ir.Value, uses: list) -> bool:
    """A one-element ±1 read only as ``1 - x`` or ``x·(±1)``: a converter's complement or negation
    (skl2onnx's ``unity`` and ``negate`` in classifiers), not a weight."""
    array = value.const_value.numpy()
    if array.size != 1 or abs(float(array.reshape(-1)[0])) != 1.0:
        return False
    return all((node.op_type == "Sub" and idx == 0) or node.op_type == "Mul" for node, idx in uses)


def _is_folded_constant(value: ir.Value, computed: set[str]) -> bool:
    sources = value.metadata_props.get(_FOLDED_FROM)
    if not sources:
        return False
    names = [n for n in re.findall(r"'([^']*)'", sources) if not (_TEMPORARY.fullmatch(n) or n in computed)]
    # NOTE: torch's cos/sin in the fold make a table of positions (rotary or sinusoidal, from buffers such as
    # inv_freq), not a copy of parameters (a transpose, GRU's gates reordered)
    return not names or any(_TRIG.fullmatch(n) for n in names)


def _is_weight(value: ir.Value, computed: set[str] = frozenset()) -> bool:
    """A float initializer read as a parameter: not 0-d (exporters' folded scalars: GELU's √2, a scale, a
    beta), not a dynamo-folded constant, not a buffer or tensor constant of a dynamo export, not a ±1 complement, with no infinite or NaN value (an attention mask
    of 0 and -inf both exporters fold from a boolean ``attn_mask``), and read at least once outside the slots
    of ``_NON_WEIGHT_SLOTS``."""
    if value.const_value is None or value.dtype not in FLOAT_TYPES:
        return False
    if value.metadata_props.get(_INPUT_KIND) in _NOT_PARAMETER:
        return False
    uses = list(value.uses())
    if not uses or value.shape is None or value.shape.rank() == 0 or _is_unit_constant(value, uses) \
            or _is_folded_constant(value, computed):
        return False
    if not np.isfinite(value.const_value.numpy()).all():
        return False
    return any(idx not in _NON_WEIGHT_SLOTS.get(node.op_type, ()) for node, idx in uses)


_FEATURE_WISE = {"Sub", "Div", "Mul", "Add"}
# NOTE: Gather and Slice pick columns (a ColumnTransformer's ArrayFeatureExtractor, lowered to Gather)
_PASS_THROUGH = {"Cast", "Identity", "Reshape", "Flatten", "Gather", "Slice"}


def _preprocessing_constants(m: ir.Model) -> set[str]:
    """skl2onnx models: the constants of the feature-wise Sub/Div/Mul/Add applied to the raw inputs before any
    other op (a pipeline's StandardScaler in float64, MinMaxScaler, the mean PCA or PLS subtract), through
    column selections and their Concat (a ColumnTransformer): fitted statistics of a transformer, not
    coefficients of the estimator; and an ensemble's voting weights (``_voting_weights``)."""
    if m.producer_name != "skl2onnx":
        return set()
    features, found = set(m.graph.inputs), set()
    for node in m.graph:  # NOTE: topological order: a feature value's consumers come after it
        inputs = [v for v in node.inputs if v is not None]
        if not any(v in features for v in inputs):
            continue
        consts = [v for v in inputs if v not in features]
        if node.op_type in _PASS_THROUGH and node.inputs[0] in features:
            features.update(node.outputs)
        elif node.op_type == "Concat" and all(v in features for v in inputs):
            features.update(node.outputs)  # NOTE: a ColumnTransformer joins its transformed columns
        elif node.op_type in _FEATURE_WISE and (stats := _statistics(consts)) is not None:
            features.update(node.outputs)
            found.update(s.name for s in stats)
        elif node.op_type == "MatMul" and node.inputs[0] in features and _projection(node.inputs[1]) is not None:
            features.update(node.outputs)  # NOTE: PCA's or TruncatedSVD's components, then what reads them
            found.add(node.inputs[1].name)
    return found | _voting_weights(m)


# NOTE: skl2onnx's VotingRegressor / VotingClassifier converters name each estimator's share (1/n, or its
# normalized ``weights``) w0, w1, ... and multiply the estimator's output by it
_VOTING_WEIGHT = re.compile(r"w\d+(_\d+)?")


def _voting_weights(m: ir.Model) -> set[str]:
    """The one-element initializers named ``w<i>`` read only by Mul: an ensemble's fixed voting weights (a
    hyperparameter of VotingRegressor/VotingClassifier, not a coefficient)."""
    found = set()
    for name, v in m.graph.initializers.items():
        uses = list(v.uses())
        if _VOTING_WEIGHT.fullmatch(name) and v.const_value is not None and v.const_value.size == 1 and uses \
                and all(node.op_type == "Mul" for node, _ in uses):
            found.add(name)
    return found


def _stored_data(m: ir.Model) -> set[str]:
    """skl2onnx models: initializers read only as a Scan's input or looked up by computed indices
    (``ArrayFeatureExtractor``): nearest neighbours' training samples and targets, data rather than parameters."""
    if m.producer_name != "skl2onnx":
        return set()

    def lookup(node: ir.Node, idx: int) -> bool:
        return node.op_type == "Scan" or (node.op_type == "ArrayFeatureExtractor" and idx == 0
                                          and node.inputs[1].const_value is None)

    return {name for name, v in m.graph.initializers.items()
            if v.uses() and all(lookup(node, idx) for node, idx in v.uses())}


def _statistics(consts: list[ir.Value]) -> list[ir.Value] | None:
    """The transformer initializers ``consts`` are (a scaler's row, a decomposition's), or None if one is not."""
    found = [v if v.is_initializer() and _per_feature(v) else _projection(v) for v in consts]
    return None if any(s is None for s in found) else found


def _per_feature(v: ir.Value) -> bool:
    """Whether the constant ``v`` is one value or a row of them, one per feature (a scaler's), not a table
    (GaussianNB's per-class means, which broadcast the features to a class axis)."""
    return v.const_value is not None and sum(d > 1 for d in v.const_value.shape) <= 1 and \
        (v.const_value.size == 1 or v.const_value.shape[-1] > 1)


# NOTE: skl2onnx's decomposition converters (PCA, IncrementalPCA, TruncatedSVD) name their components and
# whitening variances so; a pipeline's estimator comes after them
_DECOMPOSITION = ("transform_matrix", "explained_variance")


def _projection(v: ir.Value) -> ir.Value | None:
    """The decomposition initializer ``v`` is, or is the Sqrt of (PCA's whitening), else None."""
    node = v.producer()
    if node is not None and node.op_type == "Sqrt":
        v = node.inputs[0]
    return v if v.is_initializer() and v.name.rstrip("0123456789") in _DECOMPOSITION else None


def _weight_names(m: ir.Model) -> list[str]:
    computed = {v.name for node in m.graph for v in node.outputs} | {v.name for v in m.graph.inputs}
    tables = _stored_data(m)
    weights = [name for name, v in m.graph.initializers.items() if _is_weight(v, computed) and name not in tables]
    # NOTE: statistics of a transformer only in front of an estimator's coefficients: a model that is nothing
    # but X + c (onnxcustom's tests) trains c
    skip = _preprocessing_constants(m)
    kept = [name for name in weights if name not in skip]
    return kept if kept else weights


def train_initializers(model: ModelLike) -> dict[str, np.ndarray]:
    """Returns the real weights of ``model``: float initializers except those read only as shapes, axes,
    indices, bounds, BatchNormalization statistics, Dropout ratios, Pow exponents, comparison operands or
    RNN initial states, 0-d scalars, the registered buffers and tensor constants a dynamo export marks as such,
    tensors holding an infinite or NaN value (attention masks), constants the
    dynamo exporter folded from its temporaries, one-element ±1 constants read only as ``1 - x`` or ``x·(±1)``,
    and in skl2onnx models the constants of feature-wise Sub/Div/Mul/Add on the raw inputs or columns of them
    (scalers' statistics, a ColumnTransformer's), a decomposition's components (PCA, TruncatedSVD) and an
    ensemble's voting weights when weights follow them; pass
    ``weights=`` to train those (see docs/modes.md).

    >>> from onnxopt.examples import linear_regression
    >>> sorted(train_initializers(linear_regression(3)))
    ['bias', 'coef']
    """
    m = load_model(model)
    return {name: m.graph.initializers[name].const_value.numpy() for name in _weight_names(m)}


def _check_frozen(m: ir.Model, frozen: Sequence[str] | None) -> set[str]:
    frozen = [frozen] if isinstance(frozen, str) else list(frozen or ())
    unknown = [n for n in frozen if n not in m.graph.initializers]
    if unknown:
        raise WeightError(f"frozen: {unknown} are not initializers of the model (expected some of "
                          f"{sorted(m.graph.initializers)[:20]})")
    return set(frozen)


def check_weights(m: ir.Model, weights: Sequence[str] | None, frozen: Sequence[str] | None = None) -> list[str]:
    """Validates ``weights`` against the initializers of ``m`` (None = every real weight not ``frozen``) and
    returns them."""
    inits = m.graph.initializers
    skip = _check_frozen(m, frozen)
    if weights is None:
        found = [n for n in _weight_names(m) if n not in skip]
        if not found and skip:
            raise WeightError(f"frozen: {sorted(skip)} leave no weight to train (expected at least one real "
                              f"weight not frozen, the model has {_weight_names(m)})")
        if not found:
            have = {n: v.dtype.name for n, v in inits.items() if v.dtype is not None}
            tables = sorted(_stored_data(m))
            data = f"; {tables} hold stored data (a Scan's input, rows looked up by computed indices: nearest " \
                   "neighbours keep their training set), not parameters" if tables else ""
            raise WeightError("weights: the model has no float initializer to train (expected at least one float "
                              f"tensor read as a weight, got initializers {have or 'none'}{data})")
        return found
    if isinstance(weights, str):
        weights = [weights]
    if not weights:
        raise WeightError(f"weights: expected at least one initializer name, got {list(weights)!r}")
    out = []
    for name in weights:
        if name not in inits:
            import difflib

            close = difflib.get_close_matches(name, list(inits), n=3)
            hint = f"; did you mean {close}?" if close else f"; initializers are {sorted(inits)[:20]}"
            raise WeightError(f"weights: {name!r} is not an initializer of the model{hint}")
        if inits[name].dtype not in FLOAT_TYPES:
            raise WeightError(
                f"weights: {name!r} is not a float initializer of the model (expected "
                f"{'/'.join(t.name for t in FLOAT_TYPES)}, found {getattr(inits[name].dtype, 'name', None)})"
            )
        out.append(name)
    if len(set(out)) != len(out):
        raise WeightError(f"weights: names repeat in {list(weights)}")
    both = [n for n in out if n in skip]
    if both:
        raise WeightError(f"weights: {both} are also frozen; expected each name in weights= or frozen=, not both")
    return out


def _builder_config(weights: Sequence[str], inputs: Sequence[str], initializers: Sequence[str]):
    from onnxruntime.capi import _pybind_state as C

    cfg = C.OrtModuleGraphBuilderConfiguration()
    cfg.initializer_names = list(initializers)
    cfg.initializer_names_to_train = list(weights)
    cfg.input_names_require_grad = list(inputs)
    cfg.build_gradient_graph = True
    # NOTE: the builder warns about every node that gets no gradient (targets, shapes): expected here.
    cfg.loglevel = C.Severity.ERROR
    return cfg


def _run_builder(proto: onnx.ModelProto, weights: Sequence[str], inputs: Sequence[str]) -> onnx.ModelProto:
    from onnxruntime.capi import _pybind_state as C

    from onnxopt.passes.decompose import register_gradients

    register_gradients(C)  # NOTE: gradient definitions for ops the builder lacks (Asin, Softplus, Floor...)
    builder = C.OrtModuleGraphBuilder()
    builder.initialize(proto.SerializeToString(), _builder_config(weights, inputs, [i.name for i in proto.graph.initializer]))
    builder.build(C.TrainingGraphTransformerConfiguration())
    return onnx.load_from_string(builder.get_gradient_model())


def _cut(m: ir.Model, node_name: str, op_type: str) -> bool:
    """Replaces a node by graph inputs carrying its outputs, so the builder can go on (probing only).

    Each output becomes ``probe + 0·ReduceSum(first float input)``: the gradient path stays connected, so the
    nodes after the cut still need (and are checked for) a gradient builder.
    """
    for node in m.graph:
        if node.op_type == op_type and (node.name == node_name or not node_name):
            _cut_node(m, node)
            return True
    return False


def _cut_node(m: ir.Model, node: ir.Node) -> None:
    floats = [v for v in node.inputs if v is not None and v.dtype in FLOAT_TYPES]
    src = floats[0] if floats else None
    tape = ir.tape.Tape()
    for out in node.outputs:
        linked = src is not None and out.dtype in (None, src.dtype)
        new = ir.Value(name=out.name + "__probe", type=out.type or (src.type if linked else None), shape=out.shape)
        m.graph.inputs.append(new)
        repl = new
        if linked:  # NOTE: every float input of the same type stays connected (a weight read only here too)
            zero = tape.op("Constant", [], {"value": ir.tensor(0.0, dtype=src.dtype)})
            sums = [tape.op("ReduceSum", [v], {"keepdims": 0}) for v in floats if v.dtype == src.dtype]
            total = sums[0]
            for other in sums[1:]:  # NOTE: Add, not Sum: the builder has no gradient for Sum
                total = tape.op("Add", [total, other])
            repl = tape.op("Add", [new, tape.op("Mul", [total, zero])])
            for n in tape.nodes:  # typed, so a later cut can link through this stand-in too
                n.outputs[0].type = src.type
            repl.shape = out.shape
        ir.convenience.replace_all_uses_with(out, repl, replace_graph_outputs=True)
    m.graph.insert_after(node, tape.nodes)
    m.graph.remove(node, safe=True)


def _builds_without(m: ir.Model, cut: Sequence[int], weights: Sequence[str], inputs: Sequence[str]) -> bool:
    """Whether the builder succeeds on a copy of ``m`` whose nodes at positions ``cut`` are cut."""
    probe = ir.from_proto(ir.to_proto(m))
    nodes = list(probe.graph)
    for i in cut:
        _cut_node(probe, nodes[i])
    try:
        _run_builder(ir.to_proto(probe), weights, inputs)
        return True
    except Exception:  # ORT raises RuntimeError/Fail with the C++ message
        return False


def _failing_node(m: ir.Model, weights: Sequence[str], inputs: Sequence[str]) -> ir.Node | None:
    """The node whose cut lets the builder succeed, by bisection (log2(n) builder runs; one culprit assumed)."""
    nodes = list(m.graph)
    candidates = [i for i, n in enumerate(nodes) if n.op_type != "Constant" and n.outputs
                  and all(o.dtype is not None for o in n.outputs)
                  and any(v is not None and v.dtype in FLOAT_TYPES for v in n.inputs)]
    if not candidates or not _builds_without(m, candidates, weights, inputs):
        return None
    while len(candidates) > 1:
        half = candidates[: len(candidates) // 2]
        candidates = half if _builds_without(m, half, weights, inputs) else candidates[len(half):]
    return nodes[candidates[0]] if _builds_without(m, candidates, weights, inputs) else None


def _fix(node: ir.Node, weights: Sequence[str]) -> str:
    """What the user can change for a node the builder fails on."""
    if node.op_type in ("BatchNormalization", "Dropout"):
        return "compile_train_step(mode='train' or 'eval') rewrites this op"
    if node.op_type == "Pad":
        return ("pad with a constant where a gradient flows (torch: padding_mode='zeros', "
                "F.pad(..., mode='constant'))")
    trained = [v.name for v in node.inputs[1:] if v is not None and v.name in weights]
    if trained:
        return (f"if {trained} are not parameters, leave them out with frozen={trained} (or list the weights "
                "with weights=)")
    return ("export the model with another opset (torch.onnx.export(..., opset_version=18)) or rewrite this op "
            "into differentiable ones")


def _missing_gradients(m: ir.Model, weights: Sequence[str], inputs: Sequence[str]) -> list[tuple[str, str]]:
    """Lists (op_type, node name) of every node without a gradient builder, by cutting them one by one."""
    probe = ir.from_proto(ir.to_proto(m))
    missing: list[tuple[str, str]] = []
    for _ in range(len(probe.graph) + 1):
        try:
            _run_builder(ir.to_proto(probe), weights, inputs)
            return missing
        except Exception as exc:  # ORT raises RuntimeError/Fail with the C++ message
            found = _MISSING.search(str(exc))
            if not found or not _cut(probe, found.group(2) or "", found.group(1)):
                return missing
            missing.append((found.group(1), found.group(2) or ""))
    return missing


GRADIENT_SOURCES = ("onnxopt", "builder")


def has_training_build() -> bool:
    import onnxruntime

    return getattr(onnxruntime.capi._pybind_state, "OrtModuleGraphBuilder", None) is not None


def gradient_source(gradient: str | None = None) -> str:
    """The gradient source ``gradient`` names: "onnxopt" (onnxopt's own rules, ``onnxopt.autodiff``: standard
    ONNX on any onnxruntime), "builder" (onnxruntime-training's gradient builder, where it is installed), or
    None/"auto": $ONNXOPT_GRADIENT if set, else "onnxopt" (docs/gradients.md says why)."""
    import os

    if gradient in (None, "auto"):
        gradient = os.environ.get("ONNXOPT_GRADIENT") or "onnxopt"
    if gradient not in GRADIENT_SOURCES:
        raise ValueError(f"gradient: expected one of {list(GRADIENT_SOURCES)} or 'auto', got {gradient!r}")
    if gradient == "builder":
        require_training_build("gradient='builder'")
    return gradient


def build_gradient(m: ir.Model, weights: Sequence[str], inputs: Sequence[str] = (), mode: str | None = None,
                   portable: bool = False, gradient: str | None = None) -> ir.Model:
    """Forward, a ``com.microsoft:YieldOp``, backward, from onnxopt's rules or ORT's builder (``gradient``).
    ``mode`` ("train", "eval", None = each node as written) rewrites Dropout and BatchNormalization;
    ``portable`` unrolls GRU/LSTM first for the builder (its GRUGrad/LSTMGrad are training-build kernels; onnxopt's
    rules write them in standard ONNX)."""
    from onnxopt.rules import lower_for_gradient

    source = gradient_source(gradient)
    if source == "builder":
        check_protobuf_size(m, "onnxruntime-training's gradient builder")
    m = m.clone()  # NOTE: a copy (tensors shared): the caller's model stays as it is; the round trip through a
    # proto made the same copy at twice the cost (~6 ms on R1, ~26 ms on T1)
    # NOTE: BatchNormalization and Dropout as written or as ``mode`` says, running statistics not carried; ORT's
    # builder would swap in a kernel that writes them in place (compile_train_step applies its mode= before)
    apply_mode(m, mode)
    m = lower_for_gradient(m, portable, source)
    if source == "onnxopt":
        from onnxopt.autodiff import differentiate

        # NOTE: an exporter's repeated constants and shape computations merged before the rules and every pass
        # after them walk them (T1: 147 nodes); the builder's forward graph comes back without them too
        passes.CommonSubexpressionEliminationPass()(m)
        return differentiate(m, weights, inputs)
    proto = ir.to_proto(m)
    try:
        return ir.from_proto(_run_builder(proto, weights, inputs))
    except Exception as exc:
        missing = _missing_gradients(m, weights, inputs)
        if missing:
            listed = ", ".join(f"{op} (node {name!r})" for op, name in missing)
            raise NotDifferentiableError(
                f"model: onnxruntime-training has no gradient for {len(missing)} node(s): {listed}; "
                "expected ops with a gradient builder (rewrite these ops or register a gradient definition)",
                missing,
            ) from exc
        unreachable = _UNREACHABLE.search(str(exc))
        if unreachable and unreachable.group(1) in m.graph.initializers:
            name = unreachable.group(1)
            readers = [f"{n.op_type} node {n.name!r}" for n, _ in m.graph.initializers[name].uses()]
            where = f"read only by {readers}" if readers else "it does not reach the output"
            raise WeightError(f"weights: {name!r} gets no gradient ({where}); expected a parameter: leave it "
                              f"out with frozen=[{name!r}] or weights=") from exc
        node = _failing_node(m, weights, inputs)
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        reason = re.sub(r"^\S+\.cc:\d+ (.*?\) (const )?)?", "", reason)[:300]  # NOTE: ORT's C++ location
        if node is None:
            raise ModelError(f"model: onnxruntime-training could not build the gradient graph: {exc}") from exc
        raise ModelError(f"model: onnxruntime-training could not differentiate {node.op_type} node {node.name!r} "
                         f"(inputs {[v.name if v is not None else '' for v in node.inputs]}): {reason}; expected a "
                         f"node the builder differentiates: {_fix(node, weights)}") from exc


def _lower_unsized_pool_grads(m: ir.Model, dtype: ir.DataType | None = None) -> None:
    """Lowers the kernels that fail at run time (``passes.lower.broken_kernels(dtype)``), and every MaxPoolGrad
    when one has an output shape not static beyond the batch axis: its CPU kernel sizes the gradient from the
    graph's static shape (0 for an unknown dimension) and then writes out of bounds (a crash, or corrupted
    memory)."""
    from onnxopt.passes.lower import broken_kernels, lower_training_ops

    lower_training_ops(m, broken_kernels(dtype))

    def unsized(node: ir.Node) -> bool:
        shape = node.outputs[0].shape
        return shape is None or not all(isinstance(d, int) for d in list(shape)[1:])

    if any(n.op_type == "MaxPoolGrad" and n.domain in ("", "ai.onnx") and unsized(n) for n in m.graph):
        lower_training_ops(m, {("", "MaxPoolGrad")})


def _yield_rewrite(g: ir.Graph, keep_outputs: bool, fill_grad: bool) -> list[ir.Value]:
    """Removes the YieldOp: its outputs (output gradients) become inputs or ones; returns the forward outputs."""
    yields = [n for n in g if n.op_type == "YieldOp"]
    if len(yields) != 1:
        raise ModelError(f"gradient graph: expected one YieldOp, found {len(yields)}")
    node = yields[0]
    forward_outputs = list(node.inputs)
    grads = list(node.outputs)
    skipped = node.attributes.get("non_differentiable_outputs")
    skipped = set(skipped.as_ints()) if skipped is not None else set()
    differentiable = [v for i, v in enumerate(forward_outputs) if i not in skipped]
    # NOTE: detach first so the YieldOp can be removed before its outputs get new producers.
    replacements = []
    for fwd, grad in zip(differentiable, grads):
        if fill_grad:
            tape = ir.tape.Tape()
            one = tape.op("Constant", [], {"value": ir.tensor(np.array(1, dtype=np.int64))})
            cast = tape.op("CastLike", [one, fwd])
            new = tape.op("Expand", [cast, tape.op("Shape", [fwd])])
            for n in tape.nodes:
                n.metadata_props["onnxopt.region"] = "backward"
            g.insert_before(node, tape.nodes)
        else:
            new = ir.Value(name=grad.name + "__in", type=grad.type or fwd.type, shape=grad.shape or fwd.shape)
            g.inputs.append(new)
        replacements.append((grad, new))
    for grad, new in replacements:
        name = grad.name
        ir.convenience.replace_all_uses_with(grad, new, replace_graph_outputs=True)
        new.name = name
    g.remove(node, safe=True)
    if keep_outputs:
        g.outputs.extend(v for v in forward_outputs if v not in g.outputs)
    return forward_outputs


def _restore_constants(g: ir.Graph, original: ir.Graph, weights: Sequence[str]) -> None:
    """The builder turns every initializer into an input: put the non-trained ones back as initializers."""
    keep = set(weights)
    for value in list(g.inputs):
        if value.name in original.initializers and value.name not in keep:
            g.inputs.remove(value)
            value.const_value = original.initializers[value.name].const_value
            g.register_initializer(value)


def _tag_regions(g: ir.Graph) -> None:
    """Marks each node ``onnxopt.region`` = forward (before the YieldOp) or backward (after it)."""
    region = "forward"
    for node in g:
        if node.op_type == "YieldOp":
            region = "backward"
        node.metadata_props.setdefault("onnxopt.region", region)


def _declare_static_dims(g: ir.Graph, original: ir.Graph) -> None:
    """Each input and output of the gradient graph (``<output>_grad``, ``<weight>_grad``, ``<input>_grad``, kept
    outputs) declares every static dim the model declares on the value it mirrors.

    NOTE: onnxopt's rules and the builder infer some of these as unknown (``[N, ?]`` for a ``[N, 10]``
    output); a caller feeding a random input of the declared shape then fed the wrong one."""
    declared = {v.name: v for v in [*original.inputs, *original.outputs, *original.initializers.values()]
                if v.shape is not None}
    for v in [*g.inputs, *g.outputs]:
        mirrored = declared.get(v.name[:-len("_grad")] if v.name.endswith("_grad") else v.name)
        if mirrored is None:
            continue
        model = mirrored.shape
        v.type = v.type or mirrored.type  # NOTE: the builder leaves kept outputs untyped
        if v.shape is None or len(v.shape) != len(model):
            v.shape = ir.Shape(list(model))
        elif any(isinstance(d, int) and not isinstance(h, int) for d, h in zip(model, v.shape)):
            v.shape = ir.Shape([d if isinstance(d, int) else h for d, h in zip(model, v.shape)])


def gradient_ir(
    m: ir.Model,
    weights: Sequence[str],
    inputs: Sequence[str] = (),
    keep_outputs: bool = False,
    fill_grad: bool = False,
    mode: str | None = None,
    portable: bool = False,
    gradient: str | None = None,
) -> tuple[ir.Model, list[ir.Value]]:
    """The gradient graph of ``m`` as an ``ir.Model``, plus its forward-output values (see ``gradient_model``;
    ``portable``: see ``build_gradient``)."""
    unknown = [i for i in inputs if i not in {v.name for v in m.graph.inputs}]
    if unknown:
        names = [v.name for v in m.graph.inputs]
        raise ModelError(f"inputs: {unknown} are not inputs of the model (expected some of {names})")
    grad = build_gradient(m, weights, inputs, mode, portable, gradient)
    _lower_unsized_pool_grads(grad, m.graph.initializers[weights[0]].dtype if weights else None)
    _tag_regions(grad.graph)
    forward = _yield_rewrite(grad.graph, keep_outputs, fill_grad)
    _restore_constants(grad.graph, m.graph, weights)
    grad.graph.name = m.graph.name or "gradient"
    grad.opset_imports.clear()
    grad.opset_imports.update(m.opset_imports)
    grad.opset_imports["com.microsoft"] = 1
    grad.ir_version = m.ir_version
    passes.RemoveUnusedNodesPass()(grad)
    _declare_static_dims(grad.graph, m.graph)
    return grad, forward


def gradient_model(
    model: ModelLike,
    weights: Sequence[str] | None = None,
    inputs: Sequence[str] | None = None,
    keep_outputs: bool = False,
    fill_grad: bool = False,
    mode: str | None = None,
    gradient: str | None = None,
) -> onnx.ModelProto:
    """Builds the backward graph of ``model`` with onnxruntime-training (onnxcustom's ``onnx_derivative``).

    Args:
        model: the ONNX model, a proto or a path.
        weights: initializers to differentiate (become inputs); None = every real weight.
        inputs: model inputs whose gradient is wanted too (outputs ``<input>_grad``).
        keep_outputs: also return the forward outputs.
        fill_grad: the output gradient is ones instead of an input ``<output>_grad``.
        mode: "train" (Dropout active, BatchNormalization with batch statistics) or "eval" (Dropout the
            identity, BatchNormalization with the model's statistics), as ``compile_train_step``'s; None = each
            node as its ``training_mode`` says. Running statistics are not updated.
        gradient: "onnxopt" (its own rules), "builder" (onnxruntime-training) or "auto" (``gradient_source``).

    Returns:
        A model with inputs (model inputs, weights, ``<output>_grad`` unless filled) and outputs
        (``<input>_grad``..., ``<weight>_grad``..., forward outputs when kept).
    """
    m = load_model(model)
    names = check_weights(m, weights)
    grad, _ = gradient_ir(m, names, list(inputs or ()), keep_outputs, fill_grad, mode, gradient=gradient)
    return ir.to_proto(grad)


def agent_model(m: ir.Model, weights: Sequence[str], inputs: Sequence[str] = (), mode: str | None = None
                ) -> tuple[onnx.ModelProto, list[int]]:
    """The builder's graph as ``TrainingAgent`` runs it, YieldOp kept, plus the indices of the outputs that
    take no gradient (integer labels...). Inputs: model inputs then ``weights``; outputs: ``<name>_grad``."""
    require_training_build("ForwardBackward (onnxruntime-training's TrainingAgent)")
    grad = build_gradient(m, weights, inputs, mode, gradient="builder")
    _lower_unsized_pool_grads(grad, m.graph.initializers[weights[0]].dtype if weights else None)
    _restore_constants(grad.graph, m.graph, weights)
    grad.ir_version = 10
    # NOTE: the builder orders its inputs its own way (a Gemm's bias before its weight): put them, and the
    # gradients, in the documented order, or each weight would be fed to another's input
    feeds = [*(v.name for v in m.graph.inputs if v.name not in m.graph.initializers), *weights]
    for values, names in ((grad.graph.inputs, feeds), (grad.graph.outputs, [f"{n}_grad" for n in [*inputs, *weights]])):
        by_name = {v.name: v for v in values}
        values[:] = [by_name[n] for n in names if n in by_name] + [v for v in values if v.name not in names]
    node = next(n for n in grad.graph if n.op_type == "YieldOp")
    attr = node.attributes.get("non_differentiable_outputs")
    return ir.to_proto(grad), list(attr.as_ints()) if attr is not None else []


class TrainingAgent:
    """onnxruntime-training's ``TrainingAgent`` over ``agent_model``: ``forward`` runs up to the YieldOp and
    returns a ``PartialGraphExecutionState``; ``backward`` resumes that state from the output gradients, so
    several forwards may wait for their backwards. Values go in as OrtValues, NumPy arrays (no copy on CPU)
    or DLPack producers (``__dlpack__``, no copy), and come out as OrtValues (``.numpy()``,
    ``.to_dlpack()``)."""

    def __init__(self, model: onnx.ModelProto, n_outputs: int, device: str = "cpu", session_options=None):
        import onnxruntime as ort
        from onnxruntime.capi import _pybind_state as C

        self._C = C
        providers = ["CUDAExecutionProvider"] if device == "cuda" else []
        providers.append("CPUExecutionProvider")
        if session_options is None:
            session_options = ort.SessionOptions()
            session_options.log_severity_level = 3
        self.session = ort.InferenceSession(model.SerializeToString(), session_options, providers=providers)
        kind = C.OrtDevice.cuda() if device == "cuda" else C.OrtDevice.cpu()
        self.device = C.OrtDevice(kind, C.OrtDevice.default_memory(), 0)
        feeds = [v.name for v in model.graph.input]
        fetches = [v.name for v in model.graph.output]
        self._agent = C.TrainingAgent(self.session._sess, feeds, [self.device] * n_outputs, fetches,
                                      [self.device] * len(fetches), 0)
        self._cache = C.OrtValueCache()

    def ortvalue(self, value):
        """An OrtValue over ``value``'s memory: NumPy arrays are wrapped (keep them alive), DLPack producers
        hand their buffer over."""
        C = self._C
        if isinstance(value, C.OrtValue):
            return value
        if isinstance(value, np.ndarray):
            return C.OrtValue.ortvalue_from_numpy(value, self.device)
        # NOTE: from_dlpack on the object itself crashes in 1.19.2; the capsule is the supported form.
        return C.OrtValue.from_dlpack(value.__dlpack__(), False)

    def _vector(self, values):
        vec = self._C.OrtValueVector()
        vec.reserve(len(values))
        for value in values:
            vec.push_back(self.ortvalue(value))
        return vec

    def forward(self, values) -> tuple[list, object]:
        """Runs the forward part on ``values`` (model inputs, then weights): (outputs, state for backward)."""
        outputs, state = self._C.OrtValueVector(), self._C.PartialGraphExecutionState()
        self._agent.run_forward(self._vector(values), outputs, state, self._cache)
        return list(outputs), state

    def backward(self, grads, state) -> list:
        """Resumes ``state`` with the output gradients; returns the gradients in the graph's output order."""
        outputs = self._C.OrtValueVector()
        self._agent.run_backward(self._vector(grads), outputs, state)
        return list(outputs)


def split_models(m: ir.Model, weights: Sequence[str], inputs: Sequence[str] = (), mode: str | None = None
                 ) -> tuple[onnx.ModelProto, onnx.ModelProto, int, list[int]]:
    """onnxopt's gradient graph cut at its YieldOp into two standard models, as ``TrainingAgent`` cuts the
    builder's: forward (model inputs, weights -> outputs, then the forward values the backward reads) and
    backward (those values, model inputs, weights, output gradients -> ``<input>_grad``..., ``<weight>_grad``...).
    Returns (forward, backward, number of outputs, indices of the outputs without a gradient)."""
    from onnxopt.autodiff.engine import _reads

    proto = ir.to_proto(build_gradient(m, weights, inputs, mode, gradient="onnxopt"))
    fwd, bwd = ir.from_proto(proto), ir.from_proto(proto)

    def cut(model: ir.Model) -> tuple[ir.Node, list[ir.Node], list[ir.Node]]:
        nodes = list(model.graph)
        k = next(i for i, n in enumerate(nodes) if n.op_type == "YieldOp")
        return nodes[k], nodes[:k], nodes[k + 1:]

    node, before, after = cut(fwd)
    outputs = list(node.inputs)
    produced = {o for n in before for o in n.outputs}
    # NOTE: with the outer values the backward's subgraphs read (control flow's gradients)
    read = list(dict.fromkeys(v for n in after for v in _reads(n) if v in produced))
    for n in reversed([node, *after]):
        fwd.graph.remove(n, safe=False)
    fwd.graph.outputs.clear()
    fwd.graph.outputs.extend([*outputs, *(v for v in read if v not in outputs)])
    # NOTE: the values the cut turns into outputs and inputs need their types: inferred on the forward model
    fwd = ir.from_proto(onnx.shape_inference.infer_shapes(ir.to_proto(fwd), strict_mode=False))
    types = {v.name: v.type for v in fwd.graph.outputs}
    attr = node.attributes.get("non_differentiable_outputs")
    no_grad = list(attr.as_ints()) if attr is not None else []

    node, before, _ = cut(bwd)
    names = {v.name for v in read}
    for value in [o for n in before for o in n.outputs if o.name in names] + list(node.outputs):
        new = ir.Value(name=value.name, type=value.type or types.get(value.name), shape=value.shape)
        ir.convenience.replace_all_uses_with(value, new, replace_graph_outputs=True)
        value.name = None
        bwd.graph.inputs.append(new)
    for n in reversed([*before, node]):
        bwd.graph.remove(n, safe=False)
    passes.RemoveUnusedNodesPass()(bwd)
    for model in (fwd, bwd):
        model.opset_imports.pop("com.microsoft", None)
        model.ir_version = m.ir_version
    return ir.to_proto(fwd), ir.to_proto(bwd), len(outputs), no_grad


_ORT_TYPES = {f"tensor({name})": getattr(onnx.TensorProto, name.upper()) for name in
              ("float", "double", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool")}


class SplitAgent:
    """``TrainingAgent``'s interface over two sessions of stock onnxruntime (``split_models``): ``forward``
    returns the outputs and keeps the forward values the backward reads; ``backward`` runs from them. Values
    go in as OrtValues, NumPy arrays (no copy) or DLPack producers (read through NumPy, no copy on CPU), in
    the order of ``feeds`` (the forward model's inputs by default)."""

    def __init__(self, forward: onnx.ModelProto, backward: onnx.ModelProto, n_outputs: int, device: str = "cpu",
                 feeds: Sequence[str] | None = None):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        providers = (["CUDAExecutionProvider"] if device == "cuda" else []) + ["CPUExecutionProvider"]
        self._fwd = ort.InferenceSession(forward.SerializeToString(), opts, providers=providers,
                                         disabled_optimizers=["EliminateDropout"])  # NOTE: runner.KEEP_DROPOUT
        # NOTE: a value ONNX inference left untyped, which the cut made an input: the type onnxruntime gave it
        typed = {o.name: o.type for o in self._fwd.get_outputs()}
        for value in backward.graph.input:
            if not value.type.tensor_type.elem_type and typed.get(value.name) in _ORT_TYPES:
                value.type.tensor_type.elem_type = _ORT_TYPES[typed[value.name]]
        self._bwd = ort.InferenceSession(backward.SerializeToString(), opts, providers=providers)
        self._feeds = list(feeds) if feeds is not None else [i.name for i in self._fwd.get_inputs()]
        self._outs = [o.name for o in self._fwd.get_outputs()]
        self._bwd_inputs = [i.name for i in self._bwd.get_inputs()]
        self._fetch = [o.name for o in self._bwd.get_outputs()]
        self._n, self._ort = n_outputs, ort

    def ortvalue(self, value):
        if isinstance(value, self._ort.OrtValue):
            return value
        if not isinstance(value, np.ndarray):
            value = np.from_dlpack(value)
        return self._ort.OrtValue.ortvalue_from_numpy(value)

    def forward(self, values) -> tuple[list, object]:
        feeds = dict(zip(self._feeds, (self.ortvalue(v) for v in values)))
        outs = self._fwd.run_with_ort_values(self._outs, feeds)
        return list(outs[: self._n]), {**feeds, **dict(zip(self._outs, outs))}

    def backward(self, grads, state) -> list:
        """``grads``: the gradients of the differentiable outputs, fed to the inputs ``state`` does not hold."""
        missing = [n for n in self._bwd_inputs if n not in state]
        feeds = {n: state[n] for n in self._bwd_inputs if n in state}
        feeds.update(zip(missing, (self.ortvalue(g) for g in grads)))
        return list(self._bwd.run_with_ort_values(self._fetch, feeds))
