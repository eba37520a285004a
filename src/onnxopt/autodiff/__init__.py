"""onnxopt's own reverse-mode differentiation over onnx-ir: standard ONNX backward graphs, no training build.

``RULES`` maps (domain, op_type) to a vector-Jacobian rule, one module per op family (``elementwise``,
``linalg``, ``conv``, ``norm``, ``reduction``, ``shape``, ``recurrent``, ``templates``). Ops outside the table are first rewritten
into ops inside it by ``passes.decompose`` (the rewrites the training build's builder needs too), so both
gradient sources see the same graph. ``differentiate`` builds the backward graph (see ``engine``).
"""

from __future__ import annotations

from onnxopt.autodiff.engine import RULES, Ctx, Rule, differentiate, rule

__all__ = ["RULES", "Rule", "Ctx", "rule", "differentiate", "load_rules"]

_loaded = False


def load_rules() -> dict:
    """Imports every family module (each registers its rules) once; returns ``RULES``."""
    global _loaded
    if not _loaded:
        from onnxopt.autodiff import conv, elementwise, linalg, norm, recurrent, reduce, shape, templates  # noqa: F401

        templates.register()
        _loaded = True
    return RULES
