"""A training step of an exported 2-layer LSTM (seq 64, batch 32, input 32, hidden 128, Linear head on the
last step, square loss, SGD): onnxopt's recurrent rules (``autodiff.recurrent``: the LSTM kernel forward,
backpropagation through time in Loops) against torch eager, and against the unrolled form (the LSTM nodes
rewritten into their per-step equations before differentiation, what gradient="onnxopt" compiled before).

Turns alternate within one process, each after a pause (onnxruntime's threads spin ~35 ms after a run) and an
untimed step; the figure is the median of the turns' medians. Two threads each. Prints a markdown table.

    python benchmarks/recurrent.py [--turns 5] [--steps 5]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch
from torch import nn

import onnxopt
from onnxopt.autodiff.recurrent import lower_recurrent

SEQ, BATCH, SIZE, HIDDEN, LR = 64, 32, 32, 128, 1e-2


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(SIZE, HIDDEN, num_layers=2, batch_first=True)
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def export(module: nn.Module, x: np.ndarray) -> onnx.ModelProto:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.from_numpy(x),), buf, dynamo=False, input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    return onnx.load_from_string(buf.getvalue())


def unrolled(model: onnx.ModelProto) -> onnx.ModelProto:
    """The LSTM nodes unrolled over their 64 steps (the builder path's portable rewrite)."""
    m = ir.from_proto(model)
    lower_recurrent(m, "builder", unroll=True)
    return ir.to_proto(m)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    ort.set_default_logger_severity(3)
    torch.manual_seed(0)
    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(BATCH, SEQ, SIZE)).astype(np.float32)
    y = rng.normal(size=(BATCH, 1)).astype(np.float32)
    module = Model()
    model = export(module, X)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    runners, compile_s, nodes = {}, {}, {}
    for name, m in (("onnxopt rules", model), ("onnxopt, unrolled", unrolled(model))):
        start = time.perf_counter()
        step = onnxopt.compile_train_step(m, loss="square", update="sgd", learning_rate=LR)
        compile_s[name] = time.perf_counter() - start
        nodes[name] = len(step.model.graph.node)
        runners[name] = onnxopt.Runner(step, session_options=opts)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    xt, yt = torch.from_numpy(X), torch.from_numpy(y)

    def torch_step():
        opt.zero_grad()
        loss = nn.functional.mse_loss(module(xt), yt)
        loss.backward()
        opt.step()
        return loss.item()

    fns = {"torch eager": torch_step, **{k: (lambda r=r: r.step(X, y)) for k, r in runners.items()}}
    times = {k: [] for k in fns}
    for _ in range(args.turns):
        for name, fn in fns.items():
            time.sleep(0.1)
            fn()
            per = []
            for _ in range(args.steps):
                start = time.perf_counter()
                fn()
                per.append(time.perf_counter() - start)
            times[name].append(statistics.median(per))
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    load = os.getloadavg()
    print(f"2-layer LSTM (seq {SEQ}, batch {BATCH}, input {SIZE}, hidden {HIDDEN}), SGD step, 2 threads; "
          f"load average {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}; onnxruntime {ort.__version__}, "
          f"torch {torch.__version__}\n")
    print("| step | ms (median) | × torch eager | nodes | compile s |")
    print("|---|---|---|---|---|")
    for name, value in ms.items():
        extra = f"{nodes[name]} | {compile_s[name]:.1f}" if name in nodes else "- | -"
        print(f"| {name} | {value:.2f} | {value / ms['torch eager']:.2f} | {extra} |")


if __name__ == "__main__":
    main()
