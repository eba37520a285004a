"""AveragePool's gradient (ceil_mode, count_include_pad, dilations) against finite differences of onnxruntime's own
forward, on every Python: onnxopt's rule, and with the training build the lowering of the builder's
AveragePoolGrad; both count windows with ``passes.lower.divide_by_window_counts`` (onnxruntime 1.19 and newer
versions divide ceil_mode's last windows differently with count_include_pad=1)."""

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

import onnxopt
from conftest import needs_training_build

R = np.random.default_rng(0)


def _pool_model(x_shape, dynamic: bool, **attrs) -> onnx.ModelProto:
    shape = ["N", *x_shape[1:]] if dynamic else list(x_shape)
    node = oh.make_node("AveragePool", ["X"], ["Y"], **attrs)
    graph = oh.make_graph([node], "g", [oh.make_tensor_value_info("X", onnx.TensorProto.FLOAT, shape)],
                          [oh.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, None)])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 19)], ir_version=9)


POOLS = {  # NOTE: torch has no AveragePool dilations, and its ceil_mode divisor with count_include_pad differs
    "ceil": dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
    "ceil-pads": dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 0], ceil_mode=1),
    "ceil-pads-included": dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1,
                               count_include_pad=1),
    "dilations": dict(kernel_shape=[2, 2], dilations=[2, 1], pads=[1, 1, 0, 1]),
    "dilations-ceil-included": dict(kernel_shape=[2, 3], strides=[2, 2], dilations=[2, 2], pads=[1, 1, 1, 1],
                                    ceil_mode=1, count_include_pad=1),
}


@pytest.mark.parametrize("via", ["gradient_model", "ForwardBackward",
                                 pytest.param("builder", marks=needs_training_build)])
@pytest.mark.parametrize("case", POOLS)
def test_average_pool_gradient_equals_finite_differences(case, via):
    """AveragePool with ceil_mode, count_include_pad and dilations: the gradient of sum(Y·G) (onnxopt's rule;
    with the builder, the lowering that replaces its crashing AveragePoolGrad kernel, which portable steps use
    too: both count windows with passes.lower.divide_by_window_counts) equals differences of onnxruntime's own
    forward (linear: exact up to rounding)."""
    x_shape = (2, 2, 7, 6)
    model = _pool_model(x_shape, dynamic=True, **POOLS[case])
    X = R.normal(size=x_shape).astype(np.float32)
    fwd = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    Y = fwd.run(None, {"X": X})[0]
    G = R.normal(size=Y.shape).astype(np.float32)
    f = lambda x: float((fwd.run(None, {"X": x})[0].astype(np.float64) * G).sum())  # noqa: E731
    fd = np.zeros(X.size)
    for k in range(X.size):
        e = np.zeros(X.size, np.float32)
        e[k] = 0.5
        fd[k] = f(X + e.reshape(X.shape)) - f(X - e.reshape(X.shape))
    if via == "ForwardBackward":
        grad = onnxopt.ForwardBackward(_with_weight(model), inputs=["X"])
        out = grad.forward(X)
        got = grad.backward([G])["X"]
        np.testing.assert_allclose(out[0], Y, rtol=1e-6)
    else:
        source = "builder" if via == "builder" else "onnxopt"
        grad_model = onnxopt.gradient_model(_with_weight(model), inputs=["X"], gradient=source)
        assert via != "builder" or "AveragePoolGrad" not in {n.op_type for n in grad_model.graph.node}
        got = ort.InferenceSession(grad_model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            ["X_grad"], {"X": X, "Y_grad": G, "w": np.ones((1, 2, 1, 1), np.float32)})[0]
    np.testing.assert_allclose(got.ravel(), fd, rtol=1e-4, atol=1e-5)


def _with_weight(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with a weight ``w`` of ones (1, 2, 1, 1) scaling X first: the gradient builders want one."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    node = m.graph.node[0]
    node.input[0] = "Xw"
    m.graph.node.insert(0, oh.make_node("Mul", ["X", "w"], ["Xw"]))
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.ones((1, 2, 1, 1), np.float32), "w"))
    return m
