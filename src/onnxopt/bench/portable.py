"""A portable step on stock onnxruntime against the training build's step, each timed in its own process.

``python -m onnxopt.bench.portable --python PATH/TO/python3.13 --workloads W1 W3 --rounds 5`` compiles both
steps here (training build), then times, in turns, a process per configuration: the training build's step,
the portable step on the other interpreter's onnxruntime, and the portable step on the training build. Each
process runs ``blocks`` timed blocks after an untimed epoch (as ``onnxopt bench``); the result is the median
µs/step over rounds, interleaved so that load from other processes falls on every configuration alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

__all__ = ["time_step", "compare"]


def time_step(path: str, workload: str, blocks: int = 3) -> list[tuple[float, float]]:
    """(wall, CPU) µs per step of the saved step at ``path`` on ``workload``'s data, one pair per timed block.

    CPU time (this process's) leaves out the time other processes hold the cores: on a shared machine it is
    the steadier figure for single-threaded steps (W1, W3 run on one thread).
    """
    import onnxopt
    from onnxopt.bench.workloads import WORKLOADS

    wl = WORKLOADS[workload]
    X, y = wl.data()
    batches = [(X[i:i + wl.batch], y[i:i + wl.batch]) for i in range(0, wl.n, wl.batch)]
    runner = onnxopt.Runner(path, batch_size=wl.batch)

    def epoch():
        for xb, yb in batches:
            runner.step(xb, yb, read_loss=False)
        runner.sync()

    epoch()
    out = []
    steps = wl.epochs * len(batches)
    for _ in range(blocks):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(wl.epochs):
            epoch()
        out.append(((time.perf_counter() - t0) / steps * 1e6, (time.process_time() - c0) / steps * 1e6))
    return out


def compare(workloads: list[str], python: str, rounds: int = 5, blocks: int = 3, log=print) -> dict:
    """{workload: {configuration: (median wall, median CPU) µs/step}} plus the ratios portable (stock) /
    training build of the medians of wall and of CPU time."""
    import onnxopt
    from onnxopt.bench.competitors import _onnxopt_update
    from onnxopt.bench.workloads import select

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for wl in select(workloads):
            paths = {}
            for portable in (False, True):
                step = onnxopt.compile_train_step(wl.model(), loss=wl.loss, update=_onnxopt_update(wl.update),
                                                  learning_rate=wl.lr, portable=portable)
                paths[portable] = os.path.join(tmp, f"{wl.name}-{portable}.onnx")
                step.save(paths[portable])
            configs = {"training build": (sys.executable, paths[False]), "portable, stock": (python, paths[True]),
                       "portable, training build": (sys.executable, paths[True])}
            times: dict[str, list] = {name: [] for name in configs}
            for _ in range(rounds):  # NOTE: configurations take turns, so the machine's load falls on each alike
                for name, (exe, path) in configs.items():
                    out = subprocess.run([exe, "-m", "onnxopt.bench.portable", "--time", path, "--workload", wl.name,
                                          "--blocks", str(blocks)], capture_output=True, text=True, check=True)
                    times[name] += json.loads(out.stdout.strip().splitlines()[-1])
            row = {name: tuple(statistics.median(v[i] for v in values) for i in (0, 1)) for name, values in times.items()}
            row["ratio"] = tuple(row["portable, stock"][i] / row["training build"][i] for i in (0, 1))
            results[wl.name] = row
            log(f"{wl.name}: " + ", ".join(f"{k} {v[0]:.1f} us ({v[1]:.1f} CPU)" for k, v in row.items() if k != "ratio")
                + f"; portable on stock / training build = {row['ratio'][0]:.3f} wall, {row['ratio'][1]:.3f} CPU")
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m onnxopt.bench.portable", description=__doc__.split("\n\n")[0])
    p.add_argument("--python", help="interpreter with stock onnxruntime and onnxopt installed (e.g. .venv313)")
    p.add_argument("--workloads", nargs="+", default=["W1", "W3"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--time", metavar="STEP.onnx", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.time:  # NOTE: the worker: one configuration, its timings as JSON on the last line
        print(json.dumps(time_step(args.time, args.workload, args.blocks)))
        return 0
    if not args.python:
        p.error("--python is required (an interpreter whose onnxruntime is stock, e.g. .venv313/bin/python)")
    compare(args.workloads, args.python, args.rounds, args.blocks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
