"""The real-model workloads' torch networks, built from a seed: onnxopt trains their TorchScript export,
torch eager and torch.compile the same module (same initial weights).

- ``resnet``: a ResNet-style CNN on 3x32x32 images: a 3x3 stem, two basic blocks (the second downsamples
  with a strided 1x1 shortcut), Conv + BatchNorm + ReLU throughout, global average pooling, a Linear head;
  exported in training mode, trained with BatchNorm on batch statistics (``mode="train"``);
- ``encoder``: two ``TransformerEncoderLayer``s (d 64, 4 heads, feed-forward 128, no dropout) on sequences of
  32, mean pooling over time, a Linear head.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx

__all__ = ["build", "export"]


def build(arch: str, classes: int, seed: int = 0):
    """The torch module of ``arch`` ("resnet" or "encoder") with ``classes`` outputs, initialized from ``seed``."""
    import torch

    nn = torch.nn
    torch.manual_seed(seed)

    def conv_bn(cin, cout, stride=1, k=3):
        return [nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout)]

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.body = nn.Sequential(*conv_bn(cin, cout, stride), nn.ReLU(), *conv_bn(cout, cout))
            self.short = nn.Sequential(*conv_bn(cin, cout, stride, 1)) if stride > 1 or cin != cout else nn.Identity()

        def forward(self, x):
            return torch.relu(self.body(x) + self.short(x))

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            layer = lambda: nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)  # noqa: E731
            self.layers, self.head = nn.Sequential(layer(), layer()), nn.Linear(64, classes)

        def forward(self, x):
            return self.head(self.layers(x).mean(dim=1))

    if arch not in ("resnet", "encoder"):
        raise ValueError(f"arch: expected 'resnet' or 'encoder', got {arch!r}")
    module = Encoder() if arch == "encoder" else nn.Sequential(
        *conv_bn(3, 16), nn.ReLU(), Block(16, 16, 1), Block(16, 32, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(32, classes))
    with torch.no_grad():  # NOTE: no two equal tensors (zero biases, unit norms), which the exporter would merge
        for p in module.parameters():
            p.add_(0.01 * torch.randn(p.shape))
    return module


def export(module, x: np.ndarray, train: bool) -> onnx.ModelProto:
    """``module`` exported by TorchScript with a dynamic batch axis (in training mode when ``train``)."""
    import torch

    buf = io.BytesIO()
    mode = torch.onnx.TrainingMode.TRAINING if train else torch.onnx.TrainingMode.EVAL
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.train(train), (torch.from_numpy(x),), buf, dynamo=False, training=mode,
                          input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    return onnx.load_from_string(buf.getvalue())
