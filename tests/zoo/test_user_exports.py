"""Models a user brings, outside the zoo's lists, checked as an outside user would: export with torch's
documented API, one SGD step of onnxopt (Runner and Trainer), compared with torch.optim.SGD on the same module,
weights and batch (the weights located by value, ``zoo.common.locate``)."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
import torch

import onnxopt
from zoo.common import locate

nn, F = torch.nn, torch.nn.functional
LR = 0.1


class ScaledInput(nn.Module):
    """A registered float buffer read by forward: torch never trains it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)
        self.register_buffer("scale", torch.tensor([1.5, -0.7, 0.3, 2.0]))

    def forward(self, x):
        return self.fc(x * self.scale)


class CausalDecoder(nn.Module):
    """TransformerDecoderLayer on its own input, with a causal mask built in forward."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 8)
        self.dec = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        h, n = self.inp(x), x.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        return self.out(self.dec(h, h, tgt_mask=mask)[:, -1])


def _module(cls, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    module = cls().to(dtype)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # NOTE: noise on every parameter: no two equal values (``locate`` finds them by value)
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=dtype))
    return module.eval()


def _export(module: nn.Module, x: np.ndarray, exporter: str) -> onnx.ModelProto:
    args = (torch.from_numpy(x[:4]),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            batch = torch.export.Dim("batch", min=2)
            return torch.onnx.export(module, args, dynamo=True, verbose=False, dynamic_shapes=({0: batch},)).model_proto
        buf = io.BytesIO()
        torch.onnx.export(module, args, buf, dynamo=False, input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
        return onnx.load_from_string(buf.getvalue())


def _torch_step(module: nn.Module, X: np.ndarray, y: np.ndarray) -> tuple[float, dict]:
    before = {k: p.detach().clone() for k, p in module.named_parameters()}
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    pred = module(torch.from_numpy(X))
    loss = F.mse_loss(pred, torch.from_numpy(y).reshape(pred.shape))
    loss.backward()
    opt.step()
    return loss.item(), before


def _check_first_step(cls, exporter: str, api: str, dtype=torch.float32, shape=(4,)) -> list[str]:
    module = _module(cls, dtype)
    rng = np.random.default_rng(0)
    np_dtype = np.float64 if dtype == torch.float64 else np.float32
    X, y = rng.normal(size=(16, *shape)).astype(np_dtype), rng.normal(size=16).astype(np_dtype)
    model = _export(module, X, exporter)
    w0 = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    if api == "runner":
        step = onnxopt.compile_train_step(model, loss="square", update="sgd", learning_rate=LR)
        runner = onnxopt.Runner(step)
        ours, w1, trained = runner.step(X, y), runner.get_weights(), step.weights
    else:
        est = onnxopt.Trainer(model, loss="square", update="sgd", learning_rate=LR, batch_size=16, max_iter=1,
                              shuffle=False, scale="never", tol=None).fit(X, y)
        ours, trained = est.train_losses_[0], est.train_step_.weights
        w1 = {t.name: onnx.numpy_helper.to_array(t) for t in est.trained_model_.graph.initializer}
    theirs, before = _torch_step(module, X, y)
    assert abs(ours - theirs) <= 1e-5 * abs(theirs)
    where = locate(before, {k: w0[k] for k in trained})  # NOTE: raises naming a trained non-parameter
    after = np.concatenate([p.detach().numpy().ravel() for p in module.parameters()])
    assert sum(w.size for w in where.values()) == after.size, f"trained {trained}: not every parameter"
    for name in trained:
        np.testing.assert_allclose(w1[name], after[where[name]], rtol=1e-5, atol=1e-6, err_msg=name)
    return trained


@pytest.mark.parametrize("api", ["runner", "trainer"])
def test_a_registered_buffer_of_a_dynamo_export_is_not_trained(api):
    # NOTE: the dynamo exporter marks it (InputSpec.kind BUFFER); it was trained as a weight, unlike torch
    trained = _check_first_step(ScaledInput, "dynamo", api)
    assert "scale" not in trained


def test_a_registered_buffer_of_a_torchscript_export_is_frozen_by_name():
    # NOTE: TorchScript writes no mark: the documented way is frozen=
    module = _module(ScaledInput)
    X = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    model = _export(module, X, "script")
    assert "scale" in onnxopt.train_initializers(model)
    assert "scale" not in onnxopt.compile_train_step(model, frozen=["scale"]).weights


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["dynamo", "script"])
def test_causal_decoder_layer_first_step_equals_torch(exporter):
    _check_first_step(CausalDecoder, exporter, "runner", shape=(5, 3))


def test_float64_module_first_step_equals_torch():
    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    _check_first_step(MLP, "script", "trainer", dtype=torch.float64)
