"""Runner.epoch: the full batches of an epoch in one run of an ONNX Scan (passes/epoch.py). The reference is
Runner.step once per batch: same losses, weights, state and step count, bit for bit, and the same errors."""

import contextlib

import numpy as np
import pytest

import onnxopt
from onnxopt.errors import ConvergenceError, DataError
from onnxopt.examples import linear_regression, mlp


@pytest.fixture
def data(rng):
    X = rng.normal(size=(70, 4)).astype(np.float32)
    score = X @ np.array([1.0, -2.0, 0.5, 0.0], np.float32)
    return X, score, (score > 0).astype(np.float32), (score > 0.5).astype(np.int64) + (score > -0.5)


def _pair(step, **kw):
    return onnxopt.Runner(step, **kw), onnxopt.Runner(step, **kw)


def _per_step(runner, X, y, batch, sample_weight=None):
    return np.array([runner.step(X[i:i + batch], y[i:i + batch],
                                 None if sample_weight is None else sample_weight[i:i + batch])
                     for i in range(0, len(X), batch)])


def _assert_same(a, b):
    assert a.step_count == b.step_count
    for got, want in ((a.get_weights(), b.get_weights()), (a.get_state(), b.get_state())):
        assert got.keys() == want.keys()
        for name in got:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("update", ["sgd", "nesterov", "adam", "adamw"])
@pytest.mark.parametrize("loss, sizes, target", [("square", [4, 6, 3, 1], 1), ("log", [4, 5, 1], 2),
                                                 ("cross_entropy", [4, 5, 3], 3)])
def test_epoch_is_one_step_per_batch_bit_for_bit(data, update, loss, sizes, target):
    X, y = data[0], data[target]
    looped, stepped = _pair(onnxopt.compile_train_step(mlp(sizes, seed=1), loss=loss, update=update,
                                                       learning_rate=0.05), batch_size=8)
    for _ in range(3):  # NOTE: 8 full batches in one run, then the last (6 rows) as a step
        np.testing.assert_array_equal(looped.epoch(X, y), _per_step(stepped, X, y, 8))
    assert looped.n_runs == 6 and stepped.n_runs == 27
    _assert_same(looped, stepped)
    looped.step(X[:5], y[:5])  # NOTE: steps and epochs mix: both read the same buffer sets
    stepped.step(X[:5], y[:5])
    np.testing.assert_array_equal(looped.epoch(X, y, batch_size=10), _per_step(stepped, X, y, 10))
    _assert_same(looped, stepped)


def test_epoch_of_a_portable_float64_step(data):
    X, y = data[0].astype(np.float64), data[1].astype(np.float64)
    step = onnxopt.compile_train_step(mlp([4, 6, 1], seed=2, dtype=np.float64), loss="absolute",
                                      update="momentum", learning_rate=0.01, portable=True)
    looped, stepped = _pair(step, batch_size=7)
    np.testing.assert_array_equal(looped.epoch(X, y), _per_step(stepped, X, y, 7))
    _assert_same(looped, stepped)


def test_epoch_carries_batchnorm_statistics_of_a_torch_export(data, tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(), torch.nn.Linear(6, 1))
    path = tmp_path / "bn.onnx"
    torch.onnx.export(net.train(), (torch.zeros(8, 4),), str(path), dynamo=False, input_names=["X"],
                      dynamic_axes={"X": {0: "n"}}, training=torch.onnx.TrainingMode.TRAINING)
    step = onnxopt.compile_train_step(str(path), loss="square", update="adam", learning_rate=0.01, mode="train")
    assert step.buffers  # NOTE: the running mean and variance, carried by the Scan as by the step
    looped, stepped = _pair(step, batch_size=8)
    for _ in range(2):
        np.testing.assert_array_equal(looped.epoch(data[0], data[1]), _per_step(stepped, data[0], data[1], 8))
    _assert_same(looped, stepped)


@pytest.mark.parametrize("layer", ["dropout", "maxpool"])
def test_steps_a_loop_cannot_repeat_run_one_step_per_batch(data, tmp_path, layer):
    """Dropout draws its masks in the Scan body's own kernel (passes.epoch.scannable): its epochs are one step
    per batch, the same numbers. MaxPool's gradient by onnxopt's rules is a ScatterElements, which runs in the
    Scan (the builder's MaxPoolGrad crashes onnxruntime-training in a subgraph): one run, the same numbers."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)

    class Pool(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.max_pool1d(x.unsqueeze(1), 2).flatten(1)

    middle = torch.nn.Dropout(0.5) if layer == "dropout" else Pool()
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), middle, torch.nn.Linear(6 if layer == "dropout" else 3, 1))
    path = tmp_path / "m.onnx"
    torch.onnx.export(net.train(), (torch.zeros(8, 4),), str(path), dynamo=False, input_names=["X"],
                      dynamic_axes={"X": {0: "n"}}, training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    looped, stepped = _pair(onnxopt.compile_train_step(str(path), learning_rate=0.01), batch_size=8)
    np.testing.assert_array_equal(looped.epoch(data[0], data[1]), _per_step(stepped, data[0], data[1], 8))
    assert stepped.n_runs == 9 and looped.n_runs == (9 if layer == "dropout" else 2)
    _assert_same(looped, stepped)


def test_sample_weights_and_large_steps_run_one_step_per_batch(data, monkeypatch):
    X, y = data[0], data[1]
    sw = np.linspace(0.5, 2.0, len(X)).astype(np.float32)
    looped, stepped = _pair(onnxopt.compile_train_step(mlp([4, 6, 1], seed=3), update="adam"), batch_size=8)
    np.testing.assert_array_equal(looped.epoch(X, y, sample_weight=sw), _per_step(stepped, X, y, 8, sw))
    _assert_same(looped, stepped)
    assert looped.n_runs == 9
    monkeypatch.setattr(onnxopt.runner, "SMALL_STEP", 10)  # NOTE: parameters × batch above it: one run per step
    np.testing.assert_array_equal(looped.epoch(X, y), _per_step(stepped, X, y, 8))
    assert looped.n_runs == 18
    _assert_same(looped, stepped)


def test_diverging_epoch_stops_with_the_weights_of_the_last_finite_loss(data):
    X, y = data[0], data[1] * 100
    looped, stepped = _pair(onnxopt.compile_train_step(mlp([4, 6, 1], seed=4), learning_rate=3.0), batch_size=8)
    with pytest.raises(ConvergenceError) as expected:
        _per_step(stepped, X, y, 8)
    with pytest.raises(ConvergenceError, match=r"^batch (\d+): loss became (nan|inf)") as got:
        looped.epoch(X, y)
    assert str(got.value).split(": ", 1)[1] == str(expected.value)
    _assert_same(looped, stepped)


@pytest.mark.parametrize("lr, failing", [(0.028, 9), (0.02, 34), (0.017, 45)])
def test_divergence_after_whole_loop_epochs_goes_back_like_steps(rng, lr, failing):
    """Epochs of 8 full batches are one Scan run each: a divergence in a later epoch (step 9 is the first
    step after a Scan) goes back to the weights that gave the last finite loss, the Scan's last inputs."""
    X = rng.normal(size=(64, 4)).astype(np.float32)
    y = (X @ np.array([1.0, -2.0, 0.5, 0.0], np.float32)) * 30
    looped, stepped = _pair(onnxopt.compile_train_step(mlp([4, 6, 1], seed=4), learning_rate=lr), batch_size=8)
    for _ in range(10):
        with pytest.raises(ConvergenceError) if failing <= stepped.step_count + 8 else contextlib.nullcontext() as expected:
            _per_step(stepped, X, y, 8)
        with pytest.raises(ConvergenceError) if expected is not None else contextlib.nullcontext() as got:
            looped.epoch(X, y)
        if expected is not None:
            break
    assert f"loss became inf at step {failing};" in str(expected.value)
    assert str(got.value) == f"batch {(failing - 1) % 8 + 1}: {expected.value}"
    _assert_same(looped, stepped)


def test_refused_loop_keeps_the_weights_a_divergence_goes_back_to(rng):
    """A Scan whose batches onnxruntime refuses leaves every buffer set as it was: the next step that
    diverges still goes back to the last Scan's last inputs."""
    X = rng.normal(size=(64, 4)).astype(np.float32)
    y = (X @ np.array([1.0, -2.0, 0.5, 0.0], np.float32)) * 30
    looped, stepped = _pair(onnxopt.compile_train_step(mlp([4, 6, 1], seed=4), learning_rate=0.028), batch_size=8)
    looped.epoch(X, y)
    _per_step(stepped, X, y, 8)
    with pytest.raises(DataError, match="onnxruntime refused it"):
        looped.epoch(np.zeros((64, 5), np.float32), y)
    for runner in (looped, stepped):  # NOTE: step 9 diverges (test above)
        with pytest.raises(ConvergenceError, match="at step 9; .* last finite loss \\(step 8\\)"):
            runner.step(X[:8], y[:8])
    _assert_same(looped, stepped)


def test_finite_losses_with_overflowing_weights_replay_as_steps():
    """The Scan's last update overflows while its losses are finite: the epoch is replayed step by step, so the
    last batch's non-finite loss goes back to the weights of the last finite loss, as after Runner.step."""
    X = np.array([[0.5, 0.0], [1.0, 0.0], [0.0, 1e300], [1.0, 1.0]])  # NOTE: coef[1] is 0 until step 3
    y = np.array([1.0, 2.0, 1e10, 0.0])  # NOTE: loss 3 ~1e20, its gradient for coef[1] -2e310
    looped, stepped = _pair(onnxopt.compile_train_step(linear_regression(2, np.float64), learning_rate=0.1),
                            batch_size=1)
    for runner in (looped, stepped):
        runner.set_weights({"coef": np.array([[0.3], [0.0]]), "bias": np.zeros(1)})
    with pytest.raises(ConvergenceError) as expected:
        _per_step(stepped, X, y, 1)
    with pytest.raises(ConvergenceError, match=r"^batch 4: loss became (nan|inf|-inf) at step 4") as got:
        looped.epoch(X, y)
    assert str(got.value) == "batch 4: " + str(expected.value) and looped.n_runs == 1 + 4  # NOTE: Scan, replay
    assert np.isfinite(looped.get_weights()["coef"]).all()
    _assert_same(looped, stepped)


def test_epoch_refuses_bad_batches_like_step(data):
    X, y = data[0], data[1]
    runner = onnxopt.Runner(onnxopt.compile_train_step(mlp([4, 3, 1])), batch_size=8)
    weights = runner.get_weights()
    with pytest.raises(DataError, match=r"^batch: y: expected one row per sample of X, got shape \(69,\)"):
        runner.epoch(X, y[:-1])
    with pytest.raises(DataError, match=r"^batch: sample_weight: expected shape \(70,\) .* got \(69,\)"):
        runner.epoch(X, y, sample_weight=np.ones(69))
    with pytest.raises(DataError, match=r"^batch: onnxruntime refused it .* expected X\[.*4\] tensor\(float\)"):
        runner.epoch(X[:, :3], y)
    with pytest.raises(DataError, match=r"^batch_size: expected an integer >= 1, got 0"):
        runner.epoch(X, y, batch_size=0)
    for name, value in runner.get_weights().items():  # NOTE: refused before any step ran
        np.testing.assert_array_equal(value, weights[name], err_msg=name)
    assert runner.step_count == 0


def test_sgd_biases_are_carried_as_rows_bit_for_bit(data):
    """A bias whose SGD update is one Gemm with a ones row (passes/batch.py row_sum_updates) is carried by the
    Scan as a (1, n) row, so its Reshape leaves the body: the losses and weights stay those of one step per
    batch, bit for bit, through epochs of two batch lengths."""
    X, y = data[0], data[1]
    looped, stepped = _pair(onnxopt.compile_train_step(mlp([4, 6, 3, 1], seed=1), loss="square", update="sgd",
                                                       learning_rate=0.05), batch_size=8)
    for batch in (8, 10, 8):
        np.testing.assert_array_equal(looped.epoch(X, y, batch_size=batch), _per_step(stepped, X, y, batch))
    _assert_same(looped, stepped)
    body = next(n for n in looped._epochs.model.graph.node if n.op_type == "Scan").attribute[0].g
    rows = [[d.dim_value for d in v.type.tensor_type.shape.dim] for v in body.input]
    assert sorted(r for r in rows if r[:1] == [1]) == [[1, 1], [1, 3], [1, 6]]
    assert "Reshape" not in {n.op_type for n in body.node}
