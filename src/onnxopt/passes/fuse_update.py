"""Update rules folded into the kernels around them, as onnxscript rewrite rules on the finished step.

- ``GemmUpdate``: SGD with a constant learning rate on a weight whose gradient is a ``Gemm``:
  ``W - c·Gemm(A, B, transA=1)`` is one ``Gemm(A, B, C=W, alpha=-c, beta=1, transA=1)`` (3 kernels -> 1).
- ``MulByOne``: ``x·1`` (Adam's ``w·(1 - lr·λ)`` with λ = 0) is ``x``; exact, so it is dropped.
- ``ReshapeKeepsShape``: a ``Reshape`` to a constant shape that the input already has (the losses'
  ``Reshape(y, [0, -1])`` of a 2-D prediction) is dropped.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common
from onnxscript.rewriter import MatchResult, RewriteRule

from onnxopt import graphs
from onnxopt.passes.kernels import sgd_kernel_rules

__all__ = ["update_rules", "fuse_update", "scalar_value"]


def scalar_value(value: ir.Value) -> float | None:
    """The value of a one-element constant (initializer or Constant node), else None."""
    tensor = value.const_value
    if tensor is None and value.producer() is not None and value.producer().op_type == "Constant":
        attr = value.producer().attributes.get("value")
        tensor = attr.value if attr is not None else None
    if tensor is None:
        return None
    array = tensor.numpy()
    return float(array.reshape(-1)[0]) if array.size == 1 else None


def _sgd_gemm(op, w, c, a, b):
    return op.Sub(w, op.Mul(c, op.Gemm(a, b, _allow_other_attributes=True, _outputs=["grad"])), _outputs=["new"])


def _sgd_gemm_swapped(op, w, c, a, b):
    return op.Sub(w, op.Mul(op.Gemm(a, b, _allow_other_attributes=True, _outputs=["grad"]), c), _outputs=["new"])


def _sgd_gemm_check(context, w, c, a, b, grad, new, **_) -> MatchResult:
    result = MatchResult()
    node = grad.producer()
    if not new.producer().metadata_props.get(graphs.REGION, "").startswith("update"):
        return result.fail("not an update: a model's own x - c·Gemm(...) keeps its rounding")
    lr = scalar_value(c)
    if lr is None:
        return result.fail("the learning rate is not a constant (a schedule): Gemm's alpha is an attribute")
    if float(np.float32(lr)) != lr:  # NOTE: alpha is a float32 attribute: a float64 step would lose digits
        return result.fail(f"the learning rate {lr!r} is not exact in float32 (Gemm's alpha)")
    adds = len(node.inputs) > 2 and node.inputs[2] is not None and node.attributes.get_float("beta", 1.0) != 0.0
    if node.attributes.get_float("alpha", 1.0) != 1.0 or adds:
        return result.fail("the gradient Gemm scales or adds already")
    if w.shape is None or grad.shape is None or len(w.shape) != 2 or w.shape != grad.shape:
        return result.fail(f"weight shape {w.shape} is not the 2-D shape of the gradient {grad.shape}")
    return result


def _sgd_as_gemm(op, w, c, a, b, grad, new):
    attrs = grad.producer().attributes
    return op.Gemm(a, b, w, alpha=-scalar_value(c), beta=1.0, transA=attrs.get_int("transA", 0),
                   transB=attrs.get_int("transB", 0))


def _mul(op, x, one):
    return op.Mul(x, one, _outputs=["out"])


def _mul_by_one(context, x, one, out, **_) -> MatchResult:
    result = MatchResult()
    if scalar_value(one) != 1.0 or x.shape is None or out.shape is None or x.shape != out.shape or x.dtype != out.dtype:
        return result.fail("not a multiplication by a scalar 1 that keeps the shape")
    return result


def _identity(op, x, one, out):
    return op.Identity(x)


def _reshape(op, x, shape):
    return op.Reshape(x, shape, _allow_other_attributes=True, _outputs=["out"])


def _reshape_keeps_shape(context, x, shape, out, **_) -> MatchResult:
    result = MatchResult()
    target = shape.const_value.numpy().tolist() if shape.const_value is not None else None
    if target is None or x.shape is None or len(target) != len(x.shape):
        return result.fail("the target shape is not a constant of the input's rank")
    if out.producer().attributes.get_int("allowzero", 0) != 0:
        return result.fail("allowzero=1: a 0 is a zero-length dimension")
    # NOTE: when every other entry keeps the input's dimension, the one -1 can only be that dimension too
    same = [t == 0 or (isinstance(d, int) and t == d) for t, d in zip(target, x.shape)]
    if sum(not k for k in same) > (1 if target.count(-1) == 1 else 0):
        return result.fail(f"Reshape to {target} changes the shape {x.shape}")
    return result


def _reshape_identity(op, x, shape, out):
    return op.Identity(x)


update_rules = graphs.rule_set([
    RewriteRule(_sgd_gemm, _sgd_as_gemm, _sgd_gemm_check, name="GemmUpdate"),
    RewriteRule(_sgd_gemm_swapped, _sgd_as_gemm, _sgd_gemm_check, name="GemmUpdateSwapped"),
    RewriteRule(_mul, _identity, _mul_by_one, name="MulByOne"),
    RewriteRule(_reshape, _reshape_identity, _reshape_keeps_shape, name="ReshapeKeepsShape"),
])


_with_kernels = graphs.rule_set([*update_rules.rules, *sgd_kernel_rules])


def fuse_update(model: ir.Model, kernels: bool = False) -> ir.Model:
    """Applies ``update_rules`` in place (graph outputs keep their names), then with ``kernels`` (non-portable
    steps) ``passes.kernels.sgd_kernel_rules``; returns ``model``."""
    names = [v.name for v in model.graph.outputs]
    (_with_kernels if kernels else update_rules).apply_to_model(model)
    for value, name in zip(model.graph.outputs, names):
        value.name = name
    # NOTE: the Identity nodes left are dropped by onnxruntime; merging the Shape nodes they make equal is not
    common.CommonSubexpressionEliminationPass()(model)
    return model

