"""Control flow: If, Loop and Scan differentiated through their bodies, in standard ONNX control flow.

A body's gradient (``body_gradient``) is the body recomputed and differentiated by the engine, as a graph that
reads the outer values by reference: If's gradient is an If on the same condition whose branches are the
branches' gradients; outer values and weights read inside a body get their gradients (``Ctx.captures``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import onnx_ir as ir

from onnxopt.autodiff.engine import rule

F = "control flow"
_fresh = itertools.count()


def _inside(graph: ir.Graph) -> set[ir.Graph]:
    found = {graph}
    for node in graph.all_nodes():
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                found.add(attr.as_graph())
            elif attr.type == ir.AttributeType.GRAPHS:
                found.update(attr.as_graphs())
    return found


def _owner(value: ir.Value) -> ir.Graph | None:
    node = value.producer()
    return node.graph if node is not None else value.graph


def body_gradient(c, body: ir.Graph, wrt: Sequence[ir.Value]) -> tuple[ir.Graph, dict[int, ir.Value]]:
    """The gradient of ``body`` as a graph: inputs ``body``'s (copies) then one seed per body output that can
    carry a gradient ({output index: seed input}), outputs the gradients of ``wrt`` (``body``'s inputs, by
    position, or outer values, read by reference: the result reads them from the enclosing scope)."""
    from onnxopt.autodiff.engine import differentiate

    clone = body.clone(allow_outer_scope_values=True)
    scopes = _inside(clone)
    outer = list(dict.fromkeys([*(v for n in clone.all_nodes() for v in n.inputs
                                  if v is not None and _owner(v) not in scopes),
                                *(v for v in clone.outputs if _owner(v) not in scopes),
                                *(v for v in wrt if v not in body.inputs)]))
    holders = {}
    for v in outer:
        dtype = v.dtype or c._types.get(v.name)
        holder = ir.Value(name=v.name, type=v.type or (ir.TensorType(dtype) if dtype else None), shape=v.shape)
        holders[v] = holder
        for node, idx in list(v.uses()):
            if node.graph in scopes:
                node.replace_input_with(idx, holder)
        clone.outputs[:] = [holder if o is v else o for o in clone.outputs]
    body_inputs = list(clone.inputs)
    clone.inputs.extend(holders.values())
    names = [clone.inputs[list(body.inputs).index(v)].name if v in body.inputs else v.name for v in wrt]
    clone.opset_imports.update(c.opsets)
    model = ir.Model(clone, ir_version=10)
    differentiate(model, [], names)
    g = model.graph
    node = next(n for n in g if n.op_type == "YieldOp")
    skipped = set(node.attributes.get_ints("non_differentiable_outputs", []))
    seeds = {}
    for k, grad in zip([i for i in range(len(node.inputs)) if i not in skipped], list(node.outputs)):
        seed = ir.Value(name=grad.name, type=grad.type, shape=grad.shape)
        ir.convenience.replace_all_uses_with(grad, seed, replace_graph_outputs=True)
        seeds[k] = seed
    g.remove(node, safe=True)
    for v, holder in holders.items():
        ir.convenience.replace_all_uses_with(holder, v, replace_graph_outputs=True)
    g.inputs[:] = [*body_inputs, *seeds.values()]
    prefix = f"_cf{next(_fresh)}_"
    for value in [*g.inputs, *(o for n in g.all_nodes() for o in n.outputs)]:
        value.name = prefix + (value.name or "v")
    for n in g.all_nodes():
        n.name = prefix + (n.name or n.op_type)
    return g, seeds


def _detach(g: ir.Graph, name: str) -> ir.Graph:
    """``g``'s nodes in a new graph named ``name`` (a graph that ``differentiate``'s model held)."""
    nodes, outputs = list(g), list(g.outputs)
    g.outputs.clear()
    for n in reversed(nodes):
        g.remove(n)
    inputs = list(g.inputs)
    g.inputs.clear()
    return ir.Graph(inputs, outputs, nodes=nodes, name=name)


@rule("If", family=F, inputs=())
def _if(c):
    """An If on the same condition whose branches are the gradients of the branches with respect to the outer
    values they read (each branch recomputed: no value crosses from the forward If)."""
    branches = {}
    for attr in ("then_branch", "else_branch"):
        g, seeds = body_gradient(c, c.node.attributes[attr].as_graph(), c.captures)
        for k, seed in seeds.items():
            ir.convenience.replace_all_uses_with(seed, c.go(k))
        g.inputs.clear()
        branches[attr] = ir.AttrGraph(attr, _detach(g, f"{c.node.name or 'If'}_{attr}_grad"))
    outs = c.tape.op_multi_out("If", [c.I(0)], branches, num_outputs=len(c.captures))
    return [None] * len(c.node.inputs) + list(outs)
