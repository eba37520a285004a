"""onnxruntime-training's on-device API against onnxopt.compat.onnxruntime_training's on stock onnxruntime.

One step = ``module(X, y); optimizer.step(); module.lazy_reset_grad()`` on W1-sgd (MSELoss) and W3
(CrossEntropyLoss), SGD, the same artifacts for both: onnxruntime-training's own ``generate_artifacts``
output (and onnxopt's, as a third column). Each round runs every side in its own process (onnxruntime-training
needs Python <= 3.12, stock onnxruntime this interpreter), alternating, and times ``--steps`` steps after a
warm-up with the workload's thread count; the figure is the median of the rounds' steps per second.

    PYTHONPATH=src python benchmarks/ort_on_device.py --reference /path/to/python3.11 --reference-path DIR \
        [--before OTHER_CHECKOUT/src]
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
from pathlib import Path

import numpy as np

WORKER = Path(__file__).resolve().parents[1] / "tests" / "ort_training_worker.py"


def mlp(sizes: list[int]):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "input"
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        inits += [numpy_helper.from_array((rng.normal(size=(b, a)) / np.sqrt(a)).astype(np.float32), f"fc{i}.weight"),
                  numpy_helper.from_array(np.zeros(b, np.float32), f"fc{i}.bias")]
        out = "output" if i == len(sizes) - 2 else f"h{i}"
        nodes.append(helper.make_node("Gemm", [x, f"fc{i}.weight", f"fc{i}.bias"], [out], transB=1))
        if out != "output":
            nodes.append(helper.make_node("Relu", [out], [f"r{i}"]))
            x = f"r{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["b", sizes[0]])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["b", sizes[-1]])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


WORKLOADS = {"W1-sgd": ([100, 50, 10, 1], "MSELoss", 15, 1), "W3": ([784, 512, 512, 10], "CrossEntropyLoss", 128, 2)}


def time_steps(side: str, folder: str, workload: str, steps: int) -> float:
    """Steps per second of one side (run in its own process)."""
    if side == "ort":
        import onnxruntime as ort
        from onnxruntime.training import api
    else:
        import onnxruntime as ort

        from onnxopt.compat.onnxruntime_training import api
    sizes, loss, batch, threads = WORKLOADS[workload]
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    rng = np.random.default_rng(1)
    X = rng.normal(size=(batch, sizes[0])).astype(np.float32)
    y = rng.integers(0, sizes[-1], batch).astype(np.int64) if loss == "CrossEntropyLoss" else \
        rng.normal(size=(batch, sizes[-1])).astype(np.float32)
    state = api.CheckpointState.load_checkpoint(f"{folder}/checkpoint")
    module = api.Module(f"{folder}/training_model.onnx", state, session_options=opts)
    optimizer = api.Optimizer(f"{folder}/optimizer_model.onnx", module)
    module.train()
    for _ in range(max(steps // 10, 5)):
        module(X, y), optimizer.step(), module.lazy_reset_grad()
    start = time.perf_counter()
    for _ in range(steps):
        module(X, y)
        optimizer.step()
        module.lazy_reset_grad()
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference", default=os.environ.get("ONNXOPT_ORT_REFERENCE_PYTHON", ".venv312/bin/python"))
    parser.add_argument("--reference-path", default=os.environ.get("ONNXOPT_ORT_REFERENCE_PATH", ".ort-reference"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--before", help="another onnxopt src folder, timed as a fourth column on the same artifacts")
    parser.add_argument("--time", nargs=3, metavar=("SIDE", "FOLDER", "WORKLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.time:
        print(json.dumps(time_steps(*args.time, args.steps)))
        return
    import onnx

    from onnxopt.compat.onnxruntime_training import artifacts

    env = {**os.environ, "PYTHONPATH": args.reference_path}
    here = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (sizes, loss, _, _) in WORKLOADS.items():
            model = mlp(sizes)
            onnx.save(model, f"{tmp}/{name}.onnx")
            subprocess.run([args.reference, str(WORKER), "generate", f"{tmp}/{name}.onnx", f"{tmp}/{name}-ort", loss, "SGD"],
                           env=env, check=True, capture_output=True)
            artifacts.generate_artifacts(model, [i.name for i in model.graph.initializer], loss=getattr(artifacts.LossType, loss),
                                         optimizer=artifacts.OptimType.SGD, artifact_directory=f"{tmp}/{name}-onnxopt")
        sides = ["ort", "onnxopt", "onnxopt-artifacts", *(["onnxopt-before"] if args.before else [])]
        runs = {(w, s): [] for w in WORKLOADS for s in sides}
        for _ in range(args.rounds):
            for w in WORKLOADS:
                for side, python, folder, e in [("ort", args.reference, f"{tmp}/{w}-ort", env),
                                                ("onnxopt", sys.executable, f"{tmp}/{w}-ort", here),
                                                ("onnxopt-artifacts", sys.executable, f"{tmp}/{w}-onnxopt", here),
                                                ("onnxopt-before", sys.executable, f"{tmp}/{w}-ort",
                                                 {**here, "PYTHONPATH": args.before or ""})][:len(sides)]:
                    out = subprocess.run([python, __file__, "--steps", str(args.steps), "--time",
                                          "ort" if side == "ort" else "onnxopt", folder, w],
                                         env=e, check=True, capture_output=True, text=True).stdout
                    runs[w, side].append(json.loads(out.strip().splitlines()[-1]))
    for w in WORKLOADS:
        ort_rate = statistics.median(runs[w, "ort"])
        cells = [f"{s} {statistics.median(runs[w, s]):,.0f} steps/s ({statistics.median(runs[w, s]) / ort_rate:.2f}x)"
                 for s in sides]
        print(f"{w}: " + ", ".join(cells), "rounds:", {s: [round(v) for v in runs[w, s]] for s in sides})


if __name__ == "__main__":
    main()
