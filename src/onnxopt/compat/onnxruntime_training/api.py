"""``onnxruntime.training.api`` on stock onnxruntime: CheckpointState, Module, Optimizer, LinearLRScheduler.

The state (parameters, gradient buffers, moments) lives in ``OrtValue``s that stay bound between calls: each
training call feeds them to the training model (``lowering.training_graph``: onnxruntime's in-place
accumulation written as outputs) and keeps the new buffers; each optimizer step runs one standard ONNX
update model (``lowering.update_model``) over every parameter and keeps the new weights and moments.
Artifacts written by onnxruntime-training's ``generate_artifacts`` or by ``artifacts.generate_artifacts`` load
alike.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from onnxopt.compat.onnxruntime_training import checkpoint_fbs, lowering
from onnxopt.errors import CheckpointError, ModelError

__all__ = ["CheckpointState", "Module", "Optimizer", "LinearLRScheduler", "Parameter"]

BUFFER = "_grad.accumulation.buffer"
_FLAGS = {b: ort.OrtValue.ortvalue_from_numpy(np.array([b])) for b in (False, True)}  # NOTE: fed read-only
RESET = "lazy_reset_grad"


def _ortvalue(array) -> ort.OrtValue:
    if isinstance(array, ort.OrtValue):
        return array
    array = np.ascontiguousarray(array)
    if array.dtype.kind == "U":  # NOTE: onnxruntime takes strings as an object array
        array = array.astype(object)
    return ort.OrtValue.ortvalue_from_numpy(array)


class Parameter:
    """One parameter of a ``CheckpointState``: ``data`` (settable), ``grad`` (None before a Module
    exists), ``requires_grad``."""

    def __init__(self, state: CheckpointState, name: str):
        self._state, self.name = state, name

    @property
    def data(self) -> np.ndarray:
        return self._state._get(self.name)

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._state._set(self.name, value)

    @property
    def grad(self) -> np.ndarray | None:
        g = self._state._grads.get(self.name)
        return None if g is None else g.numpy().copy()

    @property
    def requires_grad(self) -> bool:
        return self._state._requires_grad[self.name]

    def __repr__(self) -> str:
        return f"Parameter(name={self.name}, requires_grad={self.requires_grad})"


class Parameters:
    """The parameters by name; iterating yields ``(name, Parameter)`` pairs, as onnxruntime's."""

    def __init__(self, state: CheckpointState):
        self._state = state

    def __getitem__(self, name: str) -> Parameter:
        if name not in self:
            raise KeyError(f"Parameter {name} not found.")
        if self._state._nominal:
            raise RuntimeError("Cannot get parameter from a nominal state. Please load the parameter states first")
        return Parameter(self._state, name)

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        if self._state._nominal:
            raise RuntimeError("Cannot set parameter in a nominal state. Please load all the parameter states first")
        self[name].data = value

    def __contains__(self, name: str) -> bool:
        return name in self._state._requires_grad

    def __iter__(self) -> Iterator[tuple[str, Parameter]]:
        for name in self._state._requires_grad:
            yield name, Parameter(self._state, name)

    def __len__(self) -> int:
        return len(self._state._requires_grad)

    def __repr__(self) -> str:
        return repr(list(self._state._requires_grad))


class Properties:
    """User properties (int, float or str values) saved in the checkpoint; iterating yields ``(name, value)``."""

    def __init__(self, state: CheckpointState):
        self._props = state._properties

    def __getitem__(self, name: str) -> int | float | str:
        if name not in self._props:
            raise KeyError(f"Property {name} not found.")
        return self._props[name]

    def __setitem__(self, name: str, value: int | float | str) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise TypeError(f"property {name!r}: expected an int, a float or a str, got {type(value).__name__}")
        self._props[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self._props

    def __iter__(self):
        yield from self._props.items()

    def __len__(self) -> int:
        return len(self._props)

    def __repr__(self) -> str:
        return repr(list(self._props))


class CheckpointState:
    """Parameters, their gradients, the optimizer state and user properties; load and save onnxruntime's
    checkpoint files (``checkpoint_fbs``)."""

    def __init__(self, ckpt: checkpoint_fbs.Checkpoint):
        if not isinstance(ckpt, checkpoint_fbs.Checkpoint):
            raise TypeError(f"Invalid argument for CheckpointState received {type(ckpt)}")
        self._nominal = ckpt.is_nominal_state
        self._requires_grad = {**{k: True for k in ckpt.requires_grad_params},
                               **{k: False for k in ckpt.frozen_params}}
        params = {**ckpt.requires_grad_params, **ckpt.frozen_params}
        self._meta = {k: (v.dtype, v.shape) for k, v in params.items()}
        self._values = {k: _ortvalue(v) for k, v in params.items()}
        self._grads: dict[str, ort.OrtValue] = {}
        self._properties = dict(ckpt.properties)
        self._optimizer_group = ckpt.optimizer_groups[0] if ckpt.optimizer_groups else None
        self._optimizer: Optimizer | None = None
        self._parameters, self._props = Parameters(self), Properties(self)

    def _get(self, name: str) -> np.ndarray:
        if self._nominal:
            raise RuntimeError("Cannot get parameter from a nominal state. Please load the parameter states first")
        return self._values[name].numpy().copy()

    def _set(self, name: str, value) -> None:
        value = np.asarray(value.numpy() if isinstance(value, ort.OrtValue) else value)
        dtype, shape = self._meta[name]
        if value.shape != tuple(shape) or value.dtype != dtype:
            raise CheckpointError(f"parameter {name!r}: expected {dtype}{list(shape)}, got {value.dtype}"
                                  f"{list(value.shape)}")
        self._values[name] = _ortvalue(value.copy())

    @classmethod
    def load_checkpoint(cls, checkpoint_uri: str | os.PathLike) -> CheckpointState:
        """Loads a checkpoint file (complete or nominal) written by onnxruntime-training or onnxopt."""
        return cls(checkpoint_fbs.load(checkpoint_uri))

    @classmethod
    def save_checkpoint(cls, state: CheckpointState, checkpoint_uri: str | os.PathLike,
                        include_optimizer_state: bool = False) -> None:
        """Writes ``state`` as onnxruntime's checkpoint file (the optimizer's step, learning rate and moments
        too when ``include_optimizer_state``)."""
        if state._nominal:
            raise CheckpointError("checkpoint: cannot save a nominal state; copy the parameters in first "
                                  "(Module.copy_buffer_to_parameters)")
        arrays = {k: v.numpy() for k, v in state._values.items()}
        ckpt = checkpoint_fbs.Checkpoint(
            requires_grad_params={k: arrays[k] for k, t in state._requires_grad.items() if t},
            frozen_params={k: arrays[k] for k, t in state._requires_grad.items() if not t},
            properties=dict(state._properties))
        if include_optimizer_state and state._optimizer is not None:
            ckpt.optimizer_groups = [state._optimizer._group()]
        elif include_optimizer_state and state._optimizer_group is not None:
            ckpt.optimizer_groups = [state._optimizer_group]
        checkpoint_fbs.save(ckpt, checkpoint_uri)

    @property
    def parameters(self) -> Parameters:
        return self._parameters

    @property
    def properties(self) -> Properties:
        return self._props


def _session(proto: onnx.ModelProto, providers: list[str], options) -> ort.InferenceSession:
    return ort.InferenceSession(proto.SerializeToString(), options, providers=providers)


def _providers(device: str) -> list[str]:
    kind = device.split(":")[0]
    if kind == "cpu":
        return ["CPUExecutionProvider"]
    if kind == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    raise ValueError(f"device: expected 'cpu' (or 'cuda' with onnxruntime-gpu), got {device!r}")


# NOTE: onnxruntime 1.19's IOBinding.get_outputs() returns views of the binding's outputs, released at the next
# clear_binding_outputs(); from 1.22 (this package's stock minimum) they are OrtValues of their own
_BIND = tuple(int(v) for v in ort.__version__.split(".")[:2]) >= (1, 22)


def _run(session: ort.InferenceSession, names: list[str], feeds: dict, strings: bool = False) -> list[ort.OrtValue]:
    """``names`` computed from ``feeds`` (OrtValues), as new OrtValues."""
    if not strings and not _BIND:
        return session.run_with_ort_values(names, feeds)
    if not strings:
        # NOTE: through an IOBinding kept per session and output list: onnxruntime >= 1.2x's
        # run_with_ort_values checks every feed in Python, ~80 us a call, most of a small model's step
        # (outputs bound afresh each call: a bound output of the last call would be written over, and the
        # state holds it)
        binding = getattr(session, "_onnxopt_binding", None)
        if binding is None:
            binding = session._onnxopt_binding = session.io_binding()
        binding.clear_binding_outputs()
        for name in names:
            binding.bind_output(name, "cpu")
        for name, value in feeds.items():
            binding.bind_ortvalue_input(name, value)
        session.run_with_iobinding(binding)
        return binding.get_outputs()
    feeds = {k: v.numpy() if isinstance(v, ort.OrtValue) else v for k, v in feeds.items()}
    return [_ortvalue(v) for v in session.run(names, feeds)]


class Module:
    """Trains (``train()``) or evaluates (``eval()``) the artifacts' models over a ``CheckpointState``.

    ``module(*inputs)`` runs one step: in training mode it adds the gradients to the state's buffers (or
    replaces them after ``lazy_reset_grad()``) and returns the loss (and additional outputs) as numpy
    arrays, or as ``OrtValue``s when every input is one.
    """

    training: bool

    def __init__(self, train_model_uri: str | os.PathLike, state: CheckpointState,
                 eval_model_uri: str | os.PathLike | None = None, device: str = "cpu",
                 session_options: ort.SessionOptions | None = None) -> None:
        self.training, self.device, self._state = True, device, state
        providers = _providers(device)
        train = onnx.load(os.fspath(train_model_uri))
        names = [v.name for v in train.graph.input]
        self._params = [n for n in names if n in state._requires_grad]
        buffers = [n for n in names if n.endswith(BUFFER)]
        missing = [n[: -len(BUFFER)] for n in buffers if n[: -len(BUFFER)] not in state._requires_grad]
        if missing:
            raise ModelError(f"training model: parameters {missing} have gradient buffers but are not in the "
                             f"checkpoint (expected some of {list(state._requires_grad)})")
        self._trained = [n[: -len(BUFFER)] for n in buffers]
        self._train_inputs = [n for n in names if n not in state._requires_grad and n not in buffers and n != RESET]
        self._has_reset = RESET in names
        self._train_outputs = [v.name for v in train.graph.output if not v.name.endswith("_grad.accumulation.out")]
        self._train = _session(lowering.training_graph(train), providers, session_options)
        self._eval = self._eval_proto = None
        if eval_model_uri is not None:
            self._eval_proto = onnx.load(os.fspath(eval_model_uri))
            self._eval = _session(lowering.training_graph(self._eval_proto), providers, session_options)
            self._eval_inputs = [v.name for v in self._eval_proto.graph.input if v.name not in state._requires_grad]
            self._eval_params = [v.name for v in self._eval_proto.graph.input if v.name in state._requires_grad]
            self._eval_outputs = [v.name for v in self._eval_proto.graph.output]
        self._accumulate = False
        self._zero_grads()

    def _zero_grads(self) -> None:
        for name in self._trained:
            dtype, shape = self._state._meta[name]
            self._state._grads.setdefault(name, _ortvalue(np.zeros(shape, dtype)))

    def __call__(self, *user_inputs):
        numpy_out = any(not isinstance(x, ort.OrtValue) for x in user_inputs)
        # NOTE: an OrtValue cannot hold strings: a string input runs the whole call on numpy arrays
        strings = any(np.asarray(x).dtype.kind in "OUS" for x in user_inputs if not isinstance(x, ort.OrtValue))
        state = self._state
        self._check_loaded()
        names = self._train_inputs if self.training else self._eval_inputs
        if len(user_inputs) != len(names):
            raise ValueError(f"Module: expected {len(names)} inputs {names}, got {len(user_inputs)}")
        feeds = dict(zip(names, user_inputs)) if strings else {n: _ortvalue(x) for n, x in zip(names, user_inputs)}
        if not self.training:
            if self._eval is None:
                raise RuntimeError("Module: no eval model was given (eval_model_uri)")
            feeds.update({n: state._values[n] for n in self._eval_params})
            outs = _run(self._eval, self._eval_outputs, feeds, strings)
        else:
            feeds.update({n: state._values[n] for n in self._params})
            feeds.update({n + BUFFER: state._grads[n] for n in self._trained})
            if self._has_reset:
                feeds[RESET] = _FLAGS[not self._accumulate]
            fetch = self._train_outputs + [n + BUFFER + lowering.NEXT for n in self._trained]
            outs = _run(self._train, fetch, feeds, strings)
            k = len(self._train_outputs)
            state._grads.update(zip(self._trained, outs[k:]))
            outs = outs[:k]
            self._accumulate = True
        outs = [o.numpy() for o in outs] if numpy_out else list(outs)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _check_loaded(self) -> None:
        if self._state._nominal:
            raise RuntimeError("Module: the checkpoint state is nominal. Please load the model parameters first. "
                               "(copy_buffer_to_parameters)")

    def train(self, mode: bool = True) -> Module:
        self.training = mode
        return self

    def eval(self) -> Module:
        return self.train(False)

    def lazy_reset_grad(self) -> None:
        """The next training call replaces the gradients instead of adding to them."""
        self._accumulate = False

    def _names(self, trainable_only: bool) -> list[str]:
        return [n for n in self._params if self._state._requires_grad[n] or not trainable_only]

    def get_parameters_size(self, trainable_only: bool = True) -> int:
        return int(sum(np.prod(self._state._meta[n][1], dtype=np.int64) for n in self._names(trainable_only)))

    def get_contiguous_parameters(self, trainable_only: bool = False) -> ort.OrtValue:
        """The parameters flattened into one float32 buffer, in the training model's input order."""
        names = self._names(trainable_only)
        self._check_loaded()
        return _ortvalue(np.concatenate([self._state._values[n].numpy().ravel() for n in names]).astype(np.float32))

    def copy_buffer_to_parameters(self, buffer, trainable_only: bool = True) -> None:
        """Fills the parameters from one flat buffer (what completes a nominal state)."""
        flat = np.asarray(buffer.numpy() if isinstance(buffer, ort.OrtValue) else buffer).ravel()
        size = self.get_parameters_size(trainable_only)
        if flat.size != size:
            raise ValueError(f"copy_buffer_to_parameters: expected a buffer of {size} values, got {flat.size}")
        state, start = self._state, 0
        for n in self._names(trainable_only):
            dtype, shape = state._meta[n]
            count = int(np.prod(shape, dtype=np.int64))
            state._values[n] = _ortvalue(flat[start:start + count].astype(dtype).reshape(shape))
            start += count
        if trainable_only and any(not state._requires_grad[n] for n in self._params) and state._nominal:
            raise CheckpointError("copy_buffer_to_parameters: the state is nominal and has frozen parameters; "
                                  "pass trainable_only=False")
        state._nominal = False
        self._zero_grads()

    def export_model_for_inferencing(self, inference_model_uri: str | os.PathLike,
                                     graph_output_names: list[str]) -> None:
        """Writes the eval model cut at ``graph_output_names``, with the current parameters as initializers."""
        if self._eval_proto is None:
            raise RuntimeError("export_model_for_inferencing: needs the eval model (eval_model_uri)")
        m = ir.from_proto(self._eval_proto)
        g = m.graph
        values = {v.name: v for n in g for v in n.outputs} | {v.name: v for v in g.inputs}
        unknown = [n for n in graph_output_names if n not in values]
        if unknown:
            raise ModelError(f"graph_output_names: {unknown} are not values of the eval model")
        g.outputs.clear()
        g.outputs.extend(values[n] for n in graph_output_names)
        for v in list(g.inputs):
            if v.name in self._state._values:
                g.inputs.remove(v)
                v.const_value = ir.tensor(self._state._get(v.name), name=v.name)
                g.register_initializer(v)
        ir.passes.common.RemoveUnusedNodesPass()(m)
        used = {v for n in g for v in n.inputs} | set(g.outputs)
        for v in [v for v in g.inputs if v not in used]:
            g.inputs.remove(v)
        onnx.save(ir.to_proto(m), os.fspath(inference_model_uri))

    def input_names(self) -> list[str]:
        return list(self._train_inputs if self.training else self._eval_inputs)

    def output_names(self) -> list[str]:
        return list(self._train_outputs if self.training else self._eval_outputs)


class Optimizer:
    """Updates the module's trained parameters from their gradients (AdamW or SGD, read from the optimizer
    model); the step count, learning rate and moments start from the checkpoint's optimizer state if any."""

    def __init__(self, optimizer_uri: str | os.PathLike, module: Module):
        self._module, state = module, module._state
        self._spec = lowering.optimizer_spec(onnx.load(os.fspath(optimizer_uri)))
        self._names = [n for n in module._trained]
        group = state._optimizer_group
        self._step, self._lr = (group.step, group.initial_learning_rate) if group else (0, 1e-3)
        self._moments = {}
        for n in self._names:
            dtype, shape = state._meta[n]
            saved = group.optimizer_states.get(n, {}) if group else {}
            self._moments[n] = [_ortvalue(saved.get(f"momentum{i}", np.zeros(shape, np.float32)))
                                for i in range(self._spec.moments)]
        params = [(n, state._meta[n][0], state._meta[n][1]) for n in self._names]
        # NOTE: one thread: the update is a memory-bound pass; a second thread only waits (2.8x slower on W3
        # on a loaded 2-core machine)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self._update = _session(lowering.update_model(self._spec, params), _providers(module.device), options)
        clip = [".grad"] if self._spec.clip is not None else []
        self._outputs = [f"{n}{s}{lowering.NEXT}" for n in self._names
                         for s in ["", *(f".momentum{i}" for i in range(self._spec.updated_moments)), *clip]]
        state._optimizer = self

    def step(self) -> None:
        """One update of every trained parameter from its accumulated gradient."""
        self._module._check_loaded()
        state = self._module._state
        feeds = {"learning_rate": _ortvalue(np.array([self._lr], np.float32)),
                 "step": _ortvalue(np.array([self._step + 1], np.int64))}
        for n in self._names:
            feeds[n], feeds[n + ".grad"] = state._values[n], state._grads[n]
            feeds.update({f"{n}.momentum{i}": m for i, m in enumerate(self._moments[n])})
        outs = iter(_run(self._update, self._outputs, feeds))
        for n in self._names:
            state._values[n] = next(outs)
            if self._spec.updated_moments:
                self._moments[n] = [next(outs) for _ in range(self._spec.updated_moments)]
            if self._spec.clip is not None:
                state._grads[n] = next(outs)
        self._step += 1

    def set_learning_rate(self, learning_rate: float) -> None:
        self._lr = float(np.float32(learning_rate))

    def get_learning_rate(self) -> float:
        return self._lr

    def _group(self) -> checkpoint_fbs.OptimizerGroup:
        return checkpoint_fbs.OptimizerGroup(
            "group0", self._step, self._initial_lr if hasattr(self, "_initial_lr") else self._lr,
            {n: {f"momentum{i}": m.numpy() for i, m in enumerate(self._moments[n])} for n in self._names})


class LinearLRScheduler:
    """Linear warm-up then linear decay of the optimizer's learning rate, applied at each ``step()``.

    NOTE: onnxruntime-training 1.19's Python binding hands ``warmup_step_count`` and ``total_step_count`` to
    its C++ scheduler swapped; the factor here is the one its Python API computes (checked against it):
    ``s / total`` while ``s < total``, then ``max(0, (warmup - s) / max(1, warmup - total))`` with ``s``
    the optimizer's step count. The constructor sets the rate for ``s`` too.
    """

    def __init__(self, optimizer: Optimizer, warmup_step_count: int, total_step_count: int, initial_lr: float):
        self._optimizer, self._initial = optimizer, float(initial_lr)
        self._warmup, self._total = int(total_step_count), int(warmup_step_count)
        optimizer._initial_lr = float(np.float32(initial_lr))
        self._apply()

    def _apply(self) -> None:
        s, w, t = self._optimizer._step, self._warmup, self._total
        factor = s / max(1, w) if s < w else max(0.0, (t - s) / max(1, t - w))
        self._optimizer.set_learning_rate(self._initial * factor)

    def step(self) -> None:
        self._apply()
