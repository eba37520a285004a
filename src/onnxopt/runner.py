"""``Runner``: executes a fused train step, one session run per step, weights never leaving ORT.

Weights and optimizer state live as OrtValues in three buffer sets; binding k reads set k and writes set
k+1 (mod 3), all bound once. A step binds only the batch. A failed or diverging step never touches its
inputs, and the set before them still holds the weights that gave the last finite loss.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from onnxopt.errors import ConvergenceError, DataError
from onnxopt.step import NEW, STEP, TrainStep

__all__ = ["Runner", "default_session_options"]

logger = logging.getLogger(__name__)
_N_SETS = 3


def default_session_options(n_parameters: int) -> ort.SessionOptions:
    """Options for small training graphs: one thread below ~1M parameters (no thread hand-off), all above."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # NOTE: weights are overridable initializers by design; ORT warns about it
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if n_parameters < 1_000_000:
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
    return opts


class Runner:
    """Runs ``step`` (a ``TrainStep`` or a path to one) on ``device`` ("cpu" or "cuda")."""

    def __init__(self, step: TrainStep | str | os.PathLike, device: str = "cpu",
                 session_options: ort.SessionOptions | None = None):
        self.train_step = step if isinstance(step, TrainStep) else TrainStep.load(step)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
        self.device = device
        initial = self.train_step.initial_weights()
        self.dtype = next(iter(initial.values())).dtype
        opts = session_options or default_session_options(sum(a.size for a in initial.values()))
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(self.train_step.model.SerializeToString(), opts, providers=providers)
        self._input_types = {i.name: i for i in self.session.get_inputs()}
        self._carried = [*self.train_step.weights, *self.train_step.state]
        self._sets = [self._zeros_like(initial) for _ in range(_N_SETS)]
        self.set_weights(initial, _all_sets=True)
        self._bindings = [self._bind(k) for k in range(_N_SETS)]
        self._losses = [ort.OrtValue.ortvalue_from_numpy(np.zeros((), self.dtype), device, 0) for _ in range(_N_SETS)]
        for k, b in enumerate(self._bindings):
            b.bind_ortvalue_output(self.train_step.loss, self._losses[k])
        self._current = 0
        self._previous_valid = False
        self._ones: dict[int, ort.OrtValue] = {}
        self.n_runs = 0

    # -- buffers -----------------------------------------------------------------------------------------
    def _zeros_like(self, initial: Mapping[str, np.ndarray]) -> dict[str, ort.OrtValue]:
        out = {}
        for name in self._carried:
            if name == STEP:
                arr = np.zeros((), np.int64)
            else:
                arr = np.zeros_like(initial[name if name in initial else name.rsplit(".", 1)[0]])
            out[name] = ort.OrtValue.ortvalue_from_numpy(arr, self.device, 0)
        return out

    def _bind(self, k: int) -> ort.IOBinding:
        binding = self.session.io_binding()
        src, dst = self._sets[k], self._sets[(k + 1) % _N_SETS]
        for name in self._carried:
            binding.bind_ortvalue_input(name, src[name])
            binding.bind_ortvalue_output(name + NEW, dst[name])
        return binding

    # -- training ----------------------------------------------------------------------------------------
    def _array(self, value, dtype) -> ort.OrtValue:
        arr = np.ascontiguousarray(value, dtype=dtype)
        return ort.OrtValue.ortvalue_from_numpy(arr, self.device, 0)

    def step(self, X, y=None, sample_weight=None) -> float:
        """One fused run on a batch; returns the loss. Raises ConvergenceError, keeping the last good weights."""
        ts = self.train_step
        binding = self._bindings[self._current]
        X = np.asarray(X)
        binding.bind_ortvalue_input(ts.inputs[0], self._array(X, self.dtype))
        n = X.shape[0]
        if ts.target is not None:
            if y is None:
                raise DataError(f"y: the compiled loss needs targets for {ts.target!r}, got None")
            ydtype = np.int64 if ts.target_kind == "index" else self.dtype
            binding.bind_ortvalue_input(ts.target, self._array(y, ydtype))
        if ts.sample_weight is not None:
            if sample_weight is None:  # NOTE: unweighted batches share one ones-OrtValue per batch length
                if n not in self._ones:
                    self._ones[n] = self._array(np.ones(n, self.dtype), self.dtype)
                binding.bind_ortvalue_input(ts.sample_weight, self._ones[n])
            else:
                binding.bind_ortvalue_input(ts.sample_weight, self._array(sample_weight, self.dtype))
        elif sample_weight is not None:
            raise DataError("sample_weight: the compiled loss takes no sample weight (its function has no "
                            "'sample_weight' input), got an array")
        self.session.run_with_iobinding(binding)
        self.n_runs += 1
        loss = float(self._losses[self._current].numpy())
        if not np.isfinite(loss):
            failed = self.step_count + 1
            if self._previous_valid:  # NOTE: the set before the inputs holds the weights of the last finite loss
                self._current = (self._current - 1) % _N_SETS
                self._previous_valid = False
            raise ConvergenceError(
                f"loss became {loss} at step {failed}; weights were reset to those that gave the last finite "
                f"loss (step {self.step_count + 1}), see get_weights()")
        self._current = (self._current + 1) % _N_SETS
        self._previous_valid = True
        return loss

    @property
    def step_count(self) -> int:
        """Steps completed so far."""
        return int(self._sets[self._current][STEP].numpy())

    # -- weights -----------------------------------------------------------------------------------------
    def get_weights(self) -> dict[str, np.ndarray]:
        """Copies of the current weights."""
        cur = self._sets[self._current]
        return {name: cur[name].numpy().copy() for name in self.train_step.weights}

    def get_state(self) -> dict[str, np.ndarray]:
        """Copies of the current optimizer state (and the step counter)."""
        cur = self._sets[self._current]
        return {name: cur[name].numpy().copy() for name in self.train_step.state}

    def set_weights(self, weights: Mapping[str, np.ndarray], _all_sets: bool = False) -> None:
        """Overwrites some or all weights (and state tensors, by name) in place."""
        targets = self._sets if _all_sets else [self._sets[self._current]]
        for name, value in weights.items():
            if name not in self._carried:
                raise DataError(f"weights: {name!r} is not a trained weight or state (expected one of {self._carried})")
            ref = targets[0][name]
            arr = np.asarray(value)
            if tuple(arr.shape) != tuple(ref.shape()):
                raise DataError(f"weights: {name!r} has shape {arr.shape}, expected {tuple(ref.shape())}")
            arr = np.ascontiguousarray(arr, dtype=np.int64 if name == STEP else self.dtype)
            for s in targets:
                s[name].update_inplace(arr)
        self._previous_valid = False

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Writes weights, optimizer state and step count to ``path`` (.npz), atomically."""
        path = os.fspath(path)
        arrays = {**self.get_weights(), **self.get_state()}
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".npz.tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restores what ``save_checkpoint`` wrote; training then continues bit for bit."""
        with np.load(os.fspath(path)) as data:
            missing = [n for n in self._carried if n not in data.files]
            if missing:
                raise DataError(f"checkpoint: {os.fspath(path)!r} lacks {missing}")
            self.set_weights({n: data[n] for n in self._carried})

    def export(self) -> onnx.ModelProto:
        """The user's original inference model with the trained weights written into its initializers."""
        model = onnx.ModelProto()
        model.ParseFromString(self.train_step.inference)
        weights = self.get_weights()
        for init in model.graph.initializer:
            if init.name in weights:
                init.CopyFrom(ir.serde.serialize_tensor(ir.tensor(weights[init.name], name=init.name)))
        return model
