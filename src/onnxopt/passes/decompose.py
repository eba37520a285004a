"""The pass that makes ops differentiable before a gradient source runs (onnxopt's rules or the builder).

- The rewrites and gradient definitions live with their op family (``onnxopt.autodiff``: ``elementwise``,
  ``linalg``, ``conv``, ``norm``, ``reduce``, ``shape``, ``signal``, each ending in a ``rewrites`` section;
  ``autodiff.rewrite`` holds the tables). ``RULES`` (op_type -> (build, check)) is
  ``autodiff.rewrite.REWRITES`` plus RNN's unrolling; ``GRADIENTS`` the gradient definitions (node
  templates over ``I(i)``, ``O(i)``, ``GO(i)``) that ``register_gradients`` gives the builder for
  attribute-free ops it lacks (Asin, Sinh, Softplus, Mish, Mod, Det, ...; Floor, Ceil, Round, Sign, Hardmax,
  random draws get a zero gradient).
- ``decompose`` applies the rewrites to the ops of a model that have one: ops whose gradient depends on
  attributes (Elu, Selu, HardSigmoid, ``Gelu(approximate="tanh")``, ...), variadic and reduction ops (Sum,
  Mean, ReduceMax, ReduceL1, ...), normalizations, layout ops, RNN (unrolled over its static length) and,
  given constants and static shapes, AffineGrid, Col2Im, GridSample, DFT, STFT, RoiAlign...
- Completed nodes: LayerNormalization gets its optional Mean/InvStdDev outputs (the builder's gradient
  reads them), SoftmaxCrossEntropyLoss its log-probabilities, GRU/LSTM/RNN explicit zero initial states
  (GRUGrad/LSTMGrad are invalid without); float64 LayerNormalization is rewritten (its gradient kernel is
  float only).
- For portable steps (``unroll_recurrent``): GRU and LSTM unrolled like RNN, their gradient kernels being
  the training build's only.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript.rewriter import MatchResult, RewriteRule, RewriteRuleSet

from onnxopt.autodiff.rewrite import GRADIENTS, REWRITES, _k, load_rewrites

__all__ = ["GRADIENTS", "RULES", "decompose", "register_gradients"]

_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)

load_rewrites()  # NOTE: the family modules register their rewrites and gradient definitions


def _attribute(name: str, value) -> tuple[str, str, str, bool]:
    if isinstance(value, np.floating):
        return name, json.dumps(float(value)), "float", True
    if isinstance(value, str):
        return name, json.dumps(value), "string", False
    if isinstance(value, np.ndarray):  # NOTE: a 1-D int64 tensor ('value' of a Constant)
        return name, json.dumps(value.tolist()), "int", True
    return name, json.dumps(value), "int" if isinstance(value, int) else "float", False


_registered = False


def register_gradients(C) -> None:
    """Registers ``GRADIENTS`` with onnxruntime-training (``C`` = its ``_pybind_state``), once per process."""
    global _registered
    if _registered:
        return
    for op_type, nodes in GRADIENTS.items():
        defs = []
        for op, inputs, outputs, *attrs in nodes:
            d = C.GradientNodeDefinition()
            domain, _, op = op.rpartition(":")  # NOTE: "com.microsoft:Inverse" names a contrib op
            d.op_type, d.domain, d.inputs, d.outputs = op, domain, list(inputs), list(outputs)
            attributes = []
            for name, value in (attrs[0] if attrs else {}).items():
                a = C.GradientNodeAttributeDefinition()
                a.name, a.value_json, a.dtype, a.is_tensor = _attribute(name, value)
                attributes.append(a)
            d.attributes = attributes
            defs.append(d)
        C.register_gradient_definition(f"::{op_type}", defs)
    _registered = True


_ACTIVATIONS = {"Tanh": "Tanh", "Relu": "Relu", "Sigmoid": "Sigmoid"}


def _rnn(op, node, x, w, r, b=None, sequence_lens=None, initial_h=None):
    """RNN unrolled over its static sequence length: h_t = f(x_t·Wᵀ + h_(t-1)·Rᵀ + Wb + Rb)."""
    hidden, steps = node.attributes.get_int("hidden_size"), x.shape[0]
    direction = node.attributes.get_string("direction", "forward")
    dirs = 2 if direction == "bidirectional" else 1
    acts = list(node.attributes.get_strings("activations", ["Tanh"] * dirs))
    axis0 = op.Constant(value_ints=[0])
    xs = [op.Gather(x, op.Constant(value_int=t), axis=0) for t in range(steps)]
    batch = op.Slice(op.Shape(x), op.Constant(value_ints=[1]), op.Constant(value_ints=[2]))
    ys, last = [], []
    for d in range(dirs):
        pick = op.Constant(value_int=d)
        wt, rt = (op.Transpose(op.Gather(v, pick, axis=0), perm=[1, 0]) for v in (w, r))
        bias = None
        if b is not None:
            bd = op.Gather(b, pick, axis=0)
            bias = op.Add(op.Slice(bd, axis0, op.Constant(value_ints=[hidden])),
                          op.Slice(bd, op.Constant(value_ints=[hidden]), op.Constant(value_ints=[2 * hidden])))
        h = (op.Gather(initial_h, pick, axis=0) if initial_h is not None
             else op.Expand(_k(op, 0.0, x), op.Concat(batch, op.Constant(value_ints=[hidden]), axis=0)))
        order = range(steps - 1, -1, -1) if d == 1 or direction == "reverse" else range(steps)
        outs = [None] * steps
        for t in order:
            pre = op.Add(op.MatMul(xs[t], wt), op.MatMul(h, rt))
            h = getattr(op, _ACTIVATIONS[acts[d]])(pre if bias is None else op.Add(pre, bias))
            outs[t] = op.Unsqueeze(h, op.Constant(value_ints=[0, 1]))
        ys.append(op.Concat(*outs, axis=0))
        last.append(op.Unsqueeze(h, axis0))
    y = ys[0] if dirs == 1 else op.Concat(*ys, axis=1)
    y_h = last[0] if dirs == 1 else op.Concat(*last, axis=0)
    return (y, y_h) if len(node.outputs) == 2 else y


def _rnn_check(node: ir.Node, default_activations=("Tanh",)) -> str | None:
    """Why an RNN (GRU, LSTM) node is not unrolled, or None."""
    steps = _steps(node.inputs[0])
    if steps is None or steps > 64:
        return "the sequence length is not a static number up to 64"
    if node.attributes.get_int("layout", 0) or "clip" in node.attributes or node.attributes.get_int("input_forget", 0):
        return "layout=1, clip and input_forget are not rewritten"
    if len(node.inputs) > 4 and node.inputs[4] is not None:
        return "sequence_lens is not rewritten"
    acts = node.attributes.get_strings("activations", list(default_activations))
    return None if all(a in _ACTIVATIONS for a in acts) else f"activations {list(acts)} are not rewritten"


def _steps(x: ir.Value) -> int | None:
    """The static sequence length of ``x`` (for a node ``_split_directions`` made, from shape inference)."""
    return x.shape[0] if x.shape is not None and len(x.shape) and isinstance(x.shape[0], int) else None


# op_type -> (build, check): the rewrites of the op families, and RNN unrolled (check returns the reason
# not to rewrite, or None)
RULES: dict[str, tuple] = {op_type: (r.build, r.check) for op_type, r in REWRITES.items()}
RULES["RNN"] = (_rnn, _rnn_check)
_OUTPUTS = {op_type: r.outputs for op_type, r in REWRITES.items() if r.outputs != (1,)}
_OUTPUTS["RNN"] = (1, 2)


def _rule(op_type: str, build, check, n_outputs: int = 1) -> RewriteRule:
    names = ["out"] if n_outputs == 1 else [f"out{i}" for i in range(n_outputs)]

    def pattern(op, x):
        return getattr(op, op_type)(x, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=names)

    def condition(context, x, **outs) -> MatchResult:
        result = MatchResult()
        node = outs[names[0]].producer()
        if node.domain not in ("", "ai.onnx") or not any(v is not None and v.dtype in _FLOATS for v in node.inputs):
            return result.fail(f"{op_type}: only nodes of the default domain with a float input are rewritten")
        if len(node.outputs) != n_outputs:
            return result.fail(f"{op_type}: the rule is for {n_outputs} output(s)")
        reason = check(node) if check is not None else None
        return result.fail(f"{op_type}: {reason}") if reason else result

    def replacement(op, x, **outs):
        node = outs[names[0]].producer()
        inputs = list(node.inputs)
        while inputs and inputs[-1] is None:
            inputs.pop()
        return build(op, node, *inputs)

    return RewriteRule(pattern, replacement, condition, name=f"Decompose{op_type}{n_outputs}")


# NOTE: one rule per output count for the ops whose rewrite returns several outputs
_RULE_SET = {op_type: [_rule(op_type, build, check, n) for n in _OUTPUTS.get(op_type, (1,))]
             for op_type, (build, check) in RULES.items()}
# op_type -> number of outputs the builder's gradient reads
_COMPLETE = {"LayerNormalization": 3, "SoftmaxCrossEntropyLoss": 2}


def _complete_outputs(graph: ir.Graph) -> None:
    """Gives nodes the optional outputs their builder gradient reads (exporters omit them)."""
    for node in list(graph):
        want = _COMPLETE.get(node.op_type)
        if want is None or node.domain not in ("", "ai.onnx"):
            continue
        inputs = list(node.inputs)
        if node.op_type == "LayerNormalization" and (len(inputs) < 3 or inputs[2] is None):
            # NOTE: LayerNormalizationGrad reads a bias (torch's elementwise_affine=False / bias=False omit it)
            dtype = inputs[1].dtype or inputs[0].dtype
            if dtype is None:
                continue  # NOTE: left to the builder, which names the node in its error
            tape = ir.tape.Tape()  # NOTE: zeros shaped like the scale, outside the gradient path
            zeros = tape.op("ConstantOfShape", [tape.op("Shape", [inputs[1]])],
                            attributes={"value": ir.tensor(np.zeros(1, dtype.numpy()))})
            zeros.dtype = dtype
            graph.insert_before(node, tape.nodes)
            inputs = [*inputs[:2], zeros]
        elif len(node.outputs) >= want:
            continue
        _rebuild(graph, node, inputs, max(want, len(node.outputs)))


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


def _split_directions(graph: ir.Graph) -> None:
    """A bidirectional or reverse GRU/LSTM -> forward nodes, the reverse one on the time-reversed sequence
    (Slice, step -1) with its direction's slice of every weight and state: onnxruntime's GRUTraining and
    LSTMTraining kernels run forward only. Y is concatenated on its direction axis, Y_h and Y_c on axis 0."""
    for node in list(graph):
        direction = node.attributes.get_string("direction", "forward")
        if node.op_type not in ("GRU", "LSTM") or node.domain not in ("", "ai.onnx") or direction == "forward":
            continue
        if node.inputs[0].dtype not in _FLOATS or node.attributes.get_int("layout", 0) \
                or "activation_alpha" in node.attributes or "activation_beta" in node.attributes \
                or (len(node.inputs) > 4 and node.inputs[4] is not None):
            continue  # NOTE: sequence_lens, layout=1, parametric activations: left to the builder (its error)
        tape = ir.tape.Tape()

        def pick(v, start, stop, step=1):
            return tape.op("Slice", [v, _ints(tape, [start]), _ints(tape, [stop]), _ints(tape, [0]), _ints(tape, [step])])

        both = direction == "bidirectional"
        per_dir = 3 if node.op_type == "LSTM" else 2
        acts = list(node.attributes.get_strings("activations", []))
        results = []
        for d, backward in ([(0, False), (1, True)] if both else [(0, True)]):
            x = pick(node.inputs[0], -1, -(2**63), -1) if backward else node.inputs[0]
            inputs = [x] + [v if v is None or i == 4 or not both else pick(v, d, d + 1)
                            for i, v in enumerate(node.inputs[1:], start=1)]
            attrs = {**node.attributes, "direction": ir.AttrString("direction", "forward")}
            if acts:
                attrs["activations"] = ir.AttrStrings("activations", acts[d * per_dir:(d + 1) * per_dir])
            outs = list(tape.op_multi_out(node.op_type, inputs, attrs, num_outputs=len(node.outputs),
                                          name=f"{node.name}_{'reverse' if backward else 'forward'}"))
            outs[0] = pick(outs[0], -1, -(2**63), -1) if backward else outs[0]
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
        slots = states.get(node.op_type)
        if slots is None or node.domain not in ("", "ai.onnx"):
            continue
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


_DEFAULT_ACTS = {"GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}


def _unroll_check(node: ir.Node) -> str | None:
    if node.attributes.get_string("direction", "forward") != "forward":
        return "only forward nodes are unrolled (_split_directions splits the others)"
    return _rnn_check(node, _DEFAULT_ACTS[node.op_type])


def _unroll_recurrent(graph: ir.Graph) -> None:
    """Forward GRU/LSTM nodes (``_split_directions`` splits the others) unrolled over their static length into
    MatMul, Sigmoid, Tanh, Mul, Add (the ONNX equations, gate orders zrh and iofc, zero states when none are
    given): gradients the builder writes in standard ops, where GRUTraining/GRUGrad and LSTMTraining/LSTMGrad
    are training-build kernels. Used for portable steps; a node that does not fit (``_unroll_check``) is kept."""
    for node in list(graph):
        if node.op_type not in _DEFAULT_ACTS or node.domain not in ("", "ai.onnx") or node.inputs[1].dtype not in _FLOATS \
                or _unroll_check(node) is not None:
            continue
        tape, lstm = ir.tape.Tape(), node.op_type == "LSTM"
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
        else:
            xw = xw if b is None else o("Add", xw, cut(b, 0, 3))
            rzr, rh = o("Transpose", cut(r, 0, 2), perm=[1, 0]), o("Transpose", cut(r, 2, 3), perm=[1, 0])
            rb_zr, rb_h = (cut(b, 3, 5), cut(b, 5, 6)) if b is not None else (None, None)
            xw_zr, xw_h = cut(xw, 0, 2, 2), cut(xw, 2, 3, 2)
        outs = []
        for t in range(_steps(x)):
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
            else:
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


def _expand_where_branches(graph: ir.Graph) -> None:
    """``Where(c, a, b)`` -> ``Where(c, Expand(a, s), Expand(b, s))`` for a branch not known to have the output's
    shape: ORT's Where gradient does not sum a broadcast branch back to its shape (a trained (1,) tensor would
    get a full-shaped gradient); Expand's does. ``s`` is the shape of a copy of the node (no cycle)."""
    for node in list(graph):
        if node.op_type != "Where" or node.domain not in ("", "ai.onnx") or node.outputs[0].dtype not in _FLOATS:
            continue
        out = node.outputs[0]
        todo = [i for i in (1, 2) if node.inputs[i] is not None and not _same_shape(node.inputs[i], out)
                and (node.inputs[i].producer() is None or node.inputs[i].producer().op_type != "Constant")]
        if not todo:
            continue
        tape = ir.tape.Tape()
        shape = tape.op("Shape", [tape.op("Where", list(node.inputs))])
        inputs = list(node.inputs)
        for i in todo:
            inputs[i] = tape.op("Expand", [inputs[i], shape])
            inputs[i].dtype = out.dtype
        graph.insert_before(node, tape.nodes)
        for i in todo:
            node.replace_input_with(i, inputs[i])


def _same_shape(value: ir.Value, out: ir.Value) -> bool:
    a, b = value.shape, out.shape
    return a is not None and b is not None and len(a) == len(b) and all(
        isinstance(x, int) and x == y for x, y in zip(a, b))


def _ints(tape: ir.tape.Tape, values: list[int]) -> ir.Value:
    return tape.op("Constant", [], attributes={"value": ir.tensor(np.array(values, dtype=np.int64))})


def decompose(model: ir.Model, unroll_recurrent: bool = False) -> ir.Model:
    """Applies ``RULES`` to the ops of ``model`` that have one, completes nodes, names the unnamed nodes whose
    gradient comes from ``GRADIENTS`` (the builder prefixes their gradient nodes by name); returns ``model``.
    ``unroll_recurrent`` (portable steps) also unrolls GRU and LSTM nodes (``_unroll_recurrent``)."""
    # NOTE: on the model's own Where nodes (typed by shape inference), before the rules add theirs
    _expand_where_branches(model.graph)
    present = {n.op_type for n in model.graph if n.domain in ("", "ai.onnx")}
    rules = [rule for op in sorted(present & set(_RULE_SET)) for rule in _RULE_SET[op]]
    if rules:
        RewriteRuleSet(rules).apply_to_model(model)
    _complete_outputs(model.graph)
    _split_directions(model.graph)
    _initial_states(model.graph)
    if unroll_recurrent and any(n.op_type in _DEFAULT_ACTS for n in model.graph):  # NOTE: shapes for the lengths of the
        # nodes split above and of stacked layers
        try:
            common_passes.ShapeInferencePass()(model)
        except Exception:  # NOTE: contrib ops can fail it; a node whose length stays unknown is kept
            pass
        _unroll_recurrent(model.graph)
    for i, node in enumerate(model.graph):
        if node.op_type in GRADIENTS and not node.name:
            node.name = f"{node.op_type}_{i}"
    return model
