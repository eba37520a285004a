"""onnxopt's own reverse-mode differentiation over onnx-ir: standard ONNX backward graphs, no training build.

``RULES`` maps (domain, op_type) to a vector-Jacobian rule, one module per op family (``elementwise``,
``linalg``, ``conv``, ``norm``, ``reduce``, ``shape``, ``signal``,
``recurrent``, ``transformer``; ``templates`` runs the families' gradient
definitions). Ops outside the table are first rewritten into ops inside it by the rewrites each family module
registers at its end (``autodiff.rewrite``), which ``passes.decompose`` applies for both gradient sources
(the training build's builder needs them too), so both see the same graph. ``differentiate`` builds the
backward graph (see ``engine``).
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
        from onnxopt.autodiff import control, transformer  # noqa: F401

        templates.register()
        _loaded = True
    return RULES
