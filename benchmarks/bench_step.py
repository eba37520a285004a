"""Time per training step of onnxopt's fused step against PyTorch eager, same model, data and weights.

Workload: the seeds' MLP regression, 100 features, 100-50-10-1 ReLU, batch 15, 750 samples, SGD.
Competitors take turns in rounds (ORT and torch threads keep spinning after a run), each timed block
after one untimed epoch; the result is the median µs/step per competitor and ratios within this run.

    python benchmarks/bench_step.py [--rounds 5] [--epochs 3]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np
import onnxruntime as ort

import onnxopt
from onnxopt.examples import mlp

SIZES, BATCH, N = [100, 50, 10, 1], 15, 750


def _epoch_onnxopt(runner, X, y):
    for i in range(0, N, BATCH):
        runner.step(X[i:i + BATCH], y[i:i + BATCH])


def _session_only(runner, X, y):
    """The same runs without onnxopt's Python: bind the batch and run (the floor of the runner)."""
    binding = runner._bindings[0]
    sess = runner.session
    binding.bind_cpu_input("sample_weight", np.ones(BATCH, np.float32))
    for i in range(0, N, BATCH):
        binding.bind_cpu_input("X", X[i:i + BATCH])
        binding.bind_cpu_input("target", y[i:i + BATCH])
        sess.run_with_iobinding(binding)


def _torch_setup(step, lr):
    import torch

    torch.set_num_threads(1)
    w = step.initial_weights()
    layers = []
    for k in range(len(SIZES) - 1):
        lin = torch.nn.Linear(SIZES[k], SIZES[k + 1])
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(w[f"coef_{k}"].T.copy()))
            lin.bias.copy_(torch.from_numpy(w[f"bias_{k}"]))
        layers += [lin, torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    return model, torch.optim.SGD(model.parameters(), lr=lr), torch.nn.MSELoss()


def _epoch_torch(state, X, y):
    import torch

    model, opt, loss_fn = state
    Xt, yt = torch.from_numpy(X), torch.from_numpy(y).reshape(-1, 1)
    for i in range(0, N, BATCH):
        opt.zero_grad()
        loss = loss_fn(model(Xt[i:i + BATCH]), yt[i:i + BATCH])
        loss.backward()
        opt.step()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(N, SIZES[0])).astype(np.float32)
    y = (X[:, :10].sum(axis=1) + 0.1 * rng.normal(size=N)).astype(np.float32)
    step = onnxopt.compile_train_step(mlp(SIZES), loss="square", update="sgd", learning_rate=1e-3)
    competitors = {"onnxopt Runner": (_epoch_onnxopt, onnxopt.Runner(step)),
                   "ORT session only (floor)": (_session_only, onnxopt.Runner(step))}
    try:
        competitors["PyTorch eager"] = (_epoch_torch, _torch_setup(step, 1e-3))
    except ImportError:
        print("PyTorch not installed: skipped")
    times: dict[str, list[float]] = {name: [] for name in competitors}
    for _ in range(args.rounds):
        for name, (epoch, state) in competitors.items():
            time.sleep(0.05)
            epoch(state, X, y)  # NOTE: untimed warm-up epoch after the pause
            t0 = time.perf_counter()
            for _ in range(args.epochs):
                epoch(state, X, y)
            times[name].append((time.perf_counter() - t0) / (args.epochs * N / BATCH) * 1e6)
    med = {name: statistics.median(v) for name, v in times.items()}
    ref = med["onnxopt Runner"]
    print(f"machine: {platform.processor() or platform.machine()}, onnxruntime {ort.__version__}")
    print("| competitor | us/step | ratio onnxopt/competitor |\n| --- | --- | --- |")
    for name, us in med.items():
        print(f"| {name} | {us:.1f} | {ref / us:.2f} |")
    print(f"Python overhead per step (runner - session floor): {ref - med['ORT session only (floor)']:.1f} us")


if __name__ == "__main__":
    main()
