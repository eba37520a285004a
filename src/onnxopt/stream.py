"""Streamed training data: blocks of batches read in a background thread while the previous ones train.

Sources (``as_stream``): an iterable of batches ``(X, y)`` or ``(X, y, sample_weight)`` iterated again each
epoch (a re-iterable object or a zero-argument callable returning an iterator), numpy memmaps, a Parquet file or
folder, or a ``pyarrow.dataset.Dataset`` with the ``features``/``target`` columns named (pyarrow is an extra).
Each source reads *chunks* (a user batch, a Parquet row group, ``MEMMAP_ROWS`` rows of a memmap) and ``blocks``
cuts them into blocks of whole batches of about ``BLOCK_BYTES``, which the Trainer runs as one ``Runner.epoch``.
- ``shuffle=True``: the chunks' order is permuted each epoch, then the rows within a buffer of
  ``SHUFFLE_BLOCKS`` blocks; user batches are kept as given, in their order.
- memory: ``PREFETCH`` blocks queued, the shuffle buffer and one chunk (a Parquet row group's columns).
- held-out chunks (early stopping): chunk k is validation when ``floor((k+1)·f) > floor(k·f)``, f the fraction.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator

import numpy as np

from onnxopt.errors import DataError

__all__ = ["as_stream", "blocks", "prefetch", "BLOCK_BYTES", "SHUFFLE_BLOCKS", "PREFETCH", "MEMMAP_ROWS"]

BLOCK_BYTES = 2 << 20  # NOTE: a block of W1's batches (400 B rows, batch 15) holds 64 of them, of W3's (3 kB) 5
MAX_BATCHES = 64  # NOTE: batches per block at most (one Scan run for small steps)
SHUFFLE_BLOCKS = 4
PREFETCH = 2
MEMMAP_ROWS = 65536
CACHE_BYTES = (SHUFFLE_BLOCKS + PREFETCH) * BLOCK_BYTES  # NOTE: what a stream may hold anyway


def held_out(k: int, fraction: float) -> bool:
    return int((k + 1) * fraction) > int(k * fraction)


class _Chunks:
    """A source read as ``n`` chunks by index (``_read(k, rows)``), shuffled and held out by chunk; a source of at
    most ``CACHE_BYTES`` is kept after its first reading (``cache``: None until the first chunk says)."""

    batched, n, rows, cache = False, 0, None, None

    def chunks(self, rng, part, rows: int) -> Iterator[tuple]:
        keys = [k for k in range(self.n) if part is None or held_out(k, part[1]) == (part[0] == "validation")]
        if part is not None and not keys:
            raise DataError(f"X: holding out a fraction {part[1]} of {self.n} chunk(s) leaves no {part[0]} data; "
                            "expected more chunks (row groups, files or batches) or validation data")
        for k in rng.permutation(keys) if rng is not None else keys:
            if self.cache and k in self.cache:
                yield from self.cache[k]
                continue
            parts = []  # NOTE: kept once the chunk is read whole (an epoch may stop half way)
            for c in self._read(int(k), rows):
                if self.cache is None:
                    self.cache = {} if self.rows * max(c[0][:1].nbytes, 1) <= CACHE_BYTES else False
                if self.cache is not False:
                    parts.append(c)
                yield c
            if self.cache is not False:
                self.cache[k] = parts


class _Batches:
    """The user's batches, each one step, in their order (an iterable iterated again each epoch)."""

    batched, n, rows, cache = True, None, None, None

    def __init__(self, source):
        self.source = source

    def chunks(self, rng, part, rows: int) -> Iterator[tuple]:
        seen = False
        for k, batch in enumerate(self.source() if callable(self.source) else self.source):
            seen = True
            if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
                raise DataError(f"X: batch {k} of the iterable: expected a tuple (X, y) or (X, y, sample_weight), "
                                f"got {type(batch).__name__}{'' if not hasattr(batch, '__len__') else len(batch)}")
            if part is None or held_out(k, part[1]) == (part[0] == "validation"):
                yield (*batch, None) if len(batch) == 2 else tuple(batch)
        if not seen:
            raise DataError("X: the iterable of batches gave no batch (a generator is exhausted after one epoch: "
                            "pass a zero-argument callable returning a new iterator, or a re-iterable object)")


class _Memmap(_Chunks):
    def __init__(self, X, y, sw):
        self.arrays, self.rows = (X, y, sw), len(X)
        self.n = -(-len(X) // MEMMAP_ROWS)

    def _read(self, k: int, rows: int):
        for a in range(k * MEMMAP_ROWS, min((k + 1) * MEMMAP_ROWS, self.rows), rows):
            end = min(a + rows, (k + 1) * MEMMAP_ROWS)
            yield tuple(None if v is None else np.array(v[a:end]) for v in self.arrays)


class _Parquet(_Chunks):
    """Row groups of a ``pyarrow.dataset.Dataset``; features are scalar or list columns, stacked side by side."""

    def __init__(self, dataset, features, target, weight):
        names = dataset.schema.names
        features = [c for c in names if c not in (target, weight)] if features is None else list(features)
        for what, cols in (("features", features), ("target", [target]), ("sample_weight", [weight])):
            bad = [c for c in cols if c is not None and c not in names]
            if bad or (what == "features" and not cols):
                raise DataError(f"{what}: expected column(s) of {names}, got {bad or cols}")
        if target is None:
            raise DataError(f"target: a Parquet source needs the target column named (one of {names}), got None")
        self.features, self.columns = features, [*features, target, *([weight] if weight else [])]
        self.pieces = [g for f in dataset.get_fragments() for g in f.split_by_row_group()]
        self.n, self.rows = len(self.pieces), dataset.count_rows()
        # NOTE: reads of about BLOCK_BYTES; a fragment's head reads one row group (a dataset's, many files)
        first = self.pieces[0].head(1, columns=self.columns).to_batches() if self.pieces else []
        width = sum(_column(c).nbytes for c in first[0].columns) if first and first[0].num_rows else 4
        self.read_rows = max(256, BLOCK_BYTES // width)
        self.weighted = weight is not None
        types = {dataset.schema.field(c).type for c in features}  # NOTE: numeric columns of one type: to_tensor
        self.tensor = len(features) > 1 and len(types) == 1 and np.dtype(types.pop().to_pandas_dtype()).kind in "biuf"

    def _read(self, k: int, rows: int):
        nf = len(self.features)
        # NOTE: one decoding thread: Arrow's pool would take the cores ORT's threads train on
        for rb in self.pieces[k].to_batches(columns=self.columns, batch_size=self.read_rows, use_threads=False):
            X = np.asarray(rb.select(self.features).to_tensor(row_major=True)) if self.tensor else None
            cols = [_column(rb.column(i)) for i in range(0 if X is None else nf, rb.num_columns)]
            if X is None:
                X, cols = cols[0] if nf == 1 else np.hstack(cols[:nf]), cols[nf:]
            yield X, np.array(cols[0][:, 0] if cols[0].shape[1] == 1 else cols[0]), np.array(cols[1][:, 0]) if self.weighted else None


def _column(col) -> np.ndarray:
    """An Arrow column as (n, k): a scalar column as (n, 1), a (fixed-size) list column as its values."""
    import pyarrow as pa

    if pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type) or pa.types.is_large_list(col.type):
        return col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), -1)
    return col.to_numpy(zero_copy_only=False).reshape(len(col), 1)


def as_stream(X, y=None, sample_weight=None, features=None, target=None):
    """The stream over ``X`` when it is one (see the module's docstring), else None (arrays)."""
    if isinstance(X, np.memmap) or isinstance(y, np.memmap):
        return _Memmap(X, y, sample_weight)
    if isinstance(X, (str, os.PathLike)) or type(X).__module__.startswith("pyarrow"):
        try:
            import pyarrow.dataset as ds
        except ImportError as exc:
            raise DataError(f"X: reading {X!r} needs pyarrow (pip install 'onnxopt[parquet]')") from exc
        if isinstance(X, (str, os.PathLike)):
            if not os.path.exists(X):
                raise DataError(f"X: expected a Parquet file or folder, got {os.fspath(X)!r}, which does not exist")
            X = ds.dataset(os.fspath(X), format="parquet")
        if y is not None:
            raise DataError(f"y: a Parquet source reads its target from column target={target!r}, got an array")
        return _Parquet(X, features, target, sample_weight)
    if isinstance(X, np.ndarray) or hasattr(X, "__array__") or hasattr(X, "iloc") or isinstance(X, (list, tuple)):
        return None
    if callable(X) or hasattr(X, "__iter__"):
        if not callable(X) and iter(X) is X:
            raise DataError(f"X: {type(X).__name__} is a one-shot iterator, read once; expected a re-iterable object "
                            "or a zero-argument callable returning a new iterator each epoch")
        if y is not None or sample_weight is not None:
            raise DataError("y: an iterable of batches carries its targets, got y or sample_weight as well")
        return _Batches(X)
    return None


def _cat(parts: list[tuple]) -> tuple:
    return tuple(None if parts[0][i] is None else parts[0][i] if len(parts) == 1
                 else np.concatenate([q[i] for q in parts]) for i in range(3))


def blocks(stream, batch: int, rng: np.random.Generator | None = None, part=None, dtype=None) -> Iterator[tuple]:
    """Blocks ``(X, y, sample_weight, batch)`` of whole batches (but the last), X cast to ``dtype``."""
    cast = (lambda b: b) if dtype is None else (lambda b: (np.asarray(b[0], dtype), *b[1:]))  # noqa: E731
    if stream.batched:  # NOTE: equal-length user batches grouped up to BLOCK_BYTES, kept as they are
        group: list[tuple] = []
        for b in stream.chunks(rng, part, batch):
            b = cast(b)
            if group and (len(b[0]) != len(group[0][0]) or (b[2] is None) != (group[0][2] is None)
                          or len(group) >= MAX_BATCHES or len(group) * b[0].nbytes >= BLOCK_BYTES):
                yield (*_cat(group), len(group[0][0]))
                group = []
            group.append(b)
        if group:
            yield (*_cat(group), len(group[0][0]))
        return
    size = buf = None  # NOTE: one buffer of SHUFFLE_BLOCKS blocks and a chunk, reused: rows are copied in once
    rows = 0
    for chunk in stream.chunks(rng, part, batch * MAX_BATCHES):
        chunk, n = cast(chunk), len(chunk[0])
        if size is None:
            size = batch * max(1, min(MAX_BATCHES, BLOCK_BYTES // (batch * max(chunk[0][:1].nbytes, 1))))
            limit = size * (SHUFFLE_BLOCKS if rng is not None else 1)
        if buf is None or rows + n > len(buf[0]):
            old, buf = buf, tuple(None if a is None else np.empty((max(limit, rows) + n, *a.shape[1:]), a.dtype)
                                  for a in chunk)
            for a, b in zip(buf, old or ()):
                if a is not None:
                    a[:rows] = b[:rows]
        for a, c in zip(buf, chunk):
            if a is not None:
                a[rows:rows + n] = c
        rows += n
        if rows >= limit:
            yield from _cut(buf, rows, size, rng, batch, rows // size * size)
            rows %= size
    if rows:
        yield from _cut(buf, rows, size, rng, batch, rows)


def _cut(buf: tuple, rows: int, size: int, rng, batch: int, cut: int) -> Iterator[tuple]:
    """Blocks (copies) of ``size`` rows from the first ``cut`` of the ``rows`` rows of ``buf``, shuffled by
    ``rng``; the rows after ``cut`` move to the front of ``buf``."""
    order = rng.permutation(rows) if rng is not None else np.arange(rows)
    for i in range(0, cut, size):
        yield (*(None if a is None else a[order[i:min(i + size, cut)]] for a in buf), batch)
    for a in buf:
        if a is not None:
            a[:rows - cut] = a[order[cut:rows]]


def prefetch(items: Iterator, depth: int = PREFETCH) -> Iterator:
    """``items`` produced by a background thread, ``depth`` ahead; its errors are raised here."""
    q: queue.Queue = queue.Queue(depth)
    stop, end = threading.Event(), object()

    def work() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        pass
                if stop.is_set():
                    return
            q.put((end, None))
        except BaseException as exc:  # noqa: BLE001  NOTE: raised in the consumer's thread
            q.put((end, exc))

    thread = threading.Thread(target=work, name="onnxopt-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item, exc = q.get()
            if exc is not None:
                raise exc
            if item is end:
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # NOTE: a producer blocked on a full queue sees ``stop`` within 0.1 s
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(0.01)


def epoch(run: Callable, stream, batch: int, rng=None, part=None, dtype=None) -> tuple[float, int]:
    """Runs ``run(X, y, sample_weight, batch) -> mean loss`` on each block; returns (mean loss, rows)."""
    total, n, items = 0.0, 0, blocks(stream, batch, rng, part, dtype)
    cached = isinstance(stream.cache, dict) and len(stream.cache) == stream.n  # NOTE: nothing to read: no thread
    for X, y, sw, b in items if cached else prefetch(items):
        total += run(X, y, sw, b) * len(X)
        n += len(X)
    if not n:
        raise DataError("X: the stream gave no rows in this epoch")
    return total / n, n
