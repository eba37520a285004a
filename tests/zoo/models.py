"""The torch half of the zoo: small models as torch.onnx writes them, and their torch references.

Every model is built with a fixed seed and exported once per session (``exported``). A case is
``<model>-<exporter>``:

- ``dynamo``: ``torch.onnx.export(model, args)`` at the exporter's default opset (BatchNorm folds into the
  Conv/Gemm before it, Dropout disappears, some parameters become transposed ``val_N`` copies);
- ``dynamo18``: the same at ``opset_version=18`` (GELU written with Erf/Tanh and 0-d scalar initializers);
- ``script``: TorchScript, ``dynamo=False`` (BatchNorm folds into a Conv, stays after a Gemm);
- ``script_train``: TorchScript with ``training=TrainingMode.TRAINING`` (BatchNorm and Dropout kept as in
  training), only for the models that carry them.
"""

from __future__ import annotations

import dataclasses
import io
import warnings
from collections.abc import Callable

import numpy as np
import onnx
import torch

from zoo.common import locate as common_locate

nn = torch.nn

torch.set_num_threads(1)

EXPORTERS = ["dynamo", "dynamo18", "script"]


# ---------------------------------------------------------------------------------------------------------
# torch models: tiny, CPU, float32


class LeNet(nn.Module):
    """Conv -> BatchNorm2d -> ReLU -> MaxPool -> Dropout -> Linear on 1x8x8 images, 3 classes."""

    def __init__(self, p: float = 0.25):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.pool = nn.MaxPool2d(2)
        self.drop = nn.Dropout(p)
        self.fc = nn.Linear(4 * 3 * 3, 3)

    def forward(self, x):
        x = self.drop(self.pool(torch.relu(self.bn(self.conv(x)))))
        return self.fc(torch.flatten(x, 1))


class RNNRegressor(nn.Module):
    """GRU or LSTM over (N, T, 3) sequences, Linear on the last hidden state."""

    def __init__(self, cell: str):
        super().__init__()
        self.rnn = (nn.GRU if cell == "gru" else nn.LSTM)(3, 6, batch_first=True)
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class Encoder(nn.Module):
    """One TransformerEncoderLayer (batch_first), mean pooling over time, Linear."""

    def __init__(self, p: float = 0.1):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=p, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.layer(x).mean(dim=1))


class MLP(nn.Module):
    """Linear(4, 8) -> [norm] -> activation -> [Dropout] -> Linear(8, 1)."""

    def __init__(self, act: nn.Module, norm: nn.Module | None = None, p: float | None = None):
        super().__init__()
        self.fc1, self.norm, self.act = nn.Linear(4, 8), norm or nn.Identity(), act
        self.drop = nn.Dropout(p) if p is not None else nn.Identity()
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.norm(self.fc1(x)))))


@dataclasses.dataclass
class TorchSpec:
    """How to build one zoo model and its data."""

    build: Callable[..., nn.Module]  # build(p) -> module; p is the Dropout probability when the model has one
    shape: tuple[int, ...]  # one sample's input shape
    classes: int = 0  # > 0: cross_entropy on logits with integer targets; 0: squared error on (N, 1)
    stateful: bool = False  # carries BatchNorm and/or Dropout (train mode differs from eval mode)
    lr: float = 0.05
    summary: Callable[[np.ndarray], np.ndarray] = lambda X: X.reshape(len(X), -1)  # what the target reads


def _mlp(act, norm=None, p=None):
    return lambda p_=None: MLP(act(), norm() if norm else None, p if p_ is None else p_)


TORCH_MODELS: dict[str, TorchSpec] = {
    "lenet": TorchSpec(lambda p=0.25: LeNet(p), (1, 8, 8), classes=3, stateful=True, lr=0.1),
    "gru": TorchSpec(lambda p=None: RNNRegressor("gru"), (5, 3), lr=0.1, summary=lambda X: X[:, -1]),
    "lstm": TorchSpec(lambda p=None: RNNRegressor("lstm"), (5, 3), lr=0.1, summary=lambda X: X[:, -1]),
    "transformer": TorchSpec(lambda p=0.1: Encoder(p), (4, 8), stateful=True, lr=0.05,
                             summary=lambda X: X.mean(axis=1)),
    "mlp_gelu": TorchSpec(_mlp(nn.GELU), (4,)),
    "mlp_gelu_tanh": TorchSpec(_mlp(lambda: nn.GELU(approximate="tanh")), (4,)),
    "mlp_silu": TorchSpec(_mlp(nn.SiLU), (4,)),
    "mlp_softplus": TorchSpec(_mlp(nn.Softplus), (4,)),
    "mlp_elu": TorchSpec(_mlp(nn.ELU), (4,)),
    "mlp_leakyrelu": TorchSpec(_mlp(lambda: nn.LeakyReLU(0.1)), (4,)),
    "mlp_layernorm": TorchSpec(_mlp(nn.Tanh, lambda: nn.LayerNorm(8)), (4,)),
    "mlp_batchnorm": TorchSpec(_mlp(nn.ReLU, lambda: nn.BatchNorm1d(8), p=0.2), (4,), stateful=True),
}


def make_module(name: str, p: float | None = None) -> nn.Module:
    """The model ``name`` with seeded weights; BatchNorm gets non-trivial affine weights and statistics."""
    torch.manual_seed(0)
    spec = TORCH_MODELS[name]
    return perturb(spec.build() if p is None else spec.build(p))


def perturb(module: nn.Module) -> nn.Module:
    """Seeded noise on every parameter, and non-trivial BatchNorm affine weights and statistics (in place)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        # NOTE: noise on every parameter: torch's ones/zeros initializations (LayerNorm, attention biases) are
        # equal tensors, which both exporters merge into one initializer (then no 1:1 match with torch)
        for param in module.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=gen))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
                m.running_mean.copy_(0.3 * torch.randn(m.running_mean.shape, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen))
    return module


def make_data(name: str, n: int = 96, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and a learnable target (a fixed nonlinear teacher of the inputs), float32."""
    spec = TORCH_MODELS[name]
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, *spec.shape)).astype(np.float32)
    flat = spec.summary(X)
    teacher = np.random.default_rng(123).normal(size=(flat.shape[1], max(spec.classes, 1)))
    score = np.tanh(flat @ teacher / np.sqrt(flat.shape[1]))
    if spec.classes:
        return X, score.argmax(axis=1).astype(np.int64)
    return X, (2 * score + 0.5).astype(np.float32)


def torch_loss(name: str, pred, y):
    """The loss onnxopt compiles for ``name`` (``cross_entropy`` or ``square``), computed by torch."""
    y = torch.as_tensor(y)
    if TORCH_MODELS[name].classes:
        return nn.functional.cross_entropy(pred, y)
    return nn.functional.mse_loss(pred, y.reshape(pred.shape))


def loss_name(name: str) -> str:
    return "cross_entropy" if TORCH_MODELS[name].classes else "square"


def export(module: nn.Module, x: np.ndarray, exporter: str) -> onnx.ModelProto:
    """``module`` exported by ``exporter`` (see the module docstring) with a dynamic batch axis."""
    args = (torch.from_numpy(x),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter in ("dynamo", "dynamo18"):
            kw = {"opset_version": 18} if exporter == "dynamo18" else {}
            batch = torch.export.Dim("batch", min=2)
            program = torch.onnx.export(module, args, dynamo=True, verbose=False,
                                        dynamic_shapes=({0: batch},), **kw)
            return program.model_proto
        buf = io.BytesIO()
        mode = torch.onnx.TrainingMode
        training = mode.TRAINING if exporter == "script_train" else mode.EVAL
        torch.onnx.export(module, args, buf, dynamo=False, training=training, input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
        return onnx.load_from_string(buf.getvalue())


_EXPORTS: dict[tuple[str, str, float | None], tuple[onnx.ModelProto, dict]] = {}


def _export_once(name: str, exporter: str, p: float | None) -> tuple[onnx.ModelProto, dict]:
    key = (name, exporter, p)
    if key not in _EXPORTS:
        module = make_module(name, p)
        module.train(exporter == "script_train")
        proto = export(module, make_data(name, n=4)[0], exporter)
        # NOTE: a training-mode export runs the module once: its BatchNorm statistics moved, as in the ONNX
        _EXPORTS[key] = proto, {k: v.clone() for k, v in module.state_dict().items()}
    return _EXPORTS[key]


def exported(name: str, exporter: str, p: float | None = None) -> onnx.ModelProto:
    """The export of ``make_module(name, p)`` by ``exporter``, made once per session.

    ``script_train`` exports the module in ``train()`` mode, every other exporter in ``eval()`` mode.
    """
    out = onnx.ModelProto()
    out.CopyFrom(_export_once(name, exporter, p)[0])
    return out


def exported_module(name: str, exporter: str, p: float | None = None) -> nn.Module:
    """``make_module(name, p)`` as it was right after its export (the state the ONNX model holds)."""
    module = make_module(name, p)
    module.load_state_dict(_export_once(name, exporter, p)[1])
    return module


TORCH_CASES = [f"{name}-{exporter}" for name in TORCH_MODELS for exporter in EXPORTERS] + [
    f"{name}-script_train" for name, spec in TORCH_MODELS.items() if spec.stateful
]


# ---------------------------------------------------------------------------------------------------------
# the torch module an export stands for, and where each ONNX weight lives in it


def reference_module(name: str, exporter: str, p: float | None = None) -> nn.Module:
    """The exported module in eval mode, with BatchNorm folded into the layer before it when the export
    folded it (dynamo always, TorchScript into Conv): then its parameters are the export's weights."""
    module = exported_module(name, exporter, p).eval()
    if any(n.op_type == "BatchNormalization" for n in exported(name, exporter, p).graph.node):
        return module
    from torch.nn.utils.fusion import fuse_conv_bn_eval, fuse_linear_bn_eval

    if isinstance(module, LeNet):
        module.conv, module.bn = fuse_conv_bn_eval(module.conv, module.bn), nn.Identity()
    elif isinstance(module, MLP) and isinstance(module.norm, nn.BatchNorm1d):
        module.fc1, module.norm = fuse_linear_bn_eval(module.fc1, module.norm), nn.Identity()
    return module


def flat_parameters(module: nn.Module) -> tuple[list[str], np.ndarray]:
    """Names and concatenated values of ``module.named_parameters()``."""
    names, values = zip(*[(n, p.detach().numpy().ravel()) for n, p in module.named_parameters()])
    return list(names), np.concatenate(values)


def locate(module: nn.Module, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Where every element of every ONNX weight sits in ``flat_parameters(module)`` (``common.locate``)."""
    return common_locate(dict(module.named_parameters()), weights)


def load_into(module: nn.Module, weights: dict[str, np.ndarray], where: dict[str, np.ndarray]) -> None:
    """Writes the ONNX ``weights`` into ``module``'s parameters at the places ``locate`` found."""
    _, flat = flat_parameters(module)
    flat = flat.copy()
    for wname, w in weights.items():
        flat[where[wname].ravel()] = w.ravel()
    start = 0
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.from_numpy(flat[start:start + param.numel()].reshape(param.shape)))
            start += param.numel()


def flat_gradients(module: nn.Module) -> np.ndarray:
    return np.concatenate([p.grad.numpy().ravel() for p in module.parameters()])
