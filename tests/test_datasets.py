"""Trainer and `onnxopt fit` with their defaults on scikit-learn's bundled data sets, against scikit-learn's own
estimator with its defaults on the same split (issue 28): within 0.02 of its R² or accuracy.

Each ONNX model is converted by skl2onnx from an estimator fitted to shuffled targets, so onnxopt starts from a
model that knows nothing of the task.
"""

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from sklearn import datasets
from sklearn.linear_model import LinearRegression, LogisticRegression
from sklearn.metrics import r2_score
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier, MLPRegressor
from skl2onnx import to_onnx
from threadpoolctl import threadpool_limits

import onnxopt
from onnxopt.cli import main

CASES = [("diabetes", MLPRegressor), ("diabetes", LinearRegression), ("breast_cancer", MLPClassifier),
         ("breast_cancer", LogisticRegression), ("digits", MLPClassifier), ("digits", LogisticRegression),
         ("wine", MLPClassifier), ("wine", LogisticRegression)]


def _case(name, cls):
    X, y = getattr(datasets, f"load_{name}")(return_X_y=True)
    Xtr, Xte, ytr, yte = train_test_split(X.astype(np.float32), y, random_state=0)
    kw = {} if cls is LinearRegression else {"random_state": 0}
    with warnings.catch_warnings(), threadpool_limits(1):  # NOTE: BLAS threads on a shared machine: 10x slower
        warnings.simplefilter("ignore")  # NOTE: scikit-learn's ConvergenceWarning with its defaults
        reference = cls(**kw).fit(Xtr, ytr).score(Xte, yte)
        start = cls(**kw, **({} if cls is LinearRegression else {"max_iter": 1}))
        start.fit(Xtr, np.random.default_rng(0).permutation(ytr))  # NOTE: a model that learnt nothing of y
    options = {} if cls in (LinearRegression, MLPRegressor) else {"zipmap": False}
    return to_onnx(start, Xtr[:1], target_opset=18, options=options), (Xtr, Xte, ytr, yte), reference


@pytest.mark.parametrize("name,cls", CASES, ids=[f"{n}-{c.__name__}" for n, c in CASES])
def test_trainer_defaults_reach_scikit_learn(name, cls):
    model, (Xtr, Xte, ytr, yte), reference = _case(name, cls)
    est = onnxopt.Trainer(model).fit(Xtr, ytr)
    assert est.score(Xte, yte) >= reference - 0.02, (est.score(Xte, yte), reference)


@pytest.mark.parametrize("name,cls", [("diabetes", MLPRegressor), ("breast_cancer", MLPClassifier)])
def test_cli_fit_defaults_reach_scikit_learn_and_print_the_metric(name, cls, tmp_path, capsys):
    model, (Xtr, Xte, ytr, yte), reference = _case(name, cls)
    onnx.save(model, tmp_path / "m.onnx")
    header = ",".join([f"x{i}" for i in range(Xtr.shape[1])] + ["y"])
    np.savetxt(tmp_path / "d.csv", np.column_stack([Xtr, ytr]), delimiter=",", header=header, comments="")
    out = str(tmp_path / "t.onnx")
    assert main(["fit", str(tmp_path / "m.onnx"), str(tmp_path / "d.csv"), "--target", "y", "--quiet", "-o", out]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    metric = "R²" if cls is MLPRegressor else "accuracy"
    n_val = int(np.ceil(0.1 * len(Xtr)))
    assert f"train ({len(Xtr) - n_val} rows): {metric}" in last and f"validation ({n_val} rows): {metric}" in last
    sess = ort.InferenceSession(out, providers=["CPUExecutionProvider"])
    pred = sess.run(None, {"X": Xte})[0]
    score = r2_score(yte, pred.ravel()) if cls is MLPRegressor else float(np.mean(pred == yte))
    assert score >= reference - 0.02, (score, reference)
