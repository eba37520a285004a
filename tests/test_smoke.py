import numpy as np

import onnxopt
from onnxopt.examples import linear_regression
from helpers import run_once


def test_one_sgd_step_on_linear_regression_matches_numpy(rng):
    X, y = rng.normal(size=(8, 3)), rng.normal(size=8)
    step = onnxopt.compile_train_step(linear_regression(3, dtype=np.float64), loss="square", update="sgd",
                                      learning_rate=0.1)
    out = run_once(step, X, y)
    w = step.initial_weights()
    d = (X @ w["coef"] + w["bias"])[:, 0] - y
    np.testing.assert_allclose(out["loss"], (d ** 2).mean(), rtol=1e-12)
    np.testing.assert_allclose(out["coef.new"], w["coef"] - 0.1 * 2 * X.T @ d[:, None] / 8, rtol=1e-7)
    np.testing.assert_allclose(out["bias.new"], w["bias"] - 0.1 * 2 * d.mean(), rtol=1e-7)
    assert out["optim.step.new"] == 1
