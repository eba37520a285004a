"""Loading ONNX models and bringing their versions to what the installed onnxruntime loads."""

from __future__ import annotations

import logging
import os
from typing import Union

import onnx
import onnx_ir as ir
import onnxruntime

from onnxopt.errors import ModelError, ModelFormatError, ModelVersionError
from onnxopt.modelcheck import check_model

__all__ = ["ModelLike", "load_model", "require_cuda", "require_training_build", "runtime_limits", "DSL_OPSET", "PROTOBUF_LIMIT", "check_protobuf_size"]

ModelLike = Union[onnx.ModelProto, ir.Model, str, os.PathLike]

# NOTE: onnxscript functions of the DSL are written against this opset; a model below it is converted up.
DSL_OPSET = 18
# Highest IR version and default-domain opset each onnxruntime release loads (from its release notes).
# NOTE: protobuf refuses to serialize a message of 2 GB or more; ORT's builder and sessions take one.
PROTOBUF_LIMIT = 2**31
# NOTE: 1.32 measured: it loads opset 26 and IR 13; onnx 1.19 (opsets <= 24) is the cap, IR 10 is what torch writes
_LIMITS = {(1, 17): (9, 20), (1, 18): (10, 21), (1, 19): (10, 21), (1, 20): (10, 21), (1, 21): (10, 22),
           (1, 32): (10, 24)}
# NOTE: ops whose opset-22 versions onnxruntime 1.32 has no CPU kernel for (only bfloat16 was added): lowered to 21
_NO_KERNEL_AFTER_21 = {"Bernoulli", "Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform",
                       "RandomUniformLike", "GlobalLpPool", "MaxRoiPool", "RoiAlign"}


def runtime_limits() -> tuple[int, int]:
    """Returns (max IR version, max opset) of the installed onnxruntime."""
    major, minor = (int(x) for x in onnxruntime.__version__.split(".")[:2])
    newest = max(_LIMITS)
    return _LIMITS.get((major, minor), _LIMITS[newest] if (major, minor) > newest else (10, 21))


def require_cuda(what: str) -> None:
    """Raises ImportError unless onnxruntime has the CUDAExecutionProvider (onnxruntime-gpu): without it ORT would
    fall back to CPU with a warning and then fail to allocate the step's device buffers."""
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        raise ImportError(f"{what}: 'cuda' needs onnxruntime-gpu's CUDAExecutionProvider; onnxruntime "
                          f"{onnxruntime.__version__} here has {onnxruntime.get_available_providers()} (pip install "
                          "onnxruntime-gpu in place of onnxruntime; the training build has no CUDA wheel here)")


def require_training_build(what: str) -> None:
    """Raises ImportError when the installed onnxruntime lacks the gradient builder of onnxruntime-training."""
    # NOTE: an attribute check on the module onnxruntime already loaded; gradient.py alone calls the builder
    if getattr(onnxruntime.capi._pybind_state, "OrtModuleGraphBuilder", None) is not None:
        return
    import sys

    raise ImportError(
        f"{what}: needs onnxruntime-training's gradient builder, found onnxruntime {onnxruntime.__version__} "
        f"without it (Python {sys.version_info.major}.{sys.version_info.minor}; onnxruntime-training has wheels for "
        "CPython <= 3.12 only). Use gradient='onnxopt' (the default: onnxopt's own rules, any onnxruntime), or "
        "install the training build on Python <= 3.12 (pip install -e . brings onnxruntime-training-cpu there); "
        "see docs/gradients.md")


def load_model(model: ModelLike, name: str = "model", base_dir: str | os.PathLike | None = None) -> ir.Model:
    """Loads ``model`` (proto, ir.Model or path) as an ``ir.Model`` whose versions onnxruntime and the DSL accept.

    External data is read from the model's folder only (``base_dir`` for a proto; ``onnxopt.modelcheck``
    checks it, tensor sizes, value names and opsets before anything is allocated). An IR version newer than
    onnxruntime loads is lowered when no tensor uses a newer type; a newer opset is lowered when no op changed in between, else with
    onnx's version converter (via onnxscript's, which drops big tensors first). The default-domain opset is
    raised to at least ``DSL_OPSET``. Nothing here serializes the whole model to one protobuf.
    """
    if isinstance(model, ir.Model):
        base_dir = next((t.base_dir for t in _tensors(model) if isinstance(t, ir.ExternalTensor) and t.base_dir),
                        base_dir)
        model = ir.to_proto(model)
    if isinstance(model, (str, os.PathLike)):
        base_dir = os.path.dirname(os.path.abspath(model))
        model = _read(os.fspath(model), name)
    if not isinstance(model, onnx.ModelProto):
        raise ModelFormatError(f"{name}: expected onnx.ModelProto, ir.Model or a path, got {type(model).__name__}")
    if not model.HasField("graph") or model.ir_version < 1:
        raise ModelFormatError(f"{name}: not an ONNX model (expected a ModelProto with a graph and an IR "
                               f"version, got ir_version={model.ir_version}, graph={model.HasField('graph')})")
    check_model(model, None if base_dir is None else os.fspath(base_dir), name)
    if any(n.op_type == "ZipMap" for n in model.graph.node):
        from onnxopt.ml_rules import drop_zipmap  # NOTE: skl2onnx's default: probabilities as a list of dicts

        model = drop_zipmap(model)
    max_ir, max_opset = runtime_limits()
    opset = _default_opset(model, name)
    try:
        m = ir.serde.deserialize_model(model)
    except Exception as exc:  # NOTE: onnx_ir reads tensors and sequences of tensors only, not maps
        odd = [v.name for v in model.graph.output if v.type.WhichOneof("value") != "tensor_type"]
        if not odd:
            raise ModelFormatError(f"{name}: the model cannot be read ({type(exc).__name__}: {exc})") from exc
        raise ModelError(
            f"{name}: outputs {odd} are not tensors (a map or a sequence of maps, e.g. skl2onnx's ZipMap); "
            "expected tensor outputs: convert classifiers with options={'zipmap': False}"
        ) from exc
    _load_external(m, base_dir, name)
    if m.ir_version > max_ir:
        _lower_ir(m, max_ir, name)
    if opset > max_opset:
        _lower_opset(m, opset, max_opset, name)
    elif opset > 21 and any(n.op_type in _NO_KERNEL_AFTER_21 and n.domain in ("", "ai.onnx")
                            for n in ir.traversal.RecursiveGraphIterator(m.graph)):
        _lower_opset(m, opset, 21, name)
    if opset < DSL_OPSET:
        from onnxscript import version_converter

        try:
            version_converter.convert_version(m, DSL_OPSET)
        except Exception as exc:
            raise ModelVersionError(
                f"{name}: opset {opset} could not be converted to opset {DSL_OPSET} ({exc}); "
                f"convert it with onnx.version_converter first"
            ) from exc
        m.opset_imports[""] = DSL_OPSET
    if m.opset_imports.get("ai.onnx.ml") is not None:
        from onnxopt.ml_rules import lower_ml_ops  # NOTE: sklearn's linear ops -> MatMul + Add with weights

        lower_ml_ops(m)
    return m


def _read(path: str, name: str) -> onnx.ModelProto:
    if not os.path.isfile(path):
        raise ModelFormatError(f"{name}: expected an ONNX file, {path!r} does not exist or is not a file")
    size = os.path.getsize(path)
    if size == 0:
        raise ModelFormatError(f"{name}: {path!r} is empty (0 bytes); expected an ONNX model")
    try:
        return onnx.load(path, load_external_data=False)  # NOTE: checked (modelcheck), then read by onnx_ir
    except Exception as exc:  # protobuf raises DecodeError, RuntimeWarning...: all mean "not ONNX"
        hint = (f"; a protobuf file is limited to 2 GB, save big models with external data"
                if size >= PROTOBUF_LIMIT else "; the file may be truncated or not an ONNX model")
        raise ModelFormatError(
            f"{name}: {path!r} ({size} bytes) is not a readable ONNX model (expected a serialized onnx.ModelProto, "
            f"got {type(exc).__name__}: {exc}){hint}"
        ) from exc


def _tensors(m: ir.Model):
    """The initializer tensors of the main graph."""
    return [v.const_value for v in m.graph.initializers.values() if v.const_value is not None]


def _load_external(m: ir.Model, base_dir: str | None, name: str) -> None:
    """Reads tensors kept in external files into memory, so later copies need no folder."""
    external = [t for t in _tensors(m) if isinstance(t, ir.ExternalTensor)]
    if not external:
        return
    if base_dir is not None:
        ir.external_data.set_base_dir(m.graph, base_dir)
    try:
        ir.external_data.load_to_model(m)
    except OSError as exc:
        raise ModelFormatError(
            f"{name}: initializer {external[0].name!r} keeps its data in external file {external[0].location!r}, "
            f"not found ({exc}); expected the model's path, or onnx.load(path) with external data loaded"
        ) from exc


# IR version that introduced each recent tensor type (onnx docs/IR.md); older types are in every IR version.
_TYPE_IR = {ir.DataType.FLOAT8E4M3FN: 9, ir.DataType.FLOAT8E4M3FNUZ: 9, ir.DataType.FLOAT8E5M2: 9,
            ir.DataType.FLOAT8E5M2FNUZ: 9, ir.DataType.UINT4: 10, ir.DataType.INT4: 10, ir.DataType.FLOAT4E2M1: 11,
            ir.DataType.FLOAT8E8M0: 12, ir.DataType.UINT2: 13, ir.DataType.INT2: 13}


def _type_ir(dtype: ir.DataType) -> int:
    return _TYPE_IR.get(dtype, 99 if dtype.value > ir.DataType.INT4.value else 0)


def _lower_ir(m: ir.Model, max_ir: int, name: str) -> None:
    """Sets the IR version to ``max_ir`` when every tensor type exists there, else names the blocking types."""
    used = {t.dtype for t in _tensors(m)} | {v.dtype for v in _values(m) if v.dtype is not None}
    newer = sorted(t.name for t in used if _type_ir(t) > max_ir)
    if newer:
        raise ModelVersionError(
            f"{name}: IR version {m.ir_version} uses types {newer} that IR version {max_ir} (the newest "
            f"onnxruntime {onnxruntime.__version__} loads) lacks; expected IR version <= {max_ir}"
        )
    m.ir_version = max_ir


def _values(m: ir.Model):
    yield from m.graph.inputs
    for node in ir.traversal.RecursiveGraphIterator(m.graph):
        yield from node.outputs


def _lower_opset(m: ir.Model, opset: int, max_opset: int, name: str) -> None:
    """Lowers the default-domain opset to ``max_opset``: as is when no op changed in between, else converted."""
    nodes = [n for n in ir.traversal.RecursiveGraphIterator(m.graph) if n.domain in ("", "ai.onnx")]
    for f in m.functions.values():
        nodes += [n for n in f if n.domain in ("", "ai.onnx")]
    changed = sorted({n.op_type for n in nodes if _since(n.op_type, opset) > max_opset})
    if not changed:  # NOTE: every op has the same definition at both opsets: only the import changes
        m.opset_imports[""] = max_opset
        for f in m.functions.values():
            if "" in f.opset_imports:
                f.opset_imports[""] = max_opset
        return
    from onnxscript import version_converter

    quiet = logging.getLogger("onnxscript.version_converter")
    level, quiet.level = quiet.level, logging.CRITICAL
    try:  # NOTE: fallback=True runs onnx's converter (which can lower) on a copy without big tensors
        version_converter.convert_version(m, max_opset, fallback=True)
    except Exception:  # the converter says nothing useful beyond "no adapter"; the check below reports
        pass
    finally:
        quiet.level = level
    if m.opset_imports.get("") != max_opset:
        raise ModelVersionError(
            f"{name}: opset {opset} is newer than onnxruntime {onnxruntime.__version__} loads and ops {changed} "
            f"changed after opset {max_opset}, so it cannot be lowered; expected opset {DSL_OPSET}..{max_opset}: "
            f"export the model again with that opset"
        )


def _since(op_type: str, opset: int) -> int:
    try:
        return onnx.defs.get_schema(op_type, opset, "").since_version
    except onnx.defs.SchemaError:  # NOTE: an op onnx does not know: nothing to compare, ORT will say
        return 0


def check_protobuf_size(m: ir.Model, what: str) -> None:
    """Raises ModelError when the tensors of ``m`` reach protobuf's 2 GB limit: ``what`` needs one protobuf."""
    total = sum(t.nbytes for t in _tensors(m))
    if total >= PROTOBUF_LIMIT:
        raise ModelError(
            f"model: its initializers hold {total / 2**30:.2f} GB; {what} takes the model as one serialized "
            f"protobuf, expected < {PROTOBUF_LIMIT / 2**30:.0f} GB (train a smaller part with weights=... "
            "on a sub-model, or use onnxopt.ForwardBackward)"
        )


def _default_opset(model: onnx.ModelProto, name: str = "model") -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    domains = [imp.domain for imp in model.opset_import]
    raise ModelFormatError(f"{name}: no default-domain ('') opset import found (expected one, got domains {domains})")
