"""A convolution's gradients (onnxopt's rules and the ConvGrad lowering share them) in float32 against torch
autograd in float64 (onnxruntime has no float64 Conv kernel), over the forms its rule writes differently: dX as a Conv of the flipped kernel (stride 1) or as a
ConvTranspose (strided, or pads past the kernel), dW as im2col + MatMul or, when the window matrix would be too
large, as a Conv of X by dY."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnxopt
from onnxopt.passes import lower

torch = pytest.importorskip("torch")

CASES = {
    # id: (input shape, weight shape, Conv attributes)
    "2d-same": ((2, 3, 7, 6), (4, 3, 3, 3), dict(pads=[1, 1, 1, 1])),
    "2d-strided": ((2, 3, 7, 6), (4, 3, 3, 3), dict(pads=[1, 1, 1, 1], strides=[2, 2])),
    "2d-asymmetric-pads": ((2, 3, 7, 6), (4, 3, 3, 2), dict(pads=[0, 1, 2, 1])),
    "2d-dilated": ((2, 3, 9, 8), (4, 3, 3, 3), dict(pads=[2, 2, 2, 2], dilations=[2, 2])),
    "2d-groups": ((2, 4, 6, 6), (6, 2, 3, 3), dict(pads=[1, 1, 1, 1], group=2)),
    "2d-depthwise-strided": ((2, 4, 7, 7), (4, 1, 3, 3), dict(pads=[1, 1, 1, 1], group=4, strides=[2, 1])),
    "2d-1x1-strided": ((2, 3, 6, 6), (5, 3, 1, 1), dict(strides=[2, 2])),
    "2d-1x1": ((2, 3, 5, 5), (5, 3, 1, 1), {}),
    "2d-pads-past-kernel": ((2, 3, 5, 5), (4, 3, 2, 2), dict(pads=[2, 2, 2, 2])),
    # NOTE: stride 1, fewer outputs than channels: dW from the windows of dY
    "2d-fewer-outputs": ((2, 4, 7, 6), (1, 4, 3, 2), dict(pads=[1, 0, 2, 1])),
    "2d-fewer-outputs-dilated-groups": ((2, 6, 8, 7), (4, 3, 3, 2),
                                        dict(pads=[2, 1, 1, 0], dilations=[2, 1], group=2)),
    "3d-fewer-outputs": ((1, 3, 4, 5, 4), (2, 3, 2, 3, 2), dict(pads=[0, 1, 1, 1, 1, 0])),
    "1d": ((2, 3, 9), (4, 3, 3), dict(pads=[1, 2])),
    "3d": ((1, 2, 4, 5, 4), (3, 2, 2, 3, 2), dict(pads=[0, 1, 0, 1, 1, 0], strides=[1, 2, 1])),
}


def _model(x_shape, w_shape, attrs, bias: bool) -> onnx.ModelProto:
    inputs = ["X", "W", "B"] if bias else ["X", "W"]
    node = helper.make_node("Conv", inputs, ["Y"], **attrs)
    rng = np.random.default_rng(1)
    inits = [onnx.numpy_helper.from_array(rng.normal(size=w_shape).astype(np.float32), "W")]
    if bias:
        inits.append(onnx.numpy_helper.from_array(rng.normal(size=w_shape[:1]).astype(np.float32), "B"))
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _torch_grads(x, w, b, dy, attrs):
    r = x.ndim - 2
    pads = attrs.get("pads", [0] * 2 * r)
    begin, end = pads[:r], pads[r:]
    conv = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}[r]
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    bt = torch.tensor(b, dtype=torch.float64, requires_grad=True) if b is not None else None
    # NOTE: torch pads symmetrically only: pad explicitly (F.pad takes the last axis first)
    padded = torch.nn.functional.pad(xt, [p for i in reversed(range(r)) for p in (begin[i], end[i])])
    y = conv(padded, wt, bt, stride=attrs.get("strides", 1), dilation=attrs.get("dilations", 1),
             groups=attrs.get("group", 1))
    y.backward(torch.tensor(dy, dtype=torch.float64))
    return {"X_grad": xt.grad.numpy(), "W_grad": wt.grad.numpy(), **({"B_grad": bt.grad.numpy()} if b is not None else {})}


@pytest.mark.parametrize("im2col", [True, False], ids=["im2col", "conv-of-x-by-dy"])
@pytest.mark.parametrize("name", list(CASES))
def test_conv_gradients_match_torch(name, im2col, monkeypatch):
    """dX, dW and dB of a Conv equal torch autograd's to float32 rounding (every form the rule writes)."""
    if not im2col:
        monkeypatch.setattr(lower, "IM2COL_FLOATS", 0)
    x_shape, w_shape, attrs = CASES[name]
    bias = name != "2d-groups"
    model = _model(x_shape, w_shape, attrs, bias)
    weights = ["W", "B"] if bias else ["W"]
    grad = onnxopt.gradient_model(model, weights=weights, inputs=["X"], gradient="onnxopt")
    session = ort.InferenceSession(grad.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(2)
    x = rng.normal(size=x_shape).astype(np.float32)
    w = onnx.numpy_helper.to_array(model.graph.initializer[0])
    b = onnx.numpy_helper.to_array(model.graph.initializer[1]) if bias else None
    y_shape = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"X": x})[0].shape
    dy = rng.normal(size=y_shape).astype(np.float32)
    feeds = {"X": x, "W": w, "Y_grad": dy, **({"B": b} if bias else {})}
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    expected = _torch_grads(x, w, b, dy, attrs)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], value, rtol=2e-5, atol=2e-5, err_msg=f"{name}: {key}")


def test_weight_gradient_form_follows_the_window_matrix_size():
    """Below ``IM2COL_FLOATS`` window values per sample the weight gradient is im2col (a depthwise Conv and a
    MatMul), above it a Conv of X by dY (no window matrix): the kernels the step runs say which."""
    model = _model((2, 3, 8, 8), (4, 3, 3, 3), dict(pads=[1, 1, 1, 1]), bias=False)

    def ops():
        grad = onnxopt.gradient_model(model, weights=["W"], gradient="onnxopt")
        return sorted(n.op_type for n in grad.graph.node if n.op_type in ("Conv", "ConvTranspose", "MatMul"))

    assert ops() == ["Conv", "MatMul"]  # NOTE: the window matrix, and the MatMul (Y itself is not needed)
    lower_limit = 3 * 9 * 64 - 1  # NOTE: one float fewer than this model's windows per sample
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lower, "IM2COL_FLOATS", lower_limit)
        assert ops() == ["Conv"]


# ConvTranspose: its rule's dX is a Conv by W, its dW the weight gradient of that Conv (dY as its input, X as its
# output gradient: im2col or the Conv of dY by X); exported decoders and the strided Conv's dX (what a gradient
# penalty differentiates again) meet it
CT_CASES = {
    # id: (input shape, weight shape, ConvTranspose attributes)
    "2d-strided-output-padding": ((2, 3, 4, 5), (3, 2, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1],
                                                                   output_padding=[1, 0])),
    "2d-asymmetric-pads-dilated": ((2, 3, 4, 4), (3, 4, 3, 2), dict(strides=[2, 1], pads=[0, 1, 2, 0],
                                                                    dilations=[1, 2])),
    "2d-groups": ((2, 4, 3, 3), (4, 3, 3, 3), dict(strides=[2, 2], group=2)),
    "1d-pads-past-stride": ((2, 3, 5), (3, 2, 4), dict(strides=[3], pads=[1, 2])),
}


def _ct_model(x_shape, w_shape, attrs, tanh: bool = False) -> onnx.ModelProto:
    nodes = [helper.make_node("ConvTranspose", ["X", "W", "B"], ["Z" if tanh else "Y"], **attrs)]
    if tanh:
        nodes.append(helper.make_node("Tanh", ["Z"], ["Y"]))
    rng = np.random.default_rng(1)
    out_channels = w_shape[1] * attrs.get("group", 1)
    inits = [onnx.numpy_helper.from_array(rng.normal(size=w_shape).astype(np.float32), "W"),
             onnx.numpy_helper.from_array(rng.normal(size=out_channels).astype(np.float32), "B")]
    graph = helper.make_graph(nodes, "ct", [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _torch_conv_transpose(x, w, b, attrs):
    """ONNX's ConvTranspose in torch: unpadded (torch pads symmetrically only), then cropped by the pads."""
    r = x.ndim - 2
    pads = attrs.get("pads", [0] * 2 * r)
    fn = {1: torch.nn.functional.conv_transpose1d, 2: torch.nn.functional.conv_transpose2d}[r]
    y = fn(x, w, b, stride=attrs.get("strides", 1), output_padding=attrs.get("output_padding", 0),
           groups=attrs.get("group", 1), dilation=attrs.get("dilations", 1))
    return y[(slice(None), slice(None), *(slice(pads[i], y.shape[2 + i] - pads[r + i]) for i in range(r)))]


def _inits(model):
    return {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}


@pytest.mark.parametrize("im2col", [True, False], ids=["im2col", "conv-of-dy-by-x"])
@pytest.mark.parametrize("name", list(CT_CASES))
def test_conv_transpose_gradients_match_torch(name, im2col, monkeypatch):
    """dX, dW and dB of a ConvTranspose equal torch autograd's in float64 to float32 rounding."""
    if not im2col:
        monkeypatch.setattr(lower, "IM2COL_FLOATS", 0)
    x_shape, w_shape, attrs = CT_CASES[name]
    model = _ct_model(x_shape, w_shape, attrs)
    grad = onnxopt.gradient_model(model, weights=["W", "B"], inputs=["X"], gradient="onnxopt")
    assert "Pad" not in {n.op_type for n in grad.graph.node}  # NOTE: no zeros inserted
    rng = np.random.default_rng(2)
    x = rng.normal(size=x_shape).astype(np.float32)
    params = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True)
              for k, v in {"X": x, **_inits(model)}.items()}
    y = _torch_conv_transpose(params["X"], params["W"], params["B"], attrs)
    dy = rng.normal(size=tuple(y.shape)).astype(np.float32)
    y.backward(torch.tensor(dy, dtype=torch.float64))
    sess = ort.InferenceSession(grad.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"X": x, "Y_grad": dy, **_inits(model)})))
    for key in ("X", "W", "B"):
        np.testing.assert_allclose(got[f"{key}_grad"], params[key].grad.numpy(), rtol=2e-5, atol=2e-5,
                                   err_msg=f"{name}: {key}")


@pytest.mark.parametrize("name", list(CT_CASES))
def test_conv_transpose_second_derivatives_match_torch(name):
    """grad(grad(tanh(ConvTranspose)) · (V, U), [X, W]) equals torch's double backward in float64."""
    x_shape, w_shape, attrs = CT_CASES[name]
    model = _ct_model(x_shape, w_shape, attrs, tanh=True)
    first = onnxopt.grad(model, ["X", "W"])
    inits = _inits(model)
    dot = onnx.ModelProto()
    dot.CopyFrom(first)
    dot.graph.node.extend([helper.make_node("Mul", ["X_grad", "V"], ["xv"]),
                           helper.make_node("Mul", ["W_grad", "U"], ["wu"]),
                           helper.make_node("ReduceSum", ["xv"], ["sx"], keepdims=0),
                           helper.make_node("ReduceSum", ["wu"], ["sw"], keepdims=0),
                           helper.make_node("Add", ["sx", "sw"], ["dot"])])
    dot.graph.input.extend([helper.make_tensor_value_info("V", TensorProto.FLOAT, x_shape),
                            helper.make_tensor_value_info("U", TensorProto.FLOAT, w_shape)])
    dot.graph.output.append(helper.make_tensor_value_info("dot", TensorProto.FLOAT, []))
    second = onnxopt.grad(dot, ["X", "W"], of="dot")
    rng = np.random.default_rng(3)
    x, v = (rng.normal(size=x_shape).astype(np.float32) for _ in range(2))
    u = rng.normal(size=w_shape).astype(np.float32)
    sess = ort.InferenceSession(second.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"X": x, "V": v, "U": u})))

    xt, wt = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, inits["W"]))
    y = torch.tanh(_torch_conv_transpose(xt, wt, torch.tensor(inits["B"], dtype=torch.float64), attrs))
    gx, gw = torch.autograd.grad(y.sum(), [xt, wt], create_graph=True)
    d = (gx * torch.tensor(v, dtype=torch.float64)).sum() + (gw * torch.tensor(u, dtype=torch.float64)).sum()
    hx, hw = torch.autograd.grad(d, [xt, wt])
    np.testing.assert_allclose(got["X_grad2"], hx.numpy(), rtol=1e-4, atol=1e-4, err_msg=f"{name}: X")
    np.testing.assert_allclose(got["W_grad2"], hw.numpy(), rtol=1e-4, atol=1e-4, err_msg=f"{name}: W")
