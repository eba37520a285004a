"""Small ONNX models built with onnx_ir, for the demo, the docs and the tests (no converter needed)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir

from onnxopt.modelio import DSL_OPSET

__all__ = ["linear_regression", "mlp", "polynomial"]


def _model(graph: ir.Graph) -> onnx.ModelProto:
    return ir.to_proto(ir.Model(graph, ir_version=10))


def _init(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    value = ir.Value(name=name, type=ir.TensorType(ir.DataType.from_numpy(array.dtype)), shape=ir.Shape(array.shape),
                     const_value=ir.tensor(array, name=name))
    graph.register_initializer(value)
    return value


def _input(name: str, dtype: np.dtype, width: int) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(ir.DataType.from_numpy(np.dtype(dtype))), shape=ir.Shape(["N", width]))


def linear_regression(n_features: int, dtype=np.float32, seed: int = 0) -> onnx.ModelProto:
    """``Y = X @ coef + bias`` with inputs X (N, n_features), output Y (N, 1) and weights ``coef``, ``bias``."""
    return mlp([n_features, 1], dtype=dtype, seed=seed, names=("coef", "bias"))


def mlp(
    sizes: Sequence[int],
    activation: str | Sequence[str] = "Relu",
    dtype=np.float32,
    seed: int = 0,
    final: str | None = None,
    names: tuple[str, str] = ("coef", "bias"),
) -> onnx.ModelProto:
    """A perceptron ``sizes[0] -> ... -> sizes[-1]``: MatMul + Add per layer, ``activation`` between layers.

    ``activation`` is an op type (Relu, Tanh, Sigmoid...) or one per hidden layer; ``final`` an op applied to
    the output (e.g. Softmax). Weights are ``coef_<i>``/``bias_<i>`` (``coef``/``bias`` with one layer), drawn
    like torch.nn.Linear's default init from ``seed``.
    """
    rng = np.random.default_rng(seed)
    n_layers = len(sizes) - 1
    acts = [activation] * (n_layers - 1) if isinstance(activation, str) else list(activation)
    graph = ir.Graph([], [], nodes=[], opset_imports={"": DSL_OPSET}, name="mlp")
    x = _input("X", dtype, sizes[0])
    graph.inputs.append(x)
    tape = ir.tape.Tape(graph)
    h = x
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        suffix = f"_{i}" if n_layers > 1 else ""
        bound = 1 / np.sqrt(n_in)
        w = _init(graph, names[0] + suffix, rng.uniform(-bound, bound, (n_in, n_out)).astype(dtype))
        b = _init(graph, names[1] + suffix, rng.uniform(-bound, bound, (n_out,)).astype(dtype))
        h = tape.op("Add", [tape.op("MatMul", [h, w]), b])
        if i < n_layers - 1:
            h = tape.op(acts[i], [h])
    if final:
        h = tape.op(final, [h], {"axis": -1} if final in ("Softmax", "LogSoftmax") else None)
    h.name = "Y"
    h.type, h.shape = x.type, ir.Shape(["N", sizes[-1]])
    graph.outputs.append(h)
    return _model(graph)


def polynomial(dtype=np.float32) -> onnx.ModelProto:
    """The seed notebook's model: ``y = x @ [-2, 3] + (x*x) @ [0.5, -1/3] - 1`` built with Mul, Slice, Squeeze.

    Weights ``init`` (x² coefficients), ``init_1`` (x coefficients), ``init_b10`` (bias), as in the notebook.
    """
    graph = ir.Graph([], [], nodes=[], opset_imports={"": DSL_OPSET}, name="poly")
    x = _input("x", dtype, 2)
    graph.inputs.append(x)
    init = _init(graph, "init", np.array([[0.5, -0.33333]], dtype=dtype))
    init_1 = _init(graph, "init_1", np.array([[-2.0, 3.0]], dtype=dtype))
    i1, i2, i0 = (_init(graph, n, np.array([v], dtype=np.int64)) for n, v in (("init_2", 1), ("init_3", 2), ("init_5", 0)))
    bias = _init(graph, "init_b10", np.array([-1.0], dtype=dtype))
    shape = _init(graph, "init_b11", np.array([-1, 1], dtype=np.int64))
    t = ir.tape.Tape(graph)
    poly = t.op("Add", [t.op("Mul", [x, init_1]), t.op("Mul", [t.op("Mul", [x, x]), init])])
    second = t.op("Squeeze", [t.op("Slice", [poly, i1, i2, i1]), i1])
    first = t.op("Squeeze", [t.op("Slice", [poly, i0, i1, i1]), i1])
    y = t.op("Reshape", [t.op("Add", [t.op("Add", [first, second]), bias]), shape])
    y.name = "y"
    y.type, y.shape = x.type, ir.Shape(["N", 1])
    graph.outputs.append(y)
    return _model(graph)
