"""Data-parallel training (onnxopt.distributed): the split step equals the fused one; 2 gloo ranks equal 1 process."""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime
import pytest

import onnxopt
from onnxopt import distributed, dsl
from onnxopt.cli import main
from onnxopt.examples import mlp

HERE = os.path.dirname(__file__)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "ONNXOPT_TIMEOUT": "6"}
CONFIGS = {
    "sgd": dict(update="sgd", learning_rate=0.05),
    "nesterov": dict(update=dsl.updates.nesterov(momentum=0.9), penalty="l2", learning_rate=dsl.schedules.invscaling(eta0=0.05)),
    "adam": dict(update=dsl.updates.adam(clip_norm=1.0), penalty=dsl.penalties.elastic(l1=0.01, l2=0.01),
                 learning_rate=dsl.schedules.cosine(eta0=0.01, total=30, warmup=3)),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("weighted", [False, True])
def test_split_step_trains_like_the_fused_step(name, weighted):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(96, 5)).astype(np.float32)
    y, sw = (X.sum(1) + 0.5).astype(np.float32), rng.uniform(0.5, 2, 96).astype(np.float32)
    model, cfg = mlp([5, 8, 1]), CONFIGS[name]
    ref = onnxopt.Runner(onnxopt.compile_train_step(model, **cfg))
    dp = distributed.DataParallelRunner(*distributed.split_step(model, loss="square", **cfg))
    assert dp._update, "the update reads each weight's gradient where it lies (no Split of the flat buffer)"
    for i in range(0, 96, 16):
        w = sw[i:i + 16] if weighted else None
        assert dp.step(X[i:i + 16], y[i:i + 16], w) == pytest.approx(ref.step(X[i:i + 16], y[i:i + 16], w), rel=1e-5)
    for k, v in ref.get_weights().items():
        np.testing.assert_allclose(dp.get_weights()[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    assert dp.step_count == ref.step_count == 6
    exported = {t.name for t in dp.export().graph.initializer}
    assert set(ref.get_weights()) <= exported


def _weights(path) -> dict:
    import onnx_ir as ir

    return {t.name: ir.serde.deserialize_tensor(t).numpy() for t in onnx.load(path).graph.initializer}


def _cli(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "onnxopt", "fit", *args], capture_output=True, text=True,
                         timeout=timeout, env=ENV)
    assert out.returncode == 0, out.stdout[-1000:] + out.stderr[-3000:]
    return out


@pytest.mark.parametrize("update", ["adam"])  # NOTE: SGD: test_cli_workers_on_fewer_rows_than_ranks_times_batch
def test_cli_two_workers_give_the_weights_of_one(update, tmp_path):
    """`onnxopt fit model.onnx data.parquet --target y --workers 2` and 1 worker, shuffled, from Parquet; with
    Adam the 2-rank run stops after 2 epochs and resumes from its checkpoint for the third."""
    pytest.importorskip("torch.distributed")
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rng = np.random.default_rng(1)
    X = rng.normal(size=(600, 6)).astype(np.float32)
    table = pa.table({**{f"f{i}": X[:, i] for i in range(6)}, "y": np.tanh(X @ rng.normal(size=6)).astype(np.float32)})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=100)
    onnx.save(mlp([6, 16, 1]), tmp_path / "m.onnx")
    common = [str(tmp_path / "m.onnx"), str(tmp_path / "d.parquet"), "--target", "y", "--batch-size", "40",
              "--tol", "none", "--quiet", "--update", update, "--lr", "0.01" if update == "adam" else "0.05",
              "--validation-fraction", "0"]  # NOTE: 6 row groups: too few to hold out whole chunks
    if update == "adam":
        common += ["--penalty", "l2:alpha=0.001"]
    assert main(["fit", *common, "--epochs", "3", "-o", str(tmp_path / "one.onnx")]) == 0
    if update == "adam":
        _cli([*common, "--epochs", "2", "--workers", "2", "--checkpoint", str(tmp_path / "ck"), "-o",
              str(tmp_path / "two.onnx")])
        assert "resuming" in _cli([*common, "--epochs", "3", "--workers", "2", "--checkpoint", str(tmp_path / "ck"),
                                   "-o", str(tmp_path / "two.onnx")]).stdout
    else:
        assert "trained 3 epochs on 600 samples" in _cli([*common, "--epochs", "3", "--workers", "2", "-o",
                                                          str(tmp_path / "two.onnx")]).stdout
    one, two = _weights(tmp_path / "one.onnx"), _weights(tmp_path / "two.onnx")
    assert one.keys() == two.keys()
    for k in one:
        np.testing.assert_allclose(two[k], one[k], rtol=1e-4, atol=1e-5, err_msg=k)
    assert not any(np.array_equal(one[k], _weights(tmp_path / "m.onnx")[k]) for k in one if one[k].size > 1)


def test_cli_workers_on_fewer_rows_than_ranks_times_batch(tmp_path):
    """SGD on 5 rows, batch 4, 2 ranks: the last batch's row goes to rank 1 and rank 0 adds zeros; the weights of
    one worker, and rank 0 alone prints."""
    pytest.importorskip("torch.distributed")
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    X = np.random.default_rng(2).normal(size=(5, 3)).astype(np.float32)
    pq.write_table(pa.table({"a": X[:, 0], "b": X[:, 1], "c": X[:, 2], "y": X.sum(1)}), tmp_path / "d.parquet")
    onnx.save(mlp([3, 4, 1]), tmp_path / "m.onnx")
    common = [str(tmp_path / "m.onnx"), str(tmp_path / "d.parquet"), "--target", "y", "--epochs", "2",
              "--validation-fraction", "0", "--lr", "0.1", "--batch-size", "4", "--update", "sgd"]
    assert main(["fit", *common, "--quiet", "-o", str(tmp_path / "one.onnx")]) == 0
    out = _cli([*common, "--workers", "2", "-o", str(tmp_path / "two.onnx")])
    assert out.stdout.count("trained 2 epochs on 5 samples") == 1 and out.stdout.count("mean loss") == 1, out.stdout
    assert "Traceback" not in out.stderr and "Warning" not in out.stderr, out.stderr[-2000:]
    one, two = _weights(tmp_path / "one.onnx"), _weights(tmp_path / "two.onnx")
    for k in one:
        np.testing.assert_allclose(two[k], one[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_cli_workers_without_torch_is_one_line(tmp_path, monkeypatch, capsys):
    """`--workers 2` where torch is not installed: one line naming torch and the install command, exit 2, no
    launch (the launcher only looks torch up: the agent and the ranks import it)."""
    import importlib.util

    X = np.random.default_rng(3).normal(size=(8, 3)).astype(np.float32)
    np.savez(tmp_path / "d.npz", X=X, y=X.sum(1))
    onnx.save(mlp([3, 4, 1]), tmp_path / "m.onnx")
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else find(name, *a))
    monkeypatch.setattr(subprocess, "call", lambda *a, **k: pytest.fail("launched ranks without torch"))
    code = main(["fit", str(tmp_path / "m.onnx"), str(tmp_path / "d.npz"), "--workers", "2", "-o",
                 str(tmp_path / "t.onnx")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "--workers: 2 ranks need torch" in err[0] and "pip install -e '.[torch]'" in err[0], err


@pytest.mark.parametrize("fault", ["kill", pytest.param("hang", marks=pytest.mark.slow), "disagree"])
def test_a_faulty_rank_stops_the_others(fault, tmp_path):
    """Rank 1 is SIGKILLed or hangs in epoch 2, or runs another learning rate: rank 0 stops with a
    DistributedError within the timeout (6 s), and the checkpoint of epoch 1 still loads."""
    pytest.importorskip("torch.distributed")
    rng = np.random.default_rng(0)
    X = rng.normal(size=(256, 8)).astype(np.float32)
    np.savez(tmp_path / "d.npz", X=X, y=X.sum(1).astype(np.float32))
    onnx.save(mlp([8, 16, 1]), tmp_path / "m.onnx")
    cfg = json.dumps(dict(data=str(tmp_path / "d.npz"), model=str(tmp_path / "m.onnx"), update="sgd", lr=0.01,
                          ckpt=str(tmp_path / "ck"), fault=fault))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "distributed_worker.py"), cfg], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**ENV, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in range(2)]
    try:
        out, err = procs[0].communicate(timeout=240)
    finally:
        for p in procs[1:]:
            p.kill()
            p.communicate()
    assert procs[0].returncode != 0
    expected = "ranks disagree on the compiled steps" if fault == "disagree" else "another rank died or hung"
    assert "DistributedError" in err and expected in err, err[-2000:]
    # NOTE: onnxopt destroys the group it made before the interpreter's teardown, where gloo's threads made
    # ranks abort at exit ("terminate called without an active exception")
    assert "group left at exit: True" in out and "terminate called" not in err, out + err[-2000:]
    if fault != "disagree":
        t0 = time.perf_counter()
        est = onnxopt.Trainer(str(tmp_path / "m.onnx"), update="sgd", learning_rate=0.01, max_iter=1,
                              checkpoint_dir=str(tmp_path / "ck"))  # NOTE: the ranks' optimizer
        est.fit(X, X.sum(1))
        assert est.n_iter_ == 1 and len(est.train_losses_) == 1 and time.perf_counter() - t0 < 60


def _launch(cfg: dict, ranks: int = 2, timeout: int = 240) -> None:
    """Runs tests/distributed_worker.py on ``ranks`` local gloo ranks with ``cfg``; fails with their stderr."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "distributed_worker.py"), json.dumps(cfg)],
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**ENV, "RANK": str(r), "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "ONNXOPT_TIMEOUT": "60"})
             for r in range(ranks)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]


def _reference(model, update, lr, X, y, sw, batch) -> tuple[dict, np.ndarray]:
    """Weights and losses of one process (the fused step) after 2 epochs of batches of ``batch`` rows."""
    ref = onnxopt.Runner(onnxopt.compile_train_step(model, loss="square", update=update, learning_rate=lr),
                         batch_size=batch)
    losses = [ref.step(X[i:i + batch], y[i:i + batch], None if sw is None else sw[i:i + batch])
              for _ in range(2) for i in range(0, len(X), batch)]
    return ref.get_weights(), np.array(losses)


@pytest.mark.parametrize("weighted", [False, True])
def test_sync_every_k_gives_one_process_with_k_times_the_batch(weighted):
    """Float64, Adam, 100 rows: 3 micro-batches of 8 accumulated per update equal one process with batch 24 (the
    last update of an epoch on 4 rows), to float64 rounding; the losses are those of the 24-row batches."""
    rng = np.random.default_rng(4)
    X, sw = rng.normal(size=(100, 5)), rng.uniform(0.2, 2, 100) if weighted else None
    y, model = np.tanh(X @ rng.normal(size=5)), mlp([5, 8, 1], dtype=np.float64)
    want, want_losses = _reference(model, "adam", 0.01, X, y, sw, 24)
    dp = distributed.DataParallelRunner(*distributed.split_step(model, loss="square", update="adam",
                                                                learning_rate=0.01), batch_size=24, sync_every=3)
    losses = np.concatenate([dp.epoch(X, y, sw) for _ in range(2)])
    np.testing.assert_allclose(losses, want_losses, rtol=1e-12)
    assert dp.step_count == len(want_losses) == 10
    for k, v in want.items():
        np.testing.assert_allclose(dp.get_weights()[k], v, rtol=1e-10, atol=1e-13, err_msg=k)


def test_trainer_sync_every_trains_like_k_times_the_batch():
    """Trainer(batch_size=8, sync_every=3) gives the weights of Trainer(batch_size=24), shuffled, float64."""
    rng = np.random.default_rng(5)
    X = rng.normal(size=(90, 4))
    y = X @ rng.normal(size=4)
    kw = dict(update="sgd", learning_rate=0.05, max_iter=3, tol=None, scale="never")
    one = onnxopt.Trainer(mlp([4, 6, 1], dtype=np.float64), batch_size=24, **kw).fit(X, y)
    acc = onnxopt.Trainer(mlp([4, 6, 1], dtype=np.float64), batch_size=8, sync_every=3, **kw).fit(X, y)
    assert acc.runner_.step_count == one.runner_.step_count == 12
    np.testing.assert_allclose(acc.train_losses_, one.train_losses_, rtol=1e-12)
    for k, v in one.runner_.get_weights().items():
        np.testing.assert_allclose(acc.runner_.get_weights()[k], v, rtol=1e-10, atol=1e-13, err_msg=k)


@pytest.mark.parametrize("name,value", [("sync_every", 0), ("compress", "int8"), ("transport", "nccl"),
                                        ("buckets", 0), ("device", "tpu")])
def test_data_parallel_options_are_checked(name, value):
    steps = distributed.split_step(mlp([3, 4, 1]), loss="square", update="sgd")
    with pytest.raises(onnxopt.errors.DataError, match=f"{name}: expected .*got {value!r}"):
        distributed.DataParallelRunner(*steps, **{name: value})


CUDA = "CUDAExecutionProvider" in onnxruntime.get_available_providers()


@pytest.mark.skipif(CUDA, reason="the CUDA provider is installed")
def test_data_parallel_on_cuda_without_the_provider_is_one_clear_error():
    steps = distributed.split_step(mlp([3, 4, 1]), loss="square", update="sgd")
    with pytest.raises(ImportError, match="device: 'cuda' needs onnxruntime-gpu's CUDAExecutionProvider"):
        distributed.DataParallelRunner(*steps, device="cuda")


def _saved_data(tmp_path, seed: int):
    """97 rows of 5 float64 features, targets and sample weights (d.npz) and a float64 MLP (m.onnx) in tmp_path."""
    rng = np.random.default_rng(seed)
    X, sw = rng.normal(size=(97, 5)), rng.uniform(0.2, 2, 97)
    y = np.tanh(X @ rng.normal(size=5))
    np.savez(tmp_path / "d.npz", X=X, y=y, sw=sw)
    onnx.save(mlp([5, 16, 16, 1], dtype=np.float64), tmp_path / "m.onnx")
    return X, y, sw


@pytest.mark.skipif(not CUDA, reason="needs onnxruntime-gpu's CUDAExecutionProvider and a GPU")
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_two_ranks_on_cuda_give_one_process_with_the_global_batch(transport, tmp_path):
    """2 ranks, each with its steps on the one GPU, gradients staged through host memory and all-reduced by shm or
    gloo (buckets: the split step's pieces pass values on the device): float64, Adam, the weights of one CPU
    process with batch 24 to float64 rounding (the GPU's sums run in another order)."""
    pytest.importorskip("torch.distributed")
    X, y, sw = _saved_data(tmp_path, 6)
    runs = {"cuda": dict(batch=24, transport=transport, device="cuda", weighted=True,
                         buckets=2 if transport == "gloo" else 1)}
    _launch(dict(data=str(tmp_path / "d.npz"), model=str(tmp_path / "m.onnx"), update="adam", lr=0.01,
                 out=str(tmp_path), runs=runs))
    got = dict(np.load(tmp_path / "cuda.npz"))
    assert str(got.pop("transport")) == transport and int(got.pop("pieces")) == (2 if transport == "gloo" else 0)
    want, losses = _reference(mlp([5, 16, 16, 1], dtype=np.float64), "adam", 0.01, X, y, sw, 24)
    np.testing.assert_allclose(got.pop("losses"), losses, rtol=1e-9)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-8, atol=1e-11, err_msg=k)


RUNS = {  # NOTE: one launch of 2 ranks runs them all; batch = rows per update; buckets > 1: a split step
    "shm": dict(batch=24), "shm_k3": dict(batch=24, sync_every=3, weighted=True),
    "gloo_buckets": dict(batch=24, transport="gloo", buckets=3, sync_every=2),
    "gloo": dict(batch=24, transport="gloo", weighted=True),
    "gloo_pieces": dict(batch=24, transport="gloo", buckets=2, weighted=True),
    "gloo_pieces3": dict(batch=24, transport="gloo", buckets=3),
    "bf16": dict(batch=24, compress="bf16", buckets=2), "fp16": dict(batch=24, compress="fp16")}


def test_two_ranks_give_one_process_with_the_global_batch(tmp_path):
    """2 gloo ranks, float64 (float32 for the compressed runs), Adam, 2 epochs of 97 rows (the last batch's row on
    rank 1 alone): the shared-memory and the gloo all-reduce (in 3 asynchronous buckets, or started piece by piece
    of a gradient step split in 2 or 3), with and without sample weights and accumulation over micro-batches, give
    the weights of one process with batch 24, to float64 rounding; bf16 and fp16 compression come close to them
    (relative to how far training moved the weights), not equal."""
    pytest.importorskip("torch.distributed")
    X, y, sw = _saved_data(tmp_path, 6)
    np.savez(tmp_path / "d32.npz", X=X.astype(np.float32), y=y.astype(np.float32), sw=sw.astype(np.float32))
    onnx.save(mlp([5, 16, 16, 1]), tmp_path / "m32.onnx")
    exact = {k: v for k, v in RUNS.items() if "compress" not in v}
    compressed = {k: v for k, v in RUNS.items() if "compress" in v}
    for runs, suffix in ((exact, ""), (compressed, "32")):
        _launch(dict(data=str(tmp_path / f"d{suffix}.npz"), model=str(tmp_path / f"m{suffix}.onnx"), update="adam",
                     lr=0.01, out=str(tmp_path), runs=runs))
    for name, run in RUNS.items():
        got = dict(np.load(tmp_path / f"{name}.npz"))
        assert str(got.pop("transport")) == ("gloo" if "compress" in run else run.get("transport", "shm")), name
        split = (run.get("transport") == "gloo" or "compress" in run) and run.get("sync_every", 1) == 1
        assert int(got.pop("pieces")) == (run.get("buckets", 1) if split and run.get("buckets", 1) > 1 else 0), name
        float32 = "compress" in run
        model = mlp([5, 16, 16, 1], dtype=np.float32 if float32 else np.float64)
        cast = (lambda a: a.astype(np.float32)) if float32 else (lambda a: a)  # noqa: E731
        want, losses = _reference(model, "adam", 0.01, cast(X), cast(y), cast(sw) if run.get("weighted") else None, 24)
        start = {t.name: ir.serde.deserialize_tensor(t).numpy() for t in model.graph.initializer}
        if not float32:
            np.testing.assert_allclose(got.pop("losses"), losses, rtol=1e-12, err_msg=name)
            for k, v in want.items():
                np.testing.assert_allclose(got[k], v, rtol=1e-10, atol=1e-13, err_msg=f"{name}: {k}")
            continue
        np.testing.assert_allclose(got.pop("losses"), losses, rtol=2e-2, err_msg=name)
        moved = max(np.abs(v - start[k]).max() for k, v in want.items())
        off = max(np.abs(got[k] - v).max() for k, v in want.items())
        assert 0 < off < 0.05 * moved, (name, off, moved)


SGD = "dict(update='sgd', learning_rate=0.05)"
AVERAGED = {  # NOTE: runs given the fused step too: mode "weights" where the update is affine in the gradient
    "w_sgd": dict(batch=24, options=SGD), "w_sgd_weighted": dict(batch=24, options=SGD, weighted=True),
    "w_nesterov": dict(batch=24, weighted=True, options="dict(update=dsl.updates.nesterov(momentum=0.9), "
                       "penalty='l2', learning_rate=dsl.schedules.invscaling(eta0=0.05))"),
    "w_momentum": dict(batch=24, options="dict(update=dsl.updates.momentum(0.9), learning_rate=0.02)"),
    "g_adam": dict(batch=24, weighted=True, options="dict(update='adam', learning_rate=0.01)"),
    "g_clip": dict(batch=24, options="dict(update=dsl.updates.sgd(clip_norm=1.0), learning_rate=0.05)"),
    "w_nan0": dict(batch=24, options=SGD, nan_rank=0), "w_nan1": dict(batch=24, options=SGD, nan_rank=1)}


def test_two_ranks_averaging_weights_give_one_process_with_the_global_batch(tmp_path):
    """2 shm ranks given the fused step, float64, 2 epochs of 97 rows (the last batch's row on rank 1: rank 0 steps
    with share 0): SGD, momentum, Nesterov with an L2 penalty and a schedule average their weights and state (mode
    "weights"), Adam and clipped SGD all-reduce gradients; all give the weights and losses of one process with
    batch 24. A NaN loss on either rank raises ConvergenceError on both, which keep the weights before the step
    and go on alike."""
    pytest.importorskip("torch.distributed")
    X, y, sw = _saved_data(tmp_path, 7)
    _launch(dict(data=str(tmp_path / "d.npz"), model=str(tmp_path / "m.onnx"), update="sgd", lr=0.01,
                 out=str(tmp_path), runs=AVERAGED))
    for name, run in AVERAGED.items():
        nan = "nan_rank" in run
        got = dict(np.load(tmp_path / (f"{name}0.npz" if nan else f"{name}.npz")))
        assert str(got.pop("reduces")) == ("weights" if name.startswith("w_") else "gradients"), name
        assert str(got.pop("transport")) == "shm" and int(got.pop("pieces")) == 0, name
        ref = onnxopt.Runner(onnxopt.compile_train_step(mlp([5, 16, 16, 1], dtype=np.float64), loss="square",
                                                        **eval(run["options"], {"dsl": dsl})), batch_size=24)
        w = sw if run.get("weighted") else None
        losses = [ref.step(X[i:i + 24], y[i:i + 24], None if w is None else w[i:i + 24])
                  for _ in range(2) for i in range(0, 97, 24)]
        np.testing.assert_allclose(got.pop("losses"), losses, rtol=1e-12, err_msg=name)
        if nan:
            ref.step(X[:24], y[:24])
            other = dict(np.load(tmp_path / f"{name}1.npz"))
            for rank_got in (got, other):
                assert rank_got.pop("raised") and rank_got.pop("kept"), name
            for k in ref.get_weights():
                np.testing.assert_array_equal(got[k], other[k], err_msg=f"{name}: {k}")
        for k, v in ref.get_weights().items():
            np.testing.assert_allclose(got[k], v, rtol=1e-10, atol=1e-13, err_msg=f"{name}: {k}")


@pytest.mark.parametrize("update,expected", [("sgd", True), (dsl.updates.momentum(0.9), True),
                                             (dsl.updates.nesterov(0.9), True), ("adam", False),
                                             (dsl.updates.sgd(clip_norm=1.0), False), (dsl.updates.rmsprop(), False),
                                             (dsl.updates.sgd(clip_norm=1e12), False)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_affine_tells_the_updates_that_weight_averaging_keeps_exact(update, expected, dtype):
    """``affine``: updates linear in the gradient given weights and state (with a schedule and an L2 penalty) are;
    Adam, RMSprop and a clipped SGD are not, even clipped at a norm no training reaches (1e12)."""
    _, upd = distributed.split_step(mlp([5, 8, 1], dtype=dtype), loss="square", update=update, penalty="l2",
                                    learning_rate=dsl.schedules.invscaling(eta0=0.05))
    assert distributed.affine(upd) is expected
