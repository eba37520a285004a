"""Per-step time of onnxopt's npm package in Node (onnxruntime-node) against the Python Runner on W1 and W3.

Both train the same step file (``onnxopt.compile_train_step(..., portable=True)`` then ``ship.for_js``) on the
workload's data: ``step()`` over the batches of an epoch, and ``epoch()`` (the Scan form where the Runner uses it).
Turns alternate (Python block, pause, Node block, pause, Node on the unpacked step, pause); the table gives the
median over turns of ms per step and the ratio Node / Python; "unpacked" is the StepRunner on the step as saved
(``packed: false``: one input and output per carried tensor, the model before ``runner.cpu_model``). Each block
runs as many epochs as take Python about ``--seconds`` (steady state: 200 steps of W1 left V8's compiler and the
allocator warming up). "session.run alone" is onnxruntime-node's ``InferenceSession.run`` on the session and
feeds ``step()`` uses for one full batch (the packed model, specialized for the batch length), nothing of the
StepRunner around it: the floor a JS runner on this binding starts from. Needs node and js/node_modules (cd js && ONNXRUNTIME_NODE_INSTALL=skip npm ci).

    python benchmarks/js/node_vs_python.py [--turns 5] [--workloads W1-sgd W1-adam W3]
"""

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

import onnxopt
from onnxopt.bench.workloads import select
from onnxopt.ship import for_js

JS = Path(__file__).resolve().parents[2] / "js"


def calibrate(path, X, y, batch, seconds):
    """Epochs a block runs: about ``seconds`` of Python's ``step()``."""
    runner = onnxopt.Runner(path, batch_size=batch)
    runner.epoch(X, y)
    t = time.perf_counter()
    runner.epoch(X, y)
    return max(1, round(seconds / (time.perf_counter() - t)))


def python_block(path, X, y, batch, epochs):
    runner = onnxopt.Runner(path, batch_size=batch)
    batches = [(X[i:i + batch], y[i:i + batch]) for i in range(0, len(X), batch)]
    for xb, yb in batches:
        runner.step(xb, yb)
    runner.epoch(X, y)
    time.sleep(0.2)
    t = time.perf_counter()
    for _ in range(epochs):
        for xb, yb in batches:
            runner.step(xb, yb)
    step_ms = (time.perf_counter() - t) * 1e3 / (epochs * len(batches))
    time.sleep(0.2)
    t = time.perf_counter()
    for _ in range(epochs):
        runner.epoch(X, y)
    return step_ms, (time.perf_counter() - t) * 1e3 / (epochs * len(batches))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--workloads", nargs="+", default=["W1-sgd", "W1-adam", "W3"])
    parser.add_argument("--seconds", type=float, default=0.5, help="Python's time a block, about")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for w in select(args.workloads):
            X, y = w.data()
            step = onnxopt.compile_train_step(w.model(), loss=w.loss, update=w.update, learning_rate=w.lr,
                                              portable=True)
            path = Path(tmp) / f"{w.name}.onnx"
            for_js(step, batch_size=w.batch).save(path)
            X.tofile(Path(tmp) / "X.bin")
            y.tofile(Path(tmp) / "y.bin")
            epochs = calibrate(path, X, y, w.batch, args.seconds)
            py, node, unpacked = [], [], []
            for _ in range(args.turns):
                py.append(python_block(path, X, y, w.batch, epochs))
                time.sleep(0.5)
                for form, times in (("packed", node), ("unpacked", unpacked)):
                    out = subprocess.run(["node", "../benchmarks/js/node_steps.mjs", str(path), str(Path(tmp) / "X.bin"),
                                          str(Path(tmp) / "y.bin"), ",".join(map(str, X.shape)), y.dtype.name,
                                          str(w.batch), str(epochs), form], cwd=JS, capture_output=True, text=True,
                                         check=True)
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    times.append((r["step_ms"], r["epoch_ms"], r["run_ms"]))
                    time.sleep(0.5)
            med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
            # NOTE: ratios are medians of each turn's ratio (turns are paired), times medians over turns
            ratio = lambda xs, k, py=py, j=None: statistics.median(a[k] / b[k if j is None else j] for a, b in zip(xs, py))  # noqa: E731
            rows.append((w.name, w.batch, med(py, 0), med(node, 0), ratio(node, 0), med(unpacked, 0),
                         ratio(unpacked, 0), med(node, 2), ratio(node, 2, j=0), med(py, 1), med(node, 1), ratio(node, 1)))
    print("| workload | batch | Python step() ms | Node step() ms | ratio | Node unpacked step() ms | ratio | "
          "Node session.run alone ms | ratio | Python epoch() ms/step | Node epoch() ms/step | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, batch, ps, ns, nr, us, ur, rs, rr, pe, ne, er in rows:
        print(f"| {name} | {batch} | {ps:.4f} | {ns:.4f} | {nr:.2f} | {us:.4f} | {ur:.2f} | {rs:.4f} | {rr:.2f} | "
              f"{pe:.4f} | {ne:.4f} | {er:.2f} |")


if __name__ == "__main__":
    main()
