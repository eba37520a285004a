"""Fault injection (issue 27): writes cut by a full disk or kill -9, hostile model files, threads, class labels.

Each test makes its own fault: a file-size limit (RLIMIT_FSIZE) or a tiny tmpfs for a full disk, a child
process killed with SIGKILL in the middle of a write, model files pointing outside their folder or declaring
more bytes than they hold, one Runner shared by threads, class indices out of range.
"""

import contextlib
import fcntl
import glob
import io
import os
import re
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

import onnxopt
from onnxopt import checkpoint
from onnxopt.cli import _plot, main
from onnxopt.draw import render
from onnxopt.errors import CheckpointError, DataError, ModelFormatError, ModelVersionError
from onnxopt.examples import mlp
from onnxopt.modelio import load_model

X = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
Y = X.sum(axis=1)
OLD = b"the previous content, kept when a write fails\n"


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Writes that grow a file past ``nbytes`` fail with EFBIG, as on a full disk (SIGXFSZ ignored)."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def _temps(folder) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, ".*.tmp")))


@pytest.fixture(scope="module")
def step():
    return onnxopt.compile_train_step(mlp([4, 8, 1]), loss="square", update="adam")


@pytest.fixture
def files(tmp_path, monkeypatch):
    """A model and a CSV in the working directory."""
    monkeypatch.chdir(tmp_path)
    onnx.save(mlp([4, 8, 1]), "model.onnx")
    table = np.column_stack([X, Y])
    np.savetxt("data.csv", table, delimiter=",", header="a,b,c,d,y", comments="")
    return tmp_path


WRITERS = {  # NOTE: each writes ``out`` (a file that exists, holding OLD) in the working directory
    "TrainStep.save": lambda step, out: step.save(out),
    "checkpoint": lambda step, out: onnxopt.Runner(step).save_checkpoint(out),
    "compile -o": lambda step, out: main(["compile", "model.onnx", "-o", out]),
    "fit -o": lambda step, out: main(["fit", "model.onnx", "data.csv", "--target", "y", "--epochs", "1", "--quiet",
                                      "--batch-size", "8", "-o", out]),
    "show -o": lambda step, out: render(step.model, out),
    "bench page": lambda step, out: __import__("onnxopt.bench.report").bench.report.write_markdown(out, "x" * 100),
    "picture": lambda step, out: _plot({"loss": [3.0, 2.0, 1.0]}, out, "demo"),
}
SUFFIX = {"checkpoint": ".ckpt", "show -o": ".dot", "bench page": ".md", "picture": ".png"}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_failed_write_keeps_the_old_file_and_leaves_no_temp_file(files, step, writer, capsys):
    out = "out" + SUFFIX.get(writer, ".onnx")
    (files / out).write_bytes(OLD)
    with warnings.catch_warnings(), file_size_limit(len(OLD) + 16):  # NOTE: every new file is larger
        warnings.simplefilter("ignore")
        try:
            code = WRITERS[writer](step, out)
        except OSError as exc:
            code = exc.errno
    assert code not in (None, 0), "the write should have failed"
    assert (files / out).read_bytes() == OLD, f"{writer} replaced {out} with a torn file"
    assert _temps(files) == []
    WRITERS[writer](step, out)  # NOTE: the same write with room succeeds and leaves no temp file either
    assert (files / out).read_bytes() != OLD and _temps(files) == []


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 KiB tmpfs (needs root; skipped elsewhere, the RLIMIT_FSIZE tests above cover the same code)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_full_disk_keeps_the_previous_step_and_checkpoint(tiny_disk, step):
    step.save(tiny_disk / "step.onnx")
    onnxopt.Runner(step).save_checkpoint(tiny_disk / "c.ckpt")
    before = {n: (tiny_disk / n).read_bytes() for n in ("step.onnx", "c.ckpt")}
    bigger = onnxopt.compile_train_step(mlp([4, 256, 64, 1]), loss="square", update="adam")  # NOTE: ~70 KB
    fd = os.open(tiny_disk / "filler", os.O_WRONLY | os.O_CREAT)
    with pytest.raises(OSError, match="No space left"):  # NOTE: fill the disk
        while True:
            os.write(fd, b"\0" * 4096)
    os.close(fd)
    os.truncate(tiny_disk / "filler", os.path.getsize(tiny_disk / "filler") - 16384)  # NOTE: room for a part
    for write in (lambda: bigger.save(tiny_disk / "step.onnx"),
                  lambda: onnxopt.Runner(bigger).save_checkpoint(tiny_disk / "c.ckpt")):
        with pytest.raises(OSError, match="No space left"):
            write()
    assert {n: (tiny_disk / n).read_bytes() for n in before} == before
    assert sorted(os.listdir(tiny_disk)) == ["c.ckpt", "filler", "step.onnx"]
    onnxopt.TrainStep.load(tiny_disk / "step.onnx")
    checkpoint.load_arrays(tiny_disk / "c.ckpt")
    os.remove(tiny_disk / "filler")
    bigger.save(tiny_disk / "step.onnx")
    assert onnxopt.TrainStep.load(tiny_disk / "step.onnx").weights == bigger.weights


KILLED = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from onnxopt import checkpoint

    def stalled(fd):  # NOTE: the disk stalls after the data is written: the parent kills us here
        print("fsync", flush=True)
        time.sleep(60)

    os.fsync = stalled
    checkpoint.save_arrays(sys.argv[1], {"w": np.full(1 << 20, 7.0)}, {"new": True})
""")


def test_kill_9_during_a_write_keeps_the_old_file_and_the_next_write_cleans_up(tmp_path):
    path = tmp_path / "c.ckpt"
    checkpoint.save_arrays(path, {"w": np.zeros(3)}, {"new": False})
    before = path.read_bytes()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", KILLED, str(path)], stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout.readline() == b"fsync\n"
        assert len(_temps(tmp_path)) == 1 and os.path.getsize(tmp_path / _temps(tmp_path)[0]) > 8 << 20
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert path.read_bytes() == before  # NOTE: the killed write left its temp file, never touched the target
    assert len(_temps(tmp_path)) == 1
    checkpoint.save_arrays(path, {"w": np.ones(3)}, {"new": True})
    assert _temps(tmp_path) == []
    assert checkpoint.load_arrays(path)[1] == {"new": True}


def _killed_write(path) -> None:
    """Leaves the temporary file of a write to ``path`` killed with SIGKILL before its rename."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", KILLED, str(path)], stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout.readline() == b"fsync\n"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()


def test_resuming_removes_the_temp_files_of_killed_checkpoint_writes(files, capsys):
    """A resumed run may write nothing (nothing left to train, a refused resume): it cleans up all the same."""
    ckpt = files / "ckpt"
    fit = ["fit", "model.onnx", "data.csv", "--target", "y", "--epochs", "2", "--quiet", "--checkpoint", "ckpt",
           "-o", "out.onnx"]
    assert main(fit) == 0
    _killed_write(ckpt / "trainer.ckpt")
    (ckpt / ".notes.tmp").write_text("not onnxopt's: kept")
    assert len(_temps(ckpt)) == 2
    assert main(fit) == 2 and "already holds 2 epochs" in capsys.readouterr().err
    assert _temps(ckpt) == [".notes.tmp"]
    _killed_write(ckpt / "trainer.ckpt")
    est = onnxopt.Trainer(mlp([4, 8, 1]), max_iter=2, checkpoint_dir=str(ckpt))
    est.fit(X, Y)
    assert est.n_iter_ == 2 and _temps(ckpt) == [".notes.tmp"]


def test_temp_file_of_a_live_writer_is_kept(tmp_path):
    path = tmp_path / "c.ckpt"
    (tmp_path / ".c.ckpt.dead.tmp").write_bytes(b"left by a killed write")
    live = tmp_path / ".c.ckpt.live.tmp"
    with open(live, "wb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # NOTE: as a writer in another process holds it
        checkpoint.save_arrays(path, {"w": np.ones(3)}, {})
        assert _temps(tmp_path) == [".c.ckpt.live.tmp"]


def test_cli_checks_its_outputs_before_training(files, capsys):
    (files / "a_file").write_text("not a folder")
    fit = ["fit", "model.onnx", "data.csv", "--target", "y", "--epochs", "2"]
    for argv, named in [([*fit, "-o", "a_file/trained.onnx"], "a_file"),
                        ([*fit, "--checkpoint", "a_file", "-o", "trained.onnx"], "a_file"),
                        (["compile", "model.onnx", "-o", "a_file/step.onnx"], "a_file"),
                        ([*fit, "-o", "no_folder/trained.onnx"], "no_folder' does not exist"),
                        (["demo", "--out", "a_file", "--epochs", "1"], "a_file")]:
        t0 = time.perf_counter()
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert named in err and "expected" in err and out == "", (argv, out, err)
        assert time.perf_counter() - t0 < 5, "the CLI trained or compiled before checking its outputs"
    assert sorted(os.listdir(files)) == ["a_file", "data.csv", "model.onnx"]


def test_trainer_refuses_a_checkpoint_dir_that_is_a_file(tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("a file")
    with pytest.raises(CheckpointError, match=rf"checkpoint_dir: expected a folder .*{re.escape(str(path))}.*an "
                                              r"existing file"):
        onnxopt.Trainer(mlp([4, 8, 1]), checkpoint_dir=str(path))
    with pytest.raises(CheckpointError, match=r"checkpoint_dir: .*'.*ckpt/sub' \(.*ckpt' is a file\)"):
        onnxopt.Trainer(mlp([4, 8, 1]), checkpoint_dir=str(path / "sub"))


# -- hostile model files ---------------------------------------------------------------------------------------
def _external(tmp_path):
    folder, outside = tmp_path / "model", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    onnx.save_model(mlp([4, 8, 1]), folder / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.data", size_threshold=0)
    (outside / "secret.bin").write_bytes((folder / "m.data").read_bytes())  # NOTE: loads fine if read
    return folder, outside


def _relocated(folder, location: str) -> str:
    proto = onnx.load(folder / "m.onnx", load_external_data=False)
    for t in proto.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    onnx.save(proto, folder / "bad.onnx")
    return str(folder / "bad.onnx")


@pytest.mark.parametrize("kind", ["symlink", "dotdot", "absolute"])
def test_external_data_outside_the_models_folder_is_refused(tmp_path, kind):
    folder, outside = _external(tmp_path)
    location = {"symlink": "link.bin", "dotdot": "../outside/secret.bin", "absolute": str(outside / "secret.bin")}
    os.symlink(outside / "secret.bin", folder / "link.bin")
    with pytest.raises(ModelFormatError, match=rf"tensor 'coef_0' keeps its data in external file "
                                               rf"'{re.escape(location[kind])}', which is outside the model's folder"):
        onnxopt.compile_train_step(_relocated(folder, location[kind]))


def test_proto_with_external_data_needs_its_folder(tmp_path, monkeypatch):
    folder, _ = _external(tmp_path)
    proto = onnx.load(folder / "m.onnx", load_external_data=False)
    monkeypatch.chdir(folder)  # NOTE: it used to be read from the working directory
    with pytest.raises(ModelFormatError, match=r"'coef_0' keeps its data in external file 'm.data', and the "
                                               r"model was given without its folder"):
        onnxopt.compile_train_step(proto)
    monkeypatch.chdir(tmp_path)
    bad = onnx.load(_relocated(folder, "../outside/secret.bin"), load_external_data=False)
    with pytest.raises(ModelFormatError, match="outside the model's folder"):
        load_model(bad, base_dir=folder)
    loaded = load_model(proto, base_dir=folder)
    np.testing.assert_array_equal(loaded.graph.initializers["coef_0"].const_value.numpy(),
                                  numpy_helper.to_array(mlp([4, 8, 1]).graph.initializer[0]))


def _with_initializer(tensor: TensorProto) -> onnx.ModelProto:
    model = mlp([4, 8, 1])
    model.graph.initializer.append(tensor)
    return model


def test_declared_sizes_are_checked_before_anything_is_allocated(tmp_path):
    huge = TensorProto(name="huge", data_type=TensorProto.FLOAT, dims=[10**6, 10**6])  # NOTE: 3.6 TiB, no data
    short = TensorProto(name="short", data_type=TensorProto.FLOAT, dims=[4, 4], raw_data=b"\0" * 60)
    few = TensorProto(name="few", data_type=TensorProto.INT64, dims=[3], int64_data=[1, 2])
    for tensor, match in [(huge, r"tensor 'huge' declares shape \[1000000, 1000000\] of FLOAT \(4000000000000 "
                                 r"bytes\); expected at most"),
                          (short, r"tensor 'short' declares shape \[4, 4\] of FLOAT \(64 bytes\) but holds 60 bytes; "
                                  r"expected 64"),
                          (few, r"tensor 'few' .* holds 2 values in int64_data; expected 3")]:
        with pytest.raises(ModelFormatError, match=match):
            onnxopt.compile_train_step(_with_initializer(tensor))
    onnx.save_model(mlp([4, 8, 1]), tmp_path / "m.onnx", save_as_external_data=True, location="m.data",
                    size_threshold=0, all_tensors_to_one_file=True)
    with open(tmp_path / "m.data", "r+b") as f:
        f.truncate(100)  # NOTE: coef_0 (128 bytes at offset 0) no longer fits
    with pytest.raises(ModelFormatError, match=r"tensor 'coef_0' .* \(128 bytes\) but its external data is 128 bytes "
                                               r"at offset 0 of 'm.data' \(100 bytes\)"):
        load_model(tmp_path / "m.onnx")


def test_duplicate_names_unknown_opsets_and_domains_are_refused_by_name():
    model = mlp([4, 8, 1])
    model.graph.node.append(oh.make_node("Relu", [model.graph.node[0].input[0]], [model.graph.node[0].output[0]],
                                         name="again"))
    with pytest.raises(ModelFormatError, match=rf"value '{model.graph.node[0].output[0]}' is defined twice .* and "
                                               r"by node 'again' \(Relu\)"):
        onnxopt.compile_train_step(model)
    model = mlp([4, 8, 1])
    model.opset_import[0].version = 99
    with pytest.raises(ModelVersionError, match=r"opset 99 of domain '' is unknown .*versions 1\.\.\d+"):
        onnxopt.compile_train_step(model)
    model = mlp([4, 8, 1])
    model.opset_import.append(oh.make_opsetid("my.domain", 1))
    with pytest.raises(ModelVersionError, match=r"unknown domain 'my.domain'"):
        onnxopt.compile_train_step(model)
    model = mlp([4, 8, 1])
    last = model.graph.node[-1]
    last.domain = "com.microsoft"
    with pytest.raises(ModelVersionError, match=rf"node '{last.name}' \({last.op_type}\) is in domain 'com.microsoft', "
                                                r"which the model does not import"):
        onnxopt.compile_train_step(model)


def _cyclic() -> onnx.ModelProto:
    """mlp([4, 8, 1]) whose second node reads a value computed from the graph's output: a cycle of 5 nodes."""
    model = mlp([4, 8, 1])
    first, last = model.graph.node[0], model.graph.node[-1]
    model.graph.node.append(oh.make_node("Add", [last.output[0], first.output[0]], ["back"], name="loop_add"))
    model.graph.node[1].input[0] = "back"
    return model


def _twice(kind: str) -> onnx.ModelProto:
    """mlp([4, 8, 1]) declaring its first graph input or output a second time, with another shape."""
    model = mlp([4, 8, 1])
    values = getattr(model.graph, kind)
    values.append(values[0])
    values[-1].type.tensor_type.shape.dim[1].dim_value = 3
    return model


def test_cycles_and_twice_declared_inputs_and_outputs_are_refused_by_name(files, capsys):
    cases = [(_cyclic(), r"graph 'mlp' has a cycle: node '[^']+' \(\w+\) depends on its own output through 5 node\(s\) "
                         r"\(.*node 'loop_add' \(Add\)"),
             (_twice("output"), r"graph 'mlp' declares output 'Y' 2 times; expected each output name once"),
             (_twice("input"), r"graph 'mlp' declares input 'X' 2 times; expected each input name once")]
    for model, match in cases:
        with pytest.raises(ModelFormatError, match=match):
            onnxopt.compile_train_step(model)
        onnx.save(model, "hostile.onnx")
        assert main(["fit", "hostile.onnx", "data.csv", "--target", "y", "--epochs", "1", "--quiet",
                     "-o", "out.onnx"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and re.search(match, err), err


# -- threads ---------------------------------------------------------------------------------------------------
def test_runner_shared_by_threads_loses_no_step(step):
    shared, alone = onnxopt.Runner(step), onnxopt.Runner(step)
    errors = []

    def work():
        try:
            for _ in range(150):
                shared.step(X, Y)
                shared.get_weights()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _ in range(600):
        alone.step(X, Y)
    assert errors == [] and shared.step_count == 600
    for name, value in alone.get_weights().items():  # NOTE: same batch every step: order does not matter
        np.testing.assert_array_equal(shared.get_weights()[name], value)


# -- class labels ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def classifier():
    return onnxopt.compile_train_step(mlp([4, 8, 3]), loss="cross_entropy")


@pytest.mark.parametrize(("labels", "match"), [
    ([0, 1, 2, 2, -1, 0], r"expected class indices in 0\.\.2 \(the prediction has 3 classes\), got -1 at row 4"),
    ([0, 1, -3, 2, 1, 0], r"got -3 at row 2"),
    ([0, 1, 2, 3, 1, 0], r"expected class indices in 0\.\.2 .*got 3 at row 3"),
    ([0.0, 1.0, 0.5, 2.0, 1.0, 0.0], r"expected integer class indices, got 0.5 at row 2 \(continuous target\? use "
                                     r"loss='square'\)"),
])
def test_class_indices_are_checked_before_a_step(classifier, labels, match):
    runner = onnxopt.Runner(classifier)
    before = runner.get_weights()
    for run in (lambda: runner.step(X[:6], np.array(labels)), lambda: runner.epoch(X[:6], np.array(labels), None, 2)):
        with pytest.raises(DataError, match=match):
            run()
    assert runner.step_count == 0
    for name, value in before.items():
        np.testing.assert_array_equal(runner.get_weights()[name], value)


# -- exports ---------------------------------------------------------------------------------------------------
def check_export(model: onnx.ModelProto) -> ort.InferenceSession:
    """The exported model passes onnx's full checker and loads in onnxruntime."""
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_torchscript_batchnorm_mlp_exports_a_valid_model(mode):
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)).eval()  # NOTE: fresh BN
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.zeros(2, 4),), buf, dynamo=False, input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    model = onnx.load_from_string(buf.getvalue())
    assert [n.op_type for n in model.graph.node][:2] == ["Identity", "Identity"]  # running stats = Identity(w, b)
    runner = onnxopt.Runner(onnxopt.compile_train_step(model, mode=mode, learning_rate=0.1))
    for _ in range(3):
        runner.step(X, Y)
    exported = runner.export()
    names = [t.name for t in exported.graph.initializer] + [o for n in exported.graph.node for o in n.output]
    assert len(names) == len(set(names))
    out = check_export(exported).run(None, {"x": X})[0]
    inits = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    weights = runner.get_weights()
    np.testing.assert_array_equal(inits["1.weight"], weights["1.weight"])
    if mode == "train":  # NOTE: the statistics moved apart from the weight they were aliased to
        assert not np.array_equal(inits["1.running_var"], inits["1.weight"])
    else:  # NOTE: eval: the running statistics stay as exported while the weight trains
        np.testing.assert_array_equal(inits["1.running_var"], np.ones(8, np.float32))
    with torch.no_grad():
        for k, name in [(0, "0"), (1, "1"), (3, "3")]:
            net[k].weight.copy_(torch.tensor(inits[f"{name}.weight"]))
            net[k].bias.copy_(torch.tensor(inits[f"{name}.bias"]))
        net[1].running_mean.copy_(torch.tensor(inits["1.running_mean"]))
        net[1].running_var.copy_(torch.tensor(inits["1.running_var"]))
        np.testing.assert_allclose(out, net(torch.from_numpy(X)).numpy(), rtol=1e-5, atol=1e-6)
