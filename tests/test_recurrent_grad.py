"""onnxopt's RNN/GRU/LSTM gradient rules (``onnxopt.autodiff.recurrent``): backpropagation through time with
Scans, no unrolling. Hand cases against float64 central finite differences (onnx's reference runs both the
forward and the gradient graph in float64; onnxruntime has float32 kernels only), torch exports against torch
autograd and torch.optim.SGD, and, with the training build, against its builder."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from helpers import finite_differences
from onnxopt.errors import NotDifferentiableError
from onnxopt.gradient import gradient_ir, has_training_build
from onnxopt.modelio import load_model

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def _sigmoid(v):
    return 1 / (1 + np.exp(-v))


def recurrent_forward(op, x, w, r, b=None, h0=None, c0=None, direction="forward", layout=0, lbr=0, acts=None):
    """The ONNX equations of RNN (Tanh/Relu), GRU and LSTM (default activations) in NumPy: onnx's reference
    ignores direction and runs no bidirectional node nor Relu. Returns Y, Y_h, Y_c."""
    if layout:
        x = x.swapaxes(0, 1)
        h0, c0 = (None if v is None else v.swapaxes(0, 1) for v in (h0, c0))
    steps, batch = x.shape[:2]
    dirs, hidden = w.shape[0], r.shape[-1]
    y = np.zeros((steps, dirs, batch, hidden), x.dtype)
    last_h, last_c = np.zeros((dirs, batch, hidden), x.dtype), np.zeros((dirs, batch, hidden), x.dtype)
    for d in range(dirs):
        wd, rd = w[d], r[d]
        bd = b[d] if b is not None else np.zeros(2 * wd.shape[0], x.dtype)
        wb, rb = np.split(bd, 2)
        h = h0[d] if h0 is not None else np.zeros((batch, hidden), x.dtype)
        c = c0[d] if c0 is not None else np.zeros((batch, hidden), x.dtype)
        for t in (range(steps - 1, -1, -1) if d == 1 or direction == "reverse" else range(steps)):
            if op == "RNN":
                a = x[t] @ wd.T + h @ rd.T + wb + rb
                h = np.maximum(a, 0) if acts and acts[d].lower() == "relu" else np.tanh(a)
            elif op == "GRU":
                xw, hr = x[t] @ wd.T + wb, h @ rd.T + rb
                z = _sigmoid(xw[:, :hidden] + hr[:, :hidden])
                rg = _sigmoid(xw[:, hidden:2 * hidden] + hr[:, hidden:2 * hidden])
                if lbr:
                    ht = np.tanh(xw[:, 2 * hidden:] + rg * hr[:, 2 * hidden:])
                else:
                    ht = np.tanh(xw[:, 2 * hidden:] + (rg * h) @ rd[2 * hidden:].T + rb[2 * hidden:])
                h = (1 - z) * ht + z * h
            else:
                g = x[t] @ wd.T + h @ rd.T + wb + rb
                i, o, f = (_sigmoid(g[:, k * hidden:(k + 1) * hidden]) for k in range(3))
                c = f * c + i * np.tanh(g[:, 3 * hidden:])
                h = o * np.tanh(c)
            y[t, d] = h
        last_h[d], last_c[d] = h, c
    if layout:
        return y.transpose(2, 0, 1, 3), last_h.swapaxes(0, 1), last_c.swapaxes(0, 1)
    return y, last_h, last_c


def _reference_op(op):
    """An onnx.reference kernel of ``op`` by ``recurrent_forward``."""
    def _run(self, x, w, r, b=None, lens=None, h0=None, c0=None, **_):
        node = self.onnx_node
        attrs = {a.name: oh.get_attribute_value(a) for a in node.attribute}
        acts = [a.decode() if isinstance(a, bytes) else a for a in attrs.get("activations", [])]
        direction = attrs.get("direction", b"forward")
        outs = recurrent_forward(op, x, w, r, b, h0, c0, direction.decode() if isinstance(direction, bytes)
                                 else direction, attrs.get("layout", 0), attrs.get("linear_before_reset", 0), acts)
        return outs[:len(node.output)]
    return type(op, (OpRun,), {"op_domain": "", "_run": _run})


REFERENCE_OPS = [_reference_op(op) for op in GATES]


def _evaluator(model):
    return ReferenceEvaluator(model, new_ops=REFERENCE_OPS)


def _node_model(op, direction="forward", layout=0, extras=(), outputs=("Y", "Y_h"), seq=4, batch=2, size=3,
                hidden=2, dtype=TensorProto.DOUBLE, dynamic=False, seed=0, **attrs):
    """A model of one recurrent node, every float input a graph input; returns (model, feeds)."""
    rng = np.random.default_rng(seed)
    dirs = 2 if direction == "bidirectional" else 1
    g = GATES[op]
    xs = (batch, seq, size) if layout else (seq, batch, size)
    state = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
    shapes = {"X": xs, "W": (dirs, g * hidden, size), "R": (dirs, g * hidden, hidden), "B": (dirs, 2 * g * hidden),
              "h0": state, "c0": state}
    names = ["X", "W", "R", "B" if "B" in extras else "", "", "h0" if "h0" in extras else ""]
    if op == "LSTM":
        names.append("c0" if "c0" in extras else "")
    while not names[-1]:
        names.pop()
    np_type = np.float64 if dtype == TensorProto.DOUBLE else np.float32
    feeds = {n: (rng.normal(size=shapes[n]) * 0.6).astype(np_type) for n in names if n}
    all_outs = ["Y", "Y_h", "Y_c"][:3 if op == "LSTM" else 2]
    outs = [o if o in outputs else "" for o in all_outs]
    while not outs[-1]:
        outs.pop()
    node = oh.make_node(op, names, outs, hidden_size=hidden, direction=direction, layout=layout, name="rec", **attrs)
    dims = lambda n: ["T" if (k == (1 if layout else 0)) else d for k, d in enumerate(shapes[n])] \
        if dynamic and n == "X" else list(shapes[n])  # noqa: E731
    graph = oh.make_graph([node], "rec", [oh.make_tensor_value_info(n, dtype, dims(n)) for n in names if n],
                          [oh.make_tensor_value_info(o, dtype, None) for o in outs if o])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10), feeds


def _grads(model, feeds, cot, run_with="reference"):
    """onnxopt's gradients of sum(outputs · cot) with respect to every graph input."""
    grad, _ = gradient_ir(load_model(model), [], list(feeds), gradient="onnxopt")
    import onnx_ir as ir

    proto = ir.to_proto(grad)
    assert not {"GRUGrad", "LSTMGrad", "RNN" "Grad"} & {n.op_type for n in proto.graph.node}
    run_feeds = {**feeds, **{f"{o}_grad": v for o, v in cot.items()}}
    if run_with == "reference":
        names = [o.name for o in proto.graph.output]
        values = _evaluator(proto).run(None, {i.name: run_feeds[i.name] for i in proto.graph.input})
    else:
        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        values = sess.run(None, {i.name: run_feeds[i.name] for i in sess.get_inputs()})
    return dict(zip(names, values)), proto


def _finite_differences(model, feeds, cot, eps=1e-6, evaluator=_evaluator):
    ref = evaluator(model)
    names = [o.name for o in model.graph.output]

    def loss(values):
        return sum(float((o * cot[n]).sum()) for n, o in zip(names, ref.run(None, values)) if n in cot)

    return finite_differences(loss, feeds, list(feeds), eps)


CASES = [
    ("RNN", "forward", 0, ("B",), ("Y",), {}),
    ("RNN", "bidirectional", 1, ("B", "h0"), ("Y", "Y_h"), {"activations": ["Relu", "Tanh"]}),
    ("GRU", "forward", 0, ("B", "h0"), ("Y", "Y_h"), {"linear_before_reset": 1}),
    ("GRU", "reverse", 0, (), ("Y_h",), {"linear_before_reset": 0}),
    ("GRU", "bidirectional", 1, ("B",), ("Y",), {"linear_before_reset": 0}),
    ("LSTM", "forward", 0, ("B", "h0", "c0"), ("Y", "Y_h", "Y_c"), {}),
    ("LSTM", "reverse", 1, ("h0",), ("Y_c",), {}),
    ("LSTM", "bidirectional", 0, ("B",), ("Y", "Y_h"), {}),
]


@pytest.mark.parametrize("op, direction, layout, extras, outputs, attrs", CASES,
                         ids=[f"{c[0]}-{c[1]}-layout{c[2]}-{'+'.join(c[4])}" for c in CASES])
def test_gradients_match_float64_finite_differences(op, direction, layout, extras, outputs, attrs):
    """Every input's gradient (X, W, R, B, initial states) with the gradient entering any of Y, Y_h, Y_c, in
    float64 under onnx's reference; onnxruntime runs the same gradient graph in float32."""
    model, feeds = _node_model(op, direction, layout, extras, outputs, **attrs)
    ref_outs = _evaluator(model).run(None, feeds)
    rng = np.random.default_rng(1)
    cot = {o.name: rng.normal(size=v.shape) for o, v in zip(model.graph.output, ref_outs)}
    got, _ = _grads(model, feeds, cot)
    expected = _finite_differences(model, feeds, cot)
    for name, value in expected.items():
        np.testing.assert_allclose(got[f"{name}_grad"], value, rtol=1e-6, atol=1e-7, err_msg=name)
    if layout:  # NOTE: onnxruntime has no layout=1 kernel (torch's batch_first exports transpose instead)
        return
    model32, feeds32 = _node_model(op, direction, layout, extras, outputs, dtype=TensorProto.FLOAT, **attrs)
    got32, _ = _grads(model32, feeds32, {k: v.astype(np.float32) for k, v in cot.items()}, run_with="ort")
    for name, value in expected.items():
        np.testing.assert_allclose(got32[f"{name}_grad"], value, rtol=1e-4, atol=1e-4, err_msg=f"{name} float32")


def test_long_dynamic_sequence_uses_loops_not_an_unrolling():
    """200 steps over a dynamic time axis: one gradient graph of fixed size serves any
    length (two Loops); its float32 gradient matches float64 finite differences of a few entries."""
    model, feeds = _node_model("LSTM", "forward", 0, ("B",), ("Y", "Y_h"), seq=200, batch=2, size=3, hidden=3,
                               dtype=TensorProto.FLOAT, dynamic=True)
    grad, _ = gradient_ir(load_model(model), [], list(feeds), gradient="onnxopt")
    import onnx_ir as ir

    proto = ir.to_proto(grad)
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("Loop") == 2 and ops.count("LSTM") == 1 and len(ops) < 200, (len(ops), ops.count("Loop"))
    # the same model gives the same graph, Loop bodies' names included, whatever was compiled before
    again = ir.to_proto(gradient_ir(load_model(model), [], list(feeds), gradient="onnxopt")[0])
    assert again.SerializeToString() == proto.SerializeToString()
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(2)
    for seq in (200, 7):
        x = feeds["X"][:seq]
        cot = {"Y_grad": rng.normal(size=(seq, 1, 2, 3)).astype(np.float32),
               "Y_h_grad": rng.normal(size=(1, 2, 3)).astype(np.float32)}
        run_feeds = {**feeds, "X": x, **cot}
        got = dict(zip([o.name for o in sess.get_outputs()],
                       sess.run(None, {i.name: run_feeds[i.name] for i in sess.get_inputs()})))
        forward = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

        def loss(w):
            y, yh = forward.run(None, {**feeds, "X": x, "W": w.astype(np.float32)})
            return float((y * cot["Y_grad"]).sum() + (yh * cot["Y_h_grad"]).sum())

        for idx in [(0, 0, 0), (0, 5, 2), (0, 11, 1)]:
            d = np.zeros(feeds["W"].shape)
            d[idx] = 1e-2
            expected = (loss(feeds["W"] + d) - loss(feeds["W"] - d)) / 2e-2
            np.testing.assert_allclose(got["W_grad"][idx], expected, rtol=2e-2, atol=2e-3, err_msg=f"{seq} {idx}")


@pytest.mark.parametrize("op, attrs, inputs, why", [
    ("LSTM", {"clip": 1.0}, {}, "clip"),
    ("GRU", {"activations": ["Sigmoid", "Relu"]}, {}, "activations"),
    ("LSTM", {"input_forget": 1}, {}, "input_forget"),
    ("GRU", {}, {4: np.array([3, 2], np.int32)}, "sequence_lens"),
])
def test_refused_forms_name_the_op_node_and_reason(op, attrs, inputs, why):
    """Forms the rule does not differentiate (and the unrolling does not take: 100 steps) are refused by name."""
    model, feeds = _node_model(op, seq=100, **attrs)
    node = model.graph.node[0]
    for slot, value in inputs.items():
        names = list(node.input) + [""] * (slot + 1 - len(node.input))
        names[slot] = f"c{slot}"
        del node.input[:]
        node.input.extend(names)
        model.graph.initializer.append(onh.from_array(value, f"c{slot}"))
    with pytest.raises(NotDifferentiableError, match=fr"{op} \(node 'rec'\).*{why}") as info:
        gradient_ir(load_model(model), [], list(feeds), gradient="onnxopt")
    assert info.value.nodes == [(op, "rec")]


def test_peepholes_over_a_short_static_length_are_unrolled():
    """LSTM peepholes are not in the rule; over a static length up to 64 the node is unrolled instead and its
    gradient still equals finite differences."""
    model, feeds = _node_model("LSTM", extras=("B",), outputs=("Y",))
    rng = np.random.default_rng(3)
    node = model.graph.node[0]
    node.input.extend(["", "", "", "P"])
    model.graph.input.append(oh.make_tensor_value_info("P", TensorProto.DOUBLE, [1, 6]))
    feeds["P"] = rng.normal(size=(1, 6))
    cot = {"Y": rng.normal(size=(4, 1, 2, 2))}
    got, proto = _grads(model, feeds, cot)
    assert "LSTM" not in {n.op_type for n in proto.graph.node}
    # NOTE: onnx's own LSTM runs peepholes (forward direction)
    for name, value in _finite_differences(model, feeds, cot, evaluator=ReferenceEvaluator).items():
        np.testing.assert_allclose(got[f"{name}_grad"], value, rtol=1e-6, atol=1e-7, err_msg=name)


# ---------------------------------------------------------------------------------------------------------------
# torch exports against torch autograd + torch.optim.SGD


def _torch_module(cell: str, seq: int):
    import torch
    from torch import nn

    class Seq(nn.Module):
        """A 2-layer bidirectional batch_first recurrent layer; the head reads Y's last step, Y_h (and Y_c)."""

        def __init__(self):
            super().__init__()
            kind = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[cell]
            self.rnn = kind(3, 5, num_layers=2, bidirectional=True, batch_first=True)
            self.head = nn.Linear(10 + 5, 1)

        def forward(self, x):
            out, state = self.rnn(x)
            h = state[0] if cell == "lstm" else state
            extra = h[-1] + (state[1][-1] if cell == "lstm" else 0)
            return self.head(torch.cat([out[:, -1], extra], dim=1))

    torch.manual_seed(0)
    return Seq()


def _export(module, x, exporter, dynamic_seq=False):
    import io
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            dims = {0: torch.export.Dim("batch", min=2)}
            if dynamic_seq:
                dims[1] = torch.export.Dim("seq", min=2, max=512)
            return torch.onnx.export(module, (torch.from_numpy(x),), dynamo=True, verbose=False,
                                     dynamic_shapes=(dims,)).model_proto
        buf = io.BytesIO()
        axes = {0: "N", 1: "T"} if dynamic_seq else {0: "N"}
        torch.onnx.export(module, (torch.from_numpy(x),), buf, dynamo=False, input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": axes, "y": {0: "N"}})
        return onnx.load_from_string(buf.getvalue())


# NOTE: the dynamo exporter writes nn.RNN as MatMuls and Tanh (no RNN node); its exports take 20-80 s here
# NOTE: the 70-step case is TorchScript's: dynamo's export of a 70-step LSTM alone takes ~20 s
TORCH_CASES = [("lstm", "dynamo", 6, False), ("lstm", "script", 6, True), ("gru", "script", 70, False),
               ("rnn", "script", 6, False), pytest.param("gru", "dynamo", 6, True, marks=pytest.mark.slow)]


@pytest.mark.parametrize("cell, exporter, seq, dynamic_seq", TORCH_CASES,
                         ids=["lstm-dynamo", "lstm-script-dynamic", "gru-script-seq70", "rnn-script",
                              "gru-dynamo-dynamic"])
def test_first_step_equals_torch_sgd(cell, exporter, seq, dynamic_seq):
    """2 layers, bidirectional, batch_first, from both exporters (one over 70 steps, some with a dynamic sequence
    axis): the first SGD step of onnxopt's default step moves every weight as torch.optim.SGD does."""
    import torch

    import onnxopt
    from zoo.common import locate

    rng = np.random.default_rng(0)
    X = rng.normal(size=(4, seq, 3)).astype(np.float32)
    y = rng.normal(size=(4, 1)).astype(np.float32)
    module = _torch_module(cell, seq).eval()
    model = _export(module, X, exporter, dynamic_seq)
    assert cell.upper() in {n.op_type for n in model.graph.node}
    step = onnxopt.compile_train_step(model, loss="square", update="sgd", learning_rate=0.5)
    ops = {n.op_type for n in step.model.graph.node}
    assert cell.upper() in ops and "Loop" in ops, "the forward node stays, its gradient loops"
    initial = {t.name: onh.to_array(t) for t in model.graph.initializer if t.name in step.weights}
    where = locate(dict(module.named_parameters()), initial)
    runner = onnxopt.Runner(step)
    loss = runner.step(X, y)
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    ref = torch.nn.functional.mse_loss(module(torch.from_numpy(X)), torch.from_numpy(y))
    ref.backward()
    opt.step()
    np.testing.assert_allclose(loss, ref.item(), rtol=1e-5)
    flat = np.concatenate([p.detach().numpy().ravel() for p in module.parameters()])
    got = runner.get_weights()
    for name in step.weights:
        np.testing.assert_allclose(got[name], flat[where[name]], rtol=1e-4, atol=1e-5, err_msg=name)
    if dynamic_seq:  # NOTE: the same step over another length
        assert np.isfinite(runner.step(rng.normal(size=(4, seq + 3, 3)).astype(np.float32), y))


def test_whole_path_epoch_portable_trainer_and_input_gradients():
    """A TorchScript export of a 2-layer bidirectional batch_first LSTM through every entry point: an epoch (the
    step inside a Scan over batches: Loops inside a Scan) equals the same steps one by one, the portable step
    equals the default one, Trainer fits, and ForwardBackward's input gradient equals torch autograd's."""
    import torch

    import onnxopt

    rng = np.random.default_rng(4)
    X = rng.normal(size=(12, 5, 3)).astype(np.float32)
    y = rng.normal(size=(12, 1)).astype(np.float32)
    module = _torch_module("lstm", 5).eval()
    model = _export(module, X[:4], "script")
    kwargs = dict(loss="square", update="momentum", learning_rate=0.1)
    step = onnxopt.compile_train_step(model, **kwargs)
    portable = onnxopt.compile_train_step(model, portable=True, **kwargs)
    assert "LSTM" in {n.op_type for n in portable.model.graph.node}
    one, two, three = (onnxopt.Runner(s) for s in (step, step, portable))
    losses = [one.step(X[i:i + 4], y[i:i + 4]) for i in range(0, 12, 4)]
    np.testing.assert_allclose(two.epoch(X, y, batch_size=4), losses, rtol=1e-5)
    np.testing.assert_allclose([three.step(X[i:i + 4], y[i:i + 4]) for i in range(0, 12, 4)], losses, rtol=1e-5)
    for name, value in one.get_weights().items():
        np.testing.assert_allclose(two.get_weights()[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(three.get_weights()[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    est = onnxopt.Trainer(model, loss="square", batch_size=4, max_iter=1, shuffle=False, tol=None).fit(X, y)
    assert np.isfinite(est.predict(X)).all()
    fb = onnxopt.ForwardBackward(model)
    cot = rng.normal(size=(4, 1)).astype(np.float32)
    fb.forward({"x": X[:4]})
    got = fb.backward(cot)["x"]
    x = torch.from_numpy(X[:4]).requires_grad_(True)
    (module(x) * torch.from_numpy(cot)).sum().backward()
    np.testing.assert_allclose(got, x.grad.numpy(), rtol=1e-4, atol=1e-5)


# NOTE: the builder's GRUGrad is invalid (a type error on its zrh input) for linear_before_reset=0, and for a
# reverse GRU without initial state (the split node reads a Slice of X, which _initial_states cannot type)
PARITY = [("GRU", "bidirectional", ("B", "h0"), {"linear_before_reset": 1}),
          ("GRU", "forward", ("h0",), {"linear_before_reset": 1}),
          ("GRU", "reverse", ("B", "h0"), {"linear_before_reset": 1}),
          ("LSTM", "bidirectional", ("B", "h0", "c0"), {}), ("RNN", "reverse", ("B",), {})]


@pytest.mark.skipif(not has_training_build(), reason="the training build's gradient builder is the oracle here")
@pytest.mark.parametrize("op, direction, extras, attrs", PARITY, ids=[f"{c[0]}-{c[1]}" for c in PARITY])
def test_rules_match_the_builder(op, direction, extras, attrs):
    """The builder's gradients (GRUGrad/LSTMGrad on split directions; RNN unrolled) equal the rules' in float32,
    with the gradient entering Y and Y_h."""
    model, feeds = _node_model(op, direction, 0, extras, ("Y", "Y_h"), dtype=TensorProto.FLOAT, seq=5)
    rng = np.random.default_rng(5)
    outs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    cot = {o.name: rng.normal(size=v.shape).astype(np.float32) for o, v in zip(model.graph.output, outs)}
    got, _ = _grads(model, feeds, cot, run_with="ort")
    import onnx_ir as ir

    grad, _ = gradient_ir(load_model(model), [], list(feeds), gradient="builder")
    sess = ort.InferenceSession(ir.to_proto(grad).SerializeToString(), providers=["CPUExecutionProvider"])
    run_feeds = {**feeds, **{f"{o}_grad": v for o, v in cot.items()}}
    expected = dict(zip([o.name for o in sess.get_outputs()],
                        sess.run(None, {i.name: run_feeds[i.name] for i in sess.get_inputs()})))
    assert sorted(expected) == sorted(got)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_portable_step_trains_under_onnx_reference():
    """A TorchScript export of a GRU and an LSTM (forward, as onnx's reference runs them) trains under
    onnx.reference as in onnxruntime: the Loops of the gradient are standard ONNX both run."""
    import torch
    from torch import nn

    from helpers import under_reference

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru, self.lstm, self.head = nn.GRU(3, 4, batch_first=True), nn.LSTM(4, 3), nn.Linear(3, 1)

        def forward(self, x):
            out, _ = self.gru(x)
            _, (h, _) = self.lstm(out.transpose(0, 1))  # NOTE: onnx's reference LSTM outputs no Y_c
            return self.head(h[-1])

    torch.manual_seed(0)
    rng = np.random.default_rng(6)
    X, y = rng.normal(size=(8, 5, 3)).astype(np.float32), rng.normal(size=(8, 1)).astype(np.float32)
    model = _export(Two().eval(), X[:4], "script")
    under_reference(model, [(X[:4], y[:4]), (X[4:], y[4:])], 1e-5, loss="square", update="momentum",
                    learning_rate=0.1)
