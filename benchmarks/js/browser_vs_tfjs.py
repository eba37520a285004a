"""onnxopt in Chromium (onnxruntime-web, wasm) against TensorFlow.js (cpu and wasm backends), ms per training step.

The same MLP (W1's 100-50-10-1 with SGD and Adam, W3's 784-512-512-10 with SGD), the same initial weights,
optimizer, learning rate and batches; each step reads its loss. Contenders alternate in turns in one page
(cross-origin isolated); the table gives the median over turns, in ms per step. Needs js/node_modules (npm ci) and Debian's chromium.

    python benchmarks/js/browser_vs_tfjs.py [--turns 3] [--workloads W1-sgd W1-adam W3]
"""

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import onnxopt
from onnxopt.bench.workloads import select
from onnxopt.ship import for_js

HERE = Path(__file__).resolve().parent


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["W1-sgd", "W1-adam", "W3"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        entries = []
        for w in select(args.workloads):
            X, y = w.data()
            step = onnxopt.compile_train_step(w.model(), loss=w.loss, update=w.update, learning_rate=w.lr,
                                              portable=True)
            for_js(step).save(Path(tmp) / f"{w.name}.onnx")
            X.tofile(Path(tmp) / f"{w.name}.X")
            y.tofile(Path(tmp) / f"{w.name}.y")
            entries.append({"name": w.name, "step": f"{w.name}.onnx", "X": f"{w.name}.X", "y": f"{w.name}.y",
                            "sizes": list(w.sizes), "task": w.task, "batch": w.batch, "n": w.n, "update": w.update,
                            "lr": w.lr, "epochs": 1})
        (Path(tmp) / "manifest.json").write_text(json.dumps({"workloads": entries, "turns": args.turns}))
        out = subprocess.run(["node", str(HERE / "browser_driver.mjs")], capture_output=True, text=True, check=True,
                             env={**os.environ, "ONNXOPT_BENCH_DATA": tmp})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"Chromium headless, cross-origin isolated: {result['crossOriginIsolated']}, TensorFlow.js "
          f"{result['tfjs']}, onnxruntime-web wasm threads: {result.get('ortThreads')}")
    print("| workload | batch | onnxopt step() | onnxopt epoch() | TF.js wasm | TF.js cpu | "
          "TF.js fastest / onnxopt step() | first loss onnxopt / TF.js |")
    print("|---|---|---|---|---|---|---|---|")
    for w in result["workloads"]:
        med = {k: statistics.median(v) for k, v in w["times"].items()}
        fastest = min(med["tfjs-wasm"], med["tfjs-cpu"])
        print(f"| {w['name']} | {w['batch']} | {med['onnxopt']:.3f} | {med['onnxopt-epoch']:.3f} | {med['tfjs-wasm']:.3f} "
              f"| {med['tfjs-cpu']:.3f} "
              f"| {fastest / med['onnxopt']:.2f} | {w['first']['onnxopt']:.5f} / {w['first']['tfjs-wasm']:.5f} |")


if __name__ == "__main__":
    main()
