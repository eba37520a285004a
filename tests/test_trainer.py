"""``onnxopt.Trainer``: scikit-learn protocol and parity, divergence, checkpoints, interrupts, data checks."""

import os
import re
import warnings

import numpy as np
import onnx
import pandas as pd
import pytest
from sklearn.base import clone
from sklearn.datasets import make_blobs, make_classification, make_regression
from sklearn.exceptions import NotFittedError
from sklearn.linear_model import SGDClassifier
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier, MLPRegressor
from sklearn.preprocessing import StandardScaler
from sklearn.utils.validation import check_is_fitted

import onnxopt
from onnxopt.examples import linear_regression, mlp
from helpers import run_script, session


@pytest.fixture
def data(rng):
    X = rng.normal(size=(64, 4)).astype(np.float32)
    return X, (X @ np.array([1.0, -1.0, 2.0, 0.5], np.float32) + 0.3).astype(np.float32)


def _trainer(**kw):
    params = {"learning_rate": 0.05, "batch_size": 8, "max_iter": 3, "tol": None, "update": "sgd", "scale": "never",
              "n_iter_no_change": 5, **kw}  # NOTE: the defaults before issue 28, which these tests were written for
    return onnxopt.Trainer(params.pop("model", None) or mlp([4, 8, 1]), **params)


def _replay(est, X, y, n_steps, batch):
    """A fresh Runner on the estimator's step, fed the first ``n_steps`` batches of unshuffled epochs."""
    runner = onnxopt.Runner(est.train_step_)
    starts = [s for _ in range(n_steps) for s in range(0, len(X), batch)][:n_steps]
    for s in starts:
        runner.step(X[s:s + batch], y[s:s + batch])
    return runner


def _assert_same_weights(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


# -- 1. scikit-learn protocol ------------------------------------------------------------------------------
def test_get_set_params_clone_and_repr(data):
    X, y = data
    est = _trainer(update="nesterov:momentum=0.9")
    params = est.get_params()
    assert params["update"] == "nesterov:momentum=0.9" and params["batch_size"] == 8 and params["tol"] is None
    assert est.set_params(learning_rate=0.1, max_iter=2) is est
    assert est.get_params()["learning_rate"] == 0.1
    with pytest.raises(ValueError, match="unknown parameter 'learning_rat'"):
        est.set_params(learning_rat=0.1)
    assert repr(est) == ("Trainer(update='nesterov:momentum=0.9', learning_rate=0.1, batch_size=8, max_iter=2, "
                         "n_iter_no_change=5, tol=None, scale='never')")
    assert repr(onnxopt.Trainer(mlp([4, 1]))) == "Trainer()"
    est.fit(X, y)
    check_is_fitted(est)
    copy = clone(est)
    assert type(copy) is onnxopt.Trainer and copy is not est
    assert {k: v for k, v in copy.get_params().items() if k != "model"} == \
        {k: v for k, v in est.get_params().items() if k != "model"}
    assert copy.get_params()["model"] == est.model
    with pytest.raises(NotFittedError):
        check_is_fitted(copy)
    with pytest.raises(AttributeError, match="not fitted"):
        copy.predict(X)
    np.testing.assert_array_equal(copy.fit(X, y).train_losses_, est.train_losses_)  # same params, same run


def test_pickled_estimator_predicts_and_trains_on_like_the_original(data):
    import pickle

    X, y = data
    labels = np.where(y > 0, "pos", "neg")
    est = _trainer(model=mlp([4, 8, 2]), loss="cross_entropy", update="adam", warm_start=True).fit(X, labels)
    copy = pickle.loads(pickle.dumps(est))
    np.testing.assert_array_equal(copy.predict(X), est.predict(X))
    assert list(copy.classes_) == ["neg", "pos"] and copy.train_losses_ == est.train_losses_
    copy.fit(X, labels)
    est.fit(X, labels)  # the optimizer state travelled too: both continue identically
    assert copy.train_losses_ == est.train_losses_ and copy.n_iter_ == 6
    _assert_same_weights(copy.runner_.get_weights(), est.runner_.get_weights())


def test_scikit_learn_tools_see_a_regressor_or_a_classifier(data):
    from sklearn.base import is_classifier, is_regressor
    from sklearn.model_selection import cross_val_score

    X, y = data
    reg, clf = _trainer(), _trainer(model=mlp([4, 8, 2]), loss="cross_entropy", max_iter=30)
    assert is_regressor(reg) and not is_classifier(reg) and is_classifier(clf)
    assert cross_val_score(reg, X, y, cv=2).min() > 0.5  # R² per fold
    labels = np.where(y > 0, "pos", "neg")
    scores = cross_val_score(clf, X, labels, cv=2)  # stratified folds, accuracy
    assert scores.shape == (2,) and scores.min() > 0.7


# -- 2. parity with scikit-learn ---------------------------------------------------------------------------
def _split(X, y, seed=1):
    return train_test_split(StandardScaler().fit_transform(X), y, test_size=0.5, random_state=seed)


def _sgd_mlp(cls, lr):
    return cls(hidden_layer_sizes=(16,), solver="sgd", learning_rate_init=lr, momentum=0.9, nesterovs_momentum=True,
               alpha=0.0, batch_size=32, max_iter=20, tol=0.0, n_iter_no_change=1000, random_state=1)


def test_regression_scores_like_mlp_regressor():
    X, y = make_regression(400, 8, noise=5.0, random_state=1)
    Xtr, Xte, ytr, yte = _split(X, (y - y.mean()) / y.std())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NOTE: scikit-learn's ConvergenceWarning at max_iter
        sk = _sgd_mlp(MLPRegressor, 0.02).fit(Xtr, ytr)
    # NOTE: scikit-learn's squared loss is ½·mean(d²): the same steps need half the learning rate here
    est = onnxopt.Trainer(mlp([8, 16, 1]), loss="square", update="nesterov:momentum=0.9", learning_rate=0.01,
                          batch_size=32, max_iter=20, tol=None).fit(Xtr, ytr)
    assert est.n_iter_ == sk.n_iter_ == 20
    assert sk.score(Xte, yte) > 0.95
    assert est.score(Xte, yte) == pytest.approx(sk.score(Xte, yte), abs=0.02)


def test_binary_classification_scores_like_sgd_classifier():
    X, y = make_classification(600, 6, n_informative=4, class_sep=1.5, random_state=1)
    Xtr, Xte, ytr, yte = _split(X, np.array(["no", "yes"])[y])
    sk = SGDClassifier(loss="log_loss", learning_rate="constant", eta0=0.01, penalty=None, max_iter=5, tol=None,
                       random_state=1).fit(Xtr, ytr)
    est = onnxopt.Trainer(linear_regression(6), loss="log", learning_rate=0.01, batch_size=1, max_iter=5,
                          tol=None).fit(Xtr, ytr)
    assert list(est.classes_) == ["no", "yes"]
    assert set(est.predict(Xte)) <= {"no", "yes"}
    assert sk.score(Xte, yte) > 0.8
    assert est.score(Xte, yte) == pytest.approx(sk.score(Xte, yte), abs=0.02)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_multiclass_scores_like_mlp_classifier(dtype):
    X, y = make_blobs(450, 5, centers=3, cluster_std=3.0, random_state=1)
    Xtr, Xte, ytr, yte = _split(X, np.array(["a", "b", "c"])[y])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sk = _sgd_mlp(MLPClassifier, 0.05).fit(Xtr, ytr)
    est = onnxopt.Trainer(mlp([5, 16, 3], dtype=dtype), loss="cross_entropy", update="nesterov:momentum=0.9",
                          learning_rate=0.05, batch_size=32, max_iter=20, tol=None).fit(Xtr, pd.Series(ytr))
    assert list(est.classes_) == ["a", "b", "c"]
    assert sk.score(Xte, yte) > 0.9
    assert est.score(Xte, yte) == pytest.approx(sk.score(Xte, yte), abs=0.02)
    # the exported model, in a plain session, gives the same classes
    out = session(est.trained_model_).run(None, {"X": Xte.astype(dtype)})[0]
    np.testing.assert_array_equal(est.classes_[out.argmax(axis=1)], est.predict(Xte))


def test_stopping_rule_matches_scikit_learn_count(data):
    X, y = data  # a tol no epoch can beat: both stop after n_iter_no_change + 2 epochs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sk = MLPRegressor(hidden_layer_sizes=(8,), solver="sgd", tol=1e3, n_iter_no_change=3, max_iter=50).fit(X, y)
    est = _trainer(tol=1e3, n_iter_no_change=3, max_iter=50).fit(X, y)
    assert est.n_iter_ == sk.n_iter_ == 5 == len(est.train_losses_)
    early = _trainer(tol=1e3, n_iter_no_change=3, max_iter=50, early_stopping=True).fit(X, y)
    assert early.n_iter_ == 5 == len(early.validation_losses_)
    assert all(np.isfinite(early.validation_losses_))


# -- 3. divergence -----------------------------------------------------------------------------------------
def test_divergence_names_epoch_and_batch_and_keeps_last_finite_weights(data):
    X, y = data
    y = y * 100
    est = _trainer(learning_rate=5.0, shuffle=False, max_iter=20)
    with pytest.raises(onnxopt.ConvergenceError, match=r"epoch \d+, batch \d+") as info:
        est.fit(X, y)
    epoch, batch = map(int, re.search(r"epoch (\d+), batch (\d+)", str(info.value)).groups())
    failed = (epoch - 1) * 8 + batch  # 8 batches of 8 per epoch; the 1-based step whose loss was not finite
    assert failed >= 2
    kept = est.runner_.get_weights()
    assert all(np.isfinite(v).all() for v in kept.values())
    # the kept weights are those that gave the last finite loss: failed - 2 steps from the start
    replay = _replay(est, X, y, failed - 2, 8)
    _assert_same_weights(kept, replay.get_weights())
    starts = [s for _ in range(epoch) for s in range(0, 64, 8)]
    assert np.isfinite(replay.step(X[starts[failed - 2]:][:8], y[starts[failed - 2]:][:8]))
    with pytest.raises(onnxopt.ConvergenceError):
        replay.step(X[starts[failed - 1]:][:8], y[starts[failed - 1]:][:8])
    onnx.checker.check_model(est.trained_model_)
    pred = session(est.trained_model_).run(None, {"X": X})[0]
    assert np.isfinite(pred).all()
    np.testing.assert_allclose(pred[:, 0], est.predict(X), rtol=1e-6, atol=1e-6)


# -- 4. checkpoints and export -----------------------------------------------------------------------------
def test_checkpoint_resume_equals_uninterrupted_run(data, tmp_path):
    X, y = data
    kw = {"update": "adam", "learning_rate": 0.01}
    first = _trainer(max_iter=4, checkpoint_dir=tmp_path, **kw).fit(X, y)
    assert first.n_iter_ == 4 and (tmp_path / "trainer.ckpt").exists()
    resumed = _trainer(max_iter=8, tol=1e-4, checkpoint_dir=tmp_path, **kw).fit(X, y)
    full = _trainer(max_iter=8, tol=1e-4, **kw).fit(X, y)
    assert resumed.n_iter_ == full.n_iter_ == 8
    assert resumed.runner_.step_count == full.runner_.step_count == 64
    assert resumed.train_losses_ == full.train_losses_
    _assert_same_weights(resumed.runner_.get_weights(), full.runner_.get_weights())
    _assert_same_weights(resumed.runner_.get_state(), full.runner_.get_state())


@pytest.mark.parametrize("weighted", [False, True])
def test_interrupted_run_resumes_from_its_last_epoch(data, tmp_path, monkeypatch, weighted):
    X, y = data
    sw = np.linspace(0.5, 1.5, len(X)).astype(np.float32) if weighted else None
    # NOTE: Ctrl-C in epoch 3: after its run (Runner.epoch) or in its 5th step (sample weights: one step per
    # batch); its completed steps are not in the checkpoint
    method, at = ("step", 21) if weighted else ("epoch", 3)
    calls, original = [], getattr(onnxopt.Runner, method)

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        out = original(self, *args, **kwargs) if method == "epoch" else None
        if len(calls) == at:
            raise KeyboardInterrupt
        return out if method == "epoch" else original(self, *args, **kwargs)

    monkeypatch.setattr(onnxopt.Runner, method, interrupted)
    with pytest.warns(UserWarning, match="fit interrupted at epoch 3"):
        _trainer(max_iter=5, checkpoint_dir=tmp_path).fit(X, y, sample_weight=sw)
    monkeypatch.undo()
    resumed = _trainer(max_iter=5, checkpoint_dir=tmp_path).fit(X, y, sample_weight=sw)
    full = _trainer(max_iter=5).fit(X, y, sample_weight=sw)
    assert resumed.train_losses_ == full.train_losses_ and resumed.runner_.step_count == 40
    _assert_same_weights(resumed.runner_.get_weights(), full.runner_.get_weights())


def test_bad_checkpoint_dir_is_refused_before_training(data, tmp_path):
    X, y = data
    _trainer(max_iter=1, checkpoint_dir=tmp_path).fit(X, y)
    with pytest.raises(onnxopt.CheckpointError, match=r"array 'coef_0' is float32\[4, 8\], expected float32\[4, 5\]"):
        _trainer(model=mlp([4, 5, 1]), checkpoint_dir=tmp_path).fit(X, y)
    path = tmp_path / "trainer.ckpt"
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(onnxopt.CheckpointError, match="truncated or corrupted"):
        _trainer(checkpoint_dir=tmp_path).fit(X, y)


def test_trained_model_predicts_like_predict_in_a_plain_session(data):
    X, y = data
    est = _trainer(max_iter=5).fit(X, y)
    for model in (est.trained_model_, est.runner_.export()):
        onnx.checker.check_model(model)
        pred = session(model).run(None, {"X": X})[0]
        np.testing.assert_allclose(pred[:, 0], est.predict(X), rtol=1e-6, atol=1e-6)
    assert est.score(X, y) > 0.9


# -- 5. partial_fit and warm_start -------------------------------------------------------------------------
def test_partial_fit_adds_one_epoch_per_call_like_fit(data):
    X, y = data
    est = _trainer()
    for k in range(1, 4):
        est.partial_fit(X, y)
        assert est.n_iter_ == k == len(est.train_losses_) and est.runner_.step_count == 8 * k
    full = _trainer(max_iter=3).fit(X, y)
    assert est.train_losses_ == full.train_losses_
    _assert_same_weights(est.runner_.get_weights(), full.runner_.get_weights())


def test_warm_start_continues_and_cold_start_restarts(data):
    X, y = data
    warm = _trainer(update="momentum", warm_start=True).fit(X, y)
    first = list(warm.train_losses_)
    warm.fit(X, y)  # max_iter more epochs from the current weights and optimizer state
    six = _trainer(update="momentum", max_iter=6).fit(X, y)
    assert warm.n_iter_ == 6 and warm.train_losses_ == six.train_losses_
    _assert_same_weights(warm.runner_.get_weights(), six.runner_.get_weights())
    assert warm.train_losses_[:3] == first
    cold = _trainer(update="momentum").fit(X, y)
    cold.fit(X, y)  # warm_start=False: from the model's weights again
    assert cold.n_iter_ == 3 and cold.train_losses_ == first


# -- 6. dtypes, input containers, verbosity ---------------------------------------------------------------
def test_float32_and_float64_models_train_alike(data):
    X, y = data
    single = _trainer(model=mlp([4, 8, 1], dtype=np.float32)).fit(X, y)
    double = _trainer(model=mlp([4, 8, 1], dtype=np.float64)).fit(X.astype(np.float64), y.astype(np.float64))
    assert single.predict(X).dtype == np.float32 and double.predict(X).dtype == np.float64
    np.testing.assert_allclose(single.train_losses_, double.train_losses_, rtol=1e-4)
    np.testing.assert_allclose(single.predict(X), double.predict(X), rtol=1e-3, atol=1e-4)


def test_pandas_and_lists_are_accepted(data):
    X, y = data
    ref = _trainer().fit(X, y)
    frame = _trainer().fit(pd.DataFrame(X, columns=list("abcd")), pd.Series(y))
    lists = _trainer().fit(X.tolist(), y.tolist(), sample_weight=[1.0] * len(X))
    assert frame.train_losses_ == ref.train_losses_ == lists.train_losses_
    np.testing.assert_array_equal(frame.predict(pd.DataFrame(X)), ref.predict(X))
    assert frame.score(pd.DataFrame(X), pd.Series(y)) == ref.score(X, y)


def test_verbose_zero_prints_nothing_and_one_shows_a_progress_bar(data, capsys):
    X, y = data
    _trainer(verbose=0).fit(X, y)
    assert capsys.readouterr() == ("", "")
    _trainer(verbose=1).fit(X, y)
    out, err = capsys.readouterr()
    assert out == ""
    assert "24/24" in err and "step" in err and "loss=" in err


# -- 7. data errors ----------------------------------------------------------------------------------------
def _set(a, index, value):
    a = a.copy()
    a[index] = value
    return a


BAD_DATA = [  # id, change of (X, y, sample_weight), expected message
    ("features", lambda X, y: {"X": X[:, :3]}, r"X: expected 4 values on axis 1 .*got shape \(64, 3\)"),
    ("one-column", lambda X, y: {"X": X[:, 0]}, r"X: expected 2 dimensions .*got shape \(64,\).*reshape"),
    ("target-rows", lambda X, y: {"y": y[:10]}, r"y: expected 64 rows .*got shape \(10,\)"),
    ("target-columns", lambda X, y: {"y": np.c_[y, y]}, r"y: expected shape \[64, 1\] .*got \(64, 2\)"),
    ("nan-in-X", lambda X, y: {"X": _set(X, (3, 2), np.nan)},
     r"X: expected finite values, got nan at index \(3, 2\) \(pass allow_nan=True"),
    ("inf-in-y", lambda X, y: {"y": _set(y, 5, np.inf)}, r"y: expected finite values, got inf at index \(5,\)"),
    ("empty", lambda X, y: {"X": X[:0], "y": y[:0]}, r"X: expected at least one sample, got shape \(0, 4\)"),
    ("weight-length", lambda X, y: {"sample_weight": np.ones(3)},
     r"sample_weight: expected shape \(64,\) .*got \(3,\)"),
    ("negative-weight", lambda X, y: {"sample_weight": -np.ones(64)},
     r"sample_weight: expected non-negative weights, got -1"),
    ("zero-weights", lambda X, y: {"sample_weight": np.zeros(64)},
     r"sample_weight: expected at least one positive weight, got all zeros"),
    ("nan-weight", lambda X, y: {"sample_weight": np.full(64, np.nan)},
     r"sample_weight: expected finite values, got nan at index \(0,\)$"),  # no allow_nan hint: it does not apply
    ("strings", lambda X, y: {"X": X.astype(str)}, r"X: expected numbers castable to float32, got dtype <U"),
    ("objects", lambda X, y: {"X": np.full((64, 4), "a", dtype=object)}, r"X: expected numbers, got dtype object"),
    ("lossy-cast", lambda X, y: {"X": np.full((64, 4), 2**24 + 1)},
     r"X: expected float32 values, got int64 values that change when cast"),
    ("no-target", lambda X, y: {"y": None}, r"y: the loss needs targets, got None"),
]


@pytest.mark.parametrize("change, message", [pytest.param(c, m, id=i) for i, c, m in BAD_DATA])
def test_bad_data_is_a_data_error_naming_the_input(data, change, message):
    X, y = data
    args = {"X": X, "y": y, "sample_weight": None, **change(X, y)}
    est = _trainer()
    with pytest.raises(onnxopt.DataError, match=message):
        est.fit(args["X"], args["y"], sample_weight=args["sample_weight"])
    assert not hasattr(est, "trained_model_") and est.n_iter_ == 0  # refused before any step


def test_lossless_casts_and_allow_nan(data):
    X, y = data
    ints = np.rint(X * 4).astype(np.int64)
    assert np.isfinite(_trainer().fit(ints, y).train_losses_).all()  # small integers cast exactly
    nan_x = X.copy()
    nan_x[3, 2] = np.nan
    est = _trainer(allow_nan=True)
    with pytest.raises(onnxopt.ConvergenceError):  # the check let it through: the model itself turns it into NaN
        est.fit(nan_x, y)
    pred = est.predict(nan_x)
    assert np.isnan(pred[3]) and np.isfinite(np.delete(pred, 3)).all()
    with pytest.raises(onnxopt.DataError, match="X: expected finite values"):
        _trainer().fit(X, y).predict(nan_x)


@pytest.mark.parametrize("batch_size", [0, -3, 2.5, True])
def test_batch_size_below_one_or_not_an_integer_is_refused(data, batch_size):
    with pytest.raises(onnxopt.DataError, match=rf"batch_size: expected an integer >= 1, got {batch_size!r}"):
        _trainer(batch_size=batch_size).fit(*data)


def test_batch_size_larger_than_the_data_is_clipped_with_a_warning(data):
    X, y = data
    with pytest.warns(UserWarning, match="batch_size: 1000 is larger than the 64 training samples; clipped to 64"):
        est = _trainer(batch_size=1000).fit(X, y)
    assert est.runner_.step_count == 3  # one full batch per epoch
    full = _trainer(batch_size=64).fit(X, y)
    assert est.train_losses_ == full.train_losses_


_HUGE_BATCH = """
import sys, numpy as np, onnxopt
from onnxopt.examples import linear_regression
X, y = np.zeros((8, 3)), np.zeros(8)
onnxopt.Trainer(linear_regression(3, dtype=np.float64), batch_size=8, max_iter=1).fit(X, y)  # NOTE: imports, sessions
before = peak()
if sys.argv[1] == "trainer":
    onnxopt.Trainer(linear_regression(3, dtype=np.float64), batch_size=10**8, max_iter=1).fit(X, y)
else:
    step = onnxopt.compile_train_step(linear_regression(3, dtype=np.float64), loss="square")
    onnxopt.Runner(step, batch_size=10**8).step(X, y)
print(peak() - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
@pytest.mark.parametrize("caller", ["trainer", "runner"])
def test_a_huge_batch_size_allocates_nothing_for_it(caller):
    """``batch_size=10**8`` on 8 rows: the step's session was specialized for 10**8 rows and onnxruntime folded
    per-row constants at that length (+800 MB on onnxruntime 1.32, +2.4 GB on 1.19; test_fuzz's 10**9 took 23 GB
    and the OOM killer). Now the Trainer makes its sessions for the rows it has, and the Runner specializes for
    at most 65,536 rows."""
    grown = int(run_script(_HUGE_BATCH, caller).split()[-1])
    assert grown < 200e6, f"peak RSS grew by {grown / 1e6:.0f} MB"


def test_classifier_label_errors(data):
    X, y = data
    labels = np.where(y > 0, "pos", "neg")
    with pytest.raises(onnxopt.DataError, match=r"y: the 'log' loss is binary, expected at most 2 classes, got 3"):
        _trainer(model=linear_regression(4), loss="log").fit(X, np.r_[labels[:-1], ["other"]])
    est = _trainer(model=linear_regression(4), loss="log").fit(X, labels)
    with pytest.raises(onnxopt.DataError, match=r"y: label 'zero' was not seen by fit"):
        est.partial_fit(X, np.r_[labels[:-1], ["zero"]])
    with pytest.raises(onnxopt.DataError, match=r"y: expected 64 class labels shaped \(64,\), got shape \(64, 2\)"):
        est.partial_fit(X, np.c_[labels, labels])


def test_partial_fit_classes_lists_labels_the_first_batch_lacks(data):
    X, y = data
    labels = np.array(["a", "b", "c"])[np.digitize(y, [-1.0, 1.0])]
    first = labels != "c"
    est = _trainer(model=mlp([4, 8, 3]), loss="cross_entropy")
    est.partial_fit(X[first], labels[first], classes=["a", "b", "c"])
    est.partial_fit(X, labels)  # "c" is known although the first batch had none
    assert list(est.classes_) == ["a", "b", "c"] and est.n_iter_ == 2
    with pytest.raises(onnxopt.DataError, match="y: label 'a' was not seen by fit"):
        _trainer(model=mlp([4, 8, 3]), loss="cross_entropy").partial_fit(X, labels, classes=["b", "c"])
    binary = _trainer(model=linear_regression(4), loss="log")
    with pytest.raises(onnxopt.DataError, match="classes: the 'log' loss is binary, expected at most 2 classes, got 3"):
        binary.partial_fit(X, labels, classes=["a", "b", "c"])
    assert not hasattr(binary, "classes_")


# -- 8. KeyboardInterrupt ----------------------------------------------------------------------------------
@pytest.mark.parametrize("weighted", [False, True])
def test_keyboard_interrupt_returns_a_usable_estimator(data, monkeypatch, weighted):
    X, y = data
    # NOTE: Ctrl-C in epoch 2: in its 4th step (sample weights: one step per batch, 11 steps completed) or
    # before its run (Runner.epoch: the full batches of an epoch are one run, 8 steps completed)
    sw = np.ones(len(X), np.float32) if weighted else None
    method, at, done = ("step", 12, 11) if weighted else ("epoch", 2, 8)
    calls, original = [], getattr(onnxopt.Runner, method)

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(onnxopt.Runner, method, interrupted)
    est = _trainer(update="momentum", shuffle=False, max_iter=5)
    with pytest.warns(UserWarning, match=rf"fit interrupted at epoch 2; .*last completed step \({done}\)"):
        assert est.fit(X, y, sample_weight=sw) is est
    monkeypatch.undo()
    assert est.runner_.step_count == done and est.n_iter_ == 1 and len(est.train_losses_) == 1
    replay = _replay(est, X, y, done, 8)
    _assert_same_weights(est.runner_.get_weights(), replay.get_weights())
    _assert_same_weights(est.runner_.get_state(), replay.get_state())
    pred = session(est.trained_model_).run(None, {"X": X})[0][:, 0]
    np.testing.assert_allclose(est.predict(X), pred, rtol=1e-6, atol=1e-6)
    est.set_params(warm_start=True, max_iter=2).fit(X, y)  # training goes on from there
    assert est.n_iter_ == 3 and est.runner_.step_count == done + 16 and len(est.train_losses_) == 3


def test_a_batch_of_zero_sample_weight_is_skipped():
    """Its weighted mean would be 0/0; the step is skipped, the other batches train as usual."""
    from onnxopt.examples import linear_regression

    rng = np.random.default_rng(3)
    X, y = rng.normal(size=(4, 2)), rng.normal(size=4)
    est = onnxopt.Trainer(linear_regression(2, dtype=np.float64), batch_size=2, max_iter=1, shuffle=False, tol=None,
                          scale="never")  # NOTE: the statistics of X and X[2:] differ
    est.fit(X, y, sample_weight=[0.0, 0.0, 1.0, 1.0])
    ref = onnxopt.Trainer(linear_regression(2, dtype=np.float64), batch_size=2, max_iter=1, shuffle=False, tol=None,
                          scale="never")  # NOTE: the statistics of X and X[2:] differ
    ref.fit(X[2:], y[2:])
    assert est.runner_.step_count == 1
    for name, value in ref.runner_.get_weights().items():
        np.testing.assert_array_equal(est.runner_.get_weights()[name], value)
    np.testing.assert_allclose(est.train_losses_[0], ref.train_losses_[0] / 2)


def test_scale_takes_the_clis_values_and_the_old_ones_warn():
    X = np.random.default_rng(0).normal(3.0, 20.0, size=(64, 4)).astype(np.float32)
    y = X.sum(axis=1)
    fit = {s: onnxopt.Trainer(mlp([4, 1]), scale=s, max_iter=1, tol=None).fit(X, y) for s in onnxopt.scaling.SCALE_MODES}
    assert fit["never"].scaling_ is None
    assert fit["always"].scaling_.x is not None and fit["auto"].scaling_.x is not None  # NOTE: std 20: scaled
    for old, new in [(False, "never"), (True, "always"), (None, "never")]:
        with pytest.warns(FutureWarning, match=rf"scale={old!r} is deprecated: use scale={new!r}"):
            est = onnxopt.Trainer(mlp([4, 1]), scale=old, max_iter=1, tol=None).fit(X, y)
        np.testing.assert_array_equal(est.predict(X), fit[new].predict(X))
    with pytest.raises(ValueError, match=r"scale: expected one of \['auto', 'always', 'never'\], got 'sometimes'"):
        onnxopt.Trainer(mlp([4, 1]), scale="sometimes", max_iter=1).fit(X, y)


def test_predictions_of_a_runner_on_another_device_read_host_copies_of_its_weights(rng):
    """The prediction and validation sessions run on CPU: a CUDA runner's weights are copied to host for them
    (binding the device's OrtValues failed: "no data transfer registered", found by benchmarks/gpu_check's
    machine). On CPU the copied path must give the bound path's numbers."""
    X = rng.normal(size=(64, 4)).astype(np.float32)
    est = onnxopt.Trainer(mlp([4, 8, 1]), max_iter=2, early_stopping=True, scale="never").fit(X, X.sum(axis=1))
    bound, score = est.predict(X), est.score(X, X.sum(axis=1))
    est.runner_.device = "cuda"  # NOTE: only the branch; the values stay on CPU
    np.testing.assert_array_equal(est.predict(X), bound)
    assert est.score(X, X.sum(axis=1)) == score
