"""onnxcustom's graph helpers over onnxopt's: ``add_loss_output``, ``get_train_initializer``,
``onnx_derivative`` with ``DerivativeOptions``, ``onnx_rename_weights``."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as passes

from onnxopt import loss_output
from onnxopt.dsl import losses
from onnxopt.errors import DslError, ModelError
from onnxopt.gradient import FLOAT_TYPES, build_gradient, check_weights, gradient_model, train_initializers
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
    """Adds input ``label_name`` (and ``weight_name``) and a first output ``loss_name`` = Σ_i w_i·loss_i over
    the batch (onnxcustom sums, the optimizer divides the learning rate by the batch size), plus
    ``penalty`` = ``{weight: {'l1': a, 'l2': b}}`` terms a·Σ|w| + b·Σw².

    ``score_name``: 'squared_error' ('l2'), 'absolute_error' ('l1') or 'elastic' (``l1_weight``,
    ``l2_weight`` in kwargs, 0.5 each by default).

    >>> from onnxopt.examples import linear_regression
    >>> m = add_loss_output(linear_regression(2), penalty={"coef": {"l2": 0.01}})
    >>> [i.name for i in m.graph.input], [o.name for o in m.graph.output]
    (['X', 'label'], ['loss', 'Y'])
    """
    if score_name not in _SCORES:
        raise DslError(f"score_name: expected one of {sorted(_SCORES)}, got {score_name!r}")
    extra = set(kwargs) - ({"l1_weight", "l2_weight"} if score_name == "elastic" else set())
    if extra:
        raise DslError(f"add_loss_output: unexpected arguments {sorted(extra)} for score_name={score_name!r}")
    if _SCORES[score_name] == "elastic":
        loss = losses.elastic(l1=kwargs.get("l1_weight", 0.5), l2=kwargs.get("l2_weight", 0.5), reduction="sum")
    else:
        loss = losses.LOSSES[_SCORES[score_name]](reduction="sum")
    m = load_model(onx)
    outputs = [v.name for v in m.graph.outputs]
    if output_index is None and len(outputs) != 1:
        raise ModelError(f"output_index: the model has {len(outputs)} outputs {outputs}; pass output_index= to pick one")
    output = output_index if isinstance(output_index, str) or output_index is None else outputs[output_index]
    taken = {v.name for v in m.graph.inputs} | set(m.graph.initializers) | {o.name for n in m.graph for o in n.outputs}
    for what, name in (("label_name", label_name), ("loss_name", loss_name), ("weight_name", weight_name)):
        if name is not None and name in taken:
            raise ModelError(f"{what}: {name!r} is already a name in the model; pick another one")
    lm = ir.from_proto(loss_output.add_loss_output(m, loss=loss, output=output))
    g = lm.graph
    inputs = {v.name: v for v in g.inputs}
    inputs["target"].name = label_name
    dtype = inputs["target"].dtype.numpy()
    sw = inputs["sample_weight"]
    if weight_name is not None:
        sw.name = weight_name
    else:  # NOTE: an unweighted loss: a constant 1 broadcasts like a weight per sample (not an initializer)
        tape = ir.tape.Tape()
        ir.convenience.replace_all_uses_with(sw, tape.op("Constant", [], {"value": ir.tensor(np.ones(1, dtype))}))
        g.insert_before(next(iter(g)), tape.nodes)
        g.inputs.remove(sw)
    value = g.outputs[0]
    if penalty:
        value.name = f"{loss_name}/without_penalty"
        tape = ir.tape.Tape(g)
        for term in _penalty_terms(tape, g, penalty, dtype):
            value = tape.op("Add", [value, term])
        g.outputs[0] = value
    value.name = loss_name
    return ir.to_proto(lm)


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
        if loss not in names:
            raise ModelError(f"loss: {loss!r} is not an output of the model (expected one of {names})")
        keep = next(v for v in m.graph.outputs if v.name == loss)
        m.graph.outputs.clear()
        m.graph.outputs.append(keep)
        passes.RemoveUnusedNodesPass()(m)
        diff = [i for i in (inputs if inputs is not None else _float_inputs(m)) if i not in labels]
        grad = gradient_model(m, weights, diff, keep_outputs=True, fill_grad=True)
        if path_name is not None:
            onnx.save(grad, path_name)
        return grad
    if options & DerivativeOptions.KeepYieldOp:
        if options != DerivativeOptions.KeepYieldOp:
            raise DslError(f"options: KeepYieldOp cannot be combined with other options, got {options!r}")
        names = check_weights(m, weights)
        return ir.to_proto(build_gradient(m, names, list(inputs) if inputs is not None else _float_inputs(m)))
    return gradient_model(m, weights, inputs if inputs is not None else _float_inputs(m),
                          keep_outputs=bool(options & DerivativeOptions.KeepOutputs),
                          fill_grad=bool(options & DerivativeOptions.FillGrad))


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
