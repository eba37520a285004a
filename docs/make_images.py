"""Draws the pictures of the docs into docs/img/: ``python docs/make_images.py``.

Needs Graphviz's ``dot`` on PATH (``apt-get install graphviz``) and the ``demo`` extra (scikit-learn,
skl2onnx, matplotlib). The settings are those of docs/tutorials/mlp_nesterov.md.
"""

import os
import pathlib
import shutil
import sys
import tempfile
import warnings

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import make_regression  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402
from sklearn.neural_network import MLPRegressor  # noqa: E402
from skl2onnx import to_onnx  # noqa: E402

import onnxopt  # noqa: E402
from onnxopt.cli import main  # noqa: E402
from onnxopt.examples import linear_regression  # noqa: E402

IMG = pathlib.Path(__file__).resolve().parent / "img"


def fused_graph() -> None:
    """The fused step of a linear regression (square loss, SGD), drawn by ``onnxopt show``."""
    with tempfile.TemporaryDirectory() as tmp:
        step = os.path.join(tmp, "step.onnx")
        onnxopt.compile_train_step(linear_regression(2), loss="square", update="sgd", learning_rate=0.01).save(step)
        assert main(["show", step, "-o", str(IMG / "linear_regression_step.svg"),
                     "--title", "linear regression: one fused training step"]) == 0


def loss_curves() -> None:
    """Mean training loss per epoch, onnxopt against scikit-learn's MLPRegressor, same starting weights."""
    X, y = make_regression(n_samples=1000, n_features=10, n_informative=8, noise=5.0, random_state=0)
    X, y = X.astype(np.float32), (y / y.std()).astype(np.float32)
    X_train, _, y_train, _ = train_test_split(X, y, random_state=0)
    params = dict(hidden_layer_sizes=(20, 10), solver="sgd", learning_rate="constant", learning_rate_init=0.01,
                  momentum=0.9, nesterovs_momentum=True, batch_size=25, alpha=0.0, max_iter=30,
                  n_iter_no_change=1000, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nn = MLPRegressor(**params).fit(X_train, y_train)
        start = MLPRegressor(**{**params, "max_iter": 1, "learning_rate_init": 1e-300}).fit(X_train, y_train)
    est = onnxopt.Trainer(to_onnx(start, X_train[:1], target_opset=18), loss="square", update="nesterov:momentum=0.9",
                          learning_rate=0.005, batch_size=25, max_iter=30, random_state=0, tol=None)
    est.fit(X_train, y_train)
    fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=100)
    epochs = np.arange(1, 31)
    ax.plot(epochs, est.train_losses_, marker="o", markersize=3, label="onnxopt Trainer (fused step)")
    ax.plot(epochs, 2 * np.array(nn.loss_curve_), marker="x", markersize=4, linestyle="--",
            label="scikit-learn MLPRegressor")
    ax.set(xlabel="epoch", ylabel="mean squared error (training)", yscale="log",
           title="MLP 10-20-10-1, Nesterov 0.9, same initial weights")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(IMG / "loss_curve_sklearn.png")
    plt.close(fig)


if __name__ == "__main__":
    if shutil.which("dot") is None:
        sys.exit("make_images.py: graphviz `dot` is not on PATH (apt-get install graphviz)")
    IMG.mkdir(exist_ok=True)
    fused_graph()
    loss_curves()
    print("wrote", ", ".join(sorted(p.name for p in IMG.iterdir())))
