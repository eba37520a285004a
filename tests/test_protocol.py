"""The step's protocol stored in a saved step drives a plain onnxruntime loop to the Runner's losses."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnxopt
from onnxopt import dsl
from onnxopt.examples import mlp
from onnxopt.protocol import PROTOCOL_KEY, loads, swap_map


def _protocol_loop(path, batches):
    """Trains the saved step with nothing but its file: roles and swap map from the metadata."""
    model = onnx.load(path)
    protocol = loads({p.key: p.value for p in model.metadata_props}[PROTOCOL_KEY])
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    role = {i["name"]: i["role"] for i in protocol["inputs"]}
    carried = {n: (inits[n] if n in inits else np.array(0, np.int64)) for n, r in role.items()
               if r in ("weight", "state", "step", "buffer")}
    carried.update({i["name"]: np.zeros_like(inits[i["like"]]) for i in protocol["inputs"] if i["role"] == "state"})
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    names, swap, losses = [o.name for o in sess.get_outputs()], swap_map(protocol), []
    for X, y in batches:
        data = {n: {"data": X, "target": y, "sample_weight": np.ones(len(X), X.dtype)}[r]
                for n, r in role.items() if r in ("data", "target", "sample_weight")}
        outs = dict(zip(names, sess.run(None, {**data, **carried})))
        losses.append(float(outs[next(o["name"] for o in protocol["outputs"] if o["role"] == "loss")]))
        carried.update({swap[n]: v for n, v in outs.items() if n in swap})
    return losses, carried


def test_saved_protocol_trains_as_the_runner(tmp_path, rng):
    model = mlp([4, 6, 1])
    for t in model.graph.initializer:  # NOTE: dotted names, as torch's: a state's weight is not its first part
        t.name = "layer." + t.name
    for n in model.graph.node:
        n.input[:] = ["layer." + i if i.startswith(("coef", "bias")) else i for i in n.input]
    step = onnxopt.compile_train_step(model, loss="square", update=dsl.updates.adam(), learning_rate=0.05)
    path = str(tmp_path / "step.onnx")
    step.save(path)
    X = rng.normal(size=(40, 4)).astype(np.float32)
    y = X.sum(axis=1).astype(np.float32)
    batches = [(X[i:i + 8], y[i:i + 8]) for i in range(0, 40, 8)]
    losses, carried = _protocol_loop(path, batches)
    runner = onnxopt.Runner(onnxopt.TrainStep.load(path))
    expected = [runner.step(X_, y_) for X_, y_ in batches]
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    for name, w in runner.get_weights().items():
        np.testing.assert_allclose(carried[name], w, rtol=1e-5, atol=1e-6)
    roles = {i["name"]: i["role"] for i in step.protocol["inputs"]}
    assert roles["optim.step"] == "step" and roles["target"] == "target" and roles["X"] == "data"
    assert sorted(n for n, r in roles.items() if r == "weight") == sorted(step.weights)


def test_a_step_saved_before_the_protocol_loads_and_a_newer_version_is_refused(tmp_path):
    step = onnxopt.compile_train_step(mlp([3, 1]))
    path = tmp_path / "step.onnx"
    step.save(path)
    model = onnx.load(path)
    props = {p.key: p.value for p in model.metadata_props}
    del model.metadata_props[:]
    model.metadata_props.add(key="onnxopt.train_step", value=props["onnxopt.train_step"])
    onnx.save(model, path)
    assert onnxopt.TrainStep.load(path).weights == step.weights
    model.metadata_props.add(key=PROTOCOL_KEY, value=json.dumps({**json.loads(props[PROTOCOL_KEY]), "version": 99}))
    onnx.save(model, path)
    with pytest.raises(onnxopt.ModelError, match="protocol version 99 is not supported"):
        onnxopt.TrainStep.load(path)
