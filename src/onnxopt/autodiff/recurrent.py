"""Recurrent layers: the vector-Jacobian rules of RNN, GRU and LSTM, and the rewrites of the builder's path.

The rule keeps the forward node as written (onnxruntime's fused kernel) and writes backpropagation through time
in standard ONNX, for any sequence length, static or not (``docs/gradients.md``, "Recurrent layers"):

- per direction, every per-step tensor in backward order (the processing order reversed); the hidden state
  before each step is Y shifted by one step with the initial state last; the gate pre-activations of all
  steps are recomputed at once (one MatMul for X·Wᵀ, one for H_(t-1)·Rᵀ), LSTM's cell states by a loop
  (the op does not output them);
- what does not depend on the carried gradients (the activations' derivatives) is computed for all steps,
  then a loop over the steps carries dH (and dC) with one MatMul by R per step and emits the gates' gradients;
- dW, dR are Gemms over all steps and the batch, dB sums, dX one MatMul, d initial_h (d initial_c) the final
  carries.

The loops are ``Loop`` nodes gathering each step from the outer tensors (``_loop``): onnx's reference runs
neither a Scan body reading outer values nor a reverse Scan.

Refused with ``NotDifferentiableError``: clip, input_forget, parametric or other activations (RNN: Tanh and
Relu), LSTM peepholes, a sequence_lens that is not a constant equal to the sequence length. Before the rule
(``lower_recurrent``), a node the rule refuses but that fits the unrolling (a static length up to 64, layout 0)
is unrolled instead (LSTM peepholes, other activations).

The training build's builder (``gradient="builder"``) has GRUGrad/LSTMGrad for forward GRU/LSTM nodes with
explicit initial states and nothing for RNN: ``lower_recurrent`` splits bidirectional and reverse nodes into
forward ones (``_split_directions``), gives them zero initial states (``_initial_states``) and unrolls RNN nodes,
and GRU/LSTM too for portable steps (``_unroll_recurrent``; GRUGrad and LSTMGrad are training-build kernels).
"""

from __future__ import annotations


import numpy as np
import onnx
import onnx_ir as ir

from onnxopt import graphs
from onnxopt.autodiff.engine import rule
from onnxopt.errors import NotDifferentiableError
from onnxopt.passes.lower import _Op

__all__ = ["lower_recurrent", "unsupported"]

F = "recurrent"
_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
_DEFAULT_ACTS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}
_ACTIVATIONS = {"Tanh": "Tanh", "Relu": "Relu", "Sigmoid": "Sigmoid"}
_INT64_MIN = -(2**63)


def _recurrent(node: ir.Node) -> bool:
    return node.op_type in _GATES and node.domain in ("", "ai.onnx")


def _input(node: ir.Node, i: int) -> ir.Value | None:
    return node.inputs[i] if len(node.inputs) > i else None


def _length(node: ir.Node) -> int | None:
    """The node's static sequence length (None if unknown)."""
    x = node.inputs[0]
    axis = 1 if node.attributes.get_int("layout", 0) else 0
    if x is None or x.shape is None or len(x.shape) <= axis or not isinstance(x.shape[axis], int):
        return None
    return x.shape[axis]


def unsupported(node: ir.Node | onnx.NodeProto) -> str | None:
    """Why onnxopt's rule does not differentiate the RNN/GRU/LSTM ``node`` (onnx-ir or proto), or None."""
    if isinstance(node, onnx.NodeProto):
        node = ir.serde.deserialize_node(node)
    op, attrs = node.op_type, node.attributes
    if "clip" in attrs:
        return "clip is not differentiated (the cell clips its pre-activations)"
    if attrs.get_int("input_forget", 0):
        return "input_forget=1 is not differentiated"
    if "activation_alpha" in attrs or "activation_beta" in attrs:
        return "parametric activations (activation_alpha/activation_beta) are not differentiated"
    if op == "LSTM" and _input(node, 7) is not None:
        return "peepholes (input P) are not differentiated"
    dirs = 2 if attrs.get_string("direction", "forward") == "bidirectional" else 1
    acts = attrs.get_strings("activations", None)
    if acts is not None:
        acts = [a.lower() for a in acts]
        per = len(_DEFAULT_ACTS[op])
        ok = (len(acts) == per * dirs and all(a in ("tanh", "relu") for a in acts)) if op == "RNN" else \
            acts == [a.lower() for a in _DEFAULT_ACTS[op]] * dirs
        if not ok:
            expected = "Tanh or Relu" if op == "RNN" else _DEFAULT_ACTS[op]
            return f"activations {list(attrs.get_strings('activations'))} are not differentiated (expected {expected})"
    lens = _input(node, 4)
    if lens is not None:
        steps = _length(node)
        if lens.const_value is None or steps is None or not np.all(lens.const_value.numpy() == steps):
            return ("sequence_lens is not differentiated unless it is a constant equal to the static sequence "
                    f"length (got {'a computed value' if lens.const_value is None else lens.const_value.numpy().tolist()}"
                    f", length {steps})")
    return None


# ---------------------------------------------------------------------------------------------------------------
# The rule


def _loop(c: _Op, states: list, scans: list, build, dtype: ir.DataType) -> list:
    """A loop over the leading axis of ``scans`` with ``states`` carried: ``build(op, *states, *steps)`` returns
    the new states then the per-step outputs (all rank 2, stacked on a new leading axis). Written as a Loop
    whose body gathers each step from the outer values, not a Scan: onnx's reference runs Scan bodies without
    the outer scope (the weights they read) and in forward direction only."""
    # NOTE: named by the node's first output (unique in its graph) and the tape's length, not a process-wide
    # counter: the same model compiles to the same graph whatever compiled before it
    prefix = f"_rnn_bptt_{c.node.outputs[0].name}_{len(c.tape.nodes)}"
    b = _Op(c.node)
    it = ir.Value(name=f"{prefix}_t", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    cond = ir.Value(name=f"{prefix}_cond", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    ins = [ir.Value(name=f"{prefix}_s{j}", type=ir.TensorType(dtype), shape=ir.Shape([None, None]))
           for j in range(len(states))]
    steps = [b.Gather(v, it, axis=0) for v in scans]
    outs = list(build(b, *ins, *steps))
    outs = [b.Identity(o) if o in ins or o.producer() not in b.tape.nodes else o for o in outs]
    cond_out = b.Identity(cond)
    for j, n in enumerate(b.tape.nodes):
        for k, o in enumerate(n.outputs):
            if not o.name:
                o.name = f"{prefix}_{j}_{k}"
    for o in outs:
        o.type, o.shape = ir.TensorType(dtype), ir.Shape([None, None])
    cond_out.type, cond_out.shape = ir.TensorType(ir.DataType.BOOL), ir.Shape([])
    body = ir.Graph([it, cond, *ins], [cond_out, *outs], nodes=b.tape.nodes, name=prefix)
    trips = c.Squeeze(c.Shape(scans[0], start=0, end=1), c.ints([0]))
    true = c.Constant(value=ir.tensor(np.array(True)))
    res = c.Loop(trips, true, *states, body=body, _outputs=len(outs))
    res = [res] if isinstance(res, ir.Value) else list(res)
    # NOTE: per-step outputs (T, B, k); onnx's reference concatenates them on axis 0 (T·B, k): reshaped
    shape = c.Concat(c.Shape(scans[0], start=0, end=2), c.ints([-1]), axis=0)
    return res[:len(states)] + [c.Reshape(v, shape) for v in res[len(states):]]


def _flip(c, v):
    return c.Slice(v, c.ints([-1]), c.ints([_INT64_MIN]), c.ints([0]), c.ints([-1]))


def _cut(c, v, start: int, stop: int, hidden: int, axis: int = -1):
    return c.Slice(v, c.ints([start * hidden]), c.ints([stop * hidden]), c.ints([axis]))


@rule("RNN", "GRU", "LSTM", family=F, inputs=(0, 1, 2, 3, 5, 6))
def _recurrent_rule(c):
    """BPTT: gates recomputed for all steps at once, a Scan over reversed time carrying dH (LSTM: dC, cell
    states recomputed by a Scan), weight gradients as MatMuls over all steps."""
    node, op = c.node, c.node.op_type
    why = unsupported(node)
    if why:
        raise NotDifferentiableError(f"model: onnxopt cannot differentiate {op} (node {node.name!r}): {why}; expected "
                                     "the forms docs/gradients.md lists under 'Recurrent layers'",
                                     [(op, node.name or "")])
    hidden = node.attributes.get_int("hidden_size")
    gates, layout = _GATES[op], node.attributes.get_int("layout", 0)
    direction = node.attributes.get_string("direction", "forward")
    dirs = 2 if direction == "bidirectional" else 1
    lstm = op == "LSTM"
    x, w, r, b, h0 = c.I(0), c.I(1), c.I(2), c.I(3), c.I(5)
    c0 = c.I(6) if lstm else None
    y, dy, dyh, dyc = c.O(0), c.GO(0), c.GO(1), c.GO(2) if lstm else None
    dtype = c.dtype(w) or c.dtype(x) or ir.DataType.FLOAT
    if not y.name:
        raise NotDifferentiableError(f"model: onnxopt cannot differentiate {op} (node {node.name!r}): its output Y "
                                     "is omitted (lower_recurrent names it)", [(op, node.name or "")])
    states = [(h0, dyh)] + ([(c0, dyc)] if lstm else [])
    if layout:  # NOTE: to layout 0: X (T, B, I), Y (T, D, B, H), states (D, B, H)
        x, y = c.Transpose(x, perm=[1, 0, 2]), c.Transpose(y, perm=[1, 2, 0, 3])
        dy = None if dy is None else c.Transpose(dy, perm=[1, 2, 0, 3])
        states = [tuple(None if v is None else c.Transpose(v, perm=[1, 0, 2]) for v in s) for s in states]
    acts = [a.lower() for a in node.attributes.get_strings("activations", _DEFAULT_ACTS[op] * dirs)]
    zero = c.const(0.0, y)
    one = c.const(1.0, y)
    per_dir = {k: [] for k in ("x", "w", "r", "b", "h0", "c0")}
    for d in range(dirs):
        rev = d == 1 or direction == "reverse"
        pick = c.Constant(value_int=d)

        def take(v, axis=0):
            return None if v is None else c.Gather(v, pick, axis=axis)

        # NOTE: every per-step tensor in backward order (the reverse of the direction's processing order), the
        # order the Scan of dH reads it in
        x_d, y_d = x, take(y, 1)
        dy_d = take(dy, 1)
        if not rev:
            x_d, y_d = _flip(c, x_d), _flip(c, y_d)
            dy_d = None if dy_d is None else _flip(c, dy_d)
        w_d, r_d, b_d = take(w), take(r), take(b)
        first = c.Slice(y_d, c.ints([0]), c.ints([1]), c.ints([0]))  # (1, B, H)
        zeros = c.Expand(zero, c.Shape(first))
        h_init, dh_last = (take(v) for v in states[0])
        h_prev = c.Concat(c.Slice(y_d, c.ints([1]), c.ints([2**63 - 1]), c.ints([0])),
                          zeros if h_init is None else c.Unsqueeze(h_init, c.ints([0])), axis=0)
        zeros2 = c.Squeeze(zeros, c.ints([0]))
        carries = [zeros2 if dh_last is None else dh_last]
        if lstm:
            c_init, dc_last = (take(v) for v in states[1])
            carries.append(zeros2 if dc_last is None else dc_last)
        wt = c.Transpose(w_d, perm=[1, 0])
        xw = c.MatMul(x_d, wt)
        wb = rb = None
        if b_d is not None:
            wb, rb = _cut(c, b_d, 0, gates, hidden), _cut(c, b_d, gates, 2 * gates, hidden)
        scans = [] if dy_d is None else [dy_d]

        def plus_dy(o, h, rest):  # NOTE: the step's dH: the carried one plus dY's step (when Y is read)
            return (o.Add(rest[0], h), rest[1:]) if dy_d is not None else (h, rest)

        if op == "RNN":
            k = c.Sub(one, c.Mul(y_d, y_d)) if acts[d] == "tanh" else c.CastLike(c.Greater(y_d, zero), y_d)

            def body(o, h, *rest):
                dh, (k_t,) = plus_dy(o, h, rest)
                da = o.Mul(dh, k_t)
                return [o.MatMul(da, r_d), da]

            dh_first, g_x = _loop(c, carries, scans + [k], body, dtype)
            g_r, h_in = g_x, h_prev
            dr_parts = None
        elif op == "GRU":
            if wb is not None:
                xw = c.Add(xw, wb)
            xz, xr, xh = (_cut(c, xw, k, k + 1, hidden) for k in range(3))
            if node.attributes.get_int("linear_before_reset", 0):
                hh = c.MatMul(h_prev, c.Transpose(r_d, perm=[1, 0]))
                if rb is not None:
                    hh = c.Add(hh, rb)
                hz, hr, hhh = (_cut(c, hh, k, k + 1, hidden) for k in range(3))
                z, rg = c.Sigmoid(c.Add(xz, hz)), c.Sigmoid(c.Add(xr, hr))
                ht = c.Tanh(c.Add(xh, c.Mul(rg, hhh)))
                k_z = c.Mul(c.Sub(h_prev, ht), c.Mul(z, c.Sub(one, z)))
                k_h = c.Mul(c.Sub(one, z), c.Sub(one, c.Mul(ht, ht)))
                k_r = c.Mul(c.Mul(k_h, hhh), c.Mul(rg, c.Sub(one, rg)))
                m = c.Concat(k_z, k_r, k_h, axis=-1)
                m2 = c.Concat(k_z, k_r, c.Mul(k_h, rg), axis=-1)

                def body(o, h, *rest):
                    dh, (m2_t, z_t) = plus_dy(o, h, rest)
                    g = o.Mul(o.Concat(dh, dh, dh, axis=-1), m2_t)
                    return [o.Add(o.Mul(dh, z_t), o.MatMul(g, r_d)), dh, g]

                dh_first, dh_all, g_r = _loop(c, carries, scans + [m2, z], body, dtype)
                g_x = c.Mul(c.Concat(dh_all, dh_all, dh_all, axis=-1), m)
                h_in, dr_parts = h_prev, None
            else:
                r_zr, r_h = _cut(c, r_d, 0, 2, hidden, 0), _cut(c, r_d, 2, 3, hidden, 0)
                hzr = c.MatMul(h_prev, c.Transpose(r_zr, perm=[1, 0]))
                if rb is not None:
                    hzr = c.Add(hzr, _cut(c, rb, 0, 2, hidden))
                z = c.Sigmoid(c.Add(xz, _cut(c, hzr, 0, 1, hidden)))
                rg = c.Sigmoid(c.Add(xr, _cut(c, hzr, 1, 2, hidden)))
                s = c.Mul(rg, h_prev)
                ah = c.Add(xh, c.MatMul(s, c.Transpose(r_h, perm=[1, 0])))
                ht = c.Tanh(ah if rb is None else c.Add(ah, _cut(c, rb, 2, 3, hidden)))
                k_z = c.Mul(c.Sub(h_prev, ht), c.Mul(z, c.Sub(one, z)))
                k_h = c.Mul(c.Sub(one, z), c.Sub(one, c.Mul(ht, ht)))
                k_r = c.Mul(h_prev, c.Mul(rg, c.Sub(one, rg)))

                def body(o, h, *rest):
                    dh, (kh_t, kz_t, kr_t, z_t, r_t) = plus_dy(o, h, rest)
                    ds = o.MatMul(o.Mul(dh, kh_t), r_h)
                    dar = o.Mul(ds, kr_t)
                    g = o.Concat(o.Mul(dh, kz_t), dar, axis=-1)
                    carry = o.Add(o.Add(o.Mul(dh, z_t), o.MatMul(g, r_zr)), o.Mul(ds, r_t))
                    return [carry, dh, dar]

                dh_first, dh_all, dar = _loop(c, carries, scans + [k_h, k_z, k_r, z, rg], body, dtype)
                daz, dah = c.Mul(dh_all, k_z), c.Mul(dh_all, k_h)
                g_x = c.Concat(daz, dar, dah, axis=-1)
                g_r, h_in = g_x, None
                dr_parts = (c.Concat(daz, dar, axis=-1), h_prev, dah, s)
        else:  # LSTM, gates i, o, f, c
            pre = c.Add(xw, c.MatMul(h_prev, c.Transpose(r_d, perm=[1, 0])))
            if wb is not None:
                pre = c.Add(pre, c.Add(wb, rb))
            gi, go_, gf = (c.Sigmoid(_cut(c, pre, k, k + 1, hidden)) for k in range(3))
            gc = c.Tanh(_cut(c, pre, 3, 4, hidden))
            c_start = zeros2 if c_init is None else c_init

            def forward(o, cell, f_t, ic_t):
                new = o.Add(o.Mul(f_t, cell), ic_t)
                return [new, o.Identity(new)]

            _, cells = _loop(c, [c_start], [_flip(c, gf), _flip(c, c.Mul(gi, gc))], forward, dtype)
            cells = _flip(c, cells)  # NOTE: the cell states in processing order, back to backward order
            c_prev = c.Concat(c.Slice(cells, c.ints([1]), c.ints([2**63 - 1]), c.ints([0])),
                              c.Unsqueeze(c_start, c.ints([0])), axis=0)
            tc = c.Tanh(cells)
            a = c.Mul(go_, c.Sub(one, c.Mul(tc, tc)))
            m = c.Concat(c.Mul(gc, c.Mul(gi, c.Sub(one, gi))), c.Mul(tc, c.Mul(go_, c.Sub(one, go_))),
                         c.Mul(c_prev, c.Mul(gf, c.Sub(one, gf))), c.Mul(gi, c.Sub(one, c.Mul(gc, gc))), axis=-1)

            def body(o, h, cc, *rest):
                dh, (a_t, m_t, f_t) = plus_dy(o, h, rest)
                dc = o.Add(cc, o.Mul(dh, a_t))
                g = o.Mul(o.Concat(dc, dh, dc, dc, axis=-1), m_t)
                return [o.MatMul(g, r_d), o.Mul(dc, f_t), g]

            dh_first, dc_first, g_x = _loop(c, carries, scans + [a, m, gf], body, dtype)
            g_r, h_in, dr_parts = g_x, h_prev, None
            per_dir["c0"].append(dc_first)
        per_dir["h0"].append(dh_first)
        if c.need(0):
            dx = c.MatMul(g_x, w_d)
            per_dir["x"].append(dx if rev else _flip(c, dx))
        if c.need(1):
            per_dir["w"].append(c.Gemm(c.Flatten(g_x, axis=2), c.Flatten(x_d, axis=2), transA=1))
        if c.need(2):
            if dr_parts is None:
                dr = c.Gemm(c.Flatten(g_r, axis=2), c.Flatten(h_in, axis=2), transA=1)
            else:
                g_zr, hp, dah, s = dr_parts
                dr = c.Concat(c.Gemm(c.Flatten(g_zr, axis=2), c.Flatten(hp, axis=2), transA=1),
                              c.Gemm(c.Flatten(dah, axis=2), c.Flatten(s, axis=2), transA=1), axis=0)
            per_dir["r"].append(dr)
        if c.need(3):
            axes = c.ints([0, 1])
            per_dir["b"].append(c.Concat(c.ReduceSum(g_x, axes, keepdims=0), c.ReduceSum(g_r, axes, keepdims=0),
                                         axis=0))

    def stacked(parts, state=False):
        if not parts:
            return None
        out = c.Concat(*[c.Unsqueeze(p, c.ints([0])) for p in parts], axis=0) if len(parts) > 1 else \
            c.Unsqueeze(parts[0], c.ints([0]))
        return c.Transpose(out, perm=[1, 0, 2]) if state and layout else out

    dx = None
    if per_dir["x"]:
        dx = per_dir["x"][0] if dirs == 1 else c.Add(*per_dir["x"])
        if layout:
            dx = c.Transpose(dx, perm=[1, 0, 2])
    grads = [dx, stacked(per_dir["w"]), stacked(per_dir["r"]), stacked(per_dir["b"]), None,
             stacked(per_dir["h0"], True) if c.need(5) else None,
             stacked(per_dir["c0"], True) if c.need(6) else None]
    return grads


# ---------------------------------------------------------------------------------------------------------------
# Before differentiation


def lower_recurrent(model: ir.Model, gradient: str = "builder", unroll: bool = False) -> ir.Model:
    """Prepares the recurrent nodes of ``model`` for ``gradient``'s differentiation (in place).

    "onnxopt": names an omitted Y output (the rule reads it); a node the rule refuses (``unsupported``) but
    that the unrolling takes is unrolled. "builder": bidirectional/reverse nodes split into forward ones, zero
    initial states made explicit, RNN unrolled, GRU/LSTM too when ``unroll`` (portable steps)."""
    graph = model.graph
    nodes = [n for n in graph if _recurrent(n) and n.inputs[0] is not None and
             (n.inputs[0].dtype in _FLOATS or n.inputs[0].dtype is None)]
    if not nodes:
        return model
    if gradient == "onnxopt":
        _name_outputs(graph, nodes)
        def chosen(n):
            return _recurrent(n) and unsupported(n) is not None and _unroll_reason(n, any_direction=True) is None
        if not any(chosen(n) for n in nodes):
            return model
        unroll_ops = set(_GATES)
    else:
        def chosen(n):
            return _recurrent(n)
        unroll_ops = set(_GATES) if unroll else {"RNN"}
    _split_directions(graph, chosen)
    if gradient != "onnxopt":
        _initial_states(graph)
    if any(_recurrent(n) and n.op_type in unroll_ops for n in graph):
        try:  # NOTE: shapes for the lengths of the nodes split above and of stacked layers
            graphs.infer_shapes(model)
        except Exception:  # noqa: BLE001 (contrib ops can fail it; a node whose length stays unknown is kept)
            pass
        _unroll_recurrent(graph, lambda n: n.op_type in unroll_ops and chosen(n))
    return model


def _name_outputs(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Gives an omitted Y output a name (the rule reads every hidden state)."""
    taken = {v.name for v in graph.inputs} | set(graph.initializers) | {o.name for n in graph for o in n.outputs}
    for node in nodes:
        y = node.outputs[0]
        if not y.name:
            k = 0
            while f"{node.name or node.op_type}_Y{k}" in taken:
                k += 1
            y.name = f"{node.name or node.op_type}_Y{k}"
            taken.add(y.name)


def _ints(tape: ir.tape.Tape, values: list[int]) -> ir.Value:
    return tape.op("Constant", [], attributes={"value": ir.tensor(np.array(values, dtype=np.int64))})


def _rebuild(graph: ir.Graph, node: ir.Node, inputs: list, n_outputs: int) -> None:
    """Replaces ``node`` by the same op on ``inputs`` with ``n_outputs`` outputs, keeping names and uses."""
    new = ir.node(node.op_type, inputs, attributes=dict(node.attributes), num_outputs=n_outputs,
                  name=node.name, metadata_props=dict(node.metadata_props))
    graph.insert_before(node, new)
    for old, value in zip(node.outputs, new.outputs):
        value.name, value.type, value.shape = old.name, old.type, old.shape
        old.name = None
        ir.convenience.replace_all_uses_with(old, value, replace_graph_outputs=True)
    graph.remove(node, safe=True)


def _split_directions(graph: ir.Graph, chosen=lambda n: True) -> None:
    """A bidirectional or reverse RNN/GRU/LSTM -> forward nodes, the reverse one on the time-reversed sequence
    (Slice, step -1) with its direction's slice of every weight and state: onnxruntime's GRUTraining and
    LSTMTraining kernels run forward only. Y is concatenated on its direction axis, Y_h and Y_c on axis 0."""
    for node in list(graph):
        direction = node.attributes.get_string("direction", "forward")
        if not _recurrent(node) or direction == "forward" or not chosen(node):
            continue
        if node.inputs[0].dtype not in _FLOATS or node.attributes.get_int("layout", 0) \
                or "activation_alpha" in node.attributes or "activation_beta" in node.attributes \
                or (len(node.inputs) > 4 and node.inputs[4] is not None):
            continue  # NOTE: sequence_lens, layout=1, parametric activations: left to the builder (its error)
        tape = ir.tape.Tape()

        def pick(v, start, stop, step=1):
            return tape.op("Slice", [v, _ints(tape, [start]), _ints(tape, [stop]), _ints(tape, [0]), _ints(tape, [step])])

        both = direction == "bidirectional"
        per_dir = len(_DEFAULT_ACTS[node.op_type])
        acts = list(node.attributes.get_strings("activations", []))
        results = []
        for d, backward in ([(0, False), (1, True)] if both else [(0, True)]):
            x = pick(node.inputs[0], -1, _INT64_MIN, -1) if backward else node.inputs[0]
            inputs = [x] + [v if v is None or i == 4 or not both else pick(v, d, d + 1)
                            for i, v in enumerate(node.inputs[1:], start=1)]
            attrs = {**node.attributes, "direction": ir.AttrString("direction", "forward")}
            if acts:
                attrs["activations"] = ir.AttrStrings("activations", acts[d * per_dir:(d + 1) * per_dir])
            outs = list(tape.op_multi_out(node.op_type, inputs, attrs, num_outputs=len(node.outputs),
                                          name=f"{node.name}_{'reverse' if backward else 'forward'}"))
            outs[0] = pick(outs[0], -1, _INT64_MIN, -1) if backward else outs[0]
            results.append(outs)
        for n in tape.nodes:
            n.metadata_props.update(node.metadata_props)
        used = [old.uses() or old.is_graph_output() for old in node.outputs]
        news = [tape.op("Concat", list(vs), {"axis": 1 if k == 0 else 0}) if both and used[k] else vs[0]
                for k, vs in enumerate(zip(*results))]
        graph.insert_before(node, tape.nodes)
        for old, value, keep in zip(node.outputs, news, used):
            if not keep:  # NOTE: an omitted optional output (empty name) stays unnamed and unread
                continue
            value.dtype = old.dtype
            name, old.name = old.name, None
            ir.convenience.replace_all_uses_with(old, value, replace_graph_outputs=True)
            value.name = name
        graph.remove(node, safe=True)


def _initial_states(graph: ir.Graph) -> None:
    """Gives GRU/LSTM/RNN nodes explicit zero initial states: the builder's GRUGrad/LSTMGrad is invalid without."""
    states = {"GRU": (5,), "LSTM": (5, 6), "RNN": (5,)}
    for node in list(graph):
        if not _recurrent(node):
            continue
        slots = states[node.op_type]
        x = node.inputs[0]
        if x is None or x.dtype not in _FLOATS:
            continue
        if all(len(node.inputs) > i and node.inputs[i] is not None for i in slots):
            continue
        tape = ir.tape.Tape()
        dirs = 2 if node.attributes.get_string("direction", "forward") == "bidirectional" else 1
        batch_axis = 0 if node.attributes.get_int("layout", 0) else 1
        batch = tape.op("Slice", [tape.op("Shape", [x]), _ints(tape, [batch_axis]), _ints(tape, [batch_axis + 1])])
        hidden = _ints(tape, [node.attributes.get_int("hidden_size")])
        # NOTE: states are (directions, batch, hidden), or (batch, directions, hidden) with layout=1
        parts = [batch, _ints(tape, [dirs]), hidden] if batch_axis == 0 else [_ints(tape, [dirs]), batch, hidden]
        shape = tape.op("Concat", parts, attributes={"axis": 0})
        zeros = tape.op("ConstantOfShape", [shape], attributes={"value": ir.tensor(np.zeros(1, x.dtype.numpy()))})
        zeros.dtype = x.dtype
        graph.insert_before(node, tape.nodes)
        inputs = list(node.inputs) + [None] * (max(slots) + 1 - len(node.inputs))
        for i in slots:
            inputs[i] = inputs[i] if inputs[i] is not None else zeros
        _rebuild(graph, node, inputs, len(node.outputs))


def _unroll_reason(node: ir.Node, any_direction: bool = False) -> str | None:
    """Why a node is not unrolled, or None."""
    if not any_direction and node.attributes.get_string("direction", "forward") != "forward":
        return "only forward nodes are unrolled (_split_directions splits the others)"
    steps = _length(node)
    if steps is None or steps > 64:
        return "the sequence length is not a static number up to 64"
    if node.attributes.get_int("layout", 0) or "clip" in node.attributes or node.attributes.get_int("input_forget", 0):
        return "layout=1, clip and input_forget are not rewritten"
    if "activation_alpha" in node.attributes or "activation_beta" in node.attributes:
        return "parametric activations are not rewritten"
    if len(node.inputs) > 4 and node.inputs[4] is not None:
        return "sequence_lens is not rewritten"
    acts = node.attributes.get_strings("activations", _DEFAULT_ACTS[node.op_type])
    return None if all(a in _ACTIVATIONS for a in acts) else f"activations {list(acts)} are not rewritten"


def _unroll_recurrent(graph: ir.Graph, chosen=lambda n: True) -> None:
    """Forward RNN/GRU/LSTM nodes (``_split_directions`` splits the others) unrolled over their static length
    into MatMul, Sigmoid, Tanh, Mul, Add (the ONNX equations, gate orders zrh and iofc, zero states when none
    are given): gradients the builder writes in standard ops, where GRUTraining/GRUGrad and
    LSTMTraining/LSTMGrad are training-build kernels (and it has none for RNN). A node that does not fit
    (``_unroll_reason``) is kept."""
    for node in list(graph):
        if not _recurrent(node) or node.inputs[1].dtype not in _FLOATS or not chosen(node) \
                or _unroll_reason(node) is not None:
            continue
        tape, lstm, gru = ir.tape.Tape(), node.op_type == "LSTM", node.op_type == "GRU"
        hidden, x = node.attributes.get_int("hidden_size"), node.inputs[0]
        dtype = node.inputs[1].dtype  # NOTE: the weights' (a reversed sequence, a Slice, may have no type)
        acts = [_ACTIVATIONS[a] for a in node.attributes.get_strings("activations", _DEFAULT_ACTS[node.op_type])]

        def o(op_type, *inputs, **attrs):
            return tape.op(op_type, list(inputs), attrs)

        def cut(v, start, stop, axis=0):
            return o("Slice", v, _ints(tape, [start * hidden]), _ints(tape, [stop * hidden]), _ints(tape, [axis]))

        zero, one = _ints(tape, [0]), o("Constant", value=ir.tensor(np.array(1, dtype.numpy())))
        w, r = o("Squeeze", node.inputs[1], zero), o("Squeeze", node.inputs[2], zero)
        b = o("Squeeze", node.inputs[3], zero) if len(node.inputs) > 3 and node.inputs[3] is not None else None
        xw = o("MatMul", x, o("Transpose", w, perm=[1, 0]))  # NOTE: every step's input product in one MatMul
        states = [node.inputs[i] if len(node.inputs) > i else None for i in (5, 6)]
        if any(v is None for v in states[:1 + lstm]):  # NOTE: zeros where _initial_states could not type x
            batch = o("Slice", o("Shape", x), _ints(tape, [1]), _ints(tape, [2]))
            zeros = o("ConstantOfShape", o("Concat", batch, _ints(tape, [hidden]), axis=0),
                      value=ir.tensor(np.zeros(1, dtype.numpy())))
        h = o("Squeeze", states[0], zero) if states[0] is not None else zeros
        c = (o("Squeeze", states[1], zero) if states[1] is not None else zeros) if lstm else None
        p = o("Squeeze", node.inputs[7], zero) if lstm and len(node.inputs) > 7 and node.inputs[7] is not None \
            else None
        if lstm:
            xw = xw if b is None else o("Add", xw, o("Add", cut(b, 0, 4), cut(b, 4, 8)))
            rt = o("Transpose", r, perm=[1, 0])
        elif gru:
            xw = xw if b is None else o("Add", xw, cut(b, 0, 3))
            rzr, rh = o("Transpose", cut(r, 0, 2), perm=[1, 0]), o("Transpose", cut(r, 2, 3), perm=[1, 0])
            rb_zr, rb_h = (cut(b, 3, 5), cut(b, 5, 6)) if b is not None else (None, None)
            xw_zr, xw_h = cut(xw, 0, 2, 2), cut(xw, 2, 3, 2)
        else:
            xw = xw if b is None else o("Add", xw, o("Add", cut(b, 0, 1), cut(b, 1, 2)))
            rt = o("Transpose", r, perm=[1, 0])
        outs = []
        for t in range(_length(node)):
            step = _ints(tape, [t])
            if lstm:
                g = o("Add", o("Squeeze", o("Gather", xw, step, axis=0), zero), o("MatMul", h, rt))
                gi, go, gf, gc = (cut(g, k, k + 1, 1) for k in range(4))
                if p is not None:
                    gi, gf = o("Add", gi, o("Mul", cut(p, 0, 1), c)), o("Add", gf, o("Mul", cut(p, 2, 3), c))
                i, f = o(acts[0], gi), o(acts[0], gf)
                c = o("Add", o("Mul", f, c), o("Mul", i, o(acts[1], gc)))
                go = go if p is None else o("Add", go, o("Mul", cut(p, 1, 2), c))
                h = o("Mul", o(acts[0], go), o(acts[2], c))
            elif gru:
                gh = o("MatMul", h, rzr)
                zr = o(acts[0], o("Add", o("Squeeze", o("Gather", xw_zr, step, axis=0), zero),
                                  gh if rb_zr is None else o("Add", gh, rb_zr)))
                z, rr = cut(zr, 0, 1, 1), cut(zr, 1, 2, 1)
                xh = o("Squeeze", o("Gather", xw_h, step, axis=0), zero)
                if node.attributes.get_int("linear_before_reset", 0):
                    hr = o("MatMul", h, rh)
                    hh = o("Add", xh, o("Mul", rr, hr if rb_h is None else o("Add", hr, rb_h)))
                else:
                    hr = o("MatMul", o("Mul", rr, h), rh)
                    hh = o("Add", xh, hr if rb_h is None else o("Add", hr, rb_h))
                hh = o(acts[1], hh)
                h = o("Add", o("Mul", o("Sub", one, z), hh), o("Mul", z, h))
            else:
                h = o(acts[0], o("Add", o("Squeeze", o("Gather", xw, step, axis=0), zero), o("MatMul", h, rt)))
            outs.append(o("Unsqueeze", h, _ints(tape, [0, 1])))
        news = [o("Concat", *outs, axis=0), o("Unsqueeze", h, zero), o("Unsqueeze", c, zero) if lstm else None]
        for n in tape.nodes:
            n.metadata_props.update(node.metadata_props)
        graph.insert_before(node, tape.nodes)
        for old, value in zip(node.outputs, news):
            if not old.name or not (old.uses() or old.is_graph_output()):
                continue
            value.dtype, value.shape = old.dtype or dtype, old.shape
            name, old.name = old.name, None
            ir.convenience.replace_all_uses_with(old, value, replace_graph_outputs=True)
            value.name = name
        graph.remove(node, safe=True)
