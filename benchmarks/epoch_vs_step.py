"""Runner.epoch (an epoch's batches in one session run: an ONNX Scan) against one Runner.step per batch,
A/B in one process.

Two runners on the same step alternate, each after a 50 ms pause and an untimed epoch, and time a block of
epochs; the ratio is the median of the paired ratios (the pairing absorbs the machine's drift, which moves
the medians of separate runs by ±30% on a shared 2-core VM). Time is the thread's CPU time: ORT runs on it
at one thread. The two runners must end with the same weights, bit for bit.

    python benchmarks/epoch_vs_step.py W1-sgd W1-nesterov W1-adam W2 W4 [--rounds 11]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import onnxopt
from onnxopt.bench.competitors import _onnxopt_update
from onnxopt.bench.workloads import WORKLOADS


def compare(name: str, rounds: int) -> tuple[float, float, float]:
    """(µs per step with epoch, with step, median of paired ratios epoch / step)."""
    wl = WORKLOADS[name]
    X, y = wl.data()
    step = onnxopt.compile_train_step(wl.model(), loss=wl.loss, update=_onnxopt_update(wl.update), learning_rate=wl.lr)
    looped, stepped = onnxopt.Runner(step, batch_size=wl.batch), onnxopt.Runner(step, batch_size=wl.batch)
    batches = [(X[i:i + wl.batch], y[i:i + wl.batch]) for i in range(0, wl.n, wl.batch)]

    def by_epoch():
        looped.epoch(X, y)

    def by_step():
        for xb, yb in batches:
            stepped.step(xb, yb, read_loss=False)
        stepped.sync()

    block = max(1, 2000 // len(batches))
    times = {by_epoch: [], by_step: []}
    for _ in range(rounds):
        for run, out in times.items():
            time.sleep(0.05)
            run()
            t0 = time.thread_time()
            for _ in range(block):
                run()
            out.append((time.thread_time() - t0) / (block * len(batches)) * 1e6)
    for name_, w in looped.get_weights().items():
        np.testing.assert_array_equal(w, stepped.get_weights()[name_], err_msg=name_)
    a, b = times[by_epoch], times[by_step]
    return statistics.median(a), statistics.median(b), statistics.median(x / y for x, y in zip(a, b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workloads", nargs="+")
    p.add_argument("--rounds", type=int, default=11)
    args = p.parse_args()
    for name in args.workloads:
        e, s, r = compare(name, args.rounds)
        print(f"{name}: epoch {e:.1f} us/step, step {s:.1f} us/step, epoch / step {r:.2f}")


if __name__ == "__main__":
    main()
