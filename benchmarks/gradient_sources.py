"""The step compiled with onnxopt's own gradient rules against the step from onnxruntime-training's builder.

For each workload: kernels onnxruntime runs per step (``ort_kernels`` of the Runner's CPU model), compile time,
and the time of one epoch of ``Runner.step`` calls, both steps timed in alternating turns after a pause (ORT's
threads spin ~35 ms after a run), median of the turns. Needs the training build (Python <= 3.12).

    python benchmarks/gradient_sources.py [W1 W3 ...] [--turns 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import onnxopt
from onnxopt.bench.competitors import _onnxopt_update, ort_kernels, runner_model
from onnxopt.bench.workloads import select

SOURCES = ("onnxopt", "builder")


def _setup(wl, gradient: str):
    start = time.perf_counter()
    step = onnxopt.compile_train_step(wl.model(), loss=wl.loss, update=_onnxopt_update(wl.update),
                                      learning_rate=wl.lr, gradient=gradient)
    compiled = time.perf_counter() - start
    return step, compiled, ort_kernels(runner_model(step, wl.batch, wl.threads), wl.threads)


def measure(name: str, turns: int) -> dict:
    wl = select([name])[0]
    X, y = wl.data()
    batches = [(X[i:i + wl.batch], y[i:i + wl.batch]) for i in range(0, len(X), wl.batch)]
    row = {}
    runners = {}
    for g in SOURCES:
        step, compiled, kernels = _setup(wl, g)
        runners[g] = onnxopt.Runner(step, batch_size=wl.batch)
        row[g] = {"compile_s": compiled, "kernels": kernels, "epoch_s": []}
    for _ in range(turns):
        for g in SOURCES:
            time.sleep(0.1)
            start = time.perf_counter()
            for xb, yb in batches:
                runners[g].step(xb, yb, read_loss=False)
            runners[g].sync()
            row[g]["epoch_s"].append(time.perf_counter() - start)
    for g in SOURCES:
        row[g]["epoch_s"] = statistics.median(row[g]["epoch_s"])
    row["ratio"] = row["onnxopt"]["epoch_s"] / row["builder"]["epoch_s"]
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", default=["W1-sgd", "W2", "W3", "W4", "W5", "batch-4096"])
    parser.add_argument("--turns", type=int, default=7)
    args = parser.parse_args(argv)
    print("| workload | kernels onnxopt / builder | compile s onnxopt / builder | epoch s onnxopt / builder "
          "| onnxopt / builder |")
    print("| --- | --- | --- | --- | --- |")
    for name in args.workloads:
        r = measure(name, args.turns)
        o, b = r["onnxopt"], r["builder"]
        print(f"| {name} | {o['kernels']} / {b['kernels']} | {o['compile_s']:.2f} / {b['compile_s']:.2f} "
              f"| {o['epoch_s']:.4f} / {b['epoch_s']:.4f} | {r['ratio']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
