"""The opset 22-24 forms torch's exporter writes train with onnxopt's rules (``onnxopt.autodiff.transformer``).

torch 2.13's dynamo exporter writes ``F.scaled_dot_product_attention`` (nn.TransformerEncoderLayer's too) as
ai.onnx Attention from opset 23, ``nn.RMSNorm`` as RMSNormalization, ``torch.onnx.ops.rotary_embedding`` as
RotaryEmbedding. Those exports' first SGD step is checked against torch autograd + torch.optim.SGD, and each
rule's attribute variants against float64 finite differences (``test_op_coverage._check``). The training
build (onnxruntime 1.19) loads opset <= 21 only: everything opset 23 here runs on stock onnxruntime >= 1.32.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import replace

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto

import onnxopt
from onnxopt.errors import ModelVersionError, NotDifferentiableError
from onnxopt.passes.lower import check_portable
from onnxopt.modelio import _NO_KERNEL_AFTER_21, load_model, runtime_limits
import test_op_coverage as C
from test_op_coverage import Case, _check

NEW_OPSETS = runtime_limits()[1] >= 23
needs_opset23 = pytest.mark.skipif(not NEW_OPSETS, reason=f"onnxruntime loads opset <= {runtime_limits()[1]}")
I64 = np.int64


# -- torch exports: the first SGD step against torch ------------------------------------------------------------
def _modules():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Encoder(nn.Module):
        """nn.TransformerEncoderLayer (pre-norm, GELU): Attention from opset 23, Softmax and MatMuls at 22."""

        def __init__(self):
            super().__init__()
            self.enc = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, activation="gelu",
                                                  norm_first=True)
            self.head = nn.Linear(16, 1)

        def forward(self, x):
            return self.head(self.enc(x).mean(1))

    class Block(nn.Module):
        """RMSNorm, rotary embeddings, causal grouped-query attention (4 query heads, 2 key/value heads), then a
        float bias mask (a trained parameter) and a boolean mask on the same heads, then Encoder's layer."""

        def __init__(self, d=16, hq=4, hkv=2, t=6):
            super().__init__()
            self.hq, self.hkv, self.hd = hq, hkv, d // hq
            self.norm = nn.RMSNorm(d)
            self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, hkv * self.hd), nn.Linear(d, hkv * self.hd)
            self.o, self.head = nn.Linear(d, d), nn.Linear(d, 1)
            self.enc = nn.TransformerEncoderLayer(d, 4, 32, dropout=0.0, batch_first=True)
            self.bias = nn.Parameter(0.1 * torch.randn(t, t))
            self.register_buffer("keep", (torch.rand(t, t) > 0.3) | torch.eye(t, dtype=torch.bool))
            inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
            angles = torch.outer(torch.arange(t).float(), inv)
            self.register_buffer("cos", angles.cos())
            self.register_buffer("sin", angles.sin())

        def rope(self, x, cos, sin):
            if torch.onnx.is_in_onnx_export():  # NOTE: torch has no autograd formula for this op: eager below
                return torch.onnx.ops.rotary_embedding(x, cos, sin)
            x1, x2 = x.chunk(2, dim=-1)
            cos, sin = cos[:, None], sin[:, None]
            return torch.cat([cos * x1 - sin * x2, sin * x1 + cos * x2], dim=-1)

        def forward(self, x):
            b, t, _ = x.shape
            h = self.norm(x)
            q = self.q(h).view(b, t, self.hq, self.hd).transpose(1, 2)
            k = self.k(h).view(b, t, self.hkv, self.hd).transpose(1, 2)
            v = self.v(h).view(b, t, self.hkv, self.hd).transpose(1, 2)
            cos, sin = self.cos[None].expand(b, t, -1), self.sin[None].expand(b, t, -1)
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
            a = a + F.scaled_dot_product_attention(a, kk, vv, attn_mask=self.bias)
            a = a + F.scaled_dot_product_attention(q, kk, a, attn_mask=self.keep)
            return self.head(self.enc(x + self.o(a.transpose(1, 2).reshape(b, t, -1))).mean(1))

    return {"encoder": Encoder, "block": Block}


@functools.cache
def _export(name: str, opset: int):
    import torch

    torch.manual_seed(0)
    module = _modules()[name]().eval()
    with torch.no_grad():  # NOTE: distinct values, so that each ONNX weight is found in torch's by value
        for param in module.parameters():
            param.copy_(0.2 * torch.randn_like(param) + 0.5 * (param.dim() == 1 and "norm" in str(param.shape)))
    x = torch.randn(4, 6, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.onnx.export(module, (x,), dynamo=True, opset_version=opset, verbose=False).model_proto
    return module, model


OPS = {("block", 23): {"Attention", "RMSNormalization", "RotaryEmbedding", "LayerNormalization"},
       ("encoder", 22): {"Softmax", "LayerNormalization", "Gelu"}}


@needs_opset23
@pytest.mark.parametrize("name,opset", list(OPS), ids=lambda v: str(v))
def test_first_sgd_step_follows_torch(name, opset):
    """The export's first SGD step (loss and every trained value) equals torch autograd + torch.optim.SGD."""
    import torch
    from zoo.models import flat_gradients, load_into, locate
    from zoo.common import assert_one_to_one

    module, model = _export(name, opset)
    assert OPS[name, opset] <= {n.op_type for n in model.graph.node}
    assert model.opset_import[0].version == opset and load_model(model).opset_imports[""] == opset  # not lowered
    lr = 0.1
    step = onnxopt.compile_train_step(model, loss="square", update="sgd", learning_rate=lr, gradient="onnxopt")
    initial = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name in step.weights}
    where = locate(module, initial)
    assert_one_to_one(where, dict(module.named_parameters()))
    load_into(module, initial, where)  # NOTE: torch runs on the export's exact values
    rng = np.random.default_rng(1)
    X, y = rng.normal(size=(4, 6, 16)).astype(np.float32), rng.normal(size=(4, 1)).astype(np.float32)
    runner = onnxopt.Runner(step)
    loss = runner.step(X, y)
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    opt.zero_grad()
    ref = torch.nn.functional.mse_loss(module(torch.from_numpy(X)), torch.from_numpy(y))
    ref.backward()
    grads = flat_gradients(module)
    opt.step()
    np.testing.assert_allclose(loss, ref.item(), rtol=1e-5)
    after = np.concatenate([p.detach().numpy().ravel() for p in module.parameters()])
    trained = runner.get_weights()
    for wname, places in where.items():
        moved = lr * np.abs(grads[places]).max()  # NOTE: what the step changes, the scale of the comparison
        np.testing.assert_allclose(trained[wname], after[places], rtol=0, atol=1e-4 * moved + 1e-7,
                                   err_msg=f"weight {wname!r}")
        assert np.abs(trained[wname] - initial[wname]).max() > 0.5 * moved, wname
    # NOTE: the portable step (standard ONNX only) is the same step
    portable = onnxopt.compile_train_step(model, loss="square", update="sgd", learning_rate=lr, portable=True)
    check_portable(portable.model)
    again = onnxopt.Runner(portable)
    np.testing.assert_allclose(again.step(X, y), loss, rtol=1e-6)
    for wname, value in again.get_weights().items():
        np.testing.assert_allclose(value, trained[wname], rtol=1e-5, atol=1e-7, err_msg=wname)


# -- each rule's attribute variants against float64 finite differences -------------------------------------------
def a(*inputs, outputs=1, **attrs) -> Case:
    return Case("Attention", list(inputs), attrs, outputs, opset=23)


def _mask(shape):
    return np.random.default_rng(3).random(shape) > 0.5


VARIANTS = [
    a("n:1,2,3,4", "n:1,2,5,4", "n:1,2,5,3"),  # cross attention, default scale
    a("n:2,3,8", "n:2,4,4", "n:2,4,6", q_num_heads=2, kv_num_heads=1, scale=0.7),  # 3-D inputs, GQA, scale
    a("n:1,4,3,2", "n:1,2,3,2", "n:1,2,3,2", "n:1,1,3,3", is_causal=1),  # GQA, causal, a broadcast float mask
    a("n:1,2,2,3", "n:1,2,2,3", "n:1,2,2,3", softcap=1.5),
    a("n:1,2,2,3", "n:1,2,2,3", "n:1,2,2,3", _mask((2, 2)) | np.eye(2, dtype=bool), outputs=3),  # bool mask,
    # present key/value outputs (K and V: their cotangents add to dK, dV)
    Case("RMSNormalization", ["n:2,3,4", "n:3,4"], {"axis": 1, "epsilon": 1e-3, "stash_type": TensorProto.DOUBLE},
         opset=23),
    Case("RMSNormalization", ["n:2,3,4", "n:4"], {"stash_type": TensorProto.FLOAT}, dtype=TensorProto.FLOAT,
         opset=23),
    *[Case("RotaryEmbedding", ["n:1,2,3,8", np.cos(np.arange(6.0)).reshape(1, 3, 2),
                               np.sin(np.arange(6.0)).reshape(1, 3, 2)],
           {"interleaved": inter, "rotary_embedding_dim": 4}, dtype=TensorProto.FLOAT, opset=23) for inter in (0, 1)],
    Case("RotaryEmbedding", ["n:2,3,8", np.cos(np.arange(10.0)).reshape(5, 2), np.sin(np.arange(10.0)).reshape(5, 2),
                             np.array([[0, 3, 4], [2, 1, 0]], I64)], {"num_heads": 2, "interleaved": 1},
         dtype=TensorProto.FLOAT, opset=23),
]


def _variant_id(case: Case) -> str:
    attrs = "-".join(f"{k}{v}" for k, v in case.attrs.items() if k != "stash_type")
    return f"{case.op}-{len(case.inputs)}in-{attrs}"


@needs_opset23
@pytest.mark.parametrize("case", VARIANTS, ids=_variant_id)
def test_rule_matches_finite_differences(case):
    """Every float input's gradient (Q, K, V, float masks, past keys and values, scale) against central
    differences: onnxruntime's in float64, onnx's float64 reference for float32-only kernels (RotaryEmbedding)."""
    _check(case, False)


# -- refusals ---------------------------------------------------------------------------------------------------
def _one_node(op: str, inputs: list[str], weights: dict, attrs: dict, opset: int = 23) -> onnx.ModelProto:
    names = list(dict.fromkeys(i for i in inputs if i and i not in weights))
    graph = oh.make_graph([oh.make_node(op, inputs, ["Y"], name="the_node", **attrs)], "g",
                          [oh.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names],
                          [oh.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                          [onnx.numpy_helper.from_array(v, k) for k, v in weights.items()])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)], ir_version=10)


@needs_opset23
def test_softcap_with_a_mask_is_refused_by_name():
    """onnxruntime masks after the softcap, onnx's reference before: no single derivative to give."""
    w = np.ones((1, 2, 3, 4), np.float32)
    model = _one_node("Attention", ["Q", "W", "W", "M"], {"W": w}, {"softcap": 2.0})
    with pytest.raises(NotDifferentiableError, match=r"Attention node 'the_node'.*softcap with a mask"):
        onnxopt.gradient_model(model, weights=["W"], gradient="onnxopt")


@needs_opset23
def test_a_key_value_cache_is_refused_by_name():
    """onnxruntime 1.32 infers the probabilities' shape without the cache: no backward can read them."""
    w = np.ones((1, 2, 3, 4), np.float32)
    model = _one_node("Attention", ["Q", "W", "W", "", "P", "P"], {"W": w}, {})
    with pytest.raises(NotDifferentiableError, match=r"Attention node 'the_node'.*past_key/past_value"):
        onnxopt.gradient_model(model, weights=["W"], gradient="onnxopt")


@needs_opset23
def test_trained_rotary_caches_are_refused_by_name():
    cos = np.ones((1, 3, 2), np.float32)
    model = _one_node("RotaryEmbedding", ["X", "C", "S"], {"C": cos}, {})
    with pytest.raises(NotDifferentiableError, match=r"RotaryEmbedding node 'the_node'.*cos_cache/sin_cache"):
        onnxopt.gradient_model(model, weights=["C"], gradient="onnxopt")


def test_an_opset_newer_than_onnx_knows_is_refused_by_name():
    newest = onnx.defs.onnx_opset_version()
    model = _one_node("Relu", ["X"], {}, {}, opset=newest + 1)
    with pytest.raises(ModelVersionError, match=rf"opset {newest + 1} of domain '' is unknown .*1\.\.{newest}"):
        onnxopt.compile_train_step(model, loss="square")


@pytest.mark.skipif(NEW_OPSETS, reason="the training build's onnxruntime loads opset <= 21")
def test_builder_on_opset23_names_the_ops_it_cannot_lower():
    """On the training build, an opset 23 model is lowered to 21 (onnx's converter) where no op changed;
    Attention, RMSNormalization, RotaryEmbedding have no opset-21 form: refused by name."""
    w = np.ones((4, 16), np.float32)
    model = _one_node("RMSNormalization", ["X", "S"], {"S": np.ones(16, np.float32)}, {})
    del w
    with pytest.raises(ModelVersionError, match=r"opset 23 .*\['RMSNormalization'\].*expected opset 18\.\.21"):
        onnxopt.compile_train_step(model, loss="square", gradient="builder")


# -- ops whose schema changed at opsets 22-24 (bfloat16 added, new attributes) keep matching their rules -----------
def _changed_cases() -> list[Case]:
    from test_op_coverage import CASES, EXACT, NATURE, ZERO, documented_statuses

    newest = onnx.defs.onnx_opset_version()
    changed = {s.name for s in onnx.defs.get_all_schemas_with_history()
               if s.domain == "" and 22 <= s.since_version <= newest}
    exact = documented_statuses()
    cases = [replace(case, opset=newest) for case in CASES if case.op in changed and case.opset < 22
             and case.op not in ZERO and case.op not in NATURE and exact.get(case.op, "").split(",")[0] in EXACT]
    return cases


@needs_opset23
@pytest.mark.parametrize("case", _changed_cases(), ids=lambda case: case.op)
def test_ops_changed_since_opset21_match_finite_differences(case):
    """Each op with a new schema at opsets 22-24, in a model of the newest opset, against finite differences
    (float64; where onnxruntime has no float64 kernel for the op, float32 against onnx's float64 reference).
    The ops onnxruntime 1.32 has no opset-22 kernel for are lowered to opset 21 when loaded (checked below)."""
    from test_op_coverage import NoForwardKernel

    if case.op in _NO_KERNEL_AFTER_21:
        rng = np.random.default_rng(0)
        feeds = {f"x{i}": C._value(v, rng) for i, v in enumerate(case.inputs) if isinstance(v, str)}
        model = load_model(C._model(case, feeds, False))
        assert model.opset_imports[""] == 21 and case.op in {n.op_type for n in model.graph}
        return
    try:
        _check(case, False)
    except NoForwardKernel:
        _check(replace(case, dtype=TensorProto.FLOAT), False)


@needs_opset23
def test_skl2onnx_default_opset_trains_as_opset_18():
    """skl2onnx writes opset 22 by default (ai.onnx.ml beside): loaded as is on stock onnxruntime, its steps
    equal those of the same pipeline converted at opset 18."""
    from skl2onnx import to_onnx
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, 4)).astype(np.float32)
    y = (X.sum(1) > 0).astype(np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = make_pipeline(StandardScaler(), LogisticRegression(C=0.1)).fit(X, y)
    losses = {}
    for opset in (None, 18):
        model = to_onnx(est, X[:1], options={"zipmap": False}, target_opset=opset)
        if opset is None:
            assert {i.domain: i.version for i in model.opset_import}[""] >= 22
            assert load_model(model).opset_imports[""] >= 22
        step = onnxopt.compile_train_step(model, loss="cross_entropy", learning_rate=0.05, output="probabilities")
        runner = onnxopt.Runner(step)
        losses[opset] = [runner.step(X, y) for _ in range(3)]
    np.testing.assert_allclose(losses[None], losses[18], rtol=1e-6)
    assert losses[18][2] < losses[18][0]


@needs_opset23
def test_hf_llama_with_sdpa_at_opset23_gradients_equal_autograd():
    """transformers' Llama (grouped-query heads, its own RMSNorm, the causal mask it computes from the
    attention mask) with attn_implementation "sdpa": exported as Attention + RMSNormalization at opset 23, its
    first step's gradients equal torch autograd."""
    import torch
    from zoo import models_hf as H
    from zoo.common import assert_gradients, gradient_out
    from zoo.models import load_into
    from zoo.test_hf_zoo import _flat_grads, _locate

    module = H.make_module("llama")
    module.model.config._attn_implementation = "sdpa"
    X, y = H.make_data("llama", n=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.onnx.export(module, (torch.from_numpy(X[:4]),), dynamo=True, opset_version=23, verbose=False,
                                  dynamic_shapes=({0: torch.export.Dim("batch")},)).model_proto
    assert {"Attention", "RMSNormalization"} <= {n.op_type for n in model.graph.node}
    step = onnxopt.compile_train_step(model, loss="cross_entropy", mode="eval", update=gradient_out)
    initial, runner = step.initial_weights(), onnxopt.Runner(step)
    loss = runner.step(X, y)
    grads = runner.get_weights()
    where = _locate(module, initial)
    load_into(module, initial, where)
    module.zero_grad()
    ref = torch.nn.functional.cross_entropy(module(torch.from_numpy(X)), torch.from_numpy(y))
    ref.backward()
    np.testing.assert_allclose(loss, ref.item(), rtol=1e-5)
    expected = _flat_grads(module)
    assert_gradients(grads, expected, where, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


@needs_opset23
def test_two_attentions_reading_one_query_get_distinct_probability_outputs():
    """Each Attention node's added probabilities output gets its own name (the model stays in SSA form), and
    the weight both read gets the sum of their gradients (float64 central differences)."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    w = rng.normal(size=(1, 2, 3, 4))
    nodes = [oh.make_node("Attention", ["Q", "W", "W"], ["a"]), oh.make_node("Attention", ["Q", "a", "W"], ["b"]),
             oh.make_node("Add", ["a", "b"], ["Y"])]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("Q", TensorProto.DOUBLE, [1, 2, 3, 4])],
                          [oh.make_tensor_value_info("Y", TensorProto.DOUBLE, [1, 2, 3, 4])],
                          [onnx.numpy_helper.from_array(w, "W")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 23)], ir_version=10)
    grad = onnxopt.gradient_model(model, weights=["W"], gradient="onnxopt")
    onnx.checker.check_model(grad)
    q, cot = rng.normal(size=(1, 2, 3, 4)), rng.normal(size=(1, 2, 3, 4))
    got = ort.InferenceSession(grad.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["W_grad"], {"Q": q, "W": w, "Y_grad": cot})[0]

    def loss(weights):
        model.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(weights, "W"))
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return float((sess.run(None, {"Q": q})[0] * cot).sum())

    expected = np.zeros_like(w)
    for idx in np.ndindex(w.shape):
        plus, minus = w.copy(), w.copy()
        plus[idx] += 1e-6
        minus[idx] -= 1e-6
        expected[idx] = (loss(plus) - loss(minus)) / 2e-6
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
