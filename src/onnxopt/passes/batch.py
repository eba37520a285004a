"""The Runner's CPU model specialized for how it feeds a batch (``runner.cpu_model``), bit for bit the same:

- ``hoist``: values computed from one input alone (the sample weights' ``w / Σw``) become inputs, which the
  Runner computes once per batch length when no sample weights are given;
- ``shaped_target``: the target is fed shaped like the prediction, so ``Reshape(target, Shape(y))`` goes;
- ``drop_same_shape_reshapes``: ``Reshape(x, Shape(y))`` where shape inference proves ``x`` has ``y``'s shape.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common

__all__ = ["hoist", "shaped_target", "drop_same_shape_reshapes"]


# NOTE: a value computed once must be the same at every step
_RANDOM = frozenset({"Bernoulli", "Dropout", "Multinomial", "RandomNormalLike", "RandomUniformLike"})


def _is_constant(value: ir.Value) -> bool:
    return value.const_value is not None and not value.is_graph_input()


def hoist(model: ir.Model, name: str) -> tuple[onnx.ModelProto, list[str]] | None:
    """Makes the values computed from input ``name`` and constants alone inputs of ``model`` (in place); returns
    the side model computing them from ``name`` and [name] if ``name`` stays an input ([] if not), or None."""
    g = model.graph
    source = next(v for v in g.inputs if v.name == name)
    pure, nodes = {source}, set()
    for node in g:  # NOTE: topologically sorted: a node's inputs are classified before it
        ins = [v for v in node.inputs if v is not None]
        if ins and any(v in pure for v in ins) and all(v in pure or _is_constant(v) for v in ins) \
                and node.op_type not in _RANDOM and not any(
                    a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            nodes.add(node)
            pure.update(node.outputs)
    frontier = [v for v in pure - {source} if v.is_graph_output() or any(u.node not in nodes for u in v.uses())]
    if not frontier or any(v.type is None or not v.name or v.is_graph_output() for v in frontier):
        return None
    side = ir.from_proto(ir.to_proto(model))
    values = {v.name: v for node in side.graph for v in node.outputs}
    side.graph.outputs.clear()
    side.graph.outputs.extend(values[v.name] for v in frontier)
    side_source = next(v for v in side.graph.inputs if v.name == name)
    side.graph.inputs.clear()
    side.graph.inputs.append(side_source)
    common.RemoveUnusedNodesPass()(side)
    for init in [n for n in side.graph.initializers if not side.graph.initializers[n].uses()]:
        side.graph.initializers.pop(init)
    for value in frontier:
        new = ir.Value(name=value.name, type=value.type, shape=value.shape)
        value.name = None
        ir.convenience.replace_all_uses_with(value, new, replace_graph_outputs=True)
        g.inputs.append(new)
    common.RemoveUnusedNodesPass()(model)
    kept = [name] if source.uses() else []
    if not kept:
        g.inputs.remove(source)
    return ir.to_proto(side), kept


def shaped_target(model: ir.Model, name: str, batch: str) -> tuple[int, ...] | None:
    """Gives input ``name`` the prediction's shape where its only use is ``Reshape(name, Shape(y))`` and
    ``y`` has shape (``batch``, static dims...): the reshape goes. Returns the static dims, or None (unchanged)."""
    g = model.graph
    target = next(v for v in g.inputs if v.name == name)
    uses = list(target.uses())
    if len(uses) != 1 or uses[0].node.op_type != "Reshape" or uses[0].idx != 0:
        return None
    reshape = uses[0].node
    shape_of = reshape.inputs[1].producer()
    if shape_of is None or shape_of.op_type != "Shape" or shape_of.attributes \
            or reshape.attributes.get_int("allowzero", 0):
        return None
    y = shape_of.inputs[0]
    dims = list(y.shape) if y.shape is not None else []
    if not dims or not isinstance(dims[0], ir.SymbolicDim) or dims[0].value != batch \
            or not all(isinstance(d, int) for d in dims[1:]) or y.dtype != target.dtype:
        return None
    shaped = ir.Value(name=name, type=target.type, shape=ir.Shape(dims))
    ir.convenience.replace_all_uses_with(reshape.outputs[0], shaped, replace_graph_outputs=True)
    g.inputs[g.inputs.index(target)] = shaped
    common.RemoveUnusedNodesPass()(model)
    return tuple(dims[1:])


def drop_same_shape_reshapes(model: ir.Model) -> int:
    """Removes each ``Reshape(x, Shape(y))`` where ONNX shape inference gives ``x`` and ``y`` the same fully
    known shape (symbolic dimensions included); returns how many."""
    common.ShapeInferencePass()(model)
    dropped = 0
    for node in list(model.graph):
        shape_of = node.inputs[1].producer() if node.op_type == "Reshape" else None
        if shape_of is None or shape_of.op_type != "Shape" or shape_of.attributes:
            continue
        x, y = node.inputs[0], shape_of.inputs[0]
        if node.outputs[0].is_graph_output() or x.shape is None or y.shape is None or x.shape != y.shape or any(
                not isinstance(d, int) and (d.value is None) for d in x.shape):
            continue
        ir.convenience.replace_all_uses_with(node.outputs[0], x, replace_graph_outputs=False)
        dropped += 1
    common.RemoveUnusedNodesPass()(model)
    return dropped
