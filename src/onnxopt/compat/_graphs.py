"""onnxcustom's graph helpers over onnxopt's: ``add_loss_output``, ``get_train_initializer``,
``onnx_derivative`` with ``DerivativeOptions``, ``onnx_rename_weights``."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as passes

from onnxopt import atomic, loss_output
from onnxopt.dsl import losses
from onnxopt.errors import DslError, ModelError, WeightError
from onnxopt.gradient import FLOAT_TYPES, build_gradient, check_weights, gradient_ir, train_initializers
from onnxopt.modelio import ModelLike, load_model

__all__ = ["add_loss_output", "get_train_initializer", "onnx_derivative", "DerivativeOptions",
           "onnx_rename_weights"]


def get_train_initializer(onx: ModelLike) -> dict[str, tuple[np.ndarray, onnx.TensorProto]]:
    """``{name: (array, TensorProto)}`` of the weights to train (``onnxopt.train_initializers``: float
    initializers that are not shapes, axes or indices; onnxcustom listed every float initializer).
    """
    m = load_model(onx)
    protos = {t.name: t for t in ir.to_proto(m).graph.initializer}
    return {name: (array, protos[name]) for name, array in train_initializers(m).items()}


_SCORES = {"squared_error": "square", "l2": "square", "absolute_error": "absolute", "l1": "absolute",
           "elastic": "elastic"}


def _penalty_terms(tape: ir.tape.Tape, g: ir.Graph, penalty: Mapping, dtype: np.dtype) -> list[ir.Value]:
    """l1·Σ|w| + l2·Σw² for each ``{name: {'l1': a, 'l2': b}}`` (a float means ``{'l2': value}``)."""
    values = {**{v.name: v for v in g.inputs}, **g.initializers}
    const = lambda v: tape.op("Constant", [], {"value": ir.tensor(np.array(v, dtype))})  # noqa: E731
    terms = []
    for name, spec in penalty.items():
        spec = {"l2": spec} if isinstance(spec, (int, float)) else dict(spec)
        if name not in values:
            raise ModelError(f"penalty: {name!r} is not an input or initializer of the model (expected one of "
                             f"{sorted(values)[:20]})")
        unknown = set(spec) - {"l1", "l2"}
        if unknown or not any(spec.get(k) for k in ("l1", "l2")):
            raise DslError(f"penalty[{name!r}]: expected {{'l1': a, 'l2': b}} with a non-zero value, got {spec!r}")
        w = values[name]
        if spec.get("l1"):
            terms.append(tape.op("Mul", [tape.op("ReduceSum", [tape.op("Abs", [w])], {"keepdims": 0}), const(spec["l1"])]))
        if spec.get("l2"):
            terms.append(tape.op("Mul", [tape.op("ReduceSum", [tape.op("Mul", [w, w])], {"keepdims": 0}),
                                         const(spec["l2"])]))
    return terms


def add_loss_output(onx: ModelLike, score_name: str = "squared_error", loss_name: str = "loss",
                    label_name: str = "label", weight_name: str | None = None, penalty: Mapping | None = None,
                    output_index: int | str | None = None, **kwargs) -> onnx.ModelProto:
    """Adds input ``label_name`` (and ``weight_name``) and a first output ``loss_name`` shaped (1, 1), as in
    onnxcustom: Σ_i w_i·loss_i over the batch (the optimizer divides the learning rate by the batch size),
    plus ``penalty`` = ``{weight: {'l1': a, 'l2': b}}`` terms a·Σ|w| + b·Σw².

    ``score_name``: 'squared_error' ('l2'), 'absolute_error' ('l1'), 'elastic' (``l1_weight``, ``l2_weight``
    in kwargs, 0.5 each by default) or 'log': binary log loss on a probability output with two columns and
    int64 labels (N, 1), probabilities clipped to [eps, 1 − eps] (``eps``, 1e-6 by default), averaged over
    the batch as onnxcustom did.

    >>> from onnxopt.examples import linear_regression
    >>> m = add_loss_output(linear_regression(2), penalty={"coef": {"l2": 0.01}})
    >>> [i.name for i in m.graph.input], [o.name for o in m.graph.output]
    (['X', 'label'], ['loss', 'Y'])
    """
    if score_name not in _SCORES and score_name != "log":
        raise DslError(f"score_name: expected one of {sorted([*_SCORES, 'log'])}, got {score_name!r}")
    allowed = {"elastic": {"l1_weight", "l2_weight"}, "log": {"eps"}}.get(_SCORES.get(score_name, score_name), set())
    extra = set(kwargs) - allowed
    if extra:
        raise DslError(f"add_loss_output: unexpected arguments {sorted(extra)} for score_name={score_name!r}")
    m = load_model(onx)
    outputs = [v.name for v in m.graph.outputs]
    if output_index is None and len(outputs) != 1:
        raise ModelError(f"output_index: the model has {len(outputs)} outputs {outputs}; pass output_index= to pick one")
    output = output_index if isinstance(output_index, str) or output_index is None else outputs[output_index]
    produced = {o.name: o for n in m.graph for o in n.outputs}
    if label_name in produced:  # NOTE: onnxcustom renamed a result called like the label input ('label' of classifiers)
        produced[label_name].name = f"_{label_name}_"
    taken = {v.name for v in m.graph.inputs} | set(m.graph.initializers) | {o.name for n in m.graph for o in n.outputs}
    for what, name in (("label_name", label_name), ("loss_name", loss_name), ("weight_name", weight_name)):
        if name is not None and name in taken:
            raise ModelError(f"{what}: {name!r} is already a name in the model; pick another one")
    if score_name == "log":
        lm = _log_loss(m, output or outputs[0], label_name, weight_name, kwargs.get("eps", 1e-6))
    else:
        lm = _score_loss(m, score_name, output, label_name, weight_name, kwargs)
    g = lm.graph
    value = g.outputs[0]
    tape = ir.tape.Tape(g)
    value.name = f"{loss_name}/without_penalty"
    if penalty:
        for term in _penalty_terms(tape, g, penalty, value.dtype.numpy()):
            value = tape.op("Add", [value, term])
    shape = tape.op("Constant", [], {"value": ir.tensor(np.array([1, 1], np.int64))})
    g.outputs[0] = value = tape.op("Reshape", [value, shape])  # NOTE: onnxcustom's loss output is (1, 1)
    value.name, value.shape, value.dtype = loss_name, ir.Shape([1, 1]), g.inputs[0].dtype
    return ir.to_proto(lm)


def _score_loss(m: ir.Model, score_name: str, output, label_name: str, weight_name: str | None, kwargs) -> ir.Model:
    """onnxopt's add_loss_output summing the loss, its inputs renamed as onnxcustom named them."""
    if _SCORES[score_name] == "elastic":
        loss = losses.elastic(l1=kwargs.get("l1_weight", 0.5), l2=kwargs.get("l2_weight", 0.5), reduction="sum")
    else:
        loss = losses.LOSSES[_SCORES[score_name]](reduction="sum")
    lm = ir.from_proto(loss_output.add_loss_output(m, loss=loss, output=output))
    g = lm.graph
    inputs = {v.name: v for v in g.inputs}
    inputs["target"].name = label_name
    sw = inputs["sample_weight"]
    if weight_name is not None:
        sw.name = weight_name
    else:  # NOTE: an unweighted loss: a constant 1 broadcasts like a weight per sample (not an initializer)
        tape = ir.tape.Tape()
        one = tape.op("Constant", [], {"value": ir.tensor(np.ones(1, inputs["target"].dtype.numpy()))})
        ir.convenience.replace_all_uses_with(sw, one)
        g.insert_before(next(iter(g)), tape.nodes)
        g.inputs.remove(sw)
    g.outputs[0].dtype = inputs["target"].dtype
    return lm


def _log_loss(m: ir.Model, output: str, label_name: str, weight_name: str | None, eps: float) -> ir.Model:
    """−mean_i w_i·log(q_i[y_i]), q = clip(p, eps, 1 − eps) renormalised per row; p has two columns."""
    g = m.graph
    p = next(v for v in g.outputs if v.name == output)
    dtype = p.dtype.numpy()
    label = ir.Value(name=label_name, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["N", 1]))
    g.inputs.append(label)
    tape = ir.tape.Tape(g)
    const = lambda v, t=dtype: tape.op("Constant", [], {"value": ir.tensor(np.array(v, t))})  # noqa: E731
    axis = const([1], np.int64)
    clip = tape.op("Clip", [p, const(eps), const(1 - eps)])
    log = tape.op("Log", [tape.op("Div", [clip, tape.op("ReduceSum", [clip, axis], {"keepdims": 1})])])
    t = tape.op("Reshape", [tape.op("Cast", [label], {"to": ir.DataType(p.dtype)}), const([-1, 1], np.int64)])
    like = tape.op("ReduceSum", [tape.op("Mul", [log, tape.op("Concat", [tape.op("Sub", [const(1), t]), t],
                                                                         {"axis": 1})]), axis], {"keepdims": 1})
    if weight_name is not None:
        w = ir.Value(name=weight_name, type=ir.TensorType(p.dtype), shape=ir.Shape(["N"]))
        g.inputs.append(w)
        like = tape.op("Mul", [like, tape.op("Reshape", [w, const([-1, 1], np.int64)])])
    g.outputs.insert(0, tape.op("Neg", [tape.op("ReduceMean", [like], {"keepdims": 0})]))
    return m


class QuantizedWeightError(WeightError, RuntimeError):
    """An integer (quantized) initializer asked for as a weight: a ``RuntimeError`` as onnxcustom raised."""


class DerivativeOptions(enum.IntFlag):
    """onnxcustom's options of ``onnx_derivative`` (same values)."""

    Zero = 0
    KeepYieldOp = 1
    KeepOutputs = 2
    FillGrad = 4
    Loss = 5


def _float_inputs(m: ir.Model) -> list[str]:
    return [v.name for v in m.graph.inputs if v.name not in m.graph.initializers and v.dtype in FLOAT_TYPES]


def onnx_derivative(onx: ModelLike, weights: Sequence[str] | None = None, inputs: Sequence[str] | str | None = None,
                    options: DerivativeOptions = DerivativeOptions.Zero, loss: str | None = None,
                    label: Sequence[str] | str | None = None, path_name: str | None = None) -> onnx.ModelProto:
    """onnxcustom's ``onnx_derivative`` over ``onnxopt.gradient_model``.

    ``inputs=None`` differentiates every float input too (outputs ``<input>_grad``). Options: ``Zero`` (output
    gradients are inputs ``<output>_grad``), ``KeepOutputs`` (forward outputs kept), ``FillGrad`` (output
    gradients are ones), ``KeepYieldOp`` (alone: the builder's graph with its ``YieldOp``), ``Loss``
    (``loss``: the loss output, ``label``: inputs not differentiated; gradient of the loss with outputs kept,
    written to ``path_name`` when given).
    """
    if not isinstance(options, DerivativeOptions):
        raise DslError(f"options: expected a DerivativeOptions flag, got {type(options).__name__} {options!r}")
    m = load_model(onx)
    if isinstance(inputs, str):
        inputs = [inputs]
    if options == DerivativeOptions.Loss:
        if not isinstance(loss, str) or label is None:
            raise DslError(f"loss, label: DerivativeOptions.Loss needs the loss output name and the label inputs, "
                           f"got loss={loss!r}, label={label!r}")
        labels = {label} if isinstance(label, str) else set(label)
        names = [v.name for v in m.graph.outputs]
        # NOTE: onnxruntime's GradientGraphBuilder differentiates its y outputs ('label') when the loss output
        # does not exist; so does this
        keep = [v for v in m.graph.outputs if v.name == loss or (loss not in names and v.name in labels)]
        if not keep:
            raise ModelError(f"loss: {loss!r} is not an output of the model (expected one of {names})")
        m.graph.outputs.clear()
        m.graph.outputs.extend(keep)
        passes.RemoveUnusedNodesPass()(m)
        diff = [i for i in (inputs if inputs is not None else _float_inputs(m)) if i not in labels]
        grad = ir.to_proto(gradient_ir(m, _weights(m, weights), diff, True, True)[0])
        if path_name is not None:
            atomic.write(path_name, grad.SerializeToString())
        return grad
    if options & DerivativeOptions.FillGrad and not options & DerivativeOptions.KeepOutputs:
        raise ValueError(f"options: FillGrad needs KeepOutputs (as in onnxcustom), got {options!r}")
    names = _weights(m, weights)
    diff = list(inputs) if inputs is not None else _float_inputs(m)
    if options & DerivativeOptions.KeepYieldOp:
        if options != DerivativeOptions.KeepYieldOp:
            raise DslError(f"options: KeepYieldOp cannot be combined with other options, got {options!r}")
        return ir.to_proto(build_gradient(m, names, diff))
    grad, _ = gradient_ir(m, names, diff, bool(options & DerivativeOptions.KeepOutputs),
                          bool(options & DerivativeOptions.FillGrad))
    return ir.to_proto(grad)


def _weights(m: ir.Model, weights: Sequence[str] | None) -> list[str]:
    """``weights`` checked; ``[]``, or None on a model without float initializers, differentiates inputs only."""
    if weights is not None and len(weights) == 0:
        return []
    for name in [weights] if isinstance(weights, str) else weights or ():
        init = m.graph.initializers.get(name)
        if init is not None and init.dtype not in FLOAT_TYPES:
            raise QuantizedWeightError(f"weights: {name!r} is a {init.dtype.name} initializer (quantized); expected "
                                       "float weights: training quantized weights (QAT) is not implemented")
    try:
        return check_weights(m, weights)
    except WeightError:
        if weights is None and not train_initializers(m):
            return []
        raise


def onnx_rename_weights(onx: ModelLike) -> onnx.ModelProto:
    """Renames initializers ``I<k>_<name>`` in the order nodes first use them (onnxcustom's helper, which
    made names sort like the graph; onnxopt does not need it, the names are just kept consistent).

    >>> from onnxopt.examples import linear_regression
    >>> [t.name for t in onnx_rename_weights(linear_regression(2)).graph.initializer]
    ['I0_coef', 'I1_bias']
    """
    m = load_model(onx)
    seen: list[ir.Value] = []
    for node in m.graph:
        for value in node.inputs:
            if value is not None and value.name in m.graph.initializers and value not in seen:
                seen.append(value)
    renamed = {}
    for k, value in enumerate(seen):
        renamed[f"I{k}_{value.name}"] = value
    m.graph.initializers.clear()
    for name, value in renamed.items():
        value.name = name
        m.graph.register_initializer(value)
    return ir.to_proto(m)
