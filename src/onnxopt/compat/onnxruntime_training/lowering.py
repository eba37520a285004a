"""onnxruntime-training's artifacts as standard ONNX, so that stock onnxruntime runs them.

Its runtime receives gradients and updates weights *in place*, through kernels that alias an input to an
output (``InPlaceAccumulatorV2``, ``AdamWOptimizer``, ``SGDOptimizerV2``). Here every such write becomes an
ordinary output that the api keeps and feeds back on the next call; the other training kernels
(``ReluGrad``, ``SoftmaxCrossEntropyLossGrad``, ``FusedMatMul``...) are lowered by ``onnxopt.passes.lower``,
and a kernel with no lowering raises ``ModelError`` naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir

from onnxopt.errors import ModelError

MS = "com.microsoft"
NEXT = ".next"  # NOTE: suffix of the output that carries a gradient buffer's new value


def training_graph(proto: onnx.ModelProto, fresh: bool | None = None) -> onnx.ModelProto:
    """The training (or eval) model in standard ONNX: each ``InPlaceAccumulatorV2(buffer, grad, reset)`` becomes
    an output ``<buffer>.next = reset ? grad : buffer + grad`` (its bool flag output is dropped). ``fresh`` True or
    False: the model for that value of ``reset`` (``grad`` or ``buffer + grad``), without the inputs it no longer
    reads: the accumulation costs 2 nodes per parameter, a quarter of a small model's run."""
    from onnxopt.passes.lower import lower_training_ops

    m = ir.from_proto(proto)
    g = m.graph
    unread = set()
    for node in list(g):
        if node.domain != MS or node.op_type != "InPlaceAccumulatorV2":
            continue
        buf, value = node.inputs[0], node.inputs[1]
        reset = node.inputs[2] if len(node.inputs) > 2 else None
        tape = ir.tape.Tape()
        if fresh is None or not fresh:
            acc = tape.op("Add", [buf, value])
        if reset is not None and fresh is None:
            acc = tape.op("Where", [reset, value, acc])
        if fresh:  # NOTE: the gradient is written where the buffer's next value is bound: no node at all
            kept = value.is_graph_input() or value.is_graph_output() or value.is_initializer()
            acc = tape.op("Identity", [value]) if kept else value
            unread |= {buf, reset}
        elif fresh is not None:
            unread.add(reset)
        acc.name, acc.type, acc.shape = buf.name + NEXT, buf.type, buf.shape
        done = tape.op("Constant", [], {"value": ir.tensor(np.array([True]))})
        g.insert_before(node, tape.nodes)
        flag = node.outputs[0]
        if flag in g.outputs:
            g.outputs.remove(flag)
        ir.convenience.replace_all_uses_with(flag, done)
        if len(node.outputs) > 1:
            ir.convenience.replace_all_uses_with(node.outputs[1], acc, replace_graph_outputs=True)
        g.remove(node, safe=True)
        g.outputs.append(acc)
    lower_training_ops(m)
    ir.passes.common.RemoveUnusedNodesPass()(m)
    for v in [v for v in g.inputs if v in unread and not v.uses()]:
        g.inputs.remove(v)
    m.opset_imports.pop(MS, None)
    m.ir_version = min(m.ir_version, 10)
    return ir.to_proto(m)


@dataclasses.dataclass
class OptimizerSpec:
    """What an optimizer model computes: ``kind`` ("AdamW" or "SGD") and its node's attributes."""

    kind: str
    attributes: dict
    clip: float | None = None  # NOTE: InplaceClipGradNorm's max_norm: the gradients are clipped in place first

    @property
    def moments(self) -> int:
        return 2 if self.kind == "AdamW" else 1

    @property
    def updated_moments(self) -> int:
        return 2 if self.kind == "AdamW" else 0


def optimizer_spec(proto: onnx.ModelProto) -> OptimizerSpec:
    """Reads the optimizer node of onnxruntime's optimizer model (one AdamWOptimizer or SGDOptimizerV2)."""
    kinds = {"AdamWOptimizer": "AdamW", "SGDOptimizerV2": "SGD"}
    graph = ir.from_proto(proto).graph
    found = [n for n in graph if n.domain == MS and n.op_type in kinds]
    clips = [n for n in graph if n.domain == MS and n.op_type == "InplaceClipGradNorm"]
    odd = sorted({f"{n.domain}::{n.op_type}" for n in graph if n not in found and n not in clips})
    if len(found) != 1 or odd:
        raise ModelError(f"optimizer model: expected one com.microsoft AdamWOptimizer or SGDOptimizerV2 node, got "
                         f"{len(found)} (other ops: {odd}); these kernels have no lowering to standard ONNX")
    node = found[0]
    clip = float(clips[0].attributes["max_norm"].value) if clips else None
    return OptimizerSpec(kinds[node.op_type], {k: a.value for k, a in node.attributes.items()}, clip)


def _value(name: str, dtype=ir.DataType.FLOAT, shape=(1,)) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(list(shape)))


def _update(tape: ir.tape.Tape, spec: OptimizerSpec, lr: ir.Value, step: ir.Value,
            params: dict[str, tuple[ir.Value, ir.Value]]) -> tuple[list[ir.Value], list[ir.Value]]:
    """Adds to ``tape`` the update of each parameter ``{name: (p, g)}``: the formulas of onnxruntime's CPU kernels
    (AdamW modes 0 = PyTorch and 1 = Hugging Face, with or without bias correction). Returns the moment inputs it
    reads (``<name>.momentum<i>``) and its outputs: per parameter the new ``p`` and AdamW's moments
    (``<name>.next``), and the clipped gradient (``<g>.next``) under ``spec.clip``."""
    f32 = ir.DataType.FLOAT

    def c(x: float) -> ir.Value:
        return tape.op("Constant", [], {"value": ir.tensor(np.array(x, np.float32))})

    inputs, outputs = [], []
    a = spec.attributes
    if spec.kind == "AdamW":
        alpha, beta, eps = float(a.get("alpha", 0.9)), float(a.get("beta", 0.999)), float(a.get("epsilon", 1e-8))
        wd, mode = float(a.get("weight_decay", 0.0)), int(a.get("adam_mode", 0))
        if int(a.get("correct_bias", 1)):
            # NOTE: 1 - alpha^step in double then float, as the kernel's std::pow
            s = tape.op("Cast", [step], {"to": ir.DataType.DOUBLE})
            def corr(base):
                pw = tape.op("Pow", [tape.op("Constant", [], {"value": ir.tensor(np.array(base, np.float64))}), s])
                return tape.op("Cast", [tape.op("Sub", [tape.op("Constant", [], {"value": ir.tensor(np.array(1.0))}),
                                                        pw])], {"to": f32})
            ac, bc = corr(alpha), corr(beta)
        else:
            ac = bc = c(1.0)
        lr_c = tape.op("Mul", [lr, tape.op("Div", [tape.op("Sqrt", [bc]), ac])])
    used = {name: g for name, (_, g) in params.items()}
    if spec.clip is not None:  # NOTE: InplaceClipGradNorm: g *= min(max_norm / (||all g||_2 + 1e-6), 1)
        squares = [tape.op("ReduceSumSquare", [g], {"keepdims": 0}) for g in used.values()]
        total = tape.op("Sqrt", [tape.op("Sum", squares)])
        coef = tape.op("Min", [tape.op("Div", [c(spec.clip), tape.op("Add", [total, c(1e-6)])]), c(1.0)])
        used = {n: tape.op("Mul", [g, coef]) for n, g in used.items()}
    for name, (p0, g0) in params.items():
        p, g = p0, used[name]
        moments = [_value(f"{name}.momentum{i}", shape=p0.shape) for i in range(spec.moments)]
        inputs += moments
        if spec.kind == "SGD":  # NOTE: its moment is never read or written: fed through, not copied
            new = [tape.op("Sub", [p, tape.op("Mul", [lr, g])])]
        else:
            if mode == 0:
                p = tape.op("Sub", [p, tape.op("Mul", [tape.op("Mul", [p, lr]), c(wd)])])
            m1 = tape.op("Add", [tape.op("Mul", [c(alpha), moments[0]]), tape.op("Mul", [c(1 - alpha), g])])
            m2 = tape.op("Add", [tape.op("Mul", [c(beta), moments[1]]),
                                 tape.op("Mul", [tape.op("Mul", [c(1 - beta), g]), g])])
            if mode == 0:
                denom = tape.op("Add", [tape.op("Sqrt", [tape.op("Div", [m2, bc])]), c(eps)])
                p = tape.op("Sub", [p, tape.op("Div", [tape.op("Mul", [lr, m1]), tape.op("Mul", [ac, denom])])])
            elif mode == 1:
                denom = tape.op("Add", [tape.op("Sqrt", [m2]), c(eps)])
                p = tape.op("Sub", [p, tape.op("Div", [tape.op("Mul", [lr_c, m1]), denom])])
                p = tape.op("Sub", [p, tape.op("Mul", [tape.op("Mul", [lr, c(wd)]), p])])
            else:
                raise ModelError(f"optimizer model: AdamWOptimizer adam_mode must be 0 or 1, got {mode}")
            new = [p, m1, m2]
        olds = [p0, *moments][:len(new)]
        if spec.clip is not None:  # NOTE: the clipped gradient, which onnxruntime leaves in the buffer
            new, olds = [*new, g], [*olds, g0]
        for old, out in zip(olds, new):
            out.name, out.type, out.shape = old.name + NEXT, old.type, old.shape
            outputs.append(out)
    return inputs, outputs


def update_model(spec: OptimizerSpec, params: Sequence[tuple[str, np.dtype, tuple]], opset: int = 18
                 ) -> onnx.ModelProto:
    """The optimizer step as a standard ONNX model (``_update``). Inputs: ``learning_rate`` [1], ``step`` [1] (the
    step count after this update, as onnxruntime feeds its kernel), then per parameter ``p``, ``p.grad``, its
    moments."""
    tape = ir.tape.Tape()
    lr, step = _value("learning_rate"), _value("step", ir.DataType.INT64)
    pairs = {name: (_value(name, ir.DataType.from_numpy(np.dtype(dtype)), shape), _value(name + ".grad", shape=shape))
             for name, dtype, shape in params}
    moments, outputs = _update(tape, spec, lr, step, pairs)
    inputs = [lr, step, *(v for pair in pairs.values() for v in pair), *moments]
    graph = ir.Graph(inputs, outputs, nodes=tape.nodes, name="optimizer_step", opset_imports={"": opset})
    return ir.to_proto(ir.Model(graph, ir_version=10, producer_name="onnxopt"))


def fused_model(train: onnx.ModelProto, spec: OptimizerSpec, trained: Sequence[str], buffer: str) -> onnx.ModelProto:
    """The lowered training model (``training_graph``) followed by the update of the ``trained`` parameters from
    their accumulated gradients (``<name><buffer>.next``): one run computes the loss, the gradients and candidate
    new parameters and moments (``_update``'s outputs; inputs ``learning_rate``, ``step`` and the moments added)."""
    m = ir.from_proto(train)
    g = m.graph
    inputs, outputs = {v.name: v for v in g.inputs}, {v.name: v for v in g.outputs}
    tape = ir.tape.Tape()
    lr, step = _value("learning_rate"), _value("step", ir.DataType.INT64)
    moments, new = _update(tape, spec, lr, step, {n: (inputs[n], outputs[n + buffer + NEXT]) for n in trained})
    g.extend(tape.nodes)
    g.inputs.extend([lr, step, *moments])
    g.outputs.extend(new)
    return ir.to_proto(m)
