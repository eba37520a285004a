"""Graph surgery shared by the passes, all through onnx_ir: calling DSL functions, inlining, splicing graphs."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import onnx_ir as ir
import onnx_ir.passes.common as common
import onnxscript

from onnxopt.errors import DslError

__all__ = ["REGION", "add_functions", "call", "splice", "new_input", "tag", "infer_shapes", "rule_set"]

REGION = "onnxopt.region"


# NOTE: ``Value.meta`` key: ONNX's inference (``infer_shapes``: strict, with data propagation) left this value
# without a type or a shape; ``autodiff.engine`` skips its own whole-model inference when only such values lack one
UNINFERRED = "onnxopt.uninferred"


class _Quiet(logging.Filter):
    failed = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("Shape inference failed"):
            self.failed = True
            return False
        return True


_INFERENCE_LOG = logging.getLogger(common.ShapeInferencePass.__module__)


class _Rooted:
    """A rewrite rule tried only on nodes of the op type its pattern ends with: onnxscript's rule set tries every
    rule on every node, and a try costs its matcher's setup even where the op type already rules it out (~0.01 ms;
    ~3,000 tries per R1 step for ~150 that can match)."""

    def __init__(self, rule, op_type: str):
        self._rule, self._op_type = rule, op_type

    def try_rewrite(self, model, graph_or_function, node, **kwargs):
        if node.op_type != self._op_type:
            return None
        return self._rule.try_rewrite(model, graph_or_function, node, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._rule, name)


def _root_op(rule) -> str | None:
    """The op type the pattern of ``rule`` ends with when onnxscript matches a node against it alone first (a
    single output node, the default matcher), else None."""
    from onnxscript.rewriter import _matcher, _pattern_ir

    try:
        pattern = rule._target_pattern
        if not isinstance(rule._matcher, _matcher.SimplePatternMatcher) or len(pattern.output_nodes) != 1:
            return None
        op = pattern.output_nodes[0].op
        return op.value() if isinstance(op, _pattern_ir.StringConstantPattern) else None
    except AttributeError:  # NOTE: another onnxscript: every rule tried on every node, as before
        return None


def rule_set(rules: Sequence) -> onnxscript.rewriter.RewriteRuleSet:
    """``RewriteRuleSet(rules)`` whose rules are tried only on nodes of their pattern's last op type (the same
    matches: onnxscript's matcher fails any other node on its op type)."""
    from onnxscript.rewriter import RewriteRuleSet

    wrapped = []
    for rule in rules:
        if isinstance(rule, _Rooted):
            wrapped.append(rule)
            continue
        op = _root_op(rule)
        wrapped.append(rule if op is None else _Rooted(rule, op))
    return RewriteRuleSet(wrapped)


def infer_shapes(model: ir.Model) -> None:
    """onnx_ir's ShapeInferencePass on ``model`` in place. A model onnx cannot infer (a converter's declared
    shape that contradicts its graph) stays as it is, as with the pass, but without the warning and
    traceback the pass logs: the passes that read shapes work with what they find."""
    quiet = _Quiet()
    _INFERENCE_LOG.addFilter(quiet)
    try:
        common.ShapeInferencePass()(model)
    finally:
        _INFERENCE_LOG.removeFilter(quiet)
    if not quiet.failed:
        for value in [*model.graph.inputs, *(o for node in model.graph for o in node.outputs)]:
            if value.name and (value.dtype is None or value.shape is None):  # NOTE: an unnamed output, not inferred
                value.meta[UNINFERRED] = True


def _all_functions(fn: onnxscript.OnnxFunction) -> list[onnxscript.OnnxFunction]:
    found = {fn.name: fn}
    todo = [fn]
    while todo:
        for name, sub in todo.pop().function_ir.get_called_functions().items():
            if name not in found:
                found[name] = sub
                todo.append(sub)
    return list(found.values())


def add_functions(model: ir.Model, fn: onnxscript.OnnxFunction) -> None:
    """Adds ``fn`` and the functions it calls to ``model``, at the model's default-domain opset."""
    for sub in _all_functions(fn):
        f = ir.serde.deserialize_function(sub.to_function_proto())
        # NOTE: DSL functions are written at opset 18; the ops they use mean the same up to 21.
        f.opset_imports[""] = model.opset_imports.get("", f.opset_imports.get("", 18))
        known = model.functions.get(f.identifier())
        if known is not None:
            if known.name == f.name and ir.to_proto(known) != ir.to_proto(f):
                raise DslError(f"{f.name}: two different DSL functions share this name; rename one")
            continue
        model.functions[f.identifier()] = f


def call(
    model: ir.Model,
    fn: onnxscript.OnnxFunction,
    inputs: Sequence[ir.Value | None],
    attrs: Mapping[str, Any],
    name: str,
    num_outputs: int = 1,
    region: str | None = None,
) -> list[ir.Value]:
    """Appends a node calling the DSL function ``fn`` to the main graph; returns its outputs.

    The inliner copies the call's metadata to the nodes it inlines, so ``region`` tags them all.
    """
    add_functions(model, fn)
    fdomain = fn.function_ir.domain
    model.opset_imports.setdefault(fdomain, 1)
    known = fn.function_ir.attributes
    attributes = []
    for key, value in attrs.items():
        # NOTE: the attribute type comes from the function's declaration, so 1 and 1.0 both work for a float.
        decl = known.get(key) if hasattr(known, "get") else None
        kind = getattr(decl, "type", None)
        if kind == ir.AttributeType.FLOAT or (kind is None and isinstance(value, float)):
            attributes.append(ir.AttrFloat32(key, float(value)))
        else:
            attributes.append(ir.AttrInt64(key, int(value)))
    node = ir.Node(fdomain, fn.name, inputs=list(inputs), attributes=attributes, num_outputs=num_outputs, name=name,
                   metadata_props={REGION: region or name.split("/")[0]})
    model.graph.append(node)
    return list(node.outputs)


def tag(graph: ir.Graph, region: str) -> None:
    """Gives every node without a region the region ``region`` (forward, loss, backward, penalty, update...)."""
    for node in graph:
        node.metadata_props.setdefault(REGION, region)


def new_input(graph: ir.Graph, name: str, like: ir.Value | None = None, dtype: ir.DataType | None = None,
              shape: Sequence[Any] | None = None) -> ir.Value:
    """Adds a graph input named ``name`` with the type/shape of ``like`` or the given dtype/shape."""
    if name in {v.name for v in graph.inputs} or name in graph.initializers:
        raise DslError(f"input name {name!r} is already used by the model; rename that model input")
    value = ir.Value(
        name=name,
        type=ir.TensorType(dtype) if dtype is not None else like.type,
        shape=ir.Shape(shape) if shape is not None else (like.shape if like is not None else None),
    )
    graph.inputs.append(value)
    return value


def rows(y: ir.Value) -> str:
    """The name of ``y``'s rows for the inputs of a loss on prediction ``y`` (sample weights, class indices):
    an exporter's name such as torch.export's "batch", so that passes matching row counts by name
    (``passes.batch.row_sum_updates``) see the same rows; "N" when they have none."""
    first = y.shape[0] if y.shape is not None and len(y.shape) else None
    return first.value if isinstance(first, ir.SymbolicDim) and first.value else "N"


def splice(graph: ir.Graph, sub: ir.Graph, inputs: Mapping[str, ir.Value], region: str,
           prefix: str | None = None) -> dict[str, ir.Value]:
    """Moves every node of ``sub`` into ``graph``: sub inputs are replaced by ``inputs[name]``.

    Node and value names get the prefix ``prefix/`` (default ``region/``) so they stay unique: splicing the
    same kind of graph twice needs distinct prefixes. Returns sub's outputs by their original names, now
    produced inside ``graph``.
    """
    prefix = region if prefix is None else prefix
    outputs = {v.name: v for v in sub.outputs}
    sub.outputs.clear()
    for value in list(sub.inputs):
        if value.name in inputs:
            ir.convenience.replace_all_uses_with(value, inputs[value.name])
    for name, value in list(sub.initializers.items()):
        sub.initializers.pop(name)
        value.name = f"{prefix}/{name}"
        graph.register_initializer(value)
    nodes = list(sub)
    sub.remove(nodes)
    for node in nodes:
        node.name = f"{prefix}/{node.name}"
        node.metadata_props[REGION] = region
        for out in node.outputs:
            if out.name:
                out.name = f"{prefix}/{out.name}"
    graph.extend(nodes)
    return outputs
