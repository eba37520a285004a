"""What ``loss="auto"`` means for a model, and the metrics that fit a loss (R², accuracy, log loss).

A model with a label output (int64 or string tensor, as skl2onnx's classifiers have) and one other output (the
probabilities, a tensor or ZipMap's dictionaries) is a classifier: the loss is
``cross_entropy(from_logits=False)`` on the probabilities, or ``cross_entropy`` on scores when that output is
computed from the inputs by linear and layout ops alone, nothing that could normalize it (skl2onnx names the
decision scores of SGDClassifier(hinge), Perceptron and LinearSVC "probabilities"); one such column (the positive
class's probability or score, LinearSVC's and RidgeClassifier's for two classes) takes the binary ``log`` loss.
A multilabel classifier (its label output a Binarizer's, skl2onnx's multilabel MLPClassifier) is refused with
an error saying why. Any other model is a regressor: ``square`` (GLMs too: PoissonRegressor, GammaRegressor,
TweedieRegressor train the squared error of their prediction exp(X·w + b), not their deviance).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxopt.errors import ModelError

__all__ = ["choose_loss", "metrics"]

_LABEL_TYPES = (ir.DataType.INT64, ir.DataType.INT32, ir.DataType.STRING)
CLASSIFIER_LOSS = "cross_entropy:from_logits=false"


def choose_loss(model, loss, output: str | None) -> tuple:
    """``(loss, output)`` with ``loss="auto"`` replaced by the loss that fits ``model`` (see the module)."""
    if not (isinstance(loss, str) and loss == "auto"):
        return loss, output
    if model is None:  # NOTE: a step saved without its inference model
        return "square", output
    from onnxopt.modelio import load_model  # NOTE: its one-line errors; ZipMap's dictionaries become a tensor

    outputs = load_model(model).graph.outputs
    labels = [v.name for v in outputs if isinstance(v.type, ir.TensorType) and v.dtype in _LABEL_TYPES]
    others = [v.name for v in outputs if v.name not in labels]
    if not labels or output in labels:
        return "square", output
    multi = next((v.name for v in outputs if v.name in labels and _binarized(v)), None)
    if multi is not None:
        raise ModelError(
            f"loss: the model is a multilabel classifier (its label output {multi!r} thresholds one column per "
            f"label with a Binarizer node); loss='auto' knows single-label classifiers only, and skl2onnx writes "
            f"a multilabel MLPClassifier's probabilities as (1 - p, p) for every label, twice the columns "
            f"scikit-learn's predict_proba has: convert one classifier per label, or pass loss= and output= "
            f"for an output whose columns you know")
    if output is None and len(others) != 1:
        raise ModelError(f"loss: the model has class labels {labels} and {len(others)} other outputs {others}; "
                         f"pick the probabilities with --output NAME (output=) and --loss {CLASSIFIER_LOSS}")
    chosen = output or others[0]
    value = next(v for v in outputs if v.name == chosen)
    scores = _scores(value)
    if value.shape is not None and len(value.shape) == 2 and value.shape[1] == 1:  # NOTE: the positive class's
        return ("log" if scores else "log:from_logits=false"), chosen
    return ("cross_entropy" if scores else CLASSIFIER_LOSS), chosen


# NOTE: ops that cannot turn scores into probabilities (linear, layout, casts); any other op might normalize
_PLAIN = {"Identity", "Cast", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Concat", "Transpose", "Gather", "Slice",
          "Mul", "Add", "Sub", "Neg", "MatMul", "Gemm", "Constant"}


def _scores(value: ir.Value) -> bool:
    """Whether ``value`` is computed from the graph inputs and constants by ``_PLAIN`` ops alone (scores: no op
    on any path could make them probabilities)."""
    seen, todo = set(), [value]
    while todo:
        v = todo.pop()
        node = v.producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type not in _PLAIN or node.domain not in ("", "ai.onnx"):
            return False
        todo.extend(i for i in node.inputs if i is not None)
    return True


def _binarized(value: ir.Value) -> bool:
    """Whether ``value`` is a Binarizer's output, through casts and reshapes (skl2onnx's multilabel labels)."""
    node = value.producer()
    while node is not None and node.op_type in ("Cast", "Identity", "Reshape") and node.inputs:
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    return node is not None and node.op_type == "Binarizer"


def metrics(est, X: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """The metrics of a fitted ``Trainer`` on (X, y): R² for regression, accuracy and log loss for classes."""
    if est._kind == "regression":
        return {"R²": est.score(X, y)}
    out = np.asarray(est._raw_predict(X), np.float64).reshape(len(X), -1)
    if "eps" not in est._loss.attrs:  # NOTE: the losses on probabilities have eps, those on scores do not
        out = 1 / (1 + np.exp(-out)) if out.shape[1] == 1 else np.exp(out - out.max(axis=1, keepdims=True))
    proba = np.hstack([1 - out, out]) if out.shape[1] == 1 else out / out.sum(axis=1, keepdims=True)
    index = np.searchsorted(est.classes_, np.asarray(y))
    eps = np.finfo(np.float64).eps
    log_loss = -np.mean(np.log(np.clip(proba[np.arange(len(index)), index], eps, 1)))
    return {"accuracy": est.score(X, y), "log loss": float(log_loss)}
