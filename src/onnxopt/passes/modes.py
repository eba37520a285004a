"""Training and evaluation mode (torch's ``module.train()`` / ``module.eval()``), applied before the gradient.

- ``split_statistics`` (both modes): a BatchNormalization running statistic that shares its tensor with
  anything else (an exporter merged equal initializers: a fresh ``running_var`` equals ``weight``) gets its
  own initializer, so training the weight never changes the statistic and the reverse;
- ``eval``: Dropout is the identity; BatchNormalization is its inference formula in standard ops, the running
  statistics constants (scale and bias stay weights);
- ``None`` (``gradient_model``, ``ForwardBackward``): each node as its own attributes say, without carried
  statistics, so onnxruntime's in-place training kernel never runs;
- ``train``: Dropout is active (``training_mode`` true, its mask output completed for the gradient);
  BatchNormalization normalizes with the batch's mean and biased variance, and ``running_updates`` adds
  the running statistics as carried state ``<stat>`` -> ``<stat>.new`` updated as torch does
  (``r ← momentum·r + (1-momentum)·batch``, the variance unbiased), never written in place.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from onnxopt.errors import ModelError

__all__ = ["MODES", "RunningStat", "split_statistics", "apply_mode", "running_updates"]

MODES = ("train", "eval")
_STATS = {3: "running_mean", 4: "running_var"}
_REGION = "onnxopt.region"


@dataclasses.dataclass
class RunningStat:
    """One carried running statistic: its name (an initializer of the model), starting value, the value name
    of its batch statistic (shape (1, C, 1)), the reshaped BatchNormalization input (N, C, M) and momentum."""

    name: str
    value: ir.TensorProtocol
    batch: str
    data: str
    momentum: float
    unbiased: bool


def _constant(tape: ir.tape.Tape, array) -> ir.Value:
    return tape.op("Constant", [], {"value": ir.tensor(np.asarray(array))})


def _stat_initializer(graph: ir.Graph, node: ir.Node, slot: int) -> ir.Value:
    """The constant read at ``slot``: an initializer, through Identity nodes (TorchScript's
    ``Identity(weight)``), or a Constant node's output (its ``const_value`` then set)."""
    value = node.inputs[slot] if len(node.inputs) > slot else None
    while value is not None and value.const_value is None and value.producer() is not None \
            and value.producer().op_type == "Identity":
        value = value.producer().inputs[0]
    producer = value.producer() if value is not None else None
    if value is not None and value.const_value is None and producer is not None and producer.op_type == "Constant" \
            and "value" in producer.attributes:
        value.const_value = producer.attributes["value"].as_tensor()
    if value is None or value.const_value is None:
        raise ModelError(f"model: BatchNormalization node {node.name!r} reads its {_STATS[slot]} from a computed "
                         "value; expected an initializer (export the model with its statistics as parameters)")
    return value


def _stat_name(graph: ir.Graph, node: ir.Node, slot: int) -> str:
    scale = node.inputs[1].name if len(node.inputs) > 1 and node.inputs[1] is not None else ""
    base = scale[: -len(".weight")] if scale.endswith(".weight") else (node.name or "BatchNormalization")
    # NOTE: every name of the graph, not only initializers: TorchScript's Identity(weight) outputs are named so
    taken = {*graph.initializers, *(v.name for v in graph.inputs), *(v.name for n in graph for v in n.outputs)}
    name, k = f"{base}.{_STATS[slot]}", 1
    while name in taken:
        name, k = f"{base}.{_STATS[slot]}_{k}", k + 1
    return name


def split_statistics(m: ir.Model) -> list[str]:
    """Gives each BatchNormalization statistic read elsewhere too its own initializer; returns the new names.

    A statistic read as ``Identity(weight)`` (TorchScript's export of equal tensors) takes that Identity's
    output name, and the Identity goes, so an exported model defines each name once."""
    made = []
    for node in list(m.graph):
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        for slot in _STATS:
            value, read = _stat_initializer(m.graph, node, slot), node.inputs[slot]
            if read is value and value.is_initializer() and len(value.uses()) == 1 and not value.is_graph_output():
                continue
            copy = ir.Value(type=value.type, shape=value.shape, const_value=ir.tensor(value.const_value.numpy().copy()))
            node.replace_input_with(slot, copy)
            alias = read.producer()
            if alias is not None and alias.op_type == "Identity" and not read.uses() and not read.is_graph_output():
                m.graph.remove(alias, safe=True)
                copy.name = read.name
            else:
                copy.name = _stat_name(m.graph, node, slot)
            m.graph.register_initializer(copy)
            made.append(copy.name)
    return made


def _node_mode(node: ir.Node) -> str:
    """The mode a Dropout or BatchNormalization node is written in (its training_mode)."""
    if node.op_type == "BatchNormalization":
        attr = node.attributes.get("training_mode")
        return "train" if attr is not None and attr.as_int() else "eval"
    flag = node.inputs[2] if len(node.inputs) > 2 else None
    if flag is None:
        return "eval"
    if flag.const_value is None and flag.producer() is not None and flag.producer().op_type == "Constant":
        flag = flag.producer().attributes["value"].as_tensor()
    else:
        flag = flag.const_value
    if flag is None:
        raise ModelError(f"model: Dropout node {node.name!r} takes a computed training_mode; expected a constant "
                         "(or compile_train_step(mode=...))")
    return "train" if bool(flag.numpy()) else "eval"


def _drop_unused(graph: ir.Graph, values) -> None:
    for value in values:
        if value is None or value.uses() or value.is_graph_output() or value.is_graph_input():
            continue
        if value.producer() is not None and value.producer().op_type == "Constant":
            graph.remove(value.producer(), safe=True)
        elif value.name in graph.initializers and value.const_value is not None:
            del graph.initializers[value.name]


def _dropout(graph: ir.Graph, node: ir.Node, mode: str, seed: int) -> None:
    y, flags = node.outputs[0], list(node.inputs[1:])
    if mode == "eval":
        if len(node.outputs) > 1 and node.outputs[1].uses():
            raise ModelError(f"model: Dropout node {node.name!r} has its mask read by other nodes; expected only "
                             "its output used in mode='eval' (use mode='train')")
        if y.is_graph_output():  # NOTE: an Identity keeps the output's name (the input may be a graph input)
            tape = ir.tape.Tape()
            out = tape.op("Identity", [node.inputs[0]])
            graph.insert_before(node, tape.nodes)
            ir.convenience.replace_all_uses_with(y, out, replace_graph_outputs=True)
            out.name = y.name
        else:
            ir.convenience.replace_all_uses_with(y, node.inputs[0], replace_graph_outputs=False)
        graph.remove(node, safe=True)
        _drop_unused(graph, flags)
        return
    tape = ir.tape.Tape()
    ratio = node.inputs[1] if len(node.inputs) > 1 else None
    ratio = ratio if ratio is not None else _constant(tape, np.float32(0.5))
    # NOTE: ORT's DropoutGrad reads the mask output, which exporters omit; training_mode is forced on
    # NOTE: a seed per node: masks are reproducible and differ from run to run (unseeded, ORT's shared
    # generator gives the same mask to the first two runs of a session)
    attrs = {"seed": ir.AttrInt64("seed", seed), **node.attributes}
    new = ir.Node("", "Dropout", [node.inputs[0], ratio, _constant(tape, np.bool_(True))], attrs.values(),
                  num_outputs=2, name=node.name, metadata_props=dict(node.metadata_props))
    new.outputs[1].name = (node.name or y.name) + ".mask"
    graph.insert_before(node, [*tape.nodes, new])
    for old, out in zip(node.outputs, new.outputs):
        name = old.name
        out.type, out.shape = old.type, old.shape
        ir.convenience.replace_all_uses_with(old, out, replace_graph_outputs=True)
        out.name = name if old.name else out.name
    new.outputs[1].type = ir.TensorType(ir.DataType.BOOL)
    graph.remove(node, safe=True)
    _drop_unused(graph, flags)


def _batch_norm(graph: ir.Graph, node: ir.Node, mode: str) -> list[RunningStat]:
    """(x - mean)·(scale / √(var + eps)) + bias over (N, C, M) = x reshaped, with the model's statistics
    (eval) or the batch's (train)."""
    if len(node.outputs) > 1 and any(v.uses() or v.is_graph_output() for v in node.outputs[1:]):
        raise ModelError(f"model: BatchNormalization node {node.name!r} has its running-statistics outputs read; "
                         "expected only its first output used (onnxopt carries the statistics itself)")
    attrs = node.attributes
    eps = attrs["epsilon"].as_float() if "epsilon" in attrs else 1e-5
    momentum = attrs["momentum"].as_float() if "momentum" in attrs else 0.9
    x, scale, bias = node.inputs[:3]
    stats = [_stat_initializer(graph, node, slot) for slot in _STATS]
    tape = ir.tape.Tape()
    channel = _constant(tape, np.array([1, -1, 1], np.int64))
    xr = tape.op("Reshape", [x, _constant(tape, np.array([0, 0, -1], np.int64))])
    axes = _constant(tape, np.array([0, 2], np.int64))
    if mode == "train":
        mean = tape.op("ReduceMean", [xr, axes], {"keepdims": 1})
        d = tape.op("Sub", [xr, mean])
        var = tape.op("ReduceMean", [tape.op("Mul", [d, d]), axes], {"keepdims": 1})
    else:  # NOTE: constants, copies: nothing trains them and no weight shares their memory
        mean, var = (_constant(tape, s.const_value.numpy().reshape(1, -1, 1).copy()) for s in stats)
        d = tape.op("Sub", [xr, mean])
    eps_value = tape.op("CastLike", [_constant(tape, np.array(eps, np.float64)), var])
    std = tape.op("Sqrt", [tape.op("Add", [var, eps_value])])
    factor = tape.op("Div", [tape.op("Reshape", [scale, channel]), std])
    yr = tape.op("Add", [tape.op("Mul", [d, factor]), tape.op("Reshape", [bias, channel])])
    y = tape.op("Reshape", [yr, tape.op("Shape", [x])])
    for n in tape.nodes:
        n.metadata_props.update(node.metadata_props)
    graph.insert_before(node, tape.nodes)
    out = node.outputs[0]
    y.type, y.shape = out.type, out.shape
    ir.convenience.replace_all_uses_with(out, y, replace_graph_outputs=True)
    y.name = out.name
    graph.remove(node, safe=True)
    if mode != "train":
        return []
    prefix = node.name or out.name
    xr.name, mean.name, var.name = f"{prefix}.data", f"{prefix}.batch_mean", f"{prefix}.batch_var"
    return [RunningStat(s.name, s.const_value, batch.name, xr.name, momentum, slot == 4)
            for s, batch, slot in zip(stats, (mean, var), _STATS)]


def apply_mode(m: ir.Model, mode: str | None) -> list[RunningStat]:
    """Rewrites Dropout and BatchNormalization of ``m`` in place for ``mode`` (None: as each node is written);
    returns the running statistics to carry (train mode). Statistics no node reads any more are dropped."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode: expected one of {list(MODES)}, got {mode!r}")
    carried: list[RunningStat] = []
    read, dropouts = set(), 0
    for node in list(m.graph):
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Dropout":
            dropouts += 1
            _dropout(m.graph, node, mode or _node_mode(node), seed=dropouts)
        elif node.op_type == "BatchNormalization":
            read.update(_stat_initializer(m.graph, node, slot).name for slot in _STATS)
            stats = _batch_norm(m.graph, node, mode or _node_mode(node))
            carried += stats if mode is not None else []
    for name in read:
        value = m.graph.initializers.get(name)
        if value is not None and not value.uses() and not value.is_graph_output() and not value.is_graph_input():
            del m.graph.initializers[name]
    return carried


def running_updates(m: ir.Model, stats: list[RunningStat]) -> list[tuple[ir.Value, str]]:
    """Adds each statistic of ``stats`` to the fused graph ``m`` as an input with its starting value, and its
    update ``momentum·r + (1-momentum)·batch`` (the variance made unbiased, n/(n-1), as torch does);
    returns the (new value, output name ``<stat>.new``) pairs."""
    values = {v.name: v for n in m.graph for v in n.outputs}
    outputs = []
    for stat in stats:
        if stat.batch not in values or stat.data not in values:
            raise ModelError(f"model: the batch statistic {stat.batch!r} of {stat.name!r} is missing from the "
                             "gradient graph; expected onnxruntime-training to keep the forward values")
        batch, data = values[stat.batch], values[stat.data]
        state = ir.Value(name=stat.name, type=ir.TensorType(stat.value.dtype),
                         shape=ir.Shape(stat.value.shape), const_value=stat.value)
        m.graph.inputs.append(state)
        m.graph.register_initializer(state)
        tape = ir.tape.Tape(m.graph)
        flat = tape.op("Reshape", [batch, _constant(tape, np.array([-1], np.int64))])
        if stat.unbiased:
            shape = tape.op("CastLike", [tape.op("Shape", [data]), flat])
            n = tape.op("Div", [tape.op("ReduceProd", [shape], {"keepdims": 0}),
                                tape.op("Gather", [shape, _constant(tape, np.array(1, np.int64))])])
            one = tape.op("CastLike", [_constant(tape, np.array(1.0)), flat])
            flat = tape.op("Mul", [flat, tape.op("Div", [n, tape.op("Max", [tape.op("Sub", [n, one]), one])])])
        keep = tape.op("CastLike", [_constant(tape, np.array(stat.momentum, np.float64)), flat])
        rest = tape.op("CastLike", [_constant(tape, np.array(1.0 - stat.momentum, np.float64)), flat])
        new = tape.op("Add", [tape.op("Mul", [state, keep]), tape.op("Mul", [flat, rest])])
        for node in tape.nodes:
            node.metadata_props[_REGION] = "statistics"
        outputs.append((new, stat.name + ".new"))
    return outputs
