"""passes.lower: every lowering in LOWERINGS computes what onnxruntime-training's own kernel computes (the
reference), on random inputs, float32 and float64; unknown ops are refused by name; portable steps are standard."""

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx.reference import ReferenceEvaluator

import onnxopt
from onnxopt.errors import ModelError
from onnxopt.examples import mlp
from onnxopt.passes.lower import LOWERINGS, MS, check_portable, crops_as_slices, lower_training_ops
from conftest import needs_training_build
from test_average_pool import _pool_model, _with_weight

pytestmark = needs_training_build  # NOTE: the training build's kernels are the reference

ort.set_default_logger_severity(3)
R = np.random.default_rng(0)


def _softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _conv_case(x_shape, w_shape, **attrs):
    """(inputs, attrs, output shapes) of ConvGrad for a Conv of x by w."""
    import torch

    x, w = R.normal(size=x_shape), R.normal(size=w_shape)
    r = len(x_shape) - 2
    conv = getattr(torch.nn.functional, f"conv{r}d")
    pads = attrs.get("pads", [0] * 2 * r)
    y = conv(torch.tensor(x), torch.tensor(w), stride=attrs.get("strides", 1), padding=pads[:r],
             dilation=attrs.get("dilations", 1), groups=attrs.get("group", 1))
    attrs = {"kernel_shape": list(w_shape[2:]), "strides": [1] * r, "pads": [0] * 2 * r, "dilations": [1] * r,
             "group": 1, **attrs}
    return {"dY": R.normal(size=tuple(y.shape)), "X": x, "W": w}, attrs, [x_shape, w_shape, (w_shape[0],)]


def _ln_case(shape, k):
    x = R.normal(size=shape)
    axes = tuple(range(len(shape) - k, len(shape)))
    mean = x.mean(axis=axes, keepdims=True)
    inv_std = 1 / np.sqrt(x.var(axis=axes, keepdims=True) + 1e-5)
    inputs = {"dY": R.normal(size=shape), "X": x, "scale": R.normal(size=shape[-k:]), "mean": mean, "inv_std": inv_std}
    return inputs, {"axis": -k, "epsilon": 1e-5}, [shape, shape[-k:], shape[-k:]]


def _rms_case(shape, k):
    x = R.normal(size=shape)
    inv_std = 1 / np.sqrt((x * x).mean(axis=tuple(range(len(shape) - k, len(shape))), keepdims=True) + 1e-5)
    inputs = {"dY": R.normal(size=shape), "X": x, "scale": R.normal(size=shape[-k:]), "inv_std": inv_std}
    return inputs, {"axis": -k, "epsilon": 1e-5}, [shape, shape[-k:]]


def _pool_case(op_type, x_shape, **attrs):
    import torch

    x = torch.tensor(R.normal(size=x_shape))
    r = len(x_shape) - 2
    k, s, p = attrs["kernel_shape"], attrs.get("strides", [1] * r), attrs.get("pads", [0] * 2 * r)
    if op_type == "MaxPoolGrad":
        y, idx = torch.nn.functional.max_pool2d(x, k, s, p[:r], return_indices=True)
        # NOTE: torch's indices count within a (n, c) plane, ONNX's over the whole tensor
        plane = int(np.prod(x_shape[2:]))
        flat = idx.numpy() + (np.arange(x_shape[0] * x_shape[1]) * plane).reshape(x_shape[0], x_shape[1], 1, 1)
        return {"dY": R.normal(size=y.shape), "I": flat.astype(np.int64)}, attrs, [x_shape]
    y = torch.nn.functional.avg_pool2d(x, k, s, p[:r])
    return {"dY": R.normal(size=y.shape)}, attrs, [x_shape]


def _cases():
    a, b = R.normal(size=(3, 4)), R.normal(size=(3, 4))
    y3 = R.normal(size=(2, 3, 4))
    return {
        "ReluGrad": ({"dY": a, "X": b}, {}, [(3, 4)]),
        "ReluGrad-relu": ({"dY": a, "Z": np.where(np.arange(12).reshape(3, 4) % 5 == 0, 0.0, b)}, {}, [(3, 4)]),
        "SigmoidGrad": ({"dY": a, "Y": R.uniform(0, 1, (3, 4))}, {}, [(3, 4)]),
        "TanhGrad": ({"dY": a, "Y": R.uniform(-1, 1, (3, 4))}, {}, [(3, 4)]),
        "LeakyReluGrad": ({"dY": a, "Y": b}, {"alpha": 0.2}, [(3, 4)]),
        "Gelu": ({"X": b * 3}, {}, [(3, 4)]),
        "GeluGrad": ({"dY": a, "X": b * 3}, {}, [(3, 4)]),
        "QuickGelu": ({"X": b * 3}, {"alpha": 1.0}, [(3, 4)]),
        "QuickGeluGrad": ({"dY": a, "X": b * 3}, {}, [(3, 4)]),
        "SoftmaxGrad_13": ({"dY": y3, "Y": _softmax(R.normal(size=(2, 3, 4)), 1)}, {"axis": 1}, [(2, 3, 4)]),
        "LogSoftmaxGrad_13": ({"dY": a, "Y": np.log(_softmax(b, -1))}, {"axis": -1}, [(3, 4)]),
        "Scale": ({"X": a, "scale": np.array([2.5])}, {"scale_down": 1}, [(3, 4)]),
        "DivGrad": ({"dY": a, "A": b, "B": R.uniform(0.5, 2, (1, 4))}, {}, [(3, 4), (1, 4)]),
        "GatherGrad": ({"shape": np.array([5, 4]), "I": np.array([[0, 4], [4, -1], [2, 0]]), "dY": R.normal(size=(3, 2, 4))},
                       {"axis": 0}, [(5, 4)]),
        "GatherGrad-axis1": ({"shape": np.array([3, 5, 2]), "I": np.array([1, 1, 4, 0]), "dY": R.normal(size=(3, 4, 2))},
                             {"axis": 1}, [(3, 5, 2)]),
        "GatherElementsGrad": ({"dY": R.normal(size=(3, 2)), "shape": np.array([3, 4]),
                                "I": np.array([[0, 3], [1, 1], [3, 3]])}, {"axis": 1}, [(3, 4)]),
        # NOTE: the SliceGrad kernel fails on negative steps (narrowing_error), so none here
        "SliceGrad": ({"dY": R.normal(size=(2, 2)), "shape": np.array([6, 5]), "starts": np.array([1, -4]),
                       "ends": np.array([5, 5]), "axes": np.array([0, 1]), "steps": np.array([2, 2])}, {}, [(6, 5)]),
        "ConcatTraining": ({"A": a, "B": R.normal(size=(3, 2))}, {"axis": -1}, [(3, 6), (2,)]),
        "SplitTraining": ({"X": R.normal(size=(3, 6)), "split": np.array([2, 4])}, {"axis": 1}, [(3, 2), (3, 4)]),
        "ConvGrad": _conv_case((2, 3, 9, 9), (4, 3, 3, 3), strides=[2, 2], pads=[1, 1, 1, 1]),
        "ConvGrad-group": _conv_case((2, 4, 7, 6), (6, 2, 3, 2), group=2, pads=[1, 0, 1, 0], dilations=[2, 1]),
        "ConvGrad-1d": _conv_case((3, 2, 10), (3, 2, 4), strides=[3], pads=[2, 1]),
        "LayerNormalizationGrad": _ln_case((3, 2, 5), 2),
        "FastGelu": ({"X": b * 3}, {}, [(3, 4)]),
        "FastGelu-bias": ({"X": b * 3, "B": R.normal(size=4)}, {}, [(3, 4)]),
        "FastGeluGrad": ({"dY": a, "X": b * 3}, {}, [(3, 4)]),
        "BiasGelu": ({"A": b * 3, "B": R.normal(size=4)}, {}, [(3, 4)]),
        "BiasGeluGrad_dX": ({"dY": a, "X": b * 3, "B": R.normal(size=4)}, {}, [(3, 4)]),
        "BiasFastGeluGrad_dX": ({"dY": a, "X": b * 3, "B": R.normal(size=4)}, {}, [(3, 4)]),
        "SimplifiedLayerNormalization": ({"X": y3, "scale": R.normal(size=4)}, {"axis": -1, "epsilon": 1e-5},
                                         [(2, 3, 4), (2, 3, 1)]),
        "SimplifiedLayerNormalizationGrad": _rms_case((3, 2, 5), 2),
        "MaxPoolGrad": _pool_case("MaxPoolGrad", (2, 3, 7, 7), kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        "AveragePoolGrad": _pool_case("AveragePoolGrad", (2, 3, 7, 7), kernel_shape=[2, 2], strides=[2, 2]),
        "AveragePoolGrad-pads": _pool_case("AveragePoolGrad", (2, 3, 7, 6), kernel_shape=[3, 2], strides=[2, 2],
                                           pads=[1, 1, 1, 1], count_include_pad=0),
        "FusedMatMul": ({"A": R.normal(size=(2, 3, 4)), "B": R.normal(size=(2, 5, 4))}, {"alpha": 0.5, "transB": 1},
                        [(2, 3, 5)]),
        "FusedMatMul-2d": ({"A": R.normal(size=(4, 3)), "B": R.normal(size=(4, 5))}, {"transA": 1}, [(3, 5)]),
        "FusedMatMul-batch": ({"A": R.normal(size=(3, 2, 4)), "B": R.normal(size=(5, 2, 3))},
                              {"transA": 1, "transBatchA": 1, "transB": 1, "transBatchB": 1}, [(2, 4, 5)]),
        "BroadcastGradientArgs": ({"A": np.array([3, 1, 4]), "B": np.array([2, 1, 5, 4])}, {}, [(2,), (1,)]),
        "BroadcastGradientArgs-same-rank": ({"A": np.array([1, 4]), "B": np.array([3, 4])}, {}, [(1,), (0,)]),
        "DropoutGrad": ({"dY": a, "mask": R.uniform(size=(3, 4)) > 0.3, "ratio": np.array(0.3)}, {}, [(3, 4)]),
        "DropoutGrad-default-ratio": ({"dY": a, "mask": R.uniform(size=(3, 4)) > 0.5}, {}, [(3, 4)]),
        "SoftmaxCrossEntropyLossGrad": ({"dY": np.array(0.5), "log_prob": np.log(_softmax(R.normal(size=(6, 4)), 1)),
                                         "label": np.array([0, 1, 3, 1, 2, 0])}, {"reduction": "mean"}, [(6, 4)]),
        "SoftmaxCrossEntropyLossGrad-weighted": ({"dY": np.array(0.5), "log_prob": np.log(_softmax(b, 1)),
                                                  "label": np.array([0, 1, 1]), "weight": R.uniform(0.5, 2, 4)},
                                                 {"reduction": "mean", "ignore_index": 1}, [(3, 4)]),
        "SoftmaxCrossEntropyLossGrad-sum": ({"dY": np.array(2.0), "log_prob": np.log(_softmax(b, 1)),
                                             "label": np.array([3, 1, 0])}, {"reduction": "sum"}, [(3, 4)]),
        "SoftmaxCrossEntropyLossInternal": ({"scores": b, "label": np.array([3, 1, 0])}, {"reduction": "mean"},
                                            [(), (3, 4)]),
        "SoftmaxCrossEntropyLossInternalGrad": ({"dY": np.array(0.5), "log_prob": np.log(_softmax(b, 1)),
                                                 "label": np.array([2, 1, 0])}, {"reduction": "mean"}, [(3, 4)]),
        "AveragePoolGrad-pads-included": _pool_case("AveragePoolGrad", (1, 2, 6, 7), kernel_shape=[3, 3],
                                                    strides=[2, 1], pads=[1, 1, 1, 1], count_include_pad=1),
    }


CASES = _cases()
DOMAIN = {op: dom for dom, op in LOWERINGS}


def _model(case: str, dtype) -> onnx.ModelProto:
    inputs, attrs, out_shapes = CASES[case]
    op_type = case.split("-")[0]
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    kinds = {"f": elem, "b": onnx.TensorProto.BOOL}
    info = [oh.make_tensor_value_info(n, kinds.get(v.dtype.kind, onnx.TensorProto.INT64), v.shape)
            for n, v in inputs.items()]
    outs = ["X_grad"] if op_type.endswith("PoolGrad") else [f"out{i}" for i in range(len(out_shapes))]
    out_elem = [onnx.TensorProto.INT64 if (op_type == "ConcatTraining" and i == 1) or op_type == "BroadcastGradientArgs"
                else elem for i in range(len(outs))]
    out_info = [oh.make_tensor_value_info(n, t, s) for n, t, s in zip(outs, out_elem, out_shapes)]
    if op_type.endswith("PoolGrad"):  # NOTE: the lowering reads the pooled input's shape from the graph (X)
        info.append(oh.make_tensor_value_info("X", elem, out_shapes[0]))
    names, prelude = list(inputs), []
    if case == "ReluGrad-relu":  # NOTE: ReluGrad of a Relu's output (as the builder emits it) lowers to dy·Sign(y)
        names, prelude = ["dY", "X"], [oh.make_node("Relu", ["Z"], ["X"])]
    node = oh.make_node(op_type, names, outs, domain=DOMAIN[op_type], **attrs)
    keep = [oh.make_node("Identity", ["X"], ["X_copy"])] if op_type.endswith("PoolGrad") else []
    extra = [oh.make_tensor_value_info("X_copy", elem, out_shapes[0])] if keep else []
    graph = oh.make_graph([*prelude, node, *keep], case, info, out_info + extra)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid(MS, 1)], ir_version=9)


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs() if o.name != "X_copy"]
    return sess.run(names, {k: v for k, v in feeds.items() if k in {i.name for i in sess.get_inputs()}})


def _feeds(case: str, dtype) -> dict:
    feeds = {n: (v.astype(dtype) if v.dtype.kind == "f" else v if v.dtype.kind == "b" else v.astype(np.int64))
             for n, v in CASES[case][0].items()}
    if case.split("-")[0].endswith("PoolGrad"):
        feeds["X"] = np.zeros(CASES[case][2][0], dtype)
    return feeds


def test_cases_cover_the_table():
    assert {c.split("-")[0] for c in CASES} == {op for _, op in LOWERINGS}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", sorted(CASES))
def test_lowering_matches_training_kernel(case, dtype):
    if case == "ConvGrad-group" and dtype == np.float64:
        pytest.skip("no runtime here runs a float64 grouped ConvTranspose (onnxruntime has float Conv kernels only, "
                    "onnx.reference does not group ConvTranspose)")
    model = _model(case, dtype)
    lowered = ir.to_proto(lower_training_ops(ir.from_proto(model)))
    check_portable(lowered)
    onnx.checker.check_model(lowered, full_check=True)
    if case.startswith("ReluGrad"):
        assert ("Sign" in {n.op_type for n in lowered.graph.node}) == (case == "ReluGrad-relu")
    try:
        got = _run(lowered, _feeds(case, dtype))
    except Exception as exc:  # NOTE: onnxruntime has no float64 Conv/ConvTranspose: onnx.reference runs them
        assert dtype == np.float64 and "NOT_IMPLEMENTED" in str(exc), exc
        feeds = {i.name: v for i in lowered.graph.input for k, v in _feeds(case, dtype).items() if k == i.name}
        got = ReferenceEvaluator(lowered).run([o.name for o in lowered.graph.output if o.name != "X_copy"], feeds)
    try:
        expected = _run(model, _feeds(case, dtype))
        tol = 1e-6
    except Exception as exc:  # NOTE: several training kernels are float only: compare with them in float32
        assert dtype == np.float64, exc
        expected, tol = _run(_model(case, np.float32), _feeds(case, np.float32)), 1e-5
    assert len(got) == len(expected)
    if case.startswith("BroadcastGradientArgs"):  # NOTE: the kernel lists axes descending, the lowering ascending
        expected = [np.sort(e) for e in expected]
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == (e.dtype if tol == 1e-6 else g.dtype)
        np.testing.assert_allclose(g, e, rtol=tol, atol=tol)


def test_unknown_op_is_refused_by_name():
    node = oh.make_node("MadeUpKernelGrad", ["a", "b"], ["c"], domain=MS, name="sce_grad")
    graph = oh.make_graph([node], "g", [oh.make_tensor_value_info(n, 1, [2]) for n in "ab"],
                          [oh.make_tensor_value_info("c", 1, [2])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid(MS, 1)])
    with pytest.raises(ModelError, match=r"com.microsoft::MadeUpKernelGrad \(node 'sce_grad'\)"):
        lower_training_ops(ir.from_proto(model))
    with pytest.raises(ModelError, match="outside"):
        check_portable(model)


@pytest.mark.parametrize("pads", [[0, -1, 2, -2, 0, -1], [-1, 0, 0, 0, -2, -1]])
def test_cropping_pads_become_slices(pads):
    x = R.normal(size=(2, 5, 6)).astype(np.float32)
    node = oh.make_node("Pad", ["x", "pads", "value"], ["y"], mode="constant")
    graph = oh.make_graph([node], "g", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape)],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                          [onnx.numpy_helper.from_array(np.array(pads, np.int64), "pads"),
                           onnx.numpy_helper.from_array(np.array(1.5, np.float32), "value")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=9)
    rewritten = ir.from_proto(model)
    assert crops_as_slices(rewritten) == 1
    rewritten = ir.to_proto(rewritten)
    assert "Slice" in {n.op_type for n in rewritten.graph.node}
    expected = _run(model, {"x": x})[0]
    np.testing.assert_array_equal(_run(rewritten, {"x": x})[0], expected)
    np.testing.assert_array_equal(ReferenceEvaluator(rewritten).run(None, {"x": x})[0], expected)


@pytest.mark.parametrize("activation", ["Relu", "Tanh", "Sigmoid"])
def test_portable_step_is_standard_and_trains_the_same(activation, rng):
    model = mlp([4, 8, 3], activation=activation)
    kwargs = dict(loss="cross_entropy", update="adam", penalty="l2")
    plain = onnxopt.compile_train_step(model, **kwargs)
    portable = onnxopt.compile_train_step(model, portable=True, **kwargs)
    assert {n.domain for n in plain.model.graph.node} - {""}, "the training build's step should need its kernels"
    check_portable(portable.model)
    X, y = rng.normal(size=(16, 4)).astype(np.float32), rng.integers(0, 3, 16)
    a, b = onnxopt.Runner(plain), onnxopt.Runner(portable)
    np.testing.assert_allclose([b.step(X, y) for _ in range(4)], [a.step(X, y) for _ in range(4)], rtol=1e-6)


def test_avgpool_cnn_with_dynamic_batch_trains_like_torch():
    # NOTE: onnxruntime-training 1.19.2's AveragePoolGrad kills the process (SIGFPE) with a dynamic batch length;
    # compile_train_step lowers it even when the step need not be portable (passes.lower.BROKEN_KERNELS).
    import io

    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.AvgPool2d(2), torch.nn.Flatten(),
                              torch.nn.Linear(18, 1))
    X = R.normal(size=(4, 1, 8, 8)).astype(np.float32)
    y = R.normal(size=4).astype(np.float32)
    f = io.BytesIO()
    torch.onnx.export(net, (torch.tensor(X),), f, dynamo=False, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    step = onnxopt.compile_train_step(onnx.load_from_string(f.getvalue()), loss="square", learning_rate=0.1)
    assert not any(n.op_type == "AveragePoolGrad" for n in step.model.graph.node)
    runner = onnxopt.Runner(step)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        expected = ((net(torch.tensor(X)).reshape(-1) - torch.tensor(y)) ** 2).mean()
        expected.backward()
        opt.step()
        np.testing.assert_allclose(runner.step(X, y), expected.item(), rtol=1e-5)


def test_float64_leaky_relu_step_runs_on_the_training_build(rng):
    # NOTE: the training build has no float64 LeakyReluGrad kernel: the step lowers it (BROKEN_FLOAT64_KERNELS)
    import torch

    step = onnxopt.compile_train_step(mlp([3, 5, 1], activation="LeakyRelu", dtype=np.float64), learning_rate=0.1)
    assert not any(n.op_type == "LeakyReluGrad" for n in step.model.graph.node)
    w = {k: torch.tensor(v, requires_grad=True) for k, v in step.initial_weights().items()}
    X, y = rng.normal(size=(6, 3)), rng.normal(size=6)
    runner, opt = onnxopt.Runner(step), torch.optim.SGD(list(w.values()), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        hidden = torch.nn.functional.leaky_relu(torch.tensor(X) @ w["coef_0"] + w["bias_0"],
                                                float(np.float32(0.01)))  # NOTE: ONNX attributes are float32
        expected = ((hidden @ w["coef_1"] + w["bias_1"]).reshape(-1) - torch.tensor(y)).pow(2).mean()
        expected.backward()
        opt.step()
        assert runner.step(X, y) == pytest.approx(expected.item(), rel=1e-12)


def test_average_pool_auto_pad_refusal_names_the_mode():
    model = _with_weight(_pool_model((2, 2, 7, 6), dynamic=True, kernel_shape=[2, 2], auto_pad="SAME_UPPER"))
    with pytest.raises(ModelError, match=r"^compile_train_step \(replacing a training-build kernel\): "
                                         "AveragePoolGrad .* auto_pad='SAME_UPPER'"):
        onnxopt.compile_train_step(model, loss="square", gradient="builder")
    with pytest.raises(ModelError, match=r"AveragePool node '[^']*' has auto_pad='SAME_UPPER'; expected NOTSET"):
        onnxopt.compile_train_step(model, loss="square", gradient="onnxopt")  # NOTE: onnxopt's rule says it too
