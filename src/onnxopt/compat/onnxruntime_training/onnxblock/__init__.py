"""``onnxruntime.training.onnxblock`` on onnxopt: blocks, losses, optimizers, ForwardBlock and TrainingBlock.

``with onnxblock.base(model):`` builds on a copy of ``model``; ``with onnxblock.empty_base() as accessor:``
on an empty model (``accessor.model``), which is how optimizer models are written.
"""

from __future__ import annotations

import contextlib
import copy

import onnx
import onnx_ir as ir

from onnxopt.compat.onnxruntime_training import checkpoint_fbs
from onnxopt.compat.onnxruntime_training.onnxblock import blocks, loss, optim
from onnxopt.compat.onnxruntime_training.onnxblock.blocks import Block
from onnxopt.compat.onnxruntime_training.onnxblock.onnxblock import ForwardBlock, TrainingBlock

__all__ = ["blocks", "loss", "optim", "Block", "ForwardBlock", "TrainingBlock", "base", "empty_base",
           "save_checkpoint", "load_checkpoint_to_model"]


@contextlib.contextmanager
def base(model: onnx.ModelProto):
    """Blocks called inside build on a copy of ``model`` (``accessor.model``)."""
    with blocks._using(copy.deepcopy(model)) as accessor:
        yield accessor


@contextlib.contextmanager
def empty_base(opset_version: int | None = None):
    """Blocks called inside build on an empty model (IR 10, the default opset and com.microsoft 1)."""
    model = onnx.ModelProto(ir_version=10, producer_name="onnxopt", graph=onnx.GraphProto(name="empty"))
    model.opset_import.add(domain="com.microsoft", version=1)
    model.opset_import.add(domain="", version=opset_version or min(onnx.defs.onnx_opset_version(), 21))
    with blocks._using(model) as accessor:
        yield accessor


def save_checkpoint(parameters: tuple[list[onnx.TensorProto], list[onnx.TensorProto]], path_to_checkpoint) -> None:
    """Writes ``(trainable, frozen)`` TensorProtos as onnxruntime's checkpoint file."""
    trainable, frozen = parameters
    checkpoint_fbs.save(checkpoint_fbs.Checkpoint({t.name: _array(t) for t in trainable},
                                                  {t.name: _array(t) for t in frozen}), path_to_checkpoint)


def _array(tensor: onnx.TensorProto):
    return ir.serde.deserialize_tensor(tensor).numpy()


def load_checkpoint_to_model(path_to_checkpoint, model: onnx.ModelProto, strict: bool = False) -> None:
    """Copies the checkpoint's parameters into ``model``'s initializers of the same names (in place)."""
    ckpt = checkpoint_fbs.load(path_to_checkpoint)
    params = {**ckpt.requires_grad_params, **ckpt.frozen_params}
    names = {i.name for i in model.graph.initializer}
    if strict and set(params) != names:
        raise RuntimeError(f"load_checkpoint_to_model: checkpoint parameters {sorted(params)} != model initializers "
                           f"{sorted(names)}")
    for init in model.graph.initializer:
        if init.name in params:
            init.CopyFrom(ir.serde.serialize_tensor(ir.tensor(params[init.name], name=init.name)))


def apply_loss_block(model: ir.Model, loss: Block, loss_input_names=None) -> ir.Model:
    """``model`` with the loss block built on its outputs (``loss_input_names``, default all), the loss as its
    only output: what ``artifacts.generate_artifacts(loss=<block>)`` differentiates."""
    proto = ir.to_proto(model)
    names = list(loss_input_names or [o.name for o in proto.graph.output])
    with base(proto) as accessor:
        if isinstance(loss, (ForwardBlock, TrainingBlock)):  # NOTE: build only; the caller differentiates
            loss.base = accessor.model
            out = loss.build(*names)
        else:
            out = loss(*names)
        built = onnx.shape_inference.infer_shapes(accessor.model)
    from onnxopt.compat.onnxruntime_training.onnxblock.onnxblock import register_graph_outputs

    register_graph_outputs(built, out)
    return ir.from_proto(built)
