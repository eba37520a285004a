"""Data-parallel training on ``torch.distributed``: one replica per rank, gradients all-reduced every step.

``split_step`` compiles the training step in two parts:
- the *gradient* step: forward, loss, backward and penalty on the rank's rows -> the loss and every weight's
  gradient (``GRADS/<weight>``), each written into its slice of one flat buffer;
- the *update* step: clipping, schedule and update rule, compiled by ``compile_train_step`` on a linear model
  whose loss Σₖ ⟨Wₖ, Gₖ⟩ has the flat input G as its exact gradient, and run by a ``Runner`` (weights, state,
  step counter, checkpoints and ``export`` are the ``Runner``'s); ``DataParallelRunner`` runs its session model
  with each Gₖ an input of its own, read where it lies in the reduced buffer (``_per_weight``).
Each step a rank scales its gradients and loss by its share s = c / C of the global batch (c its rows, C the
batch's; with sample weights, their sums: every rank holds the global batch, so s needs no collective), one
all-reduce sums [s·g, s·loss] over the ranks (``_Shared`` through shared memory on one host, ``_Gloo`` through
torch.distributed, started bucket by bucket as the ``pieces`` of a split step end) and every rank applies the same
update: N ranks with a global batch B give the weights of one process with batch B, to float rounding;
``sync_every`` K accumulates K micro-batches first (one process with batch K·B). torch is imported only when a
launcher set ``WORLD_SIZE`` or torch is already loaded.

Mode "weights" (shm ranks given the fused step, sync_every 1, CPU): for an update affine in the gradient given the
weights and state (``affine``: SGD, momentum, Nesterov, any penalty or schedule), rank r runs the fused step on its
rows, Aᵣ = U(W, S, gᵣ + p(W)), and every rank writes Σᵣ sᵣ·Aᵣ = U(W, S, Σᵣ sᵣ·gᵣ + p(W)) (Σ sᵣ = 1) back into its
weights and state: one process's update on the global batch, to float rounding, with the update fused into the
backward's Gemms instead of a second session reading the gradients back. The ranks' buffer sets live in one
shared-memory file (``_SharedSets``): each rank averages its shard of all of them in place.

On CUDA (``device="cuda"``) each rank's steps run on GPU 0 (weights, state and the update on the device), and
the gradient step writes its gradients into the same host buffer, which shm or gloo all-reduce and the update
reads back: host staging, one copy each way per step. NCCL is not used: it needs one GPU per rank (two ranks on
one GPU, as on a machine lent with one, are refused) and a CUDA build of torch in every rank.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import math
import os
import sys
import time

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as passes
import onnxruntime as ort

from onnxopt.data import as_array, check_batch_size
from onnxopt.dsl import op, update_rule
from onnxopt.errors import ConvergenceError, DataError, ModelError, OnnxoptError
from onnxopt.fuse import compile_train_step
from onnxopt.protocol import Roles
from onnxopt.passes.batch import masked_relu_grads
from onnxopt.ring import N_SETS
from onnxopt.runner import Runner, _without_values, cuda_model, default_session_options
from onnxopt.step import NEW, TrainStep

__all__ = ["DataParallelRunner", "DistributedError", "affine", "split_step", "world", "TIMEOUT"]

GRADS = "optim.grads"
TIMEOUT = float(os.environ.get("ONNXOPT_TIMEOUT", 300))  # NOTE: seconds a collective waits for the other ranks
COMPRESS = {"bf16": "bfloat16", "fp16": "float16"}  # NOTE: the 16-bit floats a compressed all-reduce sends


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
        piece = part if len(a.shape) == 1 else tape.op("Reshape", [part, const(a.shape)])
        piece.name = f"{GRADS}/{name}"  # NOTE: found by name in the update's session model (_per_weight)
        terms.append(tape.op("ReduceSum", [tape.op("Mul", [w, piece])], {"keepdims": 0}))
        offset += a.size
    loss = tape.op("Sum", terms) if len(terms) > 1 else terms[0]
    loss.name = "loss"
    graph.outputs.append(loss)
    return ir.Model(graph, ir_version=10)


def _per_weight(model: bytes, shapes: dict[str, tuple[int, ...]]) -> bytes | None:
    """The update's session ``model`` reading each weight's gradient ``GRADS/<w>`` (``_linear``'s slice of the flat
    input) as an input of its own, bound to its view of the reduced buffer: no Split copy of the flat buffer a
    step. None when a gradient is not found by name."""
    m = ir.from_proto(onnx.load_from_string(model))
    values = {v.name: v for node in m.graph for v in node.outputs}
    flat = next(v for v in m.graph.inputs if v.name == GRADS)
    for w, shape in shapes.items():
        old = values.get(f"{GRADS}/{w}")
        if old is None:
            return None
        new = ir.Value(name=old.name, type=flat.type, shape=ir.Shape(shape))
        old.name = f"{old.name}.sliced"
        ir.convenience.replace_all_uses_with(old, new)
        m.graph.inputs.append(new)
    m.graph.inputs.remove(flat)
    passes.RemoveUnusedNodesPass()(m)
    return ir.to_proto(m).SerializeToString()


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


def affine(update: TrainStep, share: float = 0.3) -> bool:
    """Whether ``split_step``'s ``update`` moves weights and state affinely in the gradient: U(a·g₁ + (1-a)·g₂) =
    a·U(g₁) + (1-a)·U(g₂) from the same weights and state (SGD, momentum, Nesterov, any schedule: yes; Adam,
    RMSprop, Adagrad, clipping: no). Then averaging the ranks' fused steps by their shares gives the update on the
    averaged gradient (mode "weights"). Tried on small, large and near-overflow random gradients (a clip shows on
    those above its norm: the last pass any ``clip_norm`` a float can hold), from the initial state and after one
    step, on a throwaway Runner, to rounding (relative to the moves); a step that overflows counts as not affine."""
    runner, rng = Runner(update, batch_size=1), np.random.default_rng(0)
    dtype, size = runner.dtype, sum(a.size for a in update.initial_weights().values())
    tol, eps = (1e-4 if dtype == np.float32 else 1e-9), np.finfo(dtype).eps

    def outcome(start: dict, g: np.ndarray) -> dict:
        runner.set_weights(start)
        runner.step(g)
        return {**runner.get_weights(), **runner.get_state()}

    huge = 1e-3 * math.sqrt(float(np.finfo(dtype).max) / size)  # NOTE: the norm's square still a finite float
    for scale in (1e3, 1e-3, huge):
        start = {**runner.get_weights(), **runner.get_state()}
        g0, g1, g2 = (scale * rng.standard_normal((3, size))).astype(dtype)
        for _ in range(2):  # NOTE: from the initial state, then from one where momentum is not zero
            try:
                one, two, mix = (outcome(start, g) for g in (g1, g2, (share * g1 + (1 - share) * g2).astype(dtype)))
            except ConvergenceError:
                return False
            for name, before in start.items():
                if before.dtype != dtype or not before.size:
                    continue
                moved = max(np.abs(one[name] - before).max(), np.abs(two[name] - before).max())
                off = np.abs(mix[name] - (share * one[name] + (1 - share) * two[name])).max()
                if off > tol * moved + 8 * eps * np.abs(before).max():
                    return False
            start = outcome(start, g0)
    return True


def _averages(update: TrainStep, device: str = "cpu", sync_every: int = 1, compress: str | None = None,
              transport: str = "auto") -> bool:
    """Whether ranks of this process group with these options train in mode "weights" given the fused step (shm
    permitting): CPU, no accumulation, no compression, not forced onto gloo, and ``update`` ``affine``. The Trainer
    compiles the fused step only then."""
    return (world()[1] > 1 and device == "cpu" and sync_every == 1 and not compress and transport != "gloo"
            and affine(update))


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


def pieces(model: onnx.ModelProto, sizes: dict[str, int], parts: int) -> list[tuple[onnx.ModelProto, list[str]]]:
    """The gradient step split into about ``parts`` models run in order, each ending with a bucket of gradients
    (``GRADS/<weight>`` outputs, about equal in size, in the order the backward produces them), so that each
    bucket's all-reduce can start while the next piece runs. A piece's node is one the earliest bucket needing it
    needs (the forward and the loss go to the first); values crossing pieces are outputs of the first and inputs
    of the next. Returns [(model, its weights' gradients)]; one piece where the graph has no typed cut values."""
    m = ir.from_proto(model)
    passes.TopologicalSortPass()(m)
    order = {node: i for i, node in enumerate(m.graph)}
    outs = {v.name: v for v in m.graph.outputs}
    grads = sorted(sizes, key=lambda w: order.get(outs[f"{GRADS}/{w}"].producer(), -1))
    total, buckets, done = sum(sizes.values()), [[]], 0
    for w in grads:  # NOTE: a new bucket where this gradient's middle passes the previous buckets' share of the bytes
        if buckets[-1] and done + sizes[w] / 2 > total * len(buckets) / parts:
            buckets.append([])
        buckets[-1].append(w)
        done += sizes[w]
    piece: dict[ir.Node, int] = {}
    for k, bucket in enumerate(buckets):
        stack = [outs[f"{GRADS}/{w}"].producer() for w in bucket] + ([v.producer() for v in m.graph.outputs
                                                                       if not v.name.startswith(GRADS)] if k == 0 else [])
        while stack:
            node = stack.pop()
            if node is None or node in piece:
                continue
            piece[node] = k
            stack.extend(v.producer() for v in node.inputs if v is not None)
            stack.extend(v.producer() for attr in node.attributes.values() if attr.type == ir.AttributeType.GRAPH
                         for n in attr.value for v in n.inputs if v is not None)  # NOTE: a subgraph's outer values
    made = {v.name: k for node, k in piece.items() for v in node.outputs}  # NOTE: by name: pieces are copies
    needed: dict[str, set[int]] = {}
    for node, k in piece.items():
        for v in node.inputs:
            if v is not None and v.name in made and made[v.name] != k:
                needed.setdefault(v.name, set()).add(k)
    typed = {v.name: v.dtype is not None for node in piece for v in node.outputs}
    if len(buckets) == 1 or not all(typed[name] for name in needed):
        return [(model, list(sizes))]
    result = []
    for k, bucket in enumerate(buckets):
        part = ir.from_proto(model)
        values = {v.name: v for node in part.graph for v in node.outputs}
        for name, users in needed.items():
            if made[name] < k and k in users:  # NOTE: made by an earlier piece: an input here
                value = values[name]
                fed = ir.Value(name=name, type=value.type, shape=value.shape)
                ir.convenience.replace_all_uses_with(value, fed)
                value.name = None
                part.graph.inputs.append(fed)
        wanted = [f"{GRADS}/{w}" for w in bucket] + ([v.name for v in m.graph.outputs if not v.name.startswith(GRADS)]
                                                    if k == 0 else [])
        wanted += sorted(n for n, users in needed.items() if made[n] == k and max(users) > k)
        named = {v.name: v for v in [*part.graph.outputs, *values.values()] if v.name}
        part.graph.outputs.clear()
        part.graph.outputs.extend(named[n] for n in wanted)
        passes.RemoveUnusedNodesPass()(part)
        for value in [v for v in part.graph.inputs if not v.uses()]:
            part.graph.inputs.remove(value)
        result.append((ir.to_proto(part), bucket))
    return result


class _Gloo:
    """The all-reduce through torch.distributed: in place on a buffer torch owns, in ``buckets`` slices issued at
    once as asynchronous work (gloo's threads run them side by side) and waited for together, or slice by slice as
    the pieces of a split gradient step produce them (``start``, then ``wait``); with ``compress`` the gradients
    travel as 16-bit floats (as DDP's fp16/bf16 compression hooks), the loss alone in full precision."""

    def __init__(self, dist, size: int, dtype, buckets: int, compress: str | None):
        import torch

        # NOTE: torch owns the memory (numpy and ORT read it): freeing the tensor in a gloo thread needs no GIL
        self._dist, self._wire = dist, getattr(torch, COMPRESS[compress]) if compress else None
        self._tensor = torch.zeros(size + 1, dtype=getattr(torch, np.dtype(dtype).name))
        self.buffer = self.result = self._tensor.numpy()
        self._size, self._pending = size, []
        self._bounds = [size * i // buckets for i in range(buckets + 1)]

    def start(self, lo: int, hi: int) -> None:
        """Starts the all-reduce of the buffer's [lo, hi) (the loss, at ``size``, never compressed)."""
        part = self._tensor[lo:hi]
        sent = part if self._wire is None or lo >= self._size else part.to(self._wire)
        self._pending.append((part, sent, self._dist.all_reduce(sent, async_op=True)))

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        for part, sent, work in pending:
            work.wait()
            if sent is not part:
                part.copy_(sent)

    def reduce(self) -> None:
        end = self._size + (self._wire is None)  # NOTE: uncompressed, the loss rides in the last slice
        bounds = [*self._bounds[:-1], end]
        for a, b in zip(bounds, bounds[1:]):
            if b > a:
                self.start(a, b)
        if end == self._size:
            self.start(self._size, self._size + 1)
        self.wait()


def _map(dist, rank: int, world: int, nbytes: int):
    """(mapped, header's arrival counts): one shared-memory file of ``nbytes`` past its header that every rank maps,
    or None unless all of them could (ranks on several hosts). Collective. The header holds a token (the file is this
    group's), then one int64 arrival count per rank; the file is unlinked once mapped, so its memory goes with the
    last rank, even one killed."""
    import mmap
    import secrets
    import tempfile

    head = 64 * (1 + (8 * world + 63) // 64)
    info = [None]
    if rank == 0:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix="onnxopt-allreduce-", dir=folder)
        token = secrets.token_bytes(16)
        os.ftruncate(fd, head + nbytes)
        os.pwrite(fd, token, 0)
        os.close(fd)
        info = [(path, token)]
    dist.broadcast_object_list(info, src=0)
    path, token = info[0]
    mapped = None
    try:
        with open(path, "r+b") as f:
            mapped = mmap.mmap(f.fileno(), head + nbytes)
        if mapped[:len(token)] != token:
            mapped = None
    except (OSError, ValueError):
        mapped = None
    found = [None] * world
    dist.all_gather_object(found, mapped is not None)
    if rank == 0:
        os.unlink(path)
    return (mapped, head, np.frombuffer(mapped, np.int64, world, 64)) if all(found) else None


class _Shared:
    """The all-reduce of ranks on one host through one shared-memory file all of them map (``_map``): rank r's
    gradient step writes into its slot, and after one barrier every rank sums all slots, in rank order, into its own
    result, which its update reads: no socket, no copy, the same bits on every rank. Slots alternate between two
    sets by step: a rank is at most one step ahead of the others (the barrier), so it never writes a set that
    another still reads. The barrier is in the file too: each rank writes the count of barriers it has reached into
    its word of the header and waits until every word reaches it (a spin, then yields: no socket round trip, which
    took most of a W3 step); a rank that does not arrive within ``TIMEOUT`` seconds raises. ``open`` returns None
    unless every rank could map the file."""

    def __init__(self, arrived: np.ndarray, rank: int, slots: np.ndarray | None = None):
        self._arrived, self._rank, self._step, self._slots = arrived, rank, 0, slots
        self.result = None if slots is None else np.zeros(slots.shape[2], slots.dtype)

    @property
    def buffer(self) -> np.ndarray:
        """This rank's slot for the current step."""
        return self._slots[self._step % 2, self._rank]

    @classmethod
    def open(cls, dist, rank: int, world: int, size: int, dtype) -> _Shared | None:
        shape = (2, world, size + 1)
        found = _map(dist, rank, world, math.prod(shape) * np.dtype(dtype).itemsize)
        if found is None:
            return None
        mapped, head, arrived = found
        return cls(arrived, rank, np.frombuffer(mapped, dtype, math.prod(shape), head).reshape(shape))

    def _barrier(self) -> None:
        """Returns once every rank has reached this barrier (the header's arrival counts)."""
        self._step += 1
        count = self._step
        self._arrived[self._rank] = count
        spins, deadline = 0, None
        while self._arrived.min() < count:
            spins += 1
            if spins > 1000:  # NOTE: ~1 ms of spinning, then yield the core (ranks may share cores)
                if deadline is None:
                    deadline = time.monotonic() + TIMEOUT
                elif time.monotonic() > deadline:
                    late = [r for r, c in enumerate(self._arrived) if c < count]
                    raise RuntimeError(f"shared-memory barrier: rank(s) {late} did not reach step {count}")
                time.sleep(0 if spins < 20000 else 1e-4)

    def arrive(self) -> np.ndarray:
        """The barrier, then this step's slots (every rank's, in rank order), read-only until the next ``arrive``."""
        slots = self._slots[self._step % 2]
        self._barrier()  # NOTE: every slot of this step written; the next step writes the other set
        return slots

    def reduce(self) -> None:
        slots = self.arrive()
        np.add(slots[0], slots[1], out=self.result)
        for slot in slots[2:]:
            np.add(self.result, slot, out=self.result)


class _SharedSets(_Shared):
    """Mode "weights": the buffer sets of every rank's ``Runner`` in one shared-memory file (``memory``, which
    ``BufferRing`` calls per set), and their losses. After each step's barrier rank r averages its shard of the set
    all ranks just wrote, Σ sᵣ·Aᵣ in rank order, and writes it into that shard of every rank's set; after a second
    barrier every rank's set holds the same bits. One pass over each rank's weights and state fewer than copying
    them into slots, and each rank reads 1/N of them instead of all: their bytes, not the FLOPs, bound the
    averaging (W5: 5 MB a rank). Only rank r touches shard r between the barriers, so nothing races."""

    def __init__(self, dist, rank: int, world: int, dtype):
        super().__init__(np.zeros(world, np.int64), rank)
        self._dist, self._world, self._dtype, self._sets, self._losses = dist, world, np.dtype(dtype), None, None

    @property
    def mapped(self) -> bool:
        """Whether every rank maps the file (else the sets ``memory`` gave are private)."""
        return self._sets is not None

    def memory(self, k: int, size: int) -> np.ndarray:
        """Set ``k``'s flat memory of ``size`` elements for this rank (``BufferRing``'s ``memory``); the file is
        mapped at the first set, collectively; private zeros where some rank could not map it."""
        if k == 0:
            shape, losses = (N_SETS, self._world, size), 64 * -(-16 * self._world // 64)  # NOTE: sets 64-byte aligned
            found = _map(self._dist, self._rank, self._world, losses + math.prod(shape) * self._dtype.itemsize)
            if found is not None:
                mapped, head, self._arrived = found
                self._losses = np.frombuffer(mapped, np.float64, 2 * self._world, head).reshape(2, self._world)
                self._sets = np.frombuffer(mapped, self._dtype, math.prod(shape), head + losses).reshape(shape)
        return np.zeros(size, self._dtype) if self._sets is None else self._sets[k, self._rank]

    def exchange(self, loss: float) -> np.ndarray:
        """Writes this rank's loss, waits for every rank's (the barrier) and returns them, in rank order. Rows
        alternate by barrier: the next write goes to the other row, the one after it waits for every rank here."""
        row = self._losses[self._step % 2]
        row[self._rank] = loss
        self._barrier()
        return row.copy()

    def average(self, k: int, shares: list[float]) -> None:
        """Σ sᵣ·Aᵣ over the ranks with a share, in rank order, of this rank's shard of every rank's set ``k``,
        written into that shard of every rank's set (the sum's first term in place); then the barrier."""
        sets, live = self._sets[k], [r for r, share in enumerate(shares) if share > 0]
        size, align = sets.shape[1], max(1, 64 // self._dtype.itemsize)
        lo, hi = (min(size, -(-size * r // self._world // align) * align) for r in (self._rank, self._rank + 1))
        total = sets[live[0], lo:hi]  # NOTE: whole shards: blocks sized for L2 measured slower (W5: 0.8 ms, 0.5)
        if len(live) > 1:  # NOTE: one rank with rows: its share is 1, its set the average
            np.multiply(total, shares[live[0]], out=total)
            for r in live[1:]:
                part = sets[r, lo:hi]
                np.multiply(part, shares[r], out=part)
                np.add(total, part, out=total)
        for r in range(self._world):
            if r != live[0]:
                np.copyto(sets[r, lo:hi], total)
        self._barrier()


class _RankRunner(Runner):
    """The fused step's ``Runner`` of a rank in mode "weights", its buffer sets in ``memory`` (``_SharedSets``)."""

    def __init__(self, step: TrainStep, memory, **kwargs):
        self._memory = memory
        super().__init__(step, **kwargs)


class DataParallelRunner:
    """A ``Runner`` for one rank: ``step``/``epoch`` take the *global* batch and train this rank's rows of it.

    Rank r of N trains rows [n·r/N, n·(r+1)/N) of each batch of n rows, in ``sync_every`` micro-batches whose
    gradients it accumulates before the all-reduce and the update: the weights of one process with batch n.
    ``transport``: "shm" (ranks on one host: a shared-memory all-reduce), "gloo" (torch.distributed; with
    ``buckets`` > 1 the gradient step split into that many pieces (``pieces``), each bucket's all-reduce started as
    its piece ends; ``compress``="bf16" or "fp16" halves the bytes sent: not bit-equal) or "auto" (shm where every
    rank maps it and nothing is compressed, else gloo). ``device``: "cpu" or "cuda" (gradients staged through host
    memory: the module's docstring). ``fused``: the fused step (``compile_train_step`` with the same options); with
    shm ranks on the CPU, ``sync_every`` 1 and an update ``affine`` in the gradient, each rank runs it on its rows
    and the ranks average weights and state by their shares (``reduces`` "weights", as exact: the module's
    docstring), else they all-reduce gradients (``reduces`` "gradients"). Weights, state, ``export`` and the
    rest of the ``Runner`` API come from ``updater`` (the update step's Runner, or the fused step's in mode
    "weights"); rank 0 alone writes checkpoints.
    """

    def __init__(self, grad: TrainStep, update: TrainStep, device: str = "cpu", batch_size: int = 32,
                 session_options: ort.SessionOptions | None = None, sync_every: int = 1, compress: str | None = None,
                 transport: str = "auto", buckets: int = 1, fused: TrainStep | None = None):
        for name, value, ok, expected in (
                ("device", device, device in ("cpu", "cuda"), "'cpu' or 'cuda'"),
                ("sync_every", sync_every, type(sync_every) is int and sync_every >= 1, "an integer >= 1"),
                ("buckets", buckets, type(buckets) is int and buckets >= 1, "an integer >= 1"),
                ("compress", compress, compress in (None, *COMPRESS), f"None or one of {sorted(COMPRESS)}"),
                ("transport", transport, transport in ("auto", "gloo", "shm") and not (compress and transport == "shm"),
                 "'auto', 'gloo' or 'shm' ('shm' sends nothing to compress)")):
            if not ok:
                raise DataError(f"{name}: expected {expected}, got {value!r}")
        self.rank, self.world, self._dist = world()
        self.train_step, self.device, self.batch_size, self.sync_every = grad, device, batch_size, sync_every
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

        digest = hashlib.sha256(grad.model.SerializeToString() + update.model.SerializeToString()).hexdigest()
        self._agree("the compiled steps (model, loss, update, options)",
                    (digest[:16], sync_every, compress, transport, buckets, fused is not None))
        rows = max(1, batch_size // (self.world * sync_every))
        self.reduces, self.transport, self._reducer, self._pieces = "gradients", None, None, []
        self._bindings: dict[tuple, object] = {}
        self._checked = False
        if fused is not None and _averages(update, device, sync_every, compress, transport):
            shared = _SharedSets(self._dist, self.rank, self.world, next(iter(weights.values())).dtype)
            self.updater = _RankRunner(fused, shared.memory, session_options=options(rows), batch_size=rows)
            if shared.mapped:  # NOTE: else not on one host: the gradient path below (gloo, or shm refused)
                self._reducer, self.reduces, self.transport, self.x_dtype = shared, "weights", "shm", self.updater.x_dtype
                return
        self.updater = Runner(update, device, session_options=options(1), batch_size=1)  # NOTE: checks CUDA
        if device == "cuda":  # NOTE: gradients staged through host memory (module docstring): no NCCL
            model, providers = cuda_model(grad.model), ["CUDAExecutionProvider", "CPUExecutionProvider"]
        else:  # NOTE: ReluGrad as a masked product, as the Runner's CPU model (-5% W3)
            model, providers = ir.from_proto(grad.model), ["CPUExecutionProvider"]
            model = ir.to_proto(model) if masked_relu_grads(model, rows) else grad.model
        self.session = ort.InferenceSession(_without_values(model, weights), options(rows), providers=providers)
        types = {i.name: i.type for i in self.session.get_inputs()}
        self.x_dtype = _numpy(types[grad.inputs[0]])
        self._y_dtype = _numpy(types[grad.target]) if grad.target else None
        if self._dist is not None and self.world > 1:
            if transport != "gloo" and not compress:
                self._reducer = _Shared.open(self._dist, self.rank, self.world, self._size, self.updater.dtype)
                if self._reducer is None and transport == "shm":
                    raise DistributedError("transport: 'shm' needs every rank on one host, mapping one shared-memory "
                                           "file; some rank could not (use transport='auto' or 'gloo')")
            if self._reducer is None:
                self._reducer = _Gloo(self._dist, self._size, self.updater.dtype, buckets, compress)
            self.transport = "shm" if isinstance(self._reducer, _Shared) else "gloo"
        if isinstance(self._reducer, _Gloo) and buckets > 1 and sync_every == 1:
            sizes = {name: math.prod(shape) for name, shape in self._grad_shapes.items()}
            starts = dict(zip(sizes, np.cumsum([0, *sizes.values()]).tolist()))
            split = pieces(model, sizes, buckets)
            for piece, bucket in split if len(split) > 1 else []:
                merged: list[list[int]] = []  # NOTE: the bucket's slices of the flat buffer, adjacent ones joined
                for a, b in sorted((starts[w], starts[w] + sizes[w]) for w in bucket):
                    if merged and merged[-1][1] == a:
                        merged[-1][1] = b
                    else:
                        merged.append([a, b])
                session = ort.InferenceSession(_without_values(piece, weights), options(rows), providers=providers)
                self._pieces.append((session, [tuple(r) for r in merged]))
        # NOTE: [Σ s·g, Σ s·loss]: the gradient step writes it, the all-reduce sums it into ``_result``
        self._flat = None if self._reducer else np.zeros(self._size + 1, self.updater.dtype)
        self._result = self._reducer.result if self._reducer else self._flat
        self._scratch = np.zeros_like(self._result) if sync_every > 1 else None  # NOTE: micro-batches after the first
        self._loss = np.zeros((), self.updater.dtype)
        self._ones_cache = np.ones(0, self.updater.dtype)
        lean = _per_weight(self.updater._sessions.free, self._grad_shapes)
        self._update = lean and self.updater._sessions.bindings_of(lean)  # NOTE: (session, binding per set)
        for raw in self._update[1] if self._update and device == "cpu" else []:  # NOTE: CUDA copies each step
            for name, view in self._views(self._result).items():
                raw.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(view)._ortvalue)

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

    def _binding(self, scratch: bool) -> ort.IOBinding:
        """The gradient session's binding reading the updater's current weights and writing into the flat buffer
        (or, for a micro-batch after the first, the scratch one): one per buffer set and target."""
        key = (self.updater._ring.current, scratch, self._buffer.ctypes.data)
        if key not in self._bindings:
            binding = self.session.io_binding()
            for name, value in self.updater.current_values().items():
                if name in self._roles.weights:
                    binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(self._roles.loss, ort.OrtValue.ortvalue_from_numpy(self._loss))
            for name, view in self._views(self._scratch if scratch else self._buffer).items():
                binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(view))
            self._bindings[key] = binding
        return self._bindings[key]

    @property
    def _buffer(self) -> np.ndarray:
        """Where this step's gradient step writes: the reducer's buffer (shm: a slot per step parity)."""
        return self._reducer.buffer if self._reducer else self._flat

    def _views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Each gradient output's view of ``flat``."""
        views, offset = {}, 0
        for name, shape in self._grad_shapes.items():
            size = math.prod(shape)
            views[f"{GRADS}/{name}"], offset = flat[offset:offset + size].reshape(shape), offset + size
        return views

    def _piece_bindings(self) -> list[tuple[ort.IOBinding, set[str], list[str], set[str]]]:
        """Per piece of the split gradient step: its binding (weights of the current set, gradients into the
        flat buffer, values for later pieces allocated by ORT), its inputs, its outputs in order, those values."""
        key = (self.updater._ring.current, "pieces")
        if key not in self._bindings:
            values, views, made = self.updater.current_values(), self._views(self._buffer), []
            for session, _ in self._pieces:
                binding, inputs = session.io_binding(), {i.name for i in session.get_inputs()}
                for name in inputs & set(self._roles.weights):
                    binding.bind_ortvalue_input(name, values[name])
                order = [o.name for o in session.get_outputs()]
                for name in order:
                    if name in views or name == self._roles.loss:
                        array = views[name] if name in views else self._loss
                        binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(array))
                    else:  # NOTE: bound in the session's order once; rebinding a name keeps its place
                        binding.bind_output(name, self.device)
                made.append((binding, inputs, order, set(order) - set(views) - {self._roles.loss}))
            self._bindings[key] = made
        return self._bindings[key]

    def _split_step(self, feeds: dict, share: float) -> None:
        """The pieces of the gradient step in order, each one's gradients scaled by ``share`` and their all-reduce
        started as it ends (overlapping the next piece), then the loss's."""
        env, buf = {}, self._buffer
        for (session, ranges), (binding, inputs, order, passed) in zip(self._pieces, self._piece_bindings()):
            for name, value in feeds.items():
                if name in inputs:
                    binding.bind_cpu_input(name, value)
            for name in inputs & env.keys():
                binding.bind_ortvalue_input(name, env[name])
            for name in passed:  # NOTE: allocated by ORT each run: the last batch of an epoch may be shorter
                binding.bind_output(name, self.device)
            session.run_with_iobinding(binding)
            if passed:
                env.update((n, v) for n, v in zip(order, binding.get_outputs()) if n in passed)
            for a, b in ranges:
                if share != 1:
                    np.multiply(buf[a:b], share, out=buf[a:b])
                self._collective(lambda a=a, b=b: self._reducer.start(a, b), "the gradient all-reduce")
        buf[self._size] = float(self._loss) * share

    def step(self, X, y=None, sample_weight=None) -> float:
        """One update on the global batch (X, y, sample_weight): this rank's rows in ``sync_every`` micro-batches,
        their gradients accumulated, the all-reduce, the update; returns the batch's loss."""
        X = as_array(X, self.x_dtype, "X")
        n, roles, size = len(X), self._roles, self._size
        if not self._checked:  # NOTE: once: schemas and the step counter (a resume from another checkpoint)
            shape = lambda a: None if a is None else (np.shape(a)[1:], str(np.asarray(a).dtype))  # noqa: E731
            self._agree("the data schema and step count (X, y, sample_weight, batch rows, steps done)",
                        (shape(X), shape(y), shape(sample_weight), n, self.updater.step_count))
            self._checked = True
        lo, hi = n * self.rank // self.world, n * (self.rank + 1) // self.world
        sw = None if sample_weight is None else as_array(sample_weight, self.updater.dtype, "sample_weight")
        if self.reduces == "weights":
            return self._average_step(X, y, sw)
        total = n if sw is None else float(sw.sum(dtype=np.float64))  # NOTE: every rank holds the global batch's
        target = None if y is None else as_array(y, self._y_dtype, "y")  # weights: its share needs no collective
        buf, first, k = self._buffer, True, self.sync_every
        for j in range(k):
            a, b = lo + (hi - lo) * j // k, lo + (hi - lo) * (j + 1) // k
            weight = b - a if sw is None else float(sw[a:b].sum(dtype=np.float64))
            if not weight > 0:
                continue
            share = weight / total  # NOTE: 1 on one rank and micro-batch: no pass over the gradients
            feeds = {roles.data[0]: X[a:b], roles.target: None if target is None else target[a:b],
                     roles.sample_weight: self._ones(b - a) if sw is None else sw[a:b]}
            feeds = {name: np.ascontiguousarray(value) for name, value in feeds.items() if name is not None}
            if self._pieces:  # NOTE: sync_every 1: the only micro-batch
                self._split_step(feeds, share)
                first = False
                break
            binding = self._binding(scratch=not first)
            for name, value in feeds.items():
                binding.bind_cpu_input(name, value)
            self.session.run_with_iobinding(binding)
            if first:
                if share != 1:
                    np.multiply(buf[:size], share, out=buf[:size])
                buf[size] = float(self._loss) * share
            else:
                part = self._scratch[:size]
                np.multiply(part, share, out=part)
                np.add(buf[:size], part, out=buf[:size])
                buf[size] += float(self._loss) * share
            first = False
        if first:  # NOTE: no rows (or weight) here: this rank adds zeros
            buf[:] = 0
        if self._pieces:  # NOTE: every rank issues the same all-reduces: the pieces' slices, then the loss
            if first:
                for a, b in (r for _, ranges in self._pieces for r in ranges):
                    self._collective(lambda a=a, b=b: self._reducer.start(a, b), "the gradient all-reduce")
            self._collective(lambda: (self._reducer.start(size, size + 1), self._reducer.wait()),
                             "the gradient all-reduce")
        elif self._reducer is not None:
            self._collective(self._reducer.reduce, "the gradient all-reduce")
        loss = float(self._result[size])
        if not math.isfinite(loss):
            raise ConvergenceError(f"loss became {loss} at step {self.updater.step_count + 1}; the weights are "
                                   f"those that gave the last finite loss (step {self.updater.step_count}), see "
                                   "get_weights()")
        self._apply()
        return loss

    def _average_step(self, X: np.ndarray, y, sw: np.ndarray | None) -> float:
        """Mode "weights": the fused step on this rank's rows, then every rank's weights and state averaged by
        their shares (Σ sᵣ·Aᵣ, in rank order: the same bits on every rank), exact for an update affine in the
        gradient (``affine``); a rank without rows (or weight) steps on one row with share 0, its result unread."""
        n, ring, k = len(X), self.updater._ring, self.world
        bounds = [n * r // k for r in range(k + 1)]
        weights = [float(b - a) if sw is None else float(sw[a:b].sum(dtype=np.float64))
                   for a, b in zip(bounds, bounds[1:])]
        total = sum(weights)
        shares = [w / total if total > 0 else 0.0 for w in weights]
        live = [r for r in range(k) if shares[r] > 0]
        mine, start = shares[self.rank] > 0, ring.current
        rows = slice(bounds[self.rank], bounds[self.rank + 1]) if mine else slice(0, 1)
        try:
            loss = self.updater.step(X[rows], None if y is None else y[rows], sw[rows] if mine and sw is not None
                                     else None)
            stepped = True
        except ConvergenceError:  # NOTE: the Runner stepped back past this step's inputs: back to them
            loss, stepped = math.nan, False
            if ring.current != start:
                ring.advance()
        got: list[np.ndarray] = []
        self._collective(lambda: got.append(self._reducer.exchange(loss)), "the weight average")
        loss = sum(shares[r] * float(got[0][r]) for r in live) if live else math.nan
        if not math.isfinite(loss):
            if stepped:
                ring.step_back()  # NOTE: every rank keeps the weights before this step
            raise ConvergenceError(f"loss became {loss} at step {self.updater.step_count + 1}; the weights are "
                                   f"those before it (step {self.updater.step_count}), see get_weights()")
        if not stepped:
            ring.advance()  # NOTE: the failed run wrote this step's set (its step counter too); the average follows
        self._collective(lambda: self._reducer.average(ring.current, shares), "the weight average")
        return loss

    def _apply(self) -> None:
        """The update on the reduced gradients, each weight's read where it lies in ``_result`` (CUDA: copied up)."""
        if not self._update:
            self.updater.step(self._result[:self._size])
            return
        (session, raws), ring = self._update, self.updater._ring
        with self.updater._lock:
            if self.device == "cuda":
                for name, view in self._views(self._result).items():
                    raws[ring.current].bind_ortvalue_input(
                        name, ort.OrtValue.ortvalue_from_numpy(view, "cuda")._ortvalue)
            session.run_with_iobinding(raws[ring.current], None)
            ring.advance()

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
