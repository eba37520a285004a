"""Data-parallel scaling on this machine: W3 and W5 with 1 and 2 gloo ranks at one thread each.

For each workload, alternating ``--rounds`` times: one process with ``Runner`` (the fused step, 1 thread), then
``DataParallelRunner`` on 1 rank and on 2 ranks (processes started here, gloo on 127.0.0.1, 1 thread each), each
timing ``--epochs`` epochs of the workload's data after one untimed epoch. Reported: samples/s (median over the
rounds), the 2-rank / 1-process ratio (target >= 1.7), and the all-reduce's share of a rank's step time, both
as measured in the epochs (waits for the other rank included) and for 20 all-reduces of the same buffer alone;
the rest of a 2-rank step (its half batch's gradients and the update, both cores busy) against a 1-process step
is the floor the all-reduce sits on.

    python benchmarks/distributed.py W3 W5 [--epochs 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np
import onnxruntime as ort

import onnxopt
from onnxopt import distributed
from onnxopt.bench.competitors import _onnxopt_update
from onnxopt.bench.workloads import WORKLOADS


def _options() -> ort.SessionOptions:
    opts = onnxopt.runner.default_session_options(1)  # NOTE: one thread, whatever the size
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    return opts


def _timed(epoch, epochs: int) -> float:
    """Seconds of ``epochs`` epochs after an untimed one."""
    epoch()
    t0 = time.perf_counter()
    for _ in range(epochs):
        epoch()
    return time.perf_counter() - t0


def single(name: str, epochs: int) -> float:
    """Samples/s of one process, fused step, 1 thread."""
    wl = WORKLOADS[name]
    X, y = wl.data()
    step = onnxopt.compile_train_step(wl.model(), loss=wl.loss, update=_onnxopt_update(wl.update), learning_rate=wl.lr)
    runner = onnxopt.Runner(step, batch_size=wl.batch, session_options=_options())
    return wl.n * epochs / _timed(lambda: runner.epoch(X, y), epochs)


def rank(name: str, epochs: int) -> None:
    """One rank (RANK/WORLD_SIZE set): prints JSON {samples/s, all-reduce seconds, seconds, all-reduce alone}."""
    wl = WORKLOADS[name]
    X, y = wl.data()
    steps = distributed.split_step(wl.model(), loss=wl.loss, update=_onnxopt_update(wl.update), learning_rate=wl.lr)
    runner = distributed.DataParallelRunner(*steps, batch_size=wl.batch, session_options=_options())
    spent, dist = [0.0], runner._dist
    if dist is not None:
        reduce = dist.all_reduce

        def timed_reduce(tensor):
            t0 = time.perf_counter()
            reduce(tensor)
            spent[0] += time.perf_counter() - t0

        runner._dist = type("Timed", (), {"all_reduce": staticmethod(timed_reduce),
                                          "all_gather_object": runner._dist.all_gather_object})
    runner.epoch(X, y)
    spent[0] = 0.0
    seconds = _timed(lambda: runner.epoch(X, y), epochs)
    alone = 0.0
    if dist is not None:  # NOTE: the same all-reduce with no step around it: its own cost
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(20):
            dist.all_reduce(runner._tensor)
        alone = (time.perf_counter() - t0) / 20
    print(json.dumps({"samples_s": wl.n * epochs / seconds, "allreduce_s": spent[0], "seconds": seconds,
                      "alone_s": alone, "steps": wl.steps * epochs}))


def ranks(name: str, n: int, epochs: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", name, "--epochs", str(epochs)],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True) for r in range(n)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{name}: a rank failed: {[p.returncode for p in procs]}")
    return json.loads(outs[0].strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="*", default=["W3", "W5"])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        return rank(args.rank, args.epochs)
    print("| workload | 1 process (samples/s) | 1 rank | 2 ranks | 2 ranks / 1 process | all-reduce share (2 ranks) "
          "| all-reduce alone (ms) / step (ms) | rest of a 2-rank step (ms) / 1-process step (ms) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    med = statistics.median
    for name in args.workloads:
        rows = []
        for _ in range(args.rounds):
            one, r1, two = single(name, args.epochs), ranks(name, 1, args.epochs), ranks(name, 2, args.epochs)
            rows.append((one, r1["samples_s"], two["samples_s"], two["allreduce_s"] / two["seconds"],
                         1e3 * two["alone_s"], 1e3 * two["seconds"] / two["steps"],
                         1e3 * (two["seconds"] - two["allreduce_s"]) / two["steps"], 1e3 * WORKLOADS[name].batch / one))
        one, r1, r2, share, alone, step, rest, single_step = (med(col) for col in zip(*rows))
        print(f"| {name} | {one:.0f} | {r1:.0f} | {r2:.0f} | {r2 / one:.2f} (rounds "
              f"{', '.join(f'{r[2] / r[0]:.2f}' for r in rows)}) | {100 * share:.0f}% | {alone:.1f} / {step:.1f} "
              f"| {rest:.1f} / {single_step:.1f} |", flush=True)

if __name__ == "__main__":
    main()
