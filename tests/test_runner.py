import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnxopt
from onnxopt.examples import mlp
from helpers import count_runs, run_once, session


@pytest.fixture
def data(rng):
    X = rng.normal(size=(60, 4)).astype(np.float32)
    return X, (X @ np.array([1.0, -2.0, 0.5, 0.0], np.float32) + 0.3).astype(np.float32)


def _step(update="momentum", **kw):
    return onnxopt.compile_train_step(mlp([4, 6, 1], seed=1), loss="square", update=update, learning_rate=0.05, **kw)


def test_runner_matches_a_plain_session_loop(data):
    X, y = data
    step = _step()
    runner = onnxopt.Runner(step)
    weights, state = step.initial_weights(), {}
    for k in range(3):
        ref = run_once(step, X[:20], y[:20], weights=weights, state=state, step_count=k)
        loss = runner.step(X[:20], y[:20])
        weights = {n: ref[n + ".new"] for n in step.weights}
        state = {n: ref[n + ".new"] for n in step.state if n != "optim.step"}
        np.testing.assert_allclose(loss, ref["loss"], rtol=1e-6)
    for name, value in runner.get_weights().items():
        np.testing.assert_allclose(value, weights[name], rtol=1e-6)
    assert runner.step_count == 3


def test_one_session_run_per_step_and_no_new_session(data, monkeypatch):
    X, y = data
    runner = onnxopt.Runner(_step())
    runner.step(X[:10], y[:10])
    sessions = []
    runs = count_runs(runner, monkeypatch)
    monkeypatch.setattr(ort.InferenceSession, "__init__", lambda *a, **k: sessions.append(1))
    for i in range(5):
        runner.step(X[10 * i:10 * i + 10], y[10 * i:10 * i + 10])
    assert (len(runs), len(sessions)) == (5, 0)
    assert runner.step_count == 6


def test_batches_of_another_length_train_as_a_plain_session_loop(data, monkeypatch):
    """A step that epochs run one by one (parameters × batch from SMALL_STEP, here lowered) has its session's
    batch axis fixed to ``batch_size`` rows (onnxruntime folds its shape computations); other lengths run a
    second session made once, over the same weights and state. A smaller step's epochs run as one Scan: its
    step session keeps the axis free."""
    X, y = data
    step = _step(update="adam")
    x = step.inputs[0]
    free = {i.name: i.shape for i in onnxopt.Runner(step, batch_size=8).session.get_inputs()}[x]
    assert free[1:] == [4] and not isinstance(free[0], int)
    monkeypatch.setattr(onnxopt.runner, "SMALL_STEP", 1)
    runner = onnxopt.Runner(step, batch_size=8)
    shapes = {i.name: i.shape for i in runner.session.get_inputs()}
    assert shapes[x] == [8, 4]
    batches = [(0, 8), (8, 13), (13, 21), (21, 26), (26, 34)]
    weights, state, losses, sessions = step.initial_weights(), {}, [], []
    for k, (start, end) in enumerate(batches):
        ref = run_once(step, X[start:end], y[start:end], weights=weights, state=state, step_count=k)
        weights = {n: ref[n + ".new"] for n in step.weights}
        state = {n: ref[n + ".new"] for n in step.state if n != "optim.step"}
        losses.append(ref["loss"])
    for k, (start, end) in enumerate(batches):
        if k == 2:  # NOTE: both sessions exist now
            monkeypatch.setattr(ort.InferenceSession, "__init__", lambda *a, **kw: sessions.append(1))
        np.testing.assert_allclose(runner.step(X[start:end], y[start:end]), losses[k], rtol=1e-6)
    assert sessions == []
    for name, value in runner.get_weights().items():
        np.testing.assert_allclose(value, weights[name], rtol=1e-5, atol=1e-7)


def test_checkpoint_resume_equals_uninterrupted_run(data, tmp_path):
    X, y = data
    full = onnxopt.Runner(_step(update="adam"))
    for i in range(6):
        full.step(X[10 * i:10 * i + 10], y[10 * i:10 * i + 10])
    first = onnxopt.Runner(_step(update="adam"))
    for i in range(3):
        first.step(X[10 * i:10 * i + 10], y[10 * i:10 * i + 10])
    first.save_checkpoint(tmp_path / "ckpt.npz")
    resumed = onnxopt.Runner(_step(update="adam"))
    resumed.load_checkpoint(tmp_path / "ckpt.npz")
    for i in range(3, 6):
        resumed.step(X[10 * i:10 * i + 10], y[10 * i:10 * i + 10])
    for name, value in full.get_weights().items():
        np.testing.assert_array_equal(resumed.get_weights()[name], value)
    assert resumed.step_count == 6


def test_export_predicts_with_trained_weights(data):
    X, y = data
    runner = onnxopt.Runner(_step())
    for _ in range(20):
        runner.step(X, y)
    exported = runner.export()
    onnx.checker.check_model(exported)
    pred = session(exported).run(None, {"X": X})[0][:, 0]
    w = runner.get_weights()
    h = np.maximum(X @ w["coef_0"] + w["bias_0"], 0)
    np.testing.assert_allclose(pred, (h @ w["coef_1"] + w["bias_1"])[:, 0], rtol=1e-5, atol=1e-6)
    assert np.mean((pred - y) ** 2) < np.mean(y ** 2)


def test_divergence_raises_and_keeps_last_finite_weights(data):
    X, y = data
    runner = onnxopt.Runner(onnxopt.compile_train_step(mlp([4, 1]), loss="square", update="sgd", learning_rate=50.0))
    good = None
    with pytest.raises(onnxopt.ConvergenceError, match="step"):
        for _ in range(200):
            before = runner.get_weights()
            runner.step(X, y * 1e3)
            good = before
    kept = runner.get_weights()
    assert all(np.isfinite(v).all() for v in kept.values())
    for name, value in kept.items():  # the weights that produced the last finite loss
        np.testing.assert_array_equal(value, good[name])


def test_train_step_save_load_runs_in_plain_session(data, tmp_path):
    X, y = data
    step = _step()
    step.save(tmp_path / "step.onnx")
    loaded = onnxopt.TrainStep.load(tmp_path / "step.onnx")
    assert (loaded.weights, loaded.state, loaded.inputs) == (step.weights, step.state, step.inputs)
    a, b = run_once(step, X, y), run_once(loaded, X, y)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    assert onnxopt.Runner(tmp_path / "step.onnx").step(X, y) == pytest.approx(float(a["loss"]), rel=1e-6)


def test_full_training_with_loss_in_the_graph(rng):
    from onnxopt.examples import polynomial

    X = rng.normal(size=(100, 2)).astype(np.float32)
    truth = session(polynomial()).run(None, {"x": X})[0][:, 0]
    model = onnxopt.add_loss_output(polynomial(), loss=onnxopt.dsl.losses.square(reduction="sum"))
    runner = onnxopt.Runner(onnxopt.compile_train_step(model, loss=None, loss_output="loss", learning_rate=0.005))
    runner.set_weights({"init": np.array([[2, 3]], np.float32), "init_1": np.array([[0.5, 0.33333]], np.float32),
                        "init_b10": np.array([1], np.float32)})
    first = runner.step(X[:5], truth[:5])
    for _ in range(30):
        last = np.mean([runner.step(X[i:i + 5], truth[i:i + 5]) for i in range(0, 100, 5)])
    assert last < first / 1000
    np.testing.assert_allclose(runner.get_weights()["init_1"], [[-2, 3]], atol=1e-2)


def test_a_convolution_counts_its_work_per_image_position():
    """A CNN's threads follow its work, not its few weights: a 3x3 Conv of 16 channels on 3x32x32 images has 448
    parameters (1 thread for 448 x 32 rows) but 442k multiply-adds per image (ORT's pool); on 4x4 images, one."""
    import onnx.helper as oh
    from onnx import TensorProto, numpy_helper

    from onnxopt.runner import step_work

    def cnn(side):
        w = numpy_helper.from_array(np.full((16, 3, 3, 3), 0.01, np.float32), "W")
        b = numpy_helper.from_array(np.zeros(16, np.float32), "B")
        graph = oh.make_graph(
            [oh.make_node("Conv", ["X", "W", "B"], ["c"], pads=[1, 1, 1, 1]),
             oh.make_node("GlobalAveragePool", ["c"], ["p"]), oh.make_node("Flatten", ["p"], ["Y"])],
            "cnn", [oh.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3, side, side])],
            [oh.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 16])], [w, b])
        return onnxopt.compile_train_step(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)]), loss="square")

    big, small = cnn(32), cnn(4)
    assert step_work(big) == 432 * 32 * 32 + 16 and step_work(small) == 432 * 16 + 16
    assert onnxopt.Runner(big, batch_size=32)._opts.intra_op_num_threads == 0  # NOTE: 0: one thread per core
    assert onnxopt.Runner(small, batch_size=32)._opts.intra_op_num_threads == 1


def test_a_model_exported_with_a_fixed_batch_says_so():
    """torch.onnx.export without a dynamic batch axis fixes the input's first dimension: a batch of another
    length is refused naming the fixed length and the export option, before Trainer trains anything."""
    torch = pytest.importorskip("torch")
    import io
    import warnings

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.zeros(8, 4),), buf, dynamo=False, input_names=["x"])
    model = onnx.load_from_string(buf.getvalue())
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(40, 4)).astype(np.float32), rng.normal(size=(40, 1)).astype(np.float32)
    runner = onnxopt.Runner(onnxopt.compile_train_step(model, loss="square", update="sgd", learning_rate=0.1))
    assert np.isfinite(runner.step(X[:8], y[:8]))
    with pytest.raises(onnxopt.DataError, match=r"exactly 8 rows: .*input 'x' is fixed.*dynamic_shapes"):
        runner.step(X[:32], y[:32])
    assert runner.step_count == 1
    with pytest.raises(onnxopt.ModelError, match=r"exactly 8 rows: .*input 'x' is fixed.*dynamic_shapes"):
        onnxopt.Trainer(model, loss="square").fit(X, y)


def test_a_model_with_two_data_inputs_is_refused_by_name():
    """Runner, Trainer and the CLI feed X to one input: a torch module of two tensors (a Siamese net) is refused
    naming both inputs and the way out, before any step runs."""
    torch = pytest.importorskip("torch")
    import io
    import warnings

    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encode = torch.nn.Linear(4, 3)

        def forward(self, a, b):
            return (self.encode(a) - self.encode(b)).pow(2).sum(dim=1, keepdim=True)

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Pair(), (torch.zeros(2, 4), torch.zeros(2, 4)), buf, dynamo=False, input_names=["a", "b"],
                          dynamic_axes={"a": {0: "N"}, "b": {0: "N"}})
    model = onnx.load_from_string(buf.getvalue())
    with pytest.raises(onnxopt.ModelError, match=r"2 data inputs \['a', 'b'\].*in one tensor"):
        onnxopt.Runner(onnxopt.compile_train_step(model, loss="square"))
    X, y = np.zeros((8, 4), np.float32), np.zeros((8, 1), np.float32)
    with pytest.raises(onnxopt.ModelError, match=r"2 data inputs \['a', 'b'\]"):
        onnxopt.Trainer(model, loss="square").fit(X, y)
