"""Timing in rounds: competitors take turns, each timed block after a pause and one untimed epoch.

ORT's and torch's worker threads keep spinning for tens of ms after a run and slow whoever runs next, so
a block starts after ``PAUSE`` seconds and one untimed epoch; the result is the median µs/step over rounds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time

import numpy as np

from onnxopt.bench.competitors import Competitor, Skipped
from onnxopt.bench.workloads import Workload

__all__ = ["Result", "run_workload", "sgemm_gflops"]

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
    note: str = ""
    skipped: str = ""

    @property
    def final_loss(self) -> float | None:
        """Mean loss over the last epoch."""
        return float(np.mean(self.losses[-self.per_epoch:])) if self.losses else None

    def epoch_means(self) -> np.ndarray:
        return np.asarray(self.losses, np.float64).reshape(-1, self.per_epoch).mean(axis=1)


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
        try:
            comp.setup(wl, X, y, {k: v.copy() for k, v in weights.items()})
        except Skipped as exc:
            res.skipped = str(exc)
            log(f"  {wl.name}: {cls.name} skipped: {exc}")
        else:
            res.losses += comp.epoch()
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


def sgemm_gflops(m: int, k: int, n: int, threads: int, repeat: int = 20) -> dict[str, float]:
    """GFLOP/s of a plain float32 matmul (m, k) @ (k, n) on ``threads`` threads, best of ``repeat``.

    Two references: numpy's BLAS (OpenBLAS here) and ORT's own MatMul kernel (MLAS) in a one-node session.
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # NOTE: comes with scikit-learn; without it numpy keeps its own thread count
        threadpool_limits = contextlib.nullcontext
    rng = np.random.default_rng(0)
    a = rng.normal(size=(m, k)).astype(np.float32)
    b = rng.normal(size=(k, n)).astype(np.float32)
    with threadpool_limits(threads):
        numpy_s = _best(lambda: a @ b, repeat)
    sess = _matmul_session(k, n, threads)
    mlas_s = _best(lambda: sess.run(None, {"A": a, "B": b}), repeat)
    flop = 2.0 * m * k * n
    return {"numpy matmul": flop / numpy_s / 1e9, "ORT MatMul (MLAS)": flop / mlas_s / 1e9}


def _best(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _matmul_session(k: int, n: int, threads: int):
    import onnx_ir as ir
    import onnxruntime as ort

    f32 = ir.TensorType(ir.DataType.FLOAT)
    a, b = ir.Value(name="A", type=f32, shape=ir.Shape(["M", k])), ir.Value(name="B", type=f32, shape=ir.Shape([k, n]))
    node = ir.node("MatMul", [a, b])
    node.outputs[0].name, node.outputs[0].type = "Y", f32
    graph = ir.Graph([a, b], node.outputs, nodes=[node], opset_imports={"": 18})
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    model = ir.to_proto(ir.Model(graph, ir_version=10))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
