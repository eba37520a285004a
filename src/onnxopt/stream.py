"""Streamed training data: blocks of batches read in a background thread while the previous ones train (a memmap's
in the training thread, the kernel reading its pages ahead: ``read_ahead``).

Sources (``as_stream``): an iterable of batches ``(X, y)`` or ``(X, y, sample_weight)`` iterated again each
epoch (a re-iterable object or a zero-argument callable returning an iterator), numpy memmaps, a Parquet file or
folder, or a ``pyarrow.dataset.Dataset`` with the ``features``/``target`` columns named (pyarrow is an extra), or
a folder of row-major ``X.npy``, ``y.npy`` [``sample_weight.npy``] (``write_npy``), read as memmaps: no decoding.
Each source reads *chunks* (a user batch, a Parquet row group, ``MEMMAP_ROWS`` rows of a memmap) and ``blocks``
cuts them into blocks of whole batches of about ``BLOCK_BYTES``, which the Trainer runs as one ``Runner.epoch``.
- ``shuffle=True``: the chunks' order is permuted each epoch, then the rows within a buffer of
  ``SHUFFLE_BLOCKS`` blocks; user batches are kept as given, in their order.
- memory: ``PREFETCH`` blocks queued, the shuffle buffer and one chunk (a Parquet row group's columns).
- a source of at most ``CACHE_BYTES`` (``small``) is read whole by ``read_all`` and trained as arrays.
- held-out rows (early stopping, ``part=(name, fraction, seed)``): row i of n is validation when π(i) < ⌈f·n⌉,
  π a permutation of [0, n) drawn from the seed (``held_rows``): the same rows whatever the chunking, the
  epoch or the number of ranks. User batches are held out whole: batch k when ``floor((k+1)·f) > floor(k·f)``.
- resume: ``epoch(start=...)`` remakes an epoch's blocks and skips those already trained (the Trainer saves
  that position at most every ``CHECKPOINT_SECONDS``).
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterator

import numpy as np

from onnxopt.errors import DataError

__all__ = ["as_stream", "write_npy", "blocks", "prefetch", "held_rows", "BLOCK_BYTES", "SHUFFLE_BLOCKS", "PREFETCH", "MEMMAP_ROWS",
           "CACHE_BYTES"]

BLOCK_BYTES = 2 << 20  # NOTE: a block of W1's batches (400 B rows, batch 15) holds 64 of them, of W3's (3 kB) 5
MAX_BATCHES = 512  # NOTE: batches per block at most (one Scan run for small steps)
SHUFFLE_BLOCKS = 4
PREFETCH = 2
MEMMAP_ROWS = 65536
CHECKPOINT_SECONDS = 60.0  # NOTE: a streamed epoch with checkpoint_dir saves its position at most this often
READ_BYTES = 8 * BLOCK_BYTES  # NOTE: rows of a Parquet read (to_batches' batch_size)
# NOTE: what a stream may hold anyway; ONNXOPT_STREAM_CACHE_BYTES changes it (0: always stream, for tests)
CACHE_BYTES = int(os.environ.get("ONNXOPT_STREAM_CACHE_BYTES", (SHUFFLE_BLOCKS + PREFETCH) * BLOCK_BYTES))
_M64 = (1 << 64) - 1
NPY = ("X.npy", "y.npy", "sample_weight.npy")  # NOTE: the arrays of a folder ``write_npy`` writes


def held_out(k: int, fraction: float) -> bool:
    return int((k + 1) * fraction) > int(k * fraction)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _permute(x: np.ndarray, n: int, seed: int) -> np.ndarray:
    """π(x) for x in [0, n): a 4-round Feistel network on [0, 4^h) >= n, walked until it lands below n."""
    h = max(1, -(-max(n - 1, 1).bit_length() // 2))
    mask = np.uint64((1 << h) - 1)
    keys = [np.uint64(int(_mix(np.array([(seed * 4 + r) & _M64], np.uint64))[0])) for r in range(4)]
    out = x.astype(np.uint64)
    todo = np.ones(len(out), bool)
    while todo.any():
        v = out[todo]
        left, right = v >> np.uint64(h), v & mask
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        out[todo] = (left << np.uint64(h)) | right
        todo[todo] = out[todo] >= np.uint64(n)
    return out


def held_rows(start: int, count: int, total: int, part) -> np.ndarray:
    """Which of the rows [start, start + count) of ``total`` belong to ``part[0]`` ("train" or "validation") for
    the fraction ``part[1]`` and seed ``part[2]``: validation rows are those whose π(i) < ⌈fraction·total⌉."""
    name, fraction, seed = part
    validation = _permute(np.arange(start, start + count, dtype=np.uint64), total, seed) < np.uint64(
        _n_validation(total, fraction))
    return validation if name == "validation" else ~validation


def _n_validation(total: int, fraction: float) -> int:
    n_val = int(np.ceil(fraction * total))
    if not 0 < fraction < 1 or n_val >= total:
        raise DataError(f"validation_fraction: expected a fraction in (0, 1) leaving training rows, got {fraction!r} "
                        f"for {total} rows")
    return n_val


class _Chunks:
    """A source read as ``n`` chunks by index (``_read(k, rows)``), chunk k starting at row ``offsets[k]``;
    shuffled by chunk, held out by row (``held_rows``). ``width``: bytes of a row as stored."""

    batched, n, rows, width = False, 0, None, 1
    decodes = True  # NOTE: whether reading costs CPU beyond copies (the Trainer's pool then sleeps between ops)

    @property
    def small(self) -> bool:
        """At most ``CACHE_BYTES``: the Trainer reads it whole (``read_all``) and trains it as arrays."""
        return self.rows is not None and self.rows * self.width <= CACHE_BYTES

    def read_all(self) -> tuple:
        """(X, y, sample_weight) of every row, in order."""
        parts = [c for k in range(self.n) for c in self._read(k, 1 << 20)]
        if not parts:
            raise DataError("X: the source has no rows, expected at least one")
        return _cat(parts)

    def _ahead(self, k: int) -> None:
        """Chunk ``k`` is read next (a memmap asks the kernel for its pages)."""

    def chunks(self, rng, part, rows: int) -> Iterator[tuple]:
        if part is not None:
            _n_validation(self.rows, part[1])
        order = [int(k) for k in (rng.permutation(self.n) if rng is not None else range(self.n))]
        for i, k in enumerate(order):
            if i + 1 < len(order):
                self._ahead(order[i + 1])
            start = self.offsets[k]
            for c in self._read(int(k), rows):
                n = len(c[0])
                if part is not None:
                    keep = held_rows(start, n, self.rows, part)
                    if not keep.all():
                        c = tuple(None if a is None else a[keep] for a in c)
                start += n
                if len(c[0]):
                    yield c


class _Batches:
    """The user's batches, each one step, in their order (an iterable iterated again each epoch)."""

    batched, n, rows, small, decodes = True, None, None, False, True  # NOTE: the user's iterable may compute

    def __init__(self, source):
        self.source = source

    def chunks(self, rng, part, rows: int) -> Iterator[tuple]:
        seen = False
        for k, batch in enumerate(self.source() if callable(self.source) else self.source):
            seen = True
            if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
                raise DataError(f"X: batch {k} of the iterable: expected a tuple (X, y) or (X, y, sample_weight), "
                                f"got {type(batch).__name__}{'' if not hasattr(batch, '__len__') else len(batch)}")
            if part is None or held_out(k, part[1]) == (part[0] == "validation"):  # NOTE: whole batches
                yield (*batch, None) if len(batch) == 2 else tuple(batch)
        if not seen:
            raise DataError("X: the iterable of batches gave no batch (a generator is exhausted after one epoch: "
                            "pass a zero-argument callable returning a new iterator, or a re-iterable object)")


class _Memmap(_Chunks):
    """Memmaps read in the training thread (``read_ahead``), the kernel reading the next chunk's pages meanwhile."""

    decodes = False

    def __init__(self, X, y, sw):
        self.arrays, self.rows = (X, y, sw), len(X)
        self.n = -(-len(X) // MEMMAP_ROWS)
        self.offsets = [k * MEMMAP_ROWS for k in range(self.n)]
        self.width = sum(a[:1].nbytes for a in self.arrays if a is not None) or 1

    def _read(self, k: int, rows: int):
        for a in range(k * MEMMAP_ROWS, min((k + 1) * MEMMAP_ROWS, self.rows), rows):
            end = min(a + rows, (k + 1) * MEMMAP_ROWS)
            yield tuple(None if v is None else v[a:end] for v in self.arrays)  # NOTE: ``blocks`` copies them once

    def read_all(self) -> tuple:
        return tuple(None if a is None else np.array(a) for a in super().read_all())  # NOTE: not views of the file

    def _ahead(self, k: int) -> None:
        lo, hi = k * MEMMAP_ROWS, min((k + 1) * MEMMAP_ROWS, self.rows)
        for a in self.arrays:
            mapped = getattr(a, "_mmap", None)  # NOTE: np.memmap's and np.load(mmap_mode=...)'s mmap.mmap
            if mapped is None or not hasattr(mmap, "MADV_WILLNEED") or not a.flags.c_contiguous:
                continue
            row = a[:1].nbytes  # NOTE: where row 0 lies in the map (a slice of a memmap keeps its parent's offset)
            base = a.ctypes.data - np.frombuffer(mapped, np.uint8, 1).ctypes.data
            first = base + lo * row - (base + lo * row) % mmap.PAGESIZE
            end = min(len(mapped), base + hi * row)
            if 0 <= first < end:
                mapped.madvise(mmap.MADV_WILLNEED, first, end - first)


class _Parquet(_Chunks):
    """Row groups of a ``pyarrow.dataset.Dataset``; features are numeric scalar or list columns, side by side
    (pandas' index columns are not features unless named)."""

    def __init__(self, dataset, features, target, weight, files: bool = False):
        import pyarrow as pa

        schema, names = dataset.schema, dataset.schema.names
        if features is None:
            index = [c for c in (schema.pandas_metadata or {}).get("index_columns", []) if isinstance(c, str)]
            features = [c for c in names if c not in (target, weight, *index)]
        features = list(features)
        for what, cols in (("features", features), ("target", [target]), ("sample_weight", [weight])):
            bad = [c for c in cols if c is not None and c not in names]
            if bad or (what == "features" and not cols):
                raise DataError(f"{what}: expected column(s) of {names}, got {bad or cols}")
        if target is None:
            raise DataError(f"target: a Parquet source needs the target column named (one of {names}), got None")
        self.scalars = True  # NOTE: whether each feature column holds one value per row
        for c in features + ([weight] if weight else []):
            t = schema.field(c).type
            listed = pa.types.is_list(t) or pa.types.is_fixed_size_list(t) or pa.types.is_large_list(t)
            self.scalars = self.scalars and not (listed and c in features)
            value = t.value_type if listed else t
            if not (pa.types.is_integer(value) or pa.types.is_floating(value) or pa.types.is_boolean(value)):
                raise DataError(f"{'features' if c in features else 'sample_weight'}: column {c!r} has type {t}, "
                                "expected numbers (ints, floats, bools or lists of them)")
        self.features, self.columns = features, [*features, target, *([weight] if weight else [])]
        if files:  # NOTE: a file or folder: row groups read by ParquetFile (a third less CPU than fragments' scans)
            import pyarrow.parquet as pq

            fs = dataset.filesystem  # NOTE: footers read once; a file is opened for each read (no open handles)
            metas = [(f, pq.read_metadata(fs.open_input_file(f))) for f in dataset.files]
            self.pieces = [(fs, f, m, g) for f, m in metas for g in range(m.num_row_groups)]
            counts = [m.row_group(g).num_rows for _, _, m, g in self.pieces]
        else:
            self.pieces = [g for f in dataset.get_fragments() for g in f.split_by_row_group()]
            counts = [sum(rg.num_rows for rg in g.row_groups) for g in self.pieces]
        self.n, self.rows = len(self.pieces), int(sum(counts))
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()
        # NOTE: reads of about READ_BYTES: pyarrow's cost per column and read falls with longer reads
        widths = [_bits(schema.field(c).type) for c in self.columns]
        if all(w >= 8 for w in widths):  # NOTE: fixed-width columns (bools count 1 bit): no read
            self.width = sum(w // 8 for w in widths)
        else:
            first = next(self._batches(0, 1), None) if self.rows else None
            self.width = sum(_column(c, "").nbytes for c in first.columns) if first is not None else 4
        self.read_rows = max(256, READ_BYTES // self.width)
        self.weighted = weight is not None
        types = {schema.field(c).type for c in features}  # NOTE: numeric columns of one type: to_tensor
        self.tensor = len(features) > 1 and len(types) == 1 and np.dtype(types.pop().to_pandas_dtype()).kind in "iuf"

    def _batches(self, k: int, rows: int):
        # NOTE: one decoding thread: Arrow's pool would take the cores ORT's threads train on
        if isinstance(self.pieces[k], tuple):
            import pyarrow.parquet as pq

            fs, path, meta, g = self.pieces[k]
            with fs.open_input_file(path) as f:
                yield from pq.ParquetFile(f, metadata=meta).iter_batches(batch_size=rows, row_groups=[g],
                                                                         columns=self.columns, use_threads=False)
        else:
            yield from self.pieces[k].to_batches(columns=self.columns, batch_size=rows, use_threads=False)

    finite = False  # NOTE: set by Trainer.fit (not allow_nan): NaN/inf refused here, where the row is known

    def _read(self, k: int, rows: int):
        nf, start = len(self.features), self.offsets[k]
        for rb in self._batches(k, self.read_rows):
            nulls = [c for c, col in zip(self.columns, rb.columns) if col.null_count]
            if nulls:
                raise DataError(f"column {nulls[0]!r}: {rb.column(nulls[0]).null_count} null value(s) in row group "
                                f"{k}; expected none (fill or drop them, e.g. pandas' fillna/dropna)")
            X = np.asarray(rb.select(self.features).to_tensor(row_major=True)) if self.tensor else None
            cols = [_column(rb.column(i), self.columns[i]) for i in range(0 if X is None else nf, rb.num_columns)]
            if X is None:
                X, cols = cols[0] if nf == 1 else np.hstack(cols[:nf]), cols[nf:]
            if self.finite:
                self._check_finite(X, cols[0], k, start)
            start += rb.num_rows
            yield X, cols[0][:, 0] if cols[0].shape[1] == 1 else cols[0], cols[1][:, 0] if self.weighted else None

    def _check_finite(self, X: np.ndarray, y: np.ndarray, k: int, start: int) -> None:
        """Raises DataError naming the column and the row (its position in the source) of a NaN or infinity."""
        for arr, names in ((X, self.features), (y, [self.columns[len(self.features)]])):
            if arr.dtype.kind != "f" or np.isfinite(arr).all():
                continue
            flat = arr.reshape(len(arr), -1)
            i, j = (int(v) for v in np.argwhere(~np.isfinite(flat))[0])
            name = names[j] if len(names) == flat.shape[1] else names[0] if len(names) == 1 else f"feature value {j}"
            raise DataError(f"column {name!r}: {flat[i, j]} in row {start + i} (row group {k}); "
                            "expected finite values (replace or drop that row)")


def _bits(t) -> int:
    """Bits of a fixed-width Arrow type, 0 for others (lists, strings)."""
    try:
        return int(t.bit_width)
    except ValueError:
        return 0


def _column(col, name: str) -> np.ndarray:
    """An Arrow column as (n, k): a scalar column as (n, 1), a (fixed-size) list column as its values."""
    import pyarrow as pa

    if pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type) or pa.types.is_large_list(col.type):
        values = col.flatten().to_numpy(zero_copy_only=False)
        if len(col) and values.size % len(col):
            raise DataError(f"column {name!r}: lists of different lengths, expected one length for every row")
        return values.reshape(len(col), -1)
    return col.to_numpy(zero_copy_only=False).reshape(len(col), 1)


def as_stream(X, y=None, sample_weight=None, features=None, target=None):
    """The stream over ``X`` when it is one (see the module's docstring), else None (arrays)."""
    if isinstance(X, (_Chunks, _Batches)):
        return X
    if isinstance(X, np.memmap) or isinstance(y, np.memmap):
        return _Memmap(X, y, sample_weight)
    if isinstance(X, (str, os.PathLike)) and os.path.isfile(os.path.join(X, NPY[0])):
        found = [os.path.join(X, f) for f in NPY]
        return _Memmap(*(np.load(f, mmap_mode="r") if os.path.isfile(f) else None for f in found))
    if isinstance(X, (str, os.PathLike)) or type(X).__module__.startswith("pyarrow"):
        try:
            import pyarrow.dataset as ds
        except ImportError as exc:
            raise DataError(f"X: reading {X!r} needs pyarrow (pip install -e '.[parquet]' in the repository)") from exc
        if isinstance(X, (str, os.PathLike)):
            if not os.path.exists(X):
                raise DataError(f"X: expected a Parquet file or folder, got {os.fspath(X)!r}, which does not exist")
            X, files = ds.dataset(os.fspath(X), format="parquet"), True
        else:
            files = False
        if y is not None:
            raise DataError(f"y: a Parquet source reads its target from column target={target!r}, got an array")
        return _Parquet(X, features, target, sample_weight, files)
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


def write_npy(source, folder: str | os.PathLike) -> int:
    """Writes the rows of ``source`` (a stream with known rows: a Parquet file or folder) in order, as ``folder``'s
    ``X.npy``, ``y.npy`` [``sample_weight.npy``]: rows side by side, streamed as memmaps with no decoding (W3's
    784 float columns: an epoch's reading 16-50 ms instead of 140-240 ms). Returns the rows written."""
    if getattr(source, "rows", None) is None:
        raise DataError(f"X: write_npy needs a source of known rows (a Parquet file or folder), got {source!r}")
    os.makedirs(folder, exist_ok=True)
    outs, done = None, 0
    for chunk in source.chunks(None, None, 65536):
        if outs is None:  # NOTE: written under a temporary name, renamed when whole
            outs = [None if a is None else np.lib.format.open_memmap(os.path.join(folder, f + ".tmp"), "w+", a.dtype,
                                                                     (source.rows, *a.shape[1:]))
                    for a, f in zip(chunk, NPY)]
        for out, a in zip(outs, chunk):
            if out is not None:
                out[done:done + len(a)] = a
        done += len(chunk[0])
    for out, f in zip(outs or [], NPY):
        if out is not None:
            out.flush()
            os.replace(os.path.join(folder, f + ".tmp"), os.path.join(folder, f))
    return done


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
    chunks = stream.chunks(rng, part, batch * MAX_BATCHES)
    if rng is None and not stream.decodes:
        yield from _views(map(cast, chunks), batch)
        return
    size = buf = None  # NOTE: one buffer of SHUFFLE_BLOCKS blocks and a chunk, reused: rows are copied in once
    rows = 0
    for chunk in chunks:
        chunk, n = cast(chunk), len(chunk[0])
        if size is None:
            size = _block_rows(chunk, batch)
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


def _block_rows(chunk: tuple, batch: int) -> int:
    """Rows of a block: whole batches, about ``BLOCK_BYTES`` of X, at most ``MAX_BATCHES`` batches."""
    return batch * max(1, min(MAX_BATCHES, BLOCK_BYTES // (batch * max(chunk[0][:1].nbytes, 1))))


def _views(chunks: Iterator[tuple], batch: int) -> Iterator[tuple]:
    """``blocks`` in the rows' order from chunks that stay valid (a memmap's rows): each block lying in one chunk is
    a view of it, no copy (W3 from .npy: two copies of 25 MB an epoch fewer); a block across chunks is joined."""
    size, pending, held = None, [], 0  # NOTE: the pieces of the block begun in earlier chunks, their rows
    piece = lambda chunk, a, b: tuple(None if x is None else x[a:b] for x in chunk)  # noqa: E731
    for chunk in chunks:
        size = size or _block_rows(chunk, batch)
        n, start = len(chunk[0]), 0
        if pending:
            start = min(n, size - held)
            pending.append(piece(chunk, 0, start))
            held += start
            if held < size:
                continue
            yield (*_cat(pending), batch)
            pending, held = [], 0
        end = start + (n - start) // size * size
        for a in range(start, end, size):
            yield (*piece(chunk, a, a + size), batch)
        if end < n:
            pending, held = [piece(chunk, end, n)], n - end
    if pending:
        yield (*_cat(pending), batch)


def _cut(buf: tuple, rows: int, size: int, rng, batch: int, cut: int) -> Iterator[tuple]:
    """Blocks (copies) of ``size`` rows from the first ``cut`` of the ``rows`` rows of ``buf``, shuffled by
    ``rng``; the rows after ``cut`` move to the front of ``buf``."""
    if rng is None:  # NOTE: in order: copies of slices (a memcpy, not a gather)
        for i in range(0, cut, size):
            yield (*(None if a is None else a[i:min(i + size, cut)].copy() for a in buf), batch)
        for a in buf:
            if a is not None:
                a[:rows - cut] = a[cut:rows].copy()
        return
    order = rng.permutation(rows)
    for i in range(0, cut, size):
        yield (*(None if a is None else a[order[i:min(i + size, cut)]] for a in buf), batch)
    for a in buf:
        if a is not None:
            a[:rows - cut] = a[order[cut:rows]]


def read_ahead(stream, items: Iterator) -> Iterator:
    """``stream``'s ``items`` read ahead by a thread (``prefetch``) when it decodes; a memmap's in the caller's thread:
    its reading is copies, which a thread would take from the cores onnxruntime computes on (W3 from .npy on 2 CPUs:
    0.86-0.94 of in memory with the thread), while the kernel reads the file's pages ahead (``_Memmap._ahead``)."""
    return prefetch(items) if stream.decodes else items


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


def epoch(run: Callable, stream, batch: int, rng=None, part=None, dtype=None, prepare=None,
          start: tuple[int, float, int] = (0, 0.0, 0), after: Callable | None = None) -> tuple[float, int]:
    """Runs ``run(X, y, sample_weight, batch) -> mean loss`` on each block; returns (mean loss, rows).
    ``prepare(X, y, sample_weight) -> (X, y, sample_weight)`` (checks, encoding) runs in the reading thread.
    ``start=(blocks, loss sum, rows)`` resumes an epoch: its first ``blocks`` blocks are made (the same
    chunk order and shuffle) and skipped; ``after(blocks, loss sum, rows)`` is called after each block."""
    skip, total, n = start
    items = blocks(stream, batch, rng, part, dtype)
    items = (b if k < skip or prepare is None else (*prepare(*b[:3]), b[3]) for k, b in enumerate(items))
    for k, (X, y, sw, b) in enumerate(read_ahead(stream, items)):
        if k < skip:
            continue
        total += run(X, y, sw, b) * len(X)
        n += len(X)
        if after is not None:
            after(k + 1, total, n)
    if not n:
        raise DataError("X: the stream gave no rows in this epoch")
    return total / n, n
