"""Timing in rounds: competitors take turns, each timed block after a pause and one untimed epoch, and
between two blocks of onnxopt's.

ORT's and torch's worker threads keep spinning for tens of ms after a run and slow whoever runs next, so
a block starts after ``PAUSE`` seconds and one untimed epoch; a competitor's time is its median µs/step
over rounds, and a ratio to onnxopt's the median over rounds of its block over onnxopt's around it.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time

import numpy as np

from onnxopt.bench.competitors import Competitor, Skipped
from onnxopt.bench.workloads import Workload

__all__ = ["Result", "run_workload"]

PAUSE = 0.05


@dataclasses.dataclass
class Result:
    """One competitor on one workload; ``skipped`` holds the reason when it did not run."""

    workload: str
    competitor: str
    us_per_step: float | None = None
    block_us: list[float] = dataclasses.field(default_factory=list)
    ref_us: list[float] = dataclasses.field(default_factory=list)  # onnxopt's µs/step around each block
    losses: list[float] = dataclasses.field(default_factory=list)  # every step (or epoch mean), in order
    per_epoch: int = 1  # entries of ``losses`` per epoch
    session_runs: float | None = None
    nodes: int | None = None
    note: str = ""
    skipped: str = ""
    reference: bool = False  # a plain matmul timed with the trainers (W3, W5), no loss

    @property
    def final_loss(self) -> float | None:
        """Mean loss over the last epoch."""
        return float(np.mean(self.losses[-self.per_epoch:])) if self.losses else None

    def epoch_means(self) -> np.ndarray:
        return np.asarray(self.losses, np.float64).reshape(-1, self.per_epoch).mean(axis=1)


def run_workload(wl: Workload, competitors: list[type[Competitor]], rounds: int, epochs: int | None = None,
                 log=print) -> list[Result]:
    """Sets every competitor up on ``wl`` (same data, same initial weights), then times them in rounds.

    The first competitor (onnxopt) runs a block before the first other one and after each: every other
    block is timed between two of onnxopt's, whose mean is kept beside it (``Result.ref_us``), since this
    machine's speed moves by up to 2x over seconds. onnxopt's extra epochs stay out of its loss curve,
    which has the others' length.
    """
    X, y = wl.data()
    from onnxopt import train_initializers

    weights = train_initializers(wl.model())
    epochs = epochs or wl.epochs
    results, live = [], []
    for cls in competitors:
        comp = cls()
        res = Result(wl.name, cls.name, reference=getattr(cls, "reference", False))
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

    def block(comp, res) -> float:
        time.sleep(PAUSE)
        res.losses += comp.epoch()  # NOTE: untimed warm-up epoch after the pause
        t0 = time.perf_counter()
        for _ in range(epochs):
            res.losses += comp.epoch()
        us = (time.perf_counter() - t0) / (epochs * wl.steps) * 1e6
        res.block_us.append(us)
        return us

    if not live:
        return results
    first, others = live[0], live[1:]
    length = (1 + rounds * (1 + epochs)) * first[1].per_epoch
    for _ in range(rounds):
        before = block(*first)
        for comp, res in others:
            block(comp, res)
            after = block(*first)
            res.ref_us.append((before + after) / 2)
            before = after
    del first[1].losses[length:]  # NOTE: the same epochs as every other competitor
    for comp, res in live:
        res.us_per_step = statistics.median(res.block_us)
        res.session_runs, res.nodes, res.note = comp.session_runs, comp.nodes, comp.note
        log(f"  {wl.name}: {res.competitor:<18} {res.us_per_step:10.1f} us/step"
            + ("" if res.reference else f"  final loss {res.final_loss:.5g}"))
    return results
