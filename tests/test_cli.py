"""The command line, run in-process: every command, its --help, and one-line errors with exit code 2."""

import csv
import shutil
import subprocess
import sys
import types

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnxopt
from onnxopt.cli import load_data, main
from onnxopt.examples import linear_regression

COEF = np.array([3.0, -2.0])


@pytest.fixture
def files(tmp_path, monkeypatch):
    """A linear-regression model and its data as .csv and .npz, in the working directory."""
    monkeypatch.chdir(tmp_path)
    onnx.save(linear_regression(2), "model.onnx")
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 2))
    y = X @ COEF + 1.0
    with open("data.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["a", "b", "price"])
        writer.writerows(np.column_stack([X, y]).tolist())
    np.savez("data.npz", X=X, y=y)
    return tmp_path


def _predict(path, X):
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return sess.run(None, {"X": X.astype(np.float32)})[0].ravel()


def test_compile_list(capsys):
    assert main(["compile", "--list"]) == 0
    out = capsys.readouterr().out
    for name in [*onnxopt.dsl.losses.LOSSES, *onnxopt.dsl.updates.UPDATES, *onnxopt.dsl.penalties.PENALTIES,
                 *onnxopt.dsl.schedules.SCHEDULES]:
        assert f"\n  {name} " in out
    assert "momentum=0.9" in out and "power_t=0.25" in out


def test_compile_writes_the_requested_step(files, capsys):
    argv = ["compile", "model.onnx", "--loss", "huber:delta=0.5", "--update", "nesterov:momentum=0.8",
            "--penalty", "elastic:l1=0.1,l2=0.9", "--lr", "invscaling:eta0=0.05", "--weights", "coef", "-o", "s.onnx"]
    assert main(argv) == 0
    step = onnxopt.TrainStep.load("s.onnx")
    assert step.weights == ["coef"]
    assert "coef.velocity" in step.state
    assert "wrote s.onnx" in capsys.readouterr().out
    # the same step from the Python API has the same graph
    def compiled(momentum):
        return onnxopt.compile_train_step(linear_regression(2), loss=onnxopt.dsl.losses.huber(delta=0.5),
                                          update=onnxopt.dsl.updates.nesterov(momentum=momentum),
                                          penalty=onnxopt.dsl.penalties.elastic(l1=0.1, l2=0.9),
                                          learning_rate=onnxopt.dsl.schedules.invscaling(eta0=0.05), weights=["coef"])

    def constants(model):
        """Every node with its attributes (Constant values, hyper-parameters on calls), in functions too, and
        every initializer (the hyper-parameters the fuser folds into constants)."""
        graphs = [model.graph.node, *(f.node for f in model.functions)]
        inits = sorted((i.name, i.SerializeToString()) for i in model.graph.initializer)
        return [(n.op_type, [a.SerializeToString() for a in n.attribute]) for nodes in graphs for n in nodes], inits

    assert constants(step.model) == constants(compiled(0.8).model)
    assert constants(step.model) != constants(compiled(0.7).model)  # the comparison sees the momentum


def test_compile_float_lr_and_loss_output(files):
    with_loss = onnxopt.add_loss_output(linear_regression(2))
    onnx.save(with_loss, "with_loss.onnx")
    assert main(["compile", "with_loss.onnx", "--loss-output", "loss", "--lr", "0.1", "-o", "s.onnx"]) == 0
    assert onnxopt.TrainStep.load("s.onnx").target == "target"


@pytest.mark.parametrize("data", ["data.csv", "data.npz"])
def test_fit_learns_and_resumes_from_checkpoint(files, capsys, data):
    base = ["fit", "model.onnx", data, "--lr", "0.05", "--quiet", "-o", "trained.onnx", "--checkpoint", "ckpt",
            "--tol", "none"]
    if data.endswith(".csv"):
        base += ["--target", "price"]
    assert main([*base, "--epochs", "2"]) == 0
    first = capsys.readouterr().out
    assert "resuming" not in first and "trained 2 epochs" in first
    assert main([*base, "--epochs", "20"]) == 0
    second = capsys.readouterr().out
    assert "resuming from the checkpoint in ckpt after epoch 2" in second and "trained 18 epochs" in second
    rows = [line.split() for line in second.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(1, 21))  # the resumed run keeps the first epochs' losses
    assert float(rows[-1][1]) < float(rows[0][1]) / 100
    X = np.random.default_rng(1).normal(size=(10, 2))
    np.testing.assert_allclose(_predict("trained.onnx", X), X @ COEF + 1.0, atol=0.05)


def test_show_dot_svg_and_no_graphviz(files, capsys, monkeypatch):
    assert main(["compile", "model.onnx", "-o", "s.onnx"]) == 0
    assert main(["show", "s.onnx", "-o", "s.dot", "--title", "linear regression"]) == 0
    text = open("s.dot").read()
    assert text.startswith("digraph") and "linear regression" in text
    for region in ("forward", "loss", "backward", "schedule", "update"):
        assert f'"legend:{region}"' in text
    assert '"in:X"' in text and '"out:coef.new"' in text
    if shutil.which("dot"):
        assert main(["show", "s.onnx", "-o", "s.svg"]) == 0
        assert "<svg" in open("s.svg").read()
    monkeypatch.setattr(shutil, "which", lambda name: None)
    capsys.readouterr()
    assert main(["show", "s.onnx", "-o", "nodot.png"]) == 0
    out = capsys.readouterr().out
    assert "not on PATH" in out and "nodot.dot" in out and len(out.strip().splitlines()) == 1
    assert open("nodot.dot").read() == text.replace("  labelloc=t; label=\"linear regression\"; fontname=Helvetica;\n", "")


@pytest.mark.parametrize("minimal", [True, False], ids=["no-sklearn-no-matplotlib", "skl2onnx-matplotlib"])
def test_demo_writes_its_files(tmp_path, capsys, monkeypatch, minimal):
    if minimal:
        monkeypatch.setitem(sys.modules, "matplotlib", None)
    else:
        pytest.importorskip("skl2onnx")
        pytest.importorskip("matplotlib")
    out = tmp_path / "demo"
    argv = ["demo", "--out", str(out), "--epochs", "3", "--samples", "60", "--features", "4", "--quiet"]
    assert main(argv + (["--no-sklearn"] if minimal else [])) == 0
    text = capsys.readouterr().out
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 3]
    assert "us (median" in text and "held-out" in text
    assert ("matplotlib is not installed" in text) == minimal and ("skl2onnx" in text) != minimal
    assert (out / "loss.png").exists() != minimal
    step = onnxopt.TrainStep.load(out / "train_step.onnx")
    trained = onnx.load(out / "trained.onnx")
    assert sorted(onnxopt.train_initializers(trained)) == sorted(step.weights)


def test_bench_forwards_its_arguments(monkeypatch):
    seen = []
    fake = types.ModuleType("onnxopt.bench")
    fake.main = lambda argv=None: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "onnxopt.bench", fake)
    assert main(["bench", "--quick", "--out", "x"]) == 0
    assert seen == [["--quick", "--out", "x"]]


def test_bench_missing_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnxopt.bench", None)
    assert main(["bench"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("command", ["demo", "compile", "fit", "show"])
def test_help_has_examples(command, capsys):
    assert main([command, "--help"]) == 0
    assert "examples:" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["compile", "missing.onnx", "-o", "s.onnx"],
    ["compile", "model.onnx", "--loss", "nope", "-o", "s.onnx"],
    ["compile", "model.onnx", "--update", "nesterov:momentum", "-o", "s.onnx"],
    ["compile", "model.onnx", "--update", "nesterov:beta=1", "-o", "s.onnx"],
    ["compile", "model.onnx", "--update", "nesterov:momentum=2", "-o", "s.onnx"],
    ["compile", "model.onnx", "--lr", "cosine:warmup=5000", "-o", "s.onnx"],
    ["compile", "model.onnx", "--weights", "nope", "-o", "s.onnx"],
    ["compile", "model.onnx", "-o", "s.txt"],
    ["compile", "model.onnx"],
    ["compile", "data.csv", "-o", "s.onnx"],
    ["fit", "model.onnx", "data.csv", "-o", "t.onnx"],
    ["fit", "model.onnx", "data.csv", "--target", "nope", "-o", "t.onnx"],
    ["fit", "model.onnx", "data.npz", "--target", "nope", "-o", "t.onnx"],
    ["fit", "model.onnx", "data.txt", "-o", "t.onnx"],
    ["fit", "model.onnx", "missing.csv", "--target", "price", "-o", "t.onnx"],
    ["fit", "model.onnx", "data.csv", "--target", "price", "--batch-size", "0", "-o", "t.onnx"],
    ["fit", "model.onnx", "data.csv", "--target", "price", "--epochs", "x", "-o", "t.onnx"],
    ["fit", "model.onnx", "data.csv", "--target", "price", "--tol", "low", "-o", "t.onnx"],
    ["show", "model.onnx", "-o", "x.jpg"],
    ["show", "missing.onnx", "-o", "x.svg"],
    ["show", "model.onnx"],
    ["frobnicate"],
    ["compile", "model.onnx", "-o", "s.onnx", "--unknown"],
    ["fit", "model.onnx", "header.csv", "--target", "price", "-o", "t.onnx"],
    ["fit", "model.onnx", "ragged.csv", "--target", "price", "-o", "t.onnx"],
    ["fit", "model.onnx", "data.csv", "--target", "price", "--validation-fraction", "1", "-o", "t.onnx"],
])
def test_wrong_arguments_exit_2_with_one_line(files, capsys, argv):
    open("data.txt", "w").write("1 2 3\n")
    open("header.csv", "w").write("a,b,price\n")
    open("ragged.csv", "w").write("a,b,price\n1,2,3\n4,5,6,7\n")
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "error" in captured.err and "Traceback" not in captured.err


@pytest.mark.parametrize("name,message", [("header.csv", "has a header and no data rows"),
                                          ("ragged.csv", "line 3 has 4 values, expected 3 like the header"),
                                          ("text.csv", "line 3, column 'b': expected a number or True/False "
                                                       "(every column but --target is a feature), got 'n/a'"),
                                          ("missing.csv", "line 2, column 'a': expected a number or True/False "
                                                          "(every column but --target is a feature), got a missing "
                                                          "value (fill or drop it")])
def test_csv_errors_name_the_row_and_counts(files, capsys, name, message):
    open("header.csv", "w").write("a,b,price\n")
    open("ragged.csv", "w").write("a,b,price\n1,2,3\n4,5,6,7\n")
    open("text.csv", "w").write("a,b,price\n1,2,3\n4,n/a,6\n")
    open("missing.csv", "w").write("a,b,price\n,2,3\n4,5,6\n")  # NOTE: pandas writes NaN as nothing
    assert main(["fit", "model.onnx", name, "--target", "price", "-o", "t.onnx"]) == 2
    assert message in capsys.readouterr().err


def test_checkpoint_of_another_model_and_nothing_to_resume_are_one_line(files, capsys):
    base = ["fit", "model.onnx", "data.csv", "--target", "price", "--quiet", "-o", "t.onnx", "--checkpoint", "ckpt"]
    assert main([*base, "--epochs", "2", "--tol", "none"]) == 0
    capsys.readouterr()
    assert main([*base, "--epochs", "2"]) == 2  # the checkpoint holds every epoch asked for
    err = capsys.readouterr()
    assert err.err.count("\n") == 1 and "nothing left to train" in err.err and "trained" not in err.out
    assert main([*base, "--epochs", "4", "--update", "sgd"]) == 2  # adam's moments are not in an sgd step
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "another model or optimizer" in err and "new --checkpoint folder" in err


def test_without_the_training_build_fit_and_demo_compile(files, capsys, monkeypatch, tmp_path):
    """What Python 3.13's stock onnxruntime lacks: fit and demo compile with onnxopt's rules all the same;
    asking for the builder there is one line saying what to do."""
    import onnxruntime.capi._pybind_state as C

    monkeypatch.delattr(C, "OrtModuleGraphBuilder", raising=False)
    assert main(["fit", "model.onnx", "data.csv", "--target", "price", "--epochs", "2", "--quiet", "-o", "t.onnx"]) == 0
    assert "R²" in capsys.readouterr().out
    assert main(["demo", "--no-sklearn", "--epochs", "2", "--out", str(tmp_path / "demo")]) == 0
    capsys.readouterr()
    assert main(["fit", "model.onnx", "data.csv", "--target", "price", "--gradient", "builder", "-o", "t.onnx"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs onnxruntime-training" in err and "gradient='onnxopt'" in err


def test_fit_hints_when_the_loss_stays_at_the_target_variance(files, capsys):
    base = ["fit", "model.onnx", "data.csv", "--target", "price", "--quiet", "-o", "t.onnx", "--epochs", "3"]
    assert main([*base, "--lr", "1e-9", "--scale", "never"]) == 0  # no learning: R² of the initial weights
    out = capsys.readouterr().out
    assert "hint: the loss stays at the target's variance" in out
    assert main(base) == 0
    assert "hint:" not in capsys.readouterr().out


@pytest.mark.parametrize("command", ["demo", "compile", "fit", "show"])
def test_help_shows_every_default(command, capsys):
    parser = __import__("onnxopt.cli", fromlist=["_parser"])._parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    assert main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for action in sub._actions:
        if action.option_strings and action.default not in (None, False, "==SUPPRESS=="):
            assert f"(default: {action.default})" in text, action.option_strings


def test_python_dash_m_help():
    done = subprocess.run([sys.executable, "-m", "onnxopt", "--help"], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "compile" in done.stdout and "examples:" in done.stdout


def test_csv_class_labels_train_a_classifier(tmp_path, monkeypatch, capsys):
    """A .csv whose target column holds class names (as a Parquet string column may): features are numbers,
    the labels are kept as text and encoded by the Trainer."""
    skl = pytest.importorskip("skl2onnx")
    from sklearn.linear_model import LogisticRegression

    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(1)
    X = rng.normal(size=(300, 3))
    labels = np.where(X @ [1.0, -1.0, 0.5] > 0, "yes", "no")
    fitted = LogisticRegression().fit(X[:20], rng.permutation(labels[:20]))  # NOTE: shuffled labels: untrained
    onnx.save(skl.to_onnx(fitted, X[:1].astype(np.float32), options={"zipmap": False}), "clf.onnx")
    assert np.mean(fitted.predict(X) == labels) < 0.8
    with open("d.csv", "w", newline="") as f:
        csv.writer(f).writerows([["a", "b", "c", "kind"], *([*map(float, x), k] for x, k in zip(X, labels))])
    assert main(["fit", "clf.onnx", "d.csv", "--target", "kind", "--epochs", "30", "--quiet", "-o", "t.onnx"]) == 0
    sess = ort.InferenceSession("t.onnx", providers=["CPUExecutionProvider"])
    assert np.mean(sess.run(None, {"X": X.astype(np.float32)})[0] == labels) > 0.9


def test_onnxruntime_failure_is_one_line_unless_asked(files, capsys, monkeypatch):
    """An error raised by onnxruntime itself (its exception classes are not RuntimeErrors) ends in one line and
    exit code 1; ONNXOPT_TRACEBACK=1 lets it through with its traceback."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail

    def fail(*args, **kwargs):
        raise Fail("[ONNXRuntimeError] : 1 : FAIL : Node () Op (Sub) [ShapeInferenceError] Incompatible dimensions")

    monkeypatch.setattr(onnxopt.Trainer, "fit", fail)
    argv = ["fit", "model.onnx", "data.csv", "--target", "price", "-o", "t.onnx"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "onnxruntime: [ONNXRuntimeError]" in err and "ONNXOPT_TRACEBACK=1" in err, err
    monkeypatch.setenv("ONNXOPT_TRACEBACK", "1")
    with pytest.raises(Fail):
        main(argv)


def test_csv_boolean_features_read_as_parquet_reads_them(tmp_path, monkeypatch):
    """pandas writes a bool column as True/False in a .csv and as booleans in Parquet: both read as 1/0."""
    pd = pytest.importorskip("pandas")
    monkeypatch.chdir(tmp_path)
    frame = pd.DataFrame({"a": [1.5, -2.0, 0.25], "flag": [True, False, True], "price": [1.0, 2.0, 3.0]})
    frame.to_csv("d.csv", index=False)
    X, y = load_data("d.csv", "price")
    np.testing.assert_array_equal(X, [[1.5, 1.0], [-2.0, 0.0], [0.25, 1.0]])
    np.testing.assert_array_equal(y, [1.0, 2.0, 3.0])


def test_csv_features_pick_and_order_the_columns(files, capsys):
    """--features on a CSV was ignored: every column but the target was read, whatever it named. It now picks
    the model's columns in its order (the weights then follow that order), as for a Parquet DATA."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(300, 3))
    with open("wide.csv", "w", newline="") as f:  # NOTE: an extra column 'noise' the model does not read
        writer = csv.writer(f)
        writer.writerow(["b", "noise", "a", "price"])
        writer.writerows(np.column_stack([X[:, 1], X[:, 2], X[:, 0], X[:, :2] @ COEF + 1.0]).tolist())
    argv = ["fit", "model.onnx", "wide.csv", "--target", "price", "--epochs", "200", "--lr", "0.05", "--quiet",
            "--validation-fraction", "0", "-o", "t.onnx"]
    assert main([*argv, "--features", "a,b"]) == 0
    coef = onnx.numpy_helper.to_array(next(t for t in onnx.load("t.onnx").graph.initializer if t.name == "coef"))
    np.testing.assert_allclose(coef.ravel(), COEF, atol=0.05)  # NOTE: a,b in the model's order, not the file's
    capsys.readouterr()
    assert main(argv) == 2  # NOTE: three feature columns for a model of two: named, with --features as the fix
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "from the 3 feature columns ['b', 'noise', 'a']" in err and "--features" in err


@pytest.mark.parametrize("argv,message", [
    (["wide.csv", "--features", "a,zz"], "--features: expected distinct columns of 'wide.csv' ['a', 'b', 'price'] "
                                         "other than --target 'price', got ['a', 'zz'] (['zz'] not among them)"),
    (["wide.csv", "--features", "a,price"], "(the target among them)"),
    (["wide.csv", "--features", "a"], "got shape (3, 1) from the 1 --features columns ['a']"),
    (["data.npz", "--features", "a,b"], "--features: names columns of a .csv or Parquet DATA, got 'data.npz'"),
    (["nan_target.csv"], "line 3, column 'price' (--target): expected a number or a class label, got a missing "
                         "value"),
    (["text_target.csv"], "column 'price' (--target) holds 'n/a' in data row 2"),
    (["inf.csv"], "DATA: 'inf.csv' data row 3, column 'b': expected a finite number, got inf"),
    (["inf.csv", "--features", "b,a"], "DATA: 'inf.csv' data row 3, column 'b': expected a finite number, got inf"),
    (["huge.csv"], "DATA: 'huge.csv' data row 2, column 'a': 1e+39 is infinite as the model's float32"),
])
def test_csv_features_and_target_errors_are_one_line(files, capsys, argv, message):
    open("wide.csv", "w").write("a,b,price\n1,2,3\n4,5,6\n7,8,9\n")
    open("nan_target.csv", "w").write("a,b,price\n1,2,3\n4,5,\n7,8,9\n")  # NOTE: pandas writes NaN as nothing
    open("text_target.csv", "w").write("a,b,price\n1,2,3\n4,5,n/a\n7,8,9\n")
    open("inf.csv", "w").write("a,b,price\n1,2,3\n4,5,6\n7,inf,9\n")  # NOTE: named by its index in X before
    open("huge.csv", "w").write("a,b,price\n1,2,3\n1e39,5,6\n7,8,9\n")  # NOTE: finite as read: a traceback before
    assert main(["fit", "model.onnx", argv[0], "--target", "price", "-o", "t.onnx", *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err


def test_fit_options_are_the_trainers_names_and_values(files, monkeypatch):
    """Each Trainer parameter is the option --name (dashes for underscores); the short names stay as aliases."""
    import functools
    import warnings

    seen, init = [], onnxopt.Trainer.__init__

    @functools.wraps(init)
    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen.append({k: v for k, v in self.get_params().items() if k not in ("model", "verbose")})

    monkeypatch.setattr(onnxopt.Trainer, "__init__", recording)
    base = ["fit", "model.onnx", "data.npz", "--quiet"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # NOTE: the CLI passes no deprecated value
        assert main([*base, "--max-iter", "2", "--random-state", "3", "--learning-rate", "0.02", "--n-iter-no-change",
                     "4", "--tol", "none", "--scale", "never", "--checkpoint-dir", "ck", "-o", "a.onnx"]) == 0
        assert main([*base, "--epochs", "2", "--seed", "3", "--lr", "0.02", "--n-iter-no-change", "4", "--tol", "none",
                     "--scale", "never", "--checkpoint", "ck2", "-o", "b.onnx"]) == 0
    long, short = seen
    assert {k: long[k] for k in ("max_iter", "random_state", "n_iter_no_change", "tol", "scale")} == \
        {"max_iter": 2, "random_state": 3, "n_iter_no_change": 4, "tol": None, "scale": "never"}
    assert long["checkpoint_dir"] == "ck" and short.pop("checkpoint_dir") == "ck2"
    long.pop("checkpoint_dir")
    assert repr(long) == repr(short)
