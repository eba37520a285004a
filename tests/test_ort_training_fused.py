"""The fused path of onnxopt.compat.onnxruntime_training.api keeps onnxruntime-training's semantics exactly.

The training run of the fused model also computes candidate parameters and moments, which ``Optimizer.step``
commits when nothing changed since. Each script of ``ort_training_worker.SCENARIOS`` (reads, a new learning rate,
lazy_reset_grad, eval, parameter writes between ``module()`` and ``step()``; accumulation over two calls; two
steps) runs (1) as is, (2) with every parameter written with its own value before each step, which makes every
step run the optimizer model (the unfused path), and (3) under onnxruntime-training 1.19.2's own api (the reference
of tests/test_ort_training_compat.py, skipped without it), on onnxopt's and on onnxruntime-training's artifacts.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from ort_training_worker import SCENARIOS, scenario
from test_ort_training_compat import batches, mlp, run_reference

from onnxopt.compat.onnxruntime_training import api, artifacts


class _Touching:
    """``api`` whose ``Optimizer.step`` first writes every parameter with its own value (a write, no change)."""

    def __init__(self):
        self.CheckpointState, self.Module = api.CheckpointState, api.Module

    def Optimizer(self, uri, module):  # noqa: N802  (the api's name)
        optimizer = api.Optimizer(uri, module)
        step = optimizer.step

        def touched():
            for _, p in module._state.parameters:
                p.data = p.data
            step()

        optimizer.step = touched
        return optimizer


def make(tmp_path, source: str, optim: str):
    model = mlp()
    onnx.save(model, tmp_path / "mlp.onnx")
    data = batches("CrossEntropyLoss")
    np.savez(tmp_path / "data.npz", **data)
    folder = tmp_path / source
    if source == "ort":
        run_reference("generate", tmp_path / "mlp.onnx", folder, "CrossEntropyLoss", optim)
    else:
        artifacts.generate_artifacts(model, requires_grad=[i.name for i in model.graph.initializer],
                                     loss=artifacts.LossType.CrossEntropyLoss,
                                     optimizer=getattr(artifacts.OptimType, optim), artifact_directory=folder)
    return folder, data


@pytest.mark.parametrize("optim", ["SGD", "AdamW"])
@pytest.mark.parametrize("source", ["onnxopt", "ort"])
def test_fused_step_keeps_onnxruntime_semantics(tmp_path, source, optim):
    folder, data = make(tmp_path, source, optim)
    ours = {name: scenario(api, folder, data, actions) for name, actions in SCENARIOS.items()}
    plain = {name: scenario(_Touching(), folder, data, actions) for name, actions in SCENARIOS.items()}
    for name in SCENARIOS:
        assert ours[name].keys() == plain[name].keys()
        for key, value in ours[name].items():
            np.testing.assert_allclose(value, plain[name][key], rtol=1e-6, atol=1e-7, err_msg=f"{name}: {key} (unfused)")
    run_reference("scenarios", folder, tmp_path / "data.npz", tmp_path / "ort.npz")
    theirs = np.load(tmp_path / "ort.npz")
    for name in SCENARIOS:
        for key, value in ours[name].items():
            np.testing.assert_allclose(value, theirs[f"{name}/{key}"], rtol=1e-5, atol=1e-6, err_msg=f"{name}: {key}")
    assert len(theirs.files) == sum(map(len, ours.values()))


def test_fused_step_runs_no_optimizer_model(tmp_path, monkeypatch):
    """The speed path: a step after a training call commits its candidates; a new learning rate or a parameter
    write in between runs the optimizer model instead; gradient reads, eval and lazy_reset_grad do not."""
    folder, data = make(tmp_path, "onnxopt", "AdamW")
    runs = []
    made = api._Run.__call__
    monkeypatch.setattr(api._Run, "__call__", lambda self, feeds: runs.append(self.fetch) or made(self, feeds))
    state = api.CheckpointState.load_checkpoint(folder / "checkpoint")
    module = api.Module(folder / "training_model.onnx", state, folder / "eval_model.onnx")
    optimizer = api.Optimizer(folder / "optimizer_model.onnx", module)
    X, y = data["X"][0], data["y"][0]
    def evaluate():
        module.eval()(X, y)
        module.train()

    update_runs = []
    for between in [lambda: None, lambda: [p.grad for _, p in state.parameters], module.lazy_reset_grad, evaluate,
                    lambda: optimizer.set_learning_rate(0.5),
                    lambda: state.parameters.__setitem__("fc2.bias", np.ones(3, np.float32))]:
        module.train()(X, y)
        between()
        runs.clear()
        optimizer.step()
        update_runs.append(len(runs))
    assert update_runs == [0, 0, 0, 0, 1, 1]
