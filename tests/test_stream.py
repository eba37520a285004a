"""Streamed training data (onnxopt.stream): every source trains as the same arrays in memory do."""

import os
import threading

import numpy as np
import onnx
import pytest

import onnxopt
from onnxopt import stream
from onnxopt.errors import DataError
from onnxopt.examples import mlp
from helpers import run_script

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

N, D = 600, 6


@pytest.fixture(autouse=True)
def streamed(monkeypatch):
    """Every source streamed (a source of at most CACHE_BYTES is otherwise read whole and trained as arrays)."""
    monkeypatch.setattr(stream, "CACHE_BYTES", 0)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(N, D)).astype(np.float32)
    y = (X @ rng.normal(size=D) + 0.1).astype(np.float32)
    return X, y, rng.uniform(0.5, 2.0, N).astype(np.float32)


def _fit(X, y=None, sw=None, **kw):
    params = dict(batch_size=32, max_iter=2, tol=None, shuffle=False, update="nesterov")
    params.update({k: kw.pop(k) for k in list(kw) if k in params or k in ("checkpoint_dir", "early_stopping")})
    return onnxopt.Trainer(mlp([D, 8, 1], seed=1), **params).fit(X, y, sw, **kw)


def _same(a, b) -> None:
    wa, wb = a.runner_.get_weights(), b.runner_.get_weights()
    for k in wa:
        np.testing.assert_allclose(wa[k], wb[k], rtol=0, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(a.train_losses_, b.train_losses_, rtol=1e-6)


def _table(X, y, sw=None, list_column=False):
    cols = {"x": pa.array(list(X), pa.list_(pa.float32()))} if list_column else {f"f{i}": X[:, i] for i in range(D)}
    return pa.table({**cols, "y": y, **({"w": sw} if sw is not None else {})})


class _Reiterable:
    def __init__(self, X, y):
        self.X, self.y = X, y

    def __iter__(self):
        return ((self.X[i:i + 32], self.y[i:i + 32]) for i in range(0, len(self.X), 32))


@pytest.mark.parametrize("kind", ["callable", "reiterable", "memmap", "parquet", "folder", "dataset", "list_column"])
def test_stream_sources_train_like_arrays(kind, data, tmp_path):
    X, y, _ = data
    if kind == "callable":
        got = _fit(lambda: ((X[i:i + 32], y[i:i + 32]) for i in range(0, N, 32)))
    elif kind == "reiterable":
        got = _fit(_Reiterable(X, y))
    elif kind == "memmap":
        np.save(tmp_path / "X.npy", X)
        np.save(tmp_path / "y.npy", y)
        got = _fit(np.load(tmp_path / "X.npy", mmap_mode="r"), np.load(tmp_path / "y.npy", mmap_mode="r"))
    elif kind == "folder":  # NOTE: two files of several row groups each, read in name order
        os.makedirs(tmp_path / "d")
        pq.write_table(_table(X[:250], y[:250]), tmp_path / "d" / "a.parquet", row_group_size=100)
        pq.write_table(_table(X[250:], y[250:]), tmp_path / "d" / "b.parquet", row_group_size=100)
        got = _fit(str(tmp_path / "d"), target="y")
    else:
        pq.write_table(_table(X, y, list_column=kind == "list_column"), tmp_path / "d.parquet", row_group_size=70)
        import pyarrow.dataset as ds

        source = ds.dataset(tmp_path / "d.parquet") if kind == "dataset" else tmp_path / "d.parquet"
        got = _fit(source, target="y", features=["x"] if kind == "list_column" else None)
    _same(_fit(X, y), got)


@pytest.mark.parametrize("cpus", [2, 16])
def test_streamed_fit_sessions_spin_where_the_reader_has_a_cpu(data, cpus, monkeypatch, tmp_path):
    """On fewer than 4 CPUs a streamed fit's reader thread needs the cores when it decodes (the user's batches,
    Parquet): onnxruntime's threads sleep between ops instead of spinning. On more, for arrays, and for an .npy
    folder (its reader only copies from memmaps), they keep their default, spinning."""
    X, y, _ = data
    key = "session.intra_op.allow_spinning"
    monkeypatch.setattr(onnxopt.trainer.os, "cpu_count", lambda: cpus)
    got = _fit(lambda: ((X[i:i + 32], y[i:i + 32]) for i in range(0, N, 32)))
    if cpus < 4:
        assert got.runner_._opts.get_session_config_entry(key) == "0"
    else:
        with pytest.raises(Exception, match=key):
            got.runner_._opts.get_session_config_entry(key)
    with pytest.raises(Exception, match=key):
        _fit(X, y).runner_._opts.get_session_config_entry(key)
    (tmp_path / "npy").mkdir()
    np.save(tmp_path / "npy" / "X.npy", X)
    np.save(tmp_path / "npy" / "y.npy", y)
    with pytest.raises(Exception, match=key):
        _fit(str(tmp_path / "npy")).runner_._opts.get_session_config_entry(key)


def test_memmaps_are_read_in_the_training_thread_with_their_pages_asked_ahead(data, tmp_path, monkeypatch):
    """A memmap's reading is copies: no reading thread takes the cores onnxruntime computes on (a source that
    decodes keeps one); the kernel is asked for each next chunk's pages (MADV_WILLNEED), of slices too, and the
    shuffled chunks still give every row once and train as arrays."""
    X, y, _ = data
    threads, advised = [], []
    real = stream.prefetch
    monkeypatch.setattr(stream, "prefetch", lambda items, *a: threads.append(threading.current_thread()) or
                        real(items, *a))
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    _same(_fit(X, y), _fit(str(tmp_path)))
    assert threads == []
    _fit(lambda: ((X[i:i + 32], y[i:i + 32]) for i in range(0, N, 32)))
    assert threads
    monkeypatch.setattr(stream, "MEMMAP_ROWS", 64)
    mapped = np.load(tmp_path / "X.npy", mmap_mode="r")
    source = stream._Memmap(mapped[37:], None, None)
    real_ahead = source._ahead
    monkeypatch.setattr(source, "_ahead", lambda k: advised.append(k) or real_ahead(k))
    rows = np.concatenate([c[0] for c in source.chunks(np.random.default_rng(0), None, 16)])
    assert advised == [int(k) for k in np.random.default_rng(0).permutation(source.n)][1:]  # NOTE: the next ones
    np.testing.assert_array_equal(rows[np.lexsort(rows.T[::-1])], X[37:][np.lexsort(X[37:].T[::-1])])


@pytest.mark.parametrize("chunk", [65536, 100, 37])
def test_memmap_blocks_in_order_are_views_of_the_file_joined_only_across_chunks(chunk, data, tmp_path, monkeypatch):
    """Unshuffled, a memmap's blocks lying in one chunk are the file's rows themselves (no copy); those across a
    chunk's end are joined; every block is the arrays' next rows, whole batches but the last, with or without
    held-out rows, and the fit trains as the arrays do."""
    X, y, sw = data
    for name, a in (("X", X), ("y", y), ("sample_weight", sw)):
        np.save(tmp_path / f"{name}.npy", a)
    monkeypatch.setattr(stream, "MEMMAP_ROWS", chunk)
    monkeypatch.setattr(stream, "BLOCK_BYTES", 48 * X[:1].nbytes)  # NOTE: blocks of 3 batches of 16 rows
    source = stream.as_stream(str(tmp_path))
    parts = list(stream.blocks(source, 16))
    assert [len(p[0]) for p in parts] == [48] * (N // 48) + [N % 48] and all(p[3] == 16 for p in parts)
    start = 0
    for p in parts:
        rows = slice(start, start + len(p[0]))
        for got, want in zip(p[:3], (X, y, sw)):
            np.testing.assert_array_equal(got, want[rows])
        in_one_chunk = rows.start // chunk == (rows.stop - 1) // chunk
        assert np.shares_memory(p[0], source.arrays[0]) == in_one_chunk
        start = rows.stop
    assert any(np.shares_memory(p[0], source.arrays[0]) for p in parts) == (chunk >= 48)
    held = [p[0] for p in stream.blocks(source, 16, part=("validation", 0.2, 5))]
    np.testing.assert_array_equal(np.concatenate(held), X[stream.held_rows(0, N, N, ("validation", 0.2, 5))])
    _same(_fit(X, y, sw), _fit(str(tmp_path)))
    writable = np.lib.format.open_memmap(tmp_path / "X.npy", mode="r+")  # NOTE: the user's own array: left as it is
    _same(_fit(X, y, sw), _fit(writable, y, sw))
    np.testing.assert_array_equal(np.load(tmp_path / "X.npy"), X)


def test_parquet_sample_weight_column_and_features(data, tmp_path):
    X, y, sw = data
    table = _table(X, y, sw).append_column("noise", pa.array(np.full(N, 1e6, np.float32)))
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=128)
    got = _fit(tmp_path / "d.parquet", sw="w", target="y", features=[f"f{i}" for i in range(D)])
    _same(_fit(X, y, sw), got)


def test_stream_errors_name_the_input(data, tmp_path):
    X, y, _ = data
    with pytest.raises(DataError, match="one-shot iterator"):
        _fit((b for b in [(X, y)]))
    pq.write_table(_table(X, y), tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"target: expected column\(s\) of \['f0'.*got \['label'\]"):
        _fit(tmp_path / "d.parquet", target="label")
    with pytest.raises(DataError, match="batch 0 of the iterable: expected a tuple"):
        _fit(lambda: iter([X[:32]]))
    with pytest.raises(DataError, match="does not exist"):
        _fit(tmp_path / "missing.parquet", target="y")


def test_shuffled_blocks_cover_every_row_once_per_epoch(data, tmp_path):
    X, y, _ = data
    pq.write_table(_table(X, y), tmp_path / "d.parquet", row_group_size=50)
    source = stream.as_stream(tmp_path / "d.parquet", target="y")
    orders = []
    for epoch in range(2):
        parts = list(stream.blocks(source, 16, np.random.default_rng([0, epoch])))
        assert all(len(p[0]) % 16 == 0 for p in parts[:-1]) and all(p[3] == 16 for p in parts)
        rows = np.concatenate([p[0] for p in parts])
        orders.append(np.argsort(rows[:, 0]))
        np.testing.assert_array_equal(np.sort(rows[:, 0]), np.sort(X[:, 0]))
    assert not np.array_equal(orders[0], orders[1])
    plain = np.concatenate([p[0] for p in stream.blocks(source, 16)])
    np.testing.assert_array_equal(plain, X)  # NOTE: shuffle=False keeps the file's order


@pytest.mark.parametrize("group", [600, 60, 7])
def test_held_out_rows_partition_the_data_whatever_the_chunking(group, data, tmp_path):
    """The validation rows are the same for one row group, ten or 86, and the same every epoch (shuffled)."""
    X, y, _ = data
    pq.write_table(_table(X, y), tmp_path / "d.parquet", row_group_size=group)
    source = stream.as_stream(tmp_path / "d.parquet", target="y")
    val = np.concatenate([p[0] for p in stream.blocks(source, 32, part=("validation", 0.2, 5))])
    assert len(val) == 120  # NOTE: ceil(0.2 · 600), as arrays hold out
    expected = X[np.flatnonzero(stream.held_rows(0, N, N, ("validation", 0.2, 5)))]
    np.testing.assert_array_equal(val, expected)
    for epoch in range(2):
        train = np.concatenate([p[0] for p in stream.blocks(source, 32, np.random.default_rng([0, epoch]),
                                                            part=("train", 0.2, 5))])
        assert len(train) == 480
        np.testing.assert_array_equal(np.sort(np.concatenate([train, val])[:, 0]), np.sort(X[:, 0]))
    other = stream.held_rows(0, N, N, ("validation", 0.2, 6))
    assert other.sum() == 120 and not np.array_equal(other, stream.held_rows(0, N, N, ("validation", 0.2, 5)))
    est = _fit(tmp_path / "d.parquet", target="y", early_stopping=True, max_iter=3)
    assert len(est.validation_losses_) == 3 and all(np.isfinite(est.validation_losses_))


def test_held_rows_is_a_permutation_split():
    """Rows [start, start + count) asked in pieces give the rows asked whole; the count is ceil(f · n)."""
    for n in (1, 2, 3, 17, 1000, 4097):
        for f in (0.1, 0.5, 0.9):
            if int(np.ceil(f * n)) >= n:
                with pytest.raises(DataError, match="validation_fraction"):
                    stream.held_rows(0, n, n, ("validation", f, 0))
                continue
            whole = stream.held_rows(0, n, n, ("validation", f, 0))
            assert whole.sum() == int(np.ceil(f * n))
            pieces = np.concatenate([stream.held_rows(a, min(7, n - a), n, ("validation", f, 0)) for a in range(0, n, 7)])
            np.testing.assert_array_equal(whole, pieces)
            np.testing.assert_array_equal(~whole, stream.held_rows(0, n, n, ("train", f, 0)))


def test_stream_resume_equals_uninterrupted_run(data, tmp_path):
    X, y, _ = data
    pq.write_table(_table(X, y), tmp_path / "d.parquet", row_group_size=64)
    whole = _fit(tmp_path / "d.parquet", target="y", shuffle=True, max_iter=4)
    _fit(tmp_path / "d.parquet", target="y", shuffle=True, max_iter=2, checkpoint_dir=tmp_path / "ck")
    resumed = _fit(tmp_path / "d.parquet", target="y", shuffle=True, max_iter=4, checkpoint_dir=tmp_path / "ck")
    _same(whole, resumed)


def test_stream_resume_mid_epoch_equals_uninterrupted_run(data, tmp_path, monkeypatch):
    """A streamed fit stopped in the middle of its second epoch (after a checkpoint of its position) and
    resumed gives the weights and losses of the uninterrupted fit: shuffled, with held-out rows."""
    X, y, _ = data
    pq.write_table(_table(X, y), tmp_path / "d.parquet", row_group_size=64)
    monkeypatch.setattr(stream, "BLOCK_BYTES", 2048)  # NOTE: blocks of 64 rows: 9 blocks an epoch
    monkeypatch.setattr(stream, "CHECKPOINT_SECONDS", 0.0)  # NOTE: the position saved after every block
    kw = dict(target="y", shuffle=True, max_iter=3, early_stopping=True)
    whole = _fit(tmp_path / "d.parquet", **kw)
    calls, train = [], onnxopt.Trainer._epoch

    def stopped(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 13:  # NOTE: the 4th block of epoch 2
            raise RuntimeError("killed")
        return train(self, *args, **kwargs)

    monkeypatch.setattr(onnxopt.Trainer, "_epoch", stopped)
    with pytest.raises(RuntimeError, match="killed"):
        _fit(tmp_path / "d.parquet", checkpoint_dir=tmp_path / "ck", **kw)
    monkeypatch.setattr(onnxopt.Trainer, "_epoch", train)
    from onnxopt.checkpoint import load_arrays

    assert load_arrays(tmp_path / "ck" / "trainer.ckpt")[1]["position"][:2] == [1, 3]  # NOTE: epoch 2, 3 blocks
    resumed = _fit(tmp_path / "d.parquet", checkpoint_dir=tmp_path / "ck", **kw)
    _same(whole, resumed)
    np.testing.assert_allclose(whole.validation_losses_, resumed.validation_losses_, rtol=1e-6)


def test_stream_classifier_finds_classes_first(tmp_path):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 4)).astype(np.float32)
    labels = np.array([3, 7, 9])[(X[:, 0] > 0).astype(int) + (X[:, 1] > 1)]
    est = onnxopt.Trainer(mlp([4, 8, 3]), loss="cross_entropy", batch_size=32, max_iter=2, tol=None)
    est.fit(lambda: ((X[i:i + 64], labels[i:i + 64]) for i in range(0, 300, 64)))
    np.testing.assert_array_equal(est.classes_, [3, 7, 9])


def test_runner_epoch_takes_batches(data):
    X, y, _ = data
    step = onnxopt.compile_train_step(mlp([D, 8, 1], seed=1), update="sgd")
    a, b = onnxopt.Runner(step), onnxopt.Runner(step)
    np.testing.assert_array_equal(a.epoch(X, y, batch_size=20),
                                  b.epoch(lambda: ((X[i:i + 20], y[i:i + 20]) for i in range(0, N, 20))))
    np.testing.assert_array_equal(a.get_weights()["W0"] if "W0" in a.get_weights() else 0,
                                  b.get_weights()["W0"] if "W0" in b.get_weights() else 0)


def test_prefetch_reads_ahead_and_raises_the_source_error():
    produced, second = [], threading.Event()

    def items():
        for k in range(3):
            produced.append(k)
            if k == 1:
                second.set()
            yield k
        raise KeyError("bad chunk")

    it = stream.prefetch(items())
    assert next(it) == 0
    assert second.wait(10)  # NOTE: the second item is read while the first is in use
    with pytest.raises(KeyError, match="bad chunk"):
        list(it)


_RSS = """
import sys, numpy as np, onnxopt, pyarrow.dataset  # NOTE: pyarrow's own code (~50 MB) counted before
from onnxopt.examples import mlp
est = onnxopt.Trainer(mlp([100, 50, 10, 1]), batch_size=256, max_iter=1, tol=None, warm_start=True)
est.fit(np.zeros((512, 100), np.float32), np.zeros(512, np.float32))  # NOTE: sessions and imports counted before
before = peak()
est.fit(sys.argv[1], target="y")
print(peak() - before, est.n_iter_)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
def test_parquet_fit_peak_rss_is_bounded(tmp_path):
    """A shuffled epoch on 96 MB of features grows the peak RSS by less than 64 MB (measured: 49 MB for 96 MB,
    52 MB for 192 MB: the blocks, the shuffle buffer and a row group, not the file)."""
    path, rng = tmp_path / "big.parquet", np.random.default_rng(0)
    schema = pa.schema([*(pa.field(f"f{i}", pa.float32()) for i in range(100)), pa.field("y", pa.float32())])
    with pq.ParquetWriter(path, schema) as writer:
        for _ in range(30):  # NOTE: 30 × 8000 rows × 100 float32 = 96 MB, never all in memory here either
            X = rng.normal(size=(8000, 100)).astype(np.float32)
            writer.write_table(_table_wide(X, X[:, 0]), row_group_size=4000)
    grown, epochs = run_script(_RSS, str(path)).split()
    assert int(epochs) == 2 and int(grown) < 64e6, f"peak RSS grew by {int(grown) / 1e6:.1f} MB"


def _table_wide(X, y):
    return pa.table({**{f"f{i}": X[:, i] for i in range(X.shape[1])}, "y": y})


def test_npy_folder_streams_the_rows_of_the_parquet_file(tmp_path, monkeypatch, capsys):
    """`onnxopt convert` writes a Parquet file's rows as X.npy/y.npy; a Trainer streaming that folder (memmaps,
    nothing decoded) trains the weights it trains on the Parquet file (in order, batches of 7 over row groups of
    50); `onnxopt fit` hints at the conversion for a Parquet file it decodes each epoch, and reads the folder."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    from onnxopt.cli import main
    from onnxopt.examples import mlp

    monkeypatch.setattr(stream, "CACHE_BYTES", 0)  # NOTE: streamed, not read whole
    rng = np.random.default_rng(3)
    X = rng.normal(size=(230, 4)).astype(np.float32)
    pq.write_table(pa.table({**{f"f{i}": X[:, i] for i in range(4)}, "y": X.sum(1)}), tmp_path / "d.parquet",
                   row_group_size=50)
    assert main(["convert", str(tmp_path / "d.parquet"), "--target", "y", "-o", str(tmp_path / "npy")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "npy" / "X.npy"), X)
    np.testing.assert_array_equal(np.load(tmp_path / "npy" / "y.npy"), X.sum(1))
    assert sorted(p.name for p in (tmp_path / "npy").iterdir()) == ["X.npy", "y.npy"]
    kw = dict(update="sgd", learning_rate=0.05, batch_size=7, max_iter=2, tol=None, shuffle=False, scale=False)
    parquet = onnxopt.Trainer(mlp([4, 5, 1]), **kw).fit(str(tmp_path / "d.parquet"), target="y")
    npy = onnxopt.Trainer(mlp([4, 5, 1]), **kw).fit(str(tmp_path / "npy"))
    for k, v in parquet.runner_.get_weights().items():
        np.testing.assert_allclose(npy.runner_.get_weights()[k], v, rtol=1e-6, err_msg=k)
    onnx.save(mlp([4, 5, 1]), tmp_path / "m.onnx")
    common = ["--epochs", "1", "--validation-fraction", "0", "--update", "sgd", "--lr", "0.05"]
    capsys.readouterr()
    assert main(["fit", str(tmp_path / "m.onnx"), str(tmp_path / "d.parquet"), "--target", "y", *common, "-o",
                 str(tmp_path / "a.onnx")]) == 0
    assert "onnxopt convert" in capsys.readouterr().err
    assert main(["fit", str(tmp_path / "m.onnx"), str(tmp_path / "npy"), *common, "-o", str(tmp_path / "b.onnx")]) == 0
    out = capsys.readouterr()
    assert "trained 1 epochs on 230 samples" in out.out and "onnxopt convert" not in out.err, out
