"""Portable steps of exported models (torch.onnx, both exporters): the lowered step trains as the training
build's own kernels do, step by step, for a model using each lowering that only exporters' graphs bring
(FusedMatMul from batched MatMuls, BroadcastGradientArgs from Expand, DropoutGrad, ConvGrad of a computed
kernel, GatherGrad on a late axis; GRU and LSTM, unrolled); a GRU that cannot be unrolled is refused by
name. Models that pad explicitly also train under onnx.reference.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import pytest

import onnxopt
from helpers import under_reference
from onnxopt.errors import ModelError
from onnxopt.passes.lower import check_portable
from conftest import needs_training_build
from zoo import models as MZ
from zoo import models_more as MM

# (models module, model, exporter, dropout p or None, training-only ops its step must hold)
CASES = [
    (MM, "attention", "dynamo", None, {"FusedMatMul", "SoftmaxGrad_13", "GatherGrad"}),
    (MM, "attention", "script", None, {"FusedMatMul", "SoftmaxGrad_13"}),
    (MM, "tensor_ops", "script", None, {"FusedMatMul", "SplitTraining"}),
    (MM, "bilinear", "dynamo", None, {"FusedMatMul", "TanhGrad"}),
    (MM, "math_ops", "dynamo", None, {"BroadcastGradientArgs", "DivGrad"}),
    (MM, "activations", "dynamo18", None, {"BroadcastGradientArgs", "SoftmaxGrad_13"}),
    (MM, "deconv", "dynamo", None, {"ConvGrad", "GatherGrad", "SliceGrad", "FusedMatMul"}),
    (MM, "pooling", "script", None, {"ConvGrad", "MaxPoolGrad"}),
    (MM, "rms_gelu", "script", None, {"FastGelu", "FastGeluGrad", "SimplifiedLayerNormalization",
                                      "SimplifiedLayerNormalizationGrad"}),
    (MZ, "mlp_softplus", "dynamo", None, {"BroadcastGradientArgs"}),
    (MZ, "transformer", "script_train", 0.3, {"DropoutGrad", "FusedMatMul", "LayerNormalizationGrad"}),
    (MM, "residual", "script_train", 0.3, {"DropoutGrad", "ConvGrad"}),
    (MZ, "gru", "script", None, {"GRUTraining", "GRUGrad"}),
    (MZ, "lstm", "dynamo", None, {"LSTMTraining", "LSTMGrad"}),
    (MM, "birnn", "script", None, {"GRUTraining", "LSTMTraining"}),
    (MM, "gru2", "script", None, {"GRUTraining", "GatherGrad"}),
]


@needs_training_build
@pytest.mark.parametrize("module, name, exporter, p, ops", CASES, ids=[f"{c[1]}-{c[2]}" for c in CASES])
def test_portable_step_trains_like_the_training_build(module, name, exporter, p, ops):
    """The builder's step (its kernels), its portable lowering, and the step of onnxopt's own rules train
    alike, step by step: the builder is the oracle of the rules on exported models."""
    model = module.exported(name, exporter, p)
    kwargs = dict(mode="train" if exporter == "script_train" else "eval", loss=module.loss_name(name),
                  update="momentum", learning_rate=1e-2)
    plain = onnxopt.compile_train_step(model, gradient="builder", **kwargs)
    assert ops <= {n.op_type for n in plain.model.graph.node}, "the case no longer exercises its lowerings"
    portable = onnxopt.compile_train_step(model, portable=True, gradient="builder", **kwargs)
    check_portable(portable.model)
    rules = onnxopt.compile_train_step(model, gradient="onnxopt", **kwargs)
    for other in (portable, rules):  # NOTE: the same parameters
        assert (other.weights, other.buffers) == (plain.weights, plain.buffers)
    X, y = module.make_data(name, n=24)
    # NOTE: Dropout is seeded: the same masks in all. Momentum, not Adam: some of these weights have a gradient
    # of zero but for rounding (a key bias under softmax, a bias before BatchNorm), which Adam scales up to ±lr
    a, b, c = onnxopt.Runner(plain), onnxopt.Runner(portable), onnxopt.Runner(rules)
    for i in range(0, len(X), 8):
        expected = a.step(X[i:i + 8], y[i:i + 8])
        np.testing.assert_allclose(b.step(X[i:i + 8], y[i:i + 8]), expected, rtol=1e-5)
        np.testing.assert_allclose(c.step(X[i:i + 8], y[i:i + 8]), expected, rtol=1e-5)
    wa = a.get_weights()
    for other in (b, c):
        wb = other.get_weights()
        for k in wa:
            np.testing.assert_allclose(wb[k], wa[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_rnn_that_cannot_be_unrolled_is_refused_by_name():
    """A GRU with clip: the portable step does not unroll it, the training build's GRUTraining stays, and the
    error names it and says which GRUs are unrolled."""
    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [5, "N", 3])
    w, r, head = (np.random.default_rng(0).normal(size=s).astype(np.float32) for s in ([1, 12, 3], [1, 12, 4], [4, 1]))
    nodes = [oh.make_node("GRU", ["x", "W", "R"], ["", "h"], hidden_size=4, clip=5.0),
             oh.make_node("Squeeze", ["h", "zero"], ["s"]), oh.make_node("MatMul", ["s", "head"], ["y"])]
    inits = [onnx.numpy_helper.from_array(v, n) for v, n in ((w, "W"), (r, "R"), (head, "head"))]
    inits.append(onnx.numpy_helper.from_array(np.array([0], np.int64), "zero"))
    graph = oh.make_graph(nodes, "g", [x], [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 1])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=9)
    with pytest.raises(onnxopt.NotDifferentiableError, match=r"GRU \(node '[^']*'\)"):  # NOTE: no rule, not unrolled
        onnxopt.compile_train_step(model, loss="square", gradient="onnxopt")
    if not onnxopt.gradient.has_training_build():
        return
    onnxopt.compile_train_step(model, loss="square", gradient="builder")  # NOTE: the training build trains it
    with pytest.raises(ModelError, match=r"GRUTraining \(node '[^']*'\) has no lowering.*unrolls GRU and LSTM"):
        onnxopt.compile_train_step(model, loss="square", portable=True, gradient="builder")


@pytest.mark.parametrize("module, name, exporter", [(MM, "pool_pad", "script"), (MM, "deconv", "dynamo")],
                         ids=["pool_pad-script", "deconv-dynamo"])
def test_portable_step_trains_under_onnx_reference(module, name, exporter):
    """Both pad explicitly: the gradient of a Pad is a Pad by negative widths, which the portable step writes as
    a Slice (onnx.reference refuses negative pads)."""
    X, y = module.make_data(name, n=16)
    under_reference(module.exported(name, exporter), [(X[:8], y[:8]), (X[8:], y[8:])], 1e-5,
                    loss=module.loss_name(name), update="momentum", learning_rate=1e-2)
