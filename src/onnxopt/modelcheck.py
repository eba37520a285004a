"""Checks of a model read from outside, run on its protobuf before any tensor is read or allocated.

- External data is read from the model's own folder only: no absolute path, no ``..``, no symlink leaving
  the folder; a proto given without its folder cannot read external data at all.
- Every tensor's declared shape and type must match the bytes it holds (inline or in its external file)
  and stay below ``TENSOR_LIMIT``.
- Every value name is defined once per graph (inputs, initializers, node outputs), each graph input and output
  name is declared once, and no node depends on its own output (a cycle).
- Every opset import names a domain onnx or onnxruntime defines (or a function of the model), at a version
  they know, and every node's domain is imported.
Each refusal is a ``ModelFormatError`` (``ModelVersionError`` for opsets) naming the tensor, value or domain.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import pathlib

import onnx
import onnx_ir as ir

from onnxopt.errors import ModelFormatError, ModelVersionError

__all__ = ["check_model", "TENSOR_LIMIT"]

TENSOR_LIMIT = 2**34  # NOTE: 16 GiB: one tensor above it is a hostile or broken file, not a model to train here
# NOTE: domains onnxruntime's own kernels implement (not in onnx.defs), at their highest opset version
_ORT_DOMAINS = {"com.microsoft": 1, "com.microsoft.nchwc": 1, "com.microsoft.experimental": 1,
                "ai.onnx.training": 1, "org.pytorch.aten": 1}
_FIELDS = {ir.DataType.STRING: "string_data", ir.DataType.FLOAT: "float_data", ir.DataType.COMPLEX64: "float_data",
           ir.DataType.DOUBLE: "double_data", ir.DataType.COMPLEX128: "double_data", ir.DataType.INT64: "int64_data",
           ir.DataType.UINT32: "uint64_data", ir.DataType.UINT64: "uint64_data"}


@functools.cache
def known_opsets() -> dict[str, int]:
    """Domain -> highest opset version onnx's schemas or onnxruntime's kernels define."""
    known = dict(_ORT_DOMAINS)
    for schema in onnx.defs.get_all_schemas_with_history():
        known[schema.domain] = max(known.get(schema.domain, 0), schema.since_version)
    known["ai.onnx"] = known[""] = onnx.defs.onnx_opset_version()
    return known


def check_model(model: onnx.ModelProto, base_dir: str | None, name: str) -> None:
    """Raises ModelFormatError or ModelVersionError (see the module docstring); ``base_dir`` is the folder
    external data is read from (None: the model has no folder)."""
    _check_opsets(model, name)
    imported = {imp.domain or "ai.onnx" for imp in [*model.opset_import, *(i for f in model.functions
                                                                          for i in f.opset_import)]}
    graphs = [model.graph, *model.functions]
    while graphs:
        graph = graphs.pop()
        _check_names(graph, name)
        _check_acyclic(graph, name)
        tensors = [*getattr(graph, "initializer", [])]
        for sparse in getattr(graph, "sparse_initializer", []):
            tensors += [sparse.values, sparse.indices]
        for node in graph.node:
            if (node.domain or "ai.onnx") not in imported:
                raise ModelVersionError(f"{name}: node {node.name!r} ({node.op_type}) is in domain {node.domain!r}, "
                                        f"which the model does not import; expected one of {sorted(imported)}")
            for attr in node.attribute:
                graphs += [*attr.graphs, *([attr.g] if attr.HasField("g") else [])]
                tensors += [*attr.tensors, *([attr.t] if attr.HasField("t") else [])]
                if attr.HasField("sparse_tensor"):
                    tensors += [attr.sparse_tensor.values, attr.sparse_tensor.indices]
        for tensor in tensors:
            _check_tensor(tensor, base_dir, name)


def _check_opsets(model: onnx.ModelProto, name: str) -> None:
    known = {**known_opsets(), **{f.domain: 2**31 for f in model.functions}}
    for imp in model.opset_import:
        if imp.domain not in known:
            raise ModelVersionError(
                f"{name}: opset import of unknown domain {imp.domain!r} (version {imp.version}); expected a domain "
                f"onnx or onnxruntime defines ({sorted(d for d in known_opsets() if d)} or ''), or one of the "
                f"model's functions")
        if not 1 <= imp.version <= known[imp.domain]:
            raise ModelVersionError(
                f"{name}: opset {imp.version} of domain {imp.domain!r} is unknown (onnx {onnx.__version__} and "
                f"onnxruntime define versions 1..{known[imp.domain]}); expected a version in that range")


def _check_names(graph, name: str) -> None:
    """Each value defined once: graph inputs, initializers (which may also be inputs), node outputs; each graph
    input and output declared once."""
    inputs = [i if isinstance(i, str) else i.name for i in graph.input]
    for kind, names in [("input", inputs), ("output", [o if isinstance(o, str) else o.name for o in graph.output])]:
        twice = sorted((n, c) for n, c in collections.Counter(names).items() if c > 1)
        if twice:
            raise ModelFormatError(f"{name}: graph {graph.name!r} declares {kind} {twice[0][0]!r} {twice[0][1]} times; "
                                   f"expected each {kind} name once")
    defined = [(n, "an input") for n in inputs]
    defined += [(t.name, "an initializer") for t in getattr(graph, "initializer", []) if t.name not in inputs]
    defined += [(o, f"node {node.name!r} ({node.op_type})") for node in graph.node for o in node.output if o]
    first: dict[str, str] = {}
    for value, who in defined:
        if value in first:
            raise ModelFormatError(f"{name}: value {value!r} is defined twice in graph {graph.name!r}, by "
                                   f"{first[value]} and by {who}; expected each name defined once")
        first[value] = who


def _node_label(node, i: int) -> str:
    return f"node {node.name!r} ({node.op_type})" if node.name else \
        f"node #{i} ({node.op_type}, output {(list(node.output) or [''])[0]!r})"


def _used(node) -> set[str]:
    """Names a node reads: its inputs and, NOTE: from the outer scope, those its subgraphs read."""
    used = set(node.input)
    for attr in node.attribute:
        for g in [*attr.graphs, *([attr.g] if attr.HasField("g") else [])]:
            for inner in g.node:
                used |= _used(inner)
    return used


def _check_acyclic(graph, name: str) -> None:
    """Kahn's sort of the graph's nodes by the values they read and write; what is left lies on or after a cycle."""
    nodes = list(graph.node)
    producer = {o: i for i, node in enumerate(nodes) for o in node.output if o}
    needs = [{producer[v] for v in _used(node) if v in producer} for node in nodes]
    readers: dict[int, list[int]] = {}
    for i, deps in enumerate(needs):
        for d in deps:
            readers.setdefault(d, []).append(i)
    count = [len(d) for d in needs]
    ready = [i for i, c in enumerate(count) if c == 0]
    while ready:
        for r in readers.get(ready.pop(), []):
            count[r] -= 1
            if count[r] == 0:
                ready.append(r)
    left = {i for i, c in enumerate(count) if c}
    if not left:
        return
    i = min(left)  # NOTE: walk back along unsorted producers until a node repeats: that node is on a cycle
    seen: list[int] = []
    while i not in seen:
        seen.append(i)
        i = min(d for d in needs[i] if d in left)
    cycle = seen[seen.index(i):]
    raise ModelFormatError(f"{name}: graph {graph.name!r} has a cycle: {_node_label(nodes[i], i)} depends on its own "
                           f"output through {len(cycle)} node(s) ({', '.join(_node_label(nodes[j], j) for j in cycle)}); "
                           "expected an acyclic graph")


def _check_tensor(t: onnx.TensorProto, base_dir: str | None, name: str) -> None:
    """Declared shape and type against the bytes present and ``TENSOR_LIMIT``, before anything is allocated."""
    try:
        dtype = ir.DataType(t.data_type)
        bits = 8 if dtype == ir.DataType.STRING else dtype.bitwidth  # NOTE: strings: their count, not bytes
    except (ValueError, TypeError):
        raise ModelFormatError(f"{name}: tensor {t.name!r} has data type {t.data_type}; expected an ONNX tensor "
                               "type") from None
    count = math.prod(t.dims)
    if min(t.dims, default=0) < 0:
        raise ModelFormatError(f"{name}: tensor {t.name!r} declares shape {list(t.dims)}; expected dimensions >= 0")
    nbytes = -(-count * bits // 8)
    declared = f"tensor {t.name!r} declares shape {list(t.dims)} of {dtype.name} ({nbytes} bytes)"
    if nbytes > TENSOR_LIMIT:
        raise ModelFormatError(f"{name}: {declared}; expected at most {TENSOR_LIMIT} bytes per tensor")
    if t.data_location == onnx.TensorProto.EXTERNAL:
        return _check_external(t, base_dir, name, nbytes, declared)
    if t.raw_data:
        got, want, unit = len(t.raw_data), nbytes, "bytes"
    else:
        field = _FIELDS.get(dtype, "int32_data")
        got, unit = len(getattr(t, field)), f"values in {field}"
        complex_ = dtype in (ir.DataType.COMPLEX64, ir.DataType.COMPLEX128)
        want = 2 * count if complex_ else count if bits >= 8 else nbytes  # NOTE: 4- and 2-bit types: packed
    if got != want:
        raise ModelFormatError(f"{name}: {declared} but holds {got} {unit}; expected {want}")


def _check_external(t: onnx.TensorProto, base_dir: str | None, name: str, nbytes: int, declared: str) -> None:
    info = {e.key: e.value for e in t.external_data}
    loc = info.get("location", "")
    where = f"tensor {t.name!r} keeps its data in external file {loc!r}"
    if base_dir is None:
        raise ModelFormatError(
            f"{name}: {where}, and the model was given without its folder; expected the model's path (external "
            "data is read from its folder only), onnx_ir.load(path), or onnx.load(path) with external data loaded")
    folder = os.path.realpath(base_dir)
    path = os.path.realpath(os.path.join(folder, loc))
    if not loc or os.path.isabs(loc) or ".." in pathlib.PurePath(loc).parts or \
            os.path.commonpath([folder, path]) != folder:
        raise ModelFormatError(f"{name}: {where}, which is outside the model's folder {base_dir!r} (it resolves to "
                               f"{path!r}); expected a relative path to a file inside that folder (no '..', no "
                               "absolute path, no symlink leading out)")
    if not os.path.isfile(path):
        raise ModelFormatError(f"{name}: {where}, not found in {base_dir!r}; expected the model's path, or "
                               "onnx.load(path) with external data loaded")
    size = os.path.getsize(path)
    try:
        offset = int(info.get("offset", 0))
        length = int(info.get("length", size - offset))
    except ValueError:
        raise ModelFormatError(f"{name}: {where} at offset {info.get('offset')!r}, length {info.get('length')!r}; "
                               "expected integers") from None
    if length != nbytes or offset < 0 or offset + length > size:
        raise ModelFormatError(f"{name}: {declared} but its external data is {length} bytes at offset {offset} of "
                               f"{loc!r} ({size} bytes); expected {nbytes} bytes inside the file")
