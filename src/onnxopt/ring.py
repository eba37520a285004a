"""The Runner's state buffers: three sets of weights, optimizer state and running statistics, used as a ring.

Binding k reads set k and writes set k+1 (mod 3), so a step never overwrites its inputs: after a step, the set
before the current one still holds the weights it started from (``previous_valid``), which a diverging step goes
back to (``step_back``). On CPU the packs of a multi-tensor update (``passes.update.flat_carry``) are one host
buffer per set, their members numpy views of it; every OrtValue wraps host memory the ring keeps (``hosts``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import _pybind_state as C

from onnxopt.errors import DataError
from onnxopt.protocol import NEW, STEP

__all__ = ["BufferRing", "N_SETS"]

N_SETS = 3


class BufferRing:
    """The three buffer sets of ``carried`` tensors (weights, buffers, state, the step counter, in that order)
    starting from ``initial``; ``packs`` {pack: member names} share one flat buffer per set, ``rows`` are bound
    as (1, n) views, ``views`` (packed weights) are read as views of their pack. ``current`` is the set holding
    the latest values. ``memory`` (set, size) gives a set's flat host memory for its tensors of ``dtype``
    (distributed's mode "weights": in shared memory, where ranks average them in place)."""

    def __init__(self, initial: Mapping[str, np.ndarray], carried: list[str], packs: dict[str, list[str]],
                 dtype: np.dtype, device: str, rows: tuple[str, ...] = (), views: list[str] | None = None,
                 memory: Callable[[int, int], np.ndarray] | None = None):
        self.carried, self.packs, self.dtype, self.device, self.rows = carried, packs, dtype, device, rows
        self._memory = memory  # NOTE: (set, size) -> the flat host memory of that set's tensors of ``dtype``
        members = {m for names in packs.values() for m in names}
        # NOTE: what the session reads and writes: packs and unpacked tensors; packed weights are read as views
        self.bound = [*packs, *(n for n in carried if n not in members)]
        self.views = views or []
        # NOTE: per set, its host buffers: the packs' memory (their OrtValues and views do not own it) and the rest
        self.hosts: list[list[np.ndarray]] = []
        self.row_sets: list[dict[str, ort.OrtValue]] = []  # NOTE: per set, (1, n) views of the ``rows`` vectors
        self.sets = [self._zeros_like(initial) for _ in range(N_SETS)]
        self.current = 0
        self.previous_valid = False  # NOTE: whether the set before ``current`` holds the last step's inputs
        self.write(initial, all_sets=True)

    def _zeros_like(self, initial: Mapping[str, np.ndarray]) -> dict[str, ort.OrtValue]:
        source = lambda n: initial[n if n in initial else n.rsplit(".", 1)[0]]  # noqa: E731
        shapes = {pack: [source(n).shape for n in names] for pack, names in self.packs.items()}
        alone = [n for n in self.carried if not any(n in names for names in self.packs.values())]
        blocks = {**{p: sum(int(np.prod(sh)) for sh in shs) for p, shs in shapes.items()},
                  **{n: source(n).size for n in alone if n != STEP and source(n).dtype == self.dtype}}
        memory, offset = None, 0
        if self._memory is not None:  # NOTE: one region per set, each block at a 64-byte boundary
            align = 64 // np.dtype(self.dtype).itemsize
            memory = self._memory(len(self.hosts), sum(-(-b // align) * align for b in blocks.values()))

        def zeros(name: str, size: int) -> np.ndarray:
            nonlocal offset
            if memory is None or name not in blocks:
                return np.zeros(size, self.dtype)
            block, offset = memory[offset:offset + size], offset - (-size // align) * align
            block[:] = 0
            return block

        arrays, hosts = {}, []  # NOTE: each tensor's host memory: its own array, or a view of its pack's
        for pack, names in self.packs.items():  # NOTE: one flat buffer per pack, each member a view of it
            flat = arrays[pack] = zeros(pack, blocks[pack])
            hosts.append(flat)
            start = 0
            for name, shape in zip(names, shapes[pack]):
                size = int(np.prod(shape))
                arrays[name] = flat[start:start + size].reshape(shape)
                start += size
        for name in alone:
            if name == STEP:
                arr = np.zeros((), np.int64)
            elif name in blocks:
                arr = zeros(name, blocks[name]).reshape(source(name).shape)
            else:
                arr = np.zeros_like(source(name))
            hosts.append(arr)
            arrays[name] = arr
        self.hosts.append(hosts)  # NOTE: on CPU the OrtValues wrap these arrays
        value = lambda a: ort.OrtValue.ortvalue_from_numpy(a, self.device, 0)  # noqa: E731
        self.row_sets.append({name: value(arrays[name].reshape(1, -1)) for name in self.rows})
        return {name: value(a) for name, a in arrays.items()}

    def value(self, k: int, name: str) -> C.OrtValue:
        """The OrtValue of set ``k`` bound for ``name``: a (1, n) view for a vector the model reads as a row."""
        return self.row_sets[k].get(name, self.sets[k][name])._ortvalue

    def bind(self, raw, k: int) -> None:
        """Binds set ``k`` as the inputs of the C binding ``raw`` and set k+1 as its outputs (``W.new``)."""
        for name in self.bound:
            raw.bind_ortvalue_input(name, self.value(k, name))
            raw.bind_ortvalue_output(name + NEW, self.value((k + 1) % N_SETS, name))
        for name in self.views:
            raw.bind_ortvalue_input(name, self.value(k, name))

    def advance(self) -> None:
        """After a step that read ``current``: its outputs are current, its inputs kept before them."""
        self.current = (self.current + 1) % N_SETS
        self.previous_valid = True

    def step_back(self) -> bool:
        """Makes the set before ``current`` current again when it holds the last step's inputs; whether it did."""
        if not self.previous_valid:
            return False
        self.current = (self.current - 1) % N_SETS
        self.previous_valid = False
        return True

    @property
    def step_count(self) -> int:
        return int(self.sets[self.current][STEP].numpy())

    def read(self, names: list[str], into: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Copies of the current values of ``names``; written into the arrays of an earlier ``read`` when given
        (a snapshot taken every few steps: no allocation, whose page faults cost twice the copy)."""
        cur = self.sets[self.current]
        if into is None or list(into) != list(names):
            return {name: cur[name].numpy().copy() for name in names}
        for name in names:
            np.copyto(into[name], cur[name].numpy())
        return into

    def write(self, values: Mapping[str, np.ndarray], all_sets: bool = False) -> None:
        """Overwrites some carried tensors in place, in the current set (or every set), checked by name and shape."""
        targets = self.sets if all_sets else [self.sets[self.current]]
        for name, value in values.items():
            if name not in self.carried:
                raise DataError(f"weights: {name!r} is not a trained weight or state (expected one of {self.carried})")
            ref = targets[0][name]
            arr = np.asarray(value)
            if tuple(arr.shape) != tuple(ref.shape()):
                raise DataError(f"weights: {name!r} has shape {arr.shape}, expected {tuple(ref.shape())}")
            arr = np.ascontiguousarray(arr, dtype=np.int64 if name == STEP else self.dtype)
            for s in targets:
                s[name].update_inplace(arr)
        self.previous_valid = False
