"""onnxopt's own reverse-mode differentiation over onnx-ir: standard ONNX backward graphs, no training build.

``RULES`` maps (domain, op_type) to a vector-Jacobian rule, one module per op family (``elementwise``,
``linalg``, ``conv``, ``norm``, ``reduce``, ``shape``, ``signal``,
``recurrent``, ``transformer``; ``templates`` runs the families' gradient
definitions). Ops outside the table are first rewritten into ops inside it by the rewrites each family module
registers at its end in ``autodiff.rewrite``'s tables (``load_rewrites`` imports the families), which ``passes.decompose`` applies for both gradient sources
(the training build's builder needs them too), so both see the same graph. ``differentiate`` builds the
backward graph (see ``engine``).
"""

from __future__ import annotations

from onnxopt.autodiff.engine import RULES, Ctx, Rule, differentiate, rule

__all__ = ["RULES", "Rule", "Ctx", "rule", "differentiate", "load_rules", "load_rewrites"]

_loaded = {"rules": False, "rewrites": False}


def load_rewrites() -> dict:
    """Imports the family modules with rewrites (each registers its rules, rewrites and templates in
    ``autodiff.rewrite``'s tables) once; returns ``rewrite.REWRITES``."""
    from onnxopt.autodiff.rewrite import REWRITES

    if not _loaded["rewrites"]:
        from onnxopt.autodiff import conv, elementwise, linalg, norm, reduce, shape, signal  # noqa: F401

        _loaded["rewrites"] = True
    return REWRITES


def load_rules() -> dict:
    """Imports every family module (each registers its rules) once; returns ``RULES``."""
    if not _loaded["rules"]:
        from onnxopt.autodiff import conv, elementwise, linalg, norm, recurrent, reduce, shape, templates  # noqa: F401
        from onnxopt.autodiff import control, transformer  # noqa: F401

        load_rewrites()  # NOTE: the gradient definitions templates.register runs as rules
        templates.register()
        _loaded["rules"] = True
    return RULES
