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

from onnxopt.checkpoint import restore_arrays, save_arrays
from onnxopt.data import all_finite, as_array, check_batch_size, check_class_indices
from onnxopt.epochs import EpochLoop
from onnxopt.errors import ConvergenceError, DataError, ModelError, NotDifferentiableError
from onnxopt.modelio import require_cuda
from onnxopt.passes.batch import (drop_same_shape_reshapes, hoist, masked_relu_grads, row_sum_updates, shaped_target,
                                  summed_rows)
from onnxopt.passes.epoch import scannable
from onnxopt.passes.update import PACK_WEIGHTS, flat_carry
from onnxopt.protocol import Roles
from onnxopt.ring import BufferRing
from onnxopt.sessions import KEEP_DROPOUT, StepSessions, _without_values  # noqa: F401  (distributed's)
from onnxopt.step import TrainStep
from onnxopt.stream import as_stream, blocks, read_ahead

__all__ = ["Runner", "default_session_options", "step_work", "cpu_model", "cuda_model"]

logger = logging.getLogger(__name__)
_HISTORY = 1024  # NOTE: deferred losses kept on the device before an automatic sync
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


_LEVELS = {"verbose": 0, "info": 1, "warning": 2, "error": 3, "fatal": 4}


def log_severity() -> int:
    """onnxruntime's log severity for onnxopt's sessions: the environment variable ``ONNXOPT_LOG`` (verbose,
    info, warning, error, fatal or 0-4), fatal when unset: ORT's errors are those onnxopt raises (a refused batch
    is a DataError), its warnings say weights are overridable initializers, which they are by design."""
    value = os.environ.get("ONNXOPT_LOG", "fatal").strip().lower()
    level = _LEVELS.get(value, int(value) if value.isdigit() else -1)
    if not 0 <= level <= 4:
        raise ValueError(f"ONNXOPT_LOG: expected one of {list(_LEVELS)} or 0-4, got {value!r}")
    return level


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
    opts.log_severity_level = log_severity()  # NOTE: fatal unless ONNXOPT_LOG says otherwise
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if n_parameters * batch_size < SMALL_STEP:
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
    if not spinning:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


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
        sess = ort.InferenceSession(side, default_session_options(0), providers=["CPUExecutionProvider"])
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


def cuda_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` for the CUDA provider, which leaves a ConvTranspose with uneven pads to the CPU (cuDNN pads both
    sides alike): a ConvTranspose with uneven pads (a user's; R1's strided-Conv input gradient was one, pads
    [1, 1, 0, 0], before that rule took ``output_padding``) becomes one with each axis's smaller pad on both sides,
    then a Slice crops the rest. The same values: pads
    only crop the full output. The CPU runs the model as it is (one pass fewer)."""
    m, changed = ir.from_proto(model), False
    for node in list(m.graph):
        pads = node.attributes.get("pads")
        if (node.op_type != "ConvTranspose" or node.domain not in ("", "ai.onnx") or pads is None
                or "output_shape" in node.attributes or node.attributes.get_string("auto_pad", "NOTSET") != "NOTSET"):
            continue
        pads = list(pads.as_ints())
        r = len(pads) // 2
        even = [min(b, e) for b, e in zip(pads[:r], pads[r:])]
        if pads[:r] == pads[r:]:
            continue
        full, changed = node.outputs[0], True
        node.attributes["pads"] = ir.AttrInt64s("pads", even * 2)
        cuts = [[b - k for b, k in zip(pads[:r], even)], [k - e if e > k else 2**62 for e, k in zip(pads[r:], even)],
                list(range(2, r + 2))]  # NOTE: starts, ends (negative: from the end), axes
        consts = [ir.node("Constant", [], {"value": ir.tensor(np.array(v, np.int64))}, num_outputs=1) for v in cuts]
        crop = ir.node("Slice", [full, *(c.outputs[0] for c in consts)], num_outputs=1)
        for c, what in zip(consts, ("starts", "ends", "axes")):
            c.outputs[0].name = f"{full.name}.{what}"
        cropped = crop.outputs[0]
        cropped.name, cropped.type, cropped.shape = full.name, full.type, full.shape
        full.name, full.type, full.shape = f"{cropped.name}.uncropped", None, None
        for user, index in list(full.uses()):
            if user is not crop:
                user.replace_input_with(index, cropped)
        if full.is_graph_output():
            m.graph.outputs[m.graph.outputs.index(full)] = cropped
        m.graph.insert_after(node, [*consts, crop])
    return ir.to_proto(m) if changed else model


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

    _memory = None  # NOTE: the ring's host memory per set (BufferRing): a rank's shared sets in distributed

    def __init__(self, step: TrainStep | str | os.PathLike, device: str = "cpu",
                 session_options: ort.SessionOptions | None = None, batch_size: int = 32):
        self._lock = threading.RLock()  # NOTE: reentrant: epoch calls step, save_checkpoint get_weights
        self.train_step = step if isinstance(step, TrainStep) else TrainStep.load(step)
        roles = self._roles = Roles.of(self.train_step)  # NOTE: the names by role, from the step's protocol
        if len(roles.data) > 1:  # NOTE: step() feeds X to inputs[0]; the others would be missing
            raise several_inputs(roles.data)
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
        opts = self._opts = session_options or default_session_options(step_work(self.train_step, initial),
                                                                         batch_size)
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
        # NOTE: packs are host buffers whose members are bound as numpy views, hoisted values host arrays (CPU only)
        threads = opts.intra_op_num_threads or os.cpu_count() or 1  # NOTE: 0 is ORT's default: one per core
        cpu = cpu_model(self.train_step, batch_size, threads) if device == "cpu" else None
        model, packs = (cpu.model, cpu.packs) if cpu else (cuda_model(self.train_step.model), {})
        self._side, self._weighted = None, cpu.weighted if cpu else None
        self._hoisted, self._w_kept, self._y_shape = \
            (cpu.hoisted, cpu.weight_kept, cpu.target_shape) if cpu else ([], True, None)
        self._y_rows = (-1, *self._y_shape) if self._y_shape is not None else None
        if cpu is not None and cpu.side is not None:
            side_opts = ort.SessionOptions()
            side_opts.intra_op_num_threads, side_opts.log_severity_level = 1, log_severity()
            self._side = ort.InferenceSession(cpu.side, side_opts, providers=["CPUExecutionProvider"])
        self.batch_size = batch_size
        scan = scannable(model) if cpu else False  # NOTE: whether epochs run as one Scan (EpochLoop)
        # NOTE: the step's session runs batches of ``batch_size`` rows; other lengths run on the model as compiled.
        # Only for steps that epochs run one by one: a small step's epoch is one Scan run (its own session), its
        # step session then runs the short last batch, and a second session would cost more than it saves
        rows = batch_size if type(batch_size) is int and 0 < batch_size <= MAX_SPECIALIZED_ROWS and (
            not scan or self._size * batch_size >= SMALL_STEP) else None  # NOTE: bad sizes fail later
        taken = {i.name for i in model.graph.input}  # NOTE: a step without a forward pass (distributed's update)
        views = [n for n in packs.get(PACK_WEIGHTS, []) if n in taken]  # reads only the pack
        self._ring = BufferRing(initial, [*roles.weights, *roles.buffers, *roles.state], packs, self.dtype, device,
                                cpu.rows if cpu else (), views, self._memory)
        try:
            self._sessions = StepSessions(model, initial, roles.data[0], rows, opts, providers, self._ring, roles.loss)
        except Exception as exc:
            raise _missing_kernel(exc, self.train_step.model, device) or _contradicted_shapes(exc) or exc
        self._epochs = EpochLoop(self._sessions.free, self._ring, roles.data[0], roles.target, roles.loss,
                                 roles.sample_weight, opts, self._device) if scan else None
        # NOTE: as the step declares them (the session's target and sample weights may be specialized, cpu_model)
        self._input_types = {i.name: i.type.tensor_type for i in self.train_step.model.graph.input}
        self._losses = _Deferred(self.dtype, device)
        self._ones: dict[int, tuple] = {}  # NOTE: per batch length: the OrtValues fed for all-ones sample weights
        self._fed: dict[tuple[int, str], np.ndarray] = {}  # NOTE: (binding, input): the host buffer it holds (_feed)
        self._bound_ones: dict[int, tuple | None] = {}  # NOTE: per binding (id): the ones it holds as sample weights
        self._x_name, self._y_name, self._w_name = roles.data[0], roles.target, roles.sample_weight
        self._y_dtype = np.int64 if roles.target_kind == "index" else self.dtype
        # NOTE: X keeps the model input's own type (int64 tokens for an Embedding), not the weights'
        self.x_dtype = ir.DataType(self._input_types[roles.data[0]].elem_type).numpy()
        self.n_runs = 0

    @property
    def roles(self) -> Roles:
        """The step's names by role (data, target, weights, state, buffers, loss, swap map), read from its
        protocol (``protocol.Roles``)."""
        return self._roles

    @property
    def session(self) -> ort.InferenceSession:
        """The step's onnxruntime session (for batches of ``batch_size`` rows)."""
        return self._sessions.session

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
        w_name = self._roles.sample_weight
        named = dict(zip(self._hoisted, self._side.run(None, {w_name: w}))) if self._side is not None else {}
        if self._w_kept:
            named[w_name] = w
        return [(k, C.OrtValue.ortvalue_from_numpy(a, self._device)) for k, a in named.items()], [w, *named.values()]

    def _ones_of(self, n: int) -> tuple:
        """The all-ones sample weights' OrtValues for batches of ``n`` rows (made once per length)."""
        ones = self._ones.get(n)
        if ones is None:
            ones = self._ones[n] = self._weight_values(np.ones(n, self.dtype))
        return ones

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
        sessions, ring = self._sessions, self._ring
        if sample_weight is not None and self._weighted is not None:  # NOTE: a session keeping sample weights
            sess, raws = sessions.bindings_of(self._weighted)
        elif sessions.fixed_rows is not None and X.shape[0] != sessions.fixed_rows:
            sess, raws = sessions.bindings_of(sessions.free)
        else:
            sess, raws = sessions.session._sess, sessions.raw
        raw = raws[ring.current]
        self._feed(raw, self._x_name, X)
        keep = [X]  # NOTE: OrtValues over numpy memory do not own it: keep the arrays alive until the run ends
        if self._y_name is not None:
            arr = self._target(y, X)
            self._feed(raw, self._y_name, arr)
            keep.append(arr)
        if self._w_name is not None:
            if sample_weight is None:  # NOTE: unweighted batches share one ones-OrtValue per batch length
                ones = self._ones_of(X.shape[0] if X.ndim else 0)
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
        grad_name = self._roles.output_grad
        if (grad_name is None) != (output_grad is None):
            raise DataError(f"output_grad: the step takes {grad_name!r} (None: no output gradient), got "
                            f"{'None' if output_grad is None else 'an array'}")
        if grad_name is not None:
            gv, arr = self._value(output_grad, self.dtype, "output_grad")
            raw.bind_ortvalue_input(grad_name, gv)
            keep.append(arr)
        if not read_loss:
            return self._deferred(sess, raw, keep)
        if self._losses.pending:
            self._losses.synced = [self.sync()]
        self._run(sess, raw, keep)
        self.n_runs += 1
        loss = float(sessions.loss_host[ring.current])
        if not math.isfinite(loss):
            failed = self.step_count + 1
            ring.step_back()  # NOTE: the set before the inputs holds the weights of the last finite loss
            raise ConvergenceError(
                f"loss became {loss} at step {failed}; weights were reset to those that gave the last finite "
                f"loss (step {self.step_count + 1}), see get_weights()")
        ring.advance()
        return loss

    def _target(self, y, X: np.ndarray) -> np.ndarray:
        """``y`` checked against the batch ``X`` and shaped as the session reads it."""
        if y is None:
            raise DataError(f"y: the compiled loss needs targets for {self._y_name!r}, got None")
        if self._roles.target_kind == "index":  # NOTE: a bad index would pick another class or fail in ORT
            y = check_class_indices(y, self._roles.classes)
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
        read a block of batches ahead (``stream.read_ahead``).
        """
        source = as_stream(X, y, sample_weight)
        if source is not None and source.small:  # NOTE: read whole, run as arrays
            (X, y, sample_weight), source = source.read_all(), None
        if source is not None:
            items = read_ahead(source, blocks(source, self.batch_size if batch_size is None else batch_size,
                                              dtype=self.x_dtype))
            return np.concatenate([self.epoch(*b[:3], batch_size=b[3]) for b in items])
        X = self._array(X, self.x_dtype, "X")
        n = X.shape[0] if X.ndim else 0
        batch = check_batch_size(self.batch_size if batch_size is None else batch_size, max(n, 1))
        part = lambda a, i, j: None if a is None else a[i:j]  # noqa: E731
        # NOTE: checked whole before any step runs: a bad last batch must not leave the epoch half trained
        y = self._target(y, X) if self._y_name is not None else y
        if sample_weight is not None:
            sample_weight = self._sample_weight(sample_weight, [X, y])
        full = n // batch if self._epochs is not None and sample_weight is None and self._y_name is not None \
            and self._roles.output_grad is None and self._size * batch < SMALL_STEP else 0
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

    def _loop(self, X: np.ndarray, y: np.ndarray, steps: int, batch: int) -> list[float]:
        """Losses of ``steps`` batches of ``batch`` rows run as one Scan (``EpochLoop``); none on a NaN."""
        if self._losses.pending:
            self._losses.synced = [self.sync()]
        losses = self._epochs.run(X, y, steps, batch, self._ones_of, self._run)
        self.n_runs += 1
        return losses

    def _run(self, sess, raw, keep) -> None:
        """One run of ``sess`` with binding ``raw``; ORT's shape/type errors become a DataError naming the batch."""
        try:
            sess.run_with_iobinding(raw, None)
        except Exception as exc:
            raise self._data_error(keep, exc) from exc

    def _deferred(self, sess, raw, keep) -> None:
        losses, ring, loss = self._losses, self._ring, self._roles.loss
        if losses.pending == _HISTORY:
            losses.synced = [self.sync()]
        if not losses.pending:
            losses.snapshot = ring.read([*self._roles.weights, *self._roles.buffers, *self._roles.state],
                                        losses.snapshot)
        if self.device == "cpu":  # NOTE: the loss lands in a host scalar: copying it costs less than rebinding
            self._run(sess, raw, keep)
            losses.host[losses.pending] = self._sessions.loss_host[ring.current]
        else:
            slot = losses.device.data_ptr() + losses.pending * self.dtype.itemsize
            raw.bind_output(loss, self._device, self.dtype, [], slot)
            try:
                self._run(sess, raw, keep)
            finally:
                raw.bind_ortvalue_output(loss, self._sessions.loss_values[ring.current])
        self.n_runs += 1
        losses.pending += 1
        ring.advance()
        ring.previous_valid = False
        return None

    @_locked
    def sync(self) -> np.ndarray:
        """Reads the losses of the steps run with ``read_loss=False`` (one device read) and checks them.

        Returns every such loss since the previous call, including those read by automatic syncs (every
        1024 deferred steps, or before a step that reads its loss). On a NaN or infinite loss, the weights
        and state go back to those of the last sync and ConvergenceError is raised.
        """
        deferred = self._losses
        losses = (deferred.host if self.device == "cpu" else deferred.device.numpy())[: deferred.pending]
        losses = losses.astype(np.float64)
        deferred.pending, earlier, deferred.synced = 0, deferred.synced, []
        bad = np.flatnonzero(~np.isfinite(losses))
        if bad.size:
            last = self.step_count
            self.set_weights(deferred.snapshot)
            raise ConvergenceError(
                f"loss became {losses[bad[0]]} at step {last - len(losses) + bad[0] + 1}; weights were reset to "
                f"those of step {self.step_count} (the last synced step), see get_weights()")
        return np.concatenate([*earlier, losses]) if earlier else losses

    @_locked
    def check_weights(self) -> None:
        """Raises ConvergenceError if a weight is NaN or infinite, going back to the weights that gave the last
        finite loss as a diverging step does. ``step`` checks the loss only: a finite loss can still overflow
        its update, which the next step finds (``Trainer`` calls this after every epoch)."""
        cur = self._ring.sets[self._ring.current]  # NOTE: views on CPU: a streamed fit checks every block
        bad = [name for name in self._roles.weights if not all_finite(cur[name].numpy())]
        if not bad:
            return
        failed, kept = self.step_count, "they were reset to those that gave its loss"
        if not self._ring.step_back():
            kept = "no earlier weights are kept (set_weights, a checkpoint or deferred steps came last)"
        raise ConvergenceError(f"weights: {bad} became NaN or infinite at step {failed} although its loss was "
                               f"finite; {kept}, see get_weights()")

    def _data_error(self, arrays, exc: Exception | str) -> Exception:
        names = [n for n in (self._x_name, self._y_name, self._w_name, self._roles.output_grad) if n is not None]
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
        return self._ring.step_count

    # -- weights -----------------------------------------------------------------------------------------
    @_locked
    def current_values(self) -> dict[str, ort.OrtValue]:
        """The OrtValues holding the current weights and state (on the device), valid until the next step."""
        return dict(self._ring.sets[self._ring.current])

    @_locked
    def get_weights(self) -> dict[str, np.ndarray]:
        """Copies of the current weights."""
        return self._ring.read(self._roles.weights)

    @_locked
    def get_state(self) -> dict[str, np.ndarray]:
        """Copies of the current optimizer state, running statistics (``TrainStep.buffers``) and step counter."""
        return self._ring.read([*self._roles.buffers, *self._roles.state])

    @_locked
    def set_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """Overwrites some or all weights (and state tensors, by name) in place."""
        self._ring.write(weights)

    # -- checkpoints and export --------------------------------------------------------------------------
    @_locked
    def save_checkpoint(self, path: str | os.PathLike, meta: Mapping | None = None) -> None:
        """Writes weights, optimizer state and step count to ``path``, atomically and with a SHA-256 checksum
        (``onnxopt.checkpoint``); ``meta`` (JSON values, e.g. a ``kind`` and a history) is stored with them."""
        arrays = {**self.get_weights(), **self.get_state()}
        save_arrays(path, arrays, {"kind": "onnxopt.Runner", "step": self.step_count, **(meta or {})})

    @_locked
    def load_checkpoint(self, path: str | os.PathLike, kind: str | None = None) -> dict:
        """Restores what ``save_checkpoint`` wrote and returns its metadata; training then continues bit for
        bit. The file is verified (checksum, names, shapes, dtypes, and its ``kind`` when given) before any
        weight changes: a bad one raises CheckpointError."""
        arrays, meta = restore_arrays(path, {**self.get_weights(), **self.get_state()}, kind)
        self.set_weights(arrays)
        return meta

    @_locked
    def export(self) -> onnx.ModelProto:
        """The user's original inference model with the trained weights (and running statistics, mode="train")
        written into its initializers (``TrainStep.inference_model``)."""
        buffers = self._ring.read(self._roles.buffers)
        return self.train_step.inference_model({**self.get_weights(), **buffers})


class _Deferred:
    """The losses of steps run with ``read_loss=False``: ``pending`` of them in ``host`` (CPU) or ``device``
    (CUDA, written in place by the runs), those read by automatic syncs (``synced``), and the weights and state
    before the first (``snapshot``), which a NaN among them restores."""

    def __init__(self, dtype: np.dtype, device: str):
        self.device = ort.OrtValue.ortvalue_from_shape_and_type([_HISTORY], dtype, device, 0)
        self.host = np.zeros(_HISTORY, dtype)  # NOTE: on CPU, deferred losses are copied here
        self.pending = 0
        self.synced: list[np.ndarray] = []
        self.snapshot: dict[str, np.ndarray] | None = None
