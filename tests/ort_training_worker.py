"""Runs onnxruntime-training 1.19's own on-device API (the reference), in a subprocess of an environment that
has it with onnx < 1.17 (its artifacts at IR <= 10). Used by tests/test_ort_training_*.py; not a test.

    python ort_training_worker.py generate MODEL DIR LOSS OPTIM   # its artifacts.generate_artifacts
    python ort_training_worker.py train DIR DATA.npz STEPS OUT.npz [LR]   # its api: losses, eval loss, parameters
    python ort_training_worker.py checkpoint PATH OUT.npz           # its CheckpointState.load_checkpoint
    python ort_training_worker.py parity MODEL DIR LOSS OPTIM DATA.npz STEPS LR  # see parity()
    python ort_training_worker.py scenarios DIR DATA.npz OUT.npz    # every SCENARIOS script, see scenario()
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


# NOTE: what may happen between ``module(X, y)`` and ``optimizer.step()`` (tests/test_ort_training_fused.py)
SCENARIOS = {
    "plain": "call0 step reset call1 step reset call2 step",
    "read_between": "call0 read step read reset call1 read step",
    "lr_between": "call0 lr0.2 step reset call1 step lr0.01 reset call2 step",
    "accumulate": "call0 call1 read step reset call2 call3 step",
    "reset_between": "call0 reset step call1 read step",
    "eval_between": "call0 eval1 step eval1 reset call1 eval2 step",
    "copy_between": "call0 scale step reset call1 scale read step",
    "write_between": "call0 set step reset call1 step",
    "two_steps": "call0 step step reset call1 step",
}


def scenario(api, folder, data, actions: str) -> dict:
    """Runs ``actions`` with ``api`` over FOLDER's artifacts (learning rate 0.05) and returns what they read, by
    position: ``call<i>``/``eval<i>`` the training/eval loss of batch i, ``step``, ``reset`` (lazy_reset_grad),
    ``lr<v>``, ``read`` the parameters and gradients, ``scale`` the parameters halved through
    get_contiguous_parameters and copy_buffer_to_parameters, ``set`` fc1.bias written; the parameters at the end."""
    state = api.CheckpointState.load_checkpoint(f"{folder}/checkpoint")
    module = api.Module(f"{folder}/training_model.onnx", state, f"{folder}/eval_model.onnx")
    optimizer = api.Optimizer(f"{folder}/optimizer_model.onnx", module)
    optimizer.set_learning_rate(0.05)
    module.train()
    out = {}
    for k, act in enumerate([*actions.split(), "read"]):
        if act.startswith(("call", "eval")):
            module.train(act.startswith("call"))
            out[f"{k}:{act}"] = np.asarray(module(data["X"][int(act[4:])], data["y"][int(act[4:])]))
            module.train()
        elif act == "step":
            optimizer.step()
        elif act == "reset":
            module.lazy_reset_grad()
        elif act.startswith("lr"):
            optimizer.set_learning_rate(float(act[2:]))
        elif act == "read":
            for name, p in state.parameters:  # NOTE: copies: onnxruntime's are views of memory it updates in place
                out[f"{k}:{name}"], out[f"{k}:{name}.grad"] = np.array(p.data), np.array(p.grad)
        elif act == "scale":
            buffer = module.get_contiguous_parameters()
            buffer.numpy()[...] *= 0.5  # NOTE: numpy() is a view of the OrtValue (onnxruntime's takes no other)
            module.copy_buffer_to_parameters(buffer)
        else:
            assert act == "set", act
            state.parameters["fc1.bias"].data = np.linspace(-1, 1, state.parameters["fc1.bias"].data.size, dtype=np.float32)
    return out


def scenarios(folder, data, out):
    from onnxruntime.training import api

    d = np.load(data)
    np.savez(out, **{f"{name}/{k}": v for name, actions in SCENARIOS.items()
                     for k, v in scenario(api, folder, d, actions).items()})


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
     "schedule": schedule, "scenarios": scenarios}[sys.argv[1]](*sys.argv[2:])
