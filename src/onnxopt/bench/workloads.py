"""The benchmark's workloads: model sizes, synthetic data with fixed seeds, loss, optimizer, timing block size.
MLPs (W1-W5, scaling) and two real models (R1 a ResNet-style CNN, T1 a transformer encoder: ``networks``).

Every competitor starts from ``initial_weights()`` (``examples.mlp``'s torch-like init, seed 0) and sees the
same batches in the same order (no shuffling), so their loss curves can be compared step by step.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import onnx

from onnxopt.errors import DataError

__all__ = ["Workload", "WORKLOADS", "scaling_batch", "scaling_width", "select"]

LOSSES = {"regression": "square", "binary": "log", "multiclass": "cross_entropy"}


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark configuration; ``epochs`` is how many epochs a timed block runs."""

    name: str
    title: str
    sizes: tuple[int, ...]
    task: str  # "regression" | "binary" | "multiclass"
    batch: int
    n: int
    update: str  # "sgd" | "nesterov" | "adam"
    lr: float
    epochs: int
    seed: int = 0
    arch: str = ""  # "resnet" | "encoder": a torch network (bench.networks) on inputs shaped ``sizes[:-1]``

    @property
    def loss(self) -> str:
        return LOSSES[self.task]

    @property
    def steps(self) -> int:
        """Steps per epoch (the last batch may be short)."""
        return -(-self.n // self.batch)

    @property
    def n_parameters(self) -> int:
        if self.arch:
            return sum(p.numel() for p in self.network().parameters())
        return sum(a * b + b for a, b in zip(self.sizes[:-1], self.sizes[1:]))

    @property
    def threads(self) -> int:
        """The thread count onnxopt's Runner picks (one below 1M parameters × batch); every competitor gets it."""
        return 1 if self.n_parameters * self.batch < 1_000_000 else (os.cpu_count() or 1)

    @property
    def layer(self) -> tuple[int, int, int]:
        """(batch, fan in, fan out) of the layer with the most weights: the matmul the W3/W5 targets compare with."""
        k = max(range(len(self.sizes) - 1), key=lambda i: self.sizes[i] * self.sizes[i + 1])
        return self.batch, self.sizes[k], self.sizes[k + 1]

    @property
    def flops(self) -> float:
        """Multiply-adds ×2 of one full-batch step: forward, weight gradients, input gradients but the first."""
        macs = sum(a * b for a, b in zip(self.sizes[:-1], self.sizes[1:]))
        return 2.0 * self.batch * (3 * macs - self.sizes[0] * self.sizes[1])

    @property
    def activations(self) -> int:
        """Floats a step keeps for backward: the batch, and each layer's output before and after ReLU."""
        return self.batch * (self.sizes[0] + 2 * sum(self.sizes[1:]))

    def network(self):
        """The torch module of a real-model workload (``bench.networks``), the same for every call."""
        from onnxopt.bench.networks import build

        return build(self.arch, self.sizes[-1], self.seed)

    def model(self) -> onnx.ModelProto:
        from onnxopt.examples import linear_regression, mlp

        if self.arch:
            from onnxopt.bench.networks import export

            return export(self.network(), self.data()[0][:2], train=self.arch == "resnet")

        if len(self.sizes) == 2 and self.sizes[1] == 1:
            return linear_regression(self.sizes[0], seed=self.seed)
        return mlp(list(self.sizes), seed=self.seed)

    def data(self) -> tuple[np.ndarray, np.ndarray]:
        """X (n, sizes[0]) float32 and targets: float32 values, {0, 1} floats or int64 classes."""
        rng = np.random.default_rng(1000 + self.seed)
        X = rng.normal(size=(self.n, *(self.sizes[:-1] if self.arch else self.sizes[:1]))).astype(np.float32)
        flat = X.reshape(self.n, self.sizes[0], -1).mean(axis=2) if self.arch else X  # NOTE: images, sequences
        w = rng.normal(size=(self.sizes[0], self.sizes[-1])) / np.sqrt(self.sizes[0])
        score = flat @ w * (4 if self.arch else 1) + 0.1 * rng.normal(size=(self.n, self.sizes[-1]))
        if self.task == "regression":
            y = np.tanh(score[:, 0]) * 3 if len(self.sizes) > 2 else score[:, 0] * 2 + 1
            return X, y.astype(np.float32)
        if self.task == "binary":  # NOTE: noisy labels keep the optimum finite (separable data sends |score| up)
            return X, (score[:, 0] + rng.normal(size=self.n) > 0).astype(np.float32)
        return X, score.argmax(axis=1).astype(np.int64)


def _w(name, title, sizes, task, batch, n, update, lr, epochs):
    return Workload(name, title, tuple(sizes), task, batch, n, update, lr, epochs)


WORKLOADS = {w.name: w for w in [
    _w("W1-sgd", "seed-mlp, SGD", [100, 50, 10, 1], "regression", 15, 750, "sgd", 1e-2, 8),
    _w("W1-nesterov", "seed-mlp, Nesterov 0.9", [100, 50, 10, 1], "regression", 15, 750, "nesterov", 1e-3, 8),
    _w("W1-adam", "seed-mlp, Adam", [100, 50, 10, 1], "regression", 15, 750, "adam", 1e-3, 8),
    _w("W2", "linreg", [2, 1], "regression", 10, 100, "sgd", 1e-2, 40),
    _w("W3", "mnist-mlp", [784, 512, 512, 10], "multiclass", 128, 8192, "sgd", 5e-2, 1),
    _w("W4", "binary-logreg", [20, 1], "binary", 32, 4096, "sgd", 1e-1, 4),
    _w("W5", "wide-mlp", [256, 1024, 1024, 1], "regression", 256, 4096, "sgd", 5e-3, 1),
    # NOTE: sizes = one sample's shape, then the classes
    Workload("R1", "resnet-cnn", (3, 32, 32, 10), "multiclass", 32, 512, "sgd", 5e-2, 1, arch="resnet"),
    Workload("T1", "transformer-encoder", (32, 64, 10), "multiclass", 16, 256, "sgd", 5e-2, 1, arch="encoder"),
]}

# NOTE: scaling points keep a block near 0.1-1 s of work; ~32 steps an epoch.
_BATCH_EPOCHS = {1: 20, 16: 8, 256: 2, 4096: 1}
WIDTHS = (16, 64, 256, 1024, 2048)


def scaling_batch(batch: int) -> Workload:
    """W1 (SGD) at another batch size."""
    n = batch * (4 if batch >= 4096 else 32)
    return _w(f"batch-{batch}", f"W1 batch {batch}", [100, 50, 10, 1], "regression", batch, n, "sgd", 1e-3,
              _BATCH_EPOCHS.get(batch, 1))


def scaling_width(width: int) -> Workload:
    """W1 (SGD) with hidden layers 100-w-w/5-1 (w=50 is W1)."""
    return _w(f"width-{width}", f"W1 width {width}", [100, width, max(width // 5, 1), 1], "regression", 15, 750,
              "sgd", 1e-3, 8 if width <= 256 else 2)


def select(names: list[str]) -> list[Workload]:
    """Workloads by name; "W1" means its three optimizers, "scaling" every scaling point, "batch-B" and
    "width-w" one of them (any B or w)."""
    out = []
    for name in names:
        if name == "scaling":
            out += [scaling_batch(b) for b in _BATCH_EPOCHS] + [scaling_width(w) for w in WIDTHS]
        elif name in WORKLOADS:
            out.append(WORKLOADS[name])
        elif [k for k in WORKLOADS if k.startswith(name + "-")]:
            out += [w for k, w in WORKLOADS.items() if k.startswith(name + "-")]
        elif name.startswith(("batch-", "width-")) and name.split("-", 1)[1].isdigit() and int(name.split("-")[1]) > 0:
            out.append((scaling_batch if name.startswith("batch-") else scaling_width)(int(name.split("-")[1])))
        else:
            raise DataError(f"--workloads: unknown workload {name!r}; expected one of "
                             f"{sorted(WORKLOADS) + ['W1', 'scaling', 'batch-<B>', 'width-<w>']}")
    return out
