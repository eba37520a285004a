"""The Runner's CPU model (runner.cpu_model, passes/batch.py): sample-weight values hoisted out of the step,
the target fed shaped like the prediction. The reference is ``step.model`` itself in a plain session, run after
run: the specialized model must give the same numbers bit for bit, with and without sample weights (but the
bias sums of a session on threads, the same to float rounding)."""

import collections

import numpy as np
import pytest

import onnxopt
from onnxopt.dsl import op
from onnxopt.errors import DataError
from onnxopt.examples import mlp
from onnxopt.runner import cpu_model, default_session_options

from helpers import run_once
from conftest import needs_training_build


@pytest.fixture
def data(rng):
    X = rng.normal(size=(40, 4)).astype(np.float32)
    score = X @ np.array([1.0, -2.0, 0.5, 0.0], np.float32)
    return X, score.astype(np.float32), (score > 0).astype(np.float32), (score > 0.5).astype(np.int64) + (score > -0.5)


@onnxopt.dsl.loss
def weighted_cube(y, t, sample_weight):  # NOTE: a custom loss: its gradient comes from the builder
    d = op.Sub(y, op.Reshape(t, op.Shape(y)))
    w = op.Reshape(sample_weight, op.Constant(value_ints=[-1, 1]))
    return op.Div(op.ReduceSum(op.Mul(w, op.Mul(d, op.Mul(d, d)))), op.ReduceSum(w))


def _ops(step) -> collections.Counter:
    import onnx_ir as ir

    return collections.Counter(n.op_type for n in ir.from_proto(cpu_model(step).model).graph)


@pytest.mark.parametrize("loss, sizes, target", [("square", [4, 6, 1], 1), ("log", [4, 1], 2),
                                                 ("square", [4, 5, 2], None), ("cross_entropy", [4, 5, 3], 3),
                                                 (weighted_cube, [4, 3, 1], 1)])
def test_runner_specialized_model_matches_the_step_bit_for_bit(data, loss, sizes, target):
    X, *targets = data
    y = np.stack([targets[0], -targets[0]], axis=1) if target is None else targets[target - 1]
    step = onnxopt.compile_train_step(mlp(sizes, seed=1), loss=loss, update="adam", learning_rate=0.05)
    runner = onnxopt.Runner(step)
    weights, state = step.initial_weights(), {}
    sw = np.linspace(0.5, 2.0, 10).astype(np.float32)
    for k in range(6):
        xb, yb = X[k % 4 * 10:][:10], y[k % 4 * 10:][:10]
        if k == 4 and yb.ndim == 1 and step.target_kind == "float":
            yb = yb.reshape(-1, 1)  # NOTE: a column target is fed as it is
        weighted = sw if k in (2, 3) else None
        ref = run_once(step, xb, yb, sample_weight=weighted, weights=weights, state=state, step_count=k)
        assert runner.step(xb, yb, sample_weight=weighted) == ref["loss"]
        weights = {n: ref[n + ".new"] for n in step.weights}
        state = {n: ref[n + ".new"] for n in step.state if n != "optim.step"}
    for name, value in runner.get_weights().items():
        np.testing.assert_array_equal(value, weights[name], err_msg=name)


@needs_training_build
def test_cpu_model_drops_the_loss_bookkeeping():
    step = onnxopt.compile_train_step(mlp([4, 6, 1]), loss="square", update="sgd", learning_rate=0.05)
    before = collections.Counter(n.op_type for n in step.model.graph.node)
    after = _ops(step)
    cpu = cpu_model(step)
    assert cpu.target_shape == (1,) and cpu.hoisted and not cpu.weight_kept
    assert before["Shape"] >= 1 and after["Shape"] == 0  # NOTE: Reshape(target/sw/dy) go; the two left flatten
    # NOTE: the biases are read and written as (1, n) rows, each updated by its Gemm (row_sum_updates)
    assert after["Reshape"] == 0 and after["SGDOptimizer"] == 0 and cpu.rows == ("bias_0", "bias_1")
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in [*cpu.model.graph.input,
                                                                                  *cpu.model.graph.output]}
    assert shapes["bias_0"] == shapes["bias_0.new"] == [1, 6] and shapes["bias_1.new"] == [1, 1]
    assert sum(after.values()) - after["Sign"] <= sum(before.values()) - 6, (before, after)  # NOTE: Sign: ReluGrad's


@pytest.mark.parametrize("other, row", [([2, 3], True), ([3], False), ([1], False)])
def test_a_bias_is_a_row_only_where_a_row_broadcasts_alike(other, row):
    """row_sum_updates reads a bias as a (1, n) row only where each other use gives the same values for a row:
    against an operand of two dimensions, not against a vector (the result would gain a dimension)."""
    import onnx_ir as ir
    from onnx import TensorProto, helper

    from onnxopt.passes.batch import _as_row

    f = TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node("Sub", ["b", "d"], ["b.new"]), helper.make_node("Add", ["b", "o"], ["y"])], "g",
        [helper.make_tensor_value_info("b", f, [3]), helper.make_tensor_value_info("d", f, [3]),
         helper.make_tensor_value_info("o", f, other)],
        [helper.make_tensor_value_info("b.new", f, [3]), helper.make_tensor_value_info("y", f, None)])
    model = ir.from_proto(helper.make_model(graph))
    b, o = model.graph.inputs[0], model.graph.inputs[2]
    assert _as_row(b, model.graph.node(0), {"o": o.shape}) is row


def test_a_target_of_the_wrong_size_is_a_data_error_naming_y(data):
    X, y, _, _ = data
    step = onnxopt.compile_train_step(mlp([4, 6, 1]), loss="square", update="sgd", learning_rate=0.05)
    runner = onnxopt.Runner(step)
    with pytest.raises(DataError, match=r"y: expected 1 value\(s\) per sample .* got shape \(10, 2\)"):
        runner.step(X[:10], np.zeros((10, 2), np.float32))
    with pytest.raises(DataError, match=r"sample_weight: expected shape \(10,\)"):
        runner.step(X[:10], y[:10], sample_weight=np.ones(9, np.float32))
    assert runner.step_count == 0
    assert np.isfinite(runner.step(X[:10], y[:10]))


@needs_training_build
@pytest.mark.parametrize("rows, dtype", [(1, np.float32), (2, np.float32), (1, np.float64), (2, np.float64)])
def test_relu_gradient_masks_match_the_kernel_at_the_edges(rows, dtype):
    """Every mask of passes/batch.py masked_relu_grads (Sign below LARGE_RELU_GRAD elements; from there
    HardSigmoid(y·2²², alpha=2¹²⁷) in float32, Ceil(Min(y, 1)) in float64) gives dy where y > 0, else 0, bit for
    bit, on a Relu's output at zero, subnormal, tiny, huge and infinite inputs: onnxruntime-training's ReluGrad
    in float32, numpy in float64 (the training build has no float64 ReluGrad: the rewrite is what runs)."""
    import onnx_ir as ir
    import onnxruntime as ort
    from onnx import helper

    from onnxopt.passes.batch import LARGE_RELU_GRAD, masked_relu_grads

    cols = LARGE_RELU_GRAD // 2
    f = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("ReluGrad", ["dy", "y"], ["dx"], domain="com.microsoft")],
        "g", [helper.make_tensor_value_info("x", f, [rows, cols]), helper.make_tensor_value_info("dy", f, [rows, cols])],
        [helper.make_tensor_value_info("dx", f, [rows, cols])],
        value_info=[helper.make_tensor_value_info("y", f, [rows, cols])])
    proto = helper.make_model(graph, ir_version=10,
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model = ir.from_proto(proto)
    assert masked_relu_grads(model, rows) == 1
    ops = {n.op_type for n in model.graph}
    large = {np.float32: {"HardSigmoid"}, np.float64: {"Min", "Ceil"}}[dtype]
    assert (large if rows * cols >= LARGE_RELU_GRAD else {"Sign"}) <= ops and "ReluGrad" not in ops
    tiny = np.finfo(dtype).smallest_subnormal
    edges = np.array([0.0, -0.0, -1.0, tiny, -tiny, 2 * tiny, np.finfo(dtype).tiny, 0.5, 1.0, 1.5,
                      np.finfo(dtype).max, np.inf, -np.inf], dtype)
    x = np.resize(edges, (rows, cols)).astype(dtype)
    dy = np.random.default_rng(0).normal(size=(rows, cols)).astype(dtype)
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(  # noqa: E731
        None, {"x": x, "dy": dy})[0]
    expected = run(proto) if dtype == np.float32 else np.where(x > 0, dy, 0)
    np.testing.assert_array_equal(run(ir.to_proto(model)), expected)
    np.testing.assert_array_equal(expected, np.where(x > 0, dy, 0))


@pytest.mark.parametrize("gradient", ["onnxopt", "builder"])
@pytest.mark.parametrize("batch", [4, 64])
def test_relu_gradients_become_masked_products_bit_for_bit(rng, batch, gradient):
    """ReluGrad of a Relu's output runs as a masked product, dy · HardSigmoid(y·2²², alpha=2¹²⁷) where a batch
    makes it large (passes/batch.py LARGE_RELU_GRAD), else dy · Sign(y): same losses and weights as step.model
    (the builder's ReluGrad) run by a plain session, with half the units dead."""
    from onnxopt.passes.batch import LARGE_RELU_GRAD

    width = 256
    assert width * 64 >= LARGE_RELU_GRAD > width * 4
    if gradient == "builder" and not onnxopt.gradient.has_training_build():
        pytest.skip("needs onnxruntime-training's builder")
    step = onnxopt.compile_train_step(mlp([8, width, width, 1], activation="Relu", seed=3), loss="square",
                                      update="adam", learning_rate=0.01, gradient=gradient)  # NOTE: SGD's biases change
    # NOTE: the step keeps the builder's ReluGrads, or onnxopt's rule's dy·Sign(y)
    assert collections.Counter(n.op_type for n in step.model.graph.node)[
        "ReluGrad" if gradient == "builder" else "Sign"] == 2
    ops = collections.Counter(n.op_type for n in cpu_model(step, batch_size=batch).model.graph.node)
    large = batch * width >= LARGE_RELU_GRAD
    assert ops["ReluGrad"] == 0 and ops["HardSigmoid"] == (2 if large else 0)
    if gradient == "builder":  # NOTE: stock onnxruntime's portable Adam holds a Greater and a Cast of its own
        assert ops["Greater"] == ops["Cast"] == 0
    assert ops["Sign"] == (0 if large else 2)
    one_thread = default_session_options(1)  # NOTE: on threads the bias sums change too (test below)
    runner = onnxopt.Runner(step, batch_size=batch, session_options=one_thread)
    X = rng.normal(size=(batch, 8)).astype(np.float32)
    y = rng.normal(size=batch).astype(np.float32)
    weights = step.initial_weights()
    hidden = np.maximum(X @ weights[next(n for n in step.weights if weights[n].shape == (8, width))], 0)
    assert 0.2 < (hidden == 0).mean() < 0.8  # NOTE: a random mask, the case the rewrite is for
    state = {}
    for k in range(4):
        ref = run_once(step, X, y, weights=weights, state=state, step_count=k)
        assert runner.step(X, y) == ref["loss"]
        weights = {n: ref[n + ".new"] for n in step.weights}
        state = {n: ref[n + ".new"] for n in step.state if n != "optim.step"}
    for name, value in runner.get_weights().items():
        np.testing.assert_array_equal(value, weights[name], err_msg=name)


@needs_training_build
def test_bias_sums_on_threads_are_products_with_ones(rng):
    """On two threads or more, ReduceSum over the rows of a bias gradient runs as ones · g (passes/batch.py
    summed_rows: onnxruntime 1.19's parallel ReduceSum is slow there): the same losses and weights as
    step.model in a plain session to float rounding, run after run; on one thread the ReduceSums stay."""
    step = onnxopt.compile_train_step(mlp([8, 64, 32, 1], seed=5), loss="square", update="adam",
                                      learning_rate=0.01)  # NOTE: with SGD the bias sums become updates (below)
    reduce_sums = lambda m: collections.Counter(n.op_type for n in m.graph.node)["ReduceSum"]  # noqa: E731
    one, two = cpu_model(step, 64, threads=1).model, cpu_model(step, 64, threads=2).model
    assert reduce_sums(one) - reduce_sums(two) == 3  # NOTE: the three bias gradients; the loss's stay
    assert collections.Counter(n.op_type for n in two.graph.node)["ConstantOfShape"] == 3
    threaded = default_session_options(1)
    threaded.intra_op_num_threads = 2
    runner = onnxopt.Runner(step, batch_size=64, session_options=threaded)
    _close_to_the_step(step, runner, rng, [(64, None), (64, None), (17, None)])  # NOTE: the ones follow the rows


def _close_to_the_step(step, runner, rng, batches):
    """Runs ``runner`` on random batches of (rows, sample weights): each step's loss, weights and state equal
    ``step.model``'s in a plain session from the runner's values before it, to float rounding."""
    weights, state = step.initial_weights(), {}
    for k, (batch, sw) in enumerate(batches):
        X = rng.normal(size=(batch, 8)).astype(np.float32)
        y = rng.normal(size=batch).astype(np.float32)
        ref = run_once(step, X, y, sample_weight=sw, weights=weights, state=state, step_count=k)
        np.testing.assert_allclose(runner.step(X, y, sample_weight=sw), ref["loss"], rtol=1e-6)
        for name, value in {**runner.get_weights(), **runner.get_state()}.items():
            np.testing.assert_allclose(value, ref[name + ".new"], rtol=1e-5, atol=1e-7, err_msg=name)
        weights, state = runner.get_weights(), runner.get_state()  # NOTE: the next step starts from the runner's


@needs_training_build
@pytest.mark.parametrize("portable", [False, True])
def test_sgd_bias_updates_are_gemms_with_a_ones_row(rng, portable):
    """SGD with a constant rate on a dense layer's bias, b - lr·Σ_rows g, runs as one Gemm(ones, g, C=b) in the
    Runner's model (passes/batch.py row_sum_updates; SGDOptimizer, or Mul and Sub when portable, before), the
    ones computed once per batch length from the sample weights: the same losses and weights as step.model in
    a plain session to float rounding, with a shorter batch and with sample weights. A schedule, whose rate is
    no constant, keeps the step's update."""
    from onnxopt.passes.batch import ROW

    step = onnxopt.compile_train_step(mlp([8, 16, 4, 1], seed=7), loss="square", update="sgd", learning_rate=0.05,
                                      portable=portable)
    ops = lambda m: collections.Counter(n.op_type for n in m.graph.node)  # noqa: E731
    cpu = cpu_model(step, 16)
    assert ops(cpu.model)["Gemm"] == ops(step.model)["Gemm"] + 3 and ops(cpu.model)["SGDOptimizer"] == 0
    assert ROW in cpu.hoisted and cpu.weighted is not None
    runner = onnxopt.Runner(step, batch_size=16, session_options=default_session_options(1))
    _close_to_the_step(step, runner, rng, [(16, None), (16, np.linspace(0.5, 2, 16).astype(np.float32)),
                                           (5, None), (16, None)])
    scheduled = onnxopt.compile_train_step(mlp([8, 16, 4, 1], seed=7), loss="square", update="sgd",
                                           learning_rate=onnxopt.dsl.schedules.invscaling(0.05), portable=portable)
    assert ops(cpu_model(scheduled, 16).model)["Gemm"] == ops(scheduled.model)["Gemm"]
