"""Control flow: If, Loop and Scan differentiated through their bodies, in standard ONNX control flow.

A body's gradient (``body_gradient``) is the body recomputed and differentiated by the engine, as a graph that
reads the outer values by reference: If's gradient is an If on the same condition whose branches are the
branches' gradients; outer values and weights read inside a body get their gradients (``Ctx.captures``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import onnx_ir as ir

from onnxopt.autodiff.engine import rule

F = "control flow"
_fresh = itertools.count()


def _inside(graph: ir.Graph) -> set[ir.Graph]:
    found = {graph}
    for node in graph.all_nodes():
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                found.add(attr.as_graph())
            elif attr.type == ir.AttributeType.GRAPHS:
                found.update(attr.as_graphs())
    return found


def _owner(value: ir.Value) -> ir.Graph | None:
    node = value.producer()
    return node.graph if node is not None else value.graph


def body_gradient(c, body: ir.Graph, wrt: Sequence[ir.Value]) -> tuple[ir.Graph, dict[int, ir.Value]]:
    """The gradient of ``body`` as a graph: inputs ``body``'s (copies) then one seed per body output that can
    carry a gradient ({output index: seed input}), outputs the gradients of ``wrt`` (``body``'s inputs, by
    position, or outer values, read by reference: the result reads them from the enclosing scope)."""
    from onnxopt.autodiff.engine import differentiate

    clone = body.clone(allow_outer_scope_values=True)
    scopes = _inside(clone)
    outer = list(dict.fromkeys([*(v for n in clone.all_nodes() for v in n.inputs
                                  if v is not None and _owner(v) not in scopes),
                                *(v for v in clone.outputs if _owner(v) not in scopes),
                                *(v for v in wrt if v not in body.inputs)]))
    holders = {}
    for v in outer:
        dtype = v.dtype or c._types.get(v.name)
        holder = ir.Value(name=v.name, type=v.type or (ir.TensorType(dtype) if dtype else None), shape=v.shape)
        holders[v] = holder
        for node, idx in list(v.uses()):
            if node.graph in scopes:
                node.replace_input_with(idx, holder)
        clone.outputs[:] = [holder if o is v else o for o in clone.outputs]
    body_inputs = list(clone.inputs)
    clone.inputs.extend(holders.values())
    names = [clone.inputs[list(body.inputs).index(v)].name if v in body.inputs else v.name for v in wrt]
    clone.opset_imports.update(c.opsets)
    model = ir.Model(clone, ir_version=10)
    differentiate(model, [], names)
    g = model.graph
    node = next(n for n in g if n.op_type == "YieldOp")
    skipped = set(node.attributes.get_ints("non_differentiable_outputs", []))
    seeds = {}
    for k, grad in zip([i for i in range(len(node.inputs)) if i not in skipped], list(node.outputs)):
        seed = ir.Value(name=grad.name, type=grad.type, shape=grad.shape)
        ir.convenience.replace_all_uses_with(grad, seed, replace_graph_outputs=True)
        seeds[k] = seed
    g.remove(node, safe=True)
    for v, holder in holders.items():
        ir.convenience.replace_all_uses_with(holder, v, replace_graph_outputs=True)
    g.inputs[:] = [*body_inputs, *seeds.values()]
    _name_all(g)
    return g, seeds


def _name_all(g: ir.Graph) -> None:
    """Names every value and node of ``g`` (and its subgraphs) uniquely in the model: the serializer would
    name the unnamed ones ``val_<k>`` per graph, and a subgraph's name may not shadow an outer one."""
    prefix = f"_cf{next(_fresh)}_"
    for k, value in enumerate([*g.inputs, *(o for n in g.all_nodes() for o in n.outputs)]):
        value.name = f"{prefix}{value.name or ''}{k}"
    for k, n in enumerate(g.all_nodes()):
        n.name = f"{prefix}{n.op_type}{k}"


def _detach(g: ir.Graph, name: str) -> ir.Graph:
    """``g``'s nodes in a new graph named ``name`` (a graph that ``differentiate``'s model held)."""
    nodes, outputs = list(g), list(g.outputs)
    g.outputs.clear()
    for n in reversed(nodes):
        g.remove(n)
    inputs = list(g.inputs)
    g.inputs.clear()
    return ir.Graph(inputs, outputs, nodes=nodes, name=name)


@rule("If", family=F, inputs=())
def _if(c):
    """An If on the same condition whose branches are the gradients of the branches with respect to the outer
    values they read (each branch recomputed: no value crosses from the forward If)."""
    branches = {}
    for attr in ("then_branch", "else_branch"):
        g, seeds = body_gradient(c, c.node.attributes[attr].as_graph(), c.captures)
        for k, seed in seeds.items():
            ir.convenience.replace_all_uses_with(seed, c.go(k))
        g.inputs.clear()
        branches[attr] = ir.AttrGraph(attr, _detach(g, f"{c.node.name or 'If'}_{attr}_grad"))
        _name_all(branches[attr].value)
    outs = c.tape.op_multi_out("If", [c.I(0)], branches, num_outputs=len(c.captures))
    return [None] * len(c.node.inputs) + list(outs)


def _splice(g: ir.Graph, values: Sequence[ir.Value | None]) -> list[ir.Node]:
    """``g``'s nodes reading ``values`` in place of its inputs (None: left unread), detached from ``g``."""
    for inp, value in zip(list(g.inputs), values):
        if value is not None:
            ir.convenience.replace_all_uses_with(inp, value, replace_graph_outputs=True)
    outputs = list(g.outputs)
    g.outputs.clear()
    nodes = list(g)
    for n in reversed(nodes):
        g.remove(n)
    g.outputs.extend(outputs)
    return nodes


def _value(name: str, like: ir.Value | None = None, dtype: ir.DataType | None = None) -> ir.Value:
    return ir.Value(name=name, type=like.type if like is not None else ir.TensorType(dtype),
                    shape=like.shape if like is not None else None)


def _keep_inputs(node: ir.Node, body: ir.Graph, states: Sequence[ir.Value], types: Sequence,
                 attrs: Sequence[str] = ()) -> list:
    """Makes the forward ``node`` also output ``states`` (body inputs, of ``types``) at each iteration's start,
    stacked as scan outputs along axis 0 in iteration order; returns those new outputs."""
    for k, state in enumerate(states):
        copy = ir.node("Identity", [state], outputs=[_value(f"{state.name}_kept{next(_fresh)}", state)])
        body.append(copy)
        body.outputs.append(copy.outputs[0])
    for name in attrs:  # NOTE: Scan's per-output axes and directions: the kept states along 0, forward
        if name in node.attributes:
            values = list(node.attributes[name].as_ints())
            node.attributes[name] = ir.AttrInt64s(name, values + [0] * len(states))
    n = len(node.outputs)
    node.resize_outputs(n + len(states))
    kept = list(node.outputs[n:])
    for value, t in zip(kept, types):
        value.type = t
    return kept


def _floats(c, values) -> list[int]:
    from onnxopt.autodiff.engine import FLOATS

    if any(isinstance(v.type, ir.SequenceType) for v in values):
        raise ValueError("a state or scanned value that is a sequence has no rule (states are stacked per "
                         "iteration); expected tensors")
    return [k for k, v in enumerate(values) if (v.dtype or c._types.get(v.name)) in FLOATS]


@rule("Scan", family=F)
def _scan(c):
    """A Scan over the reversed sequence: the forward keeps each iteration's states as scan outputs; the reverse
    body is the body's gradient, the state gradients carried, the outer values' gradients summed as states."""
    node, body = c.node, c.node.attributes["body"].as_graph()
    m = node.attributes.get_int("num_scan_inputs")
    n = len(node.inputs) - m
    k_out = len(node.outputs) - n
    ints = node.attributes.get_ints
    in_axes, in_dirs = list(ints("scan_input_axes", [0] * m)), list(ints("scan_input_directions", [0] * m))
    out_axes, out_dirs = list(ints("scan_output_axes", [0] * k_out)), list(ints("scan_output_directions", [0] * k_out))
    states, elems = list(body.inputs[:n]), list(body.inputs[n:])
    # NOTE: types from the Scan's inputs: a body's inputs may be untyped
    fs, fx = _floats(c, node.inputs[:n]), [k for k in _floats(c, node.inputs[n:]) if c.need(n + k)]
    caps = c.captures
    g, seeds = body_gradient(c, body, [*(states[k] for k in fs), *(elems[k] for k in fx), *caps])
    kept = _keep_inputs(node, body, states, [v.type for v in node.inputs[:n]],
                        ("scan_output_axes", "scan_output_directions"))
    # reverse body: states (dS for float states, dC sums), scan inputs (kept states, x, dY), outputs
    p = f"_cf{next(_fresh)}_"
    d_states = [_value(f"{p}ds{k}", node.inputs[k]) for k in fs]
    d_caps = [_value(f"{p}dc{k}", v) for k, v in enumerate(caps)]
    s_in = [_value(f"{p}s{k}", v) for k, v in enumerate(node.inputs[:n])]
    x_in = [_value(f"{p}x{k}", ir.Value(type=v.type)) for k, v in enumerate(node.inputs[n:])]
    dy_outs = [k for k in seeds if k >= n]
    dy_in = [_value(f"{p}dy{k}", seeds[k]) for k in dy_outs]
    seed_values = [d_states[fs.index(k)] if k < n else dy_in[dy_outs.index(k)] for k in seeds]
    nodes = _splice(g, [*s_in, *x_in, *seed_values])
    grads = list(g.outputs)
    tape = ir.tape.Tape()
    dc_out = [tape.op("Add", [acc, d]) for acc, d in zip(d_caps, grads[len(fs) + len(fx):])]
    outs = [*(tape.op("Identity", [d]) for d in grads[:len(fs)]), *dc_out,
            *(tape.op("Identity", [d]) for d in grads[len(fs):len(fs) + len(fx)])]
    for k, v in enumerate(outs):
        v.name = f"{p}out{k}"
    rbody = ir.Graph([*d_states, *d_caps, *s_in, *x_in, *dy_in], outs, nodes=[*nodes, *tape.nodes],
                     name=f"{node.name or 'Scan'}_grad")
    _name_all(rbody)
    zeros = [c.Expand(c.const(0.0, v), c.Shape(v)) for v in caps]
    dys = [c.go(k) for k in dy_outs]
    attrs = {"body": ir.AttrGraph("body", rbody), "num_scan_inputs": ir.AttrInt64("num_scan_inputs", n + m + len(dys)),
             "scan_input_axes": ir.AttrInt64s("scan_input_axes", [0] * n + in_axes + [out_axes[k - n] for k in dy_outs]),
             "scan_input_directions": ir.AttrInt64s("scan_input_directions", [1] * n + [1 - d for d in in_dirs] +
                                                    [1 - out_dirs[k - n] for k in dy_outs]),
             "scan_output_axes": ir.AttrInt64s("scan_output_axes", [in_axes[k] for k in fx]),
             "scan_output_directions": ir.AttrInt64s("scan_output_directions", [1 - in_dirs[k] for k in fx])}
    r = c.tape.op_multi_out("Scan", [*(c.go(k) for k in fs), *zeros, *kept, *node.inputs[n:], *dys], attrs,
                            num_outputs=len(outs))
    gis: list = [None] * len(node.inputs)
    for j, k in enumerate(fs):
        gis[k] = r[j]
    for j, k in enumerate(fx):
        gis[n + k] = r[len(fs) + len(caps) + j]
    return gis + list(r[len(fs):len(fs) + len(caps)])


@rule("Loop", family=F)
def _loop(c):
    """A Loop back over the iterations: the forward keeps each iteration's number and states as scan outputs;
    reverse iteration j differentiates forward iteration T-1-j (its states and scan-output gradients gathered
    at that index), the state gradients carried, the outer values' gradients summed as states."""
    node, body = c.node, c.node.attributes["body"].as_graph()
    n = len(node.inputs) - 2
    states = list(body.inputs[2:])
    fs, caps = _floats(c, node.inputs[2:]), c.captures  # NOTE: a body's inputs may be untyped
    g, seeds = body_gradient(c, body, [*(states[k] for k in fs), *caps])
    kept = _keep_inputs(node, body, [body.inputs[0], *states],
                        [ir.TensorType(ir.DataType.INT64), *(v.type for v in node.inputs[2:])])
    trips = c.Squeeze(c.Shape(kept[0]))
    p = f"_cf{next(_fresh)}_"
    j, cond = _value(f"{p}j", dtype=ir.DataType.INT64), _value(f"{p}cond", dtype=ir.DataType.BOOL)
    j.shape, cond.shape = ir.Shape([]), ir.Shape([])
    d_states = [_value(f"{p}ds{k}", node.inputs[2 + k]) for k in fs]
    d_caps = [_value(f"{p}dc{k}", v) for k, v in enumerate(caps)]
    tape = ir.tape.Tape()
    one = tape.op("Constant", [], {"value": ir.tensor(1, dtype=ir.DataType.INT64)})
    i = tape.op("Sub", [tape.op("Sub", [trips, one]), j])
    at = [tape.op("Gather", [v, i], {"axis": 0}) for v in kept]
    true = tape.op("Constant", [], {"value": ir.tensor(True, dtype=ir.DataType.BOOL)})
    seed_values = [d_states[fs.index(k - 1)] if k <= n else tape.op("Gather", [c.go(k - 1), i], {"axis": 0})
                   for k in seeds]
    nodes = _splice(g, [at[0], true, *at[1:], *seed_values])
    grads = list(g.outputs)
    end = ir.tape.Tape()
    outs = [end.op("Identity", [cond]), *(end.op("Identity", [d]) for d in grads[:len(fs)]),
            *(end.op("Add", [acc, d]) for acc, d in zip(d_caps, grads[len(fs):]))]
    for k, v in enumerate(outs):
        v.name = f"{p}out{k}"
    rbody = ir.Graph([j, cond, *d_states, *d_caps], outs, nodes=[*tape.nodes, *nodes, *end.nodes],
                     name=f"{node.name or 'Loop'}_grad")
    _name_all(rbody)
    zeros = [c.Expand(c.const(0.0, v), c.Shape(v)) for v in caps]
    r = c.tape.op_multi_out("Loop", [trips, None, *(c.go(k) for k in fs), *zeros],
                            {"body": ir.AttrGraph("body", rbody)}, num_outputs=len(outs) - 1)
    gis: list = [None] * len(node.inputs)
    for idx, k in enumerate(fs):
        gis[2 + k] = r[idx]
    return gis + list(r[len(fs):])


# ---- sequences: a sequence's gradient is a sequence of its tensors' gradients

_SEQUENCE_OUTPUTS = {"SplitToSequence", "SequenceConstruct", "SequenceInsert", "SequenceErase", "SequenceEmpty",
                     "SequenceMap"}


def retype_sequences(model: ir.Model) -> None:
    """Gives the outputs of sequence ops a sequence type where shape inference wrote a tensor type (onnx_ir's
    ShapeInferencePass does on sequences of tensors: the rules read the type to tell sequences)."""
    for node in model.graph.all_nodes():
        if node.op_type in _SEQUENCE_OUTPUTS and node.domain in ("", "ai.onnx"):
            for out in node.outputs:
                if isinstance(out.type, ir.TensorType):
                    out.type, out.shape = ir.SequenceType(out.type), None

def sequence_map(tape: ir.tape.Tape, seqs: Sequence[ir.Value], build, elem_types: Sequence) -> ir.Value:
    """SequenceMap over ``seqs`` whose body returns ``build(tape, *elements)`` (one tensor per element)."""
    inputs = [ir.Value(name=f"e{k}", type=t) for k, t in enumerate(elem_types)]
    body_tape = ir.tape.Tape()
    out = build(body_tape, *inputs)
    body = ir.Graph(inputs, [out], nodes=body_tape.nodes, name="sequence_map")
    _name_all(body)
    return tape.op("SequenceMap", list(seqs), {"body": ir.AttrGraph("body", body)})


def _elem_type(v: ir.Value):
    t = v.type
    return t.elem_type if isinstance(t, ir.SequenceType) else t


def sequence_add(tape: ir.tape.Tape, a: ir.Value, b: ir.Value) -> ir.Value:
    """The element-wise sum of two sequences of gradients."""
    t = _elem_type(a) or _elem_type(b)
    return sequence_map(tape, [a, b], lambda tp, x, y: tp.op("Add", [x, y]), [t, t])


def _zeros_like(c, seq: ir.Value) -> ir.Value:
    def build(tp, x):
        zero = tp.op("Constant", [], {"value": ir.tensor(0.0, dtype=seq.dtype)})
        return tp.op("Expand", [zero, tp.op("Shape", [x])])
    return sequence_map(c.tape, [seq], build, [_elem_type(seq)])


def _position(c, seq: ir.Value, pos: ir.Value | None) -> ir.Value:
    """``pos`` counted from the front of ``seq`` (length n): pos + n when negative; n when None (the end)."""
    n = c.SequenceLength(seq)
    if pos is None:
        return n
    pos = c.Cast(pos, to=ir.DataType.INT64)
    return c.Where(c.Less(pos, c.Constant(value_int=0)), c.Add(pos, n), pos)


@rule("SequenceConstruct", family=F)
def _sequence_construct(c):
    """dx_i = the i-th gradient of the sequence."""
    return [c.SequenceAt(c.go(0), c.Constant(value_int=i)) for i in range(len(c.node.inputs))]


@rule("SequenceAt", family=F, inputs=(0,))
def _sequence_at(c):
    """d seq = zeros with dy at the position read."""
    seq = c.I(0)
    pos = _position(c, seq, c.I(1))
    return [c.SequenceInsert(c.SequenceErase(_zeros_like(c, seq), pos), c.go(0), pos)]


@rule("SequenceInsert", family=F, inputs=(0, 1))
def _sequence_insert(c):
    """d seq = dy without the inserted position, d tensor = dy at it."""
    pos = _position(c, c.I(0), c.I(2))
    dy = c.go(0)
    return [c.SequenceErase(dy, pos) if c.need(0) else None, c.SequenceAt(dy, pos) if c.need(1) else None]


@rule("ConcatFromSequence", family=F)
def _concat_from_sequence(c):
    """d seq = dy split back: in slices of one along the new axis, else by each tensor's size on the axis."""
    axis, dy = c.attr("axis"), c.go(0)
    if c.attr("new_axis", 0):
        return [c.SplitToSequence(dy, axis=axis, keepdims=0)]
    span = {"start": axis} if axis == -1 else {"start": axis, "end": axis + 1}
    sizes = sequence_map(c.tape, [c.I(0)], lambda tp, x: tp.op("Shape", [x], span), [_elem_type(c.I(0))])
    return [c.SplitToSequence(dy, c.ConcatFromSequence(sizes, axis=0), axis=axis)]


@rule("SplitToSequence", family=F, inputs=(0,))
def _split_to_sequence(c):
    """dx = the gradients concatenated back (stacked when the split dropped the axis)."""
    stacked = c.I(1) is None and c.attr("keepdims", 1) == 0
    return [c.ConcatFromSequence(c.go(0), axis=c.attr("axis", 0), new_axis=int(stacked))]


def loop_lists_as_scan_outputs(model: ir.Model) -> int:
    """Rewrites the list a Loop appends to (TorchScript's ``outs.append(h)`` then ``torch.stack(outs)``: a state
    from SequenceEmpty, a SequenceInsert at its end in the body, a ConcatFromSequence(axis=0, new_axis=1) after)
    into a scan output of the Loop, which stacks the same tensors: a Loop's rule keeps tensor states only.
    Returns the count rewritten."""
    count = 0
    for node in list(model.graph.all_nodes()):
        if node.op_type != "Loop" or node.domain not in ("", "ai.onnx"):
            continue
        body = node.attributes["body"].as_graph()
        n = len(node.inputs) - 2
        for k in reversed(range(n)):
            stacked = _appended_list(node, body, k)
            if stacked is None:
                continue
            insert, readers = stacked
            graph = node.graph
            body.remove(insert, safe=False)
            body.outputs.pop(1 + k)
            body.outputs.append(insert.inputs[1])
            body.inputs.pop(2 + k)
            inputs = [v for i, v in enumerate(node.inputs) if i != 2 + k]
            new = ir.node("Loop", inputs, attributes={"body": ir.AttrGraph("body", body)},
                          num_outputs=len(node.outputs), name=node.name)
            graph.insert_before(node, new)
            olds = [o for i, o in enumerate(node.outputs) if i != k]
            for old, out in zip(olds, new.outputs):
                out.name, out.type, out.shape, old.name = old.name, old.type, old.shape, None
                ir.convenience.replace_all_uses_with(old, out, replace_graph_outputs=True)
            for reader in readers:  # NOTE: an Identity keeps the reader's output (a graph output's name)
                copy = ir.node("Identity", [new.outputs[-1]], name=reader.name)
                graph.insert_before(reader, copy)
                done, copy.outputs[0].name = reader.outputs[0], None
                copy.outputs[0].type = ir.TensorType(done.dtype) if done.dtype is not None else None
                ir.convenience.replace_all_uses_with(done, copy.outputs[0], replace_graph_outputs=True)
                name, done.name = done.name, None
                graph.remove(reader, safe=True)
                copy.outputs[0].name = name
            graph.remove(node, safe=False)
            node, count = new, count + 1
    return count


def _appended_list(node: ir.Node, body: ir.Graph, k: int):
    """(the SequenceInsert, the ConcatFromSequence readers) when state ``k`` of the Loop is such a list."""
    start, out = node.inputs[2 + k].producer() if node.inputs[2 + k] is not None else None, node.outputs[k]
    if start is None or start.op_type != "SequenceEmpty" or out.is_graph_output():
        return None
    uses = list(body.inputs[2 + k].uses())
    insert = uses[0][0] if len(uses) == 1 else None
    if insert is None or insert.op_type != "SequenceInsert" or len(insert.inputs) != 2 or insert.graph is not body \
            or body.outputs[1 + k] is not insert.outputs[0] or len(list(insert.outputs[0].uses())) > 0:
        return None
    readers = [r for r, _ in out.uses()]
    if not readers or any(r.op_type != "ConcatFromSequence" or r.attributes.get_int("axis", 0) != 0 or
                          r.attributes.get_int("new_axis", 0) != 1 for r in readers):
        return None
    return insert, readers
