"""The rewrites and node templates of the op families, registered next to their rules.

Each family module (``elementwise``, ``linalg``, ``conv``, ``norm``, ``reduce``, ``shape``, ``signal``) ends with a
``rewrites`` section that registers, for the ops of its family:

- ``@rewrite(op_type, family=..., check=...)``: a rewrite into standard ops that have rules (and exact builder
  gradients), applied before differentiation by ``passes.decompose`` for both gradient sources.
  ``build(op, node, *inputs)`` returns the replacement value(s) written with onnxscript's ``op``, reading
  attributes from ``node``; ``check(node)`` returns the reason not to rewrite, or None.
- ``template(op_type, nodes, family=...)``: a gradient definition, standard ONNX nodes
  ``(op_type, inputs, outputs[, {attribute: value}])`` over ``I(i)``, ``O(i)``, ``GO(i)`` writing ``GI(i)``,
  given to the training build's builder (``passes.decompose.register_gradients``) and run as a rule
  (``autodiff.templates``).

This module is the tables only: it imports no family (they import it). ``onnxopt.autodiff.load_rewrites()``
imports the family modules once and returns ``REWRITES``; the helpers below are shared by the families' rewrites.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

__all__ = ["Rewrite", "REWRITES", "GRADIENTS", "TEMPLATE_FAMILIES", "rewrite", "template"]


@dataclass(frozen=True)
class Rewrite:
    """A rewrite of ``op_type`` (default domain, a float input) by ``build``, unless ``check(node)`` gives a
    reason; ``outputs``: the output counts it rewrites (one rewrite rule each)."""

    op_type: str
    build: Callable
    check: Callable | None
    family: str
    outputs: tuple[int, ...] = (1,)


REWRITES: dict[str, Rewrite] = {}
GRADIENTS: dict[str, list[tuple]] = {}
TEMPLATE_FAMILIES: dict[str, str] = {}


def rewrite(op_type: str, *, family: str, check: Callable | None = None, outputs: tuple[int, ...] = (1,)):
    """Registers the decorated ``build(op, node, *inputs)`` as the rewrite of ``op_type`` in ``REWRITES``."""
    def register(build):
        REWRITES[op_type] = Rewrite(op_type, build, check, family, tuple(outputs))
        return build
    return register


def template(op_type: str, nodes: list[tuple], *, family: str) -> None:
    """Registers the gradient definition ``nodes`` of ``op_type`` in ``GRADIENTS``."""
    GRADIENTS[op_type] = nodes
    TEMPLATE_FAMILIES[op_type] = family


# ---- helpers of the gradient definitions: (op_type, inputs, outputs[, {attribute: value}]) per node

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


# ---- helpers of the rewrites: build(op, node, *inputs) -> output value(s) of standard ops

def _k(op, value: float, like: ir.Value):
    return op.Constant(value=ir.tensor(np.array(value, dtype=like.dtype.numpy())))


def _f(node: ir.Node, name: str, default: float) -> float:
    return node.attributes.get_float(name, default)


def _rank(node: ir.Node) -> int:
    return len(node.inputs[0].shape)


def _has_rank(node: ir.Node, least: int = 2) -> str | None:
    shape = node.inputs[0].shape
    return None if shape is not None and len(shape) >= least else "the rank of the input is unknown"


def _static(*values: ir.Value) -> bool:
    return all(v.shape is not None and all(isinstance(d, int) for d in v.shape) for v in values)


def _consts(node: ir.Node, *slots: int) -> bool:
    return all(len(node.inputs) <= i or node.inputs[i] is None or node.inputs[i].const_value is not None for i in slots)


def _needs(*slots: int, static: bool = False, reason: str):
    """A check: rewrite only when inputs ``slots`` are constants and (``static``) the first input's shape is static,
    else say ``reason``."""
    def check(node: ir.Node) -> str | None:
        return None if _consts(node, *slots) and (not static or _static(node.inputs[0])) else reason
    return check


def _int_input(node: ir.Node, slot: int, default=None):
    value = node.inputs[slot] if len(node.inputs) > slot else None
    return default if value is None else value.const_value.numpy().reshape(-1).tolist()


def _table(op, values: np.ndarray, like: ir.Value):
    """A constant array in the type of ``like``."""
    return op.Constant(value=ir.tensor(np.asarray(values, dtype=like.dtype.numpy())))
