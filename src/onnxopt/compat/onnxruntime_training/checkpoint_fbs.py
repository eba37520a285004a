"""onnxruntime's training checkpoint file, read and written with the ``flatbuffers`` runtime.

The layout is onnxruntime's schema ``onnxruntime/core/flatbuffers/schema/ort_training_checkpoint.fbs`` (and the
``Tensor`` table of ``ort.fbs``), file identifier ``ODTC``; the readers and writers below keep its table names,
fields in schema order (the slot number is the field's index), so they can be held side by side with it::

    Checkpoint {version:int32; module_state:ModuleState; optimizer_groups:[OptimizerGroup]; property_bag:PropertyBag}
    ModuleState {requires_grad_params:[Tensor]; frozen_params:[Tensor]; is_nominal_state:bool; has_external_data:bool}
    OptimizerGroup {group_name:string; step:int64; initial_learning_rate:float; optimizer_states:[ParameterOptimizerState]}
    ParameterOptimizerState {param_name:string; momentums:[Tensor]}
    PropertyBag {ints:[IntProperty]; floats:[FloatProperty]; strings:[StringProperty]}   # {name; value}
    Tensor {name:string; doc_string:string; dims:[int64]; data_type:TensorDataType; raw_data:[uint8]; string_data:[string]}

``TensorDataType`` numbers are ``onnx.TensorProto``'s. A nominal checkpoint holds the parameters' names, types
and shapes without data (onnxruntime writes them with empty ``raw_data``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import flatbuffers
import numpy as np
import onnx_ir as ir
from flatbuffers import number_types as nt
from flatbuffers.table import Table

from onnxopt.errors import CheckpointError

__all__ = ["Checkpoint", "OptimizerGroup", "load", "save", "loads", "dumps"]

FILE_IDENTIFIER = b"ODTC"
VERSION = 2  # NOTE: what onnxruntime-training 1.19 writes (kCheckpointVersion); versions 1-2 read the same here


@dataclasses.dataclass
class OptimizerGroup:
    """One ``OptimizerGroup``: its step count, initial learning rate and each parameter's momentums by name
    (onnxruntime names them ``momentum0``, ``momentum1``)."""

    group_name: str = "group0"
    step: int = 0
    initial_learning_rate: float = 0.0
    optimizer_states: dict[str, dict[str, np.ndarray]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Checkpoint:
    """A ``Checkpoint`` table: parameters (arrays, or ``(dtype, shape)`` when nominal), optimizer groups and
    the property bag (int, float and str values)."""

    requires_grad_params: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    frozen_params: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    optimizer_groups: list[OptimizerGroup] = dataclasses.field(default_factory=list)
    properties: dict[str, int | float | str] = dataclasses.field(default_factory=dict)
    is_nominal_state: bool = False
    version: int = VERSION


# ---- reading: a Table per schema table, a field read by its slot


def _field(tab: Table, slot: int) -> int:
    return tab.Offset(4 + 2 * slot)


def _table(tab: Table, slot: int) -> Table | None:
    o = _field(tab, slot)
    return Table(tab.Bytes, tab.Indirect(o + tab.Pos)) if o else None


def _tables(tab: Table, slot: int) -> list[Table]:
    o = _field(tab, slot)
    if not o:
        return []
    start = tab.Vector(o)
    return [Table(tab.Bytes, tab.Indirect(start + 4 * i)) for i in range(tab.VectorLen(o))]


def _string(tab: Table, slot: int) -> str:
    o = _field(tab, slot)
    return tab.String(o + tab.Pos).decode() if o else ""


def _scalar(tab: Table, slot: int, flags, default=0):
    o = _field(tab, slot)
    return tab.Get(flags, o + tab.Pos) if o else default


def _read_tensor(tab: Table, nominal: bool) -> tuple[str, np.ndarray]:
    name = _string(tab, 0)
    o = _field(tab, 2)
    dims = tuple(int(d) for d in tab.GetVectorAsNumpy(nt.Int64Flags, o)) if o else ()
    dtype = ir.DataType(_scalar(tab, 3, nt.Int32Flags))
    if dtype == ir.DataType.STRING:
        o = _field(tab, 5)
        start = tab.Vector(o) if o else 0
        items = [tab.String(start + 4 * i) for i in range(tab.VectorLen(o))] if o else []
        return name, np.array(items, dtype=object).reshape(dims)
    o = _field(tab, 4)
    raw = tab.GetVectorAsNumpy(nt.Uint8Flags, o) if o else np.zeros(0, np.uint8)
    if nominal or (raw.size == 0 and int(np.prod(dims)) != 0):
        return name, np.zeros(dims, dtype.numpy())
    return name, raw.view(dtype.numpy()).reshape(dims).copy()


def loads(data: bytes) -> Checkpoint:
    """The checkpoint held in ``data`` (a file's bytes)."""
    buf = bytearray(data)
    if len(buf) < 8 or bytes(buf[4:8]) != FILE_IDENTIFIER:
        raise CheckpointError(f"checkpoint: expected onnxruntime's training checkpoint (file identifier "
                              f"{FILE_IDENTIFIER!r}), got {bytes(buf[4:8])!r}")
    root = Table(buf, flatbuffers.encode.Get(flatbuffers.packer.uoffset, buf, 0))
    ckpt = Checkpoint(version=_scalar(root, 0, nt.Int32Flags))
    if ckpt.version not in (1, 2):
        raise CheckpointError(f"checkpoint: expected version 1 or 2, got {ckpt.version}")
    module = _table(root, 1)
    if module is not None:
        ckpt.is_nominal_state = bool(_scalar(module, 2, nt.BoolFlags, False))
        if _scalar(module, 3, nt.BoolFlags, False):
            raise CheckpointError("checkpoint: has_external_data=true (parameters in a separate file) is not "
                                  "supported; expected the parameters inside the checkpoint")
        ckpt.requires_grad_params = dict(_read_tensor(t, ckpt.is_nominal_state) for t in _tables(module, 0))
        ckpt.frozen_params = dict(_read_tensor(t, ckpt.is_nominal_state) for t in _tables(module, 1))
    for g in _tables(root, 2):
        states = {_string(s, 0): dict(_read_tensor(t, False) for t in _tables(s, 1)) for s in _tables(g, 3)}
        ckpt.optimizer_groups.append(OptimizerGroup(_string(g, 0), int(_scalar(g, 1, nt.Int64Flags)),
                                                    float(_scalar(g, 2, nt.Float32Flags, 0.0)), states))
    bag = _table(root, 3)
    if bag is not None:
        for slot, flags, cast in ((0, nt.Int64Flags, int), (1, nt.Float32Flags, float)):
            ckpt.properties.update({_string(p, 0): cast(_scalar(p, 1, flags)) for p in _tables(bag, slot)})
        ckpt.properties.update({_string(p, 0): _string(p, 1) for p in _tables(bag, 2)})
    return ckpt


def load(path: str | Path) -> Checkpoint:
    """The checkpoint in file ``path``."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint: expected a checkpoint file, got {str(path)!r} (no such file)")
    return loads(path.read_bytes())


# ---- writing: children first (flatbuffers builds back to front), then each table's slots


def _vector_of_offsets(b: flatbuffers.Builder, offsets: list[int]) -> int:
    b.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return b.EndVector()


def _write_tensor(b: flatbuffers.Builder, name: str, value: np.ndarray, nominal: bool = False) -> int:
    value = np.asarray(value)
    dtype = ir.DataType.STRING if value.dtype == object else ir.DataType.from_numpy(value.dtype)
    name_off = b.CreateString(name)
    dims_off = b.CreateNumpyVector(np.asarray(value.shape, np.int64))
    data_off = strings_off = None
    if dtype == ir.DataType.STRING:
        strings_off = _vector_of_offsets(b, [b.CreateString(str(s)) for s in value.ravel()])
    else:
        raw = b"" if nominal else np.ascontiguousarray(value).astype(value.dtype.newbyteorder("<")).tobytes()
        data_off = b.CreateByteVector(raw)
    b.StartObject(6)
    b.PrependUOffsetTRelativeSlot(0, name_off, 0)
    b.PrependUOffsetTRelativeSlot(2, dims_off, 0)
    b.PrependInt32Slot(3, int(dtype), 0)
    if data_off is not None:
        b.PrependUOffsetTRelativeSlot(4, data_off, 0)
    if strings_off is not None:
        b.PrependUOffsetTRelativeSlot(5, strings_off, 0)
    return b.EndObject()


def _write_named(b: flatbuffers.Builder, name: str, value: int | float | str) -> int:
    """An ``IntProperty``, ``FloatProperty`` or ``StringProperty`` (all ``{name; value}``)."""
    name_off = b.CreateString(name)
    value_off = b.CreateString(value) if isinstance(value, str) else None
    b.StartObject(2)
    b.PrependUOffsetTRelativeSlot(0, name_off, 0)
    if value_off is not None:
        b.PrependUOffsetTRelativeSlot(1, value_off, 0)
    elif isinstance(value, float):
        b.PrependFloat32Slot(1, value, 0.0)
    else:
        b.PrependInt64Slot(1, value, 0)
    return b.EndObject()


def dumps(ckpt: Checkpoint) -> bytes:
    """``ckpt`` as the bytes of a checkpoint file."""
    b = flatbuffers.Builder(1024)
    nominal = ckpt.is_nominal_state
    grads = _vector_of_offsets(b, [_write_tensor(b, k, v, nominal) for k, v in ckpt.requires_grad_params.items()])
    frozen = _vector_of_offsets(b, [_write_tensor(b, k, v, nominal) for k, v in ckpt.frozen_params.items()])
    b.StartObject(4)  # ModuleState
    b.PrependUOffsetTRelativeSlot(0, grads, 0)
    b.PrependUOffsetTRelativeSlot(1, frozen, 0)
    b.PrependBoolSlot(2, nominal, False)
    b.PrependBoolSlot(3, False, False)
    module = b.EndObject()
    groups = []
    for g in ckpt.optimizer_groups:
        states = []
        for param, momentums in g.optimizer_states.items():
            tensors = _vector_of_offsets(b, [_write_tensor(b, k, v) for k, v in momentums.items()])
            param_off = b.CreateString(param)
            b.StartObject(2)  # ParameterOptimizerState
            b.PrependUOffsetTRelativeSlot(0, param_off, 0)
            b.PrependUOffsetTRelativeSlot(1, tensors, 0)
            states.append(b.EndObject())
        states_off = _vector_of_offsets(b, states)
        name_off = b.CreateString(g.group_name)
        b.StartObject(4)  # OptimizerGroup
        b.PrependUOffsetTRelativeSlot(0, name_off, 0)
        b.PrependInt64Slot(1, int(g.step), 0)
        b.PrependFloat32Slot(2, float(g.initial_learning_rate), 0.0)
        b.PrependUOffsetTRelativeSlot(3, states_off, 0)
        groups.append(b.EndObject())
    groups_off = _vector_of_offsets(b, groups)
    kinds = [[(k, v) for k, v in ckpt.properties.items() if isinstance(v, t) and not isinstance(v, bool)]
             for t in (int, float, str)]
    odd = [k for k, v in ckpt.properties.items() if isinstance(v, bool) or not isinstance(v, (int, float, str))]
    if odd:
        raise CheckpointError(f"checkpoint: property {odd[0]!r} must be an int, a float or a str, got "
                              f"{type(ckpt.properties[odd[0]]).__name__}")
    bag_vectors = [_vector_of_offsets(b, [_write_named(b, k, v) for k, v in kind]) for kind in kinds]
    b.StartObject(3)  # PropertyBag
    for slot, off in enumerate(bag_vectors):
        b.PrependUOffsetTRelativeSlot(slot, off, 0)
    bag = b.EndObject()
    b.StartObject(4)  # Checkpoint
    b.PrependInt32Slot(0, ckpt.version, 0)
    b.PrependUOffsetTRelativeSlot(1, module, 0)
    b.PrependUOffsetTRelativeSlot(2, groups_off, 0)
    b.PrependUOffsetTRelativeSlot(3, bag, 0)
    b.Finish(b.EndObject(), file_identifier=FILE_IDENTIFIER)
    return bytes(b.Output())


def save(ckpt: Checkpoint, path: str | Path) -> None:
    """Writes ``ckpt`` to file ``path``."""
    Path(path).write_bytes(dumps(ckpt))
