"""``ForwardBackward``: an ONNX graph as one differentiable function, forward and backward run by ORT.

Built on onnxruntime-training's ``TrainingAgent`` (``gradient.TrainingAgent``): a forward run stops at the
builder's ``YieldOp`` and keeps its intermediate values in a state; a backward run resumes that state from
the output gradients. Like autograd, several forwards may be in flight; each returns its own ``Context``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from onnxopt.errors import DataError, ModelError
from onnxopt.fuse import run_part
from onnxopt.gradient import FLOAT_TYPES, SplitAgent, TrainingAgent, agent_model, split_models
from onnxopt.modelio import ModelLike

__all__ = ["ForwardBackward", "Context", "Outputs"]


class Context:
    """What one forward keeps for its backward: ORT's partial-run state, the feeds it read (their memory must
    stay alive), the OrtValues ORT read and the outputs' shapes and dtypes. ``done`` once its backward ran."""

    def __init__(self, state, feeds: list, values: list, outputs: list):
        self.state, self.feeds, self.values = state, feeds, values
        self.shapes = [tuple(o.shape()) for o in outputs]
        self.dtypes = [np.dtype(o.numpy().dtype) for o in outputs]
        self.done = False


class Outputs(list):
    """The forward outputs (NumPy arrays sharing ORT's memory) plus ``context``, the handle for backward."""

    context: Context


class ForwardBackward:
    """Forward and backward of ``model`` with respect to its inputs and weights (onnxruntime-training).

    Args:
        model: the ONNX model (proto, ir.Model or path).
        weights: initializers to differentiate; None = every real weight (``train_initializers``).
        inputs: model inputs whose gradient backward returns; None = every float input, ``[]`` = none.
        device: "cpu" or "cuda".
        mode: "train" or "eval" for Dropout and BatchNormalization (``compile_train_step``'s meaning, running
            statistics not updated); None = each node as its ``training_mode`` says.
        gradient: "onnxopt" (its rules; two sessions of any onnxruntime, ``gradient.SplitAgent``) or "builder"
            (onnxruntime-training's ``TrainingAgent``); None = ``gradient.gradient_source``'s default.
        tie: duplicated initializers as one weight (``compile_train_step``'s ``tie``); ``model`` is then the
            tied model.

    The weights live in ``ForwardBackward`` as OrtValues (``get_weights``/``set_weights``) unless a call
    passes ``weights=``. ``forward`` returns copies of ORT's outputs (its backward may reuse their memory).
    """

    def __init__(self, model: ModelLike, weights: Sequence[str] | None = None,
                 inputs: Sequence[str] | None = None, device: str = "cpu", mode: str | None = None,
                 tie: bool = True, gradient: str | None = None):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
        # NOTE: the compiler's load, tie and weights stages; the gradient builder applies ``mode`` itself (stats=())
        part = run_part(model, ("load", "tie", "weights"), weights=weights, tie=tie, gradient=gradient, stats=())
        self.model = m = part.model
        self.ties, self.weight_names = part.ties, part.names
        self.input_names = [v.name for v in m.graph.inputs if v.name not in m.graph.initializers]
        self.output_names = [v.name for v in m.graph.outputs]
        types = {v.name: v.dtype for v in m.graph.inputs}
        if inputs is None:
            inputs = [n for n in self.input_names if types[n] in FLOAT_TYPES]
        inputs = [inputs] if isinstance(inputs, str) else list(inputs)
        for name in inputs:
            if name not in self.input_names:
                raise ModelError(f"inputs: {name!r} is not an input of the model "
                                 f"(expected some of {self.input_names})")
            if types[name] not in FLOAT_TYPES:
                raise ModelError(f"inputs: {name!r} has no gradient (expected a float input, "
                                 f"found {types[name]})")
        self.grad_input_names = [n for n in self.input_names if n in inputs]
        self._dtypes = {n: ir.DataType(types[n]).numpy() for n in self.input_names}
        if part.source == "builder":
            proto, self._no_grad = agent_model(m, self.weight_names, self.grad_input_names, mode)
            self._agent = TrainingAgent(proto, len(self.output_names), device)
        else:
            fwd, bwd, _, self._no_grad = split_models(m, self.weight_names, self.grad_input_names, mode)
            self._agent = SplitAgent(fwd, bwd, len(self.output_names), device, [*self.input_names, *self.weight_names])
        # NOTE: an OrtValue over NumPy memory does not own it: the arrays stay here, the OrtValues share them.
        self._arrays = {n: np.array(value.numpy()) for n, value in part.initial.items()}
        self._weights = {n: self._agent.ortvalue(a) for n, a in self._arrays.items()}
        self._pending: list[Context] = []

    # -- weights -----------------------------------------------------------------------------------------
    def get_weights(self) -> dict[str, np.ndarray]:
        """Copies of the weights ``forward`` uses."""
        return {name: value.copy() for name, value in self._arrays.items()}

    def set_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """Overwrites some weights in place (a forward in flight sees the new values in its backward)."""
        for name, value in weights.items():
            if name not in self._weights:
                raise DataError(f"weights: {name!r} is not a trained weight "
                                f"(expected one of {self.weight_names})")
            ref, arr = self._arrays[name], np.asarray(value)
            if arr.shape != ref.shape or arr.dtype != ref.dtype:
                raise DataError(f"weights: {name!r} is {arr.dtype}{list(arr.shape)}, "
                                f"expected {ref.dtype}{list(ref.shape)}")
            ref[...] = arr

    # -- raw runs (OrtValues in and out; onnxopt.torch uses these) -----------------------------------------
    def run_forward(self, inputs: Sequence, weights: Sequence | None = None) -> tuple[list, Context]:
        """Forward on model inputs (in ``input_names`` order) and weights (``weight_names`` order, default the
        stored ones), each an array, OrtValue or DLPack producer; returns (OrtValues, context).

        The outputs are ORT's own memory, which its backward may reuse for other values: read or copy them
        before ``run_backward``."""
        feeds = [*inputs, *(weights if weights is not None else self._weights.values())]
        values = [self._agent.ortvalue(f) for f in feeds]
        outputs, state = self._agent.forward(values)
        return outputs, Context(state, feeds, values, outputs)

    def run_backward(self, output_grads: Sequence, ctx: Context) -> list:
        """Backward of ``ctx``'s forward from the gradients of its differentiable outputs; returns
        OrtValues in ``grad_input_names`` then ``weight_names`` order."""
        if ctx.done:
            raise DataError("ctx: the backward of this forward already ran (expected a forward in flight)")
        grads = [g for i, g in enumerate(output_grads) if i not in self._no_grad]
        result = self._agent.backward(grads, ctx.state)
        ctx.done, ctx.state, ctx.feeds, ctx.values = True, None, None, None
        return result

    # -- NumPy API -----------------------------------------------------------------------------------------
    def _inputs(self, inputs) -> list[np.ndarray]:
        if isinstance(inputs, Mapping):
            unknown = [n for n in inputs if n not in self.input_names]
            missing = [n for n in self.input_names if n not in inputs]
            if unknown or missing:
                raise DataError(f"inputs: unknown {unknown}, missing {missing}; expected {self.input_names}")
            inputs = [inputs[n] for n in self.input_names]
        elif isinstance(inputs, np.ndarray) or not isinstance(inputs, Sequence):
            inputs = [inputs]
        if len(inputs) != len(self.input_names):
            raise DataError(f"inputs: expected {len(self.input_names)} arrays {self.input_names}, "
                            f"got {len(inputs)}")
        # NOTE: copies only when the dtype or layout differ; otherwise ORT reads the caller's array.
        return [np.ascontiguousarray(x, dtype=self._dtypes[n]) for n, x in zip(self.input_names, inputs)]

    def forward(self, inputs, requires_grad: bool = True) -> Outputs:
        """Runs the model on ``inputs`` (an array, a list in ``input_names`` order or a dict by name).

        Returns the outputs as a list of arrays whose ``context`` attribute is the handle for ``backward``;
        ``requires_grad=False`` keeps nothing for a backward (inference).
        """
        outputs, ctx = self.run_forward(self._inputs(inputs))
        # NOTE: copies: ORT's backward may reuse an output's memory (run_forward's note)
        result = Outputs(np.array(o.numpy()) for o in outputs)
        if requires_grad:
            result.context = ctx
            self._pending.append(ctx)
        else:
            ctx.done, ctx.state, ctx.values = True, None, None
            result.context = ctx
        return result

    def backward(self, output_grads, ctx: Context | Outputs | None = None) -> dict[str, np.ndarray]:
        """Gradients of ``sum(output · output_grad)`` for one forward: ``ctx`` (its ``Outputs`` or
        ``Context``), by default the latest forward without backward (last in, first out).

        ``output_grads``: an array, a list in ``output_names`` order or a dict by name; None for an output
        means zeros. Returns {input or weight name: gradient}.
        """
        ctx = ctx.context if isinstance(ctx, Outputs) else ctx
        if ctx is None:
            if not self._pending:
                raise DataError("backward: no forward in flight (expected forward(inputs) before backward)")
            ctx = self._pending[-1]
        grads = self._output_grads(output_grads, ctx)
        result = self.run_backward(grads, ctx)
        if ctx in self._pending:
            self._pending.remove(ctx)
        return {n: _owned(v, grads) for n, v in zip([*self.grad_input_names, *self.weight_names], result)}

    def _output_grads(self, grads, ctx: Context) -> list[np.ndarray]:
        if isinstance(grads, Mapping):
            unknown = [n for n in grads if n not in self.output_names]
            if unknown:
                raise DataError(f"output_grads: {unknown} are not outputs "
                                f"(expected some of {self.output_names})")
            grads = [grads.get(n) for n in self.output_names]
        elif isinstance(grads, np.ndarray) or not isinstance(grads, Sequence):
            grads = [grads]
        if len(grads) != len(self.output_names):
            raise DataError(f"output_grads: expected {len(self.output_names)} {self.output_names}, "
                            f"got {len(grads)}")
        out = []
        for name, g, shape, dtype in zip(self.output_names, grads, ctx.shapes, ctx.dtypes):
            g = np.zeros(shape, dtype) if g is None else np.asarray(g)
            if g.shape != shape or g.dtype != dtype:
                raise DataError(f"output_grads: gradient of {name!r} is {g.dtype}{list(g.shape)}, expected "
                                f"{dtype}{list(shape)} (the forward output's)")
            out.append(np.ascontiguousarray(g))
        return out


def _owned(value, feeds: list) -> np.ndarray:
    """``value`` as an array sharing ORT's memory, copied when ORT returned a feed's own buffer (an Identity
    path): an OrtValue does not keep the NumPy array it wraps alive."""
    ptr = value.data_ptr()
    if any(isinstance(f, np.ndarray) and f.ctypes.data == ptr for f in feeds):
        return value.numpy().copy()
    return value.numpy()
