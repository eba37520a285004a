"""More exported models, with the checks of the zoo (test_torch_zoo.py, test_sklearn_zoo.py).

torch (``zoo.models_more``): every model from TorchScript and the dynamo exporter at its default opset, a few
at opset 18 too, and the BatchNorm/Dropout models as TorchScript training-mode exports. For each: the first
loss equals torch's, the gradient equals torch autograd, only torch's parameters are trained (each element
once), training lowers the loss and the exported model predicts held-out data better; train mode with
Dropout(p=0) follows torch.optim.SGD step by step. scikit-learn: more estimators and pipelines through
skl2onnx, checked against scikit-learn's loss and central finite differences of it.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import onnx.numpy_helper
import pytest
import torch
from sklearn.datasets import make_classification, make_regression
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LinearRegression, LogisticRegression, SGDClassifier
from sklearn.metrics import log_loss, mean_squared_error
from sklearn.neural_network import MLPClassifier, MLPRegressor
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import MinMaxScaler, StandardScaler
from skl2onnx import to_onnx

import onnxopt
from onnxopt import dsl
from onnxopt.errors import ModelError
from zoo import models_more as M
from zoo.common import (assert_gradients, assert_one_to_one, assert_same_outputs, central_differences, first_step,
                         locate, predict)
from zoo.models import export, flat_gradients, load_into

BATCH = 16
EPOCHS = 6

# NOTE: a dynamo export costs 1-13 s: every model goes through one exporter at least, most through two;
# dynamo at opset 18 for the activations only (other forms of HardSwish, Mish, Softmin, scalar constants).
# bilinear: TorchScript cannot export aten::bilinear. birnn, gru2: dynamo takes 4-13 s (checked by hand, the
# same ONNX GRU/LSTM nodes as TorchScript's). embedding: TorchScript only, see test_integer_inputs.
# conv_same: TorchScript only (its auto_pad=SAME_UPPER; dynamo writes explicit pads, checked by hand).
ONE_EXPORTER = {"bilinear": ["dynamo"], "birnn": ["script"], "gru2": ["script"], "embedding": [],
                "conv_same": ["script"]}
# NOTE: the architectures of the second sweep: TorchScript, and dynamo for the ViT (both exporters were checked
# by hand for every one, same results; dynamo exports take 2-13 s each)
ONE_EXPORTER.update({name: ["script"] for name in ("inverted_residual", "squeeze_excite", "unet", "lstm_lm",
                                                     "text_cnn", "mixer", "siamese", "groupnorm", "vae")})
EXPORTERS = {name: ONE_EXPORTER.get(name, ["dynamo", "script"]) for name in M.MODELS}
EXPORTERS["activations"] = ["dynamo", "dynamo18", "script"]
STATEFUL = [name for name, spec in M.MODELS.items() if spec.stateful]
CASES = [(name, e) for name, exporters in EXPORTERS.items() for e in exporters] + [
    (name, "script_train") for name in STATEFUL]


@pytest.fixture(params=CASES, ids="-".join)
def torch_case(request):
    return request.param


def _mode(exporter: str) -> str:
    return "train" if exporter == "script_train" else "eval"


def _values(model, names) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name in names}


@functools.cache
def _first(name: str, exporter: str):
    """(onnxopt loss, gradients, torch loss, torch gradients, locations) on the first batch, in eval mode."""
    model = M.exported(name, exporter)
    X, y = M.make_data(name)
    X, y = X[:BATCH], y[:BATCH]
    loss, grads, weights = first_step(model, "eval", X, y, loss=M.loss_name(name))
    initial = _values(model, weights)
    module = M.reference_module(name, exporter)
    where = M.locate(module, initial)
    load_into(module, initial, where)  # NOTE: torch runs on the export's exact values (folding rounds)
    module.zero_grad()
    ref = M.torch_loss(name, module(torch.from_numpy(X)), y)
    ref.backward()
    return loss, grads, ref.item(), flat_gradients(module), where


def test_first_loss_equals_torch(torch_case):
    loss, _, ref, _, _ = _first(*torch_case)
    np.testing.assert_allclose(loss, ref, rtol=1e-5)


def test_gradient_equals_autograd(torch_case):
    _, grads, _, ref, where = _first(*torch_case)
    assert_gradients(grads, ref, where, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_only_parameters_are_trained(torch_case):
    _, _, _, _, where = _first(*torch_case)
    assert_one_to_one(where, dict(M.reference_module(*torch_case).named_parameters()))


@functools.cache
def _trained(name: str, exporter: str):
    """EPOCHS epochs of SGD in the export's mode (Dropout(p=0) for training-mode exports: a deterministic
    exported model); returns the epoch mean losses, the export and the trained export."""
    model = M.exported(name, exporter, 0.0 if exporter == "script_train" else None)
    step = onnxopt.compile_train_step(model, mode=_mode(exporter), loss=M.loss_name(name),
                                      learning_rate=M.MODELS[name].lr)
    runner = onnxopt.Runner(step)
    X, y = M.make_data(name)
    losses = [np.mean([runner.step(X[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(X), BATCH)])
              for _ in range(EPOCHS)]
    return losses, model, runner.export()


def test_training_lowers_the_loss(torch_case):
    losses, _, _ = _trained(*torch_case)
    assert losses[-1] < 0.9 * losses[0], losses


def test_exported_model_predicts_better(torch_case):
    name, _ = torch_case
    _, before, after = _trained(*torch_case)
    assert_same_outputs(before, after)
    X, y = M.make_data(name, n=64, seed=1)
    held_out = [float(M.torch_loss(name, torch.from_numpy(predict(m, X)), y)) for m in (before, after)]
    assert held_out[1] < 0.95 * held_out[0], held_out


@pytest.mark.parametrize("name", STATEFUL)
def test_train_mode_follows_torch_sgd(name):
    """Training-mode TorchScript export, Dropout(p=0), mode="train": 20 SGD steps give torch's losses and
    BatchNorm running statistics."""
    lr = M.MODELS[name].lr
    step = onnxopt.compile_train_step(M.exported(name, "script_train", 0.0), mode="train",
                                      loss=M.loss_name(name), learning_rate=lr)
    runner = onnxopt.Runner(step)
    module = M.exported_module(name, "script_train", 0.0).train()
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    X, y = M.make_data(name)
    ours, theirs = [], []
    for k in range(20):
        i = (k * BATCH) % len(X)
        ours.append(runner.step(X[i:i + BATCH], y[i:i + BATCH]))
        opt.zero_grad()
        loss = M.torch_loss(name, module(torch.from_numpy(X[i:i + BATCH])), y[i:i + BATCH])
        loss.backward()
        opt.step()
        theirs.append(loss.item())
    np.testing.assert_allclose(ours, theirs, rtol=2e-4)
    inits = _values(runner.export(), {t.name for t in runner.export().graph.initializer})
    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    stats = [inits[n.input[k]] for n in runner.export().graph.node if n.op_type == "BatchNormalization"
             for k in (3, 4)]
    expected = [t.numpy() for m in norms for t in (m.running_mean, m.running_var)]
    assert len(stats) == len(expected)
    for ours_s, theirs_s in zip(stats, expected):
        np.testing.assert_allclose(ours_s, theirs_s, rtol=1e-4, atol=1e-6)


def test_integer_inputs():
    """Embedding on int64 tokens, LogSoftmax head (negative log-likelihood): the first step and training."""
    loss, grads, ref, ref_grads, where = _first("embedding", "script")
    np.testing.assert_allclose(loss, ref, rtol=1e-5)
    for wname, g in grads.items():
        np.testing.assert_allclose(g, ref_grads[where[wname]], rtol=1e-4, atol=1e-6)
    losses, _, _ = _trained("embedding", "script")
    assert losses[-1] < 0.9 * losses[0], losses
    # NOTE: Trainer too feeds X in the model input's own type
    X, y = M.make_data("embedding")
    assert X.dtype == np.int64
    trainer = onnxopt.Trainer(M.exported("embedding", "script"), loss=M.loss_name("embedding"), learning_rate=0.5,
                              max_iter=5, batch_size=BATCH).fit(X, y)
    assert trainer.train_losses_[-1] < 0.9 * trainer.train_losses_[0], trainer.train_losses_
    assert trainer.predict(X[:3]).shape == (3,)


def test_reflect_pad_of_a_hidden_value_is_refused_by_name():
    """onnxruntime's Pad gradient handles constant padding only: a reflect Pad that needs a gradient is an
    error naming the op and the node (a reflect Pad of the input needs none: pool_pad trains)."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.fc = torch.nn.Conv2d(1, 2, 3), torch.nn.Linear(2, 1)

        def forward(self, x):
            h = torch.nn.functional.pad(self.c(x), (1, 1, 1, 1), mode="reflect")
            return self.fc(h.mean(dim=(2, 3)))

    model = export(Net().eval(), np.zeros((2, 1, 5, 5), np.float32), "script")
    with pytest.raises(ModelError, match=r"Pad node '/Pad'.*constant mode only.*padding_mode='zeros'"):
        onnxopt.compile_train_step(model, mode="eval")


def _if_model(static: bool):
    """y = If(c, Relu(z), Neg(z)) + z, z = x @ W, the branches reading z from the outer scope; c is
    ``rank(z) > 1`` (known when compiling: TorchScript writes one for torch.tile) or ``sum(x) > 0``."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32), "W")
    branch = {f"{k}_branch": helper.make_graph([helper.make_node(op, ["z"], [f"{k}_out"])], k, [],
                                               [helper.make_tensor_value_info(f"{k}_out", TensorProto.FLOAT, None)])
              for k, op in (("then", "Relu"), ("else", "Neg"))}
    cond = [helper.make_node("Shape", ["z"], ["s"]), helper.make_node("Size", ["s"], ["r"]),
            helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.array(1, np.int64))),
            helper.make_node("Greater", ["r", "one"], ["c"])] if static else [
        helper.make_node("ReduceSum", ["x"], ["r"], keepdims=0),
        helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.array(0, np.float32))),
        helper.make_node("Greater", ["r", "zero"], ["c"])]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["z"]), *cond,
             helper.make_node("If", ["c"], ["u"], name="rank_if", **branch), helper.make_node("Add", ["u", "z"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), numpy_helper.to_array(w)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_if_of_a_run_time_condition_trains_the_branch_it_takes(sign):
    """An If whose branches read a value that depends on a weight, on a condition known only at run time
    (sum(x) > 0): the If rule (issue 39) differentiates the branch taken; before it, the node was refused by
    name. The gradient is that of Relu(z) + z (then) or of -z + z = 0 (else), computed by hand."""
    model, w = _if_model(static=False)
    rng = np.random.default_rng(2)
    X = sign * np.abs(rng.normal(size=(8, 4))).astype(np.float32)
    y = rng.normal(size=(8, 3)).astype(np.float32)
    loss, grads, _ = first_step(model, "eval", X, y, loss="square", gradient="onnxopt")
    z = X.astype(np.float64) @ w
    out = np.maximum(z, 0) + z if sign > 0 else np.zeros_like(z)
    np.testing.assert_allclose(loss, np.mean((out - y) ** 2), rtol=1e-5)
    dz = 2 * (out - y) / y.size * (((z > 0) + 1.0) if sign > 0 else 0.0)
    np.testing.assert_allclose(grads["W"], X.T @ dz, rtol=1e-5, atol=1e-7)


def test_if_of_a_rank_condition_is_inlined():
    """If(rank(z) > 1) takes its then branch: the gradient is that of Relu(z) + z, computed by hand."""
    model, w = _if_model(static=True)
    rng = np.random.default_rng(1)
    X, y = rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(8, 3)).astype(np.float32)
    loss, grads, _ = first_step(model, "eval", X, y, loss="square", gradient="onnxopt")
    z = X.astype(np.float64) @ w
    out = np.maximum(z, 0) + z
    np.testing.assert_allclose(loss, np.mean((out - y) ** 2), rtol=1e-5)
    dz = 2 * (out - y) / y.size * ((z > 0) + 1.0)
    np.testing.assert_allclose(grads["W"], X.T @ dz, rtol=1e-5, atol=1e-7)


def test_identity_transpose_before_matmul():
    """Transpose(perm=[0, 1]) between two MatMuls (cumsum's rewrite wrote one): the same loss and gradient as
    without it (onnxruntime's GemmTransposeFusion folded it into the Gemm as a 2-D transpose)."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    w, v = rng.normal(size=(4, 6)).astype(np.float32), rng.normal(size=(6, 3)).astype(np.float32)

    def model(transpose: bool):
        nodes = [helper.make_node("MatMul", ["x", "W"], ["a"]),
                 helper.make_node("Transpose", ["a"], ["t"], perm=[0, 1]) if transpose
                 else helper.make_node("Identity", ["a"], ["t"]),
                 helper.make_node("MatMul", ["t", "V"], ["y"])]
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, ["N", 4])],
                                  [helper.make_tensor_value_info("y", 1, ["N", 3])],
                                  [numpy_helper.from_array(w, "W"), numpy_helper.from_array(v, "V")])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])

    X, y = rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(16, 3)).astype(np.float32)
    ours, grads, _ = first_step(model(True), "eval", X, y)
    ref, ref_grads, _ = first_step(model(False), "eval", X, y)
    np.testing.assert_allclose(ours, ref, rtol=1e-6)
    for name in ("W", "V"):
        np.testing.assert_allclose(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# scikit-learn through skl2onnx

OPSET = 18
N_TRAIN = 200


def _mlp(cls, **kw):
    return lambda: cls(hidden_layer_sizes=(8,), max_iter=5, random_state=0, **kw)


# name: (factory, task "r"egression / "b"inary / "m"ulticlass, learning rate or None: fitted exactly)
SK_CASES = {
    "linear_regression": (LinearRegression, "r", None),
    "sgd_classifier_binary": (lambda: SGDClassifier(loss="log_loss", alpha=3.0, max_iter=2, tol=None,
                                                    random_state=0), "b", 0.5),
    "sgd_classifier_multiclass": (lambda: SGDClassifier(loss="log_loss", alpha=0.1, max_iter=2, tol=None,
                                                        random_state=0), "m", 0.05),
    "logistic_regression_binary": (lambda: LogisticRegression(C=0.01), "b", 0.1),
    "mlp_classifier_tanh": (_mlp(MLPClassifier, activation="tanh"), "m", 0.1),
    "mlp_classifier_logistic": (_mlp(MLPClassifier, activation="logistic"), "m", 0.3),
    "mlp_classifier_binary": (_mlp(MLPClassifier), "b", 0.1),
    "scaler_mlp_regressor": (lambda: make_pipeline(StandardScaler(), _mlp(MLPRegressor)()), "r", 0.05),
    "minmax_logistic_regression": (lambda: make_pipeline(MinMaxScaler(), LogisticRegression(C=0.01)), "m",
                                   0.5),
}
PROBA = dsl.losses.cross_entropy(from_logits=False)


@functools.cache
def _sk_data(task: str):
    if task == "r":
        X, y = make_regression(300, 6, noise=5.0, random_state=0)
        return X, y / y.std()
    return make_classification(300, 6, n_informative=4, n_classes=3 if task == "m" else 2, random_state=0)


@functools.cache
def _fitted(name: str):
    factory, task, _ = SK_CASES[name]
    X, y = _sk_data(task)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return factory().fit(X[:N_TRAIN], y[:N_TRAIN])


def _final(est):
    return est.steps[-1][1] if hasattr(est, "steps") else est


def _sk_params(est) -> dict[str, np.ndarray]:
    est = _final(est)
    if hasattr(est, "coefs_"):
        return {**{f"coefs_[{i}]": c for i, c in enumerate(est.coefs_)},
                **{f"intercepts_[{i}]": b for i, b in enumerate(est.intercepts_)}}
    return {"coef_": np.asarray(est.coef_), "intercept_": np.atleast_1d(est.intercept_)}


def _sk_assign(est, flat: np.ndarray) -> None:
    est, start, values = _final(est), 0, {}
    for pname, p in _sk_params(est).items():
        values[pname] = flat[start:start + p.size].reshape(p.shape)
        start += p.size
    if hasattr(est, "coefs_"):
        est.coefs_ = [values[f"coefs_[{i}]"] for i in range(len(est.coefs_))]
        est.intercepts_ = [values[f"intercepts_[{i}]"] for i in range(len(est.intercepts_))]
    else:
        est.coef_ = values["coef_"]
        est.intercept_ = values["intercept_"] if np.ndim(est.intercept_) else values["intercept_"][0]


def _sk_loss(name: str, est, X, y) -> float:
    if SK_CASES[name][1] == "r":
        return mean_squared_error(y, est.predict(X))
    return log_loss(y, est.predict_proba(X), labels=est.classes_)


def _converted(name: str, dtype):
    options = None if SK_CASES[name][1] == "r" else {"zipmap": False}
    return to_onnx(_fitted(name), _sk_data(SK_CASES[name][1])[0][:1].astype(dtype), target_opset=OPSET,
                   options=options)


def _batch(name: str, dtype, rows: slice):
    X, y = _sk_data(SK_CASES[name][1])
    y = y[rows] if SK_CASES[name][1] != "r" else y[rows].astype(dtype).reshape(-1, 1)
    return X[rows].astype(dtype), y


def _sk_options(name: str, model) -> dict:
    return {"loss": "square" if SK_CASES[name][1] == "r" else PROBA, "output": model.graph.output[-1].name}


@functools.cache
def _sk_first(name: str, dtype):
    model = _converted(name, dtype)
    X, y = _batch(name, dtype, slice(0, 32))
    loss, grads, weights = first_step(model, "eval", X, y, **_sk_options(name, model))
    # NOTE: the weights as onnxopt reads the model: attributes lowered to initializers, tied columns single
    initial = onnxopt.train_initializers(model)
    where = locate(_sk_params(_fitted(name)), {n: initial[n] for n in weights})
    raw_X, raw_y = _sk_data(SK_CASES[name][1])
    return loss, grads, where, _sk_loss(name, _fitted(name), raw_X[:32], raw_y[:32])


@pytest.fixture(params=list(SK_CASES))
def sk_case(request):
    return request.param


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sklearn_first_loss(sk_case, dtype):
    loss, _, _, ref = _sk_first(sk_case, dtype)
    np.testing.assert_allclose(loss, ref, rtol=1e-5 if dtype == np.float32 else 1e-10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sklearn_only_coefficients_are_trained(sk_case, dtype):
    """The final estimator's coefficients, each once: a scaler's statistics (float64 StandardScaler's Sub/Div,
    MinMaxScaler's Mul/Add) are not trained."""
    _, _, where, _ = _sk_first(sk_case, dtype)
    assert_one_to_one(where, _sk_params(_fitted(sk_case)))


def test_sklearn_gradient_equals_finite_differences(sk_case):
    _, grads, where, _ = _sk_first(sk_case, np.float64)
    est = _fitted(sk_case)
    X, y = _sk_data(SK_CASES[sk_case][1])
    flat = np.concatenate([p.ravel() for p in _sk_params(est).values()]).astype(np.float64)
    fd = central_differences(flat, lambda v: _sk_assign(est, v), lambda: _sk_loss(sk_case, est, X[:32], y[:32]))
    assert_gradients(grads, fd, where, rtol=1e-5, atol=1e-8 * np.abs(fd).max())


TRAINED = [(name, dtype) for name in SK_CASES if SK_CASES[name][2] for dtype in (np.float32, np.float64)]


@functools.cache
def _sk_trained(name: str, dtype):
    model = _converted(name, dtype)
    X, y = _batch(name, dtype, slice(0, N_TRAIN))
    est = onnxopt.Trainer(model, learning_rate=SK_CASES[name][2], batch_size=32, max_iter=8, random_state=0,
                          update="sgd", scale="never", **_sk_options(name, model))  # NOTE: the learning rates are SGD's
    return est.fit(X, y), model


@pytest.mark.parametrize(("name", "dtype"), TRAINED, ids=lambda v: getattr(v, "__name__", v))
def test_sklearn_training_and_export(name, dtype):
    """Training lowers the loss; the trained model, run by a plain InferenceSession, keeps its outputs and
    beats the estimator on held-out rows."""
    est, model = _sk_trained(name, dtype)
    assert est.train_losses_[-1] < 0.95 * est.train_losses_[0], est.train_losses_
    assert_same_outputs(model, est.trained_model_)
    X, y = _batch(name, dtype, slice(N_TRAIN, None))
    output = len(model.graph.output) - 1
    before, after = (predict(m, X, output) for m in (model, est.trained_model_))
    if SK_CASES[name][1] == "r":
        held_out = [mean_squared_error(y, p.reshape(y.shape)) for p in (before, after)]
    else:
        held_out = [log_loss(y, p, labels=_fitted(name).classes_) for p in (before, after)]
    assert held_out[1] < 0.95 * held_out[0], held_out
