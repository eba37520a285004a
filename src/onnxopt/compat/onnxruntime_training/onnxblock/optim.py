"""onnxblock's optimizers (``onnxruntime.training.onnxblock.optim``): they write onnxruntime's optimizer model
(``AdamWOptimizer`` / ``SGDOptimizerV2`` over sequences, optionally after ``InplaceClipGradNorm``), which its
runtime runs in place and ``api.Optimizer`` turns into standard ONNX."""

from __future__ import annotations

import onnx
import onnx_ir as ir

from onnxopt.compat.onnxruntime_training.onnxblock import blocks
from onnxopt.compat.onnxruntime_training.onnxblock.onnxblock import ForwardBlock


def _value(name: str, elem: int, shape=None, sequence: bool = False) -> onnx.ValueInfoProto:
    t = ir.TensorType(ir.DataType(elem))
    return ir.serde.serialize_value(ir.Value(name=name, type=ir.SequenceType(t) if sequence else t,
                                             shape=None if sequence or shape is None else ir.Shape(shape)))


class ClipGradNorm(blocks.Block):
    """Scales a sequence of gradients so that their global L2 norm is at most ``max_norm``."""

    def __init__(self, max_norm: float):
        super().__init__()
        self._max_norm = max_norm

    def build(self, gradients_name: str) -> str:
        out = blocks.generate_graph_name("clip_grad_norm_output")
        self.base.graph.node.append(blocks.make_node("InplaceClipGradNorm", [gradients_name], [out],
                                                     domain="com.microsoft", max_norm=float(self._max_norm)))
        self.base.graph.value_info.append(_value(out, onnx.TensorProto.FLOAT, sequence=True))
        return out


class _Optimizer(ForwardBlock):
    op_type = ""
    moments = 1

    def __init__(self, clip_grad: ClipGradNorm | None = None):
        super().__init__()
        self._clip_grad = clip_grad
        self._attributes: dict = {}

    def build(self, parameters) -> str:
        trainable, _ = parameters
        g = self.base.graph
        elem = trainable[0].data_type if trainable else onnx.TensorProto.FLOAT
        g.input.extend([_value("learning_rate", onnx.TensorProto.FLOAT, [1]), _value("step", onnx.TensorProto.INT64, [1])])
        seqs = ["params", "gradients", "first_order_moments", "second_order_moments"][: 3 + (self.moments == 2)]
        g.input.extend(_value(n, elem, sequence=True) for n in seqs)
        grads = self._clip_grad(seqs[1]) if self._clip_grad is not None else seqs[1]
        if self.op_type == "AdamWOptimizer":
            inputs = ["learning_rate", "step", seqs[0], grads, *seqs[2:]]
            out = blocks.generate_graph_name("adamw.updated_flag")
        else:
            inputs, out = ["learning_rate", seqs[0], grads], blocks.generate_graph_name("update_completed")
        g.node.append(blocks.make_node(self.op_type, inputs, [out], domain="com.microsoft", **self._attributes))
        g.output.append(_value(out, onnx.TensorProto.BOOL, [1]))
        return out


class AdamW(_Optimizer):
    """onnxruntime's AdamW (Hugging Face form, ``adam_mode=1``), same defaults."""

    op_type, moments = "AdamWOptimizer", 2

    def __init__(self, bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, clip_grad: ClipGradNorm | None = None):
        super().__init__(clip_grad)
        self._attributes = {"alpha": float(betas[0]), "beta": float(betas[1]), "epsilon": float(eps),
                            "weight_decay": float(weight_decay), "correct_bias": int(bool(bias_correction)),
                            "adam_mode": 1}


class SGD(_Optimizer):
    """Plain SGD, ``w -= lr * g``."""

    op_type = "SGDOptimizerV2"
