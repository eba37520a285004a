"""``onnxruntime.training.api`` on stock onnxruntime: CheckpointState, Module, Optimizer, LinearLRScheduler.

The state (parameters, gradient buffers, moments) lives in ``OrtValue``s bound once to each run (``_Run``): a
run writes the spare side of what it updates and ``_Swap.flip`` makes it current, so nothing is copied or bound
again per call. The training model is ``lowering.training_graph`` (onnxruntime's in-place accumulation written as
outputs); once an ``Optimizer`` exists it is ``lowering.fused_model``, whose run also computes the update from the
new gradients: ``step()`` commits those candidates when nothing changed since (same learning rate, no parameter
written), and otherwise runs the update model (``lowering.update_model``), so the results are onnxruntime's.
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
from onnxruntime.capi import _pybind_state as C

from onnxopt.compat.onnxruntime_training import checkpoint_fbs, lowering
from onnxopt.errors import CheckpointError, ModelError

__all__ = ["CheckpointState", "Module", "Optimizer", "LinearLRScheduler", "Parameter"]

BUFFER = "_grad.accumulation.buffer"
_HOST = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
RESET = "lazy_reset_grad"


def _ortvalue(array) -> ort.OrtValue:
    if isinstance(array, ort.OrtValue):
        return array
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))


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
        self._candidate: float | None = None  # NOTE: the learning rate of the last fused run's candidates, if valid
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
        self._values[name].update_inplace(np.ascontiguousarray(value))  # NOTE: in place: the value stays bound
        self._candidate = None

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


class _Swap:
    """Two OrtValues per tensor: the current one sits in the dict its readers use, a run writes the spare one, and
    ``flip`` makes the spares current. Bindings stay valid (one per side, ``k``) and nothing is copied."""

    def __init__(self):
        self.k, self.sets = 0, ({}, {})  # NOTE: per side, {name: (view, OrtValue)}

    def add(self, view: dict, names) -> None:
        for n in names:
            self.sets[self.k][n] = (view, view[n])
            self.sets[1 - self.k][n] = (view, _ortvalue(np.empty_like(view[n].numpy())))

    def spare(self, suffix: str = "") -> dict[str, ort.OrtValue]:
        return {n + suffix: v for n, (_, v) in self.sets[1 - self.k].items()}

    def flip(self) -> None:
        self.k ^= 1
        for n, (view, v) in self.sets[self.k].items():
            view[n] = v


class _Run:
    """A session run whose state stays bound: ``ins`` and ``outs`` are fixed OrtValues (written in place by the
    api), the call binds the user's ``feeds`` and returns copies of the ``fetch`` outputs."""

    def __init__(self, session: ort.InferenceSession, ins: dict, outs: dict, fetch: list[str]):
        names = {i.name for i in session.get_inputs()}  # NOTE: a specialized model may read fewer
        ins = {n: v for n, v in ins.items() if n in names}
        self.session, self.ins, self.outs, self.fetch = session, ins, outs, fetch
        self.raw = session.io_binding()._iobinding  # NOTE: the C binding: no wrapper call per run
        for n in fetch:
            self.raw.bind_output(n, _HOST)
        for n, v in ins.items():
            self.raw.bind_ortvalue_input(n, v._ortvalue)
        for n, v in outs.items():
            self.raw.bind_ortvalue_output(n, v._ortvalue)

    def __call__(self, feeds: dict) -> list[np.ndarray]:
        if any(type(x) is np.ndarray and x.dtype.kind in "OUS" for x in feeds.values()):  # NOTE: no string OrtValue
            feeds = {**{n: v.numpy() for n, v in self.ins.items()}, **feeds}
            done = self.session.run([*self.fetch, *self.outs], feeds)
            for value, array in zip(self.outs.values(), done[len(self.fetch):]):
                value.update_inplace(array)
            return done[:len(self.fetch)]
        feeds = {n: x if isinstance(x, ort.OrtValue) else np.ascontiguousarray(x) for n, x in feeds.items()}
        for n, x in feeds.items():  # NOTE: ``feeds`` keeps the arrays alive until the run ends
            self.raw.bind_ortvalue_input(n, x._ortvalue if isinstance(x, ort.OrtValue) else
                                         C.OrtValue.ortvalue_from_numpy(x, _HOST))
        self.session._sess.run_with_iobinding(self.raw, None)
        outs = self.raw.get_outputs()
        done = [outs[i].numpy().copy() for i in range(len(self.fetch))]
        for n in self.fetch:  # NOTE: afresh: onnxruntime would reuse the last buffer, whose shape may not fit
            self.raw.bind_output(n, _HOST)
        return done


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
        self._proto, self._options, self._sessions, self._optimizer = train, (providers, session_options), {}, None
        self._session(True)  # NOTE: made now, so that a model that does not lower or load fails here
        self._eval = self._eval_proto = None
        if eval_model_uri is not None:
            self._eval_proto = onnx.load(os.fspath(eval_model_uri))
            self._eval = _session(lowering.training_graph(self._eval_proto), providers, session_options)
            self._eval_inputs = [v.name for v in self._eval_proto.graph.input if v.name not in state._requires_grad]
            self._eval_params = [v.name for v in self._eval_proto.graph.input if v.name in state._requires_grad]
            self._eval_outputs = [v.name for v in self._eval_proto.graph.output]
        self._accumulate = False
        for name in self._trained:
            dtype, shape = state._meta[name]
            state._grads[name] = _ortvalue(np.zeros(shape, dtype))
        # NOTE: parameters (with the optimizer's moments) and gradients each have a spare set the runs write
        self._weights, self._grads, self._runs = _Swap(), _Swap(), {}
        self._weights.add(state._values, self._trained)
        self._grads.add(state._grads, self._trained)

    def _session(self, fresh: bool) -> ort.InferenceSession:
        """The training session for ``fresh`` gradients (else accumulated), fused with the optimizer's update once
        one exists (``lowering.fused_model``), made on first use."""
        if fresh not in self._sessions:
            proto, opt = lowering.training_graph(self._proto, fresh), self._optimizer
            if opt is not None and opt._fused:
                proto = lowering.fused_model(proto, opt._spec, self._trained, BUFFER)
            self._sessions[fresh] = _session(proto, *self._options)
        return self._sessions[fresh]

    def _run(self, kind: str, fresh: bool = True) -> _Run:
        """The run of ``kind`` ("train", "eval" or "step") bound to the current sides, made on first use."""
        key = (kind, fresh, self._weights.k, self._grads.k)
        if key not in self._runs:
            state, opt = self._state, self._optimizer
            if kind == "eval":
                run = _Run(self._eval, {n: state._values[n] for n in self._eval_params}, {}, self._eval_outputs)
            elif kind == "train":
                ins = {n: state._values[n] for n in self._params} | {n + BUFFER: state._grads[n] for n in self._trained}
                outs = self._grads.spare(BUFFER + lowering.NEXT)
                if opt is not None and opt._fused:
                    ins |= opt._inputs()
                    outs |= self._weights.spare(lowering.NEXT)
                run = _Run(self._session(fresh), ins, outs, self._train_outputs)
            else:
                ins = opt._inputs() | {n: state._values[n] for n in self._trained}
                ins |= {n + ".grad": state._grads[n] for n in self._trained}
                outs = self._weights.spare(lowering.NEXT)
                outs |= self._grads.spare(".grad" + lowering.NEXT) if opt._spec.clip is not None else {}
                run = _Run(opt._update, ins, outs, [])
            self._runs[key] = run
        return self._runs[key]

    def __call__(self, *user_inputs):
        numpy_out = any(not isinstance(x, ort.OrtValue) for x in user_inputs)
        self._check_loaded()
        names = self._train_inputs if self.training else self._eval_inputs
        if len(user_inputs) != len(names):
            raise ValueError(f"Module: expected {len(names)} inputs {names}, got {len(user_inputs)}")
        feeds = {n: x if isinstance(x, ort.OrtValue) else np.asarray(x) for n, x in zip(names, user_inputs)}
        if not self.training:
            if self._eval is None:
                raise RuntimeError("Module: no eval model was given (eval_model_uri)")
            outs = self._run("eval")(feeds)
        else:
            opt, self._state._candidate = self._optimizer, None
            fused = opt is not None and opt._fused
            if fused:
                opt._stage()
            # NOTE: without a lazy_reset_grad input, onnxruntime's accumulator always adds
            outs = self._run("train", not self._accumulate and self._has_reset)(feeds)
            self._grads.flip()
            # NOTE: the run also wrote candidate parameters and moments from these gradients: ``Optimizer.step``
            # commits them while nothing else changed (same learning rate, no parameter written)
            self._state._candidate = opt._lr if fused else None
            self._accumulate = True
        outs = outs if numpy_out else [_ortvalue(o) for o in outs]
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
            state._set(n, flat[start:start + count].astype(dtype).reshape(shape))
            start += count
        if trainable_only and any(not state._requires_grad[n] for n in self._params) and state._nominal:
            raise CheckpointError("copy_buffer_to_parameters: the state is nominal and has frozen parameters; "
                                  "pass trainable_only=False")
        state._nominal = False

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
        self._module, state, names = module, module._state, module._trained
        self._spec = spec = lowering.optimizer_spec(onnx.load(os.fspath(optimizer_uri)))
        group = state._optimizer_group
        self._step, self._lr = (group.step, group.initial_learning_rate) if group else (0, 1e-3)
        self._moments = {}
        for n in names:
            saved = group.optimizer_states.get(n, {}) if group else {}
            self._moments |= {f"{n}.momentum{i}": _ortvalue(saved.get(f"momentum{i}", np.zeros(state._meta[n][1],
                              np.float32))) for i in range(spec.moments)}
        module._weights.add(self._moments, [f"{n}.momentum{i}" for n in names for i in range(spec.updated_moments)])
        # NOTE: the learning rate and the step count after the update, written in place before each run
        self._host = np.zeros(1, np.float32), np.zeros(1, np.int64)
        self._lr_host, self._step_host = map(_ortvalue, self._host)  # NOTE: over the host arrays' memory
        params = [(n, state._meta[n][0], state._meta[n][1]) for n in names]
        # NOTE: one thread: the update is a memory-bound pass; a second thread only waits (2.8x slower on W3
        # on a loaded 2-core machine)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self._update = _session(lowering.update_model(spec, params), _providers(module.device), options)
        # NOTE: the training runs compute the update too (candidates; clipping changes the gradients: not fused)
        self._fused = spec.clip is None
        module._optimizer, state._optimizer, state._candidate = self, self, None
        module._runs.clear()
        module._sessions.clear()
        module._session(True)

    def _inputs(self) -> dict[str, ort.OrtValue]:
        return {"learning_rate": self._lr_host, "step": self._step_host} | self._moments

    def _stage(self) -> None:
        self._host[0][0], self._host[1][0] = self._lr, self._step + 1

    def step(self) -> None:
        """One update of every trained parameter from its accumulated gradient: the candidates of the last
        training run when they were computed from the same state and learning rate, else a run of the update."""
        module = self._module
        module._check_loaded()
        if module._state._candidate != self._lr:
            self._stage()
            module._run("step")({})
            if self._spec.clip is not None:
                module._grads.flip()
        module._weights.flip()
        module._state._candidate = None
        self._step += 1

    def set_learning_rate(self, learning_rate: float) -> None:
        self._lr = float(np.float32(learning_rate))

    def get_learning_rate(self) -> float:
        return self._lr

    def _group(self) -> checkpoint_fbs.OptimizerGroup:
        return checkpoint_fbs.OptimizerGroup(
            "group0", self._step, self._initial_lr if hasattr(self, "_initial_lr") else self._lr,
            {n: {f"momentum{i}": self._moments[f"{n}.momentum{i}"].numpy() for i in range(self._spec.moments)}
             for n in self._module._trained})


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
