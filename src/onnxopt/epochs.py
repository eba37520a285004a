"""The Runner's epoch loop on CPU: an epoch's full batches run as one Scan in one session run (``passes.epoch``).

The epoch model reads buffer set k and leaves its last step's inputs in set k+1 and its outputs in set k+2, as
steps would; its ``CHECK`` output (the sum of the losses and new tensors) says whether every step was finite. A
run that fails or is not finite restores the set it overwrote and returns no loss: the Runner then replays the
batches with ``step``, whose errors and kept weights are the reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.capi import _pybind_state as C

from onnxopt.passes.epoch import CHECK, COUNT, LAST, PREFIX, epoch_model
from onnxopt.passes.update import PACK_WEIGHTS
from onnxopt.protocol import NEW
from onnxopt.ring import N_SETS, BufferRing
from onnxopt.sessions import KEEP_DROPOUT

__all__ = ["EpochLoop"]


class EpochLoop:
    """Runs epochs of ``step_model`` (the CPU step, weights stripped) reading ``x`` and ``y`` over ``ring``;
    ``loss``: its loss output, ``weights``: the sample-weight input (fed ones) or None."""

    def __init__(self, step_model: bytes, ring: BufferRing, x: str, y: str, loss: str, weights: str | None,
                 opts: ort.SessionOptions, device: C.OrtDevice):
        self.step_model, self.ring, self.x, self.y, self.loss, self.weights = step_model, ring, x, y, loss, weights
        self.opts, self.device = opts, device
        self.model: onnx.ModelProto | None = None  # NOTE: the epoch model, made on first use
        self._made = None
        self._io: dict[int, tuple] = {}  # NOTE: per epoch length: the losses' buffer and the Scan's count, bound
        self._bound: list[tuple | None] = [None] * N_SETS  # NOTE: per epoch binding: (steps, batch) it holds

    def session(self) -> tuple[C.InferenceSession, list]:
        """The session of the epoch model (``passes.epoch``) and its bindings, one per buffer set (made once)."""
        if self._made is None:
            ring = self.ring
            views = (PACK_WEIGHTS, [(m, tuple(ring.sets[0][m].shape())) for m in ring.views]) if ring.views else None
            self.model = epoch_model(onnx.load_from_string(self.step_model), [self.x, self.y], ring.bound, views,
                                     self.loss)
            session = ort.InferenceSession(self.model.SerializeToString(), self.opts,
                                           providers=["CPUExecutionProvider"], disabled_optimizers=KEEP_DROPOUT)
            self._made = (session._sess, [session.io_binding()._iobinding for _ in range(N_SETS)])
            self._check = np.full((), np.nan, ring.dtype)
            check = C.OrtValue.ortvalue_from_numpy(self._check, self.device)
            for k, raw in enumerate(self._made[1]):  # NOTE: reads set k, ends with the last step's inputs in
                raw.bind_ortvalue_output(CHECK, check)
                for name in ring.bound:  # set k + 1 and its outputs in set k + 2, as the steps would
                    raw.bind_ortvalue_input(PREFIX + name, ring.value(k, name))
                    raw.bind_ortvalue_output(PREFIX + name + LAST, ring.value((k + 1) % N_SETS, name))
                    raw.bind_ortvalue_output(PREFIX + name + NEW, ring.value((k + 2) % N_SETS, name))
        return self._made

    def run(self, X: np.ndarray, y: np.ndarray, steps: int, batch: int, ones: Callable[[int], tuple],
            run: Callable) -> list[float]:
        """Losses of ``steps`` batches of ``batch`` rows run as one Scan; none, weights unchanged, on a NaN.
        ``ones(batch)``: the (name, OrtValue) pairs fed for all-ones sample weights; ``run(sess, raw, keep)``
        runs the session (the Runner's, which names the batch in onnxruntime's errors)."""
        sess, raws = self.session()
        ring = self.ring
        raw, first, valid = raws[ring.current], ring.current, ring.previous_valid
        if steps not in self._io:  # NOTE: the losses' buffer and the Scan's count per epoch length, bound
            arrays = np.empty(steps, ring.dtype), np.array(steps - 1, np.int64)  # once per binding while it lasts
            self._io[steps] = (*arrays, *(C.OrtValue.ortvalue_from_numpy(a, self.device) for a in arrays))
        losses = self._io[steps][0]
        cut = (steps - 1) * batch  # NOTE: the Scan runs all batches but the last, the outer graph the last
        for name, arr in ((self.x, X), (self.y, y)):
            head = arr[:cut].reshape(steps - 1, batch, *arr.shape[1:])
            raw.bind_ortvalue_input(PREFIX + name, C.OrtValue.ortvalue_from_numpy(head, self.device))
            raw.bind_ortvalue_input(PREFIX + name + LAST, C.OrtValue.ortvalue_from_numpy(arr[cut:], self.device))
        if self._bound[first] != (steps, batch):
            raw.bind_ortvalue_output(PREFIX + "losses", self._io[steps][2])
            if any(v.name == COUNT for v in self.model.graph.input):
                raw.bind_ortvalue_input(COUNT, self._io[steps][3])
            if self.weights is not None:
                for name, value in ones(batch)[0]:
                    raw.bind_ortvalue_input(name, value)
            self._bound[first] = (steps, batch)
        # NOTE: the Scan also writes the set before ``first`` (the last step's inputs): kept for a replay
        before = ring.hosts[(first - 1) % N_SETS]
        saved = [a.copy() for a in before] if valid else []
        ok = False
        try:
            run(sess, raw, [X, y])
            ok = math.isfinite(self._check)  # NOTE: the sum of the losses and new tensors (an overflow replays too)
        finally:
            for a, b in zip(before, saved if not ok else []):  # NOTE: a refused batch, or a NaN: epoch() replays
                np.copyto(a, b)  # the batches with step from the epoch's first weights, which stay current
        if not ok:
            return []
        ring.current, ring.previous_valid = (first + 2) % N_SETS, True
        return losses.tolist()
