"""Standardized inputs and targets for ``Trainer(scale="auto")``: the weights train on (X - mean) / std, and
regression targets on (y - mean) / std, with the statistics of the training data.

- ``fit_scaling`` decides: ``scale="always"``, ``"never"``, or ``"auto"`` when a column's std is outside [0.1, 10] or its
  mean beyond ±3 (scikit-learn's bundled data sets all are; standard-normal data is left alone).
- ``Scaling.fold`` rewrites the initial weights so the model computes the same function on scaled data, when
  the input goes (through a Cast) into ``MatMul + Add`` or ``Gemm`` and the output comes (through Reshape,
  Identity or Cast) from one. The Trainer starts from the folded weights or the weights as they are, whichever
  has the lower loss on the training data: a fitted model keeps what it learnt, a freshly initialized one
  (weights drawn for inputs of unit scale) keeps its initialization. When the inputs cannot be folded (a
  converted pipeline starting with its own scaler, a Conv), ``scale="auto"`` trains on scaled or raw inputs,
  whichever gives the lower first loss.
- ``Scaling.wrap`` puts Sub/Div before the model and Mul/Add after it: the exported model reads raw inputs and
  predicts raw targets.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

__all__ = ["Scaling", "fit_scaling", "scale_mode", "SCALE_MODES"]

SCALE_MODES = ("auto", "always", "never")  # NOTE: the Trainer's and the CLI's (--scale) values alike


def scale_mode(scale) -> str:
    """``scale`` as one of ``SCALE_MODES``; True, False and None (the Trainer's former values) still mean "always"
    and "never", with a FutureWarning."""
    if scale is True or scale is False or scale is None:
        new = "always" if scale else "never"
        warnings.warn(f"scale={scale!r} is deprecated: use scale={new!r} (the values --scale takes on the command "
                      "line)", FutureWarning, stacklevel=3)
        return new
    if scale not in SCALE_MODES:
        raise ValueError(f"scale: expected one of {list(SCALE_MODES)}, got {scale!r}")
    return scale

_PASS = ("Cast", "Reshape", "Identity", "Flatten")


@dataclass(frozen=True)
class Scaling:
    """Means and standard deviations of the inputs (``x``) and targets (``y``); None where not scaled."""

    x: tuple[np.ndarray, np.ndarray] | None
    y: tuple[np.ndarray, np.ndarray] | None

    def transform(self, X: np.ndarray, y: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        if self.x is not None:
            X = ((X - self.x[0]) / self.x[1]).astype(X.dtype)
        if self.y is not None and y is not None:
            y = ((y - self.y[0].reshape(y.shape[1:] or ())) / self.y[1].reshape(y.shape[1:] or ())).astype(y.dtype)
        return X, y

    def without_x(self) -> Scaling:
        """The same scaling of the targets, the inputs left raw."""
        return Scaling(None, self.y)

    def fold(self, model: ir.Model) -> tuple[dict[str, np.ndarray], bool]:
        """Changes the initial weights of ``model`` so that it gives on scaled data what it gave on raw data;
        returns the weights it changed, as they were, and whether the inputs' scaling was folded."""
        g, before = model.graph, {}
        x_folded = self.x is not None and (affine := _affine(_follow(g.inputs[0]), g)) is not None
        if x_folded:
            w, b, axis = affine
            raw = w.const_value.numpy()
            before.update({v.name: v.const_value.numpy() for v in (w, b)})
            mean, std = (s.astype(raw.dtype) for s in self.x)
            _set(b, b.const_value.numpy() + (mean @ raw if axis == 0 else raw @ mean))
            _set(w, raw * (std[:, None] if axis == 0 else std[None, :]))
        if self.y is not None and (affine := _affine(_source(g.outputs[0]), g, back=True)) is not None:
            w, b, axis = affine
            before.update({v.name: v.const_value.numpy() for v in (w, b) if v.name not in before})
            mean, std = (s.astype(w.const_value.dtype.numpy()) for s in self.y)
            _set(w, w.const_value.numpy() / (std[None, :] if axis == 0 else std[:, None]))
            _set(b, (b.const_value.numpy() - mean) / std)
        return before, x_folded

    def wrap(self, model: onnx.ModelProto, output: str) -> onnx.ModelProto:
        """``model`` (changed in place) reading raw inputs and writing raw ``output`` values."""
        g = model.graph
        dtype = {o.name: o.type.tensor_type.elem_type for o in [*g.input, *g.output]}
        nodes, consts = [], {}
        if self.x is not None:
            x = g.input[0].name
            _rename(g, x, x + ".scaled", inputs=True)
            nodes.append(onnx.NodeProto(op_type="Sub", input=[x, "onnxopt.x_mean"], output=[x + ".centered"]))
            nodes.append(onnx.NodeProto(op_type="Div", input=[x + ".centered", "onnxopt.x_std"], output=[x + ".scaled"]))
            consts.update({"onnxopt.x_mean": (self.x[0], dtype[x]), "onnxopt.x_std": (self.x[1], dtype[x])})
        tail = []
        if self.y is not None:
            _rename(g, output, output + ".scaled", inputs=True, outputs=True)
            tail.append(onnx.NodeProto(op_type="Mul", input=[output + ".scaled", "onnxopt.y_std"], output=[output + ".raw"]))
            tail.append(onnx.NodeProto(op_type="Add", input=[output + ".raw", "onnxopt.y_mean"], output=[output]))
            consts.update({"onnxopt.y_std": (self.y[1], dtype[output]), "onnxopt.y_mean": (self.y[0], dtype[output])})
        nodes += list(g.node) + tail
        del g.node[:]
        g.node.extend(nodes)
        for name, (value, elem) in consts.items():
            array = np.asarray(value, ir.DataType(elem).numpy())
            g.initializer.append(ir.serde.serialize_tensor(ir.tensor(array, name=name)))
        return model


def fit_scaling(X: np.ndarray, y: np.ndarray | None, scale) -> Scaling:
    """The statistics of ``X`` and of regression targets ``y`` (None for classes) that ``scale`` asks for."""
    scale = scale_mode(scale)

    def stats(a):
        if a is None or scale == "never" or a.dtype.kind != "f" or a.ndim not in (1, 2) or not np.isfinite(a).all() \
                or not a.size:  # NOTE: the data checks that follow name what is wrong with such data
            return None
        a = np.asarray(a, np.float64).reshape(len(a), -1)
        mean, std = a.mean(axis=0), a.std(axis=0)
        varying = std > 0
        needed = scale == "always" or bool(((std < 0.1) | (std > 10) | (np.abs(mean) > 3))[varying].any())
        return (mean, np.where(varying, std, 1.0)) if needed else None

    return Scaling(stats(X), stats(y))


def _set(value: ir.Value, array: np.ndarray) -> None:
    value.const_value = ir.tensor(np.ascontiguousarray(array, value.const_value.dtype.numpy()), name=value.name)


def _follow(value: ir.Value) -> ir.Value:
    """The value a graph input reaches through the Casts it alone feeds."""
    uses = list(value.uses())
    while len(uses) == 1 and uses[0].node.op_type == "Cast":
        value = uses[0].node.outputs[0]
        uses = list(value.uses())
    return value


def _source(value: ir.Value) -> ir.Value:
    """The value an output comes from through pass-through nodes."""
    while (node := value.producer()) is not None and node.op_type in _PASS:
        value = node.inputs[0]
    return value


def _init(value: ir.Value | None, g: ir.Graph) -> ir.Value | None:
    return value if value is not None and value.name in g.initializers and value.const_value is not None else None


def _affine(value: ir.Value, g: ir.Graph, back: bool = False):
    """(weight, bias, axis of the weight that meets ``value``) of the MatMul + Add or Gemm that reads ``value``
    (``back``: that writes it), when weight and bias are initializers; else None."""
    if back:
        node = value.producer()
        if node is not None and node.op_type == "Add":
            mm = next((i.producer() for i in node.inputs if i.producer() is not None
                       and i.producer().op_type == "MatMul"), None)
            bias = next((i for i in node.inputs if _init(i, g)), None)
            if mm is not None and bias is not None and _init(mm.inputs[1], g):
                return mm.inputs[1], bias, 0
        if node is not None and node.op_type == "Gemm" and len(node.inputs) == 3 and _plain_gemm(node):
            w, b = _init(node.inputs[1], g), _init(node.inputs[2], g)
            return (w, b, 1 if _attr(node, "transB") else 0) if w is not None and b is not None else None
        return None
    uses = list(value.uses())
    if len(uses) != 1 or uses[0].idx != 0:
        return None
    node = uses[0].node
    if node.op_type == "Gemm" and len(node.inputs) == 3 and _plain_gemm(node):
        w, b = _init(node.inputs[1], g), _init(node.inputs[2], g)
        return (w, b, 1 if _attr(node, "transB") else 0) if w is not None and b is not None else None
    if node.op_type != "MatMul" or _init(node.inputs[1], g) is None or len(node.inputs[1].shape or ()) != 2:
        return None
    after = list(node.outputs[0].uses())
    if len(after) == 1 and after[0].node.op_type == "Add":
        bias = _init(after[0].node.inputs[1 - after[0].idx], g)
        return (node.inputs[1], bias, 0) if bias is not None else None
    return None


def _attr(node: ir.Node, name: str, default=0):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _plain_gemm(node: ir.Node) -> bool:
    return not _attr(node, "transA") and _attr(node, "alpha", 1.0) == 1.0 and _attr(node, "beta", 1.0) == 1.0


def _rename(g: onnx.GraphProto, old: str, new: str, inputs: bool = False, outputs: bool = False) -> None:
    """Every node of ``g`` reading (``inputs``) or writing (``outputs``) ``old`` now uses ``new``."""
    for node in g.node:
        for names, on in ((node.input, inputs), (node.output, outputs)):
            for i, name in enumerate(names):
                if on and name == old:
                    names[i] = new
