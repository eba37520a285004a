"""The npm package in js/ against the Python Runner: steps compiled here train in Node on onnxruntime-node and on
onnxruntime-web's wasm backend (``node --test``, js/test/) and in a headless Chromium (js/test/browser/), giving the
Runner's losses; what JS writes back (checkpoints, exported models) is read here by the Runner and onnxruntime."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from js_fixtures import BATCH, write_fixtures

import onnxopt
from onnxopt import cli

JS = Path(__file__).resolve().parent.parent / "js"
NODE = shutil.which("node")


def needs(missing: str | None) -> None:
    """Skips with ``missing`` as the reason, or fails under CI=true, where .ci/run installed node, js/node_modules
    and chromium (a skip would hide that they did not install)."""
    if missing is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true: {missing}", pytrace=False)
    pytest.skip(missing)


@pytest.fixture
def node_ready():
    needs("needs node on PATH (.ci/run installs it)" if NODE is None else
          "needs js/node_modules (cd js && ONNXRUNTIME_NODE_INSTALL=skip npm ci; .ci/run does it)"
          if not (JS / "node_modules" / "onnxruntime-web").is_dir() else None)


def chromium() -> str | None:
    """Debian's chromium (apt-get install chromium), or CHROMIUM_PATH."""
    return os.environ.get("CHROMIUM_PATH") or shutil.which("chromium") or shutil.which("chromium-browser")


def _torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _node(args: list[str], env: dict, timeout: int = 600) -> str:
    out = subprocess.run([NODE, *args], cwd=JS, env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, (out.stdout[-6000:] + out.stderr[-3000:])
    return out.stdout


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    folder = tmp_path_factory.mktemp("js_fixtures")
    return folder, write_fixtures(folder, cnn=_torch())


def test_node_and_wasm_train_as_python(node_ready, fixtures, tmp_path):
    folder, manifest = fixtures
    out = _node(["--test", "test/"], {"ONNXOPT_JS_FIXTURES": str(folder), "ONNXOPT_JS_OUT": str(tmp_path)})
    assert "# fail 0" in out and "# skipped 0" in out, out[-3000:]
    # NOTE: what JS wrote back, read by Python: its checkpoint resumes a Runner, its export runs in onnxruntime
    for case in manifest["cases"]:
        path = folder / case["step"]
        X = np.fromfile(folder / case["X"]["file"], np.float32).reshape(case["X"]["dims"])
        y = np.fromfile(folder / case["y"]["file"], case["y"]["type"]).reshape(case["y"]["dims"])
        w = None if "sample_weight" not in case else np.fromfile(folder / case["sample_weight"]["file"], np.float32)
        reference = onnxopt.Runner(path, batch_size=BATCH)
        for i in range(0, len(X), BATCH):
            reference.step(X[i:i + BATCH], y[i:i + BATCH], None if w is None else w[i:i + BATCH])
        expected = reference.export()
        for binding in ("node", "web"):
            runner = onnxopt.Runner(path, batch_size=BATCH)
            meta = runner.load_checkpoint(tmp_path / f"{case['name']}.{binding}.ckpt", kind="onnxopt.Runner")
            assert meta["from"] == binding and runner.step_count == len(case["steps"])
            for name, value in reference.get_weights().items():
                np.testing.assert_allclose(runner.get_weights()[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
            trained = onnx.load(tmp_path / f"{case['name']}.{binding}.trained.onnx")
            onnx.checker.check_model(trained)
            got = ort.InferenceSession(trained.SerializeToString()).run(None, {trained.graph.input[0].name: X})[0]
            want = ort.InferenceSession(expected.SerializeToString()).run(None, {expected.graph.input[0].name: X})[0]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The examples' inputs (js/examples/make_data.py) and the step ``onnxopt compile --js`` writes from them."""
    folder = tmp_path_factory.mktemp("js_example")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    subprocess.run([sys.executable, str(JS / "examples" / "make_data.py"), str(folder)], check=True, env=env,
                   capture_output=True, timeout=300)
    argv = ["compile", str(folder / "classifier.onnx"), "--loss", "cross_entropy", "--update", "adam", "--lr", "0.01",
            "--js", "-o", str(folder / "step.onnx")]
    assert cli.main(argv) == 0
    return folder


def test_node_example_trains_a_classifier_from_csv(node_ready, example):
    out = _node(["examples/node/train.js", str(example / "step.onnx"), str(example / "data.csv"), "--epochs", "10",
                 "-o", str(example / "trained.onnx")], {})
    means = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("epoch")]
    accuracy = float(out.split("accuracy ")[1].split()[0])
    assert len(means) == 10 and means[-1] < 0.5 * means[0] and accuracy > 0.85, out
    # NOTE: its checkpoint resumes a Python Runner on the same step; its export is the trained classifier
    runner = onnxopt.Runner(example / "step.onnx")
    assert runner.load_checkpoint(example / "trained.onnx.ckpt")["epochs"] == 10
    data = np.loadtxt(example / "data.csv", delimiter=",", skiprows=1, dtype=np.float32)
    exported = runner.export()
    scores = ort.InferenceSession(exported.SerializeToString()).run(None, {"X": data[:, :4]})[0]
    trained = ort.InferenceSession(str(example / "trained.onnx")).run(None, {"X": data[:, :4]})[0]
    np.testing.assert_allclose(trained, scores, rtol=1e-5, atol=1e-6)
    assert (scores.argmax(1) == data[:, 4]).mean() == pytest.approx(accuracy, abs=1e-3)


def test_headless_chromium_trains_as_python(node_ready, fixtures, example):
    needs("needs Debian's chromium (apt-get install -y chromium; .ci/run does it)" if chromium() is None else
          "the browser test trains the CNN torch.onnx.export writes: needs torch" if not _torch() else None)
    folder, manifest = fixtures
    out = _node(["test/browser/run.js"], {"ONNXOPT_JS_FIXTURES": str(folder), "CHROMIUM_PATH": chromium(),
                                          "ONNXOPT_JS_EXAMPLE": str(example)})
    report = json.loads(out.strip().splitlines()[-1])
    assert {c["name"] for c in report["cases"]} >= {"mlp", "cnn"}, report
    for case in report["cases"]:
        want = next(c for c in manifest["cases"] if c["name"] == case["name"])
        np.testing.assert_allclose(case["steps"], want["steps"], rtol=1e-4, err_msg=case["name"])
        if "epoch" in want:
            np.testing.assert_allclose(case["epoch"], want["epoch"], rtol=1e-4, err_msg=case["name"])
    # NOTE: examples/browser/ trained 20 epochs of 19 batches in the page, drawing as it went
    losses = report["example"]["losses"]
    assert len(losses) == 20 * 19 and np.mean(losses[-19:]) < 0.5 * np.mean(losses[:19]), losses
    assert report["example"]["trainedBytes"] > 0


def test_for_js_epoch_model_gives_the_runners_losses(tmp_path):
    """ship.for_js: the epoch model it stores runs in onnxruntime (Python) with the Runner's epoch losses, carried
    tensors fed as inputs; the file still loads in the Runner."""
    import base64

    from onnxopt.examples import mlp
    from onnxopt.ship import EPOCH_KEY, for_js

    step = onnxopt.compile_train_step(mlp([4, 8, 2]), loss="square", update="nesterov", portable=True)
    for_js(step).save(tmp_path / "step.onnx")
    entry = json.loads({p.key: p.value for p in onnx.load(tmp_path / "step.onnx").metadata_props}[EPOCH_KEY])
    epoch = ort.InferenceSession(base64.b64decode(entry["model"]))
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((32, 4)).astype(np.float32), rng.standard_normal((32, 2)).astype(np.float32)
    weights = step.initial_weights()
    feeds = {"epoch.X": X[:24].reshape(3, 8, 4), "epoch.X.last": X[24:], "epoch.target": y[:24].reshape(3, 8, 2),
             "epoch.target.last": y[24:], "sample_weight": np.ones(8, np.float32), "epoch.count": np.array(3)}
    for name in entry["carried"]:
        feeds["epoch." + name] = weights[name] if name in weights else (
            np.zeros((), np.int64) if name == "optim.step" else np.zeros_like(weights[name.rsplit(".", 1)[0]]))
    names = {i.name for i in epoch.get_inputs()}
    losses = epoch.run(["epoch.losses"], {k: v for k, v in feeds.items() if k in names})[0]
    expected = onnxopt.Runner(tmp_path / "step.onnx", batch_size=8).epoch(X, y)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)


@pytest.mark.parametrize("update", ["sgd", "adam"])
def test_packed_form_gives_the_runners_losses_and_weights(update):
    """ship.pack_carry, run in onnxruntime (Python) as the JS runner runs it: one ``carry`` in, ``carry.new`` out
    (its last element the loss), the step counter advanced by the caller (an input only where the step reads it),
    the hoisted sample-weight values from the side model; losses and weights (read through the layout) against the
    Runner's, on batches of two lengths."""
    import base64

    from onnxopt.examples import mlp
    from onnxopt.ship import pack_carry

    step = onnxopt.compile_train_step(mlp([4, 8, 3]), loss="square", update=update, learning_rate=0.05, portable=True)
    entry = pack_carry(step, batch_size=8)
    sess = ort.InferenceSession(base64.b64decode(entry["model"]))
    side = ort.InferenceSession(base64.b64decode(entry["side"]))
    assert [o.name for o in sess.get_outputs()] == ["carry.new"] and entry["counted"]
    taken = {i.name for i in sess.get_inputs()}
    assert ("optim.step" in taken) == (update == "adam")  # NOTE: SGD's step reads no counter: no such input
    initial = step.initial_weights()
    carry = np.zeros(entry["loss_at"] + 1, np.float32)
    for name, offset, dims in entry["carry"]:  # NOTE: optimizer state starts at zero
        if name in initial:
            carry[offset:offset + int(np.prod(dims))] = initial[name].ravel()
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((20, 4)).astype(np.float32), rng.standard_normal((20, 3)).astype(np.float32)
    runner, count = onnxopt.Runner(step, batch_size=8), 0
    for i in range(0, len(X), 8):
        xb, yb = X[i:i + 8], y[i:i + 8]
        ones = {step.sample_weight: np.ones(len(xb), np.float32)}
        hoisted = dict(zip(entry["hoisted"], side.run(entry["hoisted"], ones)))
        feeds = {step.inputs[0]: xb, step.target: yb.reshape(len(xb), *entry["target_shape"]), "carry": carry,
                 "optim.step": np.array(count), **hoisted}
        carry, count = sess.run(None, {k: v for k, v in feeds.items() if k in taken})[0], count + 1
        np.testing.assert_allclose(carry[entry["loss_at"]], runner.step(xb, yb), rtol=1e-5)
    for name, offset, dims in entry["carry"]:
        if name in step.weights:
            np.testing.assert_allclose(carry[offset:offset + int(np.prod(dims))].reshape(dims),
                                       runner.get_weights()[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_for_js_leaves_out_the_epoch_form_of_a_random_step(tmp_path):
    """A step with Dropout has no epoch form (a Scan's kernel draws other masks): ``epoch()`` runs steps."""
    torch = pytest.importorskip("torch")
    from onnxopt.ship import EPOCH_KEY, for_js

    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    torch.onnx.export(net.train(), (torch.zeros(2, 4),), str(tmp_path / "m.onnx"), dynamo=False, input_names=["x"],
                      dynamic_axes={"x": {0: "N"}}, training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    step = onnxopt.compile_train_step(str(tmp_path / "m.onnx"), portable=True)
    assert any(n.op_type == "Dropout" for n in step.model.graph.node)
    assert EPOCH_KEY not in {p.key for p in for_js(step).model.metadata_props}


def test_typescript_declarations_type_a_use(node_ready):
    """src/index.d.ts against test/types/usage.ts, strict (TypeScript from js/'s devDependencies)."""
    _node(["node_modules/typescript/bin/tsc", "-p", "test/types"], {})


def test_training_session_trains_generate_artifacts(node_ready, tmp_path):
    """js/test/training.test.js: TrainingSession on the artifacts of compat.onnxruntime_training, against its api."""
    pytest.importorskip("onnxopt.compat.onnxruntime_training.api", reason="needs onnxopt.compat.onnxruntime_training")
    from js_fixtures import write_training_fixtures

    write_training_fixtures(tmp_path)
    out = _node(["--test", "test/training.test.js"], {"ONNXOPT_JS_TRAINING": str(tmp_path)})
    assert "# fail 0" in out and "# skipped 0" in out and "# pass 8" in out, out[-3000:]
