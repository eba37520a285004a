"""onnxopt.compat.onnxruntime_training against onnxruntime-training 1.19.2's own on-device API.

The reference runs in a subprocess (tests/ort_training_worker.py) of an environment with onnxruntime-training
and onnx < 1.17 (with newer onnx its artifacts are IR 11+, which its own runtime refuses): the interpreter
``$ONNXOPT_ORT_REFERENCE_PYTHON`` (default: the checkout's .venv312) with ``$ONNXOPT_ORT_REFERENCE_PATH``
(default: the checkout's .ort-reference, where .ci/run installs onnx 1.16.2) first on its path. Without it
these tests skip with that reason. Directions checked, for SGD and AdamW with each of the four losses:
(a) onnxopt's artifacts trained by onnxopt's api == onnxruntime's artifacts trained by its api; (b) its
artifacts trained by onnxopt's api; (c) onnxopt's artifacts trained by its api. Losses and parameters to 1e-4.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper as oh
from onnx import numpy_helper as onh

from onnxopt.compat.onnxruntime_training import api, artifacts, checkpoint_fbs
from onnxopt.errors import CheckpointError, ModelError

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("ort_training_worker.py")
LOSSES = ["MSELoss", "CrossEntropyLoss", "BCEWithLogitsLoss", "L1Loss"]
STEPS, LR = 4, 0.05


@functools.cache
def reference() -> tuple[str, dict] | str:
    """(python, environment) of the reference, or why there is none."""
    python = os.environ.get("ONNXOPT_ORT_REFERENCE_PYTHON", str(ROOT / ".venv312" / "bin" / "python"))
    path = os.environ.get("ONNXOPT_ORT_REFERENCE_PATH", str(ROOT / ".ort-reference"))
    if not Path(python).exists():
        return f"no onnxruntime-training interpreter at {python} (set ONNXOPT_ORT_REFERENCE_PYTHON)"
    env = {**os.environ, "PYTHONPATH": path}
    check = ("import onnx, onnxruntime.training.api, onnxruntime.training.artifacts; "
             "assert tuple(map(int, onnx.__version__.split('.')[:2])) < (1, 17), onnx.__version__")
    done = subprocess.run([python, "-c", check], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode:
        return (f"{python} with PYTHONPATH={path} lacks onnxruntime-training with onnx < 1.17 (.ci/run installs it; "
                f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode})")
    return python, env


def run_reference(*args) -> None:
    ref = reference()
    if isinstance(ref, str):
        pytest.skip(ref)
    python, env = ref
    done = subprocess.run([python, str(WORKER), *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def mlp(seed: int = 0, n_in: int = 4, hidden: int = 8, n_out: int = 3) -> onnx.ModelProto:
    """A torch-like MLP (Gemm transB=1, Relu, Gemm) with parameters fc1.weight, fc1.bias, fc2.weight, fc2.bias."""
    r = np.random.default_rng(seed)
    inits = [onh.from_array((r.normal(size=s) * k).astype(np.float32), n) for n, s, k in
             [("fc1.weight", (hidden, n_in), 0.5), ("fc1.bias", (hidden,), 0.1), ("fc2.weight", (n_out, hidden), 0.5),
              ("fc2.bias", (n_out,), 0.1)]]
    nodes = [oh.make_node("Gemm", ["input", "fc1.weight", "fc1.bias"], ["h"], transB=1),
             oh.make_node("Relu", ["h"], ["r"]), oh.make_node("Gemm", ["r", "fc2.weight", "fc2.bias"], ["output"], transB=1)]
    graph = oh.make_graph(nodes, "mlp", [oh.make_tensor_value_info("input", 1, ["batch", n_in])],
                          [oh.make_tensor_value_info("output", 1, ["batch", n_out])], inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)


def batches(loss: str, steps: int = STEPS, batch: int = 5) -> dict[str, np.ndarray]:
    r = np.random.default_rng(1)
    X = r.normal(size=(steps, batch, 4)).astype(np.float32)
    if loss == "CrossEntropyLoss":
        y = r.integers(0, 3, size=(steps, batch)).astype(np.int64)
    elif loss == "BCEWithLogitsLoss":
        y = r.integers(0, 2, size=(steps, batch, 3)).astype(np.float32)
    else:
        y = r.normal(size=(steps, batch, 3)).astype(np.float32)
    return {"X": X, "y": y}


def train(folder: Path, data: dict, steps: int = STEPS, lr: float | None = LR) -> dict:
    """What the worker's ``train`` records, through onnxopt's api."""
    state = api.CheckpointState.load_checkpoint(folder / "checkpoint")
    module = api.Module(folder / "training_model.onnx", state, folder / "eval_model.onnx")
    optimizer = api.Optimizer(folder / "optimizer_model.onnx", module)
    if lr is not None:
        optimizer.set_learning_rate(lr)
    losses = []
    module.train()
    for i in range(steps):
        losses.append(float(module(data["X"][i], data["y"][i])))
        optimizer.step()
        module.lazy_reset_grad()
    module.eval()
    out = {"losses": np.array(losses), "eval_loss": np.array(float(module(data["X"][0], data["y"][0]))),
           "contiguous": module.get_contiguous_parameters().numpy()}
    out.update({f"param:{k}": p.data for k, p in state.parameters})
    out.update({f"grad:{k}": p.grad for k, p in state.parameters})
    return out


def assert_same(ours: dict, theirs, what: str) -> None:
    for key in ["losses", "eval_loss", "contiguous", *(k for k in theirs if k.startswith(("param:", "grad:")))]:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-4, atol=1e-4, err_msg=f"{what}: {key}")


@pytest.mark.parametrize("optim", ["SGD", "AdamW"])
@pytest.mark.parametrize("loss", LOSSES)
def test_parity_both_directions(tmp_path, loss, optim):
    model = mlp()
    onnx.save(model, tmp_path / "mlp.onnx")
    data = batches(loss)
    np.savez(tmp_path / "data.npz", **data)
    artifacts.generate_artifacts(model, requires_grad=[i.name for i in model.graph.initializer], frozen_params=[],
                                 loss=getattr(artifacts.LossType, loss), optimizer=getattr(artifacts.OptimType, optim),
                                 artifact_directory=tmp_path / "onnxopt")
    ours = train(tmp_path / "onnxopt", data)
    start = {i.name: onh.to_array(i) for i in model.graph.initializer}
    moved = max(np.abs(ours[f"param:{k}"] - v).max() for k, v in start.items())
    assert moved > 1e-2, f"the parameters barely moved ({moved}): the comparison would not see a wrong update"
    run_reference("parity", tmp_path / "mlp.onnx", tmp_path, loss, optim, tmp_path / "data.npz", STEPS, LR)
    reference_run = np.load(tmp_path / "ort.npz")
    assert_same(ours, reference_run, "(a) onnxopt's artifacts and api vs onnxruntime-training's")
    assert_same(train(tmp_path / "ort", data), reference_run, "(b) onnxruntime-training's artifacts under onnxopt's api")
    assert_same(np.load(tmp_path / "onnxopt.npz"), reference_run, "(c) onnxopt's artifacts under onnxruntime-training's api")
    assert float(reference_run["lr"]) == pytest.approx(LR)


def test_checkpoint_round_trip(tmp_path):
    r = np.random.default_rng(0)
    ckpt = checkpoint_fbs.Checkpoint(
        requires_grad_params={"w": r.normal(size=(3, 2)).astype(np.float32), "b": np.zeros(2, np.float64)},
        frozen_params={"emb": r.integers(0, 9, size=(4,)).astype(np.int64), "s": np.array([], np.float32)},
        optimizer_groups=[checkpoint_fbs.OptimizerGroup("group0", 7, 0.25, {
            "w": {"momentum0": r.normal(size=(3, 2)).astype(np.float32), "momentum1": np.ones((3, 2), np.float32)}})],
        properties={"epoch": 3, "neg": -2**40, "rate": 0.5, "name": "é模型", "empty": ""})
    checkpoint_fbs.save(ckpt, tmp_path / "c")
    back = checkpoint_fbs.load(tmp_path / "c")
    assert back.properties == ckpt.properties and back.version == checkpoint_fbs.VERSION
    for got, want in [(back.requires_grad_params, ckpt.requires_grad_params), (back.frozen_params, ckpt.frozen_params),
                      (back.optimizer_groups[0].optimizer_states["w"], ckpt.optimizer_groups[0].optimizer_states["w"])]:
        assert list(got) == list(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
            np.testing.assert_array_equal(got[k], want[k])
    g = back.optimizer_groups[0]
    assert (g.group_name, g.step, g.initial_learning_rate) == ("group0", 7, 0.25)
    ckpt.is_nominal_state = True
    nominal = checkpoint_fbs.loads(checkpoint_fbs.dumps(ckpt))
    assert nominal.is_nominal_state and nominal.requires_grad_params["w"].shape == (3, 2)
    assert len(checkpoint_fbs.dumps(ckpt)) < len(checkpoint_fbs.dumps(back))


def test_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="file identifier"):
        checkpoint_fbs.loads(b"\x08\x00\x00\x00ORTM" + bytes(16))
    with pytest.raises(CheckpointError, match="no such file"):
        checkpoint_fbs.load(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="property 'flag'"):
        checkpoint_fbs.dumps(checkpoint_fbs.Checkpoint(properties={"flag": True}))


def test_checkpoint_from_and_to_onnxruntime(tmp_path):
    """A checkpoint onnxruntime-training saved (parameters, optimizer state, a property) reads here; one written
    here (frozen parameters, every property kind) loads in its CheckpointState with the same values."""
    model = mlp()
    onnx.save(model, tmp_path / "mlp.onnx")
    data = batches("MSELoss")
    np.savez(tmp_path / "data.npz", **data)
    run_reference("generate", tmp_path / "mlp.onnx", tmp_path / "ort", "MSELoss", "AdamW")
    run_reference("train", tmp_path / "ort", tmp_path / "data.npz", 2, tmp_path / "ort.npz")
    theirs = np.load(tmp_path / "ort.npz")
    ckpt = checkpoint_fbs.load(tmp_path / "ort" / "trained_checkpoint")
    assert ckpt.properties == {"steps": 2}
    for k, v in ckpt.requires_grad_params.items():
        np.testing.assert_array_equal(v, theirs[f"param:{k}"])
    (group,) = ckpt.optimizer_groups
    assert group.step == 2 and group.initial_learning_rate == pytest.approx(1e-3)
    assert set(group.optimizer_states) == set(ckpt.requires_grad_params)
    assert all(set(m) == {"momentum0", "momentum1"} for m in group.optimizer_states.values())
    # our api continues from their optimizer state: same first moment after one more step as recomputed
    state = api.CheckpointState.load_checkpoint(tmp_path / "ort" / "trained_checkpoint")
    assert dict(state.properties) == {"steps": 2}
    mine = checkpoint_fbs.Checkpoint(requires_grad_params={"fc1.weight": ckpt.requires_grad_params["fc1.weight"]},
                                     frozen_params={k: v for k, v in ckpt.requires_grad_params.items() if k != "fc1.weight"},
                                     properties={"i": -3, "f": 1.5, "s": "hello"})
    checkpoint_fbs.save(mine, tmp_path / "mine")
    run_reference("checkpoint", tmp_path / "mine", tmp_path / "mine.npz")
    seen = np.load(tmp_path / "mine.npz")
    assert json.loads(str(seen["properties"])) == {"i": -3, "f": 1.5, "s": "hello"}
    assert sorted(json.loads(str(seen["names"]))) == sorted(ckpt.requires_grad_params)
    for k, v in ckpt.requires_grad_params.items():
        np.testing.assert_array_equal(seen[f"param:{k}"], v)


@pytest.mark.parametrize(("warmup", "total"), [(2, 6), (3, 3), (0, 4)])
def test_linear_lr_scheduler_as_onnxruntime(tmp_path, warmup, total):
    """The rates onnxruntime-training's Python LinearLRScheduler sets (its binding swaps warmup and total)."""
    model = mlp()
    artifacts.generate_artifacts(model, requires_grad=[i.name for i in model.graph.initializer],
                                 loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=tmp_path)
    state = api.CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = api.Module(tmp_path / "training_model.onnx", state)
    optimizer = api.Optimizer(tmp_path / "optimizer_model.onnx", module)
    scheduler = api.LinearLRScheduler(optimizer, warmup, total, 0.5)
    ours = [optimizer.get_learning_rate()]
    for _ in range(8):
        optimizer.step()
        scheduler.step()
        ours.append(optimizer.get_learning_rate())
    run_reference("schedule", tmp_path, tmp_path / "rates.npy", warmup, total, 0.5)
    np.testing.assert_allclose(ours, np.load(tmp_path / "rates.npy"), rtol=1e-6)


def test_kernel_without_lowering_is_named(tmp_path):
    model = mlp()
    artifacts.generate_artifacts(model, requires_grad=[i.name for i in model.graph.initializer],
                                 loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=tmp_path)
    train_model = onnx.load(tmp_path / "training_model.onnx")
    relu = next(n for n in train_model.graph.node if n.op_type == "Relu")
    relu.op_type, relu.domain = "MadeUpGrad", "com.microsoft"
    onnx.save(train_model, tmp_path / "odd.onnx")
    state = api.CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    with pytest.raises(ModelError, match="MadeUpGrad"):
        api.Module(tmp_path / "odd.onnx", state)
    opt_model = onnx.load(tmp_path / "optimizer_model.onnx")
    opt_model.graph.node[0].op_type = "LambOptimizer"
    onnx.save(opt_model, tmp_path / "odd_optimizer.onnx")
    module = api.Module(tmp_path / "training_model.onnx", state)
    with pytest.raises(ModelError, match="LambOptimizer"):
        api.Optimizer(tmp_path / "odd_optimizer.onnx", module)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ignore_index", [None, 1])
def test_softmax_cross_entropy_loss_grad_lowering(reduction, weighted, ignore_index):
    """onnxruntime's SoftmaxCrossEntropyLossGrad lowered to standard ops == torch autograd's gradient."""
    torch = pytest.importorskip("torch")
    import onnx_ir as ir
    import onnxruntime as ort

    from onnxopt.passes.lower import lower_training_ops

    rng = np.random.default_rng(0)
    scores = rng.normal(size=(6, 4)).astype(np.float32)
    labels = np.array([0, 1, 3, 1, 2, 0], np.int64)
    weight = rng.uniform(0.5, 2.0, size=4).astype(np.float32)
    t = torch.tensor(scores, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(t, torch.tensor(labels), weight=torch.tensor(weight) if weighted else None,
                                             ignore_index=-100 if ignore_index is None else ignore_index,
                                             reduction=reduction)
    dy = np.ones(6, np.float32) * 0.5 if reduction == "none" else np.array(0.5, np.float32)
    loss.backward(torch.tensor(dy))
    inputs = ["dy", "log_prob", "labels"] + (["weight"] if weighted else [])
    attrs = {"reduction": reduction} | ({"ignore_index": ignore_index} if ignore_index is not None else {})
    node = oh.make_node("SoftmaxCrossEntropyLossGrad", inputs, ["dx"], domain="com.microsoft", **attrs)
    vi = [oh.make_tensor_value_info("dy", 1, list(dy.shape)), oh.make_tensor_value_info("log_prob", 1, [6, 4]),
          oh.make_tensor_value_info("labels", 7, [6])] + ([oh.make_tensor_value_info("weight", 1, [4])] if weighted else [])
    graph = oh.make_graph([node], "g", vi, [oh.make_tensor_value_info("dx", 1, [6, 4])])
    model = ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid("com.microsoft", 1)],
                                        ir_version=8))
    lowered = ir.to_proto(lower_training_ops(model))
    log_prob = torch.log_softmax(torch.tensor(scores), 1).numpy()
    feeds = {"dy": dy, "log_prob": log_prob, "labels": labels} | ({"weight": weight} if weighted else {})
    got = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-5, atol=1e-6)
