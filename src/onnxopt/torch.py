"""``OnnxModule``: an ONNX graph as a ``torch.nn.Module`` (optional: ``pip install -e '.[torch]'`` in the repository).

Its parameters are the ONNX weights; forward and backward run in onnxruntime through ``ForwardBackward``
inside a ``torch.autograd.Function``. Tensors cross with DLPack: on CPU neither the inputs, the weights
nor the gradients are copied (the outputs are: ORT's backward may reuse their memory). ``import onnxopt``
never imports this module.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
try:
    import torch
except ImportError as exc:  # NOTE: torch is the optional extra onnxopt[torch]
    raise ImportError(f"onnxopt.torch needs torch ({exc}); install it: pip install -e '.[torch]' in the repository") from exc

from onnxopt.errors import DataError
from onnxopt.forward_backward import ForwardBackward
from onnxopt.modelio import ModelLike

__all__ = ["OnnxModule"]


def _tensor(value) -> torch.Tensor:
    """A torch tensor over an OrtValue's memory (no copy): by DLPack, or through NumPy on CPU where the
    OrtValue has no DLPack export (stock onnxruntime's)."""
    if hasattr(value, "to_dlpack"):
        return torch.from_dlpack(value.to_dlpack())
    return torch.from_numpy(value.numpy())


class _OnnxFunction(torch.autograd.Function):
    """Forward: ``ForwardBackward.run_forward``; backward: ``run_backward`` of the same context."""

    @staticmethod
    def forward(ctx, fb: ForwardBackward, n_inputs: int, *tensors: torch.Tensor):
        # NOTE: detach so DLPack may export parameters; contiguous is a no-op for contiguous tensors.
        feeds = [t.detach().contiguous() for t in tensors]
        outputs, run = fb.run_forward(feeds[:n_inputs], feeds[n_inputs:])
        ctx.fb, ctx.run, ctx.n_inputs = fb, run, n_inputs
        # NOTE: copies: the backward may reuse the memory of ORT's outputs
        result = tuple(_tensor(o).clone() for o in outputs)
        ctx.mark_non_differentiable(*[result[i] for i in fb._no_grad])
        return result

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        fb, run = ctx.fb, ctx.run
        grads = [torch.zeros(shape, dtype=_dtype(dtype)) if g is None else g.contiguous()
                 for g, shape, dtype in zip(grads, run.shapes, run.dtypes)]
        result = dict(zip([*fb.grad_input_names, *fb.weight_names], fb.run_backward(grads, run)))
        names = [*fb.input_names, *fb.weight_names]
        wanted = ctx.needs_input_grad[2:]
        return (None, None, *[_tensor(result[n]) if need and n in result else None
                              for n, need in zip(names, wanted)])


def _dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype)).dtype


class OnnxModule(torch.nn.Module):
    """A ``torch.nn.Module`` running ``model`` in onnxruntime; its parameters are the ONNX weights.

    Args:
        model: the ONNX model (proto, ir.Model or path).
        weights: initializers to train (parameters); None = every real weight.
        inputs: model inputs that may receive a gradient; None = every float input.
        mode, tie: ``ForwardBackward``'s (Dropout and BatchNormalization; duplicated initializers as one).

    ``forward(*inputs)`` takes the model inputs in order and returns one tensor, or a tuple when the model
    has several outputs. Parameter names are the weight names with ``.`` replaced by ``_``.
    """

    def __init__(self, model: ModelLike, weights=None, inputs=None, mode: str | None = None, tie: bool = True):
        super().__init__()
        self.fb = ForwardBackward(model, weights=weights, inputs=inputs, mode=mode, tie=tie)
        self.param_names = {}
        for name, value in self.fb.get_weights().items():
            safe = name.replace(".", "_")
            self.register_parameter(safe, torch.nn.Parameter(torch.from_numpy(value)))
            self.param_names[name] = safe

    def forward(self, *inputs: torch.Tensor):
        names = self.fb.input_names
        if len(inputs) != len(names):
            raise DataError(f"inputs: expected {len(names)} tensors {names}, got {len(inputs)}")
        for name, x in zip(names, inputs):
            expected = _dtype(self.fb._dtypes[name])
            if not isinstance(x, torch.Tensor) or x.dtype != expected:
                found = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
                raise DataError(f"inputs: {name!r} must be a {expected} tensor, got {found}")
        params = [getattr(self, self.param_names[n]) for n in self.fb.weight_names]
        outputs = _OnnxFunction.apply(self.fb, len(inputs), *inputs, *params)
        return outputs[0] if len(outputs) == 1 else outputs

    def to_onnx(self) -> onnx.ModelProto:
        """The ONNX model (tied, see ``ForwardBackward``) with the current parameter values as its initializers."""
        m = ir.from_proto(ir.to_proto(self.fb.model))
        for name, safe in self.param_names.items():
            value = getattr(self, safe).detach().numpy().copy()
            m.graph.initializers[name].const_value = ir.tensor(value, name=name)
        return ir.to_proto(m)

