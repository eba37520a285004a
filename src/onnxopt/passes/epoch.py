"""An epoch as one model: the Runner's CPU step as the body of an ONNX ``Scan`` over stacked batches.

``epoch_model`` wraps a step whose per-batch inputs are ``batch_inputs`` (X, the target): the Scan slices
batch ``i`` of ``epoch.<input>`` (all full batches but the last, shape ``(steps - 1, batch, ...)``) and
carries the step's carried tensors (``<name>`` -> ``<name>.new``); the step then runs once more in the
outer graph on ``epoch.<input>.last``, so the Scan's final state, that last step's inputs, is an output
(``epoch.<name>.last``: what a diverging next step goes back to) next to ``epoch.<name>.new``. The losses
are stacked in ``epoch.losses`` and summed with every new float tensor in ``epoch.check``. A pack's
members (weights bound as views of it in the step, ``passes.update``) come from a ``Split`` of the carried
pack (and a ``Reshape`` for those of two or more dimensions). Every other input (hoisted sample-weight
values, constants) is read from the outer scope, so it is bound once per epoch. A bias the step reads and
writes as a (1, n) row (``batch.row_sum_updates``) is carried as that row. Otherwise the body
is the step's graph, node for node: the losses and weights are those of one run per batch, bit for bit
(tests/test_epoch.py). A ``Loop`` with a ``Gather`` of the batch gave the same numbers 6-21% slower a step
(onnxruntime 1.19): ``Scan`` slices its inputs without copying and keeps its state in preallocated buffers.
"""

from __future__ import annotations

import collections
import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxopt.passes.batch import RANDOM
from onnxopt.passes.unread import remove_unread_initializers
from onnxopt.step import NEW

__all__ = ["epoch_model", "scannable", "PREFIX", "LAST", "CHECK", "COUNT"]

PREFIX = "epoch."  # NOTE: outer names differ from the body's: ONNX forbids a subgraph to shadow outer names
LAST = ".last"
COUNT = PREFIX + "count"  # NOTE: the Scan's iterations (batches but the last), an input when counters need it
CHECK = PREFIX + "check"  # NOTE: the sum of the losses and new float tensors: finite when they all are


def scannable(model: onnx.ModelProto) -> bool:
    """Whether ``model`` can be a Scan body giving the numbers of one run per batch. Left out: control flow
    (``epoch_model`` renames the step's values, not those its subgraphs read), random ops
    (Dropout: the body's kernel draws other masks than the step's) and the gradient ops onnxruntime-training
    registers in the ONNX domain, on which 1.19 crashes inside a subgraph (a segfault at session creation;
    found: MaxPoolGrad)."""
    return all(n.op_type not in RANDOM and (n.domain not in ("", "ai.onnx") or onnx.defs.has(n.op_type))
               and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute)
               for n in model.graph.node)


def _shape(value: onnx.ValueInfoProto) -> tuple | None:
    """``value``'s dimensions (int, a name or None), or None when its shape is unknown."""
    t = value.type.tensor_type
    return tuple(d.dim_value or d.dim_param or None for d in t.shape.dim) if t.HasField("shape") else None


def _info(name: str, value: onnx.ValueInfoProto, lead: tuple = ()) -> onnx.ValueInfoProto:
    shape = _shape(value)
    return helper.make_tensor_value_info(name, value.type.tensor_type.elem_type,
                                         None if shape is None else [*lead, *shape])


def _views(pack: str, members: list[tuple[str, tuple[int, ...]]], name) -> tuple[list, list]:
    """Nodes and constants giving a pack's members (``name(member)``) from the carried pack: one Split, and a
    Reshape for a member of two or more dimensions."""
    if not members:
        return [], []
    sizes = numpy_helper.from_array(np.array([math.prod(s) for _, s in members], np.int64), name(PREFIX + "sizes"))
    flat = [name(m) if len(s) == 1 else name(f"{PREFIX}{m}.flat") for m, s in members]
    nodes, consts = [helper.make_node("Split", [pack, sizes.name], flat)], [sizes]
    for m, shape in (m for m in members if len(m[1]) != 1):
        consts.append(numpy_helper.from_array(np.array(shape, np.int64), name(f"{PREFIX}{m}.shape")))
        nodes.append(helper.make_node("Reshape", [name(f"{PREFIX}{m}.flat"), consts[-1].name], [name(m)]))
    return nodes, consts


def _renamed(graph: onnx.GraphProto, names: dict[str, str], default) -> list[onnx.NodeProto]:
    """``graph``'s nodes reading and writing ``names[v]`` (``default(v)`` for a value not in ``names``)."""
    nodes = []
    for node in graph.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = default(node.name) if node.name else ""
        for field in (copy.input, copy.output):
            field[:] = [names.get(v) or default(v) if v else v for v in field]
        nodes.append(copy)
    return nodes


def _check(names: list[str], infos: list[onnx.ValueInfoProto]) -> list[onnx.NodeProto]:
    """Nodes summing every float tensor of ``names`` into ``CHECK`` (in the first one's type): NaN or infinite
    when one of them holds a NaN or an infinity (or when finite values overflow the sum)."""
    to = infos[0].type.tensor_type.elem_type
    nodes, sums = [], []
    for name, info in zip(names, infos):
        elem = info.type.tensor_type.elem_type
        if elem not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16):
            continue
        nodes.append(helper.make_node("ReduceSum", [name], [f"{name}.sum"], keepdims=0))
        sums.append(f"{name}.sum")
        if elem != to:
            nodes.append(helper.make_node("Cast", [sums[-1]], [f"{name}.sum.cast"], to=to))
            sums[-1] = f"{name}.sum.cast"
    return [*nodes, helper.make_node("Sum", sums, [CHECK])]


def _counters(g: onnx.GraphProto, carried: list[str]) -> dict[str, tuple[onnx.NodeProto, str]]:
    """Carried tensors the step reads only to add an int64 constant to (the step counter of a rule that does
    not read it): {name: (that Add, the constant's initializer)}. The Scan leaves them out; the outer graph
    adds the constant times its iteration count once."""
    inits = {t.name: t for t in g.initializer}
    uses = collections.Counter(v for n in g.node for v in n.input)
    found = {}
    for node in g.node:
        name = node.output[0].removesuffix(NEW) if node.op_type == "Add" else None
        other = [v for v in node.input if v != name]
        if name in carried and name in node.input and len(other) == 1 and other[0] in inits \
                and inits[other[0]].data_type == onnx.TensorProto.INT64 and uses[name] == 1 \
                and not uses[node.output[0]] and node.output[0] == name + NEW:
            found[name] = (node, other[0])
    return found


def epoch_model(model: onnx.ModelProto, batch_inputs: list[str], carried: list[str],
                views: tuple[str, list[tuple[str, tuple[int, ...]]]] | None, loss: str) -> onnx.ModelProto:
    """The model running ``model`` once per batch: a Scan over all batches but the last, then the step once
    more in the outer graph on the last one, whose inputs (the Scan's final state) are outputs too.

    Outer inputs: ``epoch.<batch input>`` (all batches but the last, stacked), ``epoch.<batch input>.last``,
    ``epoch.<carried>``, the step's other inputs by name and ``epoch.count`` (``COUNT``, the Scan's
    iterations) when a counter is left out of the Scan (``_counters``); outputs ``epoch.<carried>.new``,
    ``epoch.<carried>.last`` (the last step's inputs), ``epoch.losses`` and ``epoch.check`` (``CHECK``). ``views``: a carried pack and its
    members' (name, shape), in order, which the step reads as inputs."""
    g = model.graph
    inputs, outputs = {v.name: v for v in g.input}, {v.name: v for v in g.output}
    pack, members = views or (None, [])
    nodes, consts = _views(pack, members, lambda v: v)
    counters = _counters(g, carried)
    state = [n for n in carried if n not in counters]
    skip = {id(node) for node, _ in counters.values()}
    # NOTE: Scan wants every body output's shape: a carried tensor keeps its input's
    body = helper.make_graph(
        [*nodes, *(n for n in g.node if id(n) not in skip)], "epoch_body",
        [*(inputs[n] for n in state), *(inputs[n] for n in batch_inputs)],
        [*(_info(n + NEW, inputs[n]) for n in state), outputs[loss]], [*g.initializer, *consts])
    scan = helper.make_node("Scan", [*(PREFIX + n for n in state), *(PREFIX + n for n in batch_inputs)],
                            [*(PREFIX + n + LAST for n in state), PREFIX + "losses.scan"], body=body,
                            num_scan_inputs=len(batch_inputs))
    # NOTE: the last step, renamed: outer names may not be shadowed by the body's
    inner = {*batch_inputs, *carried, *(m for m, _ in members)}
    others = {v.name: v.name for v in g.input if v.name not in inner}
    last = lambda v: f"{PREFIX}last/{v}"  # noqa: E731
    names = {**others, **{n: PREFIX + n + LAST for n in (*carried, *batch_inputs)},
             **{n + NEW: PREFIX + n + NEW for n in carried}}
    view_nodes, view_consts = _views(names.get(pack, ""), members, last)
    consts = [*view_consts, numpy_helper.from_array(np.array([1], np.int64), PREFIX + "loss.shape")]
    for init in g.initializer:
        copy = onnx.TensorProto()
        copy.CopyFrom(init)
        copy.name = last(init.name)
        consts.append(copy)
    count = [helper.make_node("Mul", [last(k), COUNT], [PREFIX + n + ".advance"]) for n, (_, k) in counters.items()]
    count += [helper.make_node("Add", [PREFIX + n, PREFIX + n + ".advance"], [PREFIX + n + LAST]) for n in counters]
    tail = [*count, *view_nodes, *_renamed(g, names, last),
            helper.make_node("Reshape", [last(loss), PREFIX + "loss.shape"], [PREFIX + "loss.last"]),
            helper.make_node("Concat", [PREFIX + "losses.scan", PREFIX + "loss.last"], [PREFIX + "losses"], axis=0),
            *_check([PREFIX + "losses", *(PREFIX + n + NEW for n in carried)],
                    [outputs[loss], *(inputs[n] for n in carried)])]
    outer = [*(_info(PREFIX + n, inputs[n], (None,)) for n in batch_inputs),
             *(_info(PREFIX + n + LAST, inputs[n]) for n in batch_inputs),
             *(_info(PREFIX + n, inputs[n]) for n in carried), *(v for v in g.input if v.name not in inner),
             *([helper.make_tensor_value_info(COUNT, onnx.TensorProto.INT64, [])] if counters else [])]
    results = [*(_info(PREFIX + n + NEW, inputs[n]) for n in carried),
               *(_info(PREFIX + n + LAST, inputs[n]) for n in carried), _info(PREFIX + "losses", outputs[loss], (None,)),
               _info(CHECK, outputs[loss])]
    return remove_unread_initializers(helper.make_model(  # NOTE: the body's constants the step did not read
        helper.make_graph([scan, *tail], "epoch", outer, results, consts), opset_imports=model.opset_import,
        ir_version=model.ir_version, functions=model.functions))
