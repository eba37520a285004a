"""``onnxruntime.training.artifacts`` on onnxopt: the training, eval and optimizer models and the checkpoint.

The files follow onnxruntime-training's conventions, so its own runtimes (Python, C, C++, C#, Java, mobile)
load and train them unchanged, and ``onnxopt.compat.onnxruntime_training.api`` trains them on stock
onnxruntime:

- ``training_model.onnx``: inputs = the model's inputs, the labels (``target``, or ``labels`` for
  CrossEntropyLoss), the parameters, ``<param>_grad.accumulation.buffer`` for each trained parameter and
  ``lazy_reset_grad`` (bool[1]); outputs = ``loss``, the additional outputs, ``<param>_grad.accumulation.out``.
  The gradient comes from onnxopt's own rules in standard ONNX; only the accumulation is onnxruntime's
  ``com.microsoft:InPlaceAccumulatorV2``, the kernel through which its runtime receives the gradient in place.
- ``eval_model.onnx``: the model's inputs, the labels and the parameters -> ``loss`` (and additional outputs).
- ``optimizer_model.onnx``: one ``com.microsoft:AdamWOptimizer`` or ``SGDOptimizerV2`` node over sequences of
  tensors (``learning_rate``, ``step``, ``params``, ``gradients``, ``first_order_moments``,
  ``second_order_moments``), as onnxruntime's: its runtime updates the parameters in place through it.
- ``checkpoint``: onnxruntime's flatbuffers checkpoint (``checkpoint_fbs``).

Models are written at IR version 10 or lower, which onnxruntime-training 1.19 loads.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from onnxopt.compat.onnxruntime_training import checkpoint_fbs
from onnxopt.errors import ModelError

__all__ = ["LossType", "OptimType", "generate_artifacts", "MAX_IR_VERSION"]

MAX_IR_VERSION = 10  # NOTE: onnxruntime(-training) 1.19 refuses IR 11+ ("max supported IR version: 10")
MS = "com.microsoft"


class LossType(enum.Enum):
    """The losses ``generate_artifacts`` appends to the model (each the mean over every element)."""

    MSELoss = 1
    CrossEntropyLoss = 2
    BCEWithLogitsLoss = 3
    L1Loss = 4


class OptimType(enum.Enum):
    """The optimizers of the optimizer model (onnxruntime's kernels, its default hyper-parameters)."""

    AdamW = 1
    SGD = 2


def _const(tape: ir.tape.Tape, value: float, like_dtype: ir.DataType) -> ir.Value:
    return tape.op("Constant", [], {"value": ir.tensor(np.array(value, like_dtype.numpy()))})


def append_loss(m: ir.Model, loss: LossType, outputs: Sequence[str]) -> None:
    """Appends ``loss`` over the graph outputs named ``outputs`` (one) in place: a labels input, a ``loss``
    output first, the other outputs after it."""
    g = m.graph
    by_name = {v.name: v for v in g.outputs}
    if len(outputs) != 1 or outputs[0] not in by_name:
        raise ModelError(f"loss_input_names: expected one output of the model among {list(by_name)}, got "
                         f"{list(outputs)}")
    pred = by_name[outputs[0]]
    dtype = pred.dtype or ir.DataType.FLOAT
    tape = ir.tape.Tape()
    if loss == LossType.CrossEntropyLoss:
        labels = ir.Value(name="labels", type=ir.TensorType(ir.DataType.INT64),
                          shape=ir.Shape(list(pred.shape)[:-1]) if pred.shape is not None else None)
        out = tape.op("SoftmaxCrossEntropyLoss", [pred, labels], {"reduction": "mean"})
    else:
        labels = ir.Value(name="target", type=ir.TensorType(dtype), shape=pred.shape)
        if loss == LossType.MSELoss:
            diff = tape.op("Sub", [pred, labels])
            out = tape.op("ReduceMean", [tape.op("Mul", [diff, diff])], {"keepdims": 0})
        elif loss == LossType.L1Loss:
            out = tape.op("ReduceMean", [tape.op("Abs", [tape.op("Sub", [pred, labels])])], {"keepdims": 0})
        elif loss == LossType.BCEWithLogitsLoss:
            # NOTE: onnxruntime's formula, -(t log s + (1 - t) log(1 - s)) with s = sigmoid(x), for equal losses
            s = tape.op("Sigmoid", [pred])
            one = _const(tape, 1.0, dtype)
            pos = tape.op("Mul", [labels, tape.op("Log", [s])])
            neg = tape.op("Mul", [tape.op("Sub", [one, labels]), tape.op("Log", [tape.op("Sub", [one, s])])])
            out = tape.op("ReduceMean", [tape.op("Neg", [tape.op("Add", [pos, neg])])], {"keepdims": 0})
        else:
            raise ModelError(f"loss: expected a LossType or an onnxblock block, got {loss!r}")
    for node in tape.nodes:
        g.append(node)
    g.inputs.append(labels)
    out.name = "loss"
    out.type, out.shape = ir.TensorType(dtype), ir.Shape([])
    rest = [v for v in g.outputs if v is not pred]
    g.outputs.clear()
    g.outputs.extend([out, *rest])


def _as_inputs(g: ir.Graph, names: Sequence[str]) -> None:
    """Turns the initializers ``names`` into graph inputs (the runtime feeds them from the checkpoint)."""
    for name in names:
        if name in g.initializers:
            value = g.initializers.pop(name)
            value.const_value = None
            g.inputs.append(value)


def _finish(m: ir.Model) -> onnx.ModelProto:
    m.ir_version = min(m.ir_version or MAX_IR_VERSION, MAX_IR_VERSION)
    return ir.to_proto(m)


def training_model(loss_model: ir.Model, requires_grad: Sequence[str], frozen: Sequence[str],
                   additional: Sequence[str]) -> onnx.ModelProto:
    """The training model of a model whose first output is its loss (see the module docstring).
    ``requires_grad`` may name graph inputs too (their gradient is accumulated the same way)."""
    from onnxopt.gradient import gradient_ir

    g0 = loss_model.graph
    user = [v.name for v in g0.inputs]
    loss_name = g0.outputs[0].name
    weights = [n for n in requires_grad if n in g0.initializers]
    wrt_inputs = [n for n in requires_grad if n not in g0.initializers]
    if requires_grad:
        grad, _ = gradient_ir(loss_model, weights, wrt_inputs, keep_outputs=True, fill_grad=True, gradient="onnxopt")
    else:  # NOTE: nothing to train: the forward model with the runtime's inputs
        grad = loss_model.clone()
    g = grad.graph
    _as_inputs(g, frozen)
    by_name = {v.name: v for v in [*g.inputs, *g.outputs]}
    reset = ir.Value(name="lazy_reset_grad", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([1]))
    buffers, flags = [], []
    for p in requires_grad:
        buf = ir.Value(name=f"{p}_grad.accumulation.buffer", type=by_name[p].type, shape=by_name[p].shape)
        node = ir.node("InPlaceAccumulatorV2", [buf, by_name[f"{p}_grad"], reset], domain=MS)
        node.outputs[0].name = f"{p}_grad.accumulation.out"
        node.outputs[0].type, node.outputs[0].shape = ir.TensorType(ir.DataType.BOOL), ir.Shape([1])
        g.append(node)
        buffers.append(buf)
        flags.append(node.outputs[0])
    params = [by_name[p] for p in [*weights, *frozen]]
    ins = [by_name[n] for n in user] + params + buffers + [reset]
    outs = [by_name[loss_name], *(by_name[n] for n in additional)] + flags
    g.inputs.clear()
    g.inputs.extend(ins)
    g.outputs.clear()
    g.outputs.extend(outs)
    grad.opset_imports[MS] = 1
    ir.passes.common.RemoveUnusedNodesPass()(grad)
    return _finish(grad)


def eval_model(loss_model: ir.Model, params: Sequence[str]) -> onnx.ModelProto:
    """The loss model with the parameters as inputs, Dropout and BatchNormalization in inference mode (as
    onnxruntime's eval model: Dropout without its training_mode input, BatchNormalization training_mode=0)."""
    m = loss_model.clone()
    _as_inputs(m.graph, params)
    for node in m.graph:
        if node.op_type == "Dropout" and node.domain in ("", "ai.onnx") and len(node.inputs) > 2:
            node.replace_input_with(2, None)
        elif node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") and "training_mode" in node.attributes:
            node.attributes["training_mode"] = ir.AttrInt64("training_mode", 0)
    return _finish(m)


ADAMW_DEFAULTS = {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-6, "weight_decay": 0.0, "adam_mode": 1,
                  "correct_bias": 1}


def optimizer_model(optimizer: OptimType, opset: int, **attributes) -> onnx.ModelProto:
    """The optimizer model as onnxruntime writes it: one node over sequences of tensors, updated in place."""
    seq = ir.SequenceType(ir.TensorType(ir.DataType.FLOAT))
    lr = ir.Value(name="learning_rate", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1]))
    step = ir.Value(name="step", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([1]))
    names = ["params", "gradients", "first_order_moments"]
    if optimizer == OptimType.AdamW:
        names.append("second_order_moments")
    seqs = [ir.Value(name=n, type=seq) for n in names]
    if optimizer == OptimType.AdamW:
        attrs = {**ADAMW_DEFAULTS, **attributes}
        attrs = {k: float(v) if k in ("alpha", "beta", "epsilon", "weight_decay") else int(v) for k, v in attrs.items()}
        node = ir.node("AdamWOptimizer", [lr, step, *seqs], attributes=attrs, domain=MS)
        node.outputs[0].name = "updated_flag"
    elif optimizer == OptimType.SGD:
        node = ir.node("SGDOptimizerV2", [lr, seqs[0], seqs[1]], domain=MS)
        node.outputs[0].name = "update_completed"
    else:
        raise ModelError(f"optimizer: expected an OptimType, got {optimizer!r}")
    node.outputs[0].type, node.outputs[0].shape = ir.TensorType(ir.DataType.BOOL), ir.Shape([1])
    graph = ir.Graph([lr, step, *seqs], [node.outputs[0]], nodes=[node], name="optimizer",
                     opset_imports={"": opset, MS: 1})
    return _finish(ir.Model(graph, ir_version=MAX_IR_VERSION, producer_name="onnxopt"))


def generate_artifacts(
    model: onnx.ModelProto | ir.Model | str | os.PathLike,
    requires_grad: Sequence[str] | None = None,
    frozen_params: Sequence[str] | None = None,
    loss: LossType | object | None = None,
    optimizer: OptimType | None = None,
    artifact_directory: str | os.PathLike | None = None,
    prefix: str = "",
    ort_format: bool = False,
    custom_op_library: str | os.PathLike | None = None,
    additional_output_names: Sequence[str] | None = None,
    nominal_checkpoint: bool = False,
    loss_input_names: Sequence[str] | None = None,
) -> None:
    """Writes ``<prefix>training_model.onnx``, ``eval_model.onnx``, ``optimizer_model.onnx`` (when
    ``optimizer``) and ``checkpoint`` into ``artifact_directory`` (default: the current directory), as
    onnxruntime-training's function of the same name.

    ``loss`` is a ``LossType`` or an ``onnxblock`` block (called on the model's output names); None means the
    model already outputs its loss first. ``requires_grad`` lists the trained initializers (default: none,
    as onnxruntime), ``frozen_params`` the ones stored in the checkpoint but not trained.
    """
    from onnxopt.fuse import run_part

    if ort_format:
        raise ModelError("ort_format: expected False; onnxopt writes ONNX files only (the ORT format is "
                         "onnxruntime's own serialization, for its minimal builds)")
    if custom_op_library is not None:
        raise ModelError(f"custom_op_library: expected None, got {custom_op_library!r}; custom ops have no "
                         "gradient in onnxopt")
    base = run_part(model, ("load",), gradient="onnxopt").model  # NOTE: the compiler's load stage; onnxopt's rules
    requires_grad, frozen = list(requires_grad or []), list(frozen_params or [])
    inits = base.graph.initializers
    missing = [n for n in [*requires_grad, *frozen] if n not in inits]
    if missing:
        raise ModelError(f"requires_grad/frozen_params: {missing} are not initializers of the model "
                         f"(expected some of {list(inits)})")
    additional = list(additional_output_names or [])
    if loss is None:
        loss_model = base
        if not loss_model.graph.outputs:
            raise ModelError("loss: None needs a model whose first output is the loss; the model has no output")
        loss_model.graph.outputs[0].name = loss_model.graph.outputs[0].name or "loss"
    elif isinstance(loss, LossType):
        loss_model = base.clone()
        append_loss(loss_model, loss, list(loss_input_names or [v.name for v in base.graph.outputs][:1]))
    else:
        from onnxopt.compat.onnxruntime_training.onnxblock import apply_loss_block

        loss_model = apply_loss_block(base, loss, loss_input_names)
    loss_name = loss_model.graph.outputs[0].name
    if loss_name != "loss":
        loss_model.graph.outputs[0].name = "loss"
    keep = [loss_model.graph.outputs[0]]
    for name in additional:
        found = [v for n in loss_model.graph for v in n.outputs if v.name == name]
        found += [v for v in loss_model.graph.inputs if v.name == name]
        if not found:
            raise ModelError(f"additional_output_names: {name!r} is not a value of the model")
        keep.append(found[0])
    loss_model.graph.outputs.clear()
    loss_model.graph.outputs.extend(keep)
    out = Path(artifact_directory if artifact_directory is not None else os.getcwd())
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(training_model(loss_model, requires_grad, frozen, additional), out / f"{prefix}training_model.onnx")
    onnx.save(eval_model(loss_model, [*requires_grad, *frozen]), out / f"{prefix}eval_model.onnx")
    if optimizer is not None:
        opset = loss_model.opset_imports.get("", 17)
        if isinstance(optimizer, OptimType):
            proto = optimizer_model(optimizer, opset)
        else:  # NOTE: an onnxblock optimizer block (onnxblock.optim.AdamW(...), SGD(clip_grad=...))
            from onnxopt.compat.onnxruntime_training import onnxblock

            with onnxblock.empty_base(opset) as accessor:
                optimizer(([ir.serde.serialize_tensor(inits[n].const_value) for n in requires_grad], []))
            proto = accessor.model
        onnx.save(proto, out / f"{prefix}optimizer_model.onnx")
    ckpt = checkpoint_fbs.Checkpoint(
        requires_grad_params={n: inits[n].const_value.numpy() for n in requires_grad},
        frozen_params={n: inits[n].const_value.numpy() for n in frozen},
        is_nominal_state=nominal_checkpoint)
    if nominal_checkpoint:  # NOTE: as onnxruntime: the complete checkpoint too, and the nominal one beside it
        checkpoint_fbs.save(ckpt, out / f"{prefix}nominal_checkpoint")
        ckpt.is_nominal_state = False
    checkpoint_fbs.save(ckpt, out / f"{prefix}checkpoint")
