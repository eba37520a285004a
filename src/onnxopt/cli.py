"""The ``onnxopt`` command line: ``onnxopt demo`` trains an MLP on synthetic data, end to end."""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    import onnx
    from tqdm import tqdm

    from onnxopt import Runner, compile_train_step, dsl
    from onnxopt.examples import mlp

    rng = np.random.default_rng(args.seed)
    X = rng.normal(size=(args.samples, args.features)).astype(np.float32)
    coef = rng.normal(size=args.features).astype(np.float32)
    y = (np.tanh(X @ coef / np.sqrt(args.features)) * 3 + 0.1 * rng.normal(size=args.samples)).astype(np.float32)
    model = mlp([args.features, 50, 10, 1], seed=args.seed)
    step = compile_train_step(model, loss="square", update=dsl.updates.nesterov(momentum=0.9),
                              learning_rate=dsl.schedules.invscaling(eta0=args.lr, power_t=0.25))
    os.makedirs(args.out, exist_ok=True)
    step.save(os.path.join(args.out, "train_step.onnx"))
    runner = Runner(step)
    rows = []
    bar = tqdm(range(args.epochs), desc="epochs", disable=args.quiet, file=sys.stderr)
    for epoch in bar:
        order = rng.permutation(args.samples)
        Xe, ye = X[order], y[order]
        t0 = time.perf_counter()
        losses = [runner.step(Xe[i:i + args.batch_size], ye[i:i + args.batch_size])
                  for i in range(0, args.samples, args.batch_size)]
        us = (time.perf_counter() - t0) / len(losses) * 1e6
        rows.append((epoch + 1, float(np.mean(losses)), us))
        bar.set_postfix(loss=f"{rows[-1][1]:.4f}")
    onnx.save(runner.export(), os.path.join(args.out, "trained.onnx"))
    print(f"{'epoch':>5}  {'mean loss':>10}  {'us/step':>8}")
    for epoch, loss, us in rows:
        print(f"{epoch:>5}  {loss:>10.5f}  {us:>8.1f}")
    print(f"one session run per step: {runner.n_runs} runs for {runner.step_count} steps")
    print(f"wrote {os.path.join(args.out, 'train_step.onnx')} and {os.path.join(args.out, 'trained.onnx')}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onnxopt", description="Compile and run fused ONNX training steps.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train an MLP 100-50-10-1 on synthetic data (no download)",
                          epilog="example: onnxopt demo --epochs 5 --out onnxopt-demo")
    demo.add_argument("--out", default="onnxopt-demo", help="folder for train_step.onnx and trained.onnx")
    demo.add_argument("--epochs", type=int, default=10)
    demo.add_argument("--samples", type=int, default=750)
    demo.add_argument("--features", type=int, default=100)
    demo.add_argument("--batch-size", type=int, default=15)
    demo.add_argument("--lr", type=float, default=1e-3)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``onnxopt`` console script."""
    args = _parser().parse_args(argv)
    return args.func(args)
