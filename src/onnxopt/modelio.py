"""Loading ONNX models and bringing their versions to what the installed onnxruntime loads."""

from __future__ import annotations

import os
from typing import Union

import onnx
import onnx_ir as ir
import onnxruntime

from onnxopt.errors import ModelError

__all__ = ["ModelLike", "load_model", "runtime_limits", "DSL_OPSET"]

ModelLike = Union[onnx.ModelProto, ir.Model, str, os.PathLike]

# NOTE: onnxscript functions of the DSL are written against this opset; a model below it is converted up.
DSL_OPSET = 18
# Highest IR version and default-domain opset each onnxruntime release loads (from its release notes).
_LIMITS = {(1, 17): (9, 20), (1, 18): (10, 21), (1, 19): (10, 21), (1, 20): (10, 21), (1, 21): (10, 22)}


def runtime_limits() -> tuple[int, int]:
    """Returns (max IR version, max opset) of the installed onnxruntime."""
    major, minor = (int(x) for x in onnxruntime.__version__.split(".")[:2])
    return _LIMITS.get((major, minor), (10, 21))


def load_model(model: ModelLike, name: str = "model") -> ir.Model:
    """Loads ``model`` (proto, ir.Model or path) as an ``ir.Model`` whose opset onnxruntime and the DSL accept.

    The default-domain opset is raised to at least ``DSL_OPSET`` with onnxscript's version converter; a model
    newer than the runtime loads is refused with the versions that work.
    """
    if isinstance(model, ir.Model):
        model = ir.to_proto(model)
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.exists(path):
            raise ModelError(f"{name}: file {path!r} does not exist")
        try:
            model = onnx.load(path)
        except Exception as exc:  # protobuf raises DecodeError, RuntimeWarning...: all mean "not ONNX"
            raise ModelError(f"{name}: {path!r} is not a readable ONNX model ({type(exc).__name__}: {exc})") from exc
    if not isinstance(model, onnx.ModelProto):
        raise ModelError(f"{name}: expected onnx.ModelProto, ir.Model or a path, got {type(model).__name__}")
    max_ir, max_opset = runtime_limits()
    opset = _default_opset(model)
    if opset > max_opset:
        raise ModelError(
            f"{name}: opset {opset} is newer than onnxruntime {onnxruntime.__version__} loads "
            f"(expected <= {max_opset}); convert the model to opset {DSL_OPSET}..{max_opset}"
        )
    try:
        m = ir.serde.deserialize_model(model)
    except Exception as exc:  # NOTE: onnx_ir reads tensors and sequences of tensors only, not maps
        odd = [v.name for v in model.graph.output if v.type.WhichOneof("value") != "tensor_type"]
        if not odd:
            raise
        raise ModelError(
            f"{name}: outputs {odd} are not tensors (a map or a sequence of maps, e.g. skl2onnx's ZipMap); "
            "expected tensor outputs: convert classifiers with options={'zipmap': False}"
        ) from exc
    if m.ir_version > max_ir:
        m.ir_version = max_ir
    if opset < DSL_OPSET:
        from onnxscript import version_converter

        try:
            version_converter.convert_version(m, DSL_OPSET)
        except Exception as exc:
            raise ModelError(
                f"{name}: opset {opset} could not be converted to opset {DSL_OPSET} ({exc}); "
                f"convert it with onnx.version_converter first"
            ) from exc
        m.opset_imports[""] = DSL_OPSET
    if m.opset_imports.get("ai.onnx.ml") is not None:
        from onnxopt.ml_rules import lower_ml_ops  # NOTE: sklearn's linear ops -> MatMul + Add with weights

        lower_ml_ops(m)
    return m


def _default_opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    raise ModelError("model: no default-domain ('') opset import found")
