"""Rewrite rules applied before differentiation, for ops onnxruntime-training has no gradient for.

- ``CastLike(x, like)`` -> ``Cast(x, to=like.dtype)`` once shape inference knows ``like``'s type: the DSL
  writes constants with CastLike, and the builder has a gradient for Cast only.
- ``Relu(x)`` -> ``Where(Greater(x, 0), x, 0)`` for float64 ``x``: onnxruntime has no double kernel for the
  ``ReluGrad`` the builder emits, while ``Where``'s gradient (a ``Where``) runs in double.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as passes
from onnxscript.rewriter import MatchResult, RewriteRule, RewriteRuleSet

__all__ = ["rules", "lower_for_gradient"]


def _castlike(op, x, like):
    return op.CastLike(x, like)


def _castlike_known(context, x, like, **_) -> MatchResult:
    result = MatchResult()
    if like.dtype is None:
        return result.fail("CastLike: the type of input 'like' is unknown")
    return result


def _cast(op, x, like):
    return op.Cast(x, to=like.dtype)


def _relu(op, x):
    return op.Relu(x)


def _relu_double(context, x, **_) -> MatchResult:
    result = MatchResult()
    if x.dtype != ir.DataType.DOUBLE:
        return result.fail("Relu: only float64 needs rewriting (ReluGrad has float kernels)")
    return result


def _relu_as_where(op, x):
    zero = op.Constant(value=ir.tensor(np.array(0.0, dtype=np.float64)))
    return op.Where(op.Greater(x, zero), x, zero)


rules = RewriteRuleSet([RewriteRule(_castlike, _cast, _castlike_known, name="CastLikeToCast"),
                        RewriteRule(_relu, _relu_as_where, _relu_double, name="DoubleReluToWhere")])


def lower_for_gradient(model: ir.Model) -> ir.Model:
    """Infers types, then applies ``rules`` in place; returns ``model``."""
    try:
        passes.ShapeInferencePass()(model)
    except Exception:  # NOTE: inference fails on some contrib ops; the rules then match less, nothing breaks
        pass
    rules.apply_to_model(model)
    return model
