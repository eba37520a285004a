"""Data-parallel training on ``torch.distributed``: one replica per rank, gradients all-reduced every step.

``split_step`` compiles the training step in two parts:
- the *gradient* step: forward, loss, backward and penalty on the rank's rows -> the loss and every weight's
  gradient (``GRADS/<weight>``), each written into its slice of one flat buffer;
- the *update* step: clipping, schedule and update rule, compiled by ``compile_train_step`` on a linear model
  whose loss Σₖ ⟨Wₖ, Gₖ⟩ has the flat input G as its exact gradient, and run by a ``Runner`` (weights, state,
  step counter, checkpoints and ``export`` are the ``Runner``'s).
Each step a rank scales its gradients and loss by its share s = c / C of the global batch (c its rows, C the
batch's; with sample weights, their sums: every rank holds the global batch, so s needs no collective), one
all-reduce sums [s·g, s·loss] over the ranks and every rank applies the same update: N ranks with a global
batch B give the weights of one process with batch B, to float rounding. torch is imported only when a
launcher set ``WORLD_SIZE`` or torch is already loaded.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import math
import os
import sys

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as passes
import onnxruntime as ort

from onnxopt.data import as_array, check_batch_size
from onnxopt.dsl import op, update_rule
from onnxopt.errors import ConvergenceError, DataError, ModelError, OnnxoptError
from onnxopt.fuse import compile_train_step
from onnxopt.protocol import Roles
from onnxopt.runner import Runner, _without_values, default_session_options
from onnxopt.step import NEW, TrainStep

__all__ = ["DataParallelRunner", "DistributedError", "split_step", "world", "TIMEOUT"]

GRADS = "optim.grads"
TIMEOUT = float(os.environ.get("ONNXOPT_TIMEOUT", 300))  # NOTE: seconds a collective waits for the other ranks


class DistributedError(OnnxoptError, RuntimeError):
    """A rank died, hung or disagrees with the others (model, step, data schema); training stopped."""


@update_rule
def emit_gradient(w, g, lr):
    """The gradient step's update: its ``W.new`` output is the gradient (penalty included)."""
    return op.Identity(g)


def world() -> tuple[int, int, object]:
    """(rank, world size, torch.distributed) of the process group; (0, 1, None) outside one. Under a launcher
    (``WORLD_SIZE`` set) the group is initialized here when the script has not done it (gloo, ``TIMEOUT``)."""
    if "WORLD_SIZE" not in os.environ and "torch" not in sys.modules:
        return 0, 1, None
    try:
        import torch.distributed as dist
    except ImportError:
        return 0, 1, None
    if not dist.is_available():
        return 0, 1, None
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        import datetime

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
        atexit.register(_leave, dist)
    if not dist.is_initialized():
        return 0, 1, None
    return dist.get_rank(), dist.get_world_size(), dist


def _leave(dist) -> None:
    """Destroys the group ``world`` initialized, at exit while the interpreter is whole. Left to the interpreter's
    teardown, gloo's worker and store threads outlive it: a rank (rank 0, which hosts the store, with a 5 MB buffer
    on W5) then aborted now and then with "terminate called without an active exception" (exit code -6)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _linear(weights: dict[str, np.ndarray], opset: int) -> ir.Model:
    """(G,) -> Σₖ ⟨Wₖ, Gₖ⟩, Gₖ the k-th slice of G shaped like Wₖ: its gradient on Wₖ is Gₖ exactly."""
    dtype = ir.DataType.from_numpy(next(iter(weights.values())).dtype)
    graph = ir.Graph([], [], nodes=[], opset_imports={"": opset}, name="update")
    flat = ir.Value(name=GRADS, type=ir.TensorType(dtype), shape=ir.Shape([sum(a.size for a in weights.values())]))
    graph.inputs.append(flat)
    tape, terms, offset = ir.tape.Tape(graph), [], 0
    const = lambda v: tape.op("Constant", [], {"value": ir.tensor(np.array(v, np.int64))})  # noqa: E731
    for name, a in weights.items():
        w = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(a.shape), const_value=ir.tensor(a))
        graph.register_initializer(w)
        part = tape.op("Slice", [flat, const([offset]), const([offset + a.size]), const([0])])
        terms.append(tape.op("ReduceSum", [tape.op("Mul", [w, tape.op("Reshape", [part, const(a.shape)])])],
                             {"keepdims": 0}))
        offset += a.size
    loss = tape.op("Sum", terms) if len(terms) > 1 else terms[0]
    loss.name = "loss"
    graph.outputs.append(loss)
    return ir.Model(graph, ir_version=10)


def split_step(model, update="sgd", learning_rate=1e-2, **kwargs) -> tuple[TrainStep, TrainStep]:
    """(gradient step, update step) of ``compile_train_step(model, update=..., learning_rate=..., **kwargs)``."""
    from onnxopt.resolve import resolve_loss

    loss = kwargs.get("loss", "square")
    if loss is not None and resolve_loss(loss).reduction == "sum":  # NOTE: ranks weigh their gradients as means
        raise ModelError(f"loss: data-parallel training averages per-rank means; expected a mean reduction, got "
                         f"{resolve_loss(loss).name!r} with reduction='sum'")
    grad = compile_train_step(model, update=emit_gradient, learning_rate=1.0, **kwargs)
    if grad.buffers or grad.output_grad:
        raise ModelError(f"model: data-parallel training needs a step without running statistics or external "
                         f"gradient, got buffers {grad.buffers} (use mode='eval' for BatchNormalization)")
    m = ir.from_proto(grad.model)
    outs = {v.name: v for v in m.graph.outputs}
    tape, grads = ir.tape.Tape(m.graph), []
    for w in grad.weights:  # NOTE: one output per weight, each bound to its slice of the flat buffer: no Concat
        value = outs[w + NEW]
        if value in grads or value.producer() is None:
            value = tape.op("Identity", [value])
        value.name = f"{GRADS}/{w}"
        grads.append(value)
    m.graph.outputs.clear()
    m.graph.outputs.extend([outs[grad.loss], *grads])
    passes.RemoveUnusedNodesPass()(m)
    for value in [v for v in m.graph.inputs if not v.uses()]:
        m.graph.inputs.remove(value)
    grad = dataclasses.replace(grad, model=ir.to_proto(m), state=[])
    upd = compile_train_step(_linear(grad.initial_weights(), m.opset_imports[""]), loss=None, loss_output="loss",
                             update=update, learning_rate=learning_rate)
    return grad, dataclasses.replace(upd, model=_lean(upd.model), inference=grad.inference)


def _ones(value: ir.Value) -> tuple[int, ...] | None:
    """The shape of ``value`` when it is a constant of ones or the ``Expand`` of one to a constant shape."""
    const = lambda v: ir.convenience.get_const_tensor(v)  # noqa: E731
    node, tensor = value.producer(), const(value)
    if tensor is None and node is not None and node.op_type == "Expand" and None not in map(const, node.inputs):
        source, shape = (const(v).numpy() for v in node.inputs)
        return np.broadcast_shapes(source.shape, tuple(shape.tolist())) if np.all(source == 1) else None
    return tensor.numpy().shape if tensor is not None and np.all(tensor.numpy() == 1) else None


def _lean(proto):
    """The update step without the linear model's own work: its loss (Σₖ ⟨Wₖ, Gₖ⟩, never read: the ranks'
    loss rides in the all-reduced buffer) becomes a constant 0, and each gradient ``ones · Gₖ`` (the backward of
    the sum) is ``Gₖ`` itself: two passes over every weight fewer per step."""
    m = ir.from_proto(proto)
    for node in list(m.graph):
        if node.op_type != "Mul":
            continue
        out = node.outputs[0]
        for one, other in (node.inputs, node.inputs[::-1]):
            shape = _ones(one)
            if shape is None or other.shape is None or not other.shape.is_static() or out in m.graph.outputs:
                continue
            dims = tuple(other.shape.numpy())
            if np.broadcast_shapes(shape, dims) == dims and (other.dtype is None or other.dtype == out.dtype):
                ir.convenience.replace_all_uses_with(out, other)
                break
    loss = next(v for v in m.graph.outputs if v.name == "loss")
    zero = ir.node("Constant", [], {"value": ir.tensor(np.zeros((), loss.dtype.numpy()))}, num_outputs=1)
    m.graph.append(zero)
    loss.name, zero.outputs[0].name = "loss.unread", "loss"
    zero.outputs[0].type, zero.outputs[0].shape = loss.type, ir.Shape([])
    m.graph.outputs[m.graph.outputs.index(loss)] = zero.outputs[0]
    passes.RemoveUnusedNodesPass()(m)
    passes.TopologicalSortPass()(m)
    return ir.to_proto(m)


class DataParallelRunner:
    """A ``Runner`` for one rank: ``step``/``epoch`` take the *global* batch and train this rank's rows of it.

    Rank r of N trains rows [n·r/N, n·(r+1)/N) of each batch of n rows. Weights, state, ``export`` and the rest
    of the ``Runner`` API come from the update step's Runner (``updater``); rank 0 alone writes checkpoints.
    """

    def __init__(self, grad: TrainStep, update: TrainStep, device: str = "cpu", batch_size: int = 32,
                 session_options: ort.SessionOptions | None = None):
        if device != "cpu":
            raise DataError(f"device: data-parallel training runs on 'cpu' (gloo) so far, got {device!r}; "
                            "docs/tutorials/distributed.md describes the CUDA (NCCL) design")
        self.rank, self.world, self._dist = world()
        self.train_step, self.device, self.batch_size = grad, device, batch_size
        self._roles = Roles.of(grad)  # NOTE: the gradient step's names by role, from its protocol
        weights = grad.initial_weights()
        self._size = sum(a.size for a in weights.values())
        self._grad_shapes = {name: weights[name].shape for name in self._roles.weights}  # NOTE: the flat buffer's order
        cores = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))

        def options(rows: int) -> ort.SessionOptions:  # NOTE: ORT's default pool capped to the cores of a local rank
            opts = session_options or default_session_options(self._size, rows)
            if session_options is None and opts.intra_op_num_threads == 0:
                opts.intra_op_num_threads = cores
            return opts

        self.updater = Runner(update, device, session_options=options(1), batch_size=1)
        self.session = ort.InferenceSession(_without_values(grad.model, weights),
                                            options(max(1, batch_size // self.world)), providers=["CPUExecutionProvider"])
        types = {i.name: i.type for i in self.session.get_inputs()}
        self.x_dtype = _numpy(types[grad.inputs[0]])
        self._y_dtype = _numpy(types[grad.target]) if grad.target else None
        self._buffer = np.zeros(self._size + 1, self.updater.dtype)  # NOTE: [Σ s·g, Σ s·loss], all-reduced
        if self._dist is not None:  # NOTE: torch owns the memory (numpy and ORT read it): freeing the tensor in a
            import torch  # gloo thread needs no GIL, which a tensor over a numpy array's memory would take

            self._tensor = torch.zeros(self._buffer.shape, dtype=getattr(torch, self._buffer.dtype.name))
            self._buffer = self._tensor.numpy()
        self._loss = np.zeros((), self.updater.dtype)
        self._ones_cache = np.ones(0, self.updater.dtype)
        self._bindings: dict[int, ort.IOBinding] = {}
        self._checked = False
        digest = hashlib.sha256(grad.model.SerializeToString() + update.model.SerializeToString()).hexdigest()
        self._agree("the compiled steps (model, loss, update, options)", digest[:16])

    @property
    def roles(self) -> Roles:
        """The gradient step's names by role, from its protocol (the update step's: ``updater.roles``)."""
        return self._roles

    def __getattr__(self, name: str):  # NOTE: get_weights, set_weights, export, dtype, step_count... of the updater
        if name == "updater":
            raise AttributeError(name)
        return getattr(self.updater, name)

    def _agree(self, what: str, value) -> None:
        """Raises DistributedError on every rank unless all ranks hold the same ``value``."""
        if self._dist is None:
            return
        values = [None] * self.world
        self._collective(lambda: self._dist.all_gather_object(values, value), f"comparing {what}")
        differ = [r for r, v in enumerate(values) if v != values[0]]
        if differ:
            raise DistributedError(f"ranks disagree on {what}: rank 0 has {values[0]!r}, rank {differ[0]} has "
                                   f"{values[differ[0]]!r}; every rank must run the same model, options and data "
                                   "schema")

    def _collective(self, call, what: str) -> None:
        try:
            call()
        except (RuntimeError, ValueError) as exc:
            raise DistributedError(
                f"rank {self.rank} of {self.world}: {what} failed at step {self.updater.step_count + 1}: another rank "
                f"died or hung (timeout {TIMEOUT:.0f} s, ONNXOPT_TIMEOUT); the last complete checkpoint stays "
                f"loadable ({str(exc).splitlines()[0][:200]})") from exc

    def _ones(self, rows: int) -> np.ndarray:
        """Sample weights of ones for ``rows`` rows (kept: the batches of an epoch share one)."""
        if len(self._ones_cache) != rows:
            self._ones_cache = np.ones(rows, self.updater.dtype)
        return self._ones_cache

    def _binding(self) -> ort.IOBinding:
        """The gradient session's binding reading the updater's current weights (one per buffer set)."""
        key = self.updater._ring.current
        if key not in self._bindings:
            binding = self.session.io_binding()
            for name, value in self.updater.current_values().items():
                if name in self._roles.weights:
                    binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(self._roles.loss, ort.OrtValue.ortvalue_from_numpy(self._loss))
            offset = 0
            for name, shape in self._grad_shapes.items():
                size = int(np.prod(shape))
                view = self._buffer[offset:offset + size].reshape(shape)
                binding.bind_ortvalue_output(f"{GRADS}/{name}", ort.OrtValue.ortvalue_from_numpy(view))
                offset += size
            self._bindings[key] = binding
        return self._bindings[key]

    def step(self, X, y=None, sample_weight=None) -> float:
        """One step on the global batch (X, y, sample_weight): this rank's rows, the all-reduce, the update."""
        X = as_array(X, self.x_dtype, "X")
        n, step = len(X), self.train_step
        if not self._checked:  # NOTE: once: schemas and the step counter (a resume from another checkpoint)
            shape = lambda a: None if a is None else (np.shape(a)[1:], str(np.asarray(a).dtype))  # noqa: E731
            self._agree("the data schema and step count (X, y, sample_weight, batch rows, steps done)",
                        (shape(X), shape(y), shape(sample_weight), n, self.updater.step_count))
            self._checked = True
        lo, hi = n * self.rank // self.world, n * (self.rank + 1) // self.world
        if sample_weight is None:
            sw, weight, total = None, hi - lo, n
        else:  # NOTE: every rank holds the global batch's weights: its share needs no collective
            sw = as_array(sample_weight, self.updater.dtype, "sample_weight")
            weight, total = float(sw[lo:hi].sum(dtype=np.float64)), float(sw.sum(dtype=np.float64))
            sw = sw[lo:hi]
        share = weight / total if total else math.nan  # NOTE: 1 on one rank: no pass over the gradients
        buf = self._buffer
        if weight > 0:
            binding = self._binding()
            target = None if y is None else as_array(y, self._y_dtype, "y")[lo:hi]
            roles = self._roles
            feeds = {roles.data[0]: X[lo:hi], roles.target: target,
                     roles.sample_weight: self._ones(hi - lo) if sw is None else sw}
            for name, value in feeds.items():
                if name is not None:
                    binding.bind_cpu_input(name, np.ascontiguousarray(value))
            self.session.run_with_iobinding(binding)
            if share != 1:
                np.multiply(buf[:self._size], share, out=buf[:self._size])
            buf[self._size] = float(self._loss) * share
        else:
            buf[:] = 0
        if self._dist is not None:
            self._collective(lambda: self._dist.all_reduce(self._tensor), "the gradient all-reduce")
        loss = float(buf[self._size])
        if not math.isfinite(loss):
            raise ConvergenceError(f"loss became {loss} at step {self.updater.step_count + 1}; the weights are "
                                   f"those that gave the last finite loss (step {self.updater.step_count}), see "
                                   "get_weights()")
        self.updater.step(buf[:self._size])
        return loss

    def epoch(self, X, y=None, sample_weight=None, batch_size: int | None = None) -> np.ndarray:
        """``step`` over the global batches of ``X`` in order (``batch_size`` rows each); returns their losses."""
        n = len(X)
        batch = check_batch_size(self.batch_size if batch_size is None else batch_size, max(n, 1))
        part = lambda a, i: None if a is None else a[i:i + batch]  # noqa: E731
        losses = []
        for k, i in enumerate(range(0, n, batch)):
            try:
                losses.append(self.step(X[i:i + batch], part(y, i), part(sample_weight, i)))
            except ConvergenceError as exc:
                raise ConvergenceError(f"batch {k + 1}: {exc}") from exc
        return np.asarray(losses, np.float64)

    def save_checkpoint(self, path, meta=None) -> None:
        """The updater's checkpoint, written by rank 0 alone."""
        if self.rank == 0:
            self.updater.save_checkpoint(path, {**(meta or {}), "world_size": self.world})

    def load_checkpoint(self, path, kind: str | None = None) -> dict:
        """The updater's ``load_checkpoint`` on every rank (any world size: the weights are the same)."""
        self._checked = False
        return self.updater.load_checkpoint(path, kind)


def _numpy(onnx_type: str):
    types = {"tensor(int64)": np.int64, "tensor(double)": np.float64, "tensor(int32)": np.int32}
    return types.get(onnx_type, np.float32)
