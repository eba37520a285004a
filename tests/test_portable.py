"""Portable steps trained outside the training build: in a second virtual environment (Python 3.13+, stock
onnxruntime, created once at <repo>/.venv313) and under onnx.reference, with the training build's losses.

Without a Python 3.13+ interpreter the cross-environment test is skipped, except in CI (CI=true), where it fails.
"""

import fcntl
import glob
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import onnx
import pytest

import onnxopt
from onnxopt.examples import mlp
from onnxopt.passes.lower import check_portable
from helpers import under_reference

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(REPO, ".venv313")
WORKER = os.path.join(REPO, "tests", "portable_worker.py")


def _python313() -> str | None:
    """A working Python >= 3.13: $ONNXOPT_PYTHON313, python3.13/python3.14 on PATH, or a pyenv install."""
    candidates = [os.environ.get("ONNXOPT_PYTHON313"), shutil.which("python3.13"), shutil.which("python3.14"),
                  *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[3-9]*/bin/python3")))]
    for exe in filter(None, candidates):
        try:  # NOTE: a pyenv shim exists on PATH even when its version is not selected; it then fails
            out = subprocess.run([exe, "-c", "import sys; print(sys.version_info >= (3, 13))"],
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == "True":
            return exe
    return None


def _stamp() -> str:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="session")
def venv313() -> str:
    """The Python of <repo>/.venv313 with onnxopt installed (editable, so its markers pick stock onnxruntime);
    created once, reused while pyproject.toml is unchanged."""
    if not onnxopt.gradient.has_training_build():
        pytest.skip("compares the training build's steps with stock onnxruntime's: runs from the training build")
    exe = _python313()
    if exe is None:
        message = "no Python >= 3.13 found (python3.13 on PATH, ~/.pyenv/versions/3.13*, or $ONNXOPT_PYTHON313)"
        if os.environ.get("CI") == "true":
            pytest.fail(message + ": CI must run the portable job")
        pytest.skip(message)
    python = os.path.join(VENV, "bin", "python")
    stamp = os.path.join(VENV, "onnxopt-stamp")
    with open(VENV + ".lock", "w") as lock:  # NOTE: several pytest runs may share the repository
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (os.path.exists(stamp) and open(stamp).read() == _stamp()):
            subprocess.run([exe, "-m", "venv", "--clear", VENV], check=True, timeout=600)
            out = subprocess.run([python, "-m", "pip", "install", "-q", "-e", REPO], capture_output=True, text=True,
                                 timeout=1200)
            assert out.returncode == 0, f"pip install -e . in {VENV} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
            with open(stamp, "w") as f:
                f.write(_stamp())
    return python


def _torch_model(kind: str) -> onnx.ModelProto:
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(0)
    if kind == "layernorm":
        module, x = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3)), torch.randn(5, 4)
    elif kind == "attention":  # NOTE: batched MatMuls, whose gradients the builder writes as FusedMatMul

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.attn, self.norm, self.head = nn.MultiheadAttention(8, 2, batch_first=True), nn.LayerNorm(8), \
                    nn.Linear(8, 3)

            def forward(self, x):
                return self.head(self.norm(x + self.attn(x, x, x, need_weights=False)[0]).mean(dim=1))

        module, x = Block(), torch.randn(5, 4, 8)
    elif kind == "gru":  # NOTE: unrolled over its 5 steps in a portable step

        class Recurrent(nn.Module):
            def __init__(self):
                super().__init__()
                self.gru, self.head = nn.GRU(3, 6, batch_first=True), nn.Linear(6, 3)

            def forward(self, x):
                return self.head(self.gru(x)[0][:, -1])

        module, x = Recurrent(), torch.randn(5, 5, 3)
    else:  # NOTE: no AveragePool: the training build's AveragePoolGrad crashes with a dynamic batch size
        module = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, stride=2),
                               nn.Tanh(), nn.Flatten(), nn.Linear(4, 3))
        x = torch.randn(5, 1, 8, 8)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), (x,), f, dynamo=False, input_names=["X"], output_names=["Y"],
                          dynamic_axes={"X": {0: "N"}, "Y": {0: "N"}}, opset_version=18)
    return onnx.load_from_string(f.getvalue())


# name -> (model, compile kwargs, X shape, task)
CASES = {
    "mlp-relu": (lambda: mlp([4, 8, 3]), dict(loss="cross_entropy", update="adam"), (4,), "classes"),
    "mlp-tanh": (lambda: mlp([4, 8, 1], activation="Tanh"), dict(loss="square", update="nesterov", penalty="l2"),
                 (4,), "values"),
    "mlp-sigmoid-f64": (lambda: mlp([4, 8, 3], activation="Sigmoid", dtype=np.float64),
                        dict(loss="cross_entropy", update="momentum"), (4,), "classes"),
    "layernorm": (lambda: _torch_model("layernorm"), dict(loss="cross_entropy", update="sgd", learning_rate=0.1),
                  (4,), "classes"),
    "attention": (lambda: _torch_model("attention"), dict(loss="cross_entropy", update="momentum", learning_rate=0.1),
                  (4, 8), "classes"),
    "gru": (lambda: _torch_model("gru"), dict(loss="cross_entropy", update="adam", learning_rate=0.01), (5, 3),
            "classes"),
    "cnn": (lambda: _torch_model("cnn"), dict(loss="cross_entropy", update="momentum", learning_rate=0.05),
            (1, 8, 8), "classes"),
}


def _batches(shape, task, dtype, rng, n=4, size=6):
    X = [rng.normal(size=(size, *shape)).astype(dtype) for _ in range(n)]
    y = [rng.integers(0, 3, size) if task == "classes" else rng.normal(size=size).astype(dtype) for _ in range(n)]
    return X, y


def test_portable_steps_train_the_same_on_stock_onnxruntime(venv313, tmp_path):
    rng = np.random.default_rng(0)
    cases, expected = [], {}
    for name, (make, kwargs, shape, task) in CASES.items():
        model = make()
        onnx.save(model, tmp_path / f"{name}.model.onnx")
        plain = onnxopt.compile_train_step(model, **kwargs)
        portable = onnxopt.compile_train_step(model, portable=True, **kwargs)
        check_portable(portable.model)
        portable.save(tmp_path / f"{name}.onnx")
        dtype = plain.initial_weights()[plain.weights[0]].dtype
        X, y = _batches(shape, task, dtype, rng)
        np.savez(tmp_path / f"{name}.npz", **{f"X{i}": a for i, a in enumerate(X)}, **{f"y{i}": a for i, a in enumerate(y)})
        runner = onnxopt.Runner(plain)
        losses = [runner.step(a, b) for a, b in zip(X, y)]
        trainer = onnxopt.Trainer(plain, loss=kwargs["loss"], batch_size=len(X[0]), max_iter=2, shuffle=False,
                                  tol=None).fit(np.concatenate(X), np.concatenate(y))
        prediction = onnxopt.Runner(plain)
        for a, b in zip(X, y):
            prediction.step(a, b)
        from helpers import session

        sess = session(prediction.export())
        expected[name] = dict(losses=losses, trainer=trainer.train_losses_, dtype=dtype,
                              prediction=sess.run(None, {sess.get_inputs()[0].name: X[0]})[0])
        cases.append(dict(name=name, step=f"{name}.onnx", model=f"{name}.model.onnx", data=f"{name}.npz",
                          n_batches=len(X), loss=kwargs["loss"], kwargs=kwargs))
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out = subprocess.run([venv313, WORKER, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["python"] >= [3, 13] and not results["training_build"], results
    for name, want in expected.items():
        got = results["cases"][name]
        rtol = 1e-5 if want["dtype"] == np.float32 else 1e-10
        np.testing.assert_allclose(got["losses"], want["losses"], rtol=rtol, err_msg=name)
        # NOTE: compiled on Python 3.13 with stock onnxruntime from the same model: the same training
        np.testing.assert_allclose(got["compiled_here"], want["losses"], rtol=rtol, err_msg=name)
        np.testing.assert_allclose(got["resumed"], got["losses"][2:], rtol=0, atol=0, err_msg=name)
        np.testing.assert_allclose(got["prediction"], want["prediction"], rtol=10 * rtol, atol=10 * rtol, err_msg=name)
        np.testing.assert_allclose(got["trainer_losses"], want["trainer"], rtol=rtol, err_msg=name)


def test_portable_step_under_onnx_reference(rng):
    batches = [(rng.normal(size=(8, 4)), rng.integers(0, 3, 8)) for _ in range(3)]
    under_reference(mlp([4, 8, 3], activation="Tanh", dtype=np.float64), batches, 1e-10, atol=1e-12,
                    loss="cross_entropy", update="adam", penalty="l1")


@pytest.mark.parametrize("kind, shape", [("attention", (4, 8)), ("cnn", (1, 8, 8)), ("gru", (5, 3))])
def test_torch_export_steps_under_onnx_reference(kind, shape, rng):
    batches = [(rng.normal(size=(6, *shape)).astype(np.float32), rng.integers(0, 3, 6)) for _ in range(2)]
    under_reference(_torch_model(kind), batches, 1e-5, loss="cross_entropy", update="momentum", learning_rate=0.1)


def test_cli_compile_portable(tmp_path):
    from onnxopt.cli import main

    onnx.save(mlp([3, 5, 2]), tmp_path / "model.onnx")
    assert main(["compile", str(tmp_path / "model.onnx"), "--loss", "cross_entropy", "--portable",
                 "-o", str(tmp_path / "step.onnx")]) == 0
    check_portable(onnxopt.TrainStep.load(tmp_path / "step.onnx").model)


def test_compiling_without_the_training_build(monkeypatch, rng):
    """Without the builder (stock onnxruntime), onnxopt's rules compile a portable step that trains as the
    step compiled with the training build present does; asking for the builder says what to do."""
    from onnxruntime.capi import _pybind_state

    model = mlp([3, 5, 2])
    X, y = rng.normal(size=(8, 3)).astype(np.float32), rng.integers(0, 2, 8)
    expected = onnxopt.Runner(onnxopt.compile_train_step(model, loss="cross_entropy", portable=True)).step(X, y)
    monkeypatch.delattr(_pybind_state, "OrtModuleGraphBuilder", raising=False)
    step = onnxopt.compile_train_step(model, loss="cross_entropy")
    check_portable(step.model)
    np.testing.assert_allclose(onnxopt.Runner(step).step(X, y), expected, rtol=1e-6)
    assert onnxopt.ForwardBackward(model).forward(X)[0].shape == (8, 2)
    for build in (lambda: onnxopt.compile_train_step(model, gradient="builder"),
                  lambda: onnxopt.gradient_model(model, gradient="builder"),
                  lambda: onnxopt.ForwardBackward(model, gradient="builder")):
        with pytest.raises(ImportError, match=r"needs onnxruntime-training.*gradient='onnxopt'"):
            build()


def test_trainer_takes_a_saved_step(tmp_path, rng):
    model = mlp([4, 6, 3])
    step = onnxopt.compile_train_step(model, loss="cross_entropy", update="adam", portable=True)
    step.save(tmp_path / "step.onnx")
    X, y = rng.normal(size=(40, 4)).astype(np.float32), rng.integers(0, 3, 40)
    fit = dict(batch_size=8, max_iter=3, tol=None)
    compiled = onnxopt.Trainer(model, loss="cross_entropy", update="adam", learning_rate=1e-2, **fit).fit(X, y)
    saved = onnxopt.Trainer(str(tmp_path / "step.onnx"), loss="cross_entropy", **fit).fit(X, y)
    np.testing.assert_allclose(saved.train_losses_, compiled.train_losses_, rtol=1e-6)
    assert saved.predict(X).shape == (40,)
    with pytest.raises(onnxopt.ModelError, match="loss: the saved step takes 'index' targets"):
        onnxopt.Trainer(step, loss="square", **fit).fit(X, y.astype(np.float32))


def test_bench_portable_worker_times_a_saved_step(tmp_path):
    from onnxopt.bench.portable import serve
    from onnxopt.bench.workloads import WORKLOADS

    wl = WORKLOADS["W2"]
    onnxopt.compile_train_step(wl.model(), loss=wl.loss, learning_rate=wl.lr, portable=True).save(tmp_path / "s.onnx")
    # NOTE: the worker side of compare(): its versions and kernels, then one block per line read
    out = io.StringIO()
    serve(str(tmp_path / "s.onnx"), "W2", 1, stdin=io.StringIO("\n\n"), stdout=out)
    info, *blocks = [json.loads(line) for line in out.getvalue().splitlines()]
    assert info["kernels"] > 5 and info["onnxruntime"] and len(blocks) == 2
    assert all(wall > 0 and cpu > 0 for wall, cpu in blocks)


def test_bench_compares_the_portable_step_on_stock_onnxruntime(venv313):
    from onnxopt.bench.portable import compare, find_python, markdown

    exe, about = find_python(venv313)
    assert exe == venv313 and "onnxruntime 1." in about, about
    row = compare(["W1-sgd"], venv313, turns=2, epochs=1, log=lambda _: None)["W1-sgd"]
    ours, stock, both = row["training build"], row["portable, stock"], row["portable, training build"]
    assert tuple(map(int, stock["python"].split(".")[:2])) >= (3, 13)
    assert stock["onnxruntime"] != ours["onnxruntime"] == both["onnxruntime"]
    # NOTE: the same graph on both builds; the training build's step has as many kernels or fewer (the Runner
    # runs its small ReluGrads as Sign + Mul and its SGD bias updates as Gemms, as the portable step does)
    assert stock["kernels"] == both["kernels"] >= ours["kernels"]
    assert all(0.2 < r < 5 for r in row["ratio"]), row["ratio"]
    text = markdown({"W1-sgd": row}, "note")
    assert f"| W1-sgd | portable, stock | {stock['python']} | {stock['onnxruntime']} | {stock['kernels']} |" in text
    assert "| W1-sgd | portable on stock / training build ≤ 1.1 |" in text
