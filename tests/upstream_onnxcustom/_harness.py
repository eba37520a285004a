"""Stand-ins for what onnxcustom's test suite imports from pyquickhelper, mlprodict and onnxcustom itself.

The upstream tests (sdpython/onnxcustom, see each file's header) run unchanged but for their imports, which
point here or at ``onnxopt.compat``. Everything below is test scaffolding, kept small:

- ``ExtTestCase``, ``ignore_warnings``, ``get_temp_folder``, ``skipif_appveyor``: pyquickhelper's test helpers.
- ``to_onnx``: mlprodict's converter with ``black_op={'LinearRegressor'|'LinearClassifier'}``, i.e. linear models
  as MatMul + Add with initializers ``coef`` and ``intercept`` (what mlprodict produced); other models go
  through skl2onnx (MLPs: MatMul/Add graphs with ``coefficient``/``intercepts`` weights).
- ``OnnxInference``: mlprodict's Python runtime, here onnx's reference evaluator (onnxruntime when the graph has
  ops the reference evaluator lacks), so ``check_runtime`` still compares two runtimes.
- ``onnx_simple_text_plot``, ``select_model_inputs_outputs``, ``random_feed``: mlprodict's graph utilities.
- ``TrainingSession``: the upstream tests skip themselves when onnxruntime has no ``TrainingSession`` (it left
  onnxruntime-training in 1.16); onnxopt is what trains here, so it stands for "training available".
- ``SGDClassifier`` and ``log_loss``: scikit-learn renamed ``loss='log'`` to ``'log_loss'`` (1.3) and dropped
  ``log_loss(eps=)`` (1.5); these two shims keep the upstream calls meaning what they meant.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import tempfile
import unittest
import warnings

import numpy
import onnx
import onnx.reference
import onnxruntime
import sklearn.linear_model
import sklearn.metrics
from onnx import TensorProto, helper, numpy_helper

import onnxopt

opset = 18  # onnxcustom.__max_supported_opset__
TrainingSession = onnxopt.TrainStep


class ExtTestCase(unittest.TestCase):
    """pyquickhelper's ``ExtTestCase``: the assertions onnxcustom's tests use."""

    def assertRaise(self, fct, exc_type, msg=None):
        with self.assertRaises(exc_type):
            fct()

    def assertEqualArray(self, expected, value, decimal=None):
        expected, value = numpy.asarray(expected), numpy.asarray(value)
        self.assertEqual(expected.shape, value.shape)
        if decimal is None:
            numpy.testing.assert_array_equal(expected, value)
        else:
            numpy.testing.assert_almost_equal(expected, value, decimal=decimal)

    def assertExists(self, name):
        self.assertTrue(os.path.exists(name), f"{name!r} does not exist")

    def assertNotEmpty(self, value):
        self.assertTrue(value is not None and len(value) > 0)

    def assertEmpty(self, value):
        self.assertTrue(value is None or len(value) == 0)

    def assertStartsWith(self, prefix, text):
        self.assertTrue(text.startswith(prefix), f"{text!r} does not start with {prefix!r}")

    def assertLogging(self, fct, logger_name, level=logging.WARNING):
        """Runs ``fct`` with the logger ``logger_name`` at ``level``; returns (result, captured text)."""
        logger = logging.getLogger(logger_name)
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        old = logger.level
        logger.addHandler(handler)
        logger.setLevel(level)
        try:
            res = fct()
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old)
        return res, stream.getvalue()


def ignore_warnings(warns):
    """Decorator silencing the warning class(es) ``warns``."""
    warns = warns if isinstance(warns, tuple) else (warns,)

    def wrap(fct):
        @functools.wraps(fct)
        def call(*args, **kwargs):
            with warnings.catch_warnings():
                for w in warns:
                    warnings.simplefilter("ignore", w)
                return fct(*args, **kwargs)

        return call

    return wrap


def skipif_appveyor(msg):
    return lambda fct: fct


def get_temp_folder(file, name, clean=True):
    """A fresh folder per test (under the system temp folder, not beside the test file)."""
    return tempfile.mkdtemp(prefix=f"{name}_")


def SGDClassifier(loss="hinge", **kwargs):  # noqa: N802
    return sklearn.linear_model.SGDClassifier(loss="log_loss" if loss == "log" else loss, **kwargs)


def log_loss(y_true, y_pred, eps=None, **kwargs):
    if eps is not None:
        y_pred = numpy.clip(y_pred, eps, 1 - eps)
    return sklearn.metrics.log_loss(y_true, y_pred, **kwargs)


def _linear(model, X, classifier: bool) -> onnx.ModelProto:
    """mlprodict's linear model with the ONNX-ML op blacklisted: MatMul(X, coef) + intercept."""
    elem = helper.np_dtype_to_tensor_dtype(X.dtype)
    coef = numpy.asarray(model.coef_, dtype=X.dtype).reshape((-1, X.shape[1])).T
    intercept = numpy.asarray(model.intercept_, dtype=X.dtype).reshape((-1,))
    inits = [numpy_helper.from_array(coef, "coef"), numpy_helper.from_array(intercept, "intercept")]
    nodes = [helper.make_node("MatMul", ["X", "coef"], ["mul"]), helper.make_node("Add", ["mul", "intercept"],
                                                                                  ["variable" if not classifier else "score"])]
    x = helper.make_tensor_value_info("X", elem, [None, X.shape[1]])
    if not classifier:
        outputs = [helper.make_tensor_value_info("variable", elem, [None, 1])]
    else:
        inits.append(numpy_helper.from_array(numpy.array([1], dtype=X.dtype), "one"))
        inits.append(numpy_helper.from_array(numpy.array([0], dtype=X.dtype), "zero"))
        nodes += [helper.make_node("Sigmoid", ["score"], ["p1"]), helper.make_node("Sub", ["one", "p1"], ["p0"]),
                  helper.make_node("Concat", ["p0", "p1"], ["probabilities"], axis=1),
                  helper.make_node("Greater", ["score", "zero"], ["positive"]),
                  helper.make_node("Cast", ["positive"], ["label2"], to=TensorProto.INT64),
                  helper.make_node("Reshape", ["label2", "flat"], ["label"])]
        inits.append(numpy_helper.from_array(numpy.array([-1], dtype=numpy.int64), "flat"))
        outputs = [helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
                   helper.make_tensor_value_info("probabilities", elem, [None, 2])]
    graph = helper.make_graph(nodes, "linear", [x], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def to_onnx(model, X, target_opset=None, black_op=None, options=None):
    """mlprodict's ``to_onnx`` for the models onnxcustom's tests convert."""
    linear = (sklearn.linear_model.LinearRegression, sklearn.linear_model.SGDRegressor,
              sklearn.linear_model.LogisticRegression, sklearn.linear_model.SGDClassifier)
    if hasattr(model, "best_estimator_"):
        model = model.best_estimator_
    if isinstance(model, linear):
        return _linear(model, X, isinstance(model, (sklearn.linear_model.LogisticRegression,
                                                    sklearn.linear_model.SGDClassifier)))
    import skl2onnx

    opts = {id(model): {k: v for k, v in (options or {}).items() if k == "zipmap"}} if options else None
    return skl2onnx.to_onnx(model, X, target_opset=target_opset or opset, options=opts)


class OnnxInference:
    """mlprodict's runtime: ``run(feeds) -> {output name: array}`` with onnx's reference evaluator."""

    def __init__(self, onx):
        self.onx = onx

    def run(self, feeds):
        names = [o.name for o in self.onx.graph.output]
        try:
            return dict(zip(names, onnx.reference.ReferenceEvaluator(self.onx).run(None, feeds)))
        except (NotImplementedError, RuntimeError, KeyError, TypeError) as exc:
            if "com.microsoft" not in str(exc) and "ai.onnx.ml" not in str(exc) and "domain" not in str(exc):
                raise
        sess = onnxruntime.InferenceSession(self.onx.SerializeToString(), providers=["CPUExecutionProvider"])
        return dict(zip(names, sess.run(None, feeds)))


def onnx_simple_text_plot(onx) -> str:
    """One line per input, node and output: ``input: name='X'``, ``Op(a, b) -> c``, ``output: name='Y'``."""
    lines = [f"input: name={i.name!r}" for i in onx.graph.input]
    lines += [f"init: name={i.name!r}" for i in onx.graph.initializer]
    lines += [f"{n.op_type}({', '.join(n.input)}) -> {', '.join(n.output)}" for n in onx.graph.node]
    lines += [f"output: name={o.name!r}" for o in onx.graph.output]
    return "\n".join(lines)


def select_model_inputs_outputs(onx, outputs=None, infer_shapes=False):
    """The model cut so that its outputs are ``outputs`` (intermediate results), unused nodes removed."""
    inferred = onnx.shape_inference.infer_shapes(onx)
    known = {v.name: v for v in [*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input]}
    needed, nodes = set(outputs), []
    for node in reversed(list(onx.graph.node)):
        if needed & set(node.output):
            nodes.insert(0, node)
            needed |= set(node.input)
    graph = helper.make_graph(nodes, onx.graph.name, [i for i in onx.graph.input if i.name in needed],
                              [known[o] for o in outputs], [i for i in onx.graph.initializer if i.name in needed])
    model = helper.make_model(graph, opset_imports=onx.opset_import, ir_version=onx.ir_version)
    return model


def random_feed(inputs, batch=10, empty_dimension=1):
    """Random float inputs of the declared shapes, as mlprodict's: ``batch`` rows where the first dimension is
    free, ``empty_dimension`` where a later one is (so a graph that declares fewer static dims than it needs
    fails, as it did upstream)."""
    rng = numpy.random.default_rng(0)
    feeds = {}
    for i in inputs:
        dims = [d.dim_value for d in i.type.tensor_type.shape.dim]
        shape = [dim or (batch if k == 0 else empty_dimension) for k, dim in enumerate(dims)]
        dtype = helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
        feeds[i.name] = rng.standard_normal(shape).astype(dtype)
    return feeds
