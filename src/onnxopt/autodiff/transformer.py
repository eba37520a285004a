"""The opset 23-24 ops torch's exporter writes: Attention, RMSNormalization, RotaryEmbedding (and Swish-24).

Each rule keeps the fused forward op and writes its backward in standard ops:

- ``Attention``: the forward node is asked for its softmax probabilities P (output ``qk_matmul_output`` with
  ``qk_matmul_output_mode=3``; the scores after ``softcap`` with mode 2 when a softcap is set), so masks, causal
  alignment and ``nonpad_kv_seqlen`` are the kernel's own (a key/value cache is refused); the backward is
  two batched products for dV and dP, the softmax's VJP, and two for dQ and dK (GQA: K and V repeated per
  query head, their gradients summed back per group).
- ``RMSNormalization``: ``1/rms`` recomputed from ``x``; ``dx = r·(ĝ - n·mean(ĝ·n))``, ĝ = dy·scale, n = x·r.
- ``RotaryEmbedding``: linear in ``x`` with an orthogonal rotation per pair, so ``dx`` is the same op applied to
  ``dy`` with ``-sin`` (the transposed rotation).
"""

from __future__ import annotations

import math

import onnx_ir as ir

from onnxopt.autodiff.engine import rule
from onnxopt.autodiff.linalg import _product
from onnxopt.errors import NotDifferentiableError
from onnxopt.passes.lower import _unbroadcast

F = "transformer"
_LOW = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _refuse(c, reason: str) -> None:
    node = c.node
    raise NotDifferentiableError(
        f"model: onnxopt cannot differentiate {node.op_type} node {node.name!r} (inputs "
        f"{[v.name if v is not None else '' for v in node.inputs]}): {reason}", [(node.op_type, node.name or "")])


def _heads_4d(c, x, heads: int):
    """(B, S, H·D) -> (B, H, S, D)."""
    return c.Transpose(c.Reshape(x, c.ints([0, 0, heads, -1])), perm=[0, 2, 1, 3])


def _back_3d(c, g, like):
    """(B, H, S, D) -> ``like``'s (B, S, H·D)."""
    return c.Reshape(c.Transpose(g, perm=[0, 2, 1, 3]), c.Shape(like))


def _static(c, value, axis: int):
    dims = c.dims(value) if value is not None else None
    return None if dims is None or len(dims) <= axis else dims[axis]


def _probabilities(c, mode: int):
    """The node's qk_matmul_output, added with ``mode`` (3: the softmax, 2: the scores after softcap)."""
    node = c.node
    outs = node.outputs
    if len(outs) > 3 and outs[3].name and (list(outs[3].uses()) or outs[3].is_graph_output()):
        if c.GO(3) is not None:
            _refuse(c, "a gradient reaches its qk_matmul_output output; expected only Y, present_key and "
                       "present_value to be differentiated")
        if c.attr("qk_matmul_output_mode", 0) != mode:
            _refuse(c, f"its qk_matmul_output is read with qk_matmul_output_mode={c.attr('qk_matmul_output_mode', 0)}"
                       f"; expected it unread or read with mode {mode}, the one its gradient needs")
        return outs[3]
    if len(outs) < 4:
        node.resize_outputs(4)
    out = node.outputs[3]
    out.type = c.I(0).type
    out.name = None  # NOTE: named by the engine (``_name_values``), unique in the graph
    node.attributes["qk_matmul_output_mode"] = ir.AttrInt64("qk_matmul_output_mode", mode)
    return out


def _repeat_heads(c, kv, q4, groups):
    """K or V (B, Hkv, L, D) repeated per query head (B, Hq, L, D): kv head j serves query heads j·g..j·g+g-1."""
    if groups == 1:
        return kv
    head_axis = c.Shape(q4, start=1, end=2)
    count = c.ints([groups]) if groups is not None else c.Div(head_axis, c.Shape(kv, start=1, end=2))
    expanded = c.Expand(c.Unsqueeze(kv, c.ints([2])), c.Concat(c.Shape(kv, start=0, end=2), count,
                                                              c.Shape(kv, start=2), axis=0))
    return c.Reshape(expanded, c.Concat(c.Shape(kv, start=0, end=1), head_axis, c.Shape(kv, start=2), axis=0))


def _sum_heads(c, g, kv, groups):
    """The gradient of ``_repeat_heads``: (B, Hq, L, D) summed per group back to ``kv``'s (B, Hkv, L, D)."""
    if groups == 1:
        return g
    shape = c.Concat(c.Shape(kv, start=0, end=2), c.ints([-1]), c.Shape(g, start=2), axis=0)
    return c.ReduceSum(c.Reshape(g, shape), c.ints([2]), keepdims=0)


@rule("Attention", family=F, inputs=(0, 1, 2, 3))
def _attention(c):
    """P from the kernel (qk_matmul_output, mode 3); dV = Pᵀ·dY, dP = dY·Vᵀ, dS = P·(dP - Σ dP·P),
    dQ = s·dS·K, dK = s·dSᵀ·Q (softcap: dS·(1 - (S'/cap)²)); a float mask: dS summed to its shape."""
    q, k, v, mask, past_k, past_v = (c.I(i) for i in range(6))
    softcap = float(c.attr("softcap", 0.0) or 0.0)
    if softcap > 0 and (mask is not None or c.attr("is_causal", 0)):
        _refuse(c, "softcap with a mask or is_causal (onnxruntime masks after the softcap, the ONNX reference "
                   "before); expected softcap=0 or no mask")
    if past_k is not None or past_v is not None:
        # NOTE: onnxruntime 1.32 infers qk_matmul_output's shape without the past keys ({1,2,2,2} for {1,2,2,5}),
        # so a backward reading it fails to load; exporters write past keys for inference only
        _refuse(c, "past_key/past_value inputs (a key/value cache); expected Attention without a cache in training")
    rank = c.rank(q)
    if rank not in (3, 4):
        _refuse(c, f"Q has rank {rank}; expected 3 or 4 (a known rank)")
    double = c.dtype(q) == ir.DataType.DOUBLE
    three = rank == 3
    hq, hkv = c.attr("q_num_heads"), c.attr("kv_num_heads")
    if three and (not hq or not hkv):
        _refuse(c, "3-D inputs without q_num_heads and kv_num_heads; expected both attributes")
    q4 = _heads_4d(c, q, hq) if three else q
    k4 = _heads_4d(c, k, hkv) if three else k
    v4 = _heads_4d(c, v, hkv) if three else v
    if not three:
        hq, hkv = _static(c, q, 1), _static(c, k, 1)
    groups = 1 if hq is not None and hq == hkv else (hq // hkv if hq and hkv and hq % hkv == 0 else None)
    k_all, v_all = k4, v4
    scores = _probabilities(c, 2 if softcap > 0 else 3)
    p = c.Softmax(scores, axis=-1) if softcap > 0 else scores
    dy = c.go(0)
    dy4 = _heads_4d(c, dy, hq) if three else dy
    dk_all = dv_all = dq = dmask = None
    if c.need(2):
        dv_all = _sum_heads(c, _product(c, p, dy4, True, False, (4, 4), double), v_all, groups)
        dv_all = dv_all if c.GO(2) is None else c.Add(dv_all, c.GO(2))  # NOTE: present_value is V (B, H, L, D)
    if c.need(0) or c.need(1) or c.need(3):
        dp = _product(c, dy4, _repeat_heads(c, v_all, q4, groups), False, True, (4, 4), double)
        ds = c.Mul(p, c.Sub(dp, c.ReduceSum(c.Mul(dp, p), c.ints([-1]), keepdims=1)))
        if softcap > 0:
            t = c.Div(scores, c.const(softcap, scores))
            ds = c.Mul(ds, c.Sub(c.const(1.0, t), c.Mul(t, t)))
        if c.need(3):  # NOTE: a float mask is added to the scores; a shorter one is padded with -inf (opset 24)
            ds_mask = c.Slice(ds, c.ints([0]), c.Shape(mask, start=-1), c.ints([-1]))
            dmask = _unbroadcast(c, ds_mask, mask)
        scale = c.attr("scale")
        if scale is None:
            d = _static(c, q4, 3) if not three else (_static(c, q, 2) // hq if _static(c, q, 2) else None)
            s = c.const(1.0 / math.sqrt(d), q) if d else c.Reciprocal(c.Sqrt(c.CastLike(c.Shape(q4, start=3), q)))
        else:
            s = c.const(float(scale), q)
        if c.need(0):
            dq = c.Mul(_product(c, ds, _repeat_heads(c, k_all, q4, groups), False, False, (4, 4), double), s)
            dq = _back_3d(c, dq, q) if three else dq
        if c.need(1):
            dk_all = _sum_heads(c, c.Mul(_product(c, ds, q4, True, False, (4, 4), double), s), k_all, groups)
            dk_all = dk_all if c.GO(1) is None else c.Add(dk_all, c.GO(1))

    dk = None if dk_all is None else _back_3d(c, dk_all, k) if three else dk_all
    dv = None if dv_all is None else _back_3d(c, dv_all, v) if three else dv_all
    return [dq, dk, dv, dmask]


@rule("RMSNormalization", family=F, inputs=(0, 1))
def _rms_norm(c):
    """n = x·r, r = 1/√(mean(x², axes) + ε); dx = r·(ĝ - n·mean(ĝ·n)), ĝ = dy·scale; dscale = Σ dy·n
    (float16/bfloat16 computed in float32 when stash_type=1, as the forward)."""
    x, scale, dy = c.I(0), c.I(1), c.go(0)
    rank = c.rank(x)
    if rank is None:
        _refuse(c, "the rank of X is unknown; expected a known rank to find the normalized axes")
    axis = c.attr("axis", -1)
    axes = c.ints(range(axis % rank, rank))
    low = c.dtype(x) in _LOW and c.attr("stash_type", 1) == 1
    xs, dys = (c.Cast(x, to=ir.DataType.FLOAT), c.Cast(dy, to=ir.DataType.FLOAT)) if low else (x, dy)
    eps = c.const(c.attr("epsilon", 1e-5), xs)
    r = c.Reciprocal(c.Sqrt(c.Add(c.ReduceMean(c.Mul(xs, xs), axes, keepdims=1), eps)))
    n = c.Mul(xs, r)
    dx = dscale = None
    if c.need(0):
        g = c.Mul(dys, c.Cast(scale, to=ir.DataType.FLOAT) if low else scale)
        dx = c.Mul(r, c.Sub(g, c.Mul(n, c.ReduceMean(c.Mul(g, n), axes, keepdims=1))))
        dx = c.Cast(dx, to=c.dtype(x)) if low else dx
    if c.need(1):
        dscale = c.unbroadcast(c.Mul(dy, c.Cast(n, to=c.dtype(x)) if low else n), 1)
    return [dx, dscale]


@rule("RotaryEmbedding", family=F, inputs=(0, 1, 2))
def _rotary_embedding(c):
    """dx = RotaryEmbedding(dy, cos, -sin): the transposed rotation (cos and sin caches: constants)."""
    cos, sin, position_ids = c.I(1), c.I(2), c.I(3)
    if c.need(1) or c.need(2):
        _refuse(c, f"its cos_cache/sin_cache ({cos.name!r}, {sin.name!r}) need a gradient; expected caches that "
                   "do not depend on a trained weight or a differentiated input")
    inputs = [c.go(0), cos, c.Neg(sin)] + ([position_ids] if position_ids is not None else [])
    attrs = c.attrs("interleaved", "rotary_embedding_dim", "num_heads")
    return [c.RotaryEmbedding(*inputs, **attrs)]


@rule("Swish", family="elementwise")
def _swish(c):
    """y = x·σ(αx) (opset 24): dx = dy·(σ + αx·σ·(1 - σ))."""
    x, dy = c.I(0), c.go(0)
    s = c.Sigmoid(c.Mul(x, c.const(c.attr("alpha", 1.0), x)))
    ax_s = c.Mul(c.Mul(x, c.const(c.attr("alpha", 1.0), x)), s)
    return [c.Mul(dy, c.Add(s, c.Mul(ax_s, c.Sub(c.const(1.0, s), s))))]
