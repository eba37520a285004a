"""Partial training: ForwardBackward (TrainingAgent), the external-gradient fused step and onnxopt.torch."""

import ast
import json
import pathlib
import subprocess
import sys

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

import onnxopt
from helpers import session
from onnxopt import dsl
from onnxopt.errors import DataError, DslError, ModelError
from onnxopt.examples import linear_regression, mlp
from onnxopt.torch import OnnxModule

MODELS = {"mlp": lambda: mlp([3, 4, 2], activation="Tanh", dtype=np.float64),
          "relu_mlp": lambda: mlp([3, 5, 1], dtype=np.float64),
          "linear": lambda: linear_regression(3, dtype=np.float64)}


def _reference(model, X, G, weights):
    """Gradients of sum(Y·G) by gradient_model in an InferenceSession."""
    sess = session(onnxopt.gradient_model(model, inputs=["X"]))
    out = sess.run(None, {"X": X, "Y_grad": G, **weights})
    return {o.name[: -len("_grad")]: v for o, v in zip(sess.get_outputs(), out)}


def _finite_differences(model, X, G, weights, eps=1e-6):
    """Central differences of sum(Y·G), Y from a plain InferenceSession (the weights made inputs)."""
    m = ir.from_proto(model)
    for name in weights:
        m.graph.inputs.append(m.graph.initializers.pop(name))
    sess = session(ir.to_proto(m))
    f = lambda X, w: float((sess.run(None, {"X": X, **w})[0] * G).sum())  # noqa: E731
    grads = {}
    for name, arr in {"X": X, **weights}.items():
        g = np.zeros_like(arr)
        for i in np.ndindex(arr.shape):
            hi, lo = arr.copy(), arr.copy()
            hi[i] += eps
            lo[i] -= eps
            args = [(hi if name == "X" else X), {**weights, **({name: hi} if name != "X" else {})}]
            args_lo = [(lo if name == "X" else X), {**weights, **({name: lo} if name != "X" else {})}]
            g[i] = (f(*args) - f(*args_lo)) / (2 * eps)
        grads[name] = g
    return grads


@pytest.mark.parametrize("name", MODELS)
def test_gradients_equal_gradient_model_and_finite_differences(name, rng):
    model = MODELS[name]()
    fb = onnxopt.ForwardBackward(model)
    X = rng.normal(size=(6, 3))
    outputs = fb.forward(X)
    G = rng.normal(size=outputs[0].shape)
    grads = fb.backward([G])
    weights = fb.get_weights()
    np.testing.assert_allclose(outputs[0], session(model).run(None, {"X": X})[0], rtol=1e-12)
    assert fb.forward(X, requires_grad=False)[0].shape == outputs[0].shape and not fb._pending
    ref, fd = _reference(model, X, G, weights), _finite_differences(model, X, G, weights)
    assert sorted(grads) == sorted(["X", *weights])
    for key in grads:
        np.testing.assert_allclose(grads[key], ref[key], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(grads[key], fd[key], rtol=1e-6, atol=1e-7)


def test_forwards_in_flight_get_their_own_gradients(rng):
    model = MODELS["mlp"]()
    fb = onnxopt.ForwardBackward(model)
    Xs = [rng.normal(size=(n, 3)) for n in (4, 7, 5)]
    outs = [fb.forward(X) for X in Xs]
    Gs = [rng.normal(size=o[0].shape) for o in outs]
    got = {1: fb.backward(Gs[1], ctx=outs[1]), 0: fb.backward({"Y": Gs[0]}, ctx=outs[0].context),
           2: fb.backward([Gs[2]])}  # NOTE: the default is the latest forward still waiting: the third
    for k, X in enumerate(Xs):
        ref = _reference(model, X, Gs[k], fb.get_weights())
        for key in ref:
            np.testing.assert_allclose(got[k][key], ref[key], rtol=1e-12, atol=1e-12)
    with pytest.raises(DataError, match="already ran"):
        fb.backward(Gs[1], ctx=outs[1])


def test_weights_and_inputs_selection(rng):
    model = MODELS["relu_mlp"]()
    fb = onnxopt.ForwardBackward(model, weights=["coef_1"], inputs=[])
    out = fb.forward(rng.normal(size=(3, 3)))
    assert sorted(fb.backward(np.ones_like(out[0]))) == ["coef_1"]
    new = fb.get_weights()["coef_1"] * 2
    fb.set_weights({"coef_1": new})
    np.testing.assert_array_equal(fb.get_weights()["coef_1"], new)


def test_bad_use_raises_clear_errors(rng):
    fb = onnxopt.ForwardBackward(linear_regression(3))
    with pytest.raises(DataError, match="no forward in flight"):
        fb.backward(np.ones((2, 1), np.float32))
    X = rng.normal(size=(2, 3)).astype(np.float32)
    fb.forward(X)
    with pytest.raises(DataError, match=r"'Y' is float32\[3, 1\], expected float32\[2, 1\]"):
        fb.backward(np.ones((3, 1), np.float32))
    with pytest.raises(DataError, match=r"'Y' is float64\[2, 1\], expected float32\[2, 1\]"):
        fb.backward(np.ones((2, 1), np.float64))
    with pytest.raises(DataError, match=r"output_grads: \['Z'\] are not outputs"):
        fb.backward({"Z": np.ones((2, 1), np.float32)})
    with pytest.raises(DataError, match=r"inputs: unknown \['x'\], missing \['X'\]"):
        fb.forward({"x": X})
    with pytest.raises(ModelError, match="'x' is not an input of the model"):
        onnxopt.ForwardBackward(linear_regression(3), inputs=["x"])
    with pytest.raises(DataError, match="'coef' is float64"):
        fb.set_weights({"coef": np.zeros((3, 1))})
    module = OnnxModule(linear_regression(3))
    with pytest.raises(DataError, match="'X' must be a torch.float32 tensor, got torch.float64"):
        module(torch.zeros(2, 3, dtype=torch.float64))


def test_forward_shares_memory_with_numpy_and_torch(rng):
    fb = onnxopt.ForwardBackward(linear_regression(3))
    X = rng.normal(size=(4, 3)).astype(np.float32)
    out = fb.forward(X)
    assert out.context.values[0].data_ptr() == X.ctypes.data  # ORT reads the caller's buffer
    G = np.ones((4, 1), np.float32)
    X[...] = 2.0  # NOTE: changed after the forward: MatMul's gradient must read the new values
    np.testing.assert_allclose(fb.backward(G)["coef"], X.T @ G)

    module = OnnxModule(linear_regression(3))
    x = torch.randn(4, 3)
    y = module(x)
    ctx = y.grad_fn.run
    assert ctx.values[0].data_ptr() == x.data_ptr()
    assert ctx.values[1].data_ptr() == module.coef.data_ptr()
    outputs, _ = module.fb.run_forward([x], [module.coef.detach(), module.bias.detach()])
    assert onnxopt.torch._tensor(outputs[0]).data_ptr() == outputs[0].data_ptr()  # ORT -> torch, no copy


def _torch_pair(dtype):
    """torch.nn.Linear(4, 3) -> [MLP 3-5-1] -> MSE, with the MLP as an OnnxModule or in torch."""
    torch.manual_seed(0)
    first = torch.nn.Linear(4, 3).to(dtype)
    onnx_mlp = mlp([3, 5, 1], dtype=np.float64 if dtype == torch.float64 else np.float32, seed=1)
    weights = onnxopt.train_initializers(onnx_mlp)
    inner = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 1)).to(dtype)
    with torch.no_grad():
        for layer, i in ((inner[0], 0), (inner[2], 1)):
            layer.weight.copy_(torch.from_numpy(weights[f"coef_{i}"].T.copy()))
            layer.bias.copy_(torch.from_numpy(weights[f"bias_{i}"].copy()))
    ours = torch.nn.Sequential(first, OnnxModule(onnx_mlp))
    theirs = torch.nn.Sequential(torch.nn.Linear(4, 3).to(dtype), inner)
    theirs[0].load_state_dict(first.state_dict())
    return ours, theirs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_layers_and_onnx_module_train_like_torch(dtype):
    ours, theirs = _torch_pair(dtype)
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(32, 4, generator=gen, dtype=dtype)
    y = X[:, :1] * 2 - X[:, 1:2]
    for model in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
        for _ in range(20):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(X), y).backward()
            opt.step()
    onnx_part = ours[1]
    torch.testing.assert_close(ours[0].weight, theirs[0].weight, rtol=0, atol=1e-5)
    torch.testing.assert_close(onnx_part.coef_0, theirs[1][0].weight.T, rtol=0, atol=1e-5)
    torch.testing.assert_close(onnx_part.bias_1, theirs[1][2].bias, rtol=0, atol=1e-5)
    assert not torch.equal(ours[0].weight, _torch_pair(dtype)[0][0].weight)  # it did train
    with torch.no_grad():
        hidden = ours[0](X)
        expected = onnx_part(hidden).numpy()
    got = session(onnx_part.to_onnx()).run(None, {"X": hidden.numpy()})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def _torch_reference(X, G, weights, lr, alpha, steps):
    """torch.optim.SGD(momentum=0.9, weight_decay=2α) on Y = X@coef + bias with dL/dY = G (l2 = α·Σw²)."""
    params = {k: torch.tensor(v, requires_grad=True) for k, v in weights.items()}
    opt = torch.optim.SGD(params.values(), lr=lr, momentum=0.9, weight_decay=2 * alpha)
    preds = []
    for _ in range(steps):
        opt.zero_grad()
        Y = torch.from_numpy(X) @ params["coef"] + params["bias"]
        preds.append(Y.detach().numpy().copy())
        Y.backward(torch.from_numpy(G))
        opt.step()
    return {k: v.detach().numpy() for k, v in params.items()}, preds


def test_external_grad_step_matches_torch(rng):
    model = linear_regression(3, dtype=np.float64)
    step = onnxopt.compile_train_step(model, loss=None, external_grad=True, penalty=dsl.penalties.l2(0.1),
                                      update=dsl.updates.momentum(momentum=0.9), learning_rate=0.05)
    assert (step.output_grad, step.prediction, step.target) == ("Y.grad", "Y", None)
    assert [o.name for o in step.model.graph.output][-1] == "Y"
    X, G = rng.normal(size=(8, 3)), rng.normal(size=(8, 1))
    ref, preds = _torch_reference(X, G, step.initial_weights(), 0.05, 0.1, 3)
    runner = onnxopt.Runner(step)
    for _ in range(3):
        runner.step(X, output_grad=G)
    for key, value in runner.get_weights().items():
        np.testing.assert_allclose(value, ref[key], rtol=1e-12)
    sess = session(step.model)
    out = sess.run(None, {"X": X, "Y.grad": G, "optim.step": np.array(0), **step.initial_weights(),
                          **{s: np.zeros((3, 1) if s.startswith("coef") else (1,)) for s in step.state[:-1]}})
    np.testing.assert_allclose(out[-1], preds[0], rtol=1e-12)
    with pytest.raises(DataError, match="output_grad: the step takes 'Y.grad'"):
        runner.step(X)
    with pytest.raises(DslError, match="expected loss=None"):
        onnxopt.compile_train_step(model, loss="square", external_grad=True)


def test_train_step_files_without_new_fields_still_load(tmp_path):
    step = onnxopt.compile_train_step(linear_regression(2))
    path = tmp_path / "old.onnx"
    step.save(path)
    proto = onnx.load(path)
    for prop in proto.metadata_props:
        if prop.key == "onnxopt.train_step":
            fields = json.loads(prop.value)
            fields.pop("output_grad"), fields.pop("prediction")
            prop.value = json.dumps(fields)
    onnx.save(proto, path)
    assert onnxopt.TrainStep.load(path).output_grad is None


def test_import_onnxopt_never_imports_torch():
    def module_level(body):  # NOTE: imports inside functions (lazy, e.g. the benchmarks) do not count
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node
            elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for field in ("body", "handlers", "orelse", "finalbody"):
                    yield from module_level(getattr(node, field, []))

    importers = []
    for path in pathlib.Path(onnxopt.__file__).parent.rglob("*.py"):
        for node in module_level(ast.parse(path.read_text()).body):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(n.split(".")[0] == "torch" for n in names) and getattr(node, "level", 0) == 0:
                importers.append(path.name)
    assert importers == ["torch.py"], importers
    # NOTE: onnxruntime itself imports torch when installed; block it and check onnxopt works without it.
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] == 'torch': raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import numpy as np, onnxopt\n"
        "from onnxopt.examples import linear_regression\n"
        "fb = onnxopt.ForwardBackward(linear_regression(2))\n"
        "fb.forward(np.ones((3, 2), np.float32))\n"
        "print(sorted(fb.backward(np.ones((3, 1), np.float32))), 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["['X',", "'bias',", "'coef']", "False"]
