"""Tied parameters: initializers an exporter wrote twice for one torch parameter train as one.

torch.onnx folds ``Transpose(weight)`` into a second initializer where a tied weight is also read transposed
(GPT-2's token embedding is its output layer too: a Gather's table, and ``wte^T`` for the MatMul). This pass:

- finds each float initializer B whose values are exactly those of another, A, or of ``A^T`` (not all equal,
  so zeros and ones are never tied), A first in the model; or B named as folded from A in the dynamo export's
  metadata (``pkg.onnxscript.optimizer.folded_from``), checked the same way;
- replaces B by ``Transpose(A)`` (or by A) and drops B: A's gradient sums both readers', an update moves both,
  and the trained model stays tied (one tensor and a Transpose node);
- then finds each float initializer B left whose every value is an element of one other, A, whose values are all
  distinct: a part or a rearrangement of a parameter the exporter folded (``W[:4]``, ``W[:4].T``,
  ``p.repeat_interleave(3)``, ``p.expand(...)``), replaced by ``Reshape(Gather(Reshape(A, [-1]), index))``. B
  must hold a value no constant table holds (not a multiple of 1/1024), so a 0/1 mask or a position table is
  never taken for a part of a parameter that happens to hold those values.
``compile_train_step(tie=False)`` and ``ForwardBackward(tie=False)`` keep the copies apart.
"""

from __future__ import annotations

import ast
import logging
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

__all__ = ["tie_parameters", "retarget", "FOLDED_FROM"]

FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"
logger = logging.getLogger(__name__)
_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _link(a: np.ndarray, b: np.ndarray) -> list[int] | None | bool:
    """How ``b`` is made from ``a``: None (a copy), a Transpose ``perm``, or False (it is not)."""
    if a.dtype != b.dtype or a.size != b.size:
        return False
    if a.shape == b.shape and np.array_equal(a, b):
        return None
    if a.ndim == 2 and a.T.shape == b.shape and np.array_equal(a.T, b):
        return [1, 0]
    return False


def _ties(g: ir.Graph) -> dict[str, tuple[str, list[int] | None]]:
    """{B: (A, perm or None)} for every duplicated float initializer B of ``g`` (see the module docstring)."""
    inputs = {v.name for v in g.inputs}
    arrays = {}
    for name, v in g.initializers.items():
        if v.dtype in _FLOATS and v.const_value is not None and name not in inputs:
            a = v.const_value.numpy()
            if a.size > 1 and not np.all(a == a.flat[0]):
                arrays[name] = a
    ties: dict[str, tuple[str, list[int] | None]] = {}
    for name, a in arrays.items():  # NOTE: the exporter's record first, whichever initializer comes first
        source = g.initializers[name].metadata_props.get(FOLDED_FROM)
        sources = ast.literal_eval(source) if source else []
        if len(sources) == 1 and sources[0] in arrays and sources[0] != name:
            perm = _link(arrays[sources[0]], a)
            if perm is not False:
                ties[name] = (sources[0], perm)
    seen: dict[tuple, str] = {}
    for name, a in arrays.items():
        if name in ties:
            continue
        hit = next((seen[k] for k in map(_key, [a] + ([a.T] if a.ndim == 2 else [])) if k in seen), None)
        perm = _link(arrays[hit], a) if hit is not None else False
        if perm is not False:
            ties[name] = (hit, perm)
        else:
            seen.setdefault(_key(a), name)
    for name, (kept, perm) in ties.items():  # NOTE: a record's source may itself be a copy: tie to the root
        while kept in ties:
            kept, outer = ties[kept]
            perm = None if (perm is None) == (outer is None) else [1, 0]
        ties[name] = (kept, perm)
    return ties


_GATHER_LIMIT = 1 << 24  # NOTE: the search reads every float initializer once: skipped on larger models


def _gathers(arrays: dict[str, np.ndarray], done: set[str]) -> dict[str, tuple[str, np.ndarray]]:
    """{B: (A, flat indices into A)} for the initializers B (not in ``done``) made of elements of another A."""
    if sum(a.size for a in arrays.values()) > _GATHER_LIMIT:
        return {}

    def table_like(a: np.ndarray) -> bool:
        scaled = a.astype(np.float64) * 1024
        return bool(np.all(scaled == np.round(scaled)))

    wanted = {n: a for n, a in arrays.items() if n not in done and not table_like(a)}
    if not wanted:
        return {}
    firsts = {n: a.flat[0] for n, a in wanted.items()}
    out: dict[str, tuple[str, np.ndarray]] = {}
    sources: set[str] = set()
    for name_a, a in arrays.items():  # NOTE: the first of two rearrangements of each other is kept
        if name_a in out:
            continue
        flat = a.ravel()
        hits = [n for n, v in firsts.items() if n != name_a and n not in out and n not in sources
                and a.dtype == wanted[n].dtype and np.any(flat == v)]
        if not hits:
            continue
        order = np.argsort(flat, kind="stable")
        ordered = flat[order]
        if np.any(ordered[1:] == ordered[:-1]):  # NOTE: a repeated value: which element a copy reads is unknown
            continue
        for name_b in hits:
            b = wanted[name_b].ravel()
            pos = np.clip(np.searchsorted(ordered, b), 0, len(ordered) - 1)
            if np.array_equal(ordered[pos], b):
                out[name_b] = (name_a, order[pos].reshape(wanted[name_b].shape))
                sources.add(name_a)
    return out


def _key(a: np.ndarray) -> tuple:
    return a.dtype.str, a.shape, hash(np.ascontiguousarray(a).tobytes())


def tie_parameters(m: ir.Model, tie: bool = True) -> dict[str, str]:
    """Ties the duplicated initializers of ``m`` in place; returns {dropped copy: the initializer kept}."""
    if not tie:
        return {}
    g = m.graph
    ties = _ties(g)
    nodes = []
    arrays = {n: v.const_value.numpy() for n, v in g.initializers.items()
              if v.dtype in _FLOATS and v.const_value is not None and v.const_value.size > 1
              and n not in {i.name for i in g.inputs}}
    arrays = {n: a for n, a in arrays.items() if not np.all(a == a.flat[0])}
    gathers = _gathers({n: a for n, a in arrays.items() if n not in ties}, set())
    for copy, (kept, index) in gathers.items():
        old, source = g.initializers.pop(copy), g.initializers[kept]
        flat = ir.node("Reshape", [source, ir.Value(name=f"tie/{copy}/flat", const_value=ir.tensor(
            np.array([-1], np.int64)))], name=f"tie/{copy}/flat")
        taken = ir.node("Gather", [flat.outputs[0], ir.Value(name=f"tie/{copy}/index", const_value=ir.tensor(
            index.astype(np.int64)))], {"axis": 0}, name=f"tie/{copy}")
        for node in (flat, taken):
            for v in node.inputs[1:]:
                v.type, v.shape = ir.TensorType(ir.DataType.INT64), ir.Shape(v.const_value.shape)
                g.register_initializer(v)
        new = taken.outputs[0]
        new.type, new.shape = old.type, old.shape
        nodes += [flat, taken]
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        new.name = copy
        logger.info("tied %r to elements of %r", copy, kept)
    for copy, (kept, perm) in ties.items():
        old, new = g.initializers.pop(copy), g.initializers[kept]
        if perm is not None:
            node = ir.node("Transpose", [new], {"perm": perm}, name=f"tie/{copy}")
            new = node.outputs[0]
            new.type, new.shape = old.type, old.shape
            nodes.append(node)
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        logger.info("tied %r to %r (%s)", copy, kept, "transposed" if perm else "equal")
        if perm is not None:  # NOTE: old keeps its name: its tensor may be the caller's TensorProto
            new.name = copy
    if nodes:
        first = next(iter(g), None)
        g.insert_before(first, nodes) if first is not None else g.extend(nodes)
    return {**{copy: kept for copy, (kept, _) in ties.items()}, **{copy: kept for copy, (kept, _) in gathers.items()}}


def retarget(names: Sequence[str] | str | None, ties: dict[str, str]) -> list[str] | None:
    """``names`` (weights=, frozen=) with each dropped copy replaced by the initializer it is tied to."""
    if names is None:
        return None
    out: list[str] = []
    for name in [names] if isinstance(names, str) else names:
        if ties.get(name, name) not in out:
            out.append(ties.get(name, name))
    return out
