"""Timing in rounds: competitors take turns, each timed block after a pause and one untimed epoch.

ORT's and torch's worker threads keep spinning for tens of ms after a run and slow whoever runs next, so
a block starts after ``PAUSE`` seconds and one untimed epoch; the result is the median µs/step over rounds.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time

import numpy as np

from onnxopt.bench.competitors import Competitor, Skipped
from onnxopt.bench.workloads import Workload

__all__ = ["Result", "run_workload", "sgemm_gflops", "rss"]

PAUSE = 0.05


@dataclasses.dataclass
class Result:
    """One competitor on one workload; ``skipped`` holds the reason when it did not run."""

    workload: str
    competitor: str
    us_per_step: float | None = None
    block_us: list[float] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)  # every step (or epoch mean), in order
    per_epoch: int = 1  # entries of ``losses`` per epoch
    session_runs: float | None = None
    nodes: int | None = None
    rss_mb: float | None = None
    note: str = ""
    skipped: str = ""

    @property
    def final_loss(self) -> float | None:
        """Mean loss over the last epoch."""
        return float(np.mean(self.losses[-self.per_epoch:])) if self.losses else None

    def epoch_means(self) -> np.ndarray:
        return np.asarray(self.losses, np.float64).reshape(-1, self.per_epoch).mean(axis=1)


def rss() -> float | None:
    """Resident memory of this process in MB (None without psutil)."""
    try:
        import psutil
    except ImportError:
        return None
    return psutil.Process().memory_info().rss / 2**20


def run_workload(wl: Workload, competitors: list[type[Competitor]], rounds: int, epochs: int | None = None,
                 log=print) -> list[Result]:
    """Sets every competitor up on ``wl`` (same data, same initial weights), then times them in rounds."""
    X, y = wl.data()
    from onnxopt import train_initializers

    weights = train_initializers(wl.model())
    epochs = epochs or wl.epochs
    results, live = [], []
    for cls in competitors:
        comp = cls()
        res = Result(wl.name, cls.name)
        gc.collect()
        before = rss()
        try:
            comp.setup(wl, X, y, {k: v.copy() for k, v in weights.items()})
        except Skipped as exc:
            res.skipped = str(exc)
            log(f"  {wl.name}: {cls.name} skipped: {exc}")
        else:
            res.losses += comp.epoch()  # NOTE: the first epoch also sizes buffers, so RSS is read after it
            after = rss()
            before = getattr(comp, "rss_before", before)
            res.rss_mb = None if before is None else after - before
            res.per_epoch = len(res.losses)
            live.append((comp, res))
        results.append(res)
    for _ in range(rounds):
        for comp, res in live:
            time.sleep(PAUSE)
            res.losses += comp.epoch()  # NOTE: untimed warm-up epoch after the pause
            t0 = time.perf_counter()
            for _ in range(epochs):
                res.losses += comp.epoch()
            res.block_us.append((time.perf_counter() - t0) / (epochs * wl.steps) * 1e6)
    for comp, res in live:
        res.us_per_step = statistics.median(res.block_us)
        res.session_runs, res.nodes, res.note = comp.session_runs, comp.nodes, comp.note
        log(f"  {wl.name}: {res.competitor:<14} {res.us_per_step:10.1f} us/step  final loss {res.final_loss:.5g}")
    return results


def sgemm_gflops(m: int, k: int, n: int, threads: int, repeat: int = 20) -> float:
    """GFLOP/s of a plain numpy float32 matmul (m, k) @ (k, n) on ``threads`` BLAS threads, best of ``repeat``."""
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    a = rng.normal(size=(m, k)).astype(np.float32)
    b = rng.normal(size=(k, n)).astype(np.float32)
    best = float("inf")
    with threadpool_limits(threads):
        a @ b
        for _ in range(repeat):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    return 2.0 * m * k * n / best / 1e9
