"""Signal processing: no rules of its own. DFT and STFT are rewritten into MatMuls with constant cos/sin tables
(given static shapes and constant lengths), MelWeightMatrix has a zero gradient definition.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxopt.autodiff.rewrite import _consts, _int_input, _k, _static, _table, rewrite, template

F = "signal"


# ==== rewrites ===========================================================================================


def _dft_core(op, x, length: int, bins: int, inverse: bool, like):
    """The DFT of x (..., length, 1 or 2: ``like``'s last axis) along axis -2 as MatMuls with constant cos/sin
    tables: (..., bins, 2)."""
    angle = 2 * np.pi * np.outer(np.arange(length), np.arange(bins)) / length
    cos, sin = _table(op, np.cos(angle), like), _table(op, np.sin(angle) * (1 if inverse else -1), like)
    last = op.Constant(value_ints=[-1])
    real = op.Squeeze(op.Slice(x, op.Constant(value_ints=[0]), op.Constant(value_ints=[1]), last), last)
    lead = op.Concat(op.Slice(op.Shape(real), op.Constant(value_ints=[0]), last), op.Constant(value_ints=[bins]), axis=0)

    def times(v, table):  # NOTE: as a 2-D MatMul: the batched MatMul gradient (FusedMatMul) is float only
        return op.Reshape(op.MatMul(op.Reshape(v, op.Constant(value_ints=[-1, length])), table), lead)

    re, im = times(real, cos), times(real, sin)
    if like.shape[-1] == 2:  # (a + ib)(cos + i·sin) = a·cos - b·sin + i(b·cos + a·sin)
        imag = op.Squeeze(op.Slice(x, op.Constant(value_ints=[1]), op.Constant(value_ints=[2]), last), last)
        re, im = op.Sub(re, times(imag, sin)), op.Add(im, times(imag, cos))
    if inverse:
        re, im = (op.Div(v, _k(op, float(length), like)) for v in (re, im))
    # NOTE: re·[1, 0] + im·[0, 1], not a Concat: the builder's Concat gradient has no float64 kernel
    return op.Add(op.Mul(op.Unsqueeze(re, last), _table(op, [1.0, 0.0], like)),
                  op.Mul(op.Unsqueeze(im, last), _table(op, [0.0, 1.0], like)))


def _dft_check(node: ir.Node) -> str | None:
    opset = node.graph.opset_imports.get("", 21) if node.graph is not None else 21
    if not _consts(node, 1, 2) or (opset < 20 and len(node.inputs) > 1 and node.inputs[1] is not None):
        return "dft_length and axis are not constants"
    return None if _static(node.inputs[0]) else "the shape is not static"


@rewrite("DFT", family=F, check=_dft_check)
def _dft(op, node, x, dft_length=None, axis=None):
    rank = len(x.shape)
    a = (_int_input(node, 2, [-2])[0] if node.graph is None or node.graph.opset_imports.get("", 21) >= 20
         else node.attributes.get_int("axis", 1)) % rank
    perm = [i for i in range(rank - 1) if i != a] + [a, rank - 1]
    y = op.Transpose(x, perm=perm) if a != rank - 2 else x
    n = x.shape[a]
    length = _int_input(node, 1, [n])[0]
    if length != n:  # NOTE: the signal is cut or padded with zeros to dft_length
        y = op.Slice(y, op.Constant(value_ints=[0]), op.Constant(value_ints=[length]), op.Constant(value_ints=[-2])) \
            if length < n else op.Pad(y, op.Constant(value_ints=[0] * (rank - 2) + [0, 0] + [0] * (rank - 2) + [length - n, 0]))
    bins = length // 2 + 1 if node.attributes.get_int("onesided", 0) else length
    y = _dft_core(op, y, length, bins, bool(node.attributes.get_int("inverse", 0)), x)
    return op.Transpose(y, perm=[int(i) for i in np.argsort(perm)]) if a != rank - 2 else y


def _stft_check(node: ir.Node) -> str | None:
    if not _consts(node, 1, 3) or not _static(node.inputs[0]):
        return "frame_step and frame_length are not constants or the shape is not static"
    window, length = node.inputs[2] if len(node.inputs) > 2 else None, node.inputs[3] if len(node.inputs) > 3 else None
    return None if window is not None or length is not None else "neither window nor frame_length is given"


@rewrite("STFT", family=F, check=_stft_check)
def _stft(op, node, signal, step, window=None, frame_length=None):
    """Frames gathered by a constant index table, windowed, then the DFT of each frame (``_dft_core``)."""
    n, hop = signal.shape[1], _int_input(node, 1)[0]
    length = _int_input(node, 3, [window.shape[0]] if window is not None else None)[0]
    frames = (n - length) // hop + 1
    index = np.arange(frames)[:, None] * hop + np.arange(length)[None, :]
    y = op.Gather(signal, op.Constant(value=ir.tensor(index.astype(np.int64))), axis=1)
    if window is not None:
        y = op.Mul(y, op.Reshape(window, op.Constant(value_ints=[length, 1])))
    bins = length // 2 + 1 if node.attributes.get_int("onesided", 1) else length
    return _dft_core(op, y, length, bins, False, signal)


# ---- gradient definitions: (op_type, inputs, outputs[, {attribute: value}]) per node, GI(0) = dL/dI(0)

# MelWeightMatrix: its triangles are built from integer bins (floors) of the edge frequencies; NOTE: the
# builder asks for no GI (the schema marks every input non-differentiable): an empty definition
template("MelWeightMatrix", [], family=F)
