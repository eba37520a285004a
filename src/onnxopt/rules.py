"""Rewrite rules applied before differentiation, for ops onnxruntime-training has no gradient for.

- ``CastLike(x, like)`` -> ``Cast(x, to=like.dtype)`` once shape inference knows ``like``'s type: the DSL
  writes constants with CastLike, and the builder has a gradient for Cast only.
- ``Relu(x)`` -> ``Where(Greater(x, 0), x, 0)`` for float64 ``x``: onnxruntime has no double kernel for the
  ``ReluGrad`` the builder emits, while ``Where``'s gradient (a ``Where``) runs in double.
- ``Softmax(x)``/``LogSoftmax(x)`` -> ``Exp``/``Sub`` of ``x − ReduceLogSumExp(x, axis)`` for float64 ``x``:
  SoftmaxGrad_13/LogSoftmaxGrad_13 have float kernels only.
- ``Concat(x_1..x_k, axis)`` -> ``Pad(x_1) + ... + Pad(x_k)`` (each padded with zeros to its place) for float64
  inputs whose sizes along ``axis`` are known: the builder's ConcatTraining gradient (SplitTraining) has no
  double kernel, Pad's gradient (a Pad) has.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRule

from onnxopt import graphs

__all__ = ["rules", "lower_for_gradient", "widen_float_constants"]


def _castlike(op, x, like):
    return op.CastLike(x, like)


def _castlike_known(context, x, like, **_) -> MatchResult:
    result = MatchResult()
    if like.dtype is None:
        return result.fail("CastLike: the type of input 'like' is unknown")
    return result


def _cast(op, x, like):
    return op.Cast(x, to=like.dtype)


def _relu(op, x):
    return op.Relu(x)


def _relu_double(context, x, **_) -> MatchResult:
    result = MatchResult()
    if x.dtype != ir.DataType.DOUBLE:
        return result.fail("Relu: only float64 needs rewriting (ReluGrad has float kernels)")
    return result


def _relu_as_where(op, x):
    zero = op.Constant(value=ir.tensor(np.array(0.0, dtype=np.float64)))
    return op.Where(op.Greater(x, zero), x, zero)


def _softmax(op, x):
    return op.Softmax(x, _allow_other_attributes=True, _outputs=["out"])


def _log_softmax(op, x):
    return op.LogSoftmax(x, _allow_other_attributes=True, _outputs=["out"])


def _softmax_double(context, x, **_) -> MatchResult:
    result = MatchResult()
    if x.dtype != ir.DataType.DOUBLE:
        return result.fail("(Log)Softmax: only float64 needs rewriting ((Log)SoftmaxGrad has float kernels)")
    return result


def _x_minus_lse(op, x, out):
    axis = out.producer().attributes.get_int("axis", -1)
    return op.Sub(x, op.ReduceLogSumExp(x, op.Constant(value_ints=[axis]), keepdims=1))


def _softmax_as_lse(op, x, out, **_):
    return op.Exp(_x_minus_lse(op, x, out))


def _log_softmax_as_lse(op, x, out, **_):
    return _x_minus_lse(op, x, out)


def _concat(op, x):
    return op.Concat(x, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["out"])


def _concat_sizes(out: ir.Value) -> tuple[int, list[int]] | None:
    """(axis, sizes along it) of the Concat producing ``out`` when every input's rank and size are known."""
    node = out.producer()
    shapes = [v.shape if v is not None else None for v in node.inputs]
    if any(s is None for s in shapes) or len({len(s) for s in shapes}) != 1:
        return None
    rank = len(shapes[0])
    axis = node.attributes.get_int("axis", 0)
    axis = axis + rank if axis < 0 else axis
    sizes = [s[axis] if 0 <= axis < rank else None for s in shapes]
    return (axis, sizes) if all(isinstance(d, int) for d in sizes) else None


def _concat_double_static(context, x, out, **_) -> MatchResult:
    result = MatchResult()
    inputs = out.producer().inputs
    if any(v is None or v.dtype != ir.DataType.DOUBLE for v in inputs):
        return result.fail("Concat: only float64 needs rewriting (SplitTraining has float kernels)")
    if _concat_sizes(out) is None:
        return result.fail("Concat: the rank or the sizes along the axis are unknown")
    return result


def _concat_as_pads(op, x, out):
    node = out.producer()
    axis, sizes = _concat_sizes(out)
    rank = len(node.inputs[0].shape)
    total, offset, parts = sum(sizes), 0, []
    for value, size in zip(node.inputs, sizes):
        pads = [0] * (2 * rank)
        pads[axis], pads[rank + axis] = offset, total - offset - size
        parts.append(op.Pad(value, op.Constant(value_ints=pads)))
        offset += size
    result = parts[0]
    for part in parts[1:]:
        result = op.Add(result, part)
    return result


rules = graphs.rule_set([RewriteRule(_castlike, _cast, _castlike_known, name="CastLikeToCast"),
                        RewriteRule(_relu, _relu_as_where, _relu_double, name="DoubleReluToWhere"),
                        RewriteRule(_softmax, _softmax_as_lse, _softmax_double, name="DoubleSoftmaxToLSE"),
                        RewriteRule(_log_softmax, _log_softmax_as_lse, _softmax_double, name="DoubleLogSoftmaxToLSE"),
                        RewriteRule(_concat, _concat_as_pads, _concat_double_static, name="DoubleConcatToPads")])


def lower_for_gradient(model: ir.Model, portable: bool = False, gradient: str = "builder") -> ir.Model:
    """Infers types, decomposes the ops the builder lacks (``passes.decompose``; recurrent layers as
    ``gradient``, the source that differentiates, needs: GRU and LSTM unrolled for a ``portable`` builder step),
    then applies ``rules`` in place; returns ``model``."""
    from onnxopt.passes.decompose import decompose

    try:
        graphs.infer_shapes(model)
    except Exception:  # NOTE: inference fails on some contrib ops; the rules then match less, nothing breaks
        pass
    from onnxopt.autodiff.control import loop_lists_as_scan_outputs, retype_sequences

    retype_sequences(model)
    loop_lists_as_scan_outputs(model)
    decompose(model, unroll_recurrent=portable, gradient=gradient)
    rules.apply_to_model(model)
    _split_repeated_inputs(model.graph)
    return model


def _split_repeated_inputs(graph: ir.Graph) -> None:
    """``Mul(w, w)`` -> ``Mul(w, Identity(w))``: the builder names both partial gradients of a graph input
    used twice by one node ``w_grad`` and fails with "Duplicate definition of name (w_grad)"."""
    for node in list(graph):
        seen = set()
        for i, value in enumerate(node.inputs):
            if value is not None and value in seen and (value.is_graph_input() or value.is_initializer()):
                copy = ir.node("Identity", [value], metadata_props=dict(node.metadata_props))
                graph.insert_before(node, copy)
                node.replace_input_with(i, copy.outputs[0])
            seen.add(value)


def widen_float_constants(model: ir.Model, dtype: ir.DataType) -> int:
    """Replaces float32 attribute constants only read through CastLike by constants of ``dtype``.

    The DSL writes a hyper-parameter as ``CastLike(Constant<value_float=@attr>, w)``; the inlined attribute
    still holds the Python float, so a double step gets the exact double value. Returns the count replaced.
    """
    if dtype != ir.DataType.DOUBLE:
        return 0
    count = 0
    for node in list(model.graph):
        attr = node.attributes.get("value_float")
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or attr is None:
            continue
        uses = list(node.outputs[0].uses())
        if not uses or any(user.op_type != "CastLike" or idx != 0 for user, idx in uses):
            continue
        node.attributes.pop("value_float")
        node.attributes["value"] = ir.AttrTensor("value", ir.tensor(np.array(attr.value, dtype=np.float64)))
        count += 1
    return count
