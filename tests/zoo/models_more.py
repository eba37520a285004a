"""More torch models for the zoo (tests/zoo/test_more_exports.py): layers and ops the first zoo lacks.

Same scheme as ``zoo.models``: fixed seeds, noise on every parameter (no two equal tensors an exporter would
merge), exports made once per session by ``zoo.models.export`` (dynamo, dynamo18, script, script_train).
Each model is small; several activations or tensor ops share one model to keep the number of exports low.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx
import torch

from zoo.common import locate as common_locate
from zoo.models import export, perturb

nn = torch.nn
F = nn.functional


class Branches(nn.Module):
    """Linear(4, 6·k), chunked into k branches, one activation each, concatenated, Linear to 1."""

    def __init__(self, acts: list[nn.Module], width: int = 6):
        super().__init__()
        self.fc1, self.acts = nn.Linear(4, width * len(acts)), nn.ModuleList(acts)
        out = sum(act(torch.zeros(2, width)).shape[1] for act in acts)  # NOTE: GLU halves its branch
        self.fc2 = nn.Linear(out, 1)

    def forward(self, x):
        parts = torch.chunk(self.fc1(x), len(self.acts), dim=1)
        return self.fc2(torch.cat([act(p) for act, p in zip(self.acts, parts)], dim=1))


class SoftmaxHead(nn.Module):
    """Linear -> ReLU -> Linear -> Softmax: probabilities, trained with the cross-entropy on probabilities."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        return torch.softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


class MathOps(nn.Module):
    """Elementwise and reduction ops torch users write inline (normalize, pow, sqrt, exp, clamp, std, where,
    cumsum, einsum, max over a dim), a free Parameter, and one Linear applied twice (a tied weight)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.tensor([0.5, -0.3, 0.8, 0.1, 0.2, -0.6]))
        self.out = nn.Linear(10, 1)

    def forward(self, x):
        h = self.fc1(x)
        n = F.normalize(h, dim=1)
        a = torch.sqrt(h.pow(2) + 0.1) * torch.exp(-0.1 * torch.clamp(h, -2.0, 2.0))
        b = torch.where(h > 0, h, self.scale * h)
        c = torch.cumsum(self.fc2(torch.tanh(self.fc2(n))), dim=1) / 6  # NOTE: fc2 twice: a tied weight
        d = torch.einsum("ni,nj->n", a, b).unsqueeze(1) / 6
        e = torch.stack([h.std(dim=1), h.max(dim=1).values, h.amin(dim=1)], dim=1)
        return self.out(torch.cat([c, d, e], dim=1))


class BilinearNet(nn.Module):
    """nn.Bilinear on two Tanh(Linear) views of the input (TorchScript cannot export aten::bilinear)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 2)
        self.bil = nn.Bilinear(3, 2, 1)

    def forward(self, x):
        return self.bil(torch.tanh(self.a(x)), torch.tanh(self.b(x)))


class Conv1dBN(nn.Module):
    """Conv1d (stride, padding) -> BatchNorm1d -> ReLU6 -> MaxPool1d -> Conv1d (dilation) -> AdaptiveAvgPool1d
    -> Dropout -> Linear; (N, 2, 12)."""

    folds = [("c1", "bn")]

    def __init__(self, p: float = 0.2):
        super().__init__()
        self.c1, self.bn = nn.Conv1d(2, 6, 3, stride=2, padding=2), nn.BatchNorm1d(6)
        self.c2 = nn.Conv1d(6, 4, 2, dilation=2)
        self.drop, self.fc = nn.Dropout(p), nn.Linear(8, 1)

    def forward(self, x):
        h = self.c2(F.max_pool1d(F.relu6(self.bn(self.c1(x))), 2, stride=1))  # (N, 4, 4)
        return self.fc(self.drop(F.adaptive_avg_pool1d(h, 2)).flatten(1))


class Conv2dNet(nn.Module):
    """Conv2d (padding) + grouped Conv2d of its Hardswish -> AvgPool2d -> dilated Conv2d ->
    AdaptiveAvgPool2d."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, stride=1, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1, groups=2)
        self.pool = nn.AvgPool2d(2)
        self.c3 = nn.Conv2d(4, 6, 3, padding=2, dilation=2)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        h = self.c1(x)
        h = self.pool(h + self.c2(F.hardswish(h)))
        return self.fc(self.gap(self.c3(h)).flatten(1))


class Residual(nn.Module):
    """Conv -> BatchNorm2d -> ReLU -> Conv -> BatchNorm2d + x -> ReLU -> Dropout -> GAP -> Linear;
    2 classes."""

    folds = [("c1", "b1"), ("c2", "b2")]

    def __init__(self, p: float = 0.2):
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1)
        self.c1, self.b1 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.c2, self.b2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.drop = nn.Dropout(p)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        x = self.stem(x)
        h = self.b2(self.c2(F.relu(self.b1(self.c1(x)))))
        return self.fc(self.drop(F.relu(h + x)).mean(dim=(2, 3)))


class DeconvNet(nn.Module):
    """Conv2d stride 2 -> SiLU -> ConvTranspose2d stride 2 -> Upsample nearest x2 -> Conv -> Upsample
    bilinear x2
    -> AvgPool2d(10) -> Linear; (N, 1, 6, 6)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 3, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(3, 2, 2, stride=2)
        self.c2 = nn.Conv2d(2, 2, 3)
        self.fc = nn.Linear(8, 1)

    def forward(self, x):
        h = F.interpolate(self.up(F.silu(self.c1(x))), scale_factor=2, mode="nearest")
        h = F.interpolate(self.c2(h), scale_factor=2, mode="bilinear")  # (N, 2, 20, 20)
        return self.fc(F.avg_pool2d(h, 10).flatten(1))


class PoolPad(nn.Module):
    """ReflectionPad2d -> Conv -> MaxPool2d(ceil_mode) -> ZeroPad2d -> Conv -> PixelShuffle -> MaxPool2d.
    (TorchScript cannot export AdaptiveMaxPool2d of a dynamic shape.)"""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 4, 3)
        self.c2 = nn.Conv2d(4, 4, 3)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = F.relu(self.c1(F.pad(x, (1, 1, 1, 1), mode="reflect")))
        h = F.max_pool2d(h, 2, ceil_mode=True)  # (N, 4, 3, 3)
        h = F.pixel_shuffle(self.c2(F.pad(h, (1, 1, 1, 1))), 2)  # (N, 1, 6, 6)
        return self.fc(F.max_pool2d(h, 3).flatten(1))


class Conv3dNet(nn.Module):
    """Conv3d -> Tanh -> AvgPool3d -> Linear; (N, 1, 4, 4, 4)."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv3d(1, 3, 2)
        self.fc = nn.Linear(3, 1)

    def forward(self, x):
        return self.fc(F.avg_pool3d(torch.tanh(self.c(x)), 3).flatten(1))


class Pooling(nn.Module):
    """Conv -> ReLU -> AvgPool2d(2, ceil_mode) (timm's resnet10t downsample on an odd size) -> AvgPool2d(3, 2,
    padding 1, ceil_mode) -> AvgPool2d(3, 1, padding 1, count_include_pad) -> MaxPool2d(2, 1, padding 1,
    dilation 2, ceil_mode) -> Linear. (ceil_mode with count_include_pad: onnxruntime divides the last windows
    by the kernel's size, torch by their part inside the pads; test_lower checks that form.)"""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(2, 4, 3, padding=1)
        self.fc = nn.Linear(36, 3)

    def forward(self, x):
        h = F.avg_pool2d(F.relu(self.c(x)), 2, ceil_mode=True, count_include_pad=False)  # (N, 4, 4, 4)
        h = F.avg_pool2d(h, 3, 2, padding=1, ceil_mode=True, count_include_pad=False)  # (N, 4, 3, 3)
        h = F.avg_pool2d(h, 3, 1, padding=1, count_include_pad=True)
        return self.fc(F.max_pool2d(h, 2, 1, padding=1, dilation=2, ceil_mode=True).flatten(1))


class RMSGelu(nn.Module):
    """Linear -> RMS normalization and GPT-2's tanh GELU written out (TorchScript's export of them becomes
    SimplifiedLayerNormalization and FastGelu in the training build's step) -> Linear."""

    def __init__(self):
        super().__init__()
        self.fc, self.scale, self.out = nn.Linear(4, 8), nn.Parameter(torch.linspace(0.5, 1.5, 8)), nn.Linear(8, 1)

    def forward(self, x):
        h = self.fc(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale
        return self.out(0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0)))))


class Norms(nn.Module):
    """A 1x1 Conv1d on (N, 3, 5), then GroupNorm, InstanceNorm1d (affine) and LayerNorm without affine side by
    side, Tanh, flattened, Linear."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv1d(3, 4, 1)
        self.norms = nn.ModuleList([nn.GroupNorm(2, 4), nn.InstanceNorm1d(4, affine=True),
                                    nn.LayerNorm(5, elementwise_affine=False)])
        self.fc = nn.Linear(60, 1)

    def forward(self, x):
        h = self.c(x)
        return self.fc(torch.cat([torch.tanh(norm(h)).flatten(1) for norm in self.norms], dim=1))


class Attention(nn.Module):
    """nn.MultiheadAttention self-attention (batch_first, 2 heads) + residual, mean over time, Linear."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.fc = nn.Linear(8, 1)

    def forward(self, x):
        h, _ = self.attn(x, x, x, need_weights=False)
        return self.fc((h + x).mean(dim=1))


class TensorOps(nn.Module):
    """split / permute / transpose / matmul / cat between two Linear layers; (N, 3, 4)."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)
        self.fc = nn.Linear(6, 1)

    def forward(self, x):
        a, b = torch.split(self.q(x), [1, 3], dim=2)  # (N, 3, 1), (N, 3, 3)
        scores = torch.matmul(self.k(x), x.transpose(1, 2))  # (N, 3, 3)
        h = torch.cat([b, scores.permute(0, 2, 1)], dim=2) * torch.sigmoid(a)  # (N, 3, 6)
        return self.fc(h.sum(dim=1))


class BiRNN(nn.Module):
    """A bidirectional GRU and a 2-layer bidirectional LSTM side by side over (N, 5, 3), Linear on the GRU's
    last step and the LSTM's final hidden and cell states."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(3, 4, bidirectional=True, batch_first=True)
        self.lstm = nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(20, 1)

    def forward(self, x):
        _, (h, c) = self.lstm(x)  # NOTE: the last LSTM layer's Y_h and Y_c read, its Y not (an unused output)
        return self.head(torch.cat([self.gru(x)[0][:, -1], h[-1], c[-2], h[-3]], dim=1))


class GRU2(nn.Module):
    """2-layer unidirectional GRU (its initial state given), Linear on the last step."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(3, 4, num_layers=2, batch_first=True)
        self.h0 = nn.Parameter(0.1 * torch.ones(2, 1, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        out, _ = self.rnn(x, self.h0.expand(2, x.shape[0], 4).contiguous())
        return self.head(out[:, -1])


class EmbeddingBag(nn.Module):
    """Embedding of integer tokens (N, 6) in [0, 10), mean over tokens, Linear; 3 classes, LogSoftmax."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(10, 5), nn.Linear(5, 3)

    def forward(self, x):
        return F.log_softmax(self.fc(self.emb(x).mean(dim=1)), dim=1)


class TiedParts(nn.Module):
    """A Parameter read whole, transposed and in part (``W[:4]``), and a (2,) Parameter repeated
    (``repeat_interleave``): both exporters fold the part and the repeat into initializers of their own
    (``passes.tie`` ties them back to W and p)."""

    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(0.4 * torch.randn(6, 4))
        self.p = nn.Parameter(torch.tensor([0.3, -0.2]))
        self.out = nn.Linear(12, 1)

    def forward(self, x):
        h = torch.tanh(x @ self.W.t())  # (N, 6)
        r = h @ self.W + F.linear(x, self.W[:4])  # (N, 4)
        # NOTE: p read as it is too: dynamo folds a parameter read only through repeat_interleave into that
        # copy alone (p is then not in the ONNX model at all, nothing to tie it to)
        return self.out(torch.cat([r, h * self.p.repeat_interleave(3), r[:, :2] * self.p], dim=1))


class AttentionMasks(nn.Module):
    """nn.MultiheadAttention with a boolean causal ``attn_mask`` buffer (exported as a constant of 0 and -inf,
    not a weight), a ``key_padding_mask`` from the input and its averaged weights read; then
    F.scaled_dot_product_attention(is_causal=True) of a Linear's heads; (N, 4, 8)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.register_buffer("causal", torch.triu(torch.ones(4, 4, dtype=torch.bool), 1))
        self.qkv = nn.Linear(8, 24)
        self.fc = nn.Linear(20, 1)

    def forward(self, x):
        padding = (x[:, :, 0] > 1.0) & (torch.arange(4) > 0)  # NOTE: the first key is never masked
        h, w = self.attn(x, x, x, key_padding_mask=padding, attn_mask=self.causal, need_weights=True)
        q, k, v = self.qkv(h).reshape(x.shape[0], 4, 3, 2, 4).permute(2, 0, 3, 1, 4)
        s = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape[0], 4, 8)
        return self.fc(torch.cat([h.mean(dim=1), s.mean(dim=1), w.mean(dim=1)], dim=1))


class ConvSame(nn.Module):
    """Conv1d(padding="same") grouped (TorchScript writes auto_pad=SAME_UPPER), Conv1d(padding="same") of an
    even kernel (one more pad at the end) without bias, ConvTranspose1d (stride 2, output_padding), mean over
    time, Linear; (N, 2, 6). (onnxruntime cannot run SAME_UPPER with a dilation: torch's dilated "same" Conv
    exported by TorchScript does not run at all.)"""

    def __init__(self):
        super().__init__()
        self.dw = nn.Conv1d(2, 4, 3, groups=2, padding="same")
        self.c = nn.Conv1d(4, 4, 2, padding="same", bias=False)
        self.tc = nn.ConvTranspose1d(4, 2, 3, stride=2, padding=1, output_padding=1)
        self.fc = nn.Linear(2, 1)

    def forward(self, x):
        return self.fc(self.tc(torch.tanh(self.c(torch.tanh(self.dw(x))))).mean(dim=2))


class Interpolate(nn.Module):
    """Conv -> F.interpolate to a size (bilinear, align_corners; the exporters compute the sizes from the input's
    shape) -> Conv stride 2 -> F.interpolate by a scale (bicubic) and to a smaller size (bicubic,
    align_corners) -> Linear; (N, 1, 6, 6)."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 2, 3), nn.Conv2d(2, 2, 3, stride=2)
        self.fc = nn.Linear(2 * 4 * 3 + 2 * 2 * 2, 1)

    def forward(self, x):
        h = self.c2(F.interpolate(self.c1(x), size=(7, 6), mode="bilinear", align_corners=True))  # (N, 2, 3, 2)
        a = F.interpolate(h, scale_factor=(1.5, 1.5), mode="bicubic")  # (N, 2, 4, 3)
        b = F.interpolate(h, size=(2, 2), mode="bicubic", align_corners=True)
        return self.fc(torch.cat([a.flatten(1), b.flatten(1)], dim=1))


class TensorOps2(nn.Module):
    """Ops users write inline: clamp by Parameter bounds, amax/amin, torch.maximum, topk and sort values,
    unbind/stack, flip/roll, masked_fill and where with scalars, gather/index_select by buffers, logsumexp,
    var/std with a correction, norms p=1/2/inf, cosine similarity, torch.tile (TorchScript: an If on the rank),
    torch.diagonal of a batch (TorchScript: an If on the sizes, GatherND batch_dims=1); one (1,) Parameter
    broadcast."""

    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(4, 6), nn.Linear(4, 6)
        self.lo = nn.Parameter(torch.linspace(-0.5, -0.1, 6))
        self.hi = nn.Parameter(torch.linspace(0.1, 0.6, 6))
        self.s = nn.Parameter(torch.tensor([1.3]))
        self.register_buffer("idx", torch.tensor([[0, 2, 2]]))
        self.register_buffer("sel", torch.tensor([4, 0, 1]))
        self.out = nn.Linear(49, 1)

    def forward(self, x):
        h, z = self.fc(x) * self.s, self.fc2(x)
        g = h.reshape(-1, 2, 3)
        a, b, c = torch.unbind(h.reshape(-1, 3, 2), 1)
        parts = [torch.clamp(h, self.lo, self.hi), g.amax(2), g.amin((1, 2))[:, None],
                 torch.maximum(h[:, :2], z[:, :2]), torch.topk(h, 3).values, torch.sort(z, 1).values[:, :3],
                 torch.stack([a * b, c], 2).flatten(1), torch.roll(h.flip(1), 2, 1)[:, :3],
                 h.masked_fill(h > 0.2, 0.5)[:, :3], torch.where(z > 0, z, 0.0)[:, :3],
                 torch.gather(h, 1, self.idx.expand(h.shape[0], 3)), torch.index_select(z, 1, self.sel),
                 torch.logsumexp(g, 2), torch.tile(z, (2,))[:, 4:7],
                 torch.diagonal(g, dim1=1, dim2=2), torch.stack([h.var(1, correction=0), z.std(1), torch.norm(g, p=1, dim=(1, 2)),
                                                     torch.norm(h, p=float("inf"), dim=1),
                                                     torch.linalg.vector_norm(z, dim=1),
                                                     F.cosine_similarity(h, z)], 1)]
        return self.out(torch.cat(parts, 1))


# ---------------------------------------------------------------------------------------------------------
# architectures users hand over whole (the second sweep): blocks of MobileNetV2, SENet, U-Net, DenseNet, an
# LSTM language model with tied embeddings, a text CNN, a ViT, an MLP-Mixer, a Siamese net, GroupNorm, a VAE


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expansion, depthwise 3x3 (groups = channels), 1x1 projection, each Conv
    without bias and followed by BatchNorm2d (ReLU6 after the first two), plus the input; GAP, Dropout, Linear."""

    folds = [("expand", "b1"), ("depthwise", "b2"), ("project", "b3")]

    def __init__(self, p: float = 0.2):
        super().__init__()
        self.expand, self.b1 = nn.Conv2d(4, 12, 1, bias=False), nn.BatchNorm2d(12)
        self.depthwise, self.b2 = nn.Conv2d(12, 12, 3, padding=1, groups=12, bias=False), nn.BatchNorm2d(12)
        self.project, self.b3 = nn.Conv2d(12, 4, 1, bias=False), nn.BatchNorm2d(4)
        self.drop, self.fc = nn.Dropout(p), nn.Linear(4, 3)

    def forward(self, x):
        h = F.relu6(self.b2(self.depthwise(F.relu6(self.b1(self.expand(x))))))
        return self.fc(self.drop((x + self.b3(self.project(h))).mean(dim=(2, 3))))


class SqueezeExcite(nn.Module):
    """Conv -> ReLU, scaled per channel by Sigmoid(Linear(ReLU(Linear(GAP)))); GAP, Linear."""

    def __init__(self):
        super().__init__()
        self.conv, self.squeeze, self.excite, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 2), \
            nn.Linear(2, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = F.relu(self.conv(x))
        w = torch.sigmoid(self.excite(F.relu(self.squeeze(F.adaptive_avg_pool2d(h, 1).flatten(1)))))
        return self.fc((h * w[:, :, None, None]).mean(dim=(2, 3)))


class SmallUNet(nn.Module):
    """Conv, MaxPool, Conv, ConvTranspose2d (stride 2) concatenated with the skip, Conv, 1x1 Conv; the map's mean."""

    def __init__(self):
        super().__init__()
        self.e1, self.e2 = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 8, 3, padding=1)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.d, self.out = nn.Conv2d(8, 4, 3, padding=1), nn.Conv2d(4, 1, 1)

    def forward(self, x):
        skip = F.relu(self.e1(x))
        h = torch.cat([self.up(F.relu(self.e2(F.max_pool2d(skip, 2)))), skip], dim=1)
        return self.out(F.relu(self.d(h))).mean(dim=(2, 3))


class LSTMLanguageModel(nn.Module):
    """Embedding, 2-layer LSTM, Dropout, Linear whose weight is the embedding's (tied); predicts the token after
    the sequence from the last step. NOTE: no dropout between the LSTM layers: TorchScript refuses to export it
    in training mode ("dropout in training mode"), and eval exports drop it (checked by hand: same graph)."""

    def __init__(self, p: float = 0.1):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.rnn = nn.LSTM(8, 8, num_layers=2, batch_first=True)
        self.drop, self.dec = nn.Dropout(p), nn.Linear(8, 20)
        self.dec.weight = self.emb.weight

    def forward(self, x):
        h, _ = self.rnn(self.emb(x))
        return self.dec(self.drop(h[:, -1]))


class TextCNN(nn.Module):
    """Embedding, Conv1d over time, ReLU, max over time, Dropout, Linear."""

    def __init__(self, p: float = 0.2):
        super().__init__()
        self.emb, self.conv = nn.Embedding(20, 6), nn.Conv1d(6, 8, 3, padding=1)
        self.drop, self.fc = nn.Dropout(p), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.drop(F.relu(self.conv(self.emb(x).transpose(1, 2))).max(dim=2).values))


class TinyViT(nn.Module):
    """Conv patch embedding (4x4 patches), a class token and positional embeddings (nn.Parameter), pre-norm
    MultiheadAttention and GELU MLP with residuals, LayerNorm, Linear on the class token."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(1, 8, 4, stride=4)
        self.cls, self.pos = nn.Parameter(torch.zeros(1, 1, 8)), nn.Parameter(torch.zeros(1, 5, 8))
        self.n1, self.n2, self.n3 = nn.LayerNorm(8), nn.LayerNorm(8), nn.LayerNorm(8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        t = self.patch(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls.expand(x.shape[0], -1, -1), t], dim=1) + self.pos
        h = self.n1(t)
        t = t + self.attn(h, h, h, need_weights=False)[0]
        t = t + self.mlp(self.n2(t))
        return self.head(self.n3(t)[:, 0])


class MixerBlock(nn.Module):
    """MLP-Mixer: a token-mixing MLP (on the transposed tokens) and a channel-mixing MLP, LayerNorm and a
    residual each; mean over tokens, Linear."""

    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(6), nn.LayerNorm(6)
        self.tokens = nn.Sequential(nn.Linear(5, 8), nn.GELU(), nn.Linear(8, 5))
        self.channels = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        x = x + self.tokens(self.n1(x).transpose(1, 2)).transpose(1, 2)
        return self.head((x + self.channels(self.n2(x))).mean(dim=1))


class Siamese(nn.Module):
    """One encoder applied to both halves of (N, 2, 4); Linear on |e(a) - e(b)| (a weight used twice)."""

    def __init__(self):
        super().__init__()
        self.enc, self.head = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)), nn.Linear(4, 1)

    def forward(self, x):
        return self.head(torch.abs(self.enc(x[:, 0]) - self.enc(x[:, 1])))


class GroupNormCNN(nn.Module):
    """Conv -> GroupNorm(3, 6) -> ReLU -> Conv -> GroupNorm(2, 4) -> SiLU -> GAP -> Linear."""

    def __init__(self):
        super().__init__()
        self.c1, self.g1 = nn.Conv2d(2, 6, 3, padding=1), nn.GroupNorm(3, 6)
        self.c2, self.g2 = nn.Conv2d(6, 4, 3), nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = F.silu(self.g2(self.c2(F.relu(self.g1(self.c1(x))))))
        return self.fc(h.mean(dim=(2, 3)))


class VAE(nn.Module):
    """Encoder to (mu, logvar), z = mu + exp(logvar / 2)·eps, decoder; (N, 8) = 6 features, then the noise eps
    (2 columns: the one data input Runner feeds); the reconstruction."""

    def __init__(self):
        super().__init__()
        self.enc, self.mu, self.logvar = nn.Linear(6, 8), nn.Linear(8, 2), nn.Linear(8, 2)
        self.dec = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        h = torch.tanh(self.enc(x[:, :6]))
        return self.dec(self.mu(h) + torch.exp(0.5 * self.logvar(h)) * x[:, 6:])


@dataclasses.dataclass
class Spec:
    """How to build one model and its data (see ``zoo.models.TorchSpec``)."""

    build: Callable[..., nn.Module]  # build() or build(p) for models with Dropout
    shape: tuple[int, ...]
    loss: str = "square"  # "square" on (N, 1); "cross_entropy" on logits; "nll" on log-probabilities; "proba"
    classes: int = 0
    stateful: bool = False
    lr: float = 0.05
    tokens: int = 0  # > 0: int64 inputs in [0, tokens)
    summary: Callable[[np.ndarray], np.ndarray] = lambda X: X.reshape(len(X), -1)


def _standardized(X: np.ndarray) -> np.ndarray:
    """X standardized along its last axis (what survives a normalization over it), flattened."""
    return ((X - X.mean(axis=-1, keepdims=True)) / X.std(axis=-1, keepdims=True)).reshape(len(X), -1)


def _branches(*acts):
    return lambda: Branches([a() for a in acts])


MODELS: dict[str, Spec] = {
    "activations": Spec(_branches(nn.Hardswish, nn.Hardsigmoid, nn.ReLU6, nn.Mish, nn.SELU, nn.CELU,
                                  nn.Softsign, nn.LogSigmoid, nn.Tanhshrink, nn.Hardtanh,
                                  lambda: nn.Softshrink(0.2), lambda: nn.Hardshrink(0.2),
                                  lambda: nn.Softmin(dim=1), nn.GLU, lambda: nn.PReLU(6)), (4,)),
    "softmax_head": Spec(SoftmaxHead, (4,), loss="proba", classes=3, lr=0.3),
    "math_ops": Spec(MathOps, (4,)),
    "bilinear": Spec(BilinearNet, (4,)),
    "conv1d_bn": Spec(lambda p=0.2: Conv1dBN(p), (2, 12), stateful=True, lr=0.1,
                      summary=lambda X: X[:, :, ::3].reshape(len(X), -1)),
    "conv2d": Spec(Conv2dNet, (2, 6, 6), loss="cross_entropy", classes=3, lr=0.5,
                   summary=lambda X: 6 * X.mean(axis=(2, 3))),
    "residual": Spec(lambda p=0.2: Residual(p), (1, 5, 5), loss="cross_entropy", classes=2, stateful=True,
                     lr=0.3, summary=lambda X: 5 * X.mean(axis=(2, 3))),
    "deconv": Spec(DeconvNet, (1, 6, 6), lr=0.1, summary=lambda X: 2 * X[:, :, 1:5, 1:5].mean(axis=(2, 3))),
    "pool_pad": Spec(PoolPad, (1, 6, 6), loss="cross_entropy", classes=3, lr=0.3,
                     summary=lambda X: 6 * X.mean(axis=(2, 3))),
    "pooling": Spec(Pooling, (2, 7, 7), loss="cross_entropy", classes=3, lr=0.3,
                    summary=lambda X: 7 * X.mean(axis=(2, 3))),
    "rms_gelu": Spec(RMSGelu, (4,)),
    "conv3d": Spec(Conv3dNet, (1, 4, 4, 4), lr=0.1,
                   summary=lambda X: 4 * X[:, :, 1:3, 1:3, 1:3].mean(axis=(2, 3, 4))),
    "norms": Spec(Norms, (3, 5), summary=_standardized),
    "attention": Spec(Attention, (4, 8), summary=lambda X: X.mean(axis=1)),
    "tensor_ops": Spec(TensorOps, (3, 4)),
    "birnn": Spec(BiRNN, (5, 3), lr=0.2, summary=lambda X: X[:, -1]),
    "gru2": Spec(GRU2, (5, 3), lr=0.2, summary=lambda X: X[:, -1]),
    "embedding": Spec(EmbeddingBag, (6,), loss="nll", classes=3, lr=0.5, tokens=10),
    "tied_parts": Spec(TiedParts, (4,)),
    "attention_masks": Spec(AttentionMasks, (4, 8), summary=lambda X: X.mean(axis=1)),
    "conv_same": Spec(ConvSame, (2, 6), lr=0.3, summary=lambda X: X.mean(axis=2)),
    "tensor_ops2": Spec(TensorOps2, (4,)),
    "interpolate": Spec(Interpolate, (1, 6, 6), lr=0.1, summary=lambda X: 2 * X[:, :, 1:5, 1:5].mean(axis=(2, 3))),
    "inverted_residual": Spec(lambda p=0.2: InvertedResidual(p), (4, 6, 6), loss="cross_entropy", classes=3,
                              stateful=True, lr=0.3, summary=lambda X: 6 * X.mean(axis=(2, 3))),
    "squeeze_excite": Spec(SqueezeExcite, (3, 6, 6), loss="cross_entropy", classes=3, lr=1.0,
                           summary=lambda X: 6 * X.mean(axis=(2, 3))),
    "unet": Spec(SmallUNet, (1, 8, 8), lr=0.1, summary=lambda X: 2 * X[:, :, 2:6, 2:6].mean(axis=(2, 3))),
    "lstm_lm": Spec(lambda p=0.1: LSTMLanguageModel(p), (7,), loss="cross_entropy", classes=20, stateful=True,
                    lr=0.5, tokens=20),
    "text_cnn": Spec(lambda p=0.2: TextCNN(p), (9,), loss="cross_entropy", classes=3, stateful=True, lr=0.5,
                     tokens=20),
    "vit": Spec(TinyViT, (1, 8, 8), loss="cross_entropy", classes=3, lr=0.1,
                summary=lambda X: 4 * X.reshape(len(X), 2, 4, 2, 4).mean(axis=(2, 4)).reshape(len(X), -1)),
    "mixer": Spec(MixerBlock, (5, 6), summary=_standardized),
    "siamese": Spec(Siamese, (2, 4), summary=lambda X: np.abs(X[:, 0] - X[:, 1])),
    "groupnorm": Spec(GroupNormCNN, (2, 6, 6), loss="cross_entropy", classes=3, lr=0.3,
                      summary=lambda X: 6 * X.mean(axis=(2, 3))),
    "vae": Spec(VAE, (8,), summary=lambda X: X[:, :6]),
}


def make_module(name: str, p: float | None = None) -> nn.Module:
    torch.manual_seed(0)
    spec = MODELS[name]
    return perturb(spec.build() if p is None else spec.build(p))


def make_data(name: str, n: int = 96, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and a learnable target (a fixed nonlinear teacher of the inputs)."""
    spec = MODELS[name]
    rng = np.random.default_rng(seed)
    if spec.tokens:
        X = rng.integers(0, spec.tokens, size=(n, *spec.shape)).astype(np.int64)
        flat = np.eye(spec.tokens)[X].mean(axis=1)
    else:
        X = rng.normal(size=(n, *spec.shape)).astype(np.float32)
        flat = spec.summary(X)
    teacher = np.random.default_rng(123).normal(size=(flat.shape[1], max(spec.classes, 1)))
    score = np.tanh(flat @ teacher / np.sqrt(flat.shape[1]) * (4 if spec.tokens else 1))
    if spec.classes:
        return X, score.argmax(axis=1).astype(np.int64)
    return X, (2 * score + 0.5).astype(np.float32)


def torch_loss(name: str, pred, y):
    y = torch.as_tensor(y)
    loss = MODELS[name].loss
    if loss == "nll":
        return F.nll_loss(pred, y)
    if loss == "proba":
        return F.nll_loss(torch.log(pred), y)
    if loss == "cross_entropy":
        return F.cross_entropy(pred, y)
    return F.mse_loss(pred, y.reshape(pred.shape))


def loss_name(name: str) -> str:
    """What onnxopt compiles: cross-entropy on raw scores for log-probabilities too (log_softmax is
    idempotent: the softmax cross-entropy of log-probabilities is their negative log-likelihood)."""
    loss = MODELS[name].loss
    if loss == "proba":
        from onnxopt import dsl

        return dsl.losses.cross_entropy(from_logits=False)
    return "square" if loss == "square" else "cross_entropy"


_EXPORTS: dict[tuple[str, str, float | None], tuple[onnx.ModelProto, dict]] = {}


def _export_once(name: str, exporter: str, p: float | None):
    key = (name, exporter, p)
    if key not in _EXPORTS:
        module = make_module(name, p)
        module.train(exporter == "script_train")
        proto = export(module, make_data(name, n=4)[0], exporter)
        _EXPORTS[key] = proto, {k: v.clone() for k, v in module.state_dict().items()}
    return _EXPORTS[key]


def exported(name: str, exporter: str, p: float | None = None) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(_export_once(name, exporter, p)[0])
    return out


def exported_module(name: str, exporter: str, p: float | None = None) -> nn.Module:
    module = make_module(name, p)
    module.load_state_dict(_export_once(name, exporter, p)[1])
    return module


def reference_module(name: str, exporter: str, p: float | None = None) -> nn.Module:
    """The exported module in eval mode, BatchNorm folded into its Conv when the export has none left."""
    module = exported_module(name, exporter, p).eval()
    if any(n.op_type == "BatchNormalization" for n in exported(name, exporter, p).graph.node):
        return module
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    for conv, bn in getattr(module, "folds", []):
        setattr(module, conv, fuse_conv_bn_eval(getattr(module, conv), getattr(module, bn)))
        setattr(module, bn, nn.Identity())
    for param in module.parameters():  # NOTE: the bias folding gives a Conv(bias=False) does not require grad
        param.requires_grad_(True)
    return module


def locate(module: nn.Module, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return common_locate(dict(module.named_parameters()), weights)
