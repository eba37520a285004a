"""mode="train" / "eval": Dropout and BatchNormalization of models exported by torch, against torch itself."""

from __future__ import annotations

import copy
import io
import logging
import warnings

import numpy as np
import onnx
import pytest

import onnxopt
from onnxopt.errors import WeightError

from helpers import importorskip  # NOTE: fails instead of skipping under CI=true
torch = importorskip("torch")
logging.getLogger("torch").setLevel(logging.ERROR)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.ReLU(), torch.nn.Dropout(0.0), torch.nn.Linear(8, 1))


def _cnn():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                               torch.nn.Flatten(), torch.nn.Dropout(0.0), torch.nn.Linear(12, 1))


def _torchscript_train(net, x):
    """TorchScript's training-mode export (the only one keeping training BatchNorm and Dropout); the export
    runs the net once, which moves its running statistics: the returned copy is the net as exported."""
    net.train()
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (x,), f, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                          input_names=["X"], output_names=["Y"], dynamic_axes={"X": {0: "N"}, "Y": {0: "N"}})
    return onnx.load_from_string(f.getvalue()), copy.deepcopy(net)


@pytest.fixture(scope="module")
def mlp_train_export():
    return _torchscript_train(_mlp(), torch.randn(16, 4))


@pytest.fixture(scope="module")
def fresh_dynamo_export():
    """A fresh BatchNorm1d first, exported by dynamo in eval mode: the exporter merged its equal initializers
    (running_var is the tensor ``0.weight``, running_mean ``0.bias``)."""
    torch.manual_seed(2)
    net = torch.nn.Sequential(torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto = torch.onnx.export(net, (torch.randn(16, 3),), dynamo=True, verbose=False).model_proto  # batch of 16
    bn = next(n for n in proto.graph.node if n.op_type == "BatchNormalization")
    assert list(bn.input[1:]) == ["0.weight", "0.bias", "0.bias", "0.weight"]  # the aliasing under test
    return proto, net


def _batches(n_features, shape=None, steps=20, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        X = rng.normal(size=(16, *(shape or (n_features,)))).astype(np.float32)
        yield X, (X.reshape(16, -1).sum(axis=1) * 0.5 + 1).astype(np.float32)


def _torch_losses(net, batches, lr, train):
    net.train(train)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    losses = []
    for X, y in batches:
        opt.zero_grad()
        loss = ((net(torch.from_numpy(X))[:, 0] - torch.from_numpy(y)) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _buffers(net) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in net.state_dict().items() if "running" in k}


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_torchscript_bn_dropout_follows_torch_for_20_steps(mlp_train_export, mode):
    model, net = mlp_train_export
    net = copy.deepcopy(net)
    step = onnxopt.compile_train_step(model, loss="square", update="sgd", learning_rate=0.05, mode=mode)
    assert step.buffers == (sorted(_buffers(net)) if mode == "train" else [])
    assert set(step.weights) == {k for k, _ in net.named_parameters()}
    runner = onnxopt.Runner(step)
    losses = [runner.step(X, y) for X, y in _batches(4)]
    expected = _torch_losses(net, _batches(4), 0.05, train=mode == "train")
    np.testing.assert_allclose(losses, expected, rtol=2e-5, atol=1e-6)
    params = dict(net.named_parameters())
    for name, value in runner.get_weights().items():
        np.testing.assert_allclose(value, params[name].detach().numpy(), rtol=1e-4, atol=1e-5)
    state = runner.get_state()
    exported = {t.name: onnx.numpy_helper.to_array(t) for t in runner.export().graph.initializer}
    for name, value in _buffers(net).items():  # train: moved like torch's; eval: untouched
        if mode == "train":
            np.testing.assert_allclose(state[name], value, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(exported[name], value, rtol=1e-5, atol=1e-6)


def test_running_var_is_unbiased_like_torch(mlp_train_export):
    """torch updates running_var with the unbiased batch variance (n/(n-1)), not ONNX's ReduceVar."""
    model, net = mlp_train_export
    step = onnxopt.compile_train_step(model, learning_rate=1e-30, mode="train")
    runner = onnxopt.Runner(step)
    X = np.random.default_rng(5).normal(size=(4, 4)).astype(np.float32) * 3
    runner.step(X, X.sum(axis=1))
    var = runner.get_state()["0.running_var"]
    start = step.initial_buffers()["0.running_var"]
    np.testing.assert_allclose(var, 0.9 * start + 0.1 * X.var(axis=0, ddof=1), rtol=1e-5)


def test_conv_batchnorm2d_first_loss_and_gradient_match_torch():
    x = torch.randn(8, 1, 6, 6)
    model, net = _torchscript_train(_cnn(), x)
    step = onnxopt.compile_train_step(model, loss="square", learning_rate=1.0, mode="train")
    runner = onnxopt.Runner(step)
    X = np.random.default_rng(3).normal(size=(8, 1, 6, 6)).astype(np.float32)
    y = X.reshape(8, -1).mean(axis=1)
    before = runner.get_weights()
    loss = runner.step(X, y)
    net.train()
    ref = ((net(torch.from_numpy(X))[:, 0] - torch.from_numpy(y)) ** 2).mean()
    ref.backward()
    assert loss == pytest.approx(ref.item(), rel=1e-5)
    after = runner.get_weights()
    for name, p in net.named_parameters():  # lr = 1: the update is the gradient
        np.testing.assert_allclose(before[name] - after[name], p.grad.numpy(), rtol=1e-3, atol=1e-5)


def test_dropout_is_active_in_train_mode_and_identity_in_eval():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 1))
    model, net = _torchscript_train(net, torch.randn(4, 6))
    X = np.random.default_rng(0).normal(size=(64, 6)).astype(np.float32)
    y = np.zeros(64, np.float32)
    train = onnxopt.Runner(onnxopt.compile_train_step(model, learning_rate=1e-30, mode="train"))
    losses = [train.step(X, y) for _ in range(4)]
    assert len(set(losses)) == 4  # a new mask each step
    again = onnxopt.Runner(train.train_step)
    assert [again.step(X, y) for _ in range(4)] == losses  # seeded per node: reproducible
    evaluate = onnxopt.Runner(onnxopt.compile_train_step(model, learning_rate=1e-30, mode="eval"))
    net.eval()
    expected = (net(torch.from_numpy(X))[:, 0] ** 2).mean().item()
    assert evaluate.step(X, y) == pytest.approx(expected, rel=1e-5)
    assert evaluate.step(X, y) == pytest.approx(expected, rel=1e-5)
    trainer = onnxopt.Trainer(model, learning_rate=0.05, max_iter=30, batch_size=16, mode="train", tol=None)
    trainer.fit(X, X[:, 0])
    assert trainer.train_losses_[-1] < trainer.train_losses_[0]


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_merged_statistics_get_their_own_tensor(fresh_dynamo_export, mode):
    proto, net = fresh_dynamo_export
    original = proto.SerializeToString()
    net = copy.deepcopy(net)
    step = onnxopt.compile_train_step(proto, learning_rate=0.1, mode=mode)
    assert set(step.weights) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert step.buffers == (["0.running_mean", "0.running_var"] if mode == "train" else [])
    runner = onnxopt.Runner(step)
    losses = [runner.step(X, y) for X, y in _batches(3, steps=5)]
    np.testing.assert_allclose(losses, _torch_losses(net, _batches(3, steps=5), 0.1, mode == "train"), rtol=2e-5)
    exported = runner.export()
    bn = next(n for n in exported.graph.node if n.op_type == "BatchNormalization")
    assert list(bn.input[1:]) == ["0.weight", "0.bias", "0.running_mean", "0.running_var"]
    values = {t.name: onnx.numpy_helper.to_array(t) for t in exported.graph.initializer}
    for name, value in _buffers(net).items():
        np.testing.assert_allclose(values[name], value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(values["0.weight"], net[0].weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert proto.SerializeToString() == original  # the caller's model is untouched


def test_lr_zero_leaves_weights_and_caller_arrays_untouched(fresh_dynamo_export):
    """No in-place statistics: at lr = 1e-30 (0 is refused) the weights stay, the running statistics move."""
    proto, _ = fresh_dynamo_export
    step = onnxopt.compile_train_step(proto, learning_rate=1e-30, mode="train")
    runner = onnxopt.Runner(step)
    start = {k: v.copy() for k, v in runner.get_weights().items()}
    mine = {k: v.copy() for k, v in start.items()}
    runner.set_weights(mine)
    kept = {k: v.copy() for k, v in mine.items()}
    for X, y in _batches(3, steps=3):
        runner.step(X, y)
    for name, value in runner.get_weights().items():
        np.testing.assert_allclose(value, start[name], rtol=0, atol=1e-20)
        np.testing.assert_array_equal(mine[name], kept[name])
    assert not np.allclose(runner.get_state()["0.running_var"], 1.0)


def test_gradient_model_keeps_batchnorm_as_written(mlp_train_export):
    """gradient_model has no mode: each node as exported (training_mode=1 here), statistics not written."""
    model, net = mlp_train_export
    net = copy.deepcopy(net).train()
    grad = onnxopt.gradient_model(model, fill_grad=True)
    from onnxruntime import InferenceSession

    sess = InferenceSession(grad.SerializeToString(), providers=["CPUExecutionProvider"])
    X = np.random.default_rng(1).normal(size=(8, 4)).astype(np.float32)
    feeds = {i.name: X if i.name == "X" else onnx.numpy_helper.to_array(
        next(t for t in model.graph.initializer if t.name == i.name)) for i in sess.get_inputs()}
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    net(torch.from_numpy(X)).sum().backward()
    np.testing.assert_allclose(out["1.weight_grad"], net[1].weight.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_mode_errors(mlp_train_export):
    model, _ = mlp_train_export
    with pytest.raises(ValueError, match="mode: expected one of"):
        onnxopt.compile_train_step(model, mode="inference")
    with pytest.raises(WeightError, match="running statistics"):
        onnxopt.compile_train_step(model, weights=["0.running_mean", "1.weight"], mode="train")
    step = onnxopt.compile_train_step(model, weights=["1.weight"], mode="eval")
    assert step.weights == ["1.weight"] and step.buffers == []


def test_trainer_writes_running_statistics(mlp_train_export, tmp_path):
    model, net = mlp_train_export
    X, y = next(_batches(4, steps=1))
    est = onnxopt.Trainer(model, max_iter=2, batch_size=8, shuffle=False, tol=None, mode="train").fit(X, y)
    trained = {t.name: onnx.numpy_helper.to_array(t) for t in est.trained_model_.graph.initializer}
    state = est.runner_.get_state()
    start = _buffers(net)
    for name in start:
        np.testing.assert_array_equal(trained[name], state[name])
        assert not np.allclose(trained[name], start[name])
    step = est.train_step_
    step.save(tmp_path / "s.onnx")
    assert onnxopt.TrainStep.load(tmp_path / "s.onnx").buffers == step.buffers


def test_statistics_from_constant_nodes_become_initializers():
    """Statistics given by Constant nodes: carried from their values, written into the exported model."""
    from onnx import TensorProto, helper

    def const(name, value):
        return helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.float32(value)))

    nodes = [const("m", np.zeros(3)), const("v", np.full(3, 2.0)),
             helper.make_node("BatchNormalization", ["X", "s", "b", "m", "v"], ["h"], name="bn"),
             helper.make_node("MatMul", ["h", "W"], ["Y"])]
    inits = {"s": np.ones(3), "b": np.zeros(3), "W": np.ones((3, 1))}
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
                              [onnx.numpy_helper.from_array(np.float32(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    step = onnxopt.compile_train_step(model, mode="train")
    assert step.buffers == ["bn.running_mean", "bn.running_var"]
    np.testing.assert_array_equal(step.initial_buffers()["bn.running_var"], np.full(3, 2.0, np.float32))
    runner = onnxopt.Runner(step)
    X = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    runner.step(X, X.sum(axis=1))
    exported = {t.name: onnx.numpy_helper.to_array(t) for t in runner.export().graph.initializer}
    np.testing.assert_allclose(exported["bn.running_mean"], 0.1 * X.mean(axis=0), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_gradient_model_and_forward_backward_take_a_mode(mlp_train_export, mode):
    """gradient_model(mode=) and ForwardBackward(mode=) give torch's gradients in that mode."""
    model, net = mlp_train_export
    net = copy.deepcopy(net).train(mode == "train")
    X = np.random.default_rng(2).normal(size=(8, 4)).astype(np.float32)
    expected = net(torch.from_numpy(X))
    expected.sum().backward()
    grad = onnxopt.gradient_model(model, fill_grad=True, mode=mode)
    from onnxruntime import InferenceSession

    sess = InferenceSession(grad.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: X if i.name == "X" else onnx.numpy_helper.to_array(
        next(t for t in model.graph.initializer if t.name == i.name)) for i in sess.get_inputs()}
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    np.testing.assert_allclose(out["1.weight_grad"], net[1].weight.grad.numpy(), rtol=1e-4, atol=1e-5)
    fb = onnxopt.ForwardBackward(model, mode=mode)
    y = fb.forward(X)
    np.testing.assert_allclose(y[0], expected.detach().numpy(), rtol=1e-4, atol=1e-5)
    grads = fb.backward(np.ones_like(y[0]))
    np.testing.assert_allclose(grads["0.weight"], net[0].weight.grad.numpy(), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="mode: expected one of"):
        onnxopt.gradient_model(model, mode="inference")
