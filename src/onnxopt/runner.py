"""``Runner``: executes a fused train step, one session run per step or epoch, weights never leaving ORT.

Weights and optimizer state live as OrtValues in three buffer sets; binding k reads set k and writes set
k+1 (mod 3), all bound once. A step binds only the batch. A failed or diverging step never touches its
inputs, and the set before them still holds the weights that gave the last finite loss. On CPU the packs of a
multi-tensor update (``passes.update.flat_carry``) are one buffer per set, the weights bound as views of theirs,
and the loss's per-batch bookkeeping is specialized away (``passes.batch``, see ``cpu_model``).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import threading
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnxruntime.capi import _pybind_state as C

from onnxopt.data import as_array, check_batch_size, check_class_indices
from onnxopt.errors import CheckpointError, ConvergenceError, DataError, ModelError, NotDifferentiableError
from onnxopt.modelio import require_cuda
from onnxopt.passes.batch import (drop_same_shape_reshapes, hoist, masked_relu_grads, row_sum_updates, shaped_target,
                                  summed_rows)
from onnxopt.passes.epoch import CHECK, COUNT, LAST, PREFIX, epoch_model, scannable
from onnxopt.passes.update import PACK_WEIGHTS, flat_carry
from onnxopt.step import NEW, STEP, TrainStep
from onnxopt.stream import as_stream, blocks, prefetch

# NOTE: stock onnxruntime (1.32) removes a Dropout whose mask nothing reads, training_mode true or not: a step
# whose gradient does not pass the Dropout (weights before it frozen) would train on one mask for ever
KEEP_DROPOUT = ["EliminateDropout"]
__all__ = ["Runner", "default_session_options", "step_work", "cpu_model"]

logger = logging.getLogger(__name__)
_N_SETS = 3
_HISTORY = 1024  # NOTE: deferred losses kept on the device before an automatic sync
_HOST = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
# NOTE: a batch array up to this size is copied into a host buffer its binding holds (0.1-0.8 µs) rather than
# wrapped in a new OrtValue and bound (1.1 µs): measured with numpy 2.4 and onnxruntime 1.19
_COPIED = 32 * 1024
# NOTE: parameters × batch below which a step does little work: one thread, and epochs as one Scan run (whose
# second session would cost memory and save nothing on longer steps)
SMALL_STEP = 1_000_000
# NOTE: the step's session is specialized for batches of at most this many rows: onnxruntime folds per-row
# constants (sample weights' ones) at that length, and a larger batch gains nothing from fixed shapes
MAX_SPECIALIZED_ROWS = 1 << 16


def step_work(step: TrainStep, weights: Mapping[str, np.ndarray] | None = None) -> int:
    """The work per sample that decides a step's threads: its parameters, a convolution's counted once per
    position of the input's static spatial grid (a CNN has few weights and much work: R1, 3x32x32 images,
    trains 1.8x faster on 2 threads than on the one its 30k parameters alone would get). ``weights``: the
    step's initial weights when the caller holds them already."""
    model, weights = step.model, step.initial_weights() if weights is None else weights
    dims = next((list(i.type.tensor_type.shape.dim) for i in model.graph.input if i.name == step.inputs[0]), [])
    grid = math.prod(d.dim_value if d.HasField("dim_value") else 1 for d in dims[2:])
    conv = {n.input[1] for n in model.graph.node if n.op_type in ("Conv", "ConvTranspose") and len(n.input) > 1}
    return sum(a.size * (grid if name in conv else 1) for name, a in weights.items() if name in step.weights)


FIXED_BATCH = ("the model takes batches of exactly {rows} rows: the first dimension of its input {name!r} is "
               "fixed (torch.onnx.export fixes it without dynamic_shapes= or dynamic_axes=); export it with a "
               "dynamic batch axis, e.g. dynamic_shapes={{'x': {{0: torch.export.Dim('batch')}}}}")


def fixed_rows(step: TrainStep) -> int | None:
    """The rows every batch must have when the step's input has a fixed first dimension (a model exported
    without a dynamic batch axis), else None."""
    x = next(i for i in step.model.graph.input if i.name == step.inputs[0])
    t = x.type.tensor_type
    if not t.HasField("shape") or not t.shape.dim or not t.shape.dim[0].HasField("dim_value"):
        return None
    return t.shape.dim[0].dim_value


def default_session_options(n_parameters: int, batch_size: int = 32, spinning: bool = True) -> ort.SessionOptions:
    """Options for training graphs: one thread when a step does little work (``n_parameters`` × batch below 1M,
    where handing work to a second thread costs more than it saves; ``step_work`` counts a step's), ORT's
    default pool above. Without
    ``spinning`` the pool's threads sleep between ops instead of spinning: for a process whose other threads
    need the cores (a streamed fit's reader).

    Measured on 2 cores: 2 threads gain 20% from about 1.4M (MLP 100-50-10-1, batch 256) and 35% on
    784-512-512-10 at batch 128; at 84k (the seeds' MLP, batch 15) one thread is faster.
    """
    opts = ort.SessionOptions()
    # NOTE: fatal only: ORT warns that weights are overridable initializers (by design) and logs every
    # refused batch as an error, which Runner.step already raises as a DataError
    opts.log_severity_level = 4
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if n_parameters * batch_size < SMALL_STEP:
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
    if not spinning:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


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


class CpuModel(NamedTuple):
    """What the Runner runs on CPU (``cpu_model``): ``model``, its packs, and how a batch is fed to it."""

    model: onnx.ModelProto
    packs: dict[str, list[str]]
    side: bytes | None  # NOTE: computes the ``hoisted`` inputs from the sample weights
    hoisted: list[str]
    weighted: bytes | None  # NOTE: with hoisted inputs, the model (sample weights kept) for weighted batches
    weight_kept: bool  # NOTE: whether the sample weights are still an input of ``model``
    target_shape: tuple[int, ...] | None  # NOTE: the target is fed as (rows, *target_shape)
    rows: tuple[str, ...] = ()  # NOTE: vectors ``model`` reads and writes as (1, n) rows (``row_sum_updates``)


def cpu_model(step: TrainStep, batch_size: int = 32, threads: int = 1) -> CpuModel:
    """``step.model`` with the packs as inputs and outputs (``flat_carry``), the values computed from the sample
    weights alone as inputs (``hoist``: the Runner computes them once per batch length when none are given;
    ``weighted`` keeps them for batches with sample weights) and the target shaped like the prediction
    (``shaped_target``); their reshapes then go. SGD on a bias becomes one ``Gemm`` with a ones row
    (``row_sum_updates``), ``ReluGrad`` a masked product (``dy · HardSigmoid(y·2²², alpha=2¹²⁷)`` where
    ``batch_size`` rows make it large, else ``dy · Sign(y)``: ``masked_relu_grads``), and for a session on
    ``threads`` > 1 the other sums over a matrix's rows (bias gradients) ``ones · g`` (``summed_rows``)."""
    model = ir.from_proto(step.model)
    for name in [*step.weights, *step.buffers]:  # NOTE: always bound: the copies made below need not hold them
        model.graph.initializers.pop(name, None)
    packs = flat_carry(model)
    side, hoisted, kept, target_shape, weighted, rows = None, [], True, None, None, []
    inputs = {v.name: v for v in model.graph.inputs}
    first = inputs[step.inputs[0]].shape
    batch = first[0].value if first is not None and len(first) and isinstance(first[0], ir.SymbolicDim) else None
    if step.target is not None and step.target_kind == "float" and batch is not None:
        target_shape = shaped_target(model, step.target, batch)
    if step.sample_weight is not None:
        rows = row_sum_updates(model, step.sample_weight)
    unhoisted = ir.to_proto(model) if step.sample_weight is not None else None
    found = hoist(model, step.sample_weight) if step.sample_weight is not None else None
    if found is not None:
        proto, kept, weighted = found[0], bool(found[1]), unhoisted.SerializeToString()
        side = proto.SerializeToString()
        sess = ort.InferenceSession(side, providers=["CPUExecutionProvider"])
        hoisted = [o.name for o in sess.get_outputs()]
        dtype = inputs[step.sample_weight].dtype.numpy()
        # NOTE: shapes found by running it at two batch lengths: a dimension following the length is the batch's
        two, three = (sess.run(None, {step.sample_weight: np.ones(n, dtype)}) for n in (2, 3))
        for name, a, b in zip(hoisted, two, three):
            dims = [batch if (p, q) == (2, 3) else (p if p == q else None) for p, q in zip(a.shape, b.shape)]
            next(v for v in model.graph.inputs if v.name == name).shape = ir.Shape(dims)
    if found is not None or target_shape is not None:
        drop_same_shape_reshapes(model)
    rewritten = masked_relu_grads(model, batch_size) + (summed_rows(model) if threads > 1 else 0)
    changed = packs or found is not None or target_shape is not None or rewritten or rows
    return CpuModel(ir.to_proto(model) if changed else step.model, packs, side, hoisted, weighted, kept,
                    target_shape, tuple(rows))


_NO_KERNEL = re.compile(r"Could not find an implementation for (\w+)\(\d+\) node with name '(([^']*?)_Grad/[^']*)'")


def _missing_kernel(exc: Exception, model: onnx.ModelProto, device: str) -> NotDifferentiableError | None:
    """onnxruntime's "no implementation" for a gradient node, as an error naming the forward op and node."""
    found = _NO_KERNEL.search(str(exc))
    if found is None:
        return None
    grad_op, grad_node, name = found.groups()
    op = next((n.op_type for n in model.graph.node if n.name == name), "?")
    return NotDifferentiableError(
        f"{op} node {name!r}: onnxruntime-training has no {device} kernel for its gradient {grad_op} (node "
        f"{grad_node!r}); onnxopt rewrites {op} into differentiable ops only in the forms docs/ops.md lists "
        f"(for Resize: constant scales or sizes on static axes), change the model to one of them", [(op, name)])


def several_inputs(names: list[str]) -> ModelError:
    """The error for a model with more than one data input: Runner, Trainer and the CLI feed one."""
    return ModelError(f"model: it reads {len(names)} data inputs {list(names)}; Runner, Trainer and onnxopt fit feed "
                      f"one (X): export the model with its inputs in one tensor (concatenate them and split them in "
                      f"forward), or run the compiled step.model in an onnxruntime session that feeds every input")


def _contradicted_shapes(exc: Exception) -> ModelError | None:
    """onnxruntime's shape inference refusing the step: a model whose declared output or value shapes its own
    graph contradicts (skl2onnx's multilabel MLPClassifier declares (N, labels) probabilities and computes
    (N, 2·labels)), as an error saying so instead of onnxruntime's bare ``Fail``."""
    text = str(exc)
    if "ShapeInferenceError" not in text:
        return None
    return ModelError(f"model: onnxruntime cannot load the training step: {text.strip()}; the model's declared "
                      f"shapes (of its outputs or values) contradict what its nodes compute, check them with "
                      f"onnx.shape_inference.infer_shapes(model, strict_mode=True) (skl2onnx's multilabel "
                      f"MLPClassifier is one such model: its probabilities are declared (N, labels) and computed "
                      f"(N, 2·labels))")


def _locked(method: Callable) -> Callable:
    """``method`` run holding the runner's lock: threads sharing a runner take turns, each step whole."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class Runner:
    """Runs ``step`` (a ``TrainStep`` or a path to one) on ``device`` ("cpu" or "cuda").

    ``session_options`` overrides ``default_session_options`` (threads, optimization level), which
    ``batch_size`` (the usual batch length) tunes; the step's session is made for batches of that length
    (the batch axis fixed, up to ``MAX_SPECIALIZED_ROWS``), another length runs a second session made on first
    use. A runner may be shared between threads: its public methods hold a lock, so concurrent steps run one
    after the other and none is lost.
    """

    def __init__(self, step: TrainStep | str | os.PathLike, device: str = "cpu",
                 session_options: ort.SessionOptions | None = None, batch_size: int = 32):
        self._lock = threading.RLock()  # NOTE: reentrant: epoch calls step, save_checkpoint get_weights
        self.train_step = step if isinstance(step, TrainStep) else TrainStep.load(step)
        if len(self.train_step.inputs) > 1:  # NOTE: step() feeds X to inputs[0]; the others would be missing
            raise several_inputs(self.train_step.inputs)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
        if device == "cuda":
            require_cuda("device")
        self.device = device
        self._device = C.OrtDevice(C.OrtDevice.cuda() if device == "cuda" else C.OrtDevice.cpu(),
                                   C.OrtDevice.default_memory(), 0)
        # NOTE: running statistics (mode="train") start from the model's values, like the weights
        initial = {**self.train_step.initial_weights(), **self.train_step.initial_buffers()}
        self.dtype = next(iter(initial.values())).dtype
        self._size = sum(a.size for a in initial.values())
        opts = session_options or default_session_options(step_work(self.train_step, initial), batch_size)
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
        # NOTE: packs are host buffers whose members are bound as numpy views, hoisted values host arrays (CPU only)
        threads = opts.intra_op_num_threads or os.cpu_count() or 1  # NOTE: 0 is ORT's default: one per core
        cpu = cpu_model(self.train_step, batch_size, threads) if device == "cpu" else None
        model, self._packs = (cpu.model, cpu.packs) if cpu else (self.train_step.model, {})
        self._side, self._weighted, self._opts = None, cpu.weighted if cpu else None, opts
        self._hoisted, self._w_kept, self._y_shape = \
            (cpu.hoisted, cpu.weight_kept, cpu.target_shape) if cpu else ([], True, None)
        self._y_rows = (-1, *self._y_shape) if self._y_shape is not None else None
        if cpu is not None and cpu.side is not None:
            side_opts = ort.SessionOptions()
            side_opts.intra_op_num_threads, side_opts.log_severity_level = 1, 4
            self._side = ort.InferenceSession(cpu.side, side_opts, providers=["CPUExecutionProvider"])
        stripped, self.batch_size, self._epoch, self._loop_io = _without_values(model, initial), batch_size, None, {}
        self._loop_bound: list[tuple | None] = [None] * _N_SETS  # NOTE: per epoch binding: (steps, batch) it holds
        self._cpu = stripped if cpu and scannable(model) else None  # NOTE: the epoch model's body, made when used
        # NOTE: the step's session runs batches of ``batch_size`` rows; other lengths run on the model as compiled.
        # Only for steps that epochs run one by one: a small step's epoch is one Scan run (its own session), its
        # step session then runs the short last batch, and a second session would cost more than it saves
        rows = batch_size if type(batch_size) is int and 0 < batch_size <= MAX_SPECIALIZED_ROWS and (
            self._cpu is None or self._size * batch_size >= SMALL_STEP) else None  # NOTE: bad sizes fail later
        fixed = _without_values(model, initial, self.train_step.inputs[0], rows) if rows else None
        self._fixed_rows, self._free, self._extra = (batch_size if fixed else None), stripped, {}
        self._providers = providers
        try:
            self.session = None
            if fixed:  # NOTE: a graph whose shapes contradict the batch length fails at run time, as compiled
                try:
                    self.session = ort.InferenceSession(fixed, opts, providers=providers,
                                                        disabled_optimizers=KEEP_DROPOUT)
                except Exception:  # noqa: BLE001  (the session as compiled says what is wrong, if anything)
                    self._fixed_rows = None
            if self.session is None:
                self.session = ort.InferenceSession(stripped, opts, providers=providers,
                                                    disabled_optimizers=KEEP_DROPOUT)
        except Exception as exc:
            raise _missing_kernel(exc, self.train_step.model, device) or _contradicted_shapes(exc) or exc
        # NOTE: as the step declares them (the session's target and sample weights may be specialized, cpu_model)
        self._input_types = {i.name: i.type.tensor_type for i in self.train_step.model.graph.input}
        self._carried = [*self.train_step.weights, *self.train_step.buffers, *self.train_step.state]
        members = {m for names in self._packs.values() for m in names}
        # NOTE: what the session reads and writes: packs and unpacked tensors; packed weights are read as views
        self._bound = [*self._packs, *(n for n in self._carried if n not in members)]
        taken = {i.name for i in model.graph.input}  # NOTE: a step without a forward pass (distributed's update)
        self._views = [n for n in self._packs.get(PACK_WEIGHTS, []) if n in taken]  # reads only the pack
        # NOTE: per set, its host buffers: the packs' memory (their OrtValues and views do not own it) and the rest
        self._hosts: list[list[np.ndarray]] = []
        self._rows = cpu.rows if cpu else ()
        self._row_sets: list[dict[str, ort.OrtValue]] = []  # NOTE: per set, (1, n) views of the ``_rows`` vectors
        self._sets = [self._zeros_like(initial) for _ in range(_N_SETS)]
        self.set_weights(initial, _all_sets=True)
        self._bindings = [self._bind(k) for k in range(_N_SETS)]
        self._raw = [b._iobinding for b in self._bindings]  # NOTE: the C binding: no wrapper call per step
        # NOTE: the loss is written into host arrays: reading it is a memory read, not an ORT call
        self._loss_host = [np.zeros((), self.dtype) for _ in range(_N_SETS)]
        self._loss_values = [C.OrtValue.ortvalue_from_numpy(a, _HOST) for a in self._loss_host]
        for raw, value in zip(self._raw, self._loss_values):
            raw.bind_ortvalue_output(self.train_step.loss, value)
        self._history = ort.OrtValue.ortvalue_from_shape_and_type([_HISTORY], self.dtype, device, 0)
        self._history_host = np.zeros(_HISTORY, self.dtype)  # NOTE: on CPU, deferred losses are copied here
        self._pending = 0  # NOTE: deferred steps whose loss sits in _history, not read yet
        self._synced: list[np.ndarray] = []  # NOTE: losses read by automatic syncs; the next sync() returns them
        self._snapshot: dict[str, np.ndarray] | None = None
        self._current = 0
        self._previous_valid = False
        self._ones: dict[int, tuple] = {}  # NOTE: per batch length: the OrtValues fed for all-ones sample weights
        self._fed: dict[tuple[int, str], np.ndarray] = {}  # NOTE: (binding, input): the host buffer it holds (_feed)
        self._bound_ones: dict[int, tuple | None] = {}  # NOTE: per binding (id): the ones it holds as sample weights
        self._x_name, self._y_name, self._w_name = self.train_step.inputs[0], self.train_step.target, self.train_step.sample_weight
        self._y_dtype = np.int64 if self.train_step.target_kind == "index" else self.dtype
        # NOTE: X keeps the model input's own type (int64 tokens for an Embedding), not the weights'
        self.x_dtype = ir.DataType(self._input_types[self._x_name].elem_type).numpy()
        self.n_runs = 0

    # -- buffers -----------------------------------------------------------------------------------------
    def _zeros_like(self, initial: Mapping[str, np.ndarray]) -> dict[str, ort.OrtValue]:
        arrays, hosts = {}, []  # NOTE: each tensor's host memory: its own array, or a view of its pack's
        for pack, names in self._packs.items():  # NOTE: one flat buffer per pack, each member a view of it
            shapes = [initial[n if n in initial else n.rsplit(".", 1)[0]].shape for n in names]
            flat = np.zeros(sum(int(np.prod(sh)) for sh in shapes), self.dtype)
            hosts.append(flat)
            arrays[pack] = flat
            offset = 0
            for name, shape in zip(names, shapes):
                size = int(np.prod(shape))
                arrays[name] = flat[offset:offset + size].reshape(shape)
                offset += size
        for name in self._carried:
            if name in arrays:
                continue
            if name == STEP:
                arr = np.zeros((), np.int64)
            else:
                arr = np.zeros_like(initial[name if name in initial else name.rsplit(".", 1)[0]])
            hosts.append(arr)
            arrays[name] = arr
        self._hosts.append(hosts)  # NOTE: on CPU the OrtValues wrap these arrays
        value = lambda a: ort.OrtValue.ortvalue_from_numpy(a, self.device, 0)  # noqa: E731
        self._row_sets.append({name: value(arrays[name].reshape(1, -1)) for name in self._rows})
        return {name: value(a) for name, a in arrays.items()}

    def _bound_value(self, k: int, name: str) -> C.OrtValue:
        """The OrtValue of set ``k`` bound for ``name``: a (1, n) view for a vector the model reads as a row."""
        return self._row_sets[k].get(name, self._sets[k][name])._ortvalue

    def _bind(self, k: int, session: ort.InferenceSession | None = None) -> ort.IOBinding:
        binding = (session or self.session).io_binding()
        raw = binding._iobinding
        for name in self._bound:
            raw.bind_ortvalue_input(name, self._bound_value(k, name))
            raw.bind_ortvalue_output(name + NEW, self._bound_value((k + 1) % _N_SETS, name))
        for name in self._views:
            raw.bind_ortvalue_input(name, self._bound_value(k, name))
        return binding

    # -- training ----------------------------------------------------------------------------------------
    @staticmethod
    def _array(arr, dtype, name: str) -> np.ndarray:
        """``arr`` itself when it is a C-contiguous array of ``dtype`` (the common case, checked first), else
        ``as_array``'s checked conversion."""
        if type(arr) is not np.ndarray or arr.dtype != dtype or not arr.flags.c_contiguous:
            arr = as_array(arr, dtype, name)
        return arr

    def _feed(self, raw, name: str, arr: np.ndarray) -> None:
        """Binds ``arr`` as input ``name`` of ``raw``: on CPU a small one is copied into a buffer of its shape that
        the binding holds (bound once while batches keep that shape), a larger one is bound where it lies."""
        key = (id(raw), name)
        if self.device != "cpu" or arr.nbytes > _COPIED:
            self._fed.pop(key, None)
            raw.bind_ortvalue_input(name, C.OrtValue.ortvalue_from_numpy(arr, self._device))
            return
        buf = self._fed.get(key)
        if buf is None or buf.shape != arr.shape or buf.dtype != arr.dtype:
            buf = self._fed[key] = np.empty_like(arr)
            raw.bind_ortvalue_input(name, C.OrtValue.ortvalue_from_numpy(buf, self._device))
        buf[...] = arr

    def _value(self, arr, dtype, name: str) -> tuple[C.OrtValue, np.ndarray]:
        """An OrtValue over ``arr`` and the array it reads (no copy on CPU for a C-contiguous array of the dtype)."""
        arr = self._array(arr, dtype, name)
        return C.OrtValue.ortvalue_from_numpy(arr, self._device), arr

    def _weight_values(self, w: np.ndarray) -> tuple[list[tuple[str, C.OrtValue]], list[np.ndarray]]:
        """(name, OrtValue) pairs fed for all-ones sample weights ``w`` (``hoist``) and the arrays they read."""
        named = dict(zip(self._hoisted, self._side.run(None, {self._w_name: w}))) if self._side is not None else {}
        if self._w_kept:
            named[self._w_name] = w
        return [(k, C.OrtValue.ortvalue_from_numpy(a, self._device)) for k, a in named.items()], [w, *named.values()]

    def _bindings_of(self, model: bytes) -> tuple[C.InferenceSession, list]:
        """A second session over ``model`` and its bindings, one per buffer set (made once per model): for
        batches given sample weights (``CpuModel.weighted``) or of another length than ``batch_size``."""
        made = self._extra.get(id(model))
        if made is None:
            session = ort.InferenceSession(model, self._opts, providers=self._providers,
                                           disabled_optimizers=KEEP_DROPOUT)
            bindings = [self._bind(k, session) for k in range(_N_SETS)]
            for binding, value in zip(bindings, self._loss_values):
                binding._iobinding.bind_ortvalue_output(self.train_step.loss, value)
            made = self._extra[id(model)] = (session, bindings, session._sess, [b._iobinding for b in bindings])
        return made[2], made[3]

    def step(self, X, y=None, sample_weight=None, read_loss: bool = True, output_grad=None) -> float | None:
        """One fused run on a batch; returns the loss. Raises ConvergenceError, keeping the last good weights.

        With ``read_loss=False`` the loss stays on the device (no sync on CUDA) and None is returned;
        ``sync()`` later reads every pending loss at once and checks them. ``output_grad`` feeds the
        ``<output>.grad`` input of a step compiled with ``external_grad=True``.
        """
        with self._lock:  # NOTE: inline, not @_locked: the wrapper's *args call costs ~1 µs a step
            return self._step(X, y, sample_weight, read_loss, output_grad)

    def _step(self, X, y, sample_weight, read_loss: bool, output_grad) -> float | None:
        X = self._array(X, self.x_dtype, "X")
        if not X.ndim or not X.shape[0]:  # NOTE: onnxruntime >= 1.20 runs an empty batch (a NaN or 0 loss)
            raise DataError(f"X: expected at least one sample, got shape {X.shape}")
        if sample_weight is not None and self._weighted is not None:  # NOTE: a session keeping sample weights
            sess, raws = self._bindings_of(self._weighted)
        elif self._fixed_rows is not None and X.shape[0] != self._fixed_rows:
            sess, raws = self._bindings_of(self._free)
        else:
            sess, raws = self.session._sess, self._raw
        raw = raws[self._current]
        self._feed(raw, self._x_name, X)
        keep = [X]  # NOTE: OrtValues over numpy memory do not own it: keep the arrays alive until the run ends
        if self._y_name is not None:
            arr = self._target(y, X)
            self._feed(raw, self._y_name, arr)
            keep.append(arr)
        if self._w_name is not None:
            if sample_weight is None:  # NOTE: unweighted batches share one ones-OrtValue per batch length
                n = X.shape[0] if X.ndim else 0
                ones = self._ones.get(n)
                if ones is None:
                    ones = self._ones[n] = self._weight_values(np.ones(n, self.dtype))
                if self._bound_ones.get(id(raw)) is not ones:  # NOTE: a bind costs ~0.6 µs, a step ~25 µs
                    for name, value in ones[0]:
                        raw.bind_ortvalue_input(name, value)
                    self._bound_ones[id(raw)] = ones
                keep.append(ones[1][0])
            else:
                self._bound_ones[id(raw)] = None
                arr = self._sample_weight(sample_weight, keep)
                raw.bind_ortvalue_input(self._w_name, C.OrtValue.ortvalue_from_numpy(arr, self._device))
                keep.append(arr)
        elif sample_weight is not None:
            raise DataError("sample_weight: the compiled loss takes no sample weight (its function has no "
                            "'sample_weight' input), got an array")
        grad_name = self.train_step.output_grad
        if (grad_name is None) != (output_grad is None):
            raise DataError(f"output_grad: the step takes {grad_name!r} (None: no output gradient), got "
                            f"{'None' if output_grad is None else 'an array'}")
        if grad_name is not None:
            gv, arr = self._value(output_grad, self.dtype, "output_grad")
            raw.bind_ortvalue_input(grad_name, gv)
            keep.append(arr)
        if not read_loss:
            return self._deferred(sess, raw, keep)
        if self._pending:
            self._synced = [self.sync()]
        self._run(sess, raw, keep)
        self.n_runs += 1
        loss = float(self._loss_host[self._current])
        if not math.isfinite(loss):
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

    def _target(self, y, X: np.ndarray) -> np.ndarray:
        """``y`` checked against the batch ``X`` and shaped as the session reads it."""
        if y is None:
            raise DataError(f"y: the compiled loss needs targets for {self._y_name!r}, got None")
        if self.train_step.target_kind == "index":  # NOTE: a bad index would pick another class or fail in ORT
            y = check_class_indices(y, self.train_step.classes)
        arr = self._array(y, self._y_dtype, "y")
        if arr.shape[:1] != X.shape[:1]:  # NOTE: the loss reshapes targets like the prediction: check rows
            raise self._data_error([X, arr], f"y: expected one row per sample of X, got shape {arr.shape}")
        if self._y_shape is not None and arr.shape[1:] != self._y_shape:  # NOTE: fed shaped (cpu_model)
            if arr.size != X.shape[0] * math.prod(self._y_shape):
                raise self._data_error([X, arr], f"y: expected {math.prod(self._y_shape)} value(s) per "
                                       f"sample (the prediction's shape {self._y_shape}), got shape {arr.shape}")
            arr = arr.reshape(self._y_rows)
        return arr

    @_locked
    def epoch(self, X, y=None, sample_weight=None, batch_size: int | None = None) -> np.ndarray:
        """``step`` over the batches of ``X`` in order, ``batch_size`` rows each (the Runner's ``batch_size`` by
        default; the last may be shorter); returns their losses.

        On CPU, for small steps (parameters × batch below ``SMALL_STEP``, where a run's fixed costs weigh), the
        full batches run in one session run, the step inside an ONNX ``Scan`` (``passes.epoch``): the numbers
        of one ``step`` per batch, bit for bit, without a run, binds and Python per batch. The epoch leaves its
        last step's inputs in the buffer set before the current one, as steps do; a NaN or infinite loss or
        weight replays the batches with ``step`` from the epoch's first weights, so the error raised
        (ConvergenceError, naming the batch) and the weights kept are always ``step``'s.

        ``X`` may also be an iterable of batches ``(X, y[, sample_weight])`` or memmaps (``onnxopt.stream``),
        read in a background thread, a block of batches ahead.
        """
        source = as_stream(X, y, sample_weight)
        if source is not None and source.small:  # NOTE: read whole, run as arrays
            (X, y, sample_weight), source = source.read_all(), None
        if source is not None:
            items = prefetch(blocks(source, self.batch_size if batch_size is None else batch_size, dtype=self.x_dtype))
            return np.concatenate([self.epoch(*b[:3], batch_size=b[3]) for b in items])
        X = self._array(X, self.x_dtype, "X")
        n = X.shape[0] if X.ndim else 0
        batch = check_batch_size(self.batch_size if batch_size is None else batch_size, max(n, 1))
        part = lambda a, i, j: None if a is None else a[i:j]  # noqa: E731
        # NOTE: checked whole before any step runs: a bad last batch must not leave the epoch half trained
        y = self._target(y, X) if self._y_name is not None else y
        if sample_weight is not None:
            sample_weight = self._sample_weight(sample_weight, [X, y])
        full = n // batch if self._cpu is not None and sample_weight is None and self._y_name is not None \
            and self.train_step.output_grad is None and self._size * batch < SMALL_STEP else 0
        losses = self._loop(X[:full * batch], y[:full * batch], full, batch) if full > 1 else []
        for k, start in enumerate(range(len(losses) * batch, n, batch), len(losses) + 1):
            try:
                losses.append(self.step(X[start:start + batch], part(y, start, start + batch),
                                        part(sample_weight, start, start + batch)))
            except ConvergenceError as exc:
                raise ConvergenceError(f"batch {k}: {exc}") from exc
        return np.asarray(losses, np.float64)

    def _sample_weight(self, sample_weight, arrays: list) -> np.ndarray:
        """``sample_weight`` checked against the batch ``arrays[0]`` (X); ``arrays`` are named in the error."""
        arr = as_array(sample_weight, self.dtype, "sample_weight")
        if arr.shape != arrays[0].shape[:1]:  # NOTE: the loss broadcasts weights: (1,) or (n, 1) would run
            raise self._data_error([*arrays, arr], f"sample_weight: expected shape {arrays[0].shape[:1]} (one "
                                   f"weight per sample of X), got {arr.shape}")
        return arr

    def _epoch_session(self) -> tuple[C.InferenceSession, list]:
        """The session of the epoch model (``passes.epoch``) and its bindings, one per buffer set (made once)."""
        if self._epoch is None:
            views = (PACK_WEIGHTS, [(m, tuple(self._sets[0][m].shape())) for m in self._views]) if self._views else None
            self._epoch_model = epoch_model(onnx.load_from_string(self._cpu), [self._x_name, self._y_name], self._bound,
                                           views, self.train_step.loss)
            session = ort.InferenceSession(self._epoch_model.SerializeToString(), self._opts,
                                           providers=["CPUExecutionProvider"], disabled_optimizers=KEEP_DROPOUT)
            self._epoch = (session._sess, [session.io_binding()._iobinding for _ in range(_N_SETS)])
            self._check = np.full((), np.nan, self.dtype)
            check = C.OrtValue.ortvalue_from_numpy(self._check, self._device)
            for k, raw in enumerate(self._epoch[1]):  # NOTE: reads set k, ends with the last step's inputs in
                raw.bind_ortvalue_output(CHECK, check)
                for name in self._bound:  # set k + 1 and its outputs in set k + 2, as the steps would
                    raw.bind_ortvalue_input(PREFIX + name, self._bound_value(k, name))
                    raw.bind_ortvalue_output(PREFIX + name + LAST, self._bound_value((k + 1) % _N_SETS, name))
                    raw.bind_ortvalue_output(PREFIX + name + NEW, self._bound_value((k + 2) % _N_SETS, name))
        return self._epoch

    def _loop(self, X: np.ndarray, y: np.ndarray, steps: int, batch: int) -> list[float]:
        """Losses of ``steps`` batches of ``batch`` rows run as one Scan; none, weights unchanged, on a NaN."""
        if self._pending:
            self._synced = [self.sync()]
        sess, raws = self._epoch_session()
        raw, first, valid = raws[self._current], self._current, self._previous_valid
        if steps not in self._loop_io:  # NOTE: the losses' buffer and the Scan's count per epoch length, bound
            arrays = np.empty(steps, self.dtype), np.array(steps - 1, np.int64)  # once per binding while it lasts
            self._loop_io[steps] = (*arrays, *(C.OrtValue.ortvalue_from_numpy(a, self._device) for a in arrays))
        losses = self._loop_io[steps][0]
        cut = (steps - 1) * batch  # NOTE: the Scan runs all batches but the last, the outer graph the last
        for name, arr in ((self._x_name, X), (self._y_name, y)):
            head = arr[:cut].reshape(steps - 1, batch, *arr.shape[1:])
            raw.bind_ortvalue_input(PREFIX + name, C.OrtValue.ortvalue_from_numpy(head, self._device))
            raw.bind_ortvalue_input(PREFIX + name + LAST, C.OrtValue.ortvalue_from_numpy(arr[cut:], self._device))
        if self._loop_bound[first] != (steps, batch):
            raw.bind_ortvalue_output(PREFIX + "losses", self._loop_io[steps][2])
            if any(v.name == COUNT for v in self._epoch_model.graph.input):
                raw.bind_ortvalue_input(COUNT, self._loop_io[steps][3])
            if self._w_name is not None:
                if batch not in self._ones:
                    self._ones[batch] = self._weight_values(np.ones(batch, self.dtype))
                for name, value in self._ones[batch][0]:
                    raw.bind_ortvalue_input(name, value)
            self._loop_bound[first] = (steps, batch)
        # NOTE: the Scan also writes the set before ``first`` (the last step's inputs): kept for a replay
        before = self._hosts[(first - 1) % _N_SETS]
        saved = [a.copy() for a in before] if valid else []
        ok = False
        try:
            self._run(sess, raw, [X, y])
            self.n_runs += 1
            ok = math.isfinite(self._check)  # NOTE: the sum of the losses and new tensors (an overflow replays too)
        finally:
            for a, b in zip(before, saved if not ok else []):  # NOTE: a refused batch, or a NaN: epoch() replays
                np.copyto(a, b)  # the batches with step from the epoch's first weights, which stay current
        if not ok:
            return []
        self._current, self._previous_valid = (first + 2) % _N_SETS, True
        return losses.tolist()

    def _run(self, sess, raw, keep) -> None:
        """One run of ``sess`` with binding ``raw``; ORT's shape/type errors become a DataError naming the batch."""
        try:
            sess.run_with_iobinding(raw, None)
        except Exception as exc:
            raise self._data_error(keep, exc) from exc

    def _deferred(self, sess, raw, keep) -> None:
        if self._pending == _HISTORY:
            self._synced = [self.sync()]
        if not self._pending:
            self._snapshot = {**self.get_weights(), **self.get_state()}
        if self.device == "cpu":  # NOTE: the loss lands in a host scalar: copying it costs less than rebinding
            self._run(sess, raw, keep)
            self._history_host[self._pending] = self._loss_host[self._current]
        else:
            slot = self._history.data_ptr() + self._pending * self.dtype.itemsize
            raw.bind_output(self.train_step.loss, self._device, self.dtype, [], slot)
            try:
                self._run(sess, raw, keep)
            finally:
                raw.bind_ortvalue_output(self.train_step.loss, self._loss_values[self._current])
        self.n_runs += 1
        self._pending += 1
        self._current = (self._current + 1) % _N_SETS
        self._previous_valid = False
        return None

    @_locked
    def sync(self) -> np.ndarray:
        """Reads the losses of the steps run with ``read_loss=False`` (one device read) and checks them.

        Returns every such loss since the previous call, including those read by automatic syncs (every
        1024 deferred steps, or before a step that reads its loss). On a NaN or infinite loss, the weights
        and state go back to those of the last sync and ConvergenceError is raised.
        """
        losses = (self._history_host if self.device == "cpu" else self._history.numpy())[: self._pending]
        losses = losses.astype(np.float64)
        self._pending, earlier, self._synced = 0, self._synced, []
        bad = np.flatnonzero(~np.isfinite(losses))
        if bad.size:
            last = self.step_count
            self.set_weights(self._snapshot)
            raise ConvergenceError(
                f"loss became {losses[bad[0]]} at step {last - len(losses) + bad[0] + 1}; weights were reset to "
                f"those of step {self.step_count} (the last synced step), see get_weights()")
        return np.concatenate([*earlier, losses]) if earlier else losses

    @_locked
    def check_weights(self) -> None:
        """Raises ConvergenceError if a weight is NaN or infinite, going back to the weights that gave the last
        finite loss as a diverging step does. ``step`` checks the loss only: a finite loss can still overflow
        its update, which the next step finds (``Trainer`` calls this after every epoch)."""
        bad = [name for name, w in self.get_weights().items() if not np.isfinite(w).all()]
        if not bad:
            return
        failed, kept = self.step_count, "they were reset to those that gave its loss"
        if self._previous_valid:
            self._current = (self._current - 1) % _N_SETS
            self._previous_valid = False
        else:
            kept = "no earlier weights are kept (set_weights, a checkpoint or deferred steps came last)"
        raise ConvergenceError(f"weights: {bad} became NaN or infinite at step {failed} although its loss was "
                               f"finite; {kept}, see get_weights()")

    def _data_error(self, arrays, exc: Exception | str) -> Exception:
        names = [n for n in (self._x_name, self._y_name, self._w_name, self.train_step.output_grad) if n is not None]
        given = ", ".join(f"{n}{tuple(a.shape)} {a.dtype}" for n, a in zip(names, arrays))
        types = self._input_types
        dims = {n: [d.dim_param or d.dim_value for d in types[n].shape.dim] if types[n].HasField("shape")
                else "(any shape)" for n in names}
        expected = ", ".join(f"{n}{dims[n]} tensor({ir.DataType(types[n].elem_type).name.lower()})" for n in names)
        reason = exc if isinstance(exc, str) else f"onnxruntime refused it ({str(exc).splitlines()[0][:300]})"
        rows = fixed_rows(self.train_step)
        if rows is not None and arrays and np.ndim(arrays[0]) and len(arrays[0]) != rows:
            reason += f"; {FIXED_BATCH.format(name=self._x_name, rows=rows)}"
        return DataError(f"batch: {reason}; expected {expected}, got {given}")

    @property
    @_locked
    def step_count(self) -> int:
        """Steps completed so far."""
        return int(self._sets[self._current][STEP].numpy())

    # -- weights -----------------------------------------------------------------------------------------
    @_locked
    def current_values(self) -> dict[str, ort.OrtValue]:
        """The OrtValues holding the current weights and state (on the device), valid until the next step."""
        return dict(self._sets[self._current])

    @_locked
    def get_weights(self) -> dict[str, np.ndarray]:
        """Copies of the current weights."""
        cur = self._sets[self._current]
        return {name: cur[name].numpy().copy() for name in self.train_step.weights}

    @_locked
    def get_state(self) -> dict[str, np.ndarray]:
        """Copies of the current optimizer state, running statistics (``TrainStep.buffers``) and step counter."""
        cur = self._sets[self._current]
        return {name: cur[name].numpy().copy() for name in [*self.train_step.buffers, *self.train_step.state]}

    @_locked
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

    @_locked
    def save_checkpoint(self, path: str | os.PathLike, meta: Mapping | None = None) -> None:
        """Writes weights, optimizer state and step count to ``path``, atomically and with a SHA-256 checksum
        (``onnxopt.checkpoint``); ``meta`` (JSON values, e.g. a ``kind`` and a history) is stored with them."""
        from onnxopt.checkpoint import save_arrays

        arrays = {**self.get_weights(), **self.get_state()}
        save_arrays(path, arrays, {"kind": "onnxopt.Runner", "step": self.step_count, **(meta or {})})

    @_locked
    def load_checkpoint(self, path: str | os.PathLike, kind: str | None = None) -> dict:
        """Restores what ``save_checkpoint`` wrote and returns its metadata; training then continues bit for
        bit. The file is verified (checksum, names, shapes, dtypes, and its ``kind`` when given) before any
        weight changes: a bad one raises CheckpointError."""
        from onnxopt.checkpoint import load_arrays

        expected = {n: (a.shape, a.dtype) for n, a in {**self.get_weights(), **self.get_state()}.items()}
        arrays, meta = load_arrays(path, expected)
        if kind is not None and meta.get("kind") != kind:
            raise CheckpointError(f"checkpoint: {os.fspath(path)!r} was written by {meta.get('kind')!r}, "
                                  f"expected {kind!r}")
        self.set_weights(arrays)
        return meta

    @_locked
    def export(self) -> onnx.ModelProto:
        """The user's original inference model with the trained weights (and running statistics, mode="train")
        written into its initializers."""
        model = onnx.ModelProto()
        model.ParseFromString(self.train_step.inference)
        weights = self.get_weights()
        weights.update({name: value for name, value in self.get_state().items() if name in self.train_step.buffers})
        for init in model.graph.initializer:
            if init.name in weights:
                init.CopyFrom(ir.serde.serialize_tensor(ir.tensor(weights[init.name], name=init.name)))
        from onnxopt.ml_rules import restore_zipmap  # NOTE: the classifier's list-of-dicts output, as converted

        return restore_zipmap(model)
