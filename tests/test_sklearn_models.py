"""Models converted by skl2onnx from scikit-learn compile into one training step and train.

References are scikit-learn's own predictions and metrics (``predict``, ``predict_proba``, ``log_loss``), never
onnxopt: the first fused loss must equal the loss of the fitted estimator, and the loss must fall over 100
steps of a loop that feeds every ``*.new`` output back as the next input.
"""

import warnings

import numpy as np
import onnx
import pytest
from helpers import session
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LinearRegression, LogisticRegression, Perceptron, RidgeClassifier, SGDClassifier
from sklearn.metrics import log_loss
from sklearn.neural_network import MLPClassifier, MLPRegressor
from sklearn.svm import LinearSVC
from skl2onnx import to_onnx

import onnxopt
from onnxopt import dsl
from onnxopt.step import STEP
from onnxopt.tasks import choose_loss

OPSET = 18  # NOTE: skl2onnx's default opset (22) is newer than onnxruntime 1.19 loads


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(128, 4)).astype(np.float32)
    y = (X @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.3 + 0.1 * rng.normal(size=128)).astype(np.float32)
    labels = (y + 0.5 * rng.normal(size=128) > 0).astype(np.int64)
    return X, y, labels


def train(step, X, y, n_steps=100):
    """Runs the fused step ``n_steps`` times in one session; returns the losses and the last weights."""
    sess = session(step.model)
    out_names = [o.name for o in sess.get_outputs()]
    carry = {name: value for name, value in step.initial_weights().items()}
    for name in step.state:
        carry[name] = np.array(0, np.int64) if name == STEP else np.zeros_like(carry[name.rsplit(".", 1)[0]])
    data = {step.inputs[0]: X, step.target: y}
    if step.sample_weight:
        data[step.sample_weight] = np.ones(len(X), carry[step.weights[0]].dtype)
    losses = []
    for _ in range(n_steps):
        out = dict(zip(out_names, sess.run(None, {**data, **carry})))
        losses.append(float(out[step.loss]))
        carry = {name: out[name + ".new"] for name in carry}
    assert carry[STEP] == n_steps
    return np.array(losses), {n: carry[n] for n in step.weights}


def _fit(est, X, y):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return est.fit(X, y)


def _with_weights(model: onnx.ModelProto, weights: dict) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for init in m.graph.initializer:
        if init.name in weights:
            init.CopyFrom(onnx.numpy_helper.from_array(weights[init.name].astype(np.float32), init.name))
    return m


def test_linear_regression(data):
    X, y, _ = data
    rng = np.random.default_rng(1)
    est = _fit(LinearRegression(), X, X @ rng.normal(size=4).astype(np.float32) - 1.0)  # fitted to other targets
    onx = to_onnx(est, X[:1], target_opset=OPSET)
    assert [n.op_type for n in onx.graph.node] == ["LinearRegressor"]  # coefficients as attributes
    step = onnxopt.compile_train_step(onx, loss="square", update="sgd", learning_rate=0.1)
    assert sorted(step.weights) == ["LinearRegressor_coef", "LinearRegressor_intercept"]
    losses, w = train(step, X, y)
    np.testing.assert_allclose(losses[0], np.mean((est.predict(X) - y) ** 2), rtol=1e-4)
    assert losses[-1] < 0.01 * losses[0]
    ref = LinearRegression().fit(X, y)
    np.testing.assert_allclose(w["LinearRegressor_coef"][:, 0], ref.coef_, atol=0.05)
    np.testing.assert_allclose(w["LinearRegressor_intercept"], [ref.intercept_], atol=0.05)


def test_mlp_regressor(data):
    X, y, _ = data
    est = _fit(MLPRegressor(hidden_layer_sizes=(8,), max_iter=3, random_state=0), X, y)
    onx = to_onnx(est, X[:1], target_opset=OPSET)
    step = onnxopt.compile_train_step(onx, loss="square", update="adam", learning_rate=0.01)
    assert sorted(step.weights) == ["coefficient", "coefficient1", "intercepts", "intercepts1"]  # not shape_tensor
    losses, w = train(step, X, y)
    np.testing.assert_allclose(losses[0], np.mean((est.predict(X) - y) ** 2), rtol=1e-4)
    assert losses[-1] < 0.3 * losses[0]
    pred = session(_with_weights(onx, w)).run(None, {"X": X})[0]  # the trained weights in the inference model
    np.testing.assert_allclose(np.mean((pred[:, 0] - y) ** 2), losses[-1], rtol=0.2)


def _classifier_step(onx, loss, learning_rate=2.0):
    return onnxopt.compile_train_step(onx, loss=loss, output="probabilities", update="sgd", learning_rate=learning_rate)


def test_mlp_classifier_on_probabilities(data):
    X, _, labels = data
    est = _fit(MLPClassifier(hidden_layer_sizes=(8,), max_iter=3, random_state=0), X, labels)
    onx = to_onnx(est, X[:1], options={"zipmap": False}, target_opset=OPSET)
    step = _classifier_step(onx, dsl.losses.cross_entropy(from_logits=False), learning_rate=0.5)
    assert "unity" not in step.weights  # the constant 1 of (1 - p, p) is no weight
    assert sorted(step.weights) == ["coefficient", "coefficient1", "intercepts", "intercepts1"]
    losses, w = train(step, X, labels)
    np.testing.assert_allclose(losses[0], log_loss(labels, est.predict_proba(X)), rtol=1e-4)
    assert losses[-1] < 0.7 * losses[0]
    proba = session(_with_weights(onx, w)).run(None, {"X": X})[1]
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=1e-6)
    assert log_loss(labels, proba) < 0.7 * losses[0]


def test_mlp_classifier_raw_scores_are_not_offered(data):
    X, _, labels = data
    est = _fit(MLPClassifier(hidden_layer_sizes=(4,), max_iter=1, random_state=0), X, labels)
    with pytest.raises(NameError, match="raw_scores"):
        to_onnx(est, X[:1], options={"zipmap": False, "raw_scores": True}, target_opset=OPSET)


def test_sgd_classifier_log_loss_on_probabilities(data):
    X, _, labels = data
    est = _fit(SGDClassifier(loss="log_loss", max_iter=2, random_state=0), X, labels)
    onx = to_onnx(est, X[:1], options={"zipmap": False}, target_opset=OPSET)
    assert all(n.op_type != "ZipMap" for n in onx.graph.node)
    step = _classifier_step(onx, dsl.losses.cross_entropy(from_logits=False))
    assert sorted(step.weights) == ["coef", "intercept"]
    losses, _ = train(step, X, labels)
    # NOTE: rtol 1e-3: the ONNX graph computes 1 - sigmoid(s) in float32, scikit-learn in float64
    np.testing.assert_allclose(losses[0], log_loss(labels, est.predict_proba(X)), rtol=1e-3)
    assert losses[-1] < 0.5 * losses[0]
    assert np.all(np.diff(losses[:20]) < 0)  # plain gradient descent on a convex loss


def test_sgd_classifier_log_loss_on_raw_scores(data):
    X, _, labels = data
    est = _fit(SGDClassifier(loss="log_loss", max_iter=2, random_state=0), X, labels)
    onx = to_onnx(est, X[:1], options={"zipmap": False, "raw_scores": True}, target_opset=OPSET)
    assert "Sigmoid" not in {n.op_type for n in onx.graph.node}
    step = _classifier_step(onx, dsl.losses.log(from_logits=True))  # reads the positive-class score
    assert sorted(step.weights) == ["coef", "intercept"]  # 'negate' (-1) is no weight
    assert step.target_kind == "float"
    losses, w = train(step, X, labels.astype(np.float32))
    np.testing.assert_allclose(losses[0], log_loss(labels, est.predict_proba(X)), rtol=1e-4)
    assert losses[-1] < 0.5 * losses[0]
    s = (X @ w["coef"] + w["intercept"])[:, 0].astype(np.float64)  # the raw score with the trained weights
    np.testing.assert_allclose(np.mean(np.logaddexp(0, s) - labels * s), losses[-1], rtol=0.05)


def test_logistic_regression_linear_classifier_is_lowered(data):
    X, _, labels = data
    est = _fit(LogisticRegression(max_iter=2), X, labels)
    onx = to_onnx(est, X[:1], options={"zipmap": False}, target_opset=OPSET)
    assert [n.op_type for n in onx.graph.node] == ["LinearClassifier"]
    # NOTE: binary LogisticRegression is written as two LOGISTIC rows (-w, w); onnxopt keeps them tied
    # (ml_rules._tie_binary_columns): one (features, 1) weight, scikit-learn's coef_.
    step = _classifier_step(onx, dsl.losses.log(from_logits=False))
    assert sorted(step.weights) == ["LinearClassifier_coef", "LinearClassifier_intercept"]
    losses, w = train(step, X, labels.astype(np.float32))
    np.testing.assert_allclose(losses[0], log_loss(labels, est.predict_proba(X)), rtol=1e-4)
    assert losses[-1] < 0.5 * losses[0]
    best = log_loss(labels, LogisticRegression(C=1e6, max_iter=1000).fit(X, labels).predict_proba(X))
    assert losses[-1] > best - 1e-3  # no model of this family does better than the unregularized optimum
    assert w["LinearClassifier_coef"].shape == (4, 1)
    np.testing.assert_allclose(step.initial_weights()["LinearClassifier_coef"].ravel(), est.coef_.ravel(), rtol=1e-6)


def test_zipmap_is_dropped_and_its_probabilities_train(data):
    X, _, labels = data
    est = _fit(SGDClassifier(loss="log_loss", max_iter=2, random_state=0), X, labels)
    onx = to_onnx(est, X[:1], target_opset=OPSET)  # default: probabilities through ZipMap
    assert "ZipMap" in [n.op_type for n in onx.graph.node]
    step = onnxopt.compile_train_step(onx, loss=dsl.losses.cross_entropy(from_logits=False), output="output_probability")
    losses, _ = train(step, X, labels.astype(np.int64))
    plain = to_onnx(est, X[:1], options={"zipmap": False}, target_opset=OPSET)
    expected, _ = train(_classifier_step(plain, dsl.losses.cross_entropy(from_logits=False)), X, labels, n_steps=1)
    np.testing.assert_allclose(losses[0], expected[0], rtol=1e-6)  # the same probabilities as zipmap=False
    np.testing.assert_allclose(losses[0], log_loss(labels, est.predict_proba(X)), rtol=1e-3)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("kind", ["mlp_regressor", "mlp_classifier", "sgd_classifier"])
def test_float64_models(data, kind):
    """skl2onnx keeps float64 when fed float64: the step runs in double (Relu, Concat have float-only gradient
    kernels in onnxruntime and are rewritten before differentiation)."""
    X32, y32, labels = data
    X, y = X32.astype(np.float64), y32.astype(np.float64)
    if kind == "mlp_regressor":
        est = _fit(MLPRegressor(hidden_layer_sizes=(8,), max_iter=3, random_state=0), X, y)
        onx = to_onnx(est, X[:1], target_opset=OPSET)
        step = onnxopt.compile_train_step(onx, loss="square", update="adam", learning_rate=0.01)
        expected, target = np.mean((est.predict(X) - y) ** 2), y
    else:
        model = MLPClassifier(hidden_layer_sizes=(8,), max_iter=3, random_state=0) if kind == "mlp_classifier" \
            else SGDClassifier(loss="log_loss", max_iter=2, random_state=0)
        est = _fit(model, X, labels)
        onx = to_onnx(est, X[:1], options={"zipmap": False}, target_opset=OPSET)
        lr = 0.5 if kind == "mlp_classifier" else 2.0
        step = _classifier_step(onx, dsl.losses.cross_entropy(from_logits=False), learning_rate=lr)
        expected, target = log_loss(labels, est.predict_proba(X)), labels
    assert {onnx.helper.tensor_dtype_to_np_dtype(t.data_type) for t in step.model.graph.initializer
            if t.name in step.weights} == {np.dtype(np.float64)}
    losses, _ = train(step, X, target)
    np.testing.assert_allclose(losses[0], expected, rtol=1e-9)
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize("make, options, scores", [
    (lambda: Perceptron(max_iter=3, random_state=0), {"zipmap": False}, True),
    (lambda: SGDClassifier(max_iter=3, random_state=0), {"zipmap": False}, True),  # NOTE: hinge: decision scores
    (lambda: LinearSVC(max_iter=30), {}, True),  # NOTE: three classes below
    (lambda: LinearSVC(max_iter=30, random_state=0), {}, "log"),  # NOTE: two: the positive class's score alone
    (lambda: RidgeClassifier(), {}, "log"),  # NOTE: its one column declared (N, 2) by skl2onnx
    (lambda: SGDClassifier(loss="log_loss", max_iter=2, random_state=0), {"zipmap": False, "raw_scores": True}, True),
    (lambda: SGDClassifier(loss="log_loss", max_iter=2, random_state=0), {"zipmap": False}, False),
    (lambda: LogisticRegression(max_iter=3), {"zipmap": False}, False),
    (lambda: MLPClassifier(hidden_layer_sizes=(4,), max_iter=3, random_state=0), {"zipmap": False}, False),
], ids=["perceptron", "sgd_hinge", "linear_svc_3", "linear_svc_2", "ridge_2", "sgd_log_raw", "sgd_log", "logistic",
        "mlp"])
def test_auto_loss_reads_decision_scores_as_logits(data, make, options, scores):
    """skl2onnx names a linear classifier's decision scores "probabilities": loss="auto" trains them as logits
    (softmax cross-entropy), and only normalized outputs with cross_entropy(from_logits=False); the first
    loss equals the one computed from scikit-learn's own decision_function / predict_proba."""
    X, y, labels = data
    est = make()
    if isinstance(est, LinearSVC) and scores is True:
        labels = np.digitize(y, np.quantile(y, [0.33, 0.66]))
    est = _fit(est, X, labels)
    onx = to_onnx(est, X[:1], options=options, target_opset=OPSET)
    loss, output = choose_loss(onx, "auto", None)
    assert loss == {True: "cross_entropy", False: "cross_entropy:from_logits=false", "log": "log"}[scores]
    step = onnxopt.compile_train_step(onx, loss=loss, output=output, update="sgd", learning_rate=0.1)
    losses, _ = train(step, X, labels.astype(np.float32) if loss == "log" else labels, n_steps=30)
    if scores == "log":
        d = np.asarray(est.decision_function(X), np.float64)
        expected = np.mean(np.logaddexp(0, d) - labels * d)
    elif scores:
        d = np.asarray(est.decision_function(X), np.float64)
        logits = np.stack([-d, d], axis=1) if d.ndim == 1 else d  # NOTE: skl2onnx's binary scores are (-s, s)
        expected = np.mean(np.logaddexp.reduce(logits, axis=1) - logits[np.arange(len(X)), labels])
    else:
        expected = log_loss(labels, est.predict_proba(X))
    np.testing.assert_allclose(losses[0], expected, rtol=1e-3)
    assert losses[-1] < losses[0]


def test_multi_output_mlp_regressor_of_skl2onnx_is_refused_by_shape(data):
    """skl2onnx writes a 2-output MLPRegressor's prediction as (2N, 1) (a Reshape to (-1, 1)): the Runner's
    session still loads (its batch-specialized one would not), and a step or a fit names the shapes."""
    X, y, _ = data
    y2 = np.c_[y, -y].astype(np.float32)
    est = _fit(MLPRegressor(hidden_layer_sizes=(4,), max_iter=3, random_state=0), X, y2)
    onx = to_onnx(est, X[:1], target_opset=OPSET)
    runner = onnxopt.Runner(onnxopt.compile_train_step(onx, loss="square"), batch_size=32)
    with pytest.raises(onnxopt.errors.DataError, match="batch"):
        runner.step(X[:32], y2[:32])
    with pytest.raises(onnxopt.errors.DataError, match=r"y: expected shape \[128, 1\] to match the prediction"):
        onnxopt.Trainer(onx, max_iter=1, verbose=0).fit(X, y2)


def test_a_shape_onnx_cannot_infer_trains_without_a_logged_traceback(data, caplog):
    """skl2onnx declares PLSRegression's output with a shape its graph contradicts, so ONNX shape inference
    fails: onnxopt's passes work with the shapes they find, the pass's warning and traceback stay out of the
    user's log, and the model trains."""
    from sklearn.cross_decomposition import PLSRegression

    X, y, _ = data
    onx = to_onnx(PLSRegression(2).fit(X, y), X[:1], target_opset=OPSET)
    with pytest.raises(Exception, match="ShapeInferenceError"):  # NOTE: what the pass meets
        onnx.shape_inference.infer_shapes(onx, strict_mode=True)
    with caplog.at_level("WARNING"):
        losses, _ = train(onnxopt.compile_train_step(onx, loss="square", update="sgd", learning_rate=0.05), X, 2 * y + 1)
    assert not [r for r in caplog.records if "Shape inference failed" in r.getMessage()]
    assert losses[-1] < 0.5 * losses[0]


def test_a_pipeline_that_scales_itself_keeps_what_it_learnt(tmp_path):
    """scale="auto" cannot fold its statistics into a pipeline starting with StandardScaler (no MatMul/Gemm
    reads the input): the inputs stay raw, so the first loss is scikit-learn's; a resumed fit stays raw too."""
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(0)
    X = (rng.normal(size=(200, 4)) * [1, 10, 100, 0.1] + [0, 5, -50, 1]).astype(np.float32)
    y = (X[:, 0] + 0.1 * X[:, 1] + 0.01 * X[:, 2] > 0.5).astype(np.int64)
    est = make_pipeline(StandardScaler(), LogisticRegression()).fit(X, y)
    model = to_onnx(est, X[:1], options={id(est[-1]): {"zipmap": False}})
    expected = log_loss(y, est.predict_proba(X))
    params = dict(update="sgd", learning_rate=1e-9, validation_fraction=0.0, checkpoint_dir=str(tmp_path))
    tr = onnxopt.Trainer(model, max_iter=1, **params).fit(X, y)
    assert tr.scaling_ is None or tr.scaling_.x is None  # NOTE: the data's columns are far from unit scale
    np.testing.assert_allclose(tr.train_losses_[0], expected, rtol=1e-4)
    resumed = onnxopt.Trainer(model, max_iter=2, **params).fit(X, y)
    assert resumed.n_iter_ == 2
    proba = session(resumed.trained_model_).run(None, {"X": X})[1]
    np.testing.assert_allclose(proba, est.predict_proba(X), atol=1e-4)


def test_compile_train_step_takes_the_auto_loss(data):
    """loss="auto" in compile_train_step picks what Trainer picks: a LogisticRegression's first step gives
    scikit-learn's log loss on its probabilities."""
    X, _, yc = data
    est = LogisticRegression().fit(X, yc)
    step = onnxopt.compile_train_step(to_onnx(est, X[:1], options={id(est): {"zipmap": False}}), loss="auto")
    loss = onnxopt.Runner(step).step(X, yc)
    np.testing.assert_allclose(loss, log_loss(yc, est.predict_proba(X)), rtol=1e-5)


def test_a_loss_on_scores_read_from_probabilities_warns(data):
    """cross_entropy (from logits) on skl2onnx's probabilities, Concat(1 - p, p) of a Sigmoid, trains a softmax of
    probabilities: it warns and names the loss on probabilities; that loss and loss="auto" do not."""
    X, _, yc = data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        est = MLPClassifier(hidden_layer_sizes=(4,), max_iter=5, random_state=0).fit(X, yc)
    model = to_onnx(est, X[:1], options={id(est): {"zipmap": False}})
    with pytest.warns(UserWarning, match=r"'cross_entropy' applies its own softmax to output 'probabilities'.*"
                                         r"Sigmoid node.*cross_entropy:from_logits=false"):
        onnxopt.compile_train_step(model, loss="cross_entropy", output="probabilities")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        onnxopt.compile_train_step(model, loss="cross_entropy:from_logits=false", output="probabilities")
        onnxopt.compile_train_step(model, loss="auto")


@pytest.mark.parametrize("make", ["pca", "pca_whiten", "svd"])
def test_a_decomposition_before_the_estimator_is_not_trained(data, make):
    """PCA's or TruncatedSVD's components (and whitening variances) are a transformer's fitted statistics: only
    the estimator after them trains, from scikit-learn's loss."""
    from sklearn.decomposition import PCA, TruncatedSVD
    from sklearn.pipeline import make_pipeline

    X, y, _ = data
    first = {"pca": PCA(3), "pca_whiten": PCA(3, whiten=True), "svd": TruncatedSVD(2)}[make]
    est = make_pipeline(first, LinearRegression()).fit(X, y)
    model = to_onnx(est, X[:1])
    assert sorted(onnxopt.train_initializers(model)) == ["LinearRegressor_coef", "LinearRegressor_intercept"]
    step = onnxopt.compile_train_step(model, loss="square", learning_rate=1e-9)
    loss = onnxopt.Runner(step).step(X, y.reshape(-1, 1))
    np.testing.assert_allclose(loss, np.mean((est.predict(X) - y) ** 2), rtol=1e-4)


@pytest.mark.parametrize("kind", ["regressor", "classifier"])
def test_nearest_neighbours_have_nothing_to_train(data, kind):
    """skl2onnx's KNeighbors* keep the training set (distances in a Scan, targets looked up by computed
    indices): data, not parameters; compiling says so instead of failing on one of them."""
    from sklearn.neighbors import KNeighborsClassifier, KNeighborsRegressor

    X, y, yc = data
    est = KNeighborsRegressor(3).fit(X, y) if kind == "regressor" else KNeighborsClassifier(3).fit(X, yc)
    model = to_onnx(est, X[:1], options={id(est): {"zipmap": False}} if kind == "classifier" else None)
    assert onnxopt.train_initializers(model) == {}
    with pytest.raises(onnxopt.WeightError, match=r"no float initializer to train.*hold stored data.*nearest"):
        onnxopt.compile_train_step(model, loss="square" if kind == "regressor" else "auto")


def test_gaussian_nb_trains_its_means_variances_and_priors(data):
    """GaussianNB's parameters are theta, the variances and the log priors; skl2onnx's stored normalizer
    -½·Σ log(2π·σ²) is computed from the variances, so the trained model is still a Gaussian naive Bayes."""
    from sklearn.naive_bayes import GaussianNB

    X, _, yc = data
    est = GaussianNB().fit(X, yc)
    model = to_onnx(est, X[:1], options={id(est): {"zipmap": False}})
    assert sorted(onnxopt.train_initializers(model)) == ["jointi", "sigma", "theta"]
    runner = onnxopt.Runner(onnxopt.compile_train_step(model, loss="auto", learning_rate=0.05))
    np.testing.assert_allclose(runner.step(X, yc), log_loss(yc, est.predict_proba(X)), rtol=1e-5)
    for _ in range(5):
        runner.step(X, yc)
    w = {k: v.astype(np.float64) for k, v in runner.get_weights().items()}
    theta, var, prior = w["theta"][0], w["sigma"][0], w["jointi"][0]
    jll = prior - 0.5 * np.log(2 * np.pi * var).sum(axis=1) - 0.5 * (((X[:, None, :] - theta) ** 2) / var).sum(axis=2)
    expected = np.exp(jll - jll.max(axis=1, keepdims=True))
    expected /= expected.sum(axis=1, keepdims=True)
    proba = session(runner.export()).run(None, {"X": X})[1]
    assert not np.allclose(var, est.var_)  # NOTE: the variances moved: a stale normalizer would show
    np.testing.assert_allclose(proba, expected, atol=1e-5)


# -- the second sweep: estimators and pipelines users hand over ----------------------------------------------


def _sk_mse(est, X, y):
    return float(np.mean((np.asarray(est.predict(X), np.float64).reshape(len(X), -1) - y.reshape(len(X), -1)) ** 2))


def _gradient_against_finite_differences(model, estimators, X, y, loss_fn, rtol=1e-5):
    """The float64 step's gradient of every weight against central differences of ``loss_fn()`` (scikit-learn's
    loss) in the estimators' ``coef_`` / ``intercept_``; each weight located by value (``zoo.common.locate``)."""
    from zoo.common import assert_gradients, assert_one_to_one, central_differences, first_step, locate

    params = {f"{i}.{a}": np.atleast_1d(np.asarray(getattr(e, a), np.float64)).copy()
              for i, e in enumerate(estimators) for a in ("coef_", "intercept_")}

    def assign(flat):
        start = 0
        for key, p in params.items():
            i, attr = key.split(".")
            value = flat[start:start + p.size].reshape(p.shape)
            setattr(estimators[int(i)], attr, value if np.ndim(getattr(estimators[int(i)], attr)) else value[0])
            start += p.size

    loss, grads, weights = first_step(model, "eval", X, y, loss="auto")
    np.testing.assert_allclose(loss, loss_fn(), rtol=1e-9)
    where = locate(params, onnxopt.train_initializers(model))
    assert_one_to_one(where, params)
    fd = central_differences(np.concatenate([p.ravel() for p in params.values()]), assign, loss_fn)
    assert_gradients(grads, fd, where, rtol=rtol, atol=1e-7 * np.abs(fd).max())


@pytest.mark.parametrize("make", ["poisson", "gamma", "tweedie"])
def test_glm_regressors_train_the_squared_error_of_their_prediction(data, make):
    """PoissonRegressor, GammaRegressor, TweedieRegressor(link='log'): skl2onnx writes exp(X·w + b); loss="auto"
    trains its squared error (not the GLM's deviance), coef_ and intercept_ only."""
    from sklearn.linear_model import GammaRegressor, PoissonRegressor, TweedieRegressor

    X32, y32, _ = data
    X, y = X32.astype(np.float64), np.exp(0.3 * y32.astype(np.float64)).reshape(-1, 1)
    est = {"poisson": PoissonRegressor(), "gamma": GammaRegressor(),
           "tweedie": TweedieRegressor(power=1.5, link="log")}[make].fit(X, y.ravel())
    model = to_onnx(est, X[:1], target_opset=OPSET)
    assert choose_loss(model, "auto", None)[0] == "square"
    _gradient_against_finite_differences(model, [est], X, y, lambda: _sk_mse(est, X, y))


def test_voting_regressor_trains_its_estimators_not_its_voting_weights(data):
    """VotingRegressor's shares (skl2onnx's one-element w0, w1) are hyperparameters: each linear model's
    coefficients train, from central differences of the ensemble's squared error."""
    from sklearn.ensemble import VotingRegressor
    from sklearn.linear_model import Ridge

    X32, y32, _ = data
    X, y = X32.astype(np.float64), y32.astype(np.float64).reshape(-1, 1)
    # NOTE: weights as an array: skl2onnx 1.x calls weights.sum() (a list fails to convert)
    est = VotingRegressor([("a", Ridge(alpha=50.0)), ("b", LinearRegression())], weights=np.array([2.0, 1.0]))
    est.fit(X, y.ravel())
    for dtype in (np.float32, np.float64):
        model = to_onnx(est, X[:1].astype(dtype), target_opset=OPSET)
        assert not [w for w in onnxopt.train_initializers(model) if w.startswith("w")]
        assert len(onnxopt.train_initializers(model)) == 4
    _gradient_against_finite_differences(model, est.estimators_, X, y, lambda: _sk_mse(est, X, y))


def test_multi_output_ridge_trains_every_target(data):
    from sklearn.linear_model import Ridge

    X32, y32, _ = data
    X, y = X32.astype(np.float64), np.c_[y32, 1 - 0.5 * y32].astype(np.float64)
    est = Ridge(alpha=100.0).fit(X, y)
    _gradient_against_finite_differences(to_onnx(est, X[:1], target_opset=OPSET), [est], X, y,
                                         lambda: _sk_mse(est, X, y))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_column_transformer_s_scaler_is_not_trained(data, dtype):
    """A ColumnTransformer scaling some columns and passing the others: the scaler's mean and scale (float64:
    Sub/Div initializers behind a column Gather and a Concat) are statistics; Ridge's coefficients train."""
    from sklearn.compose import ColumnTransformer
    from sklearn.linear_model import Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    X32, y32, _ = data
    X, y = X32.astype(dtype), y32.astype(dtype)
    est = make_pipeline(ColumnTransformer([("s", StandardScaler(), [0, 1]), ("p", "passthrough", [2, 3])]),
                        Ridge()).fit(X, y)
    model = to_onnx(est, X[:1], target_opset=OPSET)
    assert len(onnxopt.train_initializers(model)) == 2
    step = onnxopt.compile_train_step(model, loss="auto", learning_rate=1e-9)
    np.testing.assert_allclose(onnxopt.Runner(step).step(X, y.reshape(-1, 1)), _sk_mse(est, X, y), rtol=1e-4)


@pytest.mark.parametrize("make", ["lasso", "huber", "ard", "lda3", "ovr3", "passive_aggressive"])
def test_more_linear_estimators_start_from_scikit_learn_s_loss(data, make):
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
    from sklearn.linear_model import ARDRegression, HuberRegressor, Lasso, PassiveAggressiveClassifier
    from sklearn.multiclass import OneVsRestClassifier

    X, y, labels = data
    y3 = np.digitize(y, np.quantile(y, [0.33, 0.66]))
    est, target = {"lasso": (Lasso(0.1), y), "huber": (HuberRegressor(), y), "ard": (ARDRegression(), y),
                   "lda3": (LinearDiscriminantAnalysis(), y3), "ovr3": (OneVsRestClassifier(LogisticRegression()), y3),
                   "passive_aggressive": (PassiveAggressiveClassifier(max_iter=3, random_state=0), labels)}[make]
    est = _fit(est, X, target)
    model = to_onnx(est, X[:1], options={id(est): {"zipmap": False}} if hasattr(est, "classes_") else None,
                    target_opset=OPSET)
    loss, _ = choose_loss(model, "auto", None)
    step = onnxopt.compile_train_step(model, loss="auto", update="sgd", learning_rate=0.1)
    runner = onnxopt.Runner(step)
    first = runner.step(X, target if hasattr(est, "classes_") else target.reshape(-1, 1))
    if loss == "square":
        expected = _sk_mse(est, X, target)
    elif loss == "cross_entropy":  # NOTE: PassiveAggressiveClassifier's decision scores, (-s, s)
        d = est.decision_function(X).astype(np.float64)
        expected = np.mean(np.logaddexp(0, -2 * d * (2 * target - 1)))
    else:
        expected = log_loss(target, est.predict_proba(X))
    np.testing.assert_allclose(first, expected, rtol=1e-4)
    assert runner.step(X, target if hasattr(est, "classes_") else target.reshape(-1, 1)) < first


def test_a_multilabel_classifier_is_refused_with_its_reason(data):
    """skl2onnx writes a multilabel MLPClassifier's probabilities as (1 - p, p) per label, (N, 4) for 2 labels
    while declaring (N, 2): loss="auto" refuses the model as multilabel, an explicit loss names the contradicted
    shapes (not onnxruntime's bare Fail)."""
    X, _, labels = data
    multi = np.c_[labels, X[:, 0] > 0].astype(np.int64)
    est = _fit(MLPClassifier(hidden_layer_sizes=(4,), max_iter=3, random_state=0), X, multi)
    model = to_onnx(est, X[:1], options={id(est): {"zipmap": False}}, target_opset=OPSET)
    with pytest.raises(onnxopt.errors.ModelError, match="multilabel classifier.*Binarizer"):
        onnxopt.compile_train_step(model, loss="auto")
    with pytest.raises(onnxopt.errors.ModelError, match="multilabel"):
        onnxopt.Trainer(model, max_iter=1).fit(X, multi)
    step = onnxopt.compile_train_step(model, loss="cross_entropy:from_logits=false", output="probabilities")
    with pytest.raises(onnxopt.errors.ModelError, match="declared shapes.*contradict"):
        onnxopt.Runner(step)


def test_calibrated_classifier_is_refused_by_op_and_node(data):
    """CalibratedClassifierCV picks columns of an intermediate (ArrayFeatureExtractor on a value of unknown
    rank, not lowered): the error names the op and the nodes."""
    from sklearn.calibration import CalibratedClassifierCV

    X, _, labels = data
    est = CalibratedClassifierCV(LogisticRegression(), cv=2).fit(X, labels)
    model = to_onnx(est, X[:1], options={id(est): {"zipmap": False}}, target_opset=OPSET)
    with pytest.raises(onnxopt.errors.NotDifferentiableError, match=r"ArrayFeatureExtractor \(node 'CaliAFE_"):
        onnxopt.compile_train_step(model, loss="auto")
