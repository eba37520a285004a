"""Rewrite rules for the ``ai.onnx.ml`` ops scikit-learn converters emit.

``ml_rules`` (applied by ``modelio.load_model``, before weights are chosen) lower the ``ai.onnx.ml`` ops
scikit-learn converters emit, whose coefficients are attributes without a gradient, to standard ops whose
coefficients are initializers (weights to train), computing the same outputs:
- ``LinearRegressor(X)`` (post_transform NONE) -> ``MatMul(Cast(X, float), <node>_coef) + <node>_intercept``
  with ``<node>_coef`` = coefficients reshaped (targets, features) and transposed.
- ``LinearClassifier(X)`` -> raw scores ``s = MatMul(Cast(X, float), <node>_coef) + <node>_intercept``, then
  the scores output: ``Concat(1 - s, s)`` for one score and two class labels (onnxruntime's binary case,
  whatever the post_transform), else ``s`` / ``Sigmoid(s)`` / ``Softmax(s)`` for post_transform NONE /
  LOGISTIC / SOFTMAX; the label output: ``Where(s > 0, labels[1], labels[0])`` or ``labels[ArgMax(s)]``.
  PROBIT and SOFTMAX_ZERO are left alone (then reported by ``NotDifferentiableError``).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRule, RewriteRuleSet

__all__ = ["ml_rules", "lower_ml_ops"]


ML_DOMAIN = "ai.onnx.ml"


def _unique(node: ir.Node, base: str) -> str:
    taken = node.graph.initializers if node.graph is not None else {}
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    return name


def _affine(op, x, node: ir.Node, n_targets: int):
    """MatMul(Cast(X, float), coef) + intercept, the node's coefficient attributes as new initializers."""
    coef = np.asarray(node.attributes.get_floats("coefficients"), dtype=np.float32).reshape(n_targets, -1).T
    prefix = node.name or node.outputs[-1].name or node.op_type
    xf = x if x.dtype == ir.DataType.FLOAT else op.Cast(x, to=ir.DataType.FLOAT)
    y = op.MatMul(xf, op.initializer(ir.tensor(np.ascontiguousarray(coef)), _unique(node, f"{prefix}_coef")))
    intercepts = node.attributes.get_floats("intercepts", [])
    if len(intercepts):
        b = op.initializer(ir.tensor(np.asarray(intercepts, dtype=np.float32)), _unique(node, f"{prefix}_intercept"))
        y = op.Add(y, b)
    return y


def _coefficients_fit(node: ir.Node, n_targets: int) -> bool:
    coef = node.attributes.get_floats("coefficients", [])
    return n_targets > 0 and len(coef) > 0 and len(coef) % n_targets == 0


def _linear_regressor(op, x):
    return op.LinearRegressor(x, _domain=ML_DOMAIN, _allow_other_attributes=True, _outputs=["out"])


def _linear_regressor_check(context, x, out, **_) -> MatchResult:
    result = MatchResult()
    node = out.producer()
    if node.attributes.get_string("post_transform", "NONE") != "NONE":
        return result.fail("LinearRegressor: only post_transform NONE is lowered")
    if not _coefficients_fit(node, node.attributes.get_int("targets", 1)):
        return result.fail("LinearRegressor: coefficients do not split into 'targets' rows")
    return result


def _linear_regressor_lowered(op, x, out):
    node = out.producer()
    return _affine(op, x, node, node.attributes.get_int("targets", 1))


def _linear_classifier(op, x):
    return op.LinearClassifier(x, _domain=ML_DOMAIN, _allow_other_attributes=True, _outputs=["label", "scores"])


def _class_labels(node: ir.Node) -> list:
    strings = node.attributes.get_strings("classlabels_strings", [])
    return list(strings) if len(strings) else list(node.attributes.get_ints("classlabels_ints", []))


def _labels(op, labels: list):
    if labels and isinstance(labels[0], str):
        return op.Constant(value=ir.StringTensor([s.encode("utf-8") for s in labels], shape=ir.Shape([len(labels)])))
    return op.Constant(value=ir.tensor(np.array(labels, dtype=np.int64)))


def _linear_classifier_check(context, x, label, scores, **_) -> MatchResult:
    result = MatchResult()
    node = scores.producer()
    n_classes = len(node.attributes.get_floats("intercepts", []))
    transform = node.attributes.get_string("post_transform", "NONE")
    if not _coefficients_fit(node, n_classes):
        return result.fail("LinearClassifier: needs one intercept per row of coefficients")
    n_labels = len(_class_labels(node))
    if n_classes == 1 and n_labels != 2:
        return result.fail("LinearClassifier: one score needs two class labels")
    if n_classes > 1 and (n_labels != n_classes or transform not in ("NONE", "LOGISTIC", "SOFTMAX")):
        return result.fail(f"LinearClassifier: post_transform {transform} or these class labels are not lowered")
    return result


def _linear_classifier_lowered(op, x, label, scores):
    node = scores.producer()
    labels = _class_labels(node)
    n_classes = len(node.attributes.get_floats("intercepts"))
    s = _affine(op, x, node, n_classes)
    if n_classes == 1:  # onnxruntime's binary case: scores (1 - s, s), label by the sign of s
        one = op.Constant(value=ir.tensor(np.array([1.0], dtype=np.float32)))
        positive = op.Greater(op.Reshape(s, op.Constant(value_ints=[-1])), op.Constant(value_float=0.0))
        y = op.Where(positive, _labels(op, labels[1:2]), _labels(op, labels[0:1]))
        return y, op.Concat(op.Sub(one, s), s, axis=1)
    y = op.Gather(_labels(op, labels), op.ArgMax(s, axis=1, keepdims=0), axis=0)
    transform = node.attributes.get_string("post_transform", "NONE")
    z = op.Sigmoid(s) if transform == "LOGISTIC" else op.Softmax(s, axis=1) if transform == "SOFTMAX" else s
    return y, z


ml_rules = RewriteRuleSet([
    RewriteRule(_linear_regressor, _linear_regressor_lowered, _linear_regressor_check,
                name="LinearRegressorToMatMulAdd"),
    RewriteRule(_linear_classifier, _linear_classifier_lowered, _linear_classifier_check,
                name="LinearClassifierToMatMulAdd"),
])


def lower_ml_ops(model: ir.Model) -> ir.Model:
    """Applies ``ml_rules`` in place when the graph holds one of their ``ai.onnx.ml`` ops; returns ``model``."""
    if any(n.domain == ML_DOMAIN and n.op_type in ("LinearRegressor", "LinearClassifier") for n in model.graph):
        ml_rules.apply_to_model(model)
    return model
