"""Rewrite rules for the ``ai.onnx.ml`` ops scikit-learn converters emit.

``ml_rules`` (applied by ``modelio.load_model``, before weights are chosen) lower the ``ai.onnx.ml`` ops
scikit-learn converters emit, whose coefficients are attributes without a gradient, to standard ops whose
coefficients are initializers (weights to train), computing the same outputs:
- ``LinearRegressor(X)`` (post_transform NONE) -> ``MatMul(Cast(X, float), <node>_coef) + <node>_intercept``
  with ``<node>_coef`` = coefficients reshaped (targets, features) and transposed.
- ``LinearClassifier(X)`` -> raw scores ``s = MatMul(Cast(X, float), <node>_coef) + <node>_intercept``, then
  the scores output: ``Concat(1 - s, s)`` for one score and two class labels (``s = Sigmoid(s)`` first with
  LOGISTIC, as onnxruntime >= 1.20 computes it; 1.19 ignored it there) (onnxruntime's binary case,
  whatever the post_transform), else ``s`` / ``Sigmoid(s)`` / ``Softmax(s)`` for post_transform NONE /
  LOGISTIC / SOFTMAX; the label output: ``Where(s > 0, labels[1], labels[0])`` or ``labels[ArgMax(s)]``.
  PROBIT and SOFTMAX_ZERO are left alone (then reported by ``NotDifferentiableError``).
- ``ArrayFeatureExtractor(X, i)`` of float scores and constant indices -> ``Gather(X, i, axis=-1)`` (skl2onnx
  picks the positive-class score of LinearSVC and RidgeClassifier so).
- ``Normalizer(X, norm)`` -> ``X / ReduceSum(|X|)`` (L1), ``X / Sqrt(ReduceSum(X²))`` (L2), ``X / ReduceMax(X)``
  (MAX) along axis 1; ``Scaler(X)`` -> ``(X - offset) · scale``.
- skl2onnx's binary linear classifier ``X·(-w, w) + (-b, b)`` (lowered or as written in float64) keeps the tie:
  ``w`` and ``b`` are the weights, read through ``Concat(-w, w)`` (scikit-learn's ``coef_``, trained once).

``drop_zipmap`` (applied by ``modelio.load_model`` before anything else) removes a ``ZipMap`` that ends the
graph (skl2onnx's default for classifiers): the probabilities tensor it reads becomes the graph output, under
the ZipMap's output name (``output_probability``), shape (N, classes) instead of a list of dicts;
``restore_zipmap`` puts it back in the exported model (``Runner.export``).
"""

from __future__ import annotations

import threading

import numpy as np
import onnx
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRule

from onnxopt import graphs

__all__ = ["ml_rules", "lower_ml_ops", "drop_zipmap", "restore_zipmap"]


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
        # NOTE: LOGISTIC applies to s first, as onnxruntime >= 1.20 does (1.19 ignored it in this case)
        if node.attributes.get_string("post_transform", "NONE") == "LOGISTIC":
            s = op.Sigmoid(s)
        return y, op.Concat(op.Sub(one, s), s, axis=1)
    y = op.Gather(_labels(op, labels), op.ArgMax(s, axis=1, keepdims=0), axis=0)
    transform = node.attributes.get_string("post_transform", "NONE")
    z = op.Sigmoid(s) if transform == "LOGISTIC" else op.Softmax(s, axis=1) if transform == "SOFTMAX" else s
    return y, z


def _normalizer(op, x):
    return op.Normalizer(x, _domain=ML_DOMAIN, _allow_other_attributes=True, _outputs=["out"])


def _normalizer_check(context, x, out, **_) -> MatchResult:
    result = MatchResult()
    norm = out.producer().attributes.get_string("norm", "MAX")
    return result if norm in ("L1", "L2", "MAX") else result.fail(f"Normalizer: norm {norm!r} is not lowered")


def _normalizer_lowered(op, x, out):
    norm = out.producer().attributes.get_string("norm", "MAX")
    xf = x if x.dtype == ir.DataType.FLOAT else op.Cast(x, to=ir.DataType.FLOAT)
    axes = op.Constant(value_ints=[1])
    if norm == "L1":
        return op.Div(xf, op.ReduceSum(op.Abs(xf), axes, keepdims=1))
    if norm == "L2":
        return op.Div(xf, op.Sqrt(op.ReduceSum(op.Mul(xf, xf), axes, keepdims=1)))
    return op.Div(xf, op.ReduceMax(xf, axes, keepdims=1))


def _feature_extractor(op, x, i):
    return op.ArrayFeatureExtractor(x, i, _domain=ML_DOMAIN, _outputs=["out"])


def _feature_extractor_check(context, x, i, out, **_) -> MatchResult:
    result = MatchResult()
    # NOTE: X lowered in the same pass has no type yet: the output's declared one tells (X of rank 1 gives (1, k))
    dtype, shape = x.dtype or out.dtype, out.shape
    ranked = (x.shape is not None and len(x.shape) >= 2) or (shape is not None and len(shape) >= 2 and shape[0] != 1)
    if dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE) or not ranked:
        return result.fail("ArrayFeatureExtractor: only float data of rank >= 2 is lowered")
    values = _indices(i)
    if values is None or values.ndim > 1:
        return result.fail("ArrayFeatureExtractor: only a constant index or vector of indices is lowered")
    return result


def _indices(i: ir.Value) -> np.ndarray | None:
    """The value of the constant ``i`` (an initializer or a Constant node's tensor), else None."""
    tensor, node = i.const_value, i.producer()
    if tensor is None and node is not None and node.op_type == "Constant" and "value" in node.attributes:
        tensor = node.attributes["value"].value
    return None if tensor is None else tensor.numpy()


def _feature_extractor_lowered(op, x, i, out):
    index = op.Reshape(op.Cast(i, to=ir.DataType.INT64), op.Constant(value_ints=[-1]))  # NOTE: a scalar keeps its axis
    picked = op.Gather(x, index, axis=-1)
    if out.shape is not None and len(out.shape) == 2:  # NOTE: skl2onnx declares RidgeClassifier's one column as 2
        _RESHAPED.append((picked, ir.Shape([out.shape[0], _indices(i).size])))
    return picked


_RESHAPING = threading.Lock()
_RESHAPED: list[tuple[ir.Value, ir.Shape]] = []  # NOTE: shapes set once the rewriter has given the outputs the old


def _scaler(op, x):
    return op.Scaler(x, _domain=ML_DOMAIN, _allow_other_attributes=True, _outputs=["out"])


def _scaler_lowered(op, x, out):
    node = out.producer()
    xf = x if x.dtype == ir.DataType.FLOAT else op.Cast(x, to=ir.DataType.FLOAT)
    offset = np.asarray(node.attributes.get_floats("offset", [0.0]), dtype=np.float32)
    scale = np.asarray(node.attributes.get_floats("scale", [1.0]), dtype=np.float32)
    return op.Mul(op.Sub(xf, op.Constant(value=ir.tensor(offset))), op.Constant(value=ir.tensor(scale)))


_ZIPMAP_KEY = "onnxopt.zipmap"


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # NOTE: a model onnx cannot infer: the probabilities are then taken as float
        return {}
    return {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info if v.type.HasField("tensor_type")}


def drop_zipmap(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose graph-ending ZipMap nodes are removed, their input renamed to their output;
    the node and the output type are kept in the model's metadata for ``restore_zipmap``. ``model`` itself
    when it has none."""
    ends = {o.name for o in model.graph.output}
    if not any(n.op_type == "ZipMap" and n.output[0] in ends for n in model.graph.node):
        return model
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    outputs = {o.name: o for o in graph.output}
    types = _elem_types(model)
    for node in [n for n in graph.node if n.op_type == "ZipMap" and n.domain == ML_DOMAIN and n.output[0] in outputs]:
        source, name = node.input[0], node.output[0]
        dtype = types.get(source) or onnx.TensorProto.FLOAT
        kept, declared = [node], onnx.ValueInfoProto()
        declared.CopyFrom(outputs[name])
        if dtype != onnx.TensorProto.FLOAT:  # NOTE: ZipMap reads float only (skl2onnx float64 models fail to load)
            to = onnx.AttributeProto(name="to", type=onnx.AttributeProto.INT, i=onnx.TensorProto.FLOAT)
            kept = [onnx.NodeProto(op_type="Cast", input=[source], output=[source + "_float"], attribute=[to]),
                    onnx.NodeProto(op_type="ZipMap", domain=ML_DOMAIN, input=[source + "_float"], output=[name],
                                   attribute=node.attribute)]
            if declared.type.HasField("sequence_type"):
                declared.type.sequence_type.elem_type.map_type.value_type.tensor_type.elem_type = onnx.TensorProto.FLOAT
        saved = onnx.GraphProto(node=kept, output=[declared]).SerializeToString().hex()
        model.metadata_props.add(key=f"{_ZIPMAP_KEY}.{name}", value=saved)
        graph.node.remove(node)
        for other in graph.node:
            other.input[:] = [name if i == source else i for i in other.input]
            other.output[:] = [name if o == source else o for o in other.output]
        for out in graph.output:
            if out.name == source:  # NOTE: the probabilities were an output too: keep one
                graph.output.remove(out)
                break
        out = outputs[name]
        out.type.Clear()
        out.type.tensor_type.elem_type = dtype
    return model


def restore_zipmap(model: onnx.ModelProto) -> onnx.ModelProto:
    """Puts back in place (in ``model``) the ZipMap nodes ``drop_zipmap`` removed; returns ``model``."""
    for prop in [p for p in model.metadata_props if p.key.startswith(_ZIPMAP_KEY + ".")]:
        saved = onnx.GraphProto.FromString(bytes.fromhex(prop.value))
        source, output = saved.node[0].input[0], saved.output[0]
        for other in model.graph.node:
            other.input[:] = [source if i == output.name else i for i in other.input]
            other.output[:] = [source if o == output.name else o for o in other.output]
        model.graph.node.extend(saved.node)
        for out in model.graph.output:
            if out.name == output.name:
                out.CopyFrom(output)
        model.metadata_props.remove(prop)
        if not any(imp.domain == ML_DOMAIN for imp in model.opset_import):
            model.opset_import.add(domain=ML_DOMAIN, version=1)
    return model


ml_rules = graphs.rule_set([
    RewriteRule(_linear_regressor, _linear_regressor_lowered, _linear_regressor_check,
                name="LinearRegressorToMatMulAdd"),
    RewriteRule(_linear_classifier, _linear_classifier_lowered, _linear_classifier_check,
                name="LinearClassifierToMatMulAdd"),
    RewriteRule(_normalizer, _normalizer_lowered, _normalizer_check, name="NormalizerToDiv"),
    RewriteRule(_scaler, _scaler_lowered, name="ScalerToSubMul"),
    RewriteRule(_feature_extractor, _feature_extractor_lowered, _feature_extractor_check,
                name="ArrayFeatureExtractorToGather"),
])


_LOWERED = ("LinearRegressor", "LinearClassifier", "Normalizer", "Scaler", "ArrayFeatureExtractor")


def lower_ml_ops(model: ir.Model) -> ir.Model:
    """Applies ``ml_rules`` in place when the graph holds one of their ``ai.onnx.ml`` ops, then ties
    skl2onnx's binary score columns (``_tie_binary_columns``); returns ``model``."""
    if any(n.domain == ML_DOMAIN and n.op_type in _LOWERED for n in model.graph):
        with _RESHAPING:  # NOTE: _RESHAPED is shared: models lowered in two threads at once would swap shapes
            _RESHAPED.clear()
            ml_rules.apply_to_model(model)
            for value, shape in _RESHAPED:
                value.shape = shape
            _RESHAPED.clear()
    _tie_binary_columns(model)
    _derive_log_normalizer(model)
    return model


def _negated_pair(value: ir.Value | None) -> bool:
    """An initializer read once whose last axis holds two columns (-v, v), v not all zero."""
    if value is None or not value.is_initializer() or value.const_value is None or len(value.uses()) != 1:
        return False
    a = value.const_value.numpy()
    return (a.ndim >= 1 and a.shape[-1] == 2 and np.array_equal(a[..., 0], -a[..., 1])
            and bool(a[..., 1].any()))


def _tie(graph: ir.Graph, node: ir.Node, slot: int) -> None:
    """The initializer at ``slot`` of ``node`` becomes its second column ``v`` (same name), read as
    ``Concat(-v, v)``."""
    value = node.inputs[slot]
    half = value.const_value.numpy()[..., 1:]
    name = value.name
    graph.initializers.pop(name)
    value.const_value = None  # NOTE: before renaming: onnx-ir renames the tensor too (the caller's proto)
    value.name = f"{name}.pair"
    kept = ir.Value(name=name, type=value.type, shape=ir.Shape(half.shape),
                    const_value=ir.tensor(np.ascontiguousarray(half)))
    graph.register_initializer(kept)
    tape = ir.tape.Tape()
    both = tape.op("Concat", [tape.op("Neg", [kept]), kept], {"axis": half.ndim - 1})
    graph.insert_before(node, tape.nodes)
    node.replace_input_with(slot, both)


def _tie_binary_columns(model: ir.Model) -> None:
    """skl2onnx writes a binary linear classifier's scores as ``X·(-w, w) + (-b, b)`` (LogisticRegression):
    ``w`` and ``b`` become the weights, read as ``Concat(-w, w)``, so that training keeps the tie and trains
    scikit-learn's ``coef_`` and ``intercept_`` once each (two free columns would be another model)."""
    if model.producer_name != "skl2onnx":
        return
    for node in list(model.graph):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        if not _negated_pair(node.inputs[1]):
            continue
        users = list(node.outputs[0].uses())
        add = users[0][0] if len(users) == 1 and users[0][0].op_type == "Add" else None
        bias = 1 - users[0][1] if add is not None else None
        if add is None or not _negated_pair(add.inputs[bias]):
            continue
        _tie(model.graph, node, 1)
        _tie(model.graph, add, bias)


def _derive_log_normalizer(model: ir.Model) -> None:
    """skl2onnx writes GaussianNB's per-class ``-½·Σ log(2π·σ²)`` as its own initializer (``sigma_sum_log``)
    next to the variances (``sigma``): it is computed from them in the graph instead, so that training the
    variances moves it (a free copy would be another model, its normalizer stale)."""
    if model.producer_name != "skl2onnx":
        return
    inits = model.graph.initializers
    for name in [n for n in inits if n.rstrip("0123456789") == "sigma_sum_log"]:
        value, sigma = inits[name], inits.get("sigma" + name[len("sigma_sum_log"):])
        if sigma is None or value.const_value is None or sigma.const_value is None:
            continue
        var = sigma.const_value.numpy()
        derived = -0.5 * np.log(2 * np.pi * var.astype(np.float64)).sum(axis=-1)
        if var.ndim < 2 or derived.shape != value.const_value.numpy().shape or \
                not np.allclose(derived, value.const_value.numpy(), rtol=1e-5, atol=1e-6):
            continue
        inits.pop(name)
        value.const_value = None
        tape = ir.tape.Tape()
        two_pi = tape.op("Constant", [], {"value": ir.tensor(np.array(2 * np.pi, var.dtype))})
        minus_half = tape.op("Constant", [], {"value": ir.tensor(np.array(-0.5, var.dtype))})
        total = tape.op("ReduceSum", [tape.op("Log", [tape.op("Mul", [sigma, two_pi])]),
                                      tape.op("Constant", [], {"value": ir.tensor(np.array([-1], np.int64))})],
                        {"keepdims": 0})
        out = tape.op("Mul", [total, minus_half])
        model.graph.insert_before(next(n for n, _ in value.uses()), tape.nodes)
        ir.convenience.replace_all_uses_with(value, out)
        out.name = name
