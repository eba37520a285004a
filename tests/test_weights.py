"""Weights are parameters: what weights=None trains on exporters' models, frozen=, equal weights, and builder
errors that name the op and the node."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

import onnxopt
from onnxopt.errors import ModelError, WeightError
from tests.helpers import run_once

from helpers import importorskip  # NOTE: fails instead of skipping under CI=true
torch = importorskip("torch")
logging.getLogger("torch").setLevel(logging.ERROR)


def _dynamo(net, x, opset=18, optimize=True):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.onnx.export(net.eval(), (x,), dynamo=True, opset_version=opset, verbose=False,
                                 optimize=optimize).model_proto


@pytest.fixture(scope="module")
def gelu_mlp():
    """Opset 18: GELU as Div/Erf/Add/Mul with 0-d constants √2, 1, 0.5; Softplus(beta, threshold) with
    0-d ``beta_cast`` and ``threshold_cast`` read by Mul/Div and Greater."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.GELU(), torch.nn.Linear(8, 1),
                              torch.nn.Softplus(beta=2.0, threshold=5.0))
    return _dynamo(net, torch.randn(16, 4)), net


def test_dynamo_scalar_constants_are_not_weights(gelu_mlp):
    proto, net = gelu_mlp
    scalars = [t.name for t in proto.graph.initializer if len(t.dims) == 0]
    assert len(scalars) >= 4  # √2, 1, 0.5, beta, threshold: what the rule must leave out
    assert sorted(onnxopt.train_initializers(proto)) == sorted(k for k, _ in net.named_parameters())


def test_dynamo_gelu_mlp_loss_and_gradient_match_torch(gelu_mlp):
    proto, net = gelu_mlp
    step = onnxopt.compile_train_step(proto, loss="square", learning_rate=1.0)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(16, 4)).astype(np.float32)
    y = rng.normal(size=16).astype(np.float32)
    out = run_once(step, X, y)
    net.zero_grad()
    ref = ((net(torch.from_numpy(X))[:, 0] - torch.from_numpy(y)) ** 2).mean()
    ref.backward()
    assert float(out["loss"]) == pytest.approx(ref.item(), rel=1e-5)
    start = step.initial_weights()
    for name, p in net.named_parameters():
        np.testing.assert_allclose(start[name] - out[name + ".new"], p.grad.numpy(), rtol=1e-3, atol=1e-5)


def test_transformer_attention_scale_is_not_a_weight():
    """The attention scale 1/√d is a [1] tensor the exporter folded from its temporaries; the transposed
    projection weights (``val_N`` folded from a parameter) stay weights."""
    torch.manual_seed(0)
    net = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    proto = _dynamo(net, torch.randn(2, 5, 8))
    names = set(onnxopt.train_initializers(proto))
    ones = [t.name for t in proto.graph.initializer if t.data_type == TensorProto.FLOAT and list(t.dims) == [1]]
    assert ones and not names & set(ones)
    total = sum(nh.to_array(t).size for t in proto.graph.initializer if t.name in names)
    # NOTE: the exporter's optimizer merged norm2 into norm1 (equal at initialization) and dropped the zero
    # out_proj.bias (x + 0); optimize=False keeps every parameter under its torch name
    dropped = net.norm2.weight.numel() + net.norm2.bias.numel() + net.self_attn.out_proj.bias.numel()
    assert total == sum(p.numel() for p in net.parameters()) - dropped
    plain = _dynamo(net, torch.randn(2, 5, 8), optimize=False)
    assert sorted(onnxopt.train_initializers(plain)) == sorted(k for k, _ in net.named_parameters())


def test_gru_initial_state_is_not_a_weight():
    class Regressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gru, self.head = torch.nn.GRU(3, 4, batch_first=True), torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.head(self.gru(x)[0][:, -1])

    torch.manual_seed(0)
    net = Regressor()
    proto = _dynamo(net, torch.randn(2, 5, 3))
    gru = next(n for n in proto.graph.node if n.op_type == "GRU")
    names = set(onnxopt.train_initializers(proto))
    assert gru.input[5] not in names
    assert sum(nh.to_array(t).size for t in proto.graph.initializer if t.name in names) == \
        sum(p.numel() for p in net.parameters())


def _model(nodes, inits, opset=18):
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])],
                          [oh.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
                          [nh.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)], ir_version=10)


def _pow_model():
    """Y = |X·W|^p, clipped where X·W > t: W is a weight; p (exponent) and t (threshold) are not."""
    nodes = [oh.make_node("MatMul", ["X", "W"], ["h"], name="dense"), oh.make_node("Abs", ["h"], ["a"], name="abs"),
             oh.make_node("Pow", ["a", "p"], ["q"], name="power"), oh.make_node("Greater", ["h", "t"], ["c"]),
             oh.make_node("Where", ["c", "h", "q"], ["Y"], name="select")]
    return _model(nodes, {"W": np.full((3, 1), 0.5), "p": [2.0], "t": [3.0]})


def test_exponent_and_threshold_are_not_weights():
    assert list(onnxopt.train_initializers(_pow_model())) == ["W"]
    assert onnxopt.compile_train_step(_pow_model()).weights == ["W"]


@pytest.mark.skipif(not onnxopt.gradient.has_training_build(), reason="needs onnxruntime-training's builder")
def test_builder_failure_names_op_node_and_fix():
    with pytest.raises(ModelError) as info:
        onnxopt.compile_train_step(_pow_model(), weights=["W", "p"], gradient="builder")
    text = str(info.value)
    assert "Pow node 'power'" in text and "frozen=['p']" in text and "gradient_builder.cc" not in text


def test_exponent_asked_for_as_a_weight_trains_exactly():
    """The builder cannot differentiate Pow in its exponent; onnxopt's rule (dp = dy·y·ln x) can: one SGD step
    moves W and p by the learning rate times their float64 finite-difference gradients."""
    rng = np.random.default_rng(0)
    model = _pow_model()
    for init in model.graph.initializer:
        init.CopyFrom(nh.from_array(nh.to_array(init).astype(np.float64), init.name))
    for v in [*model.graph.input, *model.graph.output]:
        v.type.tensor_type.elem_type = TensorProto.DOUBLE
    step = onnxopt.compile_train_step(model, weights=["W", "p"], learning_rate=0.1, gradient="onnxopt")
    X, t = rng.normal(size=(6, 3)), rng.normal(size=(6, 1))
    out = run_once(step, X, t)

    def loss(w):
        h = X @ w["W"]
        return float(np.mean((np.where(h > 3.0, h, np.abs(h) ** w["p"][0]) - t) ** 2))

    w0 = {"W": np.full((3, 1), 0.5), "p": np.array([2.0])}
    for name in w0:
        fd = np.zeros_like(w0[name])
        for i in np.ndindex(fd.shape):
            up, down = {k: v.copy() for k, v in w0.items()}, {k: v.copy() for k, v in w0.items()}
            up[name][i] += 1e-6
            down[name][i] -= 1e-6
            fd[i] = (loss(up) - loss(down)) / 2e-6
        np.testing.assert_allclose(out[name + ".new"], w0[name] - 0.1 * fd, rtol=1e-8, err_msg=name)


def _two_equal():
    """Two weights with the same values, read by different nodes: they must stay two weights."""
    nodes = [oh.make_node("MatMul", ["X", "A"], ["a"]), oh.make_node("Tanh", ["X"], ["tx"]),
             oh.make_node("MatMul", ["tx", "B"], ["b"]), oh.make_node("Add", ["a", "b"], ["Y"])]
    return _model(nodes, {"A": np.full((3, 1), 0.5), "B": np.full((3, 1), 0.5)})


def test_equal_weights_stay_two_weights_and_caller_arrays_stay():
    model = _two_equal()
    original = model.SerializeToString()
    step = onnxopt.compile_train_step(model, learning_rate=0.1)
    assert step.weights == ["A", "B"]
    runner = onnxopt.Runner(step)
    mine = {"A": np.full((3, 1), 0.5, np.float32), "B": np.full((3, 1), 0.5, np.float32)}
    runner.set_weights(mine)
    X = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    for _ in range(3):
        runner.step(X, X.sum(axis=1))
    w = runner.get_weights()
    assert not np.allclose(w["A"], w["B"])
    assert all(np.all(v == 0.5) for v in mine.values())
    assert model.SerializeToString() == original


def test_frozen_excludes_and_validates():
    step = onnxopt.compile_train_step(_two_equal(), frozen=["B"])
    assert step.weights == ["A"]
    with pytest.raises(WeightError, match="frozen: \\['C'\\] are not initializers"):
        onnxopt.compile_train_step(_two_equal(), frozen=["C"])
    with pytest.raises(WeightError, match="also frozen"):
        onnxopt.compile_train_step(_two_equal(), weights=["A", "B"], frozen=["B"])
    with pytest.raises(WeightError, match="leave no weight"):
        onnxopt.compile_train_step(_two_equal(), frozen=["A", "B"])
    est = onnxopt.Trainer(_two_equal(), frozen=["A"], max_iter=1).fit(np.ones((4, 3), np.float32), np.ones(4))
    assert est.train_step_.weights == ["B"]


def test_weights_override_the_rule():
    """A 0-d scale is a constant unless weights= names it; a threshold cannot be trained and says so."""
    nodes = [oh.make_node("MatMul", ["X", "W"], ["h"]), oh.make_node("Mul", ["h", "s"], ["Y"])]
    model = _model(nodes, {"W": np.full((3, 1), 0.5), "s": np.float32(2.0)})
    assert onnxopt.compile_train_step(model).weights == ["W"]
    step = onnxopt.compile_train_step(model, weights=["s", "W"], learning_rate=1.0)
    X = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    y = np.zeros(8, np.float32)
    out = run_once(step, X, y)
    h = X @ np.full((3, 1), 0.5, np.float32)
    assert 2.0 - float(out["s.new"]) == pytest.approx(float(np.mean(2 * (2 * h[:, 0]) * h[:, 0])), rel=1e-5)
    with pytest.raises(WeightError, match="'t' gets no gradient.*Greater"):
        onnxopt.compile_train_step(_pow_model(), weights=["t", "W"])


def test_cli_mode_and_frozen(tmp_path, capsys):
    from onnxopt.cli import main

    path = tmp_path / "m.onnx"
    onnx.save(_two_equal(), path)
    assert main(["compile", str(path), "--frozen", "A", "--mode", "eval", "-o", str(tmp_path / "s.onnx")]) == 0
    assert "weights: B" in capsys.readouterr().out
    assert main(["compile", str(path), "--mode", "inference", "-o", str(tmp_path / "s.onnx")]) == 2
    assert "invalid choice: 'inference'" in capsys.readouterr().err


def test_fixed_rows_are_checked():
    from onnxopt.examples import mlp

    model = mlp([3, 4, 1])
    with pytest.raises(WeightError, match=r"fixed_rows: \['nope'\] are not trained weights"):
        onnxopt.compile_train_step(model, fixed_rows={"nope": [0]})
    with pytest.raises(WeightError, match=r"fixed_rows: rows \[3\] of 'coef_0' out of range \(it has 3 rows\)"):
        onnxopt.compile_train_step(model, fixed_rows={"coef_0": [3]})
