"""Soak test: many training steps of the seed MLP through ``Runner``; memory must stay flat, OrtValues not leak.

Workload: 100-50-10-1 ReLU MLP, batch 15, 750 samples cycled, SGD, float32 (the seeds' benchmark model).
RSS (psutil) is sampled every ``--every`` steps; the baseline is the sample after the warm-up (the first
``--warmup`` steps fill ORT's arena and Python's caches), growth = (last − baseline) / baseline. Leak checks:
live ``OrtValue`` objects counted by ``gc`` before and after, and the OrtValues the runner holds must be the
same objects at the end as after the warm-up (buffers reused, never re-created).

    python benchmarks/soak.py [--steps 200000] [--every 10000] [--warmup 10000]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time

import numpy as np
import onnxruntime as ort
import psutil

import onnxopt
from onnxopt.examples import mlp

SIZES, BATCH, N = [100, 50, 10, 1], 15, 750


def _ortvalues(obj, seen=None, depth=0) -> set[int]:
    """ids of every OrtValue (Python wrapper) reachable from ``obj`` through dicts, lists, tuples and attributes
    (of onnxopt's objects: the Runner and its parts, ``ring.BufferRing``, ``sessions.StepSessions``...)."""
    seen = set() if seen is None else seen
    found: set[int] = set()
    if id(obj) in seen or depth > 4:
        return found
    seen.add(id(obj))
    if isinstance(obj, ort.OrtValue):
        return {id(obj)}
    children = []
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    elif type(obj).__module__.startswith("onnxopt.") and hasattr(obj, "__dict__"):  # NOTE: the Runner and its parts
        children = list(vars(obj).values())
    for child in children:
        found |= _ortvalues(child, seen, depth + 1)
    return found


def _live_ortvalues() -> int:
    gc.collect()
    return sum(type(o) is ort.OrtValue for o in gc.get_objects())


def soak(steps: int = 200_000, every: int = 10_000, warmup: int = 10_000, seed: int = 0) -> dict:
    """Runs ``steps`` steps and returns the measurements (RSS samples in MiB, growth %, OrtValue counts)."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(N, SIZES[0])).astype(np.float32)
    y = (X[:, :10].sum(axis=1) / 3).astype(np.float32)
    runner = onnxopt.Runner(onnxopt.compile_train_step(mlp(SIZES), loss="square", update="sgd",
                                                       learning_rate=1e-3))
    proc = psutil.Process(os.getpid())
    rss_start = proc.memory_info().rss / 2**20
    samples: list[tuple[int, float]] = []
    start_live = start_held = None
    losses = []
    t0 = time.perf_counter()
    for k in range(steps):
        i = (k * BATCH) % N
        loss = runner.step(X[i:i + BATCH], y[i:i + BATCH])
        done = k + 1
        if done == warmup:
            start_live, start_held = _live_ortvalues(), _ortvalues(runner)
        if done % every == 0 or done == steps:
            samples.append((done, proc.memory_info().rss / 2**20))
            losses.append(loss)
    seconds = time.perf_counter() - t0
    end_live, end_held = _live_ortvalues(), _ortvalues(runner)
    base = next(rss for done, rss in samples if done >= warmup)
    last = samples[-1][1]
    return {
        "steps": steps, "batch": BATCH, "model": "-".join(map(str, SIZES)), "seconds": round(seconds, 1),
        "us_per_step": round(seconds / steps * 1e6, 1),
        "rss_before_first_step_mib": round(rss_start, 1),
        "rss_mib": [(d, round(r, 1)) for d, r in samples], "rss_baseline_mib": round(base, 1),
        "rss_last_mib": round(last, 1), "rss_peak_mib": round(max(r for _, r in samples), 1),
        "rss_growth_pct": round(100 * (last - base) / base, 2),
        "live_ortvalues_after_warmup": start_live, "live_ortvalues_end": end_live,
        "runner_ortvalues": len(end_held or ()), "runner_ortvalues_same_objects": start_held == end_held,
        "losses": [float(f"{v:.3g}") for v in losses], "finite": bool(np.isfinite(losses).all()),
        "onnxruntime": ort.__version__, "python": platform.python_version(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--every", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=10_000)
    args = parser.parse_args()
    for key, value in soak(args.steps, args.every, args.warmup).items():
        print(f"{key}: {json.dumps(value)}")


if __name__ == "__main__":
    main()
