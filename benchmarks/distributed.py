"""Data-parallel scaling on this machine: W3 and W5, 2 gloo ranks against the machine's capacity for two.

For each workload, alternating ``--rounds`` times: one process with ``Runner`` (the fused step, 1 thread); two
such processes at once, independent (the *capacity*: what 2 cores give two single-threaded trainings); then
``DataParallelRunner`` on 2 ranks (processes started here, 1 thread each): over shm given the fused step (mode
"weights": each rank runs the fused step on its rows and the ranks average weights and state, for the workloads'
SGD-family updates) and without it (mode "gradients": the gradient step, the shared-memory all-reduce of the
gradients, the update), over gloo (TCP loopback; also with the gradient step split in 2 pieces, the first
piece's all-reduce overlapping the second) and with ``--sync-every`` K micro-batches per update over shm. Each
times ``--epochs`` epochs after one untimed epoch; the global batch is the workload's (K times it per update with
accumulation). Reported: samples/s (median over the rounds), 2 ranks / capacity (targets: >= 0.7 on W3, >= 0.8
on W5) and / 1 process, the all-reduce's share of a rank's step (waits for the other rank included; mode
"gradients"), and the load average at the start and the end (the machine may be shared).

    python benchmarks/distributed.py W3 W5 [--epochs 3] [--rounds 3] [--sync-every 4] [--paper] [--quick]
    python benchmarks/distributed.py W3 W5 --bound   (what bounds 2 ranks: CPU time a step, ``bound``)

``--paper`` prints instead the model on paper (``paper``), calibrated by one process's step on this machine.
"""

from __future__ import annotations

import argparse
import json
import math
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


def rank(name: str, epochs: int, transport: str, sync_every: int, buckets: int = 1, fused: bool = False) -> None:
    """One rank (RANK/WORLD_SIZE set): prints JSON {samples/s, all-reduce seconds, seconds, all-reduce alone}."""
    wl = WORKLOADS[name]
    X, y = wl.data()
    kw = dict(loss=wl.loss, update=_onnxopt_update(wl.update), learning_rate=wl.lr)
    steps = distributed.split_step(wl.model(), **kw)
    rows = wl.batch * sync_every
    runner = distributed.DataParallelRunner(*steps, batch_size=rows, session_options=_options(), transport=transport,
                                            sync_every=sync_every, buckets=buckets,
                                            fused=onnxopt.compile_train_step(wl.model(), **kw) if fused else None)
    spent, reducer = [0.0], runner._reducer
    reduce = None if reducer is None or runner.reduces == "weights" else reducer.reduce
    if reduce is not None and not runner._pieces:  # NOTE: split, the all-reduce overlaps the pieces: not timed

        def timed_reduce():
            t0 = time.perf_counter()
            reduce()
            spent[0] += time.perf_counter() - t0

        reducer.reduce = timed_reduce
    runner.epoch(X, y, batch_size=rows)
    spent[0] = 0.0
    seconds = _timed(lambda: runner.epoch(X, y, batch_size=rows), epochs)
    alone = math.nan
    if reduce is not None:  # NOTE: the same all-reduce with no step around it: its own cost
        runner._dist.barrier()
        t0 = time.perf_counter()
        for _ in range(20):
            reduce()
        alone = (time.perf_counter() - t0) / 20
    print(json.dumps({"samples_s": wl.n * epochs / seconds, "allreduce_s": spent[0], "seconds": seconds,
                      "alone_s": alone, "updates": -(-wl.n // rows) * epochs, "transport": runner.transport,
                      "reduces": runner.reduces}))


def _spawn(args: list[str], n: int, env: dict) -> list[str]:
    procs = [subprocess.Popen([sys.executable, __file__, *args], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              text=True) for r in range(n)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{args}: a process failed: {[p.returncode for p in procs]}")
    return [o.strip().splitlines()[-1] for o in outs]


def ranks(name: str, n: int, epochs: int, transport: str, sync_every: int = 1, buckets: int = 1,
          fused: bool = False) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    out = _spawn(["--rank", name, "--epochs", str(epochs), "--transport", transport, "--sync-every",
                  str(sync_every), "--buckets", str(buckets), *(["--fused"] if fused else [])], n, env)
    return json.loads(out[0])


def capacity(name: str, epochs: int) -> float:
    """Samples/s of two independent single-threaded processes running at once, summed."""
    out = _spawn(["--single", name, "--epochs", str(epochs)], 2, {**os.environ, "OMP_NUM_THREADS": "1"})
    return sum(float(o) for o in out)


def bound(name: str) -> None:
    """CPU time a step (``time.process_time``, 1 thread, best of 3 runs of 30 steps: load matters less than to wall
    time) of the fused step on the batch and on half of it, and of a rank's split step on half of it (its gradient
    step alone, then its update alone): in mode "gradients" 2 ranks reach at most fused(B) / (2 · split(B/2)) of the
    capacity, the all-reduce costing nothing; in mode "weights" fused(B) / (2 · (fused(B/2) + averaging)), the
    averaging being a rank's shard of the two ranks' sets (``_SharedSets.average``), the barriers free."""
    wl = WORKLOADS[name]
    X, y = wl.data()
    kw = dict(loss=wl.loss, update=_onnxopt_update(wl.update), learning_rate=wl.lr)
    fused, steps = onnxopt.compile_train_step(wl.model(), **kw), distributed.split_step(wl.model(), **kw)

    def cpu(run, rows: int) -> float:
        batches = [(X[i:i + rows], y[i:i + rows]) for i in range(0, min(len(X), 30 * rows), rows)]
        run(*batches[0])
        times = []
        for _ in range(3):
            t0 = time.process_time()
            for xb, yb in batches:
                run(xb, yb)
            times.append((time.process_time() - t0) / len(batches))
        return 1e3 * min(times)

    half = wl.batch // 2
    ms = {f"fused, {rows} rows": cpu(onnxopt.Runner(fused, batch_size=rows, session_options=_options()).step, rows)
          for rows in (wl.batch, half)}
    ring = onnxopt.Runner(fused, batch_size=half, session_options=_options())._ring
    size = sum(a.size for a in ring.hosts[0] if a.dtype == ring.dtype)
    shared = distributed._SharedSets(None, 0, 2, ring.dtype)  # NOTE: rank 0's averaging, on private sets
    shared._sets, shared._barrier = np.random.default_rng(0).random((3, 2, size)).astype(ring.dtype), lambda: None
    average = lambda *_: shared.average(1, [0.5, 0.5])  # noqa: E731
    ms["averaging weights and state"] = cpu(average, half)
    rank = distributed.DataParallelRunner(*steps, batch_size=half, session_options=_options())
    ms[f"rank's split step, {half} rows"] = cpu(rank.step, half)
    binding = rank._binding(False)
    for key, value in ((rank.roles.data[0], X[:half]), (rank.roles.target, y[:half]),
                       (rank.roles.sample_weight, np.ones(half, rank.dtype))):
        binding.bind_cpu_input(key, np.ascontiguousarray(value))
    ms["of which the gradient step alone"] = cpu(lambda *_: rank.session.run_with_iobinding(binding), half)
    ms["of which the update step alone"] = cpu(lambda *_: rank._apply(), half)
    print(f"\n| {name}: CPU ms a step, 1 thread (load {os.getloadavg()[0]:.1f}) | ms |\n| --- | --- |")
    for key, value in ms.items():
        print(f"| {key} | {value:.2f} |")
    ratio = ms[f"fused, {wl.batch} rows"] / 2 / ms[f"rank's split step, {half} rows"]
    print(f"| bound on 2 ranks / capacity, mode gradients (free all-reduce) | {ratio:.2f} |")
    ratio = ms[f"fused, {wl.batch} rows"] / 2 / (ms[f"fused, {half} rows"] + ms["averaging weights and state"])
    print(f"| bound on 2 ranks / capacity, mode weights (free barrier) | {ratio:.2f} |")


LINKS = {"10 Gb/s": (10e9 / 8, 50e-6), "100 Gb/s": (100e9 / 8, 10e-6)}  # NOTE: (bytes/s, latency of a message)


def ring(ranks: int, nbytes: float, link: tuple[float, float]) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``ranks`` on ``link``: 2(N-1) messages of nbytes/N each."""
    bandwidth, latency = link
    return 2 * (ranks - 1) * (nbytes / ranks / bandwidth + latency)


def paper(name: str, step_s: float, sync_every: int) -> None:
    """The model on paper: a rank's step = ``step_s`` (one process's step on this machine, the workload's batch
    per rank) + a ring all-reduce of the gradients; printed as the efficiency step_s / (step_s + all-reduce)
    (the ranks' throughput against as many independent processes) for float32, bf16 and sync every K."""
    nbytes = 4 * (WORKLOADS[name].n_parameters + 1)
    print(f"\n{name}: {nbytes / 1e6:.1f} MB of gradients, a step of {1e3 * step_s:.1f} ms (1 thread, batch "
          f"{WORKLOADS[name].batch} a rank); efficiency = step / (step + all-reduce), no overlap")
    print(f"| ranks | {' | '.join(f'{k} fp32 | {k} bf16 | {k} fp32, sync every {sync_every}' for k in LINKS)} |")
    print("| --- " * (1 + 3 * len(LINKS)) + "|")
    for n in (2, 4, 8, 16, 32, 64):
        cells = []
        for link in LINKS.values():
            fp32, bf16 = ring(n, nbytes, link), ring(n, nbytes / 2, link)
            cells += [step_s / (step_s + t) for t in (fp32, bf16, fp32 / sync_every)]
        print(f"| {n} | {' | '.join(f'{c:.2f}' for c in cells)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="*", default=["W3", "W5"])
    parser.add_argument("--epochs", type=int, default=3)  # NOTE: 1 (0.3 s a rank) moved rounds by +-0.2
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--paper", action="store_true", help="print the model on paper, calibrated by one process")
    parser.add_argument("--bound", action="store_true", help="print instead what bounds 2 ranks (CPU time a step)")
    parser.add_argument("--quick", action="store_true",
                        help="only shm (both modes) and gloo in 2 pieces (the others: nan)")
    parser.add_argument("--rank", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--single", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--transport", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--buckets", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--fused", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        return rank(args.rank, args.epochs, args.transport, args.sync_every, args.buckets, args.fused)
    if args.single:
        return print(single(args.single, args.epochs))
    k = args.sync_every
    if args.bound:
        for name in args.workloads:
            bound(name)
        return None
    if args.paper:
        for name in args.workloads:
            paper(name, WORKLOADS[name].batch / single(name, args.epochs), k)
        return None
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    print(f"| workload | 1 process (samples/s) | capacity: 2 processes | 2 ranks shm | 2 ranks shm, gradients "
          f"| 2 ranks gloo | 2 ranks gloo, step in 2 pieces | 2 ranks shm, sync every {k} | shm / capacity | shm gradients / "
          f"capacity | gloo / capacity | gloo 2 pieces / capacity | shm K={k} / capacity | shm / 1 process | "
          "all-reduce share: shm gradients, gloo | all-reduce alone (ms): shm, gloo |")
    print("| --- " * 16 + "|")
    med = statistics.median
    for name in args.workloads:
        rows = []
        for _ in range(args.rounds):
            one, cap = single(name, args.epochs), capacity(name, args.epochs)
            skipped = {"samples_s": math.nan, "allreduce_s": math.nan, "seconds": 1.0, "alone_s": math.nan}
            shm, grads = ranks(name, 2, args.epochs, "shm", fused=True), ranks(name, 2, args.epochs, "shm")
            split = ranks(name, 2, args.epochs, "gloo", 1, 2)
            gloo = skipped if args.quick else ranks(name, 2, args.epochs, "gloo")
            acc = skipped if args.quick else ranks(name, 2, args.epochs, "shm", k)
            rows.append((one, cap, shm["samples_s"], grads["samples_s"], gloo["samples_s"], split["samples_s"],
                         acc["samples_s"], grads["allreduce_s"] / grads["seconds"],
                         gloo["allreduce_s"] / gloo["seconds"],
                         1e3 * grads["alone_s"], 1e3 * gloo["alone_s"]))
            print("  round:", " ".join(f"{v:.3g}" for v in rows[-1]), f"load {os.getloadavg()[0]:.2f}, shm mode "
                  f"{shm['reduces']!r}", flush=True)
        one, cap, shm, grads, gloo, split, acc, s_share, g_share, s_alone, g_alone = (med(col) for col in zip(*rows))
        print(f"| {name} | {one:.0f} | {cap:.0f} | {shm:.0f} | {grads:.0f} | {gloo:.0f} | {split:.0f} | {acc:.0f} | "
              f"{shm / cap:.2f} (rounds {', '.join(f'{r[2] / r[1]:.2f}' for r in rows)}) | {grads / cap:.2f} (rounds "
              f"{', '.join(f'{r[3] / r[1]:.2f}' for r in rows)}) | {gloo / cap:.2f} | {split / cap:.2f} | "
              f"{acc / cap:.2f} | "
              f"{shm / one:.2f} | {100 * s_share:.0f}%, {100 * g_share:.0f}% | {s_alone:.2f}, {g_alone:.2f} |",
              flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
