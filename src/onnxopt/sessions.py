"""The Runner's onnxruntime sessions and bindings: one C binding per buffer set of its ``ring.BufferRing``.

The step's session runs batches of the usual length (its batch axis fixed: onnxruntime folds the shape
computations); a batch of another length, or with sample weights where the step hoisted them
(``runner.cpu_model``), runs a second session over the model as compiled, made on first use. Every binding
writes the loss into a host scalar of its set, so reading it is a memory read, not an ORT call.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.capi import _pybind_state as C

from onnxopt.ring import N_SETS, BufferRing

__all__ = ["StepSessions", "KEEP_DROPOUT"]

# NOTE: stock onnxruntime (1.32) removes a Dropout whose mask nothing reads, training_mode true or not: a step
# whose gradient does not pass the Dropout (weights before it frozen) would train on one mask for ever
KEEP_DROPOUT = ["EliminateDropout"]
_HOST = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)


def _without_values(model: onnx.ModelProto, weights: Mapping[str, np.ndarray], x: str | None = None,
                    rows: int | None = None) -> bytes | None:
    """The fused model without its weights' values: they are always bound, so the session need not hold a copy.

    With ``x`` and ``rows``: the free dimension that starts input ``x`` (the batch) fixed to ``rows`` on every
    input it names, for a session that runs batches of ``rows``: onnxruntime then folds the shape computations
    of the step (T1's kernels per step 430 -> 281, 5% of its time); None when ``x`` starts with no named free
    dimension."""
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    if rows is not None:
        inputs = {i.name: i for i in stripped.graph.input}
        dims = inputs[x].type.tensor_type.shape.dim if x in inputs else []
        batch = dims[0].dim_param if len(dims) and not dims[0].HasField("dim_value") else ""
        if not batch:
            return None
        for i in stripped.graph.input:
            for d in i.type.tensor_type.shape.dim:
                if d.dim_param == batch:
                    d.dim_value = rows
    keep = [t for t in stripped.graph.initializer if t.name not in weights]
    del stripped.graph.initializer[:]
    stripped.graph.initializer.extend(keep)
    return stripped.SerializeToString()


class StepSessions:
    """The sessions running ``model`` (weights ``initial`` stripped, always bound from ``ring``) with ``opts``.

    ``rows``: the batch length the step's session is specialized for (None: as compiled); ``loss``: the output
    written into ``loss_host[k]`` by binding k. ``raw``: the step session's C bindings, one per buffer set.
    Construction raises onnxruntime's error when the model does not load."""

    def __init__(self, model: onnx.ModelProto, initial: Mapping[str, np.ndarray], x: str, rows: int | None,
                 opts: ort.SessionOptions, providers: list[str], ring: BufferRing, loss: str):
        self.opts, self.providers, self.ring, self.loss = opts, providers, ring, loss
        self.free = _without_values(model, initial)
        fixed = _without_values(model, initial, x, rows) if rows else None
        self.fixed_rows = rows if fixed else None
        self.extra: dict[int, tuple] = {}
        self.session = None
        if fixed:  # NOTE: a graph whose shapes contradict the batch length fails at run time, as compiled
            try:
                self.session = self._session(fixed)
            except Exception:  # noqa: BLE001  (the session as compiled says what is wrong, if anything)
                self.fixed_rows = None
        if self.session is None:
            self.session = self._session(self.free)
        self.bindings = [self.bind(k) for k in range(N_SETS)]
        self.raw = [b._iobinding for b in self.bindings]  # NOTE: the C binding: no wrapper call per step
        # NOTE: the loss is written into host arrays: reading it is a memory read, not an ORT call
        self.loss_host = [np.zeros((), ring.dtype) for _ in range(N_SETS)]
        self.loss_values = [C.OrtValue.ortvalue_from_numpy(a, _HOST) for a in self.loss_host]
        for raw, value in zip(self.raw, self.loss_values):
            raw.bind_ortvalue_output(loss, value)

    def _session(self, model: bytes) -> ort.InferenceSession:
        return ort.InferenceSession(model, self.opts, providers=self.providers, disabled_optimizers=KEEP_DROPOUT)

    def bind(self, k: int, session: ort.InferenceSession | None = None) -> ort.IOBinding:
        """A binding of ``session`` (the step's by default) reading buffer set ``k`` and writing set k+1."""
        binding = (session or self.session).io_binding()
        self.ring.bind(binding._iobinding, k)
        return binding

    def bindings_of(self, model: bytes) -> tuple[C.InferenceSession, list]:
        """A second session over ``model`` and its bindings, one per buffer set (made once per model): for
        batches given sample weights (``CpuModel.weighted``) or of another length than the step session's."""
        made = self.extra.get(id(model))
        if made is None:
            session = self._session(model)
            bindings = [self.bind(k, session) for k in range(N_SETS)]
            for binding, value in zip(bindings, self.loss_values):
                binding._iobinding.bind_ortvalue_output(self.loss, value)
            made = self.extra[id(model)] = (session, bindings, session._sess, [b._iobinding for b in bindings])
        return made[2], made[3]
