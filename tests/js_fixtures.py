"""Fixtures for the JavaScript package's tests (js/test): steps compiled here and the Python Runner's losses on
fixed batches, written as files a JS test reads (``cases.json`` names them). Used by tests/test_js.py."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import onnx

import onnxopt
from onnxopt import examples
from onnxopt.ship import PACKED_KEY, for_js

BATCH = 8


def _cnn() -> onnx.ModelProto:
    """A small CNN written by torch.onnx.export: Conv, Relu, MaxPool, Flatten, Linear on (N, 1, 8, 8)."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                              torch.nn.Linear(4 * 3 * 3, 3))
    buffer = io.BytesIO()
    torch.onnx.export(net, (torch.zeros(2, 1, 8, 8),), buffer, dynamo=False, opset_version=18, input_names=["x"],
                      output_names=["scores"], dynamic_axes={"x": {0: "N"}, "scores": {0: "N"}})
    return onnx.load_from_string(buffer.getvalue())


def _write(folder: Path, name: str, arr: np.ndarray) -> dict:
    arr = np.ascontiguousarray(arr)
    arr.tofile(folder / name)
    return {"file": name, "type": {"float32": "float32", "int64": "int64"}[arr.dtype.name], "dims": list(arr.shape)}


def _runs(path: Path, X, y, w=None) -> dict:
    """The Python Runner's losses on ``X, y`` in batches: one step per batch, and one epoch, from fresh runners."""
    runner = onnxopt.Runner(path, batch_size=BATCH)
    steps = [runner.step(X[i:i + BATCH], y[i:i + BATCH], None if w is None else w[i:i + BATCH])
             for i in range(0, len(X), BATCH)]
    out = {"steps": steps, "weights_after": {k: v.tolist() for k, v in runner.get_weights().items()}}
    if w is None:
        out["epoch"] = onnxopt.Runner(path, batch_size=BATCH).epoch(X, y).tolist()
    return out


def _two_inputs() -> onnx.ModelProto:
    """A model with two data inputs (torch.onnx.export): Linear(concat(a, b)) on (N, 2) and (N, 3)."""
    import torch

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(5, 3)

        def forward(self, a, b):
            return self.fc(torch.relu(torch.cat([a, b], 1)))

    torch.manual_seed(0)
    buffer = io.BytesIO()
    torch.onnx.export(Two(), (torch.zeros(2, 2), torch.zeros(2, 3)), buffer, dynamo=False, opset_version=18,
                      input_names=["a", "b"], output_names=["y"], dynamic_axes={"a": {0: "N"}, "b": {0: "N"}})
    return onnx.load_from_string(buffer.getvalue())


def _session_steps(step, batches: list[dict]) -> list[float]:
    """The losses of ``step.model`` run in onnxruntime one batch after another, each carried output fed to the next
    run (what a Runner does; Python's Runner refuses steps with several data inputs)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # NOTE: the weights are overridable initializers by design
    sess = ort.InferenceSession(step.model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    carried = {**step.initial_weights(), **step.initial_buffers()}
    for i in sess.get_inputs():
        if i.name in step.state:
            carried[i.name] = np.zeros((), np.int64) if i.name == "optim.step" else \
                np.zeros_like(carried[i.name.rsplit(".", 1)[0]])
    names = [o.name for o in sess.get_outputs()]
    losses = []
    for feeds in batches:
        out = dict(zip(names, sess.run(names, {**feeds, **carried})))
        losses.append(float(out[step.loss]))
        carried = {name: out[new] for name, new in step.carry.items()}
    return losses


def write_more(folder: Path) -> list[dict]:
    """Steps the Python Runner's fixed X/y cases do not cover: two data inputs (against ``_session_steps``) and
    external_grad=True (against ``Runner.step(X, output_grad=G)``)."""
    from onnxopt import dsl

    rng = np.random.default_rng(11)
    A, B = rng.standard_normal((20, 2)).astype(np.float32), rng.standard_normal((20, 3)).astype(np.float32)
    y = rng.standard_normal((20, 3)).astype(np.float32)
    step = onnxopt.compile_train_step(_two_inputs(), loss="square", update="adam", learning_rate=0.05, portable=True)
    for_js(step, batch_size=BATCH).save(folder / "two.onnx")
    batches = [{"a": A[i:i + BATCH], "b": B[i:i + BATCH], step.target: y[i:i + BATCH],
                step.sample_weight: np.ones(len(A[i:i + BATCH]), np.float32)} for i in range(0, len(A), BATCH)]
    two = {"name": "two_inputs", "step": "two.onnx", "y": _write(folder, "two.y", y), "batch": BATCH,
           "X": {"a": _write(folder, "two.a", A), "b": _write(folder, "two.b", B)}, "steps": _session_steps(step, batches)}
    X, G = rng.standard_normal((20, 4)).astype(np.float32), rng.standard_normal((20, 3)).astype(np.float32)
    step = onnxopt.compile_train_step(examples.mlp([4, 8, 3]), loss=None, external_grad=True, update="momentum",
                                      penalty=dsl.penalties.l2(0.1), learning_rate=0.05, portable=True)
    for_js(step, batch_size=BATCH).save(folder / "grad.onnx")
    runner = onnxopt.Runner(folder / "grad.onnx", batch_size=BATCH)
    losses = [runner.step(X[i:i + BATCH], output_grad=G[i:i + BATCH]) for i in range(0, len(X), BATCH)]
    grad = {"name": "external_grad", "step": "grad.onnx", "X": _write(folder, "grad.X", X),
            "output_grad": _write(folder, "grad.G", G), "batch": BATCH, "steps": losses,
            "weights_after": {k: v.tolist() for k, v in runner.get_weights().items()}}
    return [two, grad]


def write_fixtures(folder: Path, cnn: bool = True) -> dict:
    """Writes the cases (an MLP, weighted and not, and a CNN when torch is present) into ``folder``."""
    rng = np.random.default_rng(7)
    cases, folder = [], Path(folder)
    X = rng.standard_normal((44, 4)).astype(np.float32)
    y = rng.standard_normal((44, 3)).astype(np.float32)
    w = rng.uniform(0.5, 2.0, 44).astype(np.float32)
    mlp = examples.mlp([4, 16, 3])
    onnx.save(mlp, folder / "inference.onnx")
    step = onnxopt.compile_train_step(mlp, loss="square", update="adam", learning_rate=0.01,
                                       portable=True)  # NOTE: standard ONNX on the training build too
    for_js(step).save(folder / "mlp.onnx")
    # NOTE: the same step with its tensors in an external file, as onnx.save writes large models
    onnx.save_model(onnx.load(folder / "mlp.onnx"), folder / "mlp_ext.onnx", save_as_external_data=True,
                    all_tensors_to_one_file=True, location="mlp_ext.onnx.data", size_threshold=0)
    runs = _runs(folder / "mlp.onnx", X, y)
    # NOTE: a checkpoint after 3 steps, from which the JS runner must continue with steps 4.. of the Python run
    runner = onnxopt.Runner(folder / "mlp.onnx", batch_size=BATCH)
    for i in range(3):
        runner.step(X[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
    runner.save_checkpoint(folder / "mlp.ckpt", {"from": "python"})
    cases.append({"name": "mlp", "step": "mlp.onnx", "external": "mlp_ext.onnx", "X": _write(folder, "mlp.X", X),
                  "y": _write(folder, "mlp.y", y), "batch": BATCH, "checkpoint": "mlp.ckpt", "checkpoint_steps": 3,
                  **runs})
    weighted = _runs(folder / "mlp.onnx", X, y, w)
    cases.append({"name": "mlp_weighted", "step": "mlp.onnx", "X": _write(folder, "mlp.X", X),
                  "y": _write(folder, "mlp.y", y), "sample_weight": _write(folder, "mlp.w", w), "batch": BATCH,
                  **weighted})
    if cnn:
        Xc = rng.standard_normal((36, 1, 8, 8)).astype(np.float32)
        yc = rng.integers(0, 3, 36).astype(np.int64)
        step = onnxopt.compile_train_step(_cnn(), loss="cross_entropy", update="sgd", learning_rate=0.05,
                                           portable=True)
        for_js(step).save(folder / "cnn.onnx")
        cases.append({"name": "cnn", "step": "cnn.onnx", "X": _write(folder, "cnn.X", Xc),
                      "y": _write(folder, "cnn.y", yc), "batch": BATCH, **_runs(folder / "cnn.onnx", Xc, yc)})
    # NOTE: a step whose op no inference build of onnxruntime has (onnxruntime-training's ReluGrad)
    bad = onnx.load(folder / "mlp.onnx")
    sign = next(n for n in bad.graph.node if n.op_type == "Sign")
    sign.op_type, sign.domain = "ReluGrad", "com.microsoft"
    sign.input.append(sign.input[0])
    bad.opset_import.add(domain="com.microsoft", version=1)
    kept = [p for p in bad.metadata_props if p.key != PACKED_KEY]  # NOTE: the runner would load its packed form
    del bad.metadata_props[:]
    bad.metadata_props.extend(kept)
    onnx.save(bad, folder / "no_kernel.onnx")
    manifest = {"cases": cases, "inference": "inference.onnx", "no_kernel": "no_kernel.onnx",
                "no_kernel_node": sign.name, "more": write_more(folder) if cnn else []}
    (folder / "cases.json").write_text(json.dumps(manifest))
    return manifest


def write_training_fixtures(folder: Path) -> dict:
    """onnxruntime-training-format artifacts (``compat.onnxruntime_training.artifacts.generate_artifacts``) of
    three cases, and what Python's ``compat.onnxruntime_training.api`` computes on them: train and eval losses per
    batch (train, optimizer step, lazy reset, eval) and the final contiguous parameters. ``frozen``: ``bias_1``
    not trained; ``sgd``: SGD with MSE; ``nominal``: a nominal checkpoint completed by loadParametersBuffer."""
    from onnxopt.compat.onnxruntime_training import api, artifacts

    rng = np.random.default_rng(3)
    X = rng.standard_normal((32, 4)).astype(np.float32)
    labels = rng.integers(0, 3, 32).astype(np.int64)
    targets = rng.standard_normal((32, 3)).astype(np.float32)
    cases = []
    for name, loss, optim, frozen, nominal in (
            ("adamw", artifacts.LossType.CrossEntropyLoss, artifacts.OptimType.AdamW, [], False),
            ("frozen", artifacts.LossType.CrossEntropyLoss, artifacts.OptimType.AdamW, ["bias_1"], False),
            ("sgd", artifacts.LossType.MSELoss, artifacts.OptimType.SGD, [], False),
            ("nominal", artifacts.LossType.CrossEntropyLoss, artifacts.OptimType.AdamW, [], True)):
        out = folder / name
        model = examples.mlp([4, 16, 3], seed=1)
        trained = [n for n in ("coef_0", "bias_0", "coef_1", "bias_1") if n not in frozen]
        artifacts.generate_artifacts(model, requires_grad=trained, frozen_params=frozen, loss=loss, optimizer=optim,
                                     artifact_directory=out, nominal_checkpoint=nominal)
        y = labels if loss == artifacts.LossType.CrossEntropyLoss else targets
        # NOTE: nominal_checkpoint=True writes the complete checkpoint and a nominal one beside it, as onnxruntime
        state = api.CheckpointState.load_checkpoint(out / ("nominal_checkpoint" if nominal else "checkpoint"))
        module = api.Module(out / "training_model.onnx", state, out / "eval_model.onnx")
        initial = onnxopt.train_initializers(model)
        flat = np.concatenate([initial[n].ravel() for n in ("coef_0", "bias_0", "coef_1", "bias_1")])
        if nominal:
            module.copy_buffer_to_parameters(flat, trainable_only=False)
        optimizer = api.Optimizer(out / "optimizer_model.onnx", module)
        train, evals = [], []
        for i in range(0, len(X), BATCH):
            module.train()
            train.append(float(module(X[i:i + BATCH], y[i:i + BATCH])))
            optimizer.step()
            module.lazy_reset_grad()
            module.eval()
            evals.append(float(module(X[i:i + BATCH], y[i:i + BATCH])))
        cases.append({"name": name, "X": _write(out, "X", X), "y": _write(out, "y", y), "batch": BATCH, "train": train,
                      "eval": evals, "params": module.get_contiguous_parameters(trainable_only=False).numpy().tolist(),
                      "initial": flat.tolist(), "nominal": nominal, "frozen": frozen})
    (folder / "training.json").write_text(json.dumps({"cases": cases}))
    return {"cases": cases}
