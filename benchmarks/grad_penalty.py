"""A WGAN-GP critic step (loss mean(f(x)) + 10·mean((‖∂f/∂x‖ − 1)²), SGD) built with ``onnxopt.grad`` and
``compile_train_step(loss=None)``, against torch eager (``autograd.grad(create_graph=True)``, backward, SGD),
on a small MLP and a small CNN; and a Scan RNN step against the same RNN unrolled into straight-line nodes.

Turns alternate within one process, each after an untimed step; the figure is the median of the turns'
medians, in ms per step. torch on two threads (--torch-threads), onnxruntime as the Runner picks (--ort-threads
sets its intra-op threads: the same count on both sides). Prints a markdown table.

    python benchmarks/grad_penalty.py [--turns 5] [--steps 20] [--torch-threads 2] [--ort-threads N]
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
import warnings

import numpy as np
import onnx
import onnx.helper as oh
import torch
from onnx import TensorProto
from onnx import numpy_helper as nh
from torch import nn

import onnxopt
from onnxopt.runner import default_session_options

LAMBDA, LR = 10.0, 1e-3


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.Tanh(), nn.Conv2d(16, 32, 3, stride=2, padding=1),
                                 nn.Tanh(), nn.Flatten(), nn.Linear(32 * 14 * 14, 1))

    def forward(self, x):
        return self.net(x)


def export(module: nn.Module, x: torch.Tensor) -> onnx.ModelProto:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), buf, dynamo=False, input_names=["X"], output_names=["Y"],
                          dynamic_axes={"X": {0: "N"}, "Y": {0: "N"}})
    return onnx.load_from_string(buf.getvalue())


def penalty_model(critic: onnx.ModelProto, rank: int) -> onnx.ModelProto:
    g = onnxopt.grad(critic, ["X"])
    g.graph.node.extend([
        oh.make_node("Mul", ["X_grad", "X_grad"], ["sq"]), oh.make_node("ReduceSum", ["sq", "axes"], ["n2"], keepdims=0),
        oh.make_node("Sqrt", ["n2"], ["norm"]), oh.make_node("Sub", ["norm", "one"], ["d"]),
        oh.make_node("Mul", ["d", "d"], ["d2"]), oh.make_node("ReduceMean", ["d2"], ["gp"], keepdims=0),
        oh.make_node("Mul", ["gp", "lam"], ["gpl"]), oh.make_node("ReduceMean", ["Y"], ["ym"], keepdims=0),
        oh.make_node("Add", ["ym", "gpl"], ["loss"])])
    g.graph.initializer.extend([nh.from_array(np.arange(1, rank, dtype=np.int64), "axes"),
                                nh.from_array(np.float32(1.0), "one"), nh.from_array(np.float32(LAMBDA), "lam")])
    g.graph.output.append(oh.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    return g


def torch_step(module: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    x = x.requires_grad_()
    y = module(x)
    gx, = torch.autograd.grad(y.sum(), x, create_graph=True)
    loss = y.mean() + LAMBDA * ((gx.flatten(1).norm(dim=1) - 1) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def timed(fn, steps: int) -> float:
    fn()  # NOTE: untimed, after the other side's turn
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def compare(sides: dict, turns: int, steps: int) -> dict[str, float]:
    results = {name: [] for name in sides}
    for _ in range(turns):
        for name, fn in sides.items():
            time.sleep(0.05)
            results[name].append(timed(fn, steps))
    return {name: statistics.median(v) for name, v in results.items()}


def runner(step, ort_threads: int | None) -> onnxopt.Runner:
    if ort_threads is None:
        return onnxopt.Runner(step)
    opts = default_session_options(0)
    opts.intra_op_num_threads = ort_threads
    return onnxopt.Runner(step, session_options=opts)


def penalty_rows(turns: int, steps: int, ort_threads: int | None = None) -> list[str]:
    rows = []
    for name, module, shape in (("MLP 32-256-256-1, batch 256", MLP(), (256, 32)),
                                ("CNN 1x28x28, 2 conv + linear, batch 64", CNN(), (64, 1, 28, 28))):
        torch.manual_seed(0)
        x = torch.randn(*shape)
        step = onnxopt.compile_train_step(penalty_model(export(module, x), len(shape)), loss=None,
                                          loss_output="loss", update="sgd", learning_rate=LR)
        run = runner(step, ort_threads)
        opt = torch.optim.SGD(module.parameters(), lr=LR)
        xn = x.numpy()
        t = compare({"onnxopt": lambda r=run, xn=xn: r.step(xn),
                     "torch": lambda m=module, o=opt, x=x: torch_step(m, o, x.clone())}, turns, steps)
        rows.append(f"| {name} | {t['onnxopt']:.2f} | {t['torch']:.2f} | {t['onnxopt'] / t['torch']:.2f} |")
    return rows


def rnn(scan: bool, steps: int = 32, batch: int = 16, features: int = 16, hidden: int = 64) -> onnx.ModelProto:
    """h_t = tanh(x_t W + h U + b) over X (time, batch, features), output the stacked h_t: a Scan, or the same
    equations written once per time step."""
    f = TensorProto.FLOAT
    rng = np.random.default_rng(0)
    inits = [nh.from_array((rng.normal(size=s) * 0.2).astype(np.float32), n) for n, s in
             (("W", (features, hidden)), ("U", (hidden, hidden)), ("b", (hidden,)))]
    inits.append(nh.from_array(np.zeros((batch, hidden), np.float32), "H0"))

    def cell(x, h, out, p):
        return [oh.make_node("MatMul", [x, "W"], [p + "xw"]), oh.make_node("MatMul", [h, "U"], [p + "hu"]),
                oh.make_node("Add", [p + "xw", p + "hu"], [p + "s"]), oh.make_node("Add", [p + "s", "b"], [p + "s2"]),
                oh.make_node("Tanh", [p + "s2"], [out])]

    if scan:
        body = oh.make_graph(cell("x_t", "h_in", "h_out", "") + [oh.make_node("Identity", ["h_out"], ["y_t"])], "body",
                             [oh.make_tensor_value_info("h_in", f, [batch, hidden]),
                              oh.make_tensor_value_info("x_t", f, [batch, features])],
                             [oh.make_tensor_value_info("h_out", f, [batch, hidden]),
                              oh.make_tensor_value_info("y_t", f, [batch, hidden])])
        nodes = [oh.make_node("Scan", ["H0", "X"], ["HT", "Y"], body=body, num_scan_inputs=1)]
    else:
        nodes, h = [oh.make_node("Split", ["X"], [f"x{t}" for t in range(steps)], axis=0, num_outputs=steps)], "H0"
        for t in range(steps):
            nodes.append(oh.make_node("Squeeze", [f"x{t}", "zero"], [f"xs{t}"]))
            nodes += cell(f"xs{t}", h, f"h{t}", f"t{t}_")
            nodes.append(oh.make_node("Unsqueeze", [f"h{t}", "zero"], [f"y{t}"]))
            h = f"h{t}"
        nodes.append(oh.make_node("Concat", [f"y{t}" for t in range(steps)], ["Y"], axis=0))
        inits.append(nh.from_array(np.array([0], np.int64), "zero"))
    graph = oh.make_graph(nodes, "rnn", [oh.make_tensor_value_info("X", f, [steps, batch, features])],
                          [oh.make_tensor_value_info("Y", f, [steps, batch, hidden])], inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=10)


def rnn_rows(turns: int, steps: int, ort_threads: int | None = None) -> list[str]:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, 16, 16)).astype(np.float32)
    y = rng.normal(size=(32, 16, 64)).astype(np.float32)
    runners = {}
    for name, scan in (("scan", True), ("unrolled", False)):
        step = onnxopt.compile_train_step(rnn(scan), loss="square", update="sgd", learning_rate=LR,
                                          weights=["W", "U", "b"])
        runners[name] = runner(step, ort_threads)
    t = compare({name: (lambda r=r: r.step(x, y)) for name, r in runners.items()}, turns, steps)
    return [(f"| RNN step (Scan vs unrolled), 32 steps, batch 16, hidden 64 | {t['scan']:.2f} | "
             f"{t['unrolled']:.2f} | {t['scan'] / t['unrolled']:.2f} |")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--ort-threads", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    print("| workload | onnxopt ms/step | peer ms/step | ratio |")
    print("|---|---|---|---|")
    rows = penalty_rows(args.turns, args.steps, args.ort_threads) + rnn_rows(args.turns, args.steps, args.ort_threads)
    for row in rows:
        print(row, flush=True)


if __name__ == "__main__":
    main()
