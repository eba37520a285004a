"""Transposes of matrix products moved into the product, on the finished step.

Where a forward op transposes an operand of a MatMul (attention's ``Q·Kᵀ``), the reverse pass transposes the
product the MatMul rule wrote back: ``Transpose(Aᵀ·dY)``, a copy of the tensor (T1: two of 32k floats a
layer, ~0.2 ms each). ``(A·B)ᵀ = Bᵀ·Aᵀ``: the swap of the last two axes moves onto the operands, through a
Mul by one value (attention's scale), where it cancels a Transpose already there or onnxruntime folds it into
the product (FusedMatMul's transA/transB).

Written with onnx_ir directly: onnxscript's rewriter costs ~5 ms a step graph even where nothing matches.
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["transposes_into_products"]


def _swap(rank: int) -> list[int]:
    return [*range(rank - 2), rank - 1, rank - 2]


def _swaps(node: ir.Node | None) -> bool:
    """Whether ``node`` is a Transpose of the last two axes."""
    if node is None or node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return False
    perm = node.attributes.get_ints("perm", None)
    return perm is not None and len(perm) >= 2 and list(perm) == _swap(len(perm))


def _read_once(value: ir.Value) -> bool:
    return len(value.uses()) == 1 and not value.is_graph_output()


def _one_value(value: ir.Value, rank: int) -> bool:
    return value.shape is not None and len(value.shape) <= rank and all(d == 1 for d in value.shape)


def _product(value: ir.Value, rank: int) -> tuple[ir.Node, ir.Node | None] | None:
    """(the MatMul, the Mul by one value or None) that make ``value``, read once each, else None."""
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx") or not _read_once(value):
        return None
    if node.op_type == "MatMul":
        return node, None
    if node.op_type != "Mul":
        return None
    for k in (0, 1):
        inner, other = node.inputs[k], node.inputs[1 - k]
        matmul = inner.producer() if inner is not None else None
        if matmul is not None and matmul.op_type == "MatMul" and matmul.domain in ("", "ai.onnx") \
                and _read_once(inner) and other is not None and _one_value(other, rank):
            return matmul, node
    return None


def _transposed(tape: ir.tape.Tape, value: ir.Value, meta: dict) -> ir.Value:
    """``value`` with its last two axes swapped: the input of a Transpose that swapped them, else a Transpose."""
    node = value.producer()
    if _swaps(node):
        return node.inputs[0]
    return tape.op("Transpose", [value], {"perm": ir.AttrInt64s("perm", _swap(len(value.shape)))},
                   metadata_props=dict(meta))


def transposes_into_products(model: ir.Model) -> int:
    """Rewrites ``Transpose(A·B [·s])`` (last two axes, A and B of known ranks >= 2, each value read once) as
    ``(Bᵀ·Aᵀ) [·s]`` in place; returns how many."""
    graph, count = model.graph, 0
    for node in list(graph):
        if not _swaps(node):
            continue
        found = _product(node.inputs[0], len(node.attributes.get_ints("perm")))
        if found is None:
            continue
        matmul, mul = found
        a, b = matmul.inputs
        if a.shape is None or b.shape is None or min(len(a.shape), len(b.shape)) < 2:
            continue
        tape, meta = ir.tape.Tape(), dict(node.metadata_props)  # NOTE: the region (backward, ...) it stood in
        out = tape.op("MatMul", [_transposed(tape, b, meta), _transposed(tape, a, meta)], metadata_props=dict(meta))
        if mul is not None:
            out = tape.op("Mul", [out if v is matmul.outputs[0] else v for v in mul.inputs], metadata_props=dict(meta))
        old = node.outputs[0]
        out.name, out.type, out.shape = (old.name if old.is_graph_output() else None), old.type, old.shape
        graph.insert_before(node, tape.nodes)
        ir.convenience.replace_all_uses_with(old, out, replace_graph_outputs=True)
        graph.remove([n for n in (node, mul, matmul) if n is not None], safe=True)
        graph.remove([v.producer() for v in {a, b} if _swaps(v.producer()) and not v.uses()
                      and not v.is_graph_output()], safe=True)  # NOTE: the Transposes that cancelled
        count += 1
    return count
