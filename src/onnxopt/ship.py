"""Shipping a step to runners outside Python (the npm package ``onnxopt`` in ``js/``): one file, read by any
onnxruntime binding.

A file ``TrainStep.save`` writes already holds what such a runner needs: the fused model, the initial weights
(its initializers), and the protocol (``onnxopt.protocol``: each input's role, which output feeds which input).
``for_js`` adds the step's epoch form: the step as the body of an ONNX ``Scan`` over stacked batches
(``passes.epoch``), stored in the metadata under ``EPOCH_KEY`` as JSON ``{"version": 1, "model": <base64 of the
epoch model>, "batch_inputs": [X, target], "carried": [...]}``. Its carried tensors are plain inputs (no
initializers: the runner feeds them), so a runner trains a whole epoch in one session run. A step the Scan
cannot hold (control flow, random ops: ``passes.epoch.scannable``) is returned without one; runners then run
the epoch one step per batch.

``for_js`` also stores, under ``PACKED_KEY``, the step as the Python ``Runner`` runs it on CPU
(``runner.cpu_model``: multi-tensor packs, the loss's per-batch values hoisted into a side model, the target
shaped like the prediction) with every carried tensor of the weights' type in ONE flat input ``carry`` and one
output ``carry.new`` that also holds the loss (``pack_carry``). onnxruntime-node converts each input and output of
a run between JS and native (~2-5 µs each) and copies every output into a new buffer: W1-adam's 22 inputs and 20
outputs become 5 and 1.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as passes

from onnxopt.passes.epoch import epoch_model, scannable
from onnxopt.passes.update import PACK_WEIGHTS
from onnxopt.runner import SMALL_STEP, cpu_model, step_work
from onnxopt.step import NEW, STEP, TrainStep

__all__ = ["EPOCH_KEY", "PACKED_KEY", "for_js", "pack_carry"]

EPOCH_KEY = "onnxopt.epoch"
PACKED_KEY = "onnxopt.packed"
CARRY = "carry"


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _const(tape: ir.tape.Tape, values: list[int]) -> ir.Value:
    return tape.op("Constant", [], {"value": ir.tensor(np.array(values, np.int64))})


def _broadcast_row(node: ir.Node, index: int) -> bool:
    """Whether input ``index`` of ``node``, a row (1, n), gives the same values as a vector (n,)."""
    if node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "Gemm":
        return index == 2
    others = [v for k, v in enumerate(node.inputs) if k != index]
    return node.op_type in ("Add", "Sub", "Mul", "Div") and all(
        v is not None and v.shape is not None and len(v.shape) >= 2 for v in others)


def pack_carry(step: TrainStep, batch_size: int = 32) -> dict | None:
    """``step`` as ``runner.cpu_model`` makes it for ``batch_size`` rows, its carried tensors of the weights' type
    in one input ``carry`` (split and reshaped in the graph) and one output ``carry.new`` (their new values,
    concatenated in the same order, then the loss at ``loss_at``). Returns the ``PACKED_KEY`` entry: the model
    (base64); ``carry``, the logical tensors it holds as ``[name, offset, dims]`` (every weight, buffer and optimizer
    state of that type, packs expanded to their members); ``cpu_model``'s side model, hoisted names and target shape;
    ``counted``: whether the runner advances the step counter (its new value is no output; the counter is then an
    input only where the step reads it). None for a step whose
    carried tensors are not all of static shape (the runner then runs the step as saved)."""
    work = step_work(step)
    cpu = cpu_model(step, batch_size, 1 if work * batch_size < SMALL_STEP else 2)
    model = ir.from_proto(cpu.model)
    g = model.graph
    inputs, outputs = {v.name: v for v in g.inputs}, {v.name: v for v in g.outputs}
    declared = {v.name: [int(d) for d in v.shape] for v in ir.from_proto(step.model).graph.inputs
                if v.shape is not None and all(isinstance(d, int) for d in v.shape)}
    members = {m for names in cpu.packs.values() for m in names}
    dtype = inputs[step.weights[0]].dtype if step.weights[0] in inputs else inputs[PACK_WEIGHTS].dtype
    slots = [n for n in [*cpu.packs, *step.weights, *step.buffers, *step.state]
             if n in inputs and n not in members and inputs[n].dtype == dtype]
    logical = [m for n in slots for m in cpu.packs.get(n, [n])]
    if not slots or any(m not in declared for m in logical) or any(
            inputs[n].shape is None or not all(isinstance(d, int) for d in inputs[n].shape) for n in slots):
        return None
    sizes = [math.prod(int(d) for d in inputs[n].shape) for n in slots]
    # NOTE: the loss rides at the end of carry.new (its slot in carry is unused), and the step counter's new value
    # (steps done + 1) is left to the runner: a run then has one output
    loss = outputs[step.loss] if outputs[step.loss].dtype == dtype else None
    size = sum(sizes) + (loss is not None)
    carry = ir.Value(name=CARRY, type=ir.TensorType(dtype), shape=ir.Shape([size]))
    tape = ir.tape.Tape()

    def split(value: ir.Value, names: list[str], counts: list[int]) -> None:
        parts = tape.op_multi_out("Split", [value, _const(tape, counts)], {"axis": 0}, num_outputs=len(names)) \
            if len(names) > 1 else [value]
        for name, part in zip(names, parts):
            if any(m in inputs for m in cpu.packs.get(name, [])):  # NOTE: the weights the forward pass reads
                split(part, cpu.packs[name], [math.prod(declared[m]) for m in cpu.packs[name]])
            if name in inputs:
                # NOTE: a row (1, n) read only where it broadcasts against rank >= 2 (Gemm's C, an Add of a
                # matrix) stays flat: each Reshape is one more kernel a run launches (~3k instructions of ORT's)
                flat = len(inputs[name].shape) == 1 or inputs[name].shape[0] == 1 and all(
                    _broadcast_row(user, i) for user, i in inputs[name].uses())
                shaped = part if flat else tape.op(
                    "Reshape", [part, _const(tape, [int(d) for d in inputs[name].shape])])
                ir.convenience.replace_all_uses_with(inputs[name], shaped)
                g.inputs.remove(inputs.pop(name))
                g.initializers.pop(name, None)

    split(carry, [*slots, None][:len(slots) + (loss is not None)], [*sizes, 1])
    g.inputs.append(carry)
    g.insert_before(g[0], tape.nodes)
    tape = ir.tape.Tape()
    ends = [outputs[n + NEW] for n in slots] + ([loss] if loss is not None else [])
    flat = [v if len(v.shape or [0, 0]) == 1 else tape.op("Reshape", [v, _const(tape, [-1])]) for v in ends]
    new = tape.op("Concat", flat, {"axis": 0}) if len(flat) > 1 else tape.op("Identity", flat)
    new.name, new.type, new.shape = CARRY + NEW, ir.TensorType(dtype), ir.Shape([size])
    g.extend(tape.nodes)
    counted = STEP in inputs and STEP + NEW in outputs
    for v in [*ends, *([outputs[STEP + NEW]] if counted else [])]:
        if v in g.outputs:
            g.outputs.remove(v)
    g.outputs.append(new)
    if counted:  # NOTE: a counter only the dropped STEP.new read (SGD) is no input: onnxruntime-node converts
        passes.RemoveUnusedNodesPass()(model)  # each input of a run (~2-3 µs); the runner feeds session inputs only
        if not inputs[STEP].uses():
            g.inputs.remove(inputs[STEP])
    layout, offset = [], 0
    for m in logical:
        layout.append([m, offset, declared[m]])
        offset += math.prod(declared[m])

    return {"version": 1, "model": _b64(ir.to_proto(model).SerializeToString()), "carry": layout,
            "side": _b64(cpu.side), "hoisted": cpu.hoisted, "weight_kept": cpu.weight_kept,
            "target_shape": None if cpu.target_shape is None else list(cpu.target_shape), "batch_size": batch_size,
            "loss_at": sum(sizes) if loss is not None else None, "counted": counted}


def for_js(step: TrainStep, batch_size: int = 32) -> TrainStep:
    """A copy of ``step`` whose saved file also holds its epoch form (``EPOCH_KEY``), when it has one, and its
    packed form (``PACKED_KEY``, ``pack_carry``) for batches of about ``batch_size`` rows. Steps with several data
    inputs or compiled with ``external_grad=True`` have no epoch form (the JS runner runs their epochs step by step).
    """
    model = onnx.ModelProto()
    model.CopyFrom(step.model)
    carried = [*step.weights, *step.buffers, *step.state]
    # NOTE: carried tensors are fed by the runner: as initializers too, the Scan's body would shadow its state
    keep = [t for t in model.graph.initializer if t.name not in carried]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    props = [p for p in model.metadata_props if p.key not in (EPOCH_KEY, PACKED_KEY)]
    del model.metadata_props[:]
    model.metadata_props.extend(props)
    batch_inputs = [step.inputs[0], *([step.target] if step.target else [])]
    shipped = dataclasses.replace(step, model=onnx.ModelProto())
    shipped.model.CopyFrom(step.model)
    del shipped.model.metadata_props[:]
    shipped.model.metadata_props.extend(props)
    packed = pack_carry(step, batch_size)
    if packed is not None:
        shipped.model.metadata_props.add(key=PACKED_KEY, value=json.dumps(packed))
    if step.target is None or len(step.inputs) != 1 or not scannable(model):
        return shipped
    epoch = epoch_model(model, batch_inputs, carried, None, step.loss)
    entry = {"version": 1, "model": _b64(epoch.SerializeToString()),
             "batch_inputs": batch_inputs, "carried": carried}
    shipped.model.metadata_props.add(key=EPOCH_KEY, value=json.dumps(entry))
    return shipped
