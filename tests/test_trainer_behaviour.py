"""Trainer behaviours checked against scikit-learn's documented ones (issue 28), each with a precondition that
makes the single-line mutation it guards against fail:

- early stopping keeps the weights of the best validation epoch (MLP*: ``early_stopping``);
- it stops on the validation loss, not the training loss;
- the validation loss is weighted by ``sample_weight``;
- a binary classifier on probabilities predicts the positive class where its probability is above 0.5
  (``LogisticRegression.predict``);
- shuffling draws one permutation per epoch from ``random_state`` and the epoch number.
"""

import warnings

import numpy as np
import pytest
from sklearn.datasets import load_breast_cancer
from sklearn.linear_model import LogisticRegression
from skl2onnx import to_onnx

import onnxopt
from onnxopt import dsl
from onnxopt.examples import mlp
from onnxopt.trainer import split_index
from helpers import session


@pytest.fixture
def noisy():
    """Few noisy samples and a wide MLP: the validation loss rises while the training loss falls."""
    rng = np.random.default_rng(3)
    X = rng.normal(size=(40, 4)).astype(np.float32)
    y = (X[:, 0] + 2.0 * rng.normal(size=40)).astype(np.float32)
    return X, y


def _est(**kw):
    params = dict(update="sgd", learning_rate=0.05, batch_size=4, scale="never", early_stopping=True,
                  validation_fraction=0.25, random_state=0)
    return onnxopt.Trainer(mlp([4, 64, 1], seed=1), **{**params, **kw})


def _square(est, X, y, w=None):
    return float(np.average((est.predict(X) - y) ** 2, weights=w))


def test_early_stopping_keeps_the_best_validation_weights(noisy):
    X, y = noisy
    est = _est(max_iter=25, n_iter_no_change=100, tol=1e-4).fit(X, y)
    _, val = split_index(len(X), 0.25, 0)
    losses = est.validation_losses_
    assert len(losses) == 25 and int(np.argmin(losses)) < 24  # precondition: the last epoch is not the best
    np.testing.assert_allclose(_square(est, X[val], y[val]), min(losses), rtol=1e-5)


def _stop_epoch(losses, tol, patience):
    """scikit-learn's MLP rule: the epoch after which more than ``patience`` epochs did not beat best - tol."""
    best, count = np.inf, 0
    for epoch, loss in enumerate(losses, start=1):
        count = count + 1 if loss > best - tol else 0
        best = min(best, loss)
        if count > patience:
            return epoch
    return None


def test_stops_on_the_validation_loss(noisy):
    X, y = noisy
    est = _est(max_iter=60, n_iter_no_change=3, tol=1e-4).fit(X, y)
    assert est.n_iter_ == _stop_epoch(est.validation_losses_, 1e-4, 3)
    assert _stop_epoch(est.train_losses_, 1e-4, 3) != est.n_iter_  # precondition: the training loss says otherwise


def test_validation_loss_is_weighted(noisy):
    X, y = noisy
    w = np.linspace(0.1, 3.0, len(X)).astype(np.float32)
    est = _est(max_iter=3, tol=None).fit(X, y, sample_weight=w)  # NOTE: tol=None keeps the last weights
    _, val = split_index(len(X), 0.25, 0)
    weighted, plain = _square(est, X[val], y[val], w[val]), _square(est, X[val], y[val])
    assert abs(weighted - plain) > 1e-3 * plain  # precondition: the weights change the loss
    np.testing.assert_allclose(est.validation_losses_[-1], weighted, rtol=1e-5)


def test_binary_predict_thresholds_probabilities_at_one_half():
    X, y = load_breast_cancer(return_X_y=True)
    X = X[:, :4].astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = LogisticRegression(max_iter=1).fit(X, y)
    model = to_onnx(start, X[:1], target_opset=18, options={"zipmap": False})
    est = onnxopt.Trainer(model, loss=dsl.losses.log(from_logits=False), output="probabilities", max_iter=3)
    est.fit(X, y)
    proba = session(est.trained_model_).run(["probabilities"], {"X": X})[0][:, 1]
    assert 0 < (proba > 0.5).mean() < 1  # precondition: both classes predicted, so a 0 threshold differs
    np.testing.assert_array_equal(est.predict(X), est.classes_[(proba > 0.5).astype(int)])


def test_one_permutation_per_epoch_from_random_state_and_epoch(noisy):
    X, y = noisy
    kw = dict(update="sgd", learning_rate=0.05, batch_size=8, max_iter=3, tol=None, scale="never")
    est = onnxopt.Trainer(mlp([4, 8, 1], seed=1), random_state=7, **kw).fit(X, y)
    runner = onnxopt.Runner(est.train_step_)
    for epoch in range(3):
        order = np.random.default_rng([7, epoch]).permutation(len(X))
        runner.epoch(X[order], y[order], batch_size=8)
    for name, value in runner.get_weights().items():
        np.testing.assert_array_equal(est.runner_.get_weights()[name], value, err_msg=name)
    other = onnxopt.Trainer(mlp([4, 8, 1], seed=1), random_state=8, **kw).fit(X, y)
    assert not np.array_equal(other.runner_.get_weights()["coef_0"], est.runner_.get_weights()["coef_0"])


def test_data_errors_hint_at_class_labels_and_flat_rows():
    """Class labels for a model of 3 raw scores under loss="auto" (a regressor: square) and flat rows for a model
    reading (N, 2, 4): both errors say what to do."""
    from onnxopt.data import check_feature_shape, check_target
    from onnxopt.errors import DataError

    with pytest.raises(DataError, match=r"got \(6,\) \(class labels for 3 scores\? loss='cross_entropy'"):
        onnxopt.Trainer(mlp([4, 5, 3]), max_iter=1).fit(np.zeros((6, 4), np.float32), np.array([0, 1, 2, 0, 1, 2]))
    with pytest.raises(DataError, match=r"X.reshape\(-1, 2, 4\) gives the model's shape"):
        check_feature_shape((6, 8), [None, 2, 4])
    with pytest.raises(DataError, match=r"got \(6,\)$"):  # NOTE: no hint for values that are not labels
        check_target(np.linspace(0, 1, 6), 6, np.float32, ["N", 3])
