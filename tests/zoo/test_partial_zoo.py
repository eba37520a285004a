"""Partial training on the whole torch zoo: ``ForwardBackward`` and ``onnxopt.torch.OnnxModule`` give torch
autograd's outputs, input gradients and weight gradients on every export of ``zoo.models`` and
``zoo.models_more`` (each exporter the zoo uses), for the gradient ``G`` of a random ``sum(output · G)``.

The exported models are in eval mode (training-mode TorchScript exports run with ``mode="eval"``); weights
are matched to torch's parameters by value (``zoo.common.locate``), so an ONNX weight fed to another's input
fails here even where the shapes agree.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import onnxopt
from onnxopt.torch import OnnxModule
from zoo import models as Z
from zoo import models_more as M
from zoo.models import flat_gradients, load_into
from zoo.test_more_exports import CASES as MORE_CASES

CASES = [(Z, *c.split("-")) for c in Z.TORCH_CASES] + [(M, *c) for c in MORE_CASES]
# NOTE: the builder has no gradient for a reflect Pad, here on the input (test_reflect_pad_input_is_refused)
NO_INPUT_GRAD = {"pool_pad"}


def _reference(lib, name: str, exporter: str, weights: dict, X: np.ndarray, G: np.ndarray):
    """torch's output, input gradient and flat parameter gradient of sum(output · G), and where each ONNX
    weight sits among the parameters."""
    module = lib.reference_module(name, exporter)
    where = lib.locate(module, weights)
    load_into(module, weights, where)
    x = torch.from_numpy(X)
    x.requires_grad_(x.is_floating_point() and name not in NO_INPUT_GRAD)
    out = module(x)
    (out * torch.from_numpy(G)).sum().backward()
    return out.detach().numpy(), (x.grad.numpy() if x.requires_grad else None), flat_gradients(module), where


def _check(got_out, got_x, got_w, ref, tol=1e-4):
    out, gx, gw, where = ref
    np.testing.assert_allclose(got_out, out, rtol=tol, atol=tol * np.abs(out).max())
    if gx is not None:
        np.testing.assert_allclose(got_x, gx, rtol=tol, atol=tol * np.abs(gx).max(), err_msg="input gradient")
    assert sorted(got_w) == sorted(where)
    for wname, g in got_w.items():
        np.testing.assert_allclose(g, gw[where[wname]], rtol=tol, atol=tol * np.abs(gw).max(), err_msg=wname)


@pytest.mark.parametrize("lib, name, exporter", CASES, ids=[f"{n}-{e}" for _, n, e in CASES])
def test_forward_backward_and_onnx_module_equal_autograd(lib, name, exporter):
    model = lib.exported(name, exporter)
    X = lib.make_data(name, n=5)[0]
    inputs = [] if name in NO_INPUT_GRAD else None
    fb = onnxopt.ForwardBackward(model, mode="eval", inputs=inputs)
    outputs = fb.forward(X)
    out = outputs[0].copy()  # NOTE: the output shares ORT's memory, which its backward may reuse
    G = np.random.default_rng(0).normal(size=outputs[0].shape).astype(outputs[0].dtype)
    ref = _reference(lib, name, exporter, fb.get_weights(), X, G)
    grads = fb.backward([G])
    _check(out, grads.get(fb.input_names[0]), {n: grads[n] for n in fb.weight_names}, ref)

    layer = OnnxModule(model, mode="eval", inputs=inputs)
    x = torch.from_numpy(X.copy())
    x.requires_grad_(x.is_floating_point() and inputs is None)
    out = layer(x)
    (out * torch.from_numpy(G)).sum().backward()
    params = {n: getattr(layer, safe).grad.numpy() for n, safe in layer.param_names.items()}
    _check(out.detach().numpy(), x.grad.numpy() if x.requires_grad else None, params, ref)


def test_reflect_pad_input_is_refused():
    """A gradient through a reflect Pad (here of the input) is refused naming the node, not computed wrong."""
    from onnxopt.errors import ModelError

    with pytest.raises(ModelError, match="Pad node '/Pad'"):
        onnxopt.ForwardBackward(M.exported("pool_pad", "script"), mode="eval")
