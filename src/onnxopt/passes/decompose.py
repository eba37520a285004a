"""The pass that makes ops differentiable before a gradient source runs (onnxopt's rules or the builder).

- The rewrites and gradient definitions live with their op family (``onnxopt.autodiff``: ``elementwise``,
  ``linalg``, ``conv``, ``norm``, ``reduce``, ``shape``, ``signal``, each ending in a ``rewrites`` section;
  ``autodiff.rewrite`` holds the tables). ``RULES`` (op_type -> (build, check)) is
  ``autodiff.rewrite.REWRITES``; ``GRADIENTS`` the gradient definitions (node
  templates over ``I(i)``, ``O(i)``, ``GO(i)``) that ``register_gradients`` gives the builder for
  attribute-free ops it lacks (Asin, Sinh, Softplus, Mish, Mod, Det, ...; Floor, Ceil, Round, Sign, Hardmax,
  random draws get a zero gradient).
- ``decompose`` applies the rewrites to the ops of a model that have one: ops whose gradient depends on
  attributes (Elu, Selu, HardSigmoid, ``Gelu(approximate="tanh")``, ...), variadic and reduction ops (Sum,
  Mean, ReduceMax, ReduceL1, ...), normalizations, layout ops and,
  given constants and static shapes, AffineGrid, Col2Im, GridSample, DFT, STFT, RoiAlign...
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
from onnxscript.rewriter import MatchResult, RewriteRule

from onnxopt import graphs
from onnxopt.autodiff.recurrent import _rebuild
from onnxopt.autodiff import load_rewrites
from onnxopt.autodiff.rewrite import GRADIENTS, REWRITES

__all__ = ["GRADIENTS", "RULES", "decompose", "register_gradients"]

_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)

load_rewrites()  # NOTE: the family modules register their rewrites and gradient definitions


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


# op_type -> (build, check): the rewrites of the op families (check returns the reason not to rewrite, or None)
RULES: dict[str, tuple] = {op_type: (r.build, r.check) for op_type, r in REWRITES.items()}
_OUTPUTS = {op_type: r.outputs for op_type, r in REWRITES.items() if r.outputs != (1,)}


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


_STATIC_BINARY = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Greater": np.greater, "Less": np.less,
                  "Equal": np.equal, "GreaterOrEqual": np.greater_equal, "LessOrEqual": np.less_equal,
                  "And": np.logical_and, "Or": np.logical_or, "Max": np.maximum, "Min": np.minimum}


def _static_dims(node: ir.Node) -> np.ndarray | None:
    """``Gather(Shape(x), k)`` or ``Shape(x)`` as constants when the dimensions read are static sizes of x."""
    shape = node if node.op_type == "Shape" else node.inputs[0].producer()
    if shape is None or shape.op_type != "Shape" or shape.attributes or shape.inputs[0].shape is None:
        return None
    dims = list(shape.inputs[0].shape)
    if node is shape:
        picked = dims
    else:
        k = _static_value(node.inputs[1], 32) if len(node.inputs) > 1 else None
        if k is None or node.attributes.get_int("axis", 0) != 0:
            return None
        picked = [dims[int(i)] for i in k.reshape(-1)]
        if not all(isinstance(d, int) for d in picked):
            return None
        return np.array(picked, np.int64).reshape(k.shape)
    return np.array(picked, np.int64) if all(isinstance(d, int) for d in picked) else None


def _static_value(value: ir.Value | None, depth: int = 0) -> np.ndarray | None:
    """``value`` computed at compile time from constants and ranks (``Size(Shape(x))`` of an x of known
    rank), through a few integer and boolean ops; None when it depends on run-time data."""
    if value is None or depth > 32:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Constant" and "value" in node.attributes:
        return node.attributes["value"].as_tensor().numpy()
    if node.op_type == "Size" and (shape := node.inputs[0].producer()) is not None and shape.op_type == "Shape" \
            and not shape.attributes and shape.inputs[0].shape is not None:
        return np.array(len(shape.inputs[0].shape), np.int64)
    if node.op_type in ("Shape", "Gather") and (dims := _static_dims(node)) is not None:
        return dims
    args = [_static_value(v, depth + 1) for v in node.inputs]
    if any(a is None for a in args):
        return None
    if node.op_type in _STATIC_BINARY and len(args) == 2:
        return _STATIC_BINARY[node.op_type](*args)
    if node.op_type == "Not":
        return np.logical_not(args[0])
    if node.op_type == "Identity":
        return args[0]
    if node.op_type == "Concat" and all(a.ndim == 1 for a in args):
        return np.concatenate(args)
    if node.op_type == "Cast":
        return args[0].astype(ir.DataType(node.attributes.get_int("to")).numpy())
    return None


def _inline_static_ifs(graph: ir.Graph) -> int:
    """Replaces each If whose condition is known at compile time (TorchScript writes ``If(rank > 1)`` for
    ``torch.tile``) by the nodes of the branch it takes: their gradient is then built like any other (an If
    left on a gradient path is refused by name). Returns the count inlined."""
    count = 0
    for node in list(graph):
        if node.op_type != "If" or node.domain not in ("", "ai.onnx"):
            continue
        cond = _static_value(node.inputs[0])
        if cond is None or cond.size != 1:
            continue
        branch = node.attributes["then_branch" if bool(cond.reshape(-1)[0]) else "else_branch"].as_graph()
        if branch.initializers or branch.inputs or len(branch.outputs) != len(node.outputs):
            continue
        outputs = list(branch.outputs)
        branch.outputs.clear()
        inner = list(branch)
        for n in inner:
            branch.remove(n)
        graph.insert_before(node, inner)
        for old, new in zip(node.outputs, outputs):
            if old.is_graph_output() and (new.is_graph_output() or new.is_graph_input() or new.producer() is None):
                new = ir.node("Identity", [new]).outputs[0]
                graph.insert_before(node, new.producer())
            ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
            if new.type is None:
                new.type, new.shape = old.type, old.shape
        graph.remove(node, safe=True)
        count += 1
    return count


def decompose(model: ir.Model, unroll_recurrent: bool = False, gradient: str = "builder") -> ir.Model:
    """Applies ``RULES`` to the ops of ``model`` that have one, completes nodes, names the unnamed nodes whose
    gradient comes from ``GRADIENTS`` (the builder prefixes their gradient nodes by name); returns ``model``.
    RNN/GRU/LSTM nodes are prepared for ``gradient`` by ``autodiff.recurrent.lower_recurrent`` (for the
    builder: split directions, explicit initial states, RNN unrolled, GRU and LSTM too if ``unroll_recurrent``)."""
    from onnxopt.autodiff.recurrent import lower_recurrent

    _inline_static_ifs(model.graph)
    # NOTE: on the model's own Where nodes (typed by shape inference), before the rules add theirs
    _expand_where_branches(model.graph)
    present = {n.op_type for n in model.graph if n.domain in ("", "ai.onnx")}
    if gradient == "onnxopt":  # NOTE: its rule differentiates ConvTranspose faster than the zero-inserting rewrite
        present.discard("ConvTranspose")
    rules = [rule for op in sorted(present & set(_RULE_SET)) for rule in _RULE_SET[op]]
    if rules:
        graphs.rule_set(rules).apply_to_model(model)
    _complete_outputs(model.graph)
    lower_recurrent(model, gradient, unroll_recurrent)
    for i, node in enumerate(model.graph):
        if node.op_type in GRADIENTS and not node.name:
            node.name = f"{node.op_type}_{i}"
    return model
