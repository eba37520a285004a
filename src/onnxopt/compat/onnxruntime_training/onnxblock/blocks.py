"""onnxblock's building blocks: each appends nodes to the model of the current ``base`` and returns the name
of its output, as ``onnxruntime.training.onnxblock.blocks``."""

from __future__ import annotations

import contextlib
import copy
import itertools

import numpy as np
import onnx
import onnx_ir as ir

_COUNTER = itertools.count()


class ModelAccessor:
    """The model that blocks build on (``accessor.model``)."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model


_ACCESSOR: list[ModelAccessor] = []


def generate_graph_name(token: str) -> str:
    """A fresh value name, ``onnx::<token>::<n>`` as onnxruntime's."""
    return f"onnx::{token}::{next(_COUNTER)}"


def make_node(op_type: str, inputs: list[str], outputs: list[str], domain: str = "", **attributes) -> onnx.NodeProto:
    node = onnx.NodeProto(op_type=op_type, domain=domain, input=inputs, output=outputs,
                          name=generate_graph_name(op_type))
    node.attribute.extend(ir.serde.serialize_attribute(ir.convenience.convert_attribute(k, v))
                          for k, v in attributes.items() if v is not None)
    return node


def add_initializer(model: onnx.ModelProto, value: np.ndarray, token: str) -> str:
    name = generate_graph_name(token)
    model.graph.initializer.append(ir.serde.serialize_tensor(ir.tensor(np.asarray(value), name=name)))
    return name


def find_value(model: onnx.ModelProto, name: str) -> onnx.ValueInfoProto | None:
    """The graph input, output or value_info named ``name``."""
    for v in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        if v.name == name:
            return v
    return None


def exists(model: onnx.ModelProto, name: str) -> bool:
    return (find_value(model, name) is not None or any(i.name == name for i in model.graph.initializer)
            or any(name in n.output for n in model.graph.node))


class Block:
    """A piece of graph: subclasses define ``build(*input_names) -> output name(s)``; calling the block inside
    ``onnxblock.base(model)`` builds it on that model (``self.base``) and checks the model."""

    def __init__(self, temp_file_name: str = "temp.onnx"):
        self.base = None

    def build(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}.build")

    def __call__(self, *args, **kwargs):
        if not _ACCESSOR:
            raise RuntimeError(f"{type(self).__name__}: call blocks inside `with onnxblock.base(model):` or "
                               "`with onnxblock.empty_base():`")
        self.base = _ACCESSOR[-1].model
        output = self.build(*args, **kwargs)
        onnx.checker.check_model(self.base, True)
        return output

    def infer_shapes_on_base(self) -> onnx.ModelProto:
        return onnx.shape_inference.infer_shapes(self.base)


class _Op(Block):
    """One node of ``op_type`` over the inputs, with fixed attributes."""

    op_type = ""

    def __init__(self, **attributes):
        super().__init__()
        self._attributes = attributes

    def build(self, *input_names: str) -> str:
        out = generate_graph_name(f"{self.op_type.lower()}_output")
        self.base.graph.node.append(make_node(self.op_type, list(input_names), [out], **self._attributes))
        return out


def _op(op_type: str, doc: str):
    return type(op_type, (_Op,), {"op_type": op_type, "__doc__": doc})


Add, Sub, Mul, Div = (_op(t, f"Adds a {t} node (two inputs).") for t in ("Add", "Sub", "Mul", "Div"))
Sigmoid, Log, Neg, Abs, Relu, Exp, Sqrt = (_op(t, f"Adds a {t} node.") for t in
                                           ("Sigmoid", "Log", "Neg", "Abs", "Relu", "Exp", "Sqrt"))


class ReduceMean(_Op):
    op_type = "ReduceMean"

    def __init__(self, keepdims: bool = True):
        super().__init__(keepdims=int(keepdims))


class ReduceSum(ReduceMean):
    op_type = "ReduceSum"


class Cast(_Op):
    op_type = "Cast"

    def __init__(self, to: int):
        super().__init__(to=int(to))


class LabelEncoder(_Op):
    """ai.onnx.ml LabelEncoder (keys and values as its attributes)."""

    op_type = "LabelEncoder"

    def __init__(self, default_float=None, default_int64=None, default_string=None, keys_floats=None,
                 keys_int64s=None, keys_strings=None, values_floats=None, values_int64s=None, values_strings=None):
        super().__init__(**{k: v for k, v in locals().items() if k not in ("self", "__class__") and v is not None})

    def build(self, label_encoder_input_name: str) -> str:
        out = generate_graph_name("label_encoder_output")
        self.base.graph.node.append(make_node("LabelEncoder", [label_encoder_input_name], [out], domain="ai.onnx.ml",
                                              **self._attributes))
        return out


class Pow(Block):
    """``input ** exponent`` (a float initializer)."""

    def __init__(self, exponent: float):
        super().__init__()
        self._exponent = exponent

    def build(self, pow_input_name: str) -> str:
        name = add_initializer(self.base, np.array([self._exponent], np.float32), "pow_exponent")
        out = generate_graph_name("pow_output")
        self.base.graph.node.append(make_node("Pow", [pow_input_name, name], [out]))
        return out


class Constant(Block):
    """A float initializer of shape [1]."""

    def __init__(self, value_float: float):
        super().__init__()
        self._value = value_float

    def build(self) -> str:
        return add_initializer(self.base, np.array([self._value], np.float32), "initializer")


class PassThrough(Block):
    """Returns its inputs unchanged (the 'none' reduction)."""

    def __init__(self, **_):
        super().__init__()

    def build(self, *input_names: str):
        return input_names[0] if len(input_names) == 1 else input_names


class InputLike(Block):
    """A new graph input typed as the input or output ``like``."""

    def __init__(self, like: str):
        super().__init__()
        self._like = like

    def build(self, input_name: str | None = None) -> str:
        like = find_value(self.base, self._like)
        if like is None:
            raise LookupError(f"Could not find input or output with name {self._like}")
        cloned = copy.deepcopy(like)
        cloned.name = input_name or generate_graph_name("input")
        self.base.graph.input.append(cloned)
        return cloned.name


class Linear(Block):
    """``input @ W + b`` with random initial W [in, out] and b (a Gemm), as onnxruntime's."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, alpha: float = 1.0, beta: float = 1.0):
        super().__init__()
        self._shape, self._bias, self._alpha, self._beta = (in_features, out_features), bias, alpha, beta

    def build(self, linear_input_name: str) -> str:
        names = [linear_input_name, add_initializer(self.base, np.random.randn(*self._shape).astype(np.float32),
                                                    "linear.weight")]
        if self._bias:
            names.append(add_initializer(self.base, np.random.randn(self._shape[1]).astype(np.float32), "linear.bias"))
        out = generate_graph_name("linear.output")
        self.base.graph.node.append(make_node("Gemm", names, [out], alpha=float(self._alpha), beta=float(self._beta)))
        return out


@contextlib.contextmanager
def _using(model: onnx.ModelProto):
    _ACCESSOR.append(ModelAccessor(model))
    try:
        yield _ACCESSOR[-1]
    finally:
        _ACCESSOR.pop()
