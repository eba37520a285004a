"""The CUDA check: the benchmark zoo's steps on the GPU against the CPU, and R1, T1, W3 timed against torch eager.

One script, meant to finish in under 10 minutes on a machine with an NVIDIA GPU:

1. environment: runs here when ``onnxruntime`` has the CUDAExecutionProvider and torch sees a GPU; otherwise it
   installs onnxruntime-gpu (the CUDA 13 build, 244 MiB) and whatever else does not import (torch, onnx-ir...)
   into a folder (``--site``, default /tmp/onnxopt-gpu-site; from PyPI, or the wheels in ``--wheels``) and runs
   itself again with that folder and this checkout's src first on the path;
2. correctness: every workload of ``onnxopt.bench.workloads`` (W1-W5 MLPs, R1 a ResNet-style CNN with
   BatchNormalization in train mode, T1 a transformer encoder) compiled once, trained ``--steps`` steps from the
   same weights on the same batches by ``Runner(device="cpu")`` and ``Runner(device="cuda")``; the losses must
   agree to ``--rtol`` (the CUDA provider's TF32 matmuls round to ~1e-3); nodes without a CUDA kernel (found by a
   session that refuses the CPU fallback) are listed;
3. speed: R1, T1 and W3, ``--rounds`` alternating epochs of onnxopt's Runner on CUDA (``step(read_loss=False)``,
   losses read once an epoch; batches copied from host memory each step) and torch eager on the same GPU (its
   batches already on the device), after a warm-up epoch each: samples/s and the ratio.

It prints markdown tables for docs/benchmarks.md and exits 1 when a loss disagrees. ``--dry-run`` runs every part
on the CPU in this environment (the "GPU" side too), to check the script itself where no GPU is at hand.

    python benchmarks/gpu_check.py [--steps 5] [--rounds 3] [--rtol 1e-2] [--wheels DIR] [--dry-run]
    python benchmarks/gpu_check.py --placement R1 [--dry-run]   (only the nodes left to the CPU: ``placement``)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ready() -> str | None:
    """None when this interpreter can run the check, else what it lacks."""
    try:
        import onnxruntime as ort
        import torch
    except ImportError as exc:
        return f"import failed: {exc}"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    if hasattr(ort, "preload_dlls"):  # NOTE: onnxruntime-gpu >= 1.21 finds CUDA/cuDNN in torch's nvidia-* wheels
        ort.preload_dlls()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return f"onnxruntime {ort.__version__} has {ort.get_available_providers()}, no CUDAExecutionProvider"
    return None


def _reexec(args) -> int:
    """Installs onnxruntime-gpu (and whatever else does not import: torch, onnx, onnx-ir...) into the folder
    ``--site`` and runs this script again with that folder first on the path (``--inside``)."""
    import importlib.util

    wanted = {"torch": "torch", "onnx": "onnx", "onnx_ir": "onnx-ir==1.1.0", "onnxscript": "onnxscript==0.7.2",
              "numpy": "numpy", "tqdm": "tqdm"}
    missing = [spec for module, spec in wanted.items() if importlib.util.find_spec(module) is None]
    source = ["--find-links", args.wheels, "--no-index"] if args.wheels else []
    pip = [sys.executable, "-m", "pip", "install", "-q", "--upgrade", "--target", args.site, *source]
    # NOTE: without its dependencies: the `onnxruntime` module it brings shadows a CPU build's on the path
    for cmd in [[*pip, "--no-deps", "onnxruntime-gpu"], *([[*pip, *missing]] if missing else [])]:
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        print(f"$ pip install {' '.join(cmd[len(pip):])} ({time.perf_counter() - t0:.0f} s, exit {done.returncode})",
              flush=True)
        if done.returncode:
            print(f"gpu_check: could not install into {args.site}: {(done.stderr or done.stdout).strip()[-1500:]}")
            return 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([args.site, os.path.join(ROOT, "src"),
                                                         os.environ.get("PYTHONPATH", "")])}
    return subprocess.call([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--inside"], env=env)


def _providers_missing(step) -> str:
    """The error of a CUDA session that may not fall back to the CPU: the nodes without CUDA kernels, or ''."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    try:
        ort.InferenceSession(step.model.SerializeToString(), opts, providers=["CUDAExecutionProvider"])
    except Exception as exc:  # noqa: BLE001  (onnxruntime's own error types)
        return str(exc).splitlines()[0][:300]
    return ""


DEVICE = "cuda"  # NOTE: "cpu" under --dry-run


def correctness(names: list[str], steps: int, rtol: float) -> bool:
    import numpy as np

    import onnxopt
    from onnxopt.bench.competitors import _onnxopt_update
    from onnxopt.bench.workloads import WORKLOADS

    print("\n| workload | losses CPU (first, last) | losses CUDA (first, last) | max relative difference | "
          "nodes without a CUDA kernel |")
    print("| --- | --- | --- | --- | --- |")
    ok = True
    for name in names:
        wl = WORKLOADS[name]
        X, y = wl.data()
        step = onnxopt.compile_train_step(wl.model(), loss=wl.loss, update=_onnxopt_update(wl.update),
                                          learning_rate=wl.lr)
        losses = {}
        for device in ("cpu", "cuda"):
            runner = onnxopt.Runner(step, device=DEVICE if device == "cuda" else "cpu", batch_size=wl.batch)
            losses[device] = np.array([runner.step(X[i:i + wl.batch], y[i:i + wl.batch])
                                       for i in range(0, steps * wl.batch, wl.batch)])
        diff = float(np.max(np.abs(losses["cuda"] - losses["cpu"]) / np.maximum(np.abs(losses["cpu"]), 1e-12)))
        ok &= diff <= rtol
        missing = (_providers_missing(step) or "none") if DEVICE == "cuda" else "(dry run)"
        print(f"| {name} | {losses['cpu'][0]:.5g}, {losses['cpu'][-1]:.5g} | {losses['cuda'][0]:.5g}, "
              f"{losses['cuda'][-1]:.5g} | {diff:.1e}{'' if diff <= rtol else ' FAIL'} | {missing} |", flush=True)
    return ok


def speed(names: list[str], rounds: int) -> None:
    import torch

    import onnxopt
    from onnxopt.bench.competitors import TorchEager, _onnxopt_update
    from onnxopt.bench.workloads import WORKLOADS

    class TorchCuda(TorchEager):
        def setup(self, wl, X, y, weights):
            super().setup(wl, X, y, weights)
            self.model.to(DEVICE)
            self.batches = [(a.to(DEVICE), b.to(DEVICE)) for a, b in self.batches]

        def epoch(self):
            out = super().epoch()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            return out

    print(f"\n| workload | onnxopt CUDA (samples/s) | torch eager CUDA (samples/s) | onnxopt / torch | GPU: "
          f"{torch.cuda.get_device_name(0) if DEVICE == 'cuda' else 'none (dry run)'} |")
    print("| --- | --- | --- | --- | --- |")
    for name in names:
        wl = WORKLOADS[name]
        X, y = wl.data()
        step = onnxopt.compile_train_step(wl.model(), loss=wl.loss, update=_onnxopt_update(wl.update),
                                          learning_rate=wl.lr)
        runner = onnxopt.Runner(step, device=DEVICE, batch_size=wl.batch)
        batches = [(X[i:i + wl.batch], y[i:i + wl.batch]) for i in range(0, wl.n, wl.batch)]

        def ours():
            for xb, yb in batches:
                runner.step(xb, yb, read_loss=False)
            return runner.sync()

        peer = TorchCuda()
        peer.setup(wl, X, y, onnxopt.train_initializers(wl.model()))
        times = {"onnxopt": [], "torch": []}
        ours(), peer.epoch()  # NOTE: warm-up: kernels chosen, memory pools filled
        for _ in range(rounds):
            for key, run in (("onnxopt", ours), ("torch", peer.epoch)):
                t0 = time.perf_counter()
                run()
                times[key].append(wl.n / (time.perf_counter() - t0))
        a, b = statistics.median(times["onnxopt"]), statistics.median(times["torch"])
        print(f"| {name} | {a:.0f} | {b:.0f} | {a / b:.2f} | rounds {rounds} |", flush=True)


def placement(name: str) -> None:
    """The nodes of ``name``'s step that the CUDA session runs on the CPU, from onnxruntime's profile of one step
    (each node event names its provider): with the Runner's CUDA specialization (``runner.cuda_model``) and
    without it (the step as compiled). Under --dry-run both run on the CPU: the profile's parsing is checked."""
    import collections
    import json
    import tempfile

    import onnxopt
    from onnxopt import runner as runner_module
    from onnxopt.bench.competitors import _onnxopt_update
    from onnxopt.bench.workloads import WORKLOADS

    wl = WORKLOADS[name]
    X, y = wl.data()
    step = onnxopt.compile_train_step(wl.model(), loss=wl.loss, update=_onnxopt_update(wl.update), learning_rate=wl.lr)
    print(f"\n| {name} step on {DEVICE} | nodes | on the CPU | CPU nodes by type (op x count) |\n| --- | --- | --- | --- |")
    specialize = runner_module.cuda_model
    for label, rewrite in (("as compiled", lambda m: m), ("with cuda_model", specialize)):
        runner_module.cuda_model = rewrite
        with tempfile.TemporaryDirectory() as folder:
            opts = runner_module.default_session_options(0)
            opts.enable_profiling, opts.profile_file_prefix = True, os.path.join(folder, "p")
            try:
                run = onnxopt.Runner(step, device=DEVICE, batch_size=wl.batch, session_options=opts)
            finally:
                runner_module.cuda_model = specialize
            run.step(X[:wl.batch], y[:wl.batch])
            with open(run.session.end_profiling()) as f:
                events = [e for e in json.load(f) if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
        providers = {e["name"]: (e["args"].get("provider", "?"), e["args"].get("op_name", "?")) for e in events}
        cpu = collections.Counter(op for provider, op in providers.values() if provider == "CPUExecutionProvider")
        print(f"| {label} | {len(providers)} | {sum(cpu.values())} | "
              f"{', '.join(f'{op} x{k}' for op, k in cpu.most_common()) or 'none'} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rtol", type=float, default=1e-2)
    parser.add_argument("--site", default="/tmp/onnxopt-gpu-site")
    parser.add_argument("--wheels", default=None, help="a folder of wheels to install from instead of PyPI")
    parser.add_argument("--dry-run", action="store_true", help="every part on the CPU here: checks the script")
    parser.add_argument("--placement", default=None, help="only list where a workload's nodes run (e.g. R1)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global DEVICE
    DEVICE = "cpu" if args.dry_run else "cuda"
    missing = None if args.dry_run else _ready()
    if missing is not None:
        if args.inside:
            print(f"gpu_check: the prepared environment cannot run on CUDA: {missing}")
            return 2
        print(f"gpu_check: this environment cannot ({missing}); installing into {args.site}", flush=True)
        return _reexec(args)
    sys.path.insert(0, os.path.join(ROOT, "src"))
    import onnxruntime as ort

    print(f"python {sys.version.split()[0]}, onnxruntime {ort.__version__}, load {os.getloadavg()[0]:.2f}")
    if args.placement:
        return placement(args.placement) or 0
    ok = correctness(["W1-sgd", "W2", "W3", "W4", "W5", "R1", "T1"], args.steps, args.rtol)
    speed(["R1", "T1", "W3"], args.rounds)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
