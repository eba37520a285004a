"""The Runner's parts, each alone: the buffer ring (``ring``), the sessions and bindings (``sessions``), the epoch
loop (``epochs``), the roles read from the step's protocol (``protocol.Roles``), checkpoints and export."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnxopt
from onnxopt.checkpoint import restore_arrays, save_arrays
from onnxopt.epochs import EpochLoop
from onnxopt.errors import CheckpointError, DataError
from onnxopt.examples import mlp
from onnxopt.protocol import PROTOCOL_KEY, STEP, Roles
from onnxopt.ring import N_SETS, BufferRing
from onnxopt.runner import Runner
from onnxopt.sessions import StepSessions


@pytest.fixture(scope="module")
def sgd_step():
    return onnxopt.compile_train_step(mlp([3, 4, 1], seed=0), update="sgd", learning_rate=0.1)


def _data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 3)).astype(np.float32)
    return X, (X.sum(axis=1) > 0).astype(np.float32)


def _ring(step):
    roles = Roles.of(step)
    return BufferRing(step.initial_weights(), [*roles.weights, *roles.state], {}, np.dtype(np.float32), "cpu")


def test_ring_sets_advance_and_step_back(sgd_step):
    ring = _ring(sgd_step)
    w = sgd_step.initial_weights()
    for k in range(N_SETS):  # NOTE: every set starts from the initial weights, the counter at 0
        assert all(np.array_equal(ring.sets[k][n].numpy(), a) for n, a in w.items())
    assert ring.step_count == 0 and not ring.step_back()
    ring.advance()
    assert ring.current == 1 and ring.previous_valid
    assert ring.step_back() and ring.current == 0 and not ring.previous_valid
    for _ in range(N_SETS):
        ring.advance()
    assert ring.current == 0
    name = sgd_step.weights[0]
    ring.write({name: np.zeros_like(w[name])})  # NOTE: the current set only; a write forgets the previous
    assert not ring.previous_valid and not ring.read([name])[name].any()
    assert np.array_equal(ring.sets[1][name].numpy(), w[name])
    with pytest.raises(DataError, match=r"weights: 'nope' is not a trained weight or state"):
        ring.write({"nope": np.zeros(1)})
    with pytest.raises(DataError, match=rf"weights: '{name}' has shape \(1,\), expected"):
        ring.write({name: np.zeros(1)})


def test_ring_packs_share_one_buffer():
    w = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(2, np.float32)}
    ring = BufferRing(w, ["a", "b", "a.m", "b.m", STEP], {"pack": ["a", "b"]}, np.dtype(np.float32), "cpu")
    for k in range(N_SETS):
        flat = ring.sets[k]["pack"].numpy()
        assert np.array_equal(flat, np.r_[w["a"].ravel(), w["b"]])
    assert ring.bound == ["pack", "a.m", "b.m", STEP]  # NOTE: the pack is bound, not its members
    ring.hosts[0][0][:] = 7  # NOTE: the members are views of the pack's host buffer
    assert (ring.read(["a", "b"])["a"] == 7).all()


def test_sessions_fixed_rows_and_second_session(sgd_step):
    ring = _ring(sgd_step)
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    roles = Roles.of(sgd_step)
    sessions = StepSessions(sgd_step.model, sgd_step.initial_weights(), roles.data[0], 8, opts,
                            ["CPUExecutionProvider"], ring, roles.loss)
    assert sessions.fixed_rows == 8 and sessions.session.get_inputs()[0].shape[0] == 8
    assert len(sessions.raw) == N_SETS
    made = sessions.bindings_of(sessions.free)
    assert sessions.bindings_of(sessions.free) is not None and len(sessions.extra) == 1 and made[1] is \
        sessions.extra[id(sessions.free)][3]
    free = StepSessions(sgd_step.model, sgd_step.initial_weights(), roles.data[0], None, opts,
                        ["CPUExecutionProvider"], ring, roles.loss)
    assert free.fixed_rows is None and not isinstance(free.session.get_inputs()[0].shape[0], int)
    X, y = _data(8)  # NOTE: a run through binding 0 writes the loss into set 0's host scalar and set 1's weights
    binding = sessions.bindings[0]
    binding.bind_cpu_input(roles.data[0], X)
    binding.bind_cpu_input(roles.target, y.reshape(-1, 1))
    if roles.sample_weight is not None:
        binding.bind_cpu_input(roles.sample_weight, np.ones(8, np.float32))
    sessions.session.run_with_iobinding(binding)
    assert np.isfinite(sessions.loss_host[0]) and sessions.loss_host[0] > 0
    assert int(ring.sets[1][STEP].numpy()) == 1 and int(ring.sets[0][STEP].numpy()) == 0


def test_epoch_loop_matches_steps():
    step = onnxopt.compile_train_step(mlp([3, 4, 1], seed=0), loss="square", update="sgd", learning_rate=0.1)
    X, y = _data(40)
    one = Runner(step, batch_size=8)
    by_step = [one.step(X[i:i + 8], y[i:i + 8]) for i in range(0, 40, 8)]
    looped = Runner(step, batch_size=8)
    assert isinstance(looped._epochs, EpochLoop)
    losses = looped.epoch(X, y)
    assert looped.n_runs == 1  # NOTE: one Scan run for the five batches
    np.testing.assert_array_equal(losses, by_step)
    for name, w in one.get_weights().items():
        np.testing.assert_array_equal(looped.get_weights()[name], w)
    assert looped._epochs.model is not None and any(n.op_type == "Scan" for n in looped._epochs.model.graph.node)


def test_roles_read_from_the_protocol(sgd_step, tmp_path):
    roles = Roles.of(sgd_step)
    assert roles.data == sgd_step.inputs and roles.target == sgd_step.target
    assert roles.weights == sgd_step.weights and roles.state == sgd_step.state and roles.loss == "loss"
    assert roles.swap == {n + ".new": n for n in [*sgd_step.weights, STEP]}
    assert Roles.of(sgd_step.protocol) == roles
    # NOTE: a step saved before the protocol existed (no metadata) loads, and its roles come from its fields
    path = tmp_path / "old.onnx"
    sgd_step.save(path)
    model = onnx.load(path)
    keep = [p for p in model.metadata_props if p.key != PROTOCOL_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    onnx.save(model, path)
    old = onnxopt.TrainStep.load(path)
    assert Roles.of(old) == roles
    X, y = _data(8)
    assert Runner(old).step(X, y) == Runner(sgd_step).step(X, y)


def test_roles_of_a_gradient_only_step_carry_no_counter(sgd_step):
    protocol = json.loads(json.dumps(sgd_step.protocol))
    protocol["outputs"] = [o for o in protocol["outputs"] if o.get("feeds") != STEP]
    assert STEP not in Roles.of(protocol).state


def test_checkpoint_restore_checks_kind_and_shapes(tmp_path):
    current = {"w": np.zeros((2, 2), np.float32)}
    save_arrays(tmp_path / "c", {"w": np.ones((2, 2), np.float32)}, {"kind": "onnxopt.Runner"})
    arrays, meta = restore_arrays(tmp_path / "c", current, "onnxopt.Runner")
    assert meta["kind"] == "onnxopt.Runner" and arrays["w"].sum() == 4
    with pytest.raises(CheckpointError, match=r"was written by 'onnxopt.Runner', expected 'onnxopt.Trainer'"):
        restore_arrays(tmp_path / "c", current, "onnxopt.Trainer")
    with pytest.raises(CheckpointError):
        restore_arrays(tmp_path / "c", {"w": np.zeros(3, np.float32)})


def test_inference_model_writes_values(sgd_step):
    values = {n: np.full_like(a, 0.5) for n, a in sgd_step.initial_weights().items()}
    model = sgd_step.inference_model(values)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    assert all(np.array_equal(inits[n], v) for n, v in values.items())
    X, _ = _data(4)
    out = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": X})[0]
    assert out.shape == (4, 1)
