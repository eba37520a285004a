"""Where a step's time goes: ORT's profiler (kernel time by op type) and cProfile (Python per step).

Compares onnxopt's fused step with ORT on-device training on one benchmark workload; the figures in the
"What bounds it" section of docs/benchmarks.md come from this script.

    python benchmarks/profile_step.py W1-sgd [--steps 300]
    python -m onnxopt.bench.memory W5 onnxopt                 # RSS growth of one competitor, fresh process
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import glob
import json
import os
import pstats
import tempfile
import time

import onnxruntime as ort

import onnxopt
from onnxopt.bench.competitors import Onnxopt, OrtTraining, _onnxopt_update
from onnxopt.bench.workloads import WORKLOADS
from onnxopt.runner import default_session_options


def kernel_table(path: str, runs: int, top: int = 10) -> None:
    """Prints µs per run by op type from an ORT profile (the JSON written by enable_profiling)."""
    with open(path) as f:
        events = json.load(f)
    dur, count = collections.Counter(), collections.Counter()
    run_us = 0.0
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            dur[e["args"]["op_name"]] += e["dur"]
            count[e["args"]["op_name"]] += 1
        elif e.get("cat") == "Session" and e["name"] == "model_run":
            run_us += e["dur"]
    print(f"  run {run_us / runs:.1f} us, kernels {sum(dur.values()) / runs:.1f} us, "
          f"{sum(count.values()) / runs:.0f} kernels per run")
    for op, d in dur.most_common(top):
        print(f"    {op:28s} {d / runs:8.1f} us  x{count[op] / runs:.0f}")


def profile_fused(wl, X, y, steps: int, folder: str) -> None:
    """The Runner itself (its CPU model, ``runner.cpu_model``) with its default options + ORT's profiler."""
    step = onnxopt.compile_train_step(wl.model(), loss=wl.loss, update=_onnxopt_update(wl.update),
                                      learning_rate=wl.lr)
    opts = default_session_options(wl.n_parameters, wl.batch)
    opts.enable_profiling = True
    opts.profile_file_prefix = os.path.join(folder, "onnxopt")
    runner = onnxopt.Runner(step, session_options=opts, batch_size=wl.batch)
    xb, yb = X[:wl.batch], y[:wl.batch]
    for _ in range(steps):
        runner.step(xb, yb, read_loss=False)
    runner.sync()
    print(f"{wl.name}: onnxopt fused step (Runner), ORT profiler")
    kernel_table(runner.session.end_profiling(), steps)


def profile_ort_training(wl, X, y, steps: int, folder: str) -> None:
    """ORT on-device training's training session (its optimizer session writes a second profile)."""
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    comp = OrtTraining()
    comp.setup(wl, X, y, onnxopt.train_initializers(wl.model()))
    d = comp._dir.name
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = wl.threads
    opts.enable_profiling = True
    opts.profile_file_prefix = os.path.join(folder, "ort_training")
    state = CheckpointState.load_checkpoint(os.path.join(d, "checkpoint"))
    module = Module(os.path.join(d, "training_model.onnx"), state, device="cpu", session_options=opts)
    opt = Optimizer(os.path.join(d, "optimizer_model.onnx"), module)
    opt.set_learning_rate(wl.lr)
    module.train()
    xb, yb = comp.batches[0]
    for _ in range(steps):
        module(xb, yb)
        opt.step()
        module.lazy_reset_grad()
    del opt, module
    print(f"{wl.name}: ORT on-device training session, ORT profiler")
    for path in sorted(glob.glob(os.path.join(folder, "ort_training*.json"))):  # NOTE: training, then optimizer
        print(f"  {os.path.basename(path)}:")
        kernel_table(path, steps)


def profile_python(wl, X, y, epochs: int) -> None:
    """cProfile of each competitor's epoch loop: the functions with the most own time per step."""
    weights = onnxopt.train_initializers(wl.model())
    for cls in (Onnxopt, OrtTraining):
        comp = cls()
        comp.setup(wl, X, y, {k: v.copy() for k, v in weights.items()})
        for _ in range(3):
            comp.epoch()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(epochs):
            comp.epoch()
        prof.disable()
        steps = epochs * wl.steps
        print(f"{wl.name}: {cls.name}, cProfile: {(time.perf_counter() - t0) / steps * 1e6:.1f} us/step (profiled)")
        stats = pstats.Stats(prof).stats
        for (file, _, fn), (_, calls, own, _, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:6]:
            print(f"    {fn[-60:]:60s} {calls / steps:5.2f} calls  {own / steps * 1e6:6.1f} us own")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    ort.set_default_logger_severity(3)
    wl = WORKLOADS[args.workload]
    X, y = wl.data()
    with tempfile.TemporaryDirectory() as folder:
        profile_fused(wl, X, y, args.steps, folder)
        if wl.update != "nesterov":
            profile_ort_training(wl, X, y, args.steps, folder)
            profile_python(wl, X, y, max(1, args.steps // wl.steps))


if __name__ == "__main__":
    main()
