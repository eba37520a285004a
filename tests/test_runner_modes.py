"""Runner's deferred loss reading (``step(..., read_loss=False)`` + ``sync()``) and its batch errors."""

import warnings

import numpy as np
import pytest

import onnxopt
import onnxopt.runner
from onnxopt.data import all_finite
from onnxopt.examples import mlp
from helpers import count_runs


@pytest.fixture
def data(rng):
    X = rng.normal(size=(64, 4)).astype(np.float32)
    return X, (X @ np.array([1.0, -1.0, 2.0, 0.5], np.float32)).astype(np.float32)


def _batches(X, y, size=8):
    return [(X[i:i + size], y[i:i + size]) for i in range(0, len(X), size)]


def _runner(update="adam", learning_rate=0.01):
    return onnxopt.Runner(onnxopt.compile_train_step(mlp([4, 8, 1]), loss="square", update=update,
                                                     learning_rate=learning_rate))




def test_deferred_losses_and_weights_equal_per_step_reading(data):
    eager, deferred = _runner(), _runner()
    batches = _batches(*data) * 2
    expected = [eager.step(X, y) for X, y in batches]
    assert all(deferred.step(X, y, read_loss=False) is None for X, y in batches)
    losses = deferred.sync()
    np.testing.assert_array_equal(losses, np.array(expected))
    assert deferred.sync().size == 0  # nothing pending any more
    for name, value in eager.get_weights().items():
        np.testing.assert_array_equal(deferred.get_weights()[name], value)
    for name, value in eager.get_state().items():
        np.testing.assert_array_equal(deferred.get_state()[name], value)
    assert deferred.step_count == eager.step_count == len(batches)


def test_deferred_losses_survive_automatic_and_mode_switch_syncs(data, monkeypatch):
    monkeypatch.setattr(onnxopt.runner, "_HISTORY", 3)  # NOTE: a tiny device buffer forces automatic syncs
    eager, deferred = _runner(), _runner()
    batches = _batches(*data)
    sequence = batches[:7] + batches[:2] + [batches[2]]
    expected = [eager.step(X, y) for X, y in sequence]
    for X, y in sequence[:7]:  # 7 deferred steps: two automatic syncs on the way
        deferred.step(X, y, read_loss=False)
    np.testing.assert_array_equal(deferred.sync(), expected[:7])
    for X, y in sequence[7:9]:  # then a per-step read: it syncs the pending losses, which sync() still returns
        deferred.step(X, y, read_loss=False)
    assert deferred.step(*sequence[9]) == expected[9]
    np.testing.assert_array_equal(deferred.sync(), expected[7:9])
    assert deferred.step_count == 10


def test_one_session_run_per_step_in_deferred_mode(data, monkeypatch):
    runner = _runner()
    runs = count_runs(runner, monkeypatch)
    batches = _batches(*data)
    for X, y in batches:
        runner.step(X, y, read_loss=False)
    assert len(runs) == len(batches)
    runner.sync()  # reading the losses is a memory read, not a run
    assert len(runs) == len(batches) == runner.n_runs == runner.step_count


def test_divergence_found_at_sync_restores_the_weights_of_the_last_sync(data):
    X, y = data
    runner = _runner(update="momentum", learning_rate=5.0)
    runner.step(X[:8], y[:8] * 100, read_loss=False)
    first = runner.sync()
    assert np.isfinite(first).all()
    synced = {**runner.get_weights(), **runner.get_state()}
    with pytest.raises(onnxopt.ConvergenceError, match=r"at step \d+.*step 1 \(the last synced step\)"):
        for _ in range(20):
            runner.step(X[:8], y[:8] * 100, read_loss=False)
        runner.sync()
    assert runner.step_count == 1
    restored = {**runner.get_weights(), **runner.get_state()}
    for name, value in synced.items():
        np.testing.assert_array_equal(restored[name], value)
    assert all(np.isfinite(v).all() for v in restored.values())
    # the runner goes on from there: the same step from the same weights gives the same loss again
    again = _runner(update="momentum", learning_rate=5.0)
    again.step(X[:8], y[:8] * 100)
    assert runner.step(X[:8], y[:8]) == again.step(X[:8], y[:8])


def test_each_sync_refreshes_the_snapshot_in_place_and_a_divergence_restores_the_latest(data):
    """The weights kept for a divergence are rewritten in the same arrays at each run of deferred steps (no
    allocation a streamed block), and are those of the last sync, not of an earlier one."""
    X, y = data
    runner = _runner(update="momentum", learning_rate=5.0)
    runner.step(X[:8], y[:8], read_loss=False)
    runner.sync()
    kept = runner._losses.snapshot
    arrays = {name: id(a) for name, a in kept.items()}
    runner.step(X[8:16], y[8:16], read_loss=False)
    assert np.isfinite(runner.sync()).all()
    synced = {**runner.get_weights(), **runner.get_state()}
    with pytest.raises(onnxopt.ConvergenceError, match=r"step 2 \(the last synced step\)"):
        for _ in range(20):
            runner.step(X[:8], y[:8] * 100, read_loss=False)
        runner.sync()
    assert runner._losses.snapshot is kept and {name: id(a) for name, a in kept.items()} == arrays
    restored = {**runner.get_weights(), **runner.get_state()}
    assert restored.keys() == synced.keys()
    for name, value in synced.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)


def test_all_finite_is_exact_where_the_sum_overflows():
    """The check of weights and streamed blocks: a finite sum proves it; an overflowing one is checked value by
    value, so huge finite values pass and any NaN or infinity fails; numpy's overflow warnings stay out of the
    user's output."""
    huge = np.full(8, np.finfo(np.float32).max, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all_finite(huge) and all_finite(np.zeros(0, np.float32)) and all_finite(np.ones((3, 4)))
        for bad in (np.nan, np.inf, -np.inf):
            for base in (huge, np.ones(8, np.float32)):
                a = base.copy()
                a[5] = bad
                assert not all_finite(a), (bad, base[0])
        assert not all_finite(np.array([np.inf, -np.inf]))


@pytest.mark.parametrize("read_loss", [True, False])
def test_wrong_feature_count_is_a_data_error_naming_x(data, read_loss):
    X, y = data
    runner = _runner()
    runner.step(X[:8], y[:8])
    before = runner.get_weights()
    with pytest.raises(onnxopt.DataError, match=r"X\['N', 4\].*got X\(8, 3\)"):
        runner.step(X[:8, :3], y[:8], read_loss=read_loss)
    assert runner.step_count == 1 and runner.sync().size == 0
    for name, value in before.items():
        np.testing.assert_array_equal(runner.get_weights()[name], value)
    assert np.isfinite(runner.step(X[:8], y[:8]))  # still usable


def test_wrong_target_or_weight_length_is_a_data_error(data):
    X, y = data
    runner = _runner()
    with pytest.raises(onnxopt.DataError, match=r"got X\(8, 4\) float32, target\(4,\)"):
        runner.step(X[:8], y[:4])
    with pytest.raises(onnxopt.DataError, match=r"sample_weight\(3,\)"):
        runner.step(X[:8], y[:8], sample_weight=np.ones(3, np.float32))
    with pytest.raises(onnxopt.DataError, match="y: expected numbers"):
        runner.step(X[:8], y[:8].astype(str))
    assert runner.step_count == 0
