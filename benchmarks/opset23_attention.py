"""A transformer encoder's training step exported at opset 23 (fused Attention, onnxopt's transformer rule) against
the same module exported at opset 22 (MatMul/Softmax, the elementwise rules), and torch eager.

2-layer nn.TransformerEncoder (d 64, 4 heads, seq 32, batch 16, GELU, dropout 0) + a mean-pooled Linear head,
square loss, SGD, 2 threads each. Steps timed in alternating turns after a pause (ORT's threads spin ~35 ms after
a run), median of the turns. Needs stock onnxruntime >= 1.32 (Python 3.13).

    python benchmarks/opset23_attention.py [--turns 7] [--steps 20]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import warnings

import numpy as np
import onnxruntime as ort
import torch

import onnxopt
from onnxopt.bench.competitors import ort_kernels, runner_model


def _module():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True, activation="gelu")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = torch.nn.Linear(64, 1)

        def forward(self, x):
            return self.head(self.enc(x).mean(1))

    return Model()


def _export(module, x, opset: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        return torch.onnx.export(module.eval(), (x,), dynamo=True, opset_version=opset, verbose=False).model_proto


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(16, 32, 64)).astype(np.float32)
    y = rng.normal(size=(16, 1)).astype(np.float32)
    module = _module()
    runners, kernels, compile_s = {}, {}, {}
    for opset in (22, 23):
        model = _export(module, torch.from_numpy(X), opset)
        start = time.perf_counter()
        step = onnxopt.compile_train_step(model, loss="square", update="sgd", learning_rate=0.01, gradient="onnxopt")
        compile_s[opset] = time.perf_counter() - start
        kernels[opset] = ort_kernels(runner_model(step, 16, 2), 2)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 2
        runners[opset] = onnxopt.Runner(step, session_options=opts, batch_size=16)
    torch_module = _module().train()
    opt = torch.optim.SGD(torch_module.parameters(), lr=0.01)
    tx, ty = torch.from_numpy(X), torch.from_numpy(y)

    def torch_step():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(torch_module(tx), ty)
        loss.backward()
        opt.step()

    runs = {"opset 22": lambda: runners[22].step(X, y), "opset 23": lambda: runners[23].step(X, y),
            "torch eager": torch_step}
    times = {k: [] for k in runs}
    for fn in runs.values():
        fn()
    for _ in range(args.turns):
        for name, fn in runs.items():
            time.sleep(0.1)
            start = time.perf_counter()
            for _ in range(args.steps):
                fn()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    load = os.getloadavg()[0]
    print(f"load average {load:.2f}; {args.turns} turns of {args.steps} steps, median ms per step\n")
    print("| step | ms per step | kernels | compile s |")
    print("|---|---|---|---|")
    for name, values in times.items():
        opset = {"opset 22": 22, "opset 23": 23}.get(name)
        extra = f"{kernels[opset]} | {compile_s[opset]:.2f}" if opset else "- | -"
        print(f"| {name} | {statistics.median(values):.2f} | {extra} |")


if __name__ == "__main__":
    main()
