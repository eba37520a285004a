"""W1-adam's floor for a portable step on stock onnxruntime (issue 14's target: within 1.1x of the training
build's step).

The two steps differ only in their update. The training build runs Adam as one ``com.microsoft::AdamOptimizer``
kernel over W1's 5,571 packed parameters; the portable step runs the DSL rule's standard ops (13 passes over the
pack, 8 kernels on the step count). The rest of the graph is the same, and stock onnxruntime runs it as fast as
the training build (portable W1-sgd: 0.96-1.08 of the training build's step). So a portable W1-adam step takes
at least

    training build's step - its update + the portable update on stock onnxruntime

Each update is cut out of its compiled step (every node between the packs and the new packs) and timed alone:
runs of it against runs of a model with the same inputs and outputs joined by Identity nodes, in blocks that
take turns. The portable update runs in a worker on the stock interpreter; the training build's step (Runner,
one ``step`` per batch as ``onnxopt bench``'s portable section runs it) and update run here. Thread CPU time.

    python benchmarks/portable_adam_floor.py [--python .venv313/bin/python] [--rounds 21]
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

import numpy as np
import onnx
from onnx import TensorProto, helper

PACKS = ("optim.weights", "optim.grads", "optim.exp_avg", "optim.exp_avg_sq")
NEW = ("optim.weights.new", "optim.exp_avg.new", "optim.exp_avg_sq.new")


def update_part(model: onnx.ModelProto, n: int) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(every node of ``model`` from the packs and the step count to the new packs, the same inputs and outputs
    joined by Identity nodes)."""
    g = model.graph
    producer = {out: node for node in g.node for out in node.output}
    kept, todo = set(), list(NEW)
    while todo:
        node = producer.get(todo.pop())
        if node is None or id(node) in kept or set(node.output) & set(PACKS):
            continue
        kept.add(id(node))
        todo.extend(i for i in node.input if i and i not in PACKS)
    nodes = [node for node in g.node if id(node) in kept]
    used = {i for node in nodes for i in node.input}
    step = next(v for v in g.input if v.name == "optim.step")
    inputs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, [n]) for k in PACKS] + [step]
    outputs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, [n]) for k in NEW]

    def make(nodes, inits):
        return helper.make_model(helper.make_graph(nodes, "update", inputs, outputs, inits),
                                 opset_imports=model.opset_import, ir_version=model.ir_version)

    identity = [helper.make_node("Identity", [a], [b]) for a, b in zip((PACKS[0], PACKS[2], PACKS[3]), NEW)]
    return make(nodes, [t for t in g.initializer if t.name in used]), make(identity, [])


def time_update(paths: list[str], rounds: int, runs: int = 300) -> list[float]:
    """Per round, µs of thread CPU time per run of ``paths[0]`` minus that of ``paths[1]`` (blocks in turns)."""
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    rng = np.random.default_rng(0)
    calls, keep = [], []  # NOTE: an OrtValue over a numpy array does not own it
    for path in paths:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        binding = sess.io_binding()
        for i in sess.get_inputs():
            value = np.array(3, np.int64).reshape([1] * len(i.shape)) if i.name == "optim.step" else (
                np.abs(rng.normal(size=i.shape)).astype(np.float32))
            keep.append(value)
            binding.bind_ortvalue_input(i.name, ort.OrtValue.ortvalue_from_numpy(value))
        for o in sess.get_outputs():  # NOTE: preallocated, as the Runner binds its outputs
            keep.append(np.empty(o.shape, np.float32))
            binding.bind_ortvalue_output(o.name, ort.OrtValue.ortvalue_from_numpy(keep[-1]))
        calls.append(lambda sess=sess, binding=binding: sess.run_with_iobinding(binding))

    def block(call) -> float:
        time.sleep(0.02)
        call()
        t0 = time.thread_time()
        for _ in range(runs):
            call()
        return (time.thread_time() - t0) / runs * 1e6

    return [block(calls[0]) - block(calls[1]) for _ in range(rounds)]


def step_time(path: str, rounds: int) -> list[float]:
    """µs of thread CPU time per W1-adam step of the Runner on the step at ``path``, per round (8 epochs)."""
    import onnxopt
    from onnxopt.bench.workloads import WORKLOADS

    wl = WORKLOADS["W1-adam"]
    X, y = wl.data()
    batches = [(X[i:i + wl.batch], y[i:i + wl.batch]) for i in range(0, wl.n, wl.batch)]
    runner = onnxopt.Runner(path, batch_size=wl.batch)

    def epochs(k: int) -> None:
        for _ in range(k):
            for xb, yb in batches:
                runner.step(xb, yb, read_loss=False)
            runner.sync()

    out = []
    for _ in range(rounds):
        time.sleep(0.05)
        epochs(1)
        t0 = time.thread_time()
        epochs(wl.epochs)
        out.append((time.thread_time() - t0) / (wl.epochs * len(batches)) * 1e6)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default=os.path.join(".venv313", "bin", "python"),
                   help="a Python 3.13+ with stock onnxruntime and onnxopt (tests/test_portable.py makes .venv313)")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--serve", nargs=2, metavar=("UPDATE", "IDENTITY"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:  # NOTE: the worker on the stock interpreter
        import onnxruntime as ort

        print(json.dumps({"onnxruntime": ort.__version__, "us": time_update(args.serve, args.rounds)}), flush=True)
        return
    import onnxruntime as ort

    import onnxopt
    from onnxopt.bench.competitors import _onnxopt_update
    from onnxopt.bench.workloads import WORKLOADS

    wl = WORKLOADS["W1-adam"]
    n = sum(v.size for v in onnxopt.train_initializers(wl.model()).values())
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for portable in (False, True):
            step = onnxopt.compile_train_step(wl.model(), loss=wl.loss, update=_onnxopt_update(wl.update),
                                              learning_rate=wl.lr, portable=portable)
            step.save(os.path.join(tmp, f"step-{portable}.onnx"))
            update, identity = update_part(step.model, n)
            ops = sorted({node.op_type for node in update.graph.node})
            print(f"{'portable' if portable else 'training build'} update: {len(update.graph.node)} nodes {ops}")
            paths[portable] = [os.path.join(tmp, f"{name}-{portable}.onnx") for name in ("update", "identity")]
            for model, path in zip((update, identity), paths[portable]):
                onnx.save(model, path)
        out = subprocess.run([args.python, __file__, "--rounds", str(args.rounds), "--serve", *paths[True]],
                             capture_output=True, text=True, timeout=1200)
        if out.returncode != 0:
            sys.exit(f"the worker on {args.python} failed:\n{out.stderr[-2000:]}")
        stock = json.loads(out.stdout.strip().splitlines()[-1])
        train_update = time_update(paths[False], args.rounds)
        portable_here = time_update(paths[True], args.rounds)
        step = step_time(os.path.join(tmp, "step-False.onnx"), args.rounds)
    med = statistics.median
    floor = (med(step) - med(train_update) + med(stock["us"])) / med(step)
    print(f"training build {ort.__version__}: W1-adam step {med(step):.1f} us, its AdamOptimizer update "
          f"{med(train_update):.1f} us, the portable update {med(portable_here):.1f} us")
    print(f"stock onnxruntime {stock['onnxruntime']}: the portable update {med(stock['us']):.1f} us")
    print(f"floor of portable on stock / training build: {floor:.2f} (the target is 1.1)")


if __name__ == "__main__":
    main()
