"""Streamed against in-memory training, and the peak RSS of a fit on a Parquet file larger than it.

Speed: for each workload two fitted ``Trainer``s (warm_start, shuffle=False, ``--epochs`` epochs a fit, one first
fitted on the arrays, one on the file, as a user's would be) alternate a fit on the arrays and a fit on the same
rows in a Parquet file (row groups of 8192 rows, no dictionary encoding:
random floats never repeat, and trying costs 2.7× on read), ``--rounds`` times; the
ratio is the median of the paired ratios in-memory time / streamed time (>= 0.9 is the target). "Reading alone"
is the time to read and cut the file into blocks once, nothing trained: what the prefetch thread must hide (a
``.npy`` folder in order: ~0, its blocks are views of the file, read when the step reads them).
W1 runs at its own 750 rows, which a fit reads whole and trains as arrays (at most ``stream.CACHE_BYTES``,
12 MB), 10× ``--epochs`` a fit (opening the file would weigh on 3 epochs of 5 ms), and at 120,000 rows
("W1x160", 48 MB), read from the file every epoch. "W3-list" is W3 written as one FixedSizeList column of 784
floats (the features of a row side by side: read without a transposition) instead of 784 columns; "W3-npy" is
W3's Parquet file converted by ``stream.write_npy`` (``onnxopt convert``) into X.npy/y.npy, streamed as memmaps.
Memory: a subprocess fits W1's MLP (batch 256) on ``--rss-rows`` rows of 100 float32 features, and reports its
peak RSS (VmHWM: ru_maxrss would start from this parent's) before and after the fit beside the file's size.

    python benchmarks/streaming.py W1-sgd W1x160 W3 W3-list W3-npy [--rounds 3] [--rss-rows 1500000]  (under 3 minutes on 2 idle cores)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import onnxopt
from onnxopt import stream
from onnxopt.bench.competitors import _onnxopt_update
from onnxopt.bench.workloads import WORKLOADS


def _write(path: str, X: np.ndarray, y: np.ndarray, tensor: bool = False) -> None:
    """One float column per feature, or one FixedSizeList column holding each row's features (``tensor``)."""
    cols = {"x": pa.FixedSizeListArray.from_arrays(X.reshape(-1), X.shape[1])} if tensor else \
        {f"f{i}": X[:, i] for i in range(X.shape[1])}
    pq.write_table(pa.table({**cols, "y": y}), path, row_group_size=8192, use_dictionary=False)


def speed(name: str, rounds: int, epochs: int, folder: str) -> tuple[float, float, list[float]]:
    wl = WORKLOADS["W1-sgd"] if name == "W1x160" else WORKLOADS[name.removesuffix("-list").removesuffix("-npy")]
    if name == "W1x160":
        wl = dataclasses.replace(wl, n=wl.n * 160)
    X, y = wl.data()
    path = os.path.join(folder, f"{name}.parquet")
    _write(path, X, y, tensor=name.endswith("-list"))
    if name.endswith("-npy"):  # NOTE: the Parquet file converted as `onnxopt convert` does
        stream.write_npy(stream.as_stream(path, target="y"), path := os.path.join(folder, name))
    # NOTE: one Trainer per source, each first fitted on its own: a streamed fit's sessions do not spin
    ests = [onnxopt.Trainer(wl.model(), loss=wl.loss, update=_onnxopt_update(wl.update), learning_rate=wl.lr,
                            batch_size=wl.batch, max_iter=epochs, shuffle=False, tol=None, warm_start=True)
            for _ in range(2)]
    ests[0].fit(X, y)
    ests[1].fit(path, target="y")
    memory, streamed = [], []
    for _ in range(rounds):
        for est, source, times in ((ests[0], (X, y), memory), (ests[1], (path,), streamed)):
            time.sleep(0.1)  # NOTE: ORT's threads spin ~35 ms after a run
            t0 = time.perf_counter()
            est.fit(*source, target="y")
            times.append((time.perf_counter() - t0) / epochs)
    ratios = [m / s for m, s in zip(memory, streamed)]
    reads = []
    for _ in range(rounds):  # NOTE: what the prefetch thread must hide: reading and converting, nothing trained
        source = stream.as_stream(path, target="y")
        t0 = time.perf_counter()
        for _ in stream.blocks(source, wl.batch, dtype=np.float32):
            pass
        reads.append(time.perf_counter() - t0)
    return statistics.median(memory), statistics.median(streamed), ratios, statistics.median(reads)


_RSS = """
import sys, time, numpy as np, onnxopt, pyarrow.dataset
from onnxopt.examples import mlp
peak = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
est = onnxopt.Trainer(mlp([100, 50, 10, 1]), batch_size=256, max_iter=1, tol=None, warm_start=True)
est.fit(np.zeros((512, 100), np.float32), np.zeros(512, np.float32))
before, t0 = peak(), time.perf_counter()
est.fit(sys.argv[1], target="y")
print(before, peak(), time.perf_counter() - t0)
"""


def peak_rss(rows: int, folder: str) -> tuple[int, int, float]:
    """(file bytes, peak RSS bytes, seconds) of a fit on ``rows`` rows of 100 float32 features."""
    path, rng = os.path.join(folder, "big.parquet"), np.random.default_rng(0)
    schema = pa.schema([*(pa.field(f"f{i}", pa.float32()) for i in range(100)), pa.field("y", pa.float32())])
    with pq.ParquetWriter(path, schema, use_dictionary=False) as writer:
        for start in range(0, rows, 65536):
            X = rng.normal(size=(min(65536, rows - start), 100)).astype(np.float32)
            writer.write_table(pa.table({**{f"f{i}": X[:, i] for i in range(100)}, "y": X[:, 0]}), row_group_size=16384)
    out = subprocess.run([sys.executable, "-c", _RSS, path], capture_output=True, text=True, check=True, timeout=1800)
    before, peak, seconds = out.stdout.split()
    return os.path.getsize(path), int(before), int(peak), float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="*", default=["W1-sgd", "W1x160", "W3", "W3-list", "W3-npy"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rss-rows", type=int, default=1_500_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        print("load average before: %.2f %.2f %.2f\n" % os.getloadavg())
        print("| workload | in-memory epoch (ms) | streamed epoch (ms) | speed ratio (median; rounds) "
              "| reading alone, first epoch (ms) |")
        print("| --- | --- | --- | --- | --- |")
        for name in args.workloads:
            mem, st, ratios, read = speed(name, args.rounds, args.epochs * (10 if name == "W1-sgd" else 1), folder)
            print(f"| {name} | {1e3 * mem:.1f} | {1e3 * st:.1f} | {statistics.median(ratios):.2f} "
                  f"({', '.join(f'{r:.2f}' for r in ratios)}) | {1e3 * read:.1f} |", flush=True)
        print("\nload average after: %.2f %.2f %.2f" % os.getloadavg())
        if args.rss_rows:
            size, before, peak, seconds = peak_rss(args.rss_rows, folder)
            print(f"\npeak RSS of a shuffled 1-epoch fit on {args.rss_rows} rows ({size / 1e6:.0f} MB of Parquet, "
                  f"{args.rss_rows * 404 / 1e6:.0f} MB as float32): {peak / 1e6:.0f} MB in all, {before / 1e6:.0f} MB "
                  f"before the fit (libraries, sessions), in {seconds:.1f} s")


if __name__ == "__main__":
    main()
