"""onnxblock's losses (``onnxruntime.training.onnxblock.loss``): the same graphs, labels added as graph inputs
when absent (``target`` typed as the scores, ``labels`` int64 without the class axis)."""

from __future__ import annotations

import copy

import numpy as np
import onnx

from onnxopt.compat.onnxruntime_training.onnxblock import blocks

_REDUCE = {"mean": blocks.ReduceMean, "sum": blocks.ReduceSum, "none": blocks.PassThrough}


def _check(reduction: str) -> None:
    if reduction not in _REDUCE:
        raise RuntimeError(f"Reduction {reduction} not supported.")


class MSELoss(blocks.Block):
    """``reduce((output - target) ** 2)``."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        _check(reduction)
        self._reduce, self._sub, self._square = _REDUCE[reduction](keepdims=False), blocks.Sub(), blocks.Pow(2.0)

    def build(self, loss_input_name: str, target_name: str = "target") -> str:
        if not blocks.exists(self.base, target_name):
            target_name = blocks.InputLike(loss_input_name)(target_name)
        return self._reduce(self._square(self._sub(loss_input_name, target_name)))


class L1Loss(blocks.Block):
    """``reduce(abs(output - target))``."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        _check(reduction)
        self._reduce, self._abs, self._sub = _REDUCE[reduction](keepdims=False), blocks.Abs(), blocks.Sub()

    def build(self, loss_input_name: str, target_name: str = "target") -> str:
        if not blocks.exists(self.base, target_name):
            target_name = blocks.InputLike(loss_input_name)(target_name)
        return self._reduce(self._abs(self._sub(loss_input_name, target_name)))


class CrossEntropyLoss(blocks.Block):
    """``SoftmaxCrossEntropyLoss`` over the scores and int64 labels (class weights, ignore_index)."""

    def __init__(self, weight=None, reduction: str = "mean", ignore_index: int | None = None):
        super().__init__()
        _check(reduction)
        self._weight, self._reduction, self._ignore_index = weight, reduction, ignore_index

    def build(self, scores_input_name: str, labels_name: str = "labels") -> str:
        inputs = [scores_input_name, labels_name]
        if self._weight is not None:
            inputs.append(blocks.add_initializer(self.base, np.asarray(self._weight), "celoss.weight"))
        if not blocks.exists(self.base, labels_name):
            like = blocks.find_value(self.base, scores_input_name)
            if like is None:
                raise LookupError(f"Could not find the output {scores_input_name}")
            labels = copy.deepcopy(like)
            labels.name = labels_name
            labels.type.tensor_type.elem_type = onnx.TensorProto.INT64
            del labels.type.tensor_type.shape.dim[-1]
            self.base.graph.input.append(labels)
        out, log_prob = blocks.generate_graph_name("loss"), blocks.generate_graph_name("log_prob")
        self.base.graph.node.append(blocks.make_node("SoftmaxCrossEntropyLoss", inputs, [out, log_prob],
                                                     reduction=self._reduction, ignore_index=self._ignore_index))
        return out


class BCEWithLogitsLoss(blocks.Block):
    """``reduce(-(t log s(x) * pos_weight + (1 - t) log(1 - s(x))) * weight)``, s the sigmoid."""

    def __init__(self, weight=None, reduction: str = "mean", pos_weight=None):
        super().__init__()
        _check(reduction)
        self._weight, self._pos_weight, self._reduce = weight, pos_weight, _REDUCE[reduction](keepdims=False)

    def build(self, loss_input_name: str, target_name: str = "target") -> str:
        if not blocks.exists(self.base, target_name):
            target_name = blocks.InputLike(loss_input_name)(target_name)
        one = blocks.Constant(1.0)
        s = blocks.Sigmoid()(loss_input_name)
        pos = blocks.Mul()(blocks.Log()(s), target_name)
        if self._pos_weight is not None:
            pos = blocks.Mul()(pos, blocks.add_initializer(self.base, np.asarray(self._pos_weight), "bceloss.pos_weight"))
        neg = blocks.Mul()(blocks.Log()(blocks.Sub()(one(), s)), blocks.Sub()(one(), target_name))
        out = blocks.Neg()(blocks.Add()(pos, neg))
        if self._weight is not None:
            out = blocks.Mul()(blocks.add_initializer(self.base, np.asarray(self._weight), "bceloss.weight"), out)
        return self._reduce(out)
