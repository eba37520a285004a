"""Runs onnxruntime-training 1.19's own on-device API (the reference), in a subprocess of an environment that
has it with onnx < 1.17 (its artifacts at IR <= 10). Used by tests/test_ort_training_*.py; not a test.

    python ort_training_worker.py generate MODEL DIR LOSS OPTIM   # its artifacts.generate_artifacts
    python ort_training_worker.py train DIR DATA.npz STEPS OUT.npz [LR]   # its api: losses, eval loss, parameters
    python ort_training_worker.py checkpoint PATH OUT.npz           # its CheckpointState.load_checkpoint
    python ort_training_worker.py parity MODEL DIR LOSS OPTIM DATA.npz STEPS LR  # see parity()
"""

import json
import sys

import numpy as np


def generate(model, out, loss, optim):
    import onnx
    from onnxruntime.training import artifacts

    import os

    os.makedirs(out, exist_ok=True)
    m = onnx.load(model)
    artifacts.generate_artifacts(m, requires_grad=[i.name for i in m.graph.initializer], frozen_params=[],
                                 loss=getattr(artifacts.LossType, loss), optimizer=getattr(artifacts.OptimType, optim),
                                 artifact_directory=out)


def train(folder, data, steps, out, lr=None):
    from onnxruntime.training import api

    d = np.load(data)
    state = api.CheckpointState.load_checkpoint(f"{folder}/checkpoint")
    module = api.Module(f"{folder}/training_model.onnx", state, f"{folder}/eval_model.onnx")
    optimizer = api.Optimizer(f"{folder}/optimizer_model.onnx", module)
    if lr is not None:
        optimizer.set_learning_rate(float(lr))
    losses = []
    module.train()
    for i in range(int(steps)):
        losses.append(float(module(d["X"][i], d["y"][i])))
        optimizer.step()
        module.lazy_reset_grad()
    module.eval()
    eval_loss = float(module(d["X"][0], d["y"][0]))
    result = {f"param:{k}": p.data for k, p in state.parameters}
    result.update({f"grad:{k}": p.grad for k, p in state.parameters if p.grad is not None})
    state.properties["steps"] = int(steps)
    api.CheckpointState.save_checkpoint(state, f"{folder}/trained_checkpoint", include_optimizer_state=True)
    np.savez(out, losses=np.array(losses), eval_loss=np.array(eval_loss), lr=np.array(optimizer.get_learning_rate()),
             contiguous=module.get_contiguous_parameters().numpy(), **result)


def parity(model, folder, loss, optim, data, steps, lr):
    """Its artifacts of MODEL into FOLDER/ort, trained by its api (FOLDER/ort.npz); the artifacts already in
    FOLDER/onnxopt trained by its api (FOLDER/onnxopt.npz)."""
    generate(model, f"{folder}/ort", loss, optim)
    train(f"{folder}/ort", data, steps, f"{folder}/ort.npz", lr)
    train(f"{folder}/onnxopt", data, steps, f"{folder}/onnxopt.npz", lr)


def schedule(folder, out, warmup, total, lr):
    """The learning rates its LinearLRScheduler sets after construction and after each of 8 steps."""
    from onnxruntime.training import api

    state = api.CheckpointState.load_checkpoint(f"{folder}/checkpoint")
    module = api.Module(f"{folder}/training_model.onnx", state)
    optimizer = api.Optimizer(f"{folder}/optimizer_model.onnx", module)
    scheduler = api.LinearLRScheduler(optimizer, int(warmup), int(total), float(lr))
    rates = [optimizer.get_learning_rate()]
    for _ in range(8):
        optimizer.step()
        scheduler.step()
        rates.append(optimizer.get_learning_rate())
    np.save(out, np.array(rates))


def checkpoint(path, out):
    from onnxruntime.training import api

    state = api.CheckpointState.load_checkpoint(path)
    props = dict(state.properties)
    names = [k for k, _ in state.parameters]
    arrays = {}
    try:
        arrays = {f"param:{k}": state.parameters[k].data for k in names}
    except RuntimeError as e:  # a nominal state
        props["__error__"] = str(e).splitlines()[-1]
    np.savez(out, properties=np.array(json.dumps(props)), names=np.array(json.dumps(names)), **arrays)


if __name__ == "__main__":
    {"generate": generate, "train": train, "checkpoint": checkpoint, "parity": parity,
     "schedule": schedule}[sys.argv[1]](*sys.argv[2:])
