"""Checks and conversions of training data: each failure is a ``DataError`` naming the input.

Casting rule: float data of another precision is cast (as scikit-learn does); integer or boolean data is
cast only when every value survives the cast exactly; anything else (strings, objects, complex) is refused.
"""

from __future__ import annotations

import warnings

import numpy as np

from onnxopt.errors import DataError

__all__ = ["as_array", "check_features", "check_target", "check_class_indices", "check_sample_weight",
           "check_batch_size"]


def as_array(value, dtype, name: str) -> np.ndarray:
    """``value`` (array, list, DataFrame) as a C-contiguous array of ``dtype``, cast only when lossless."""
    dtype = np.dtype(dtype)
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{name}: expected a numeric array, got {type(value).__name__} ({exc})") from exc
    if arr.dtype == dtype:
        return np.asarray(arr, order="C")  # NOTE: not ascontiguousarray, which makes 0-d arrays 1-d
    if arr.dtype.kind == "O":  # NOTE: lists of mixed numbers or pandas object columns: the values' own dtype
        values = arr
        try:  # NOTE: Python ints alone become int64 (then the integer rule below), strings stay strings
            arr = np.asarray(arr.tolist()) if arr.size else arr.astype(np.float64)
            arr = arr.astype(np.float64) if arr.dtype.kind == "O" else arr  # NOTE: None -> NaN
        except (TypeError, ValueError, OverflowError) as exc:
            raise DataError(f"{name}: expected numbers, got dtype object holding non-numbers ({exc})") from exc
        if arr.dtype.kind not in "biuf" or arr.shape != values.shape:
            raise DataError(f"{name}: expected numbers, got dtype object holding non-numbers (read as {arr.dtype} "
                            f"of shape {arr.shape}, expected {values.shape})")
        if arr.dtype.kind == "f" and any(type(v) is int and v != float(c) for v, c in zip(values.flat, arr.flat)):
            raise DataError(f"{name}: expected {dtype} values, got integers that change when cast to float64")
    if arr.dtype.kind == "f" and dtype.kind == "f":
        return np.asarray(arr, dtype=dtype, order="C")
    if arr.dtype.kind in "biuf" and dtype.kind in "biuf":
        cast = arr.astype(dtype)
        if arr.size and not np.array_equal(cast.astype(arr.dtype), arr, equal_nan=arr.dtype.kind == "f"):
            raise DataError(f"{name}: expected {dtype} values, got {arr.dtype} values that change when cast "
                            f"to {dtype} (e.g. non-integer class labels or integers too large)")
        return np.asarray(cast, order="C")
    raise DataError(f"{name}: expected numbers castable to {dtype}, got dtype {arr.dtype}")


def all_finite(a: np.ndarray) -> bool:
    """Whether every value of the float array ``a`` is finite: a finite sum says so without a mask as large as
    ``a`` (a streamed fit checks every block and, after it, every weight). A sum that overflows warns nothing."""
    with np.errstate(over="ignore", invalid="ignore"):
        total = a.sum()
    return bool(np.isfinite(total) or np.isfinite(a).all())


def _check_finite(arr: np.ndarray, name: str, allow_nan: bool | None) -> None:
    """``allow_nan=None``: always checked, and the error does not suggest ``allow_nan``."""
    if not allow_nan and arr.dtype.kind == "f" and not all_finite(arr):
        bad = np.argwhere(~np.isfinite(arr))[0]
        hint = "" if allow_nan is None else " (pass allow_nan=True if the model handles them)"
        raise DataError(f"{name}: expected finite values, got {arr[tuple(bad)]} at index {tuple(int(i) for i in bad)}"
                        + hint)


def check_features(X, shape: list, dtype, allow_nan: bool = False) -> np.ndarray:
    """X as the model's input expects it: ``shape`` is the input's shape (ints fixed, anything else free)."""
    arr = as_array(X, dtype, "X")
    check_feature_shape(arr.shape, shape)
    if arr.shape[0] == 0:
        raise DataError(f"X: expected at least one sample, got shape {arr.shape}")
    _check_finite(arr, "X", allow_nan)
    return arr


def check_feature_shape(got: tuple, shape: list, columns: list[str] | None = None) -> None:
    """Raises DataError unless an X of shape ``got`` fits the model input ``shape`` (ints fixed, anything else
    free); ``columns``: the feature columns X was read from, named in the error."""
    if len(got) != len(shape):
        hint = " (use X.reshape(-1, 1) for a single feature)" if len(got) == 1 and len(shape) == 2 else ""
        tail = shape[1:]
        if len(got) == 2 and len(shape) > 2 and all(isinstance(d, int) for d in tail) and \
                int(np.prod(tail)) == got[1]:  # NOTE: a CSV or Parquet row is flat
            hint = (f" (X.reshape(-1, {', '.join(map(str, tail))}) gives the model's shape; a CSV or Parquet row "
                    f"is flat: pass such inputs as an array, or to onnxopt fit in a .npz)")
        raise DataError(f"X: expected {len(shape)} dimensions {list(shape)}, got shape {tuple(got)}{hint}")
    for axis, (want, n) in enumerate(zip(shape, got)):
        if isinstance(want, int) and axis > 0 and want != n:
            read = f" from the {len(columns)} feature columns {columns} (name the model's with features=, the " \
                   "CLI's --features)" if columns is not None else ""
            raise DataError(f"X: expected {want} values on axis {axis} (model input shape {list(shape)}), got "
                            f"shape {tuple(got)}{read}")


def check_target(y, n: int, dtype, shape: list | None, allow_nan: bool = False) -> np.ndarray:
    """y with ``n`` rows; (n,) is accepted for a prediction shaped (n, 1) and the other way round."""
    if y is None:
        raise DataError("y: the loss needs targets, got None")
    arr = as_array(y, dtype, "y")
    if arr.ndim == 0 or arr.shape[0] != n:
        raise DataError(f"y: expected {n} rows (one per sample of X), got shape {arr.shape}")
    if shape is not None and dtype != np.int64:
        tail = [d if isinstance(d, int) else None for d in shape[1:]]
        fits = (list(arr.shape[1:]) in ([], [1]) and tail in ([], [1])) or (
            len(tail) == arr.ndim - 1 and all(t is None or t == a for t, a in zip(tail, arr.shape[1:])))
        if not fits:
            hint = ""
            if arr.shape in ((n,), (n, 1)) and len(tail) == 1 and isinstance(tail[0], int) and tail[0] > 1 and \
                    np.issubdtype(arr.dtype, np.number) and np.array_equal(arr, np.round(arr)):
                hint = (f" (class labels for {tail[0]} scores? loss='cross_entropy', the CLI's --loss cross_entropy, "
                        f"trains them as a classifier; loss='auto' takes a model without a label output for a "
                        f"regressor)")
            raise DataError(f"y: expected shape {[n, *tail]} to match the prediction {list(shape)}, got "
                            f"{arr.shape}{hint}")
    elif dtype == np.int64 and arr.shape not in ((n,), (n, 1)):
        raise DataError(f"y: expected class labels shaped ({n},) or ({n}, 1), got shape {arr.shape}")
    _check_finite(arr, "y", allow_nan)
    return arr


def check_class_indices(y, classes: int | None) -> np.ndarray:
    """``y`` as int64 class indices in [0, classes) (``classes`` None: >= 0 only), checked before a step runs."""
    arr = np.asarray(y)
    if arr.dtype.kind == "f" and arr.size and not np.array_equal(arr, np.round(arr)):
        bad = np.argwhere(arr != np.round(arr))[0]
        raise DataError(f"y: expected integer class indices, got {arr[tuple(bad)]} at row {int(bad[0])} "
                        "(continuous target? use loss='square')")
    arr = as_array(arr, np.int64, "y")
    if arr.size and (arr.min() < 0 or (classes is not None and arr.max() >= classes)):
        bad = np.argwhere((arr < 0) | (arr >= (classes or np.iinfo(np.int64).max)))[0]
        expected = f"0..{classes - 1} (the prediction has {classes} classes)" if classes else ">= 0"
        raise DataError(f"y: expected class indices in {expected}, got {arr[tuple(bad)]} at row {int(bad[0])}")
    return arr


def check_sample_weight(sample_weight, n: int, dtype) -> np.ndarray | None:
    """None, or ``n`` finite non-negative weights (shaped (n,) or (n, 1)), not all zero."""
    if sample_weight is None:
        return None
    arr = as_array(sample_weight, dtype, "sample_weight")
    if arr.shape == (n, 1):  # NOTE: a column of weights, as onnxcustom took them
        arr = arr.reshape(n)
    if arr.shape != (n,):
        raise DataError(f"sample_weight: expected shape ({n},) (one per sample of X), got {arr.shape}")
    _check_finite(arr, "sample_weight", None)
    if (arr < 0).any():
        raise DataError(f"sample_weight: expected non-negative weights, got {arr.min()} at index {int(arr.argmin())}")
    if not arr.any():
        raise DataError("sample_weight: expected at least one positive weight, got all zeros")
    return arr


def check_batch_size(batch_size, n: int) -> int:
    """``batch_size`` as an int in [1, n]; larger than the data is clipped with a warning."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise DataError(f"batch_size: expected an integer >= 1, got {batch_size!r}")
    if batch_size > n:
        warnings.warn(f"batch_size: {batch_size} is larger than the {n} training samples; clipped to {n}",
                      UserWarning, stacklevel=3)
        return n
    return int(batch_size)
