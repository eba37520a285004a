"""Compile-time checks of DSL functions against the model they are applied to, errors naming the function.

Each function (loss, penalty, schedule, update rule) is called alone on inputs typed like the real ones and
ONNX shape inference runs in strict mode: a type clash (a float64 constant beside float32 weights), a
non-scalar loss or an update rule whose outputs do not match the weight raise ``DslError`` before any
session exists, instead of a runtime error deep inside the fused graph.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as passes

from onnxopt import graphs
from onnxopt.dsl.core import Loss, Penalty, Schedule, UpdateRule, _Decl, inputs_of
from onnxopt.errors import DslError

__all__ = ["check_step_functions", "infer_call"]

Spec = tuple[str, ir.DataType, Sequence[int | str] | None]  # input name, dtype, shape (None: unknown)
_HINT = "write constants as op.CastLike(value, w) so they follow the weights' dtype"


def where(kind: str, decl: _Decl) -> str:
    """``kind name (file:line)`` of a DSL declaration, for error messages."""
    fn = getattr(decl.fn, "function", None)
    try:
        return f"{kind} {decl.name} ({inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]})"
    except (OSError, TypeError):  # NOTE: no source for functions defined in a REPL or exec
        return f"{kind} {decl.name}"


def _standalone(decl: _Decl, inputs: Sequence[Spec], n_outputs: int, opset: int) -> ir.Model:
    graph = ir.Graph([], [], nodes=[], opset_imports={"": opset}, name="check")
    model = ir.Model(graph, ir_version=10)
    ins = [ir.Value(name=n, type=ir.TensorType(t), shape=None if s is None else ir.Shape(s)) for n, t, s in inputs]
    graph.inputs.extend(ins)
    outs = graphs.call(model, decl.fn, ins, decl.call_attrs(), "check", n_outputs)
    for i, out in enumerate(outs):
        out.name = f"output_{i}"
    graph.outputs.extend(outs)
    passes.InlinePass()(model)
    return model


def infer_call(kind: str, decl: _Decl, inputs: Sequence[Spec], n_outputs: int, opset: int):
    """Calls ``decl.fn`` on typed inputs in a standalone model, runs strict shape inference and returns the
    (dtype, shape) of each output; shape is None when inference cannot tell."""
    model = _standalone(decl, inputs, n_outputs, opset)
    try:
        inferred = onnx.shape_inference.infer_shapes(ir.to_proto(model), check_type=True, strict_mode=True,
                                                     data_prop=True)
    except onnx.shape_inference.InferenceError as exc:
        raise DslError(f"{where(kind, decl)}: ONNX type and shape inference fails on inputs "
                       f"{_show(inputs)}: {str(exc).strip()}; {_HINT}") from exc
    result = []
    for out in inferred.graph.output:
        tensor = out.type.tensor_type
        dtype = ir.DataType(tensor.elem_type) if tensor.elem_type else None
        shape = None
        if tensor.HasField("shape"):
            shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor.shape.dim)
        result.append((dtype, shape))
    return result


def _show(inputs: Sequence[Spec]) -> str:
    return ", ".join(f"{n}: {t.name}{ir.Shape(s) if s is not None else ''}" for n, t, s in inputs)


def _is_scalar(shape) -> bool | None:
    """Whether ``shape`` holds one element: False for a size other than 1 or a named (batch) dimension,
    None when inference left it unknown."""
    if shape is None:
        return None
    if any(d != 1 and d != "?" for d in shape):
        return False
    return None if "?" in shape else True


def _known(shape) -> bool:
    return shape is not None and all(isinstance(d, int) for d in shape)


def _expect(kind: str, decl: _Decl, outs, dtype: ir.DataType, shapes: Sequence, names: Sequence[str]) -> None:
    for (got_type, got_shape), want_shape, name in zip(outs, shapes, names):
        if got_type is not None and got_type != dtype:
            raise DslError(f"{where(kind, decl)}: output {name} is {got_type.name}, expected {dtype.name} "
                           f"(the weights' dtype); {_HINT}")
        if want_shape == "scalar":
            if _is_scalar(got_shape) is False:
                raise DslError(f"{where(kind, decl)}: output {name} has shape {list(got_shape)}, expected a "
                               "scalar (one element): reduce it with op.ReduceMean or op.ReduceSum")
        elif _known(got_shape) and _known(want_shape) and tuple(got_shape) != tuple(want_shape):
            raise DslError(f"{where(kind, decl)}: output {name} has shape {list(got_shape)}, expected "
                           f"{list(want_shape)} (the shape of the weight it updates)")


def _probe_shape(loss: Loss, ins: Sequence[Spec], opset: int):
    """The loss's output shape from one run on a batch of 2 with targets shaped like the prediction, when
    inference left it unknown; None if that run fails (the real batch may fit where this one does not)."""
    import onnxruntime as ort

    dims = [d if isinstance(d, int) else 2 for d in ins[0][2] or [2]]
    feeds = {"y": np.full(dims, 0.5, ins[0][1].numpy())}
    feeds["t"] = np.zeros(dims[:1], np.int64) if ins[1][1] == ir.DataType.INT64 else feeds["y"].copy()
    if len(ins) == 3:
        feeds["sample_weight"] = np.ones(dims[:1], feeds["y"].dtype)
    model = _standalone(loss, [(n, t, None) for n, t, _ in ins], 1, opset)
    try:
        opts = ort.SessionOptions()
        opts.log_severity_level = 4
        sess = ort.InferenceSession(ir.to_proto(model).SerializeToString(), opts, providers=["CPUExecutionProvider"])
        return tuple(sess.run(None, feeds)[0].shape)
    except Exception:  # NOTE: inconclusive, not an error: leave it to the runner
        return None


def check_step_functions(loss: Loss | None, rule: UpdateRule, penalty: Penalty | None, schedule: Schedule,
                         y: ir.Value, weights: Sequence[ir.Value], opset: int) -> None:
    """Checks every DSL function of a train step on the model's prediction ``y`` and ``weights``."""
    dtype = weights[0].dtype
    if loss is not None and y.dtype is not None:
        ydims = list(y.shape.dims) if y.shape is not None else None
        ins: list[Spec] = [("y", y.dtype, ydims), ("t", ir.DataType.INT64 if loss.target == "index" else y.dtype, None)]
        if len(inputs_of(loss.fn)) == 3:
            ins.append(("sample_weight", y.dtype, ["N"]))
        outs = infer_call("loss", loss, ins, 1, opset)
        name = "0 (the loss)"
        if loss.reduction is None and _is_scalar(outs[0][1]) is None:
            outs, name = [(outs[0][0], _probe_shape(loss, ins, opset))], "0 (the loss, run on a batch of 2)"
        _expect("loss", loss, outs, y.dtype, ["scalar" if loss.reduction is None else None], [name])
    shapes = {(w.dtype, tuple(w.shape.dims) if w.shape is not None else None) for w in weights}
    for wtype, wshape in shapes:
        w = ("w", wtype, wshape)
        if penalty is not None:
            outs = infer_call("penalty", penalty, [w], 1, opset)
            _expect("penalty", penalty, outs, wtype, ["scalar"], ["0 (the penalty)"])
        ins = [w, ("g", wtype, wshape), ("lr", wtype, []), *((s, wtype, wshape) for s in rule.state)]
        if rule.uses_step:
            ins.append(("step", wtype, []))
        outs = infer_call("update_rule", rule, ins, 1 + len(rule.state), opset)
        names = ["0 (new w)", *(f"{i + 1} (new {s})" for i, s in enumerate(rule.state))]
        _expect("update_rule", rule, outs, wtype, [wshape] * len(outs), names)
    outs = infer_call("schedule", schedule, [("step", dtype, [])], 1, opset)
    _expect("schedule", schedule, outs, dtype, ["scalar"], ["0 (the learning rate)"])
