"""The matmuls of a W3 or W5 step alone against ORT's MatMul of the biggest layer: how much of the GFLOP/s
target (docs/benchmarks.md, "W3, W5: share of ORT's own MatMul") the matmuls themselves leave.

One session holds the step's dense-layer `Gemm`s with their shapes and attributes: the forward pass (with
its bias), the weight update fused in the gradient `Gemm` (`W - lr·Xᵀ·dY`) and the input gradients but the
first layer's; it is timed between two blocks of the one-node MatMul reference (as `onnxopt bench` pairs
its blocks), on the workload's threads, and the share counts the flops of `Workload.flops`.

    python benchmarks/matmul_floor.py W3 [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from onnxopt.bench.workloads import WORKLOADS


def _session(nodes, feeds: dict[str, np.ndarray], outputs: list[str], threads: int) -> ort.InferenceSession:
    graph = helper.make_graph(nodes, "matmuls", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape)
                                                 for k, v in feeds.items()],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.log_severity_level = threads, 3
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def step_matmuls(name: str):
    """(session, feeds) of the workload's matmuls, random float32 data."""
    wl = WORKLOADS[name]
    rng = np.random.default_rng(0)
    feeds, nodes = {"X": rng.normal(size=(wl.batch, wl.sizes[0])).astype(np.float32)}, []
    for i, (a, b) in enumerate(zip(wl.sizes[:-1], wl.sizes[1:])):
        feeds.update({f"W{i}": rng.normal(size=(a, b)).astype(np.float32), f"b{i}": rng.normal(size=b).astype(np.float32),
                      f"G{i}": rng.normal(size=(wl.batch, b)).astype(np.float32)})
        x = "X" if i == 0 else f"H{i - 1}"
        nodes.append(helper.make_node("Gemm", [x, f"W{i}", f"b{i}"], [f"H{i}"]))
        nodes.append(helper.make_node("Gemm", [x, f"G{i}", f"W{i}"], [f"U{i}"], transA=1, alpha=-0.05, beta=1.0))
        if i:
            nodes.append(helper.make_node("Gemm", [f"G{i}", f"W{i}"], [f"D{i}"], transB=1))
    outputs = [o for n in nodes for o in n.output if o[0] in "UD"] + [f"H{len(wl.sizes) - 2}"]
    return _session(nodes, feeds, outputs, wl.threads), feeds


def share(name: str, rounds: int) -> list[float]:
    """Per round: the matmuls' GFLOP/s over the reference's, timed between two reference blocks."""
    wl = WORKLOADS[name]
    m, k, n = wl.layer
    rng = np.random.default_rng(1)
    ref_feeds = {"A": rng.normal(size=(m, k)).astype(np.float32), "B": rng.normal(size=(k, n)).astype(np.float32)}
    ref = _session([helper.make_node("MatMul", ["A", "B"], ["Y"])], ref_feeds, ["Y"], wl.threads)
    sess, feeds = step_matmuls(name)

    def block(s, f, runs):
        time.sleep(0.05)
        s.run(None, f)
        t0 = time.perf_counter()
        for _ in range(runs):
            s.run(None, f)
        return (time.perf_counter() - t0) / runs

    out = []
    for _ in range(rounds):
        before, ours, after = block(ref, ref_feeds, 40), block(sess, feeds, 10), block(ref, ref_feeds, 40)
        out.append(wl.flops / ours / (2.0 * m * k * n / ((before + after) / 2)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=["W3", "W5"])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    shares = share(args.workload, args.rounds)
    print(f"{args.workload}: the step's matmuls alone reach {statistics.median(shares):.2f} of ORT's MatMul rate "
          f"on {WORKLOADS[args.workload].layer} (rounds {min(shares):.2f}-{max(shares):.2f})")


if __name__ == "__main__":
    main()
