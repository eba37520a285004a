"""Models exported by torch.onnx (dynamo at its default opset and at 18, TorchScript) train as in torch.

References are torch's own: the loss and autograd gradient of the module an export stands for
(``reference_module``: the eval-mode module, BatchNorm folded where the exporter folded it), and
``torch.optim.SGD`` for train mode. Exports in eval mode are checked in ``mode="eval"``; TorchScript
training-mode exports (``script_train``) in ``mode="eval"`` against ``module.eval()`` and, with
``Dropout(p=0)``, in ``mode="train"`` step by step against ``module.train()``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import onnxopt
from zoo.common import assert_gradients, assert_one_to_one, assert_same_outputs, first_step, predict, unchanged
from zoo.models import (TORCH_MODELS, exported, exported_module, flat_gradients, load_into, locate, loss_name,
                        make_data, reference_module, torch_loss)

BATCH = 16
EPOCHS = 6


def _mode(exporter: str) -> str:
    return "train" if exporter == "script_train" else "eval"


@functools.cache
def _first(name: str, exporter: str):
    """(onnxopt loss, onnxopt gradients, torch loss, torch gradients) on the first batch, in eval mode."""
    model = exported(name, exporter)
    X, y = make_data(name)
    X, y = X[:BATCH], y[:BATCH]
    loss, grads, weights = first_step(model, "eval", X, y, loss=loss_name(name))
    initial = {t.name: onnx_value(t) for t in model.graph.initializer if t.name in weights}
    module = reference_module(name, exporter)
    where = locate(module, initial)
    load_into(module, initial, where)  # NOTE: torch runs on the export's exact values (folding rounds)
    module.zero_grad()
    ref = torch_loss(name, module(torch.from_numpy(X)), y)
    ref.backward()
    return loss, grads, ref.item(), flat_gradients(module), where


def onnx_value(tensor) -> np.ndarray:
    import onnx.numpy_helper

    return onnx.numpy_helper.to_array(tensor)


def test_first_loss_equals_torch(torch_case):
    loss, _, ref, _, _ = _first(*torch_case)
    np.testing.assert_allclose(loss, ref, rtol=1e-5)


def test_gradient_equals_autograd(torch_case):
    _, grads, _, ref, where = _first(*torch_case)
    assert_gradients(grads, ref, where, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_only_parameters_are_trained(torch_case):
    """The trained weights are torch's parameters, every element once: no statistic, ratio or constant."""
    name, exporter = torch_case
    _, grads, _, _, where = _first(name, exporter)
    module = reference_module(name, exporter)
    assert_one_to_one(where, dict(module.named_parameters()))
    for pname in set(grads) & set(dict(module.named_parameters())):  # NOTE: a kept name is the same parameter
        start, stop = span(module, pname)
        assert start <= where[pname].min() and where[pname].max() < stop, f"{pname!r} holds other values"


def span(module, pname: str) -> tuple[int, int]:
    """[start, stop) of parameter ``pname`` in the concatenation of ``module.named_parameters()``."""
    params = list(module.named_parameters())
    start = sum(p.numel() for _, p in params[: [n for n, _ in params].index(pname)])
    return start, start + dict(params)[pname].numel()


@functools.cache
def _trained(name: str, exporter: str):
    """Trains the export ``EPOCHS`` epochs (SGD, batches of ``BATCH``) in its mode; returns the epoch mean
    losses, the export and the trained export. Training-mode exports use Dropout(p=0) here so that the
    exported model is deterministic in onnxruntime."""
    p = 0.0 if exporter == "script_train" else None
    return _train(exported(name, exporter, p), name, _mode(exporter))


def _train(model, name: str, mode: str):
    lr = TORCH_MODELS[name].lr
    step = onnxopt.compile_train_step(model, mode=mode, loss=loss_name(name), learning_rate=lr)
    runner = onnxopt.Runner(step)
    X, y = make_data(name)
    losses = []
    for _ in range(EPOCHS):
        losses.append(np.mean([runner.step(X[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(X), BATCH)]))
    return losses, model, runner.export()


def test_training_lowers_the_loss(torch_case):
    losses, _, _ = _trained(*torch_case)
    assert losses[-1] < 0.9 * losses[0], losses


def test_exported_model_predicts_better(torch_case):
    name, exporter = torch_case
    _, before, after = _trained(name, exporter)
    assert_same_outputs(before, after)
    X, y = make_data(name, n=64, seed=1)
    held_out = [float(torch_loss(name, torch.from_numpy(predict(m, X)), y)) for m in (before, after)]
    assert held_out[1] < 0.95 * held_out[0], held_out


TRAIN_CASES = [(name, "script_train") for name, spec in TORCH_MODELS.items() if spec.stateful] + [
    ("mlp_batchnorm", "script")]


def _running_statistics(model) -> list[np.ndarray]:
    inits = {t.name: onnx_value(t) for t in model.graph.initializer}
    return [inits[n.input[k]] for n in model.graph.node if n.op_type == "BatchNormalization" for k in (3, 4)]


@pytest.mark.parametrize("case", TRAIN_CASES, ids="-".join)
def test_train_mode_follows_torch_sgd(case):
    """Dropout(p=0), mode="train": 20 SGD steps give torch's losses and BatchNorm running statistics."""
    name, exporter = case
    lr = TORCH_MODELS[name].lr
    model = exported(name, exporter, 0.0)
    step = onnxopt.compile_train_step(model, mode="train", loss=loss_name(name), learning_rate=lr)
    runner = onnxopt.Runner(step)
    module = exported_module(name, exporter, 0.0).train()
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    X, y = make_data(name)
    ours, theirs = [], []
    for k in range(20):
        i = (k * BATCH) % len(X)
        xb, yb = X[i:i + BATCH], y[i:i + BATCH]
        ours.append(runner.step(xb, yb))
        opt.zero_grad()
        loss = torch_loss(name, module(torch.from_numpy(xb)), yb)
        loss.backward()
        opt.step()
        theirs.append(float(loss))
    np.testing.assert_allclose(ours, theirs, rtol=2e-4)
    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    stats = [t.numpy() for m in norms for t in (m.running_mean, m.running_var)]
    exported_stats = _running_statistics(runner.export())
    assert len(exported_stats) == len(stats)
    for ours_s, theirs_s in zip(exported_stats, stats):
        np.testing.assert_allclose(ours_s, theirs_s, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", [name for name, spec in TORCH_MODELS.items() if spec.stateful])
def test_train_mode_dropout_is_active(name):
    """TorchScript training export with Dropout(p>0), mode="train": with weights kept, steps on the
    same batch differ (a new mask each step; BatchNorm's batch statistics stay the same); training works."""
    model = exported(name, "script_train")
    X, y = make_data(name)
    step = onnxopt.compile_train_step(model, mode="train", loss=loss_name(name), update=unchanged)
    frozen = onnxopt.Runner(step)
    losses = [frozen.step(X[:BATCH], y[:BATCH]) for _ in range(4)]
    assert len(set(losses)) == len(losses), losses
    losses, _, _ = _train(model, name, "train")
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize("exporter", ["dynamo", "script"])
def test_frozen_trains_only_the_head(exporter):
    """frozen= every weight of the encoder layer: only the head moves, the rest of the export is unchanged."""
    model = exported("transformer", exporter)
    _, grads, _, _, where = _first("transformer", exporter)
    head = span(reference_module("transformer", exporter), "head.weight")[0]
    frozen = [n for n in grads if where[n].min() < head]
    step = onnxopt.compile_train_step(model, mode="eval", frozen=frozen, learning_rate=0.05)
    assert sorted(step.weights) == ["head.bias", "head.weight"]
    runner = onnxopt.Runner(step)
    X, y = make_data("transformer")
    for i in range(0, len(X), BATCH):
        runner.step(X[i:i + BATCH], y[i:i + BATCH])
    before = {t.name: onnx_value(t) for t in model.graph.initializer}
    after = {t.name: onnx_value(t) for t in runner.export().graph.initializer}
    assert before.keys() == after.keys()
    moved = sorted(n for n in before if not np.array_equal(before[n], after[n]))
    assert moved == ["head.bias", "head.weight"]


@pytest.mark.parametrize("exporter", ["dynamo", "script"])
def test_wide_relu_export_follows_torch_sgd_at_a_large_batch(exporter):
    """A wide ReLU MLP exported by torch at a batch where the Runner's CPU model masks ReluGrad with
    HardSigmoid(y·2²², alpha=2¹²⁷) and updates each bias as a (1, n) row in its Gemm (passes/batch.py): 8
    SGD steps by Runner.step and Runner.epoch give torch.optim.SGD's losses and weights."""
    from onnxopt.passes.batch import LARGE_RELU_GRAD
    from onnxopt.runner import cpu_model
    from zoo.models import export

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                 torch.nn.Linear(64, 1))
    batch = 256
    assert batch * 64 >= LARGE_RELU_GRAD
    rng = np.random.default_rng(0)
    X = rng.normal(size=(8 * batch, 16)).astype(np.float32)
    y = np.tanh(X[:, :4].sum(axis=1, keepdims=True)).astype(np.float32)
    model = export(module, X[:4], exporter)
    step = onnxopt.compile_train_step(model, loss="square", update="sgd", learning_rate=0.05)
    cpu = cpu_model(step, batch)
    ops = {n.op_type for n in cpu.model.graph.node}
    assert "HardSigmoid" in ops and "ReluGrad" not in ops and len(cpu.rows) == 3
    reference = torch.optim.SGD(module.parameters(), lr=0.05)
    theirs = []
    for i in range(0, len(X), batch):
        reference.zero_grad()
        loss = torch.nn.functional.mse_loss(module(torch.from_numpy(X[i:i + batch])), torch.from_numpy(y[i:i + batch]))
        loss.backward()
        reference.step()
        theirs.append(loss.item())
    stepped, looped = onnxopt.Runner(step, batch_size=batch), onnxopt.Runner(step, batch_size=batch)
    ours = [stepped.step(X[i:i + batch], y[i:i + batch]) for i in range(0, len(X), batch)]
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)
    np.testing.assert_allclose(looped.epoch(X, y), theirs, rtol=1e-4)
    with torch.no_grad():  # NOTE: the trained weights, through the exported model's predictions
        expected = module(torch.from_numpy(X)).numpy()
    for runner in (stepped, looped):
        np.testing.assert_allclose(predict(runner.export(), X), expected, rtol=1e-4, atol=1e-5)
