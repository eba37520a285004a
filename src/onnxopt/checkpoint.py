"""Checkpoint files: named arrays plus JSON metadata, written atomically and verified by a SHA-256 checksum.

Layout: ``MAGIC``, an 8-byte little-endian header length, a JSON header (metadata and, per array, its name,
dtype, shape and byte range), the raw array bytes, then the SHA-256 of everything before it. A file is
written atomically (``onnxopt.atomic``: a temporary file in the same folder, flushed to disk and renamed over
``path``), so a crash leaves the old checkpoint or the new one, never a mix; a truncated or altered file
fails the checksum on load. No pickle is involved: loading a file runs no code from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from onnxopt.atomic import replacing
from onnxopt.errors import CheckpointError

__all__ = ["save_arrays", "load_arrays", "restore_arrays", "MAGIC"]

MAGIC = b"ONNXOPT-CHECKPOINT-1\n"
_DIGEST = 32


def save_arrays(path: str | os.PathLike, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
    """Writes ``arrays`` (numeric NumPy arrays) and ``meta`` (JSON-serializable) to ``path`` atomically."""
    path = os.fspath(path)
    entries, blobs, offset = [], [], 0
    for name, value in arrays.items():
        arr = np.asarray(value, order="C")  # NOTE: ascontiguousarray would make 0-d arrays 1-d
        if arr.dtype.kind not in "biuf":
            raise CheckpointError(f"arrays: {name!r} has dtype {arr.dtype}, expected a numeric or boolean dtype")
        entries.append({"name": name, "dtype": arr.dtype.str, "shape": list(arr.shape), "offset": offset,
                        "nbytes": arr.nbytes})
        blobs.append(arr.tobytes())
        offset += arr.nbytes
    try:
        header = json.dumps({"meta": dict(meta), "arrays": entries}).encode("utf-8")
    except TypeError as exc:
        raise CheckpointError(f"meta: expected JSON-serializable values, got {exc}") from exc
    digest = hashlib.sha256(MAGIC)
    parts = [struct.pack("<Q", len(header)), header, *blobs]
    for part in parts:
        digest.update(part)
    with replacing(path) as f:
        f.write(MAGIC)
        for part in parts:
            f.write(part)
        f.write(digest.digest())


def load_arrays(
    path: str | os.PathLike, expected: Mapping[str, tuple[tuple[int, ...], Any]] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Reads ``(arrays, meta)`` from ``path``, verifying the checksum and, when given, that the names, shapes
    and dtypes are exactly ``expected`` (name -> (shape, dtype)). Raises CheckpointError otherwise."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CheckpointError(f"checkpoint: cannot read {path!r} ({exc})") from exc
    if not data.startswith(MAGIC):
        raise CheckpointError(f"checkpoint: {path!r} is not an onnxopt checkpoint (expected it to start with "
                              f"{MAGIC!r}, got {data[:len(MAGIC)]!r})")
    if len(data) < len(MAGIC) + 8 + _DIGEST:
        raise CheckpointError(f"checkpoint: {path!r} is truncated ({len(data)} bytes)")
    body, stored = data[:-_DIGEST], data[-_DIGEST:]
    actual = hashlib.sha256(body).digest()
    if actual != stored:
        raise CheckpointError(f"checkpoint: {path!r} is truncated or corrupted (SHA-256 expected {stored.hex()[:16]}..., "
                              f"content gives {actual.hex()[:16]}...); nothing was loaded")
    (size,) = struct.unpack_from("<Q", body, len(MAGIC))
    start = len(MAGIC) + 8
    try:
        header = json.loads(body[start:start + size].decode("utf-8"))
        arrays = {}
        base = start + size
        for e in header["arrays"]:
            dtype, shape = np.dtype(e["dtype"]), tuple(e["shape"])
            lo, hi = base + e["offset"], base + e["offset"] + e["nbytes"]
            if hi > len(body) or e["nbytes"] != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
                raise ValueError(f"array {e['name']!r} does not fit the file")
            arrays[e["name"]] = np.frombuffer(body[lo:hi], dtype=dtype).reshape(shape).copy()
        meta = header["meta"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint: {path!r} has a malformed header ({exc})") from exc
    if expected is not None:
        _check(path, arrays, expected)
    return arrays, meta


def _check(path: str, arrays: Mapping[str, np.ndarray], expected: Mapping[str, tuple]) -> None:
    missing = [n for n in expected if n not in arrays]
    extra = [n for n in arrays if n not in expected]
    if missing or extra:
        raise CheckpointError(f"checkpoint: {path!r} holds the {len(arrays)} arrays of another model or optimizer, "
                              f"expected {len(expected)} ({len(missing)} missing, e.g. {missing[:2]}; {len(extra)} "
                              f"unexpected, e.g. {extra[:2]}); nothing was loaded")
    for name, (shape, dtype) in expected.items():
        got = arrays[name]
        if tuple(got.shape) != tuple(shape) or got.dtype != np.dtype(dtype):
            raise CheckpointError(f"checkpoint: {path!r} array {name!r} is {got.dtype}{list(got.shape)}, expected "
                                  f"{np.dtype(dtype)}{list(shape)}; nothing was loaded")


def restore_arrays(path: str | os.PathLike, current: Mapping[str, np.ndarray],
                   kind: str | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``load_arrays(path)`` checked against the arrays it replaces (``current``: their names, shapes, dtypes) and,
    when given, the ``kind`` the writer stored in its metadata: a runner's checkpoint, verified whole before any
    weight changes."""
    arrays, meta = load_arrays(path, {n: (a.shape, a.dtype) for n, a in current.items()})
    if kind is not None and meta.get("kind") != kind:
        raise CheckpointError(f"checkpoint: {os.fspath(path)!r} was written by {meta.get('kind')!r}, "
                              f"expected {kind!r}")
    return arrays, meta
