"""Rewrite rules applied before differentiation, for ops onnxruntime-training has no gradient for.

- ``CastLike(x, like)`` -> ``Cast(x, to=like.dtype)`` once shape inference knows ``like``'s type: the DSL
  writes constants with CastLike, and the builder has a gradient for Cast only.
- ``Relu(x)`` -> ``Where(Greater(x, 0), x, 0)`` for float64 ``x``: onnxruntime has no double kernel for the
  ``ReluGrad`` the builder emits, while ``Where``'s gradient (a ``Where``) runs in double.
"""

from __future__ import annotations

import numpy as np
import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as passes
from onnxscript.rewriter import MatchResult, RewriteRule, RewriteRuleSet

__all__ = ["rules", "lower_for_gradient", "widen_float_constants"]


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


def widen_float_constants(model: ir.Model, dtype: ir.DataType) -> int:
    """Replaces float32 attribute constants only read through CastLike by constants of ``dtype``.

    The DSL writes a hyper-parameter as ``CastLike(Constant<value_float=@attr>, w)``; the inlined attribute
    still holds the Python float, so a double step gets the exact double value. Returns the count replaced.
    """
    if dtype != ir.DataType.DOUBLE:
        return 0
    count = 0
    for node in list(model.graph):
        attr = node.attributes.get("value_float")
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or attr is None:
            continue
        uses = list(node.outputs[0].uses())
        if not uses or any(user.op_type != "CastLike" or idx != 0 for user, idx in uses):
            continue
        node.attributes.pop("value_float")
        node.attributes["value"] = ir.AttrTensor("value", ir.tensor(np.array(attr.value, dtype=np.float64)))
        count += 1
    return count
