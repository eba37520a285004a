"""Initializers that no node reads, removed from a model and from each of its subgraphs.

NOTE: onnxruntime 1.32 logs a warning per such initializer when it builds a session ("Removing initializer
'val_29'. It is not used by any node"), and the compiler's folding, lifting and pruning leave some (a removed
node's inputs still count as uses in onnx-ir, and its RemoveUnusedNodesPass looks at the main graph only).
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

__all__ = ["RemoveUnreadInitializersPass", "remove_unread_initializers"]


class RemoveUnreadInitializersPass(ir.passes.InPlacePass):
    """Drops every initializer of the model's graphs that no node in them reads and that is no graph input or
    output; reads are those of the nodes in the graphs now, not onnx-ir's ``uses()``, which can be stale."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graphs, read = [model.graph], set()
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            read.update(node.inputs)
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.GRAPH:
                    graphs.append(attr.as_graph())
                elif attr.type == ir.AttributeType.GRAPHS:
                    graphs.extend(attr.as_graphs())
        removed = 0
        for g in graphs:
            kept = {*g.inputs, *g.outputs}
            for name in [n for n, v in g.initializers.items() if v not in read and v not in kept]:
                g.initializers.pop(name)
                removed += 1
        return ir.passes.PassResult(model, modified=bool(removed))


def remove_unread_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """The proto form of ``RemoveUnreadInitializersPass``, for models built as protos (the epoch model):
    ``model`` itself when nothing is unread, else a copy without those initializers."""
    graphs, read = [model.graph], set()
    while graphs:  # NOTE: a first walk only gathers names: most models have nothing to remove
        g = graphs.pop()
        for node in g.node:
            read.update(node.input)
            for attr in node.attribute:
                graphs += [*attr.graphs, *([attr.g] if attr.HasField("g") else [])]
    if not _unread(model.graph, read):
        return model
    m = ir.from_proto(model)
    RemoveUnreadInitializersPass()(m)
    return ir.to_proto(m)


def _unread(g: onnx.GraphProto, read: set[str]) -> bool:
    kept = read | {v.name for v in [*g.input, *g.output]}
    if any(t.name not in kept for t in g.initializer):
        return True
    return any(_unread(sub, read) for node in g.node for attr in node.attribute
               for sub in [*attr.graphs, *([attr.g] if attr.HasField("g") else [])])
