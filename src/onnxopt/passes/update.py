"""Multi-tensor updates: an elementwise update rule applied once to all weights, flattened and concatenated.

``multi_tensor`` builds the update of a step: the weights, gradients and each optimizer state are
flattened and concatenated (``optim.weights``, ``optim.grads``, ``optim.<state>``), the rule runs once on
them (``optim.weights.new``, ``optim.<state>.new``) and ``Split`` + ``Reshape`` give back one tensor per
weight, so the step keeps its per-weight inputs and outputs (``W``, ``W.<state>`` -> ``W.new``, ...).
Adam then costs its ~13 elementwise kernels once instead of once per weight.

``flat_carry`` is the layout the ``Runner`` uses: the concatenated values become inputs and outputs
themselves (the Runner holds each as one buffer and binds the weights as views of it), so the
concatenations and splits of weights and state disappear; only the gradients are concatenated.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common

from onnxopt import graphs
from onnxopt.dsl.core import UpdateRule
from onnxopt.step import NEW

__all__ = ["ELEMENTWISE", "is_elementwise", "multi_tensor", "find_packs", "flat_carry", "name_packs", "PACK_WEIGHTS"]

PACK_WEIGHTS = "optim.weights"
# NOTE: ops whose output element i depends only on element i of its (same-shaped or scalar) inputs: a rule
# made of them gives the same numbers on a concatenation of tensors as on each tensor.
ELEMENTWISE = frozenset({
    "Abs", "Add", "And", "Cast", "CastLike", "Ceil", "Clip", "Constant", "Div", "Equal", "Erf", "Exp", "Floor",
    "Greater", "GreaterOrEqual", "Identity", "IsInf", "IsNaN", "Less", "LessOrEqual", "Log", "Max", "Min", "Mod",
    "Mul", "Neg", "Not", "Or", "Pow", "Reciprocal", "Relu", "Round", "Sigmoid", "Sign", "Sqrt", "Sub", "Tanh",
    "Where", "Xor",
})


def is_elementwise(rule: UpdateRule) -> bool:
    """Whether every node of the rule (and of the functions it calls) is elementwise with scalar constants."""
    functions = graphs._all_functions(rule.fn)
    called = {f.name for f in functions}  # NOTE: calls to the rule's own DSL helpers are checked through them
    for fn in functions:
        for node in fn.to_function_proto().node:
            if node.op_type not in (ELEMENTWISE if node.domain in ("", "ai.onnx") else called):
                return False
            for attr in node.attribute:  # NOTE: a tensor constant has a shape: it would not broadcast alike
                if attr.name == "value" and len(attr.t.dims) > 0 and int(np.prod(attr.t.dims)) != 1:
                    return False
    return True


def _flatten(tape: ir.tape.Tape, values: list[ir.Value], name: str) -> ir.Value:
    minus_one = tape.op("Constant", [], {"value": ir.tensor(np.array([-1], np.int64))})
    flat = [v if v.shape is not None and len(v.shape) == 1 else tape.op("Reshape", [v, minus_one]) for v in values]
    out = tape.op("Concat", flat, {"axis": 0}) if len(flat) > 1 else tape.op("Identity", flat)
    out.name = name
    return out


def _unflatten(tape: ir.tape.Tape, flat: ir.Value, shapes: list[tuple[int, ...]]) -> tuple[list[ir.Value], ir.Node]:
    sizes = tape.op("Constant", [], {"value": ir.tensor(np.array([int(np.prod(s)) for s in shapes], np.int64))})
    if len(shapes) > 1:
        parts = tape.op_multi_out("Split", [flat, sizes], {"axis": 0}, num_outputs=len(shapes),
                                  metadata_props={graphs.REGION: "update"})
    else:
        parts = [tape.op("Identity", [flat])]
    split = parts[0].producer()
    out = []
    for part, shape in zip(parts, shapes):
        if len(shape) != 1:
            part = tape.op("Reshape", [part, tape.op("Constant", [], {"value": ir.tensor(np.array(shape, np.int64))})])
        out.append(part)
    return out, split


def multi_tensor(model: ir.Model, rule: UpdateRule, ws: list[ir.Value], grads: list[ir.Value], lr: ir.Value,
                 t: ir.Value, tape: ir.tape.Tape) -> tuple[list[ir.Value], list[str], list[str], dict, list]:
    """The rule applied once to the concatenation of ``ws``/``grads`` and of each state.

    Returns (outputs, their names, state input names, packs, split nodes): outputs per weight as the
    per-weight loop makes them ([W.new, W.<s>.new, ...] for each W); ``packs`` maps each concatenated
    value's name to the carried names it holds, in order; the split nodes read the flat new values (the
    caller names their inputs ``<pack>.new`` once the graph is final, see ``name_packs``).
    """
    g = model.graph
    shapes = [tuple(int(d) for d in w.shape) for w in ws]
    states = {s: [graphs.new_input(g, f"{w.name}.{s}", like=w) for w in ws] for s in rule.state}
    w_flat = _flatten(tape, ws, PACK_WEIGHTS)
    g_flat = _flatten(tape, grads, "optim.grads")
    s_flat = [_flatten(tape, states[s], f"optim.{s}") for s in rule.state]
    args = [w_flat, g_flat, lr, *s_flat] + ([t] if rule.uses_step else [])
    new_flat = graphs.call(model, rule.fn, args, rule.call_attrs(), "update/optim", 1 + len(rule.state))
    per_tensor, splits = [], []
    for flat in new_flat:
        parts, split = _unflatten(tape, flat, shapes)
        per_tensor.append(parts)
        splits.append(split)
    outputs, out_names = [], []
    for i, w in enumerate(ws):
        outputs += [parts[i] for parts in per_tensor]
        out_names += [w.name + NEW, *(f"{w.name}.{s}{NEW}" for s in rule.state)]
    packs = {PACK_WEIGHTS: [w.name for w in ws], **{f"optim.{s}": [v.name for v in states[s]] for s in rule.state}}
    state_names = [v.name for i in range(len(ws)) for v in (states[s][i] for s in rule.state)]
    return outputs, out_names, state_names, packs, splits


def name_packs(packs: dict[str, list[str]], splits: list[ir.Node]) -> None:
    """Names the flat new values ``<pack>.new`` (after inlining, which replaces the call's outputs)."""
    for name, split in zip(packs, splits):
        split.inputs[0].name = name + NEW


def find_packs(model: ir.Model) -> dict[str, list[str]]:
    """The packs ``multi_tensor`` made: ``optim.*`` values with a ``.new`` value, and the inputs they concatenate."""
    g = model.graph
    values = {v.name: v for node in g for v in node.outputs}
    inputs = {v.name for v in g.inputs}
    packs = {}
    for name, value in values.items():
        node = value.producer()
        if not name.startswith("optim.") or name + NEW not in values or node.op_type not in ("Concat", "Identity"):
            continue
        members = [v.producer().inputs[0] if v.producer() is not None and v.producer().op_type == "Reshape" else v
                   for v in node.inputs]
        if all(m.name in inputs for m in members):
            packs[name] = [m.name for m in members]
    return packs


def flat_carry(model: ir.Model) -> dict[str, list[str]]:
    """Rewrites the step so that each pack is an input ``<pack>`` and an output ``<pack>.new`` in place of its
    members' (the weights stay inputs: the forward pass reads them, the Runner binds them as views of the
    pack). Returns the packs: name -> member names, in order; none for a step without them."""
    packs = find_packs(model)
    g = model.graph
    values = {v.name: v for node in g for v in node.outputs}
    inputs = {v.name: v for v in g.inputs}
    members = {m for names in packs.values() for m in names}
    for name, names in packs.items():
        flat, flat_new = values[name], values[name + NEW]
        flat.name = None
        size = sum(int(np.prod([int(d) for d in inputs[m].shape])) for m in names)
        new_input = ir.Value(name=name, type=flat.type, shape=ir.Shape([size]))
        ir.convenience.replace_all_uses_with(flat, new_input)
        g.inputs.append(new_input)
        g.outputs.append(flat_new)
    kept = [v for v in g.outputs if not (v.name.endswith(NEW) and v.name[: -len(NEW)] in members)]
    g.outputs.clear()
    g.outputs.extend(kept)
    common.RemoveUnusedNodesPass()(model)
    for v in [v for v in g.inputs if v.name in members and not v.uses()]:
        g.inputs.remove(v)
        g.initializers.pop(v.name, None)
    return packs
