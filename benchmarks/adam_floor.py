"""W1-adam's floor against ORT on-device (issue 13's target: onnxopt's Adam step ≤ 0.5× ORT on-device's).

An Adam step computes the forward and backward of an SGD step and then, at least, one fused Adam pass over
the parameters. onnxopt's W1-sgd epoch step (its updates inside the backward's Gemms: no update pass) plus
onnxruntime's own ``com.microsoft::AdamOptimizer`` on W1's 5,571 parameters (iterations of a Scan with
nothing else, as in ``Runner.epoch``) is therefore below any Adam step in this runtime. Each round times
ORT on-device's AdamW block between two blocks of each floor term (each after a pause and an untimed epoch)
and takes the ratio floor / ORT within it; thread CPU time, one thread.

    python benchmarks/adam_floor.py [--rounds 31]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import onnxopt
from onnxopt.bench.competitors import Onnxopt, OrtTraining
from onnxopt.bench.workloads import WORKLOADS


def adam_alone(n: int, steps: int):
    """A function running ``steps`` AdamOptimizer updates of ``n`` floats in one Scan (one session run)."""
    f = TensorProto.FLOAT
    body = helper.make_graph(
        [helper.make_node("AdamOptimizer", ["lr", "t", "w", "g", "m", "v"], ["t2", "m2", "v2", "w2"],
                          domain="com.microsoft", alpha=0.9, beta=0.999, epsilon=1e-8, do_bias_correction=1),
         helper.make_node("Identity", ["t2"], ["t3"])],
        "body", [helper.make_tensor_value_info(k, f, [n]) for k in ("w", "m", "v")]
        + [helper.make_tensor_value_info("t", TensorProto.INT64, [1]), helper.make_tensor_value_info("g", f, [n])],
        [helper.make_tensor_value_info(k, f, [n]) for k in ("w2", "m2", "v2")]
        + [helper.make_tensor_value_info("t3", TensorProto.INT64, [1])],
        [numpy_helper.from_array(np.array(1e-3, np.float32), "lr")])
    scan = helper.make_node("Scan", ["w0", "m0", "v0", "t0", "gs"], ["w1", "m1", "v1", "t1"], body=body,
                            num_scan_inputs=1)
    model = helper.make_model(helper.make_graph(
        [scan], "adam", [*(helper.make_tensor_value_info(k, f, [n]) for k in ("w0", "m0", "v0")),
                         helper.make_tensor_value_info("t0", TensorProto.INT64, [1]),
                         helper.make_tensor_value_info("gs", f, [steps, n])],
        [helper.make_tensor_value_info(k, f, [n]) for k in ("w1", "m1", "v1")]
        + [helper.make_tensor_value_info("t1", TensorProto.INT64, [1])]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)], ir_version=8)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {"w0": rng.normal(size=n).astype(np.float32), "m0": np.zeros(n, np.float32),
             "v0": np.zeros(n, np.float32), "t0": np.ones(1, np.int64),
             "gs": rng.normal(size=(steps, n)).astype(np.float32)}
    binding = sess.io_binding()
    for k, v in feeds.items():
        binding.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(v))
    for o in sess.get_outputs():
        binding.bind_output(o.name)
    return lambda: sess.run_with_iobinding(binding)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=31)
    args = p.parse_args()
    ort.set_default_logger_severity(3)
    sgd, adam = WORKLOADS["W1-sgd"], WORKLOADS["W1-adam"]
    X, y = sgd.data()
    weights = onnxopt.train_initializers(sgd.model())
    ours, theirs = Onnxopt(), OrtTraining()
    ours.setup(sgd, X, y, {k: v.copy() for k, v in weights.items()})
    theirs.setup(adam, X, y, {k: v.copy() for k, v in weights.items()})
    steps = sgd.steps
    alone = adam_alone(sum(v.size for v in weights.values()), steps - 1)
    blocks = {"onnxopt W1-sgd": ours.epoch, "AdamOptimizer alone": alone, "ORT on-device W1-adam": theirs.epoch}
    times = {k: [] for k in blocks}

    def block(name: str) -> float:
        run = blocks[name]
        time.sleep(0.05)
        run()
        t0 = time.thread_time()
        for _ in range(10):
            run()
        return (time.thread_time() - t0) / (10 * (steps - 1 if name == "AdamOptimizer alone" else steps)) * 1e6

    floor = []
    for _ in range(args.rounds):  # NOTE: ORT's block between two of each floor term: a phase of the VM is shared
        a1, b1, c, b2, a2 = (block(n) for n in (*list(blocks)[:2], list(blocks)[2], *list(blocks)[1::-1]))
        for name, value in zip(blocks, ((a1 + a2) / 2, (b1 + b2) / 2, c)):
            times[name].append(value)
        floor.append(((a1 + a2) / 2 + (b1 + b2) / 2) / c)
    for name, t in times.items():
        print(f"{name:24s} {statistics.median(t):7.1f} us/step")
    print(f"floor / ORT on-device W1-adam: median {statistics.median(floor):.2f} "
          f"(quartiles {np.percentile(floor, 25):.2f}-{np.percentile(floor, 75):.2f}); the target is 0.5")


if __name__ == "__main__":
    main()
