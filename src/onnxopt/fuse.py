"""The fusion pass: model forward + loss + backward + penalty + update rule -> one training-step graph.

``compile_train_step`` runs ``STAGES``, named functions over one ``stages.CompileState`` (each says what it needs
and leaves; ``stages.run_stages`` checks the order; ``onnxopt compile --explain`` prints them). They rewrite, in
order, the gradient graph from ``gradient.gradient_ir`` (forward, YieldOp, backward):
- the output gradient (the YieldOp's output) is computed from the prediction by the loss and its gradient;
- each weight gradient gets its penalty gradient, then global-norm clipping;
- the schedule turns the step counter into a learning rate and the update rule makes new weights and state;
- every DSL function is inlined, dead nodes dropped, versions set to what onnxruntime loads.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Collection, Sequence

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as passes
from onnxscript.optimizer import constant_folding

from onnxopt import graphs
from onnxopt.dsl.check import check_step_functions
from onnxopt.dsl.core import Loss, Penalty, Schedule, UpdateRule
from onnxopt.dsl.losses import (cross_entropy_index, cross_entropy_onehot, flat_pair, log_logits, weighted_mean,
                                weighted_sum)
from onnxopt.errors import DslError, ModelError, WeightError
from onnxopt.gradient import check_weights, gradient_ir, gradient_source, has_training_build
from onnxopt.modelio import ModelLike, load_model, runtime_limits
from onnxopt.passes.lower import (broken_kernels, check_portable, crops_as_slices,
                                  lower_training_ops)
from onnxopt.passes.tie import retarget, tie_parameters
from onnxopt.passes.modes import apply_mode, running_updates, split_statistics
from onnxopt.passes.fuse_update import fuse_update
from onnxopt.passes.kernels import optimizer_kernels
from onnxopt.passes.products import transposes_into_products
from onnxopt.passes.update import is_elementwise, multi_tensor, name_packs
from onnxopt.passes.unread import RemoveUnreadInitializersPass
from onnxopt.rules import widen_float_constants
from onnxopt.resolve import resolve_loss, resolve_penalty, resolve_schedule, resolve_update
from onnxopt.stages import CompileState, Stage, StageReport, run_stages
from onnxopt.step import GRAD, NEW, STEP, TrainStep
from onnxopt.tasks import choose_loss

__all__ = ["compile_train_step", "explain_train_step", "run_part", "STAGES", "select_output", "loss_graph",
           "apply_loss", "target_input"]


def select_output(m: ir.Model, output: str | None, what: str = "output") -> ir.Value:
    """The model output the loss reads; ``output`` is required when the model has several."""
    outs = {v.name: v for v in m.graph.outputs}
    if output is None:
        if len(outs) != 1:
            raise ModelError(f"{what}: the model has {len(outs)} outputs {list(outs)}; pass {what}= (on the command "
                             f"line --{what.replace('_', '-')} NAME) to pick one")
        return m.graph.outputs[0]
    if output not in outs:
        raise ModelError(f"{what}: {output!r} is not an output of the model (expected one of {list(outs)})")
    return outs[output]


def _keep_only(m: ir.Model, value: ir.Value) -> None:
    m.graph.outputs.clear()
    m.graph.outputs.append(value)
    passes.RemoveUnusedNodesPass()(m)


def target_input(graph: ir.Graph, loss: Loss, y: ir.Value) -> ir.Value:
    if loss.target == "index":
        return graphs.new_input(graph, "target", dtype=ir.DataType.INT64, shape=[graphs.rows(y)])
    return graphs.new_input(graph, "target", dtype=y.dtype)


def apply_loss(model: ir.Model, loss: Loss, ins: list[ir.Value]) -> ir.Value:
    """Calls the loss (and its reduction with the sample weight) on ``ins`` = [y, t(, sample_weight)]."""
    if loss.reduction is None:
        value = graphs.call(model, loss.fn, ins, loss.call_attrs(), "loss/fn")[0]
        # NOTE: a user loss may keep dims ([1], [1, 1]); the step's loss is a scalar (fails if not 1 element)
        scalar = ir.tape.Tape(model.graph).op(
            "Constant", [], {"value": ir.tensor(np.array([], np.int64))}, metadata_props={graphs.REGION: "loss"})
        return ir.tape.Tape(model.graph).op("Reshape", [value, scalar], metadata_props={graphs.REGION: "loss"})
    per_sample = graphs.call(model, loss.fn, ins[:2], loss.call_attrs(), "loss/per_sample")[0]
    reducer = weighted_mean if loss.reduction == "mean" else weighted_sum
    return graphs.call(model, reducer, [per_sample, ins[2]], {}, "loss/reduce")[0]


def loss_graph(loss: Loss, y: ir.Value, opset: int) -> ir.Model:
    """A standalone model (y, target[, sample_weight]) -> loss, its DSL calls inlined."""
    graph = ir.Graph([], [], nodes=[], opset_imports={"": opset}, name="loss")
    model = ir.Model(graph, ir_version=10)
    ins = [graphs.new_input(graph, "y", like=y), target_input(graph, loss, y)]
    if loss.weighted:
        ins.append(graphs.new_input(graph, "sample_weight", dtype=y.dtype, shape=[graphs.rows(y)]))
    out = apply_loss(model, loss, ins)
    out.name = "loss"
    graph.outputs.append(out)
    passes.InlinePass()(model)
    return model


def _loss_and_grad(model: ir.Model, loss: Loss, y: ir.Value, t: ir.Value, sw: ir.Value | None, gradient: str):
    """Adds the loss of ``y`` and its gradient dloss/dy to ``model``; derived by ORT unless ``loss.grad``."""
    ins = [y, t] + ([sw] if sw is not None else [])
    fast = _elementwise_loss(model, loss, y, t, sw) if sw is not None else None
    if fast is not None:
        return fast
    if loss.grad is not None:
        if loss.reduction is not None:
            raise DslError(f"loss {loss.name}: a hand-written grad needs a loss returning the scalar itself")
        value = apply_loss(model, loss, ins)
        return value, graphs.call(model, loss.grad, ins, loss.call_attrs(), "loss/grad")[0]
    standalone = loss_graph(loss, y, model.opset_imports[""])
    derived, _ = gradient_ir(standalone, [], ["y"], keep_outputs=True, fill_grad=True, gradient=gradient)
    outs = graphs.splice(model.graph, derived.graph, dict(zip(["y", "target", "sample_weight"], ins)), "loss")
    return outs["loss"], outs["y_grad"]


def _elementwise_loss(model: ir.Model, loss: Loss, y: ir.Value, t: ir.Value, sw: ir.Value) -> tuple | None:
    """Loss and dloss/dy from the loss's ``elementwise`` form, c_ik = s_i (/Σs) (/K); None if it does not apply."""
    k = y.shape[-1] if y.shape is not None and len(y.shape) == 2 else (1 if y.shape is not None and len(y.shape) == 1 else None)
    if loss.elementwise is None or loss.grad is not None or (loss.per_output == "one" and k != 1) \
            or (loss.per_output == "sample" and (y.shape is None or len(y.shape) != 2)):
        return None
    y2, t2 = (y, t) if loss.per_output == "sample" else graphs.call(model, flat_pair, [y, t], {}, "loss/flat", 2)
    tape = _RegionTape(model.graph, "loss")
    w = tape.op("Reshape", [sw, tape.op("Constant", [], {"value": ir.tensor(np.array([-1, 1], np.int64))})])
    if loss.reduction == "mean":
        w = tape.op("Div", [w, tape.op("ReduceSum", [w], {"keepdims": 0})])
    if loss.per_output == "mean" and k != 1:  # NOTE: K known at compile time folds to a constant
        k_value = tape.op("CastLike", [tape.op("Shape", [y2], {"start": 1, "end": 2}), y2]) if not isinstance(k, int) \
            else tape.op("Constant", [], {"value": ir.tensor(np.array(k, y.dtype.numpy()))})
        w = tape.op("Div", [w, k_value])
    value, grad = graphs.call(model, loss.elementwise, [y2, t2, w], loss.call_attrs(), "loss", 2)
    return value, tape.op("Reshape", [grad, tape.op("Shape", [y])])


def _penalty_and_grad(model: ir.Model, penalty: Penalty, w: ir.Value, gradient: str) -> tuple[ir.Value, ir.Value]:
    region = f"penalty/{w.name}"
    value = graphs.call(model, penalty.fn, [w], penalty.call_attrs(), region)[0]
    if penalty.grad is not None:
        return value, graphs.call(model, penalty.grad, [w], penalty.call_attrs(), region + "/grad")[0]
    standalone = ir.Model(ir.Graph([], [], nodes=[], opset_imports=dict(model.opset_imports), name="penalty"), ir_version=10)
    pw = graphs.new_input(standalone.graph, "w", like=w)
    out = graphs.call(standalone, penalty.fn, [pw], penalty.call_attrs(), "p")[0]
    out.name = "p"
    standalone.graph.outputs.append(out)
    passes.InlinePass()(standalone)
    derived, _ = gradient_ir(standalone, [], ["w"], keep_outputs=False, fill_grad=True, gradient=gradient)
    return value, graphs.splice(model.graph, derived.graph, {"w": w}, "penalty", prefix=region)["w_grad"]


def _clip(tape: ir.tape.Tape, grads: list[ir.Value], max_norm: float) -> list[ir.Value]:
    """torch's clip_grad_norm_: g ← g·min(1, max_norm / (‖g‖₂ + 1e-6)) with one norm over all gradients."""
    squares = [tape.op("ReduceSumSquare", [g], {"keepdims": 0}) for g in grads]
    total = tape.op("Sqrt", [squares[0] if len(squares) == 1 else tape.op("Sum", squares)])
    like = grads[0]
    const = lambda v: tape.op("CastLike", [tape.op("Constant", [], {"value": ir.tensor(np.array(v, np.float64))}), like])  # noqa: E731
    coef = tape.op("Min", [const(1.0), tape.op("Div", [const(max_norm), tape.op("Add", [total, const(1e-6)])])])
    return [tape.op("Mul", [g, coef]) for g in grads]


# NOTE: what may follow a Softmax or Sigmoid in a probabilities output (skl2onnx: Concat(1 - p, p), Div by the sum)
_TAIL = {"Identity", "Cast", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Concat", "Sub", "Div", "Abs", "ReduceSum",
         "Mul", "Neg"}


def _normalizer(y: ir.Value, depth: int = 6) -> ir.Node | None:
    """The Softmax or Sigmoid node ``y`` comes from through at most ``depth`` ``_TAIL`` ops, else None."""
    node = y.producer()
    if node is None or depth == 0:
        return None
    if node.op_type in ("Softmax", "Sigmoid"):
        return node
    if node.op_type not in _TAIL:
        return None
    return next((found for v in node.inputs if v is not None and (found := _normalizer(v, depth - 1))), None)


def _warn_if_normalized_twice(loss: Loss | None, y: ir.Value) -> None:
    """Warns when a loss on raw scores (it applies its own softmax or sigmoid) reads an output that a Softmax or
    Sigmoid already normalized: trained as asked, but almost always meant on probabilities."""
    if loss is None or loss.fn not in (log_logits, cross_entropy_index, cross_entropy_onehot):
        return
    node = _normalizer(y)
    if node is not None:
        warnings.warn(f"loss: {loss.name!r} applies its own {'sigmoid' if loss.name == 'log' else 'softmax'} to "
                      f"output {y.name!r}, which {node.op_type} node {node.name!r} already normalizes; expected "
                      f"scores, or '{loss.name}:from_logits=false' (loss='auto') to train on probabilities",
                      UserWarning, stacklevel=3)


def _external_grad(g: ir.Graph, y: ir.Value) -> ir.Value:
    """Renames the output-gradient input ``<y>.grad``; returns the data part of the loss, zero: the caller
    computes it (the step's ``loss`` is then the penalty alone)."""
    grad = next(v for v in g.inputs if v.name == y.name + "_grad")
    grad.name = y.name + GRAD
    grad.type, grad.shape = grad.type or y.type, grad.shape or y.shape
    zero = ir.tensor(np.array(0, dtype=y.dtype.numpy()))
    return ir.tape.Tape(g).op("Constant", [], {"value": zero}, metadata_props={graphs.REGION: "loss"})


# -- the stages of compile_train_step: each reads what earlier stages left in the state (``stages.run_stages``) --

def _load(s: CompileState) -> None:
    """Loads the model; picks the gradient source, the loss ("auto") and its output, portable or not.

    Needs the options; leaves ``model`` (an ir.Model), ``source``, ``loss``, ``output``, ``portable``."""
    s.source = gradient_source(s.gradient)
    s.loss, s.output = choose_loss(s.model_arg, s.loss, s.output)
    s.portable = s.portable or not has_training_build()  # NOTE: stock onnxruntime runs standard ONNX only
    s.model = load_model(s.model_arg)


def _tie(s: CompileState) -> None:
    """Ties duplicated parameters (``passes.tie``).

    Needs ``model``; leaves ``ties`` ({duplicate: parameter}) and ``weights``, ``frozen``, ``fixed_rows`` renamed to
    the tied parameters."""
    s.ties = ties = tie_parameters(s.model, s.tie)
    s.weights, s.frozen = retarget(s.weights, ties), retarget(s.frozen, ties)
    s.fixed_rows = {ties.get(n, n): rows for n, rows in (s.fixed_rows or {}).items()}


def _inference(s: CompileState) -> None:
    """Splits running statistics from weights and keeps the inference model.

    Needs ``ties`` (the tied model); leaves ``inference`` (the proto ``Runner.export`` writes into)."""
    split_statistics(s.model)  # NOTE: also in the inference model, so export() writes statistics and weights apart
    s.inference = ir.to_proto(s.model)


def _check(s: CompileState) -> None:
    """Resolves the update rule, penalty, schedule and loss declarations.

    Needs ``loss``; leaves ``rule``, ``pen``, ``sched``, ``loss_decl`` and ``by_output`` (the loss reads the
    prediction, not an output holding the loss)."""
    s.rule, s.pen, s.sched = resolve_update(s.update), resolve_penalty(s.penalty), resolve_schedule(s.learning_rate)
    s.loss_decl = resolve_loss(s.loss) if s.loss is not None else None
    if s.external_grad and s.loss_decl is not None:
        raise DslError(f"loss: external_grad=True takes the output gradient as an input; expected loss=None, "
                       f"got {s.loss!r}")
    s.by_output = s.loss_decl is not None or s.external_grad


def _select(s: CompileState) -> None:
    """Keeps only the output the loss reads (or the loss output) and what computes it.

    Needs ``model``, ``by_output``; leaves ``y``, that output."""
    by_output = s.by_output
    s.y = select_output(s.model, s.output if by_output else s.loss_output,
                        "output" if by_output else "loss_output")
    _warn_if_normalized_twice(s.loss_decl, s.y)
    _keep_only(s.model, s.y)


def _modes(s: CompileState) -> None:
    """Applies ``mode`` (train: Dropout active, BatchNormalization on batch statistics, its statistics carried).

    Needs ``y`` (after ``select``, whose unused-output removal would drop Dropout's mask); leaves ``stats``."""
    s.stats = apply_mode(s.model, s.mode)
    carried = [st.name for st in s.stats if s.weights is not None and st.name in s.weights]
    if carried:
        raise WeightError(f"weights: {carried} are BatchNormalization running statistics, carried as state in "
                          "mode='train', not trained; expected weights, or mode='eval' to keep them as constants")


def _trained(s: CompileState) -> None:
    """Picks the trained weights: ``weights`` less ``frozen``, None = every real weight (``check_weights``).

    Needs ``stats`` (after ``modes``; a client that applies no mode passes ``stats=()``); leaves ``names`` and
    ``initial`` (their values)."""
    s.names = check_weights(s.model, s.weights, s.frozen)
    s.initial = {n: s.model.graph.initializers[n].const_value for n in s.names}


def _functions(s: CompileState) -> None:
    """Checks the step's DSL functions against the trained weights; clears their values from ``inference``.

    Needs ``names``, ``rule``, ``inference``; leaves ``checked``."""
    check_step_functions(s.loss_decl, s.rule, s.pen, s.sched, s.y, [s.model.graph.initializers[n] for n in s.names],
                         s.model.opset_imports[""])
    for init in s.inference.graph.initializer:  # NOTE: trained values live in the runner, not twice on disk
        if init.name in s.initial:
            for field in ("raw_data", "float_data", "double_data"):
                init.ClearField(field)
    s.checked = True


def _differentiate(s: CompileState) -> None:
    """Builds the gradient graph (forward, backward) of the kept output with respect to the trained weights.

    Needs ``names``, ``initial``, ``checked``; leaves ``fused`` (the step being built), ``y`` (its prediction),
    ``grads`` and ``ws`` (gradient and weight values, in ``names`` order)."""
    s.fused, forward = gradient_ir(s.model, s.names, (), keep_outputs=True, fill_grad=not s.by_output,
                                   portable=s.portable, gradient=s.source)
    g = s.fused.graph
    if forward[0].type is None:  # NOTE: the builder drops the value info of outputs that feed the YieldOp
        forward[0].type, forward[0].shape = s.y.type or ir.TensorType(s.initial[s.names[0]].dtype), s.y.shape
    s.y = forward[0]
    grad_by_weight = {v.name[: -len("_grad")]: v for v in g.outputs if v.name.endswith("_grad")}
    missing = [n for n in s.names if n not in grad_by_weight]
    if missing:
        raise ModelError(f"weights: {missing} do not reach output {s.y.name!r}; no gradient flows to them")
    g.outputs.clear()
    s.grads = [grad_by_weight[n] for n in s.names]
    w_values = {v.name: v for v in g.inputs}
    s.ws = [w_values[n] for n in s.names]


def _loss(s: CompileState) -> None:
    """Computes the loss of the prediction and feeds its gradient to the backward graph.

    Needs ``fused``, ``y``; leaves ``loss_value``, ``target`` and ``sample_weight`` (inputs, or None)."""
    g, y = s.fused.graph, s.y
    s.target = s.sample_weight = None
    if s.external_grad:
        s.loss_value = _external_grad(g, y)
    elif s.loss_decl is None:
        s.loss_value = y
    else:
        s.target = target_input(g, s.loss_decl, y)
        s.sample_weight = (graphs.new_input(g, "sample_weight", dtype=y.dtype, shape=[graphs.rows(y)])
                           if s.loss_decl.weighted else None)
        s.loss_value, dy = _loss_and_grad(s.fused, s.loss_decl, y, s.target, s.sample_weight, s.source)
        y_grad_input = next(v for v in g.inputs if v.name == y.name + "_grad")
        ir.convenience.replace_all_uses_with(y_grad_input, dy)
        g.inputs.remove(y_grad_input)


def _penalty(s: CompileState) -> None:
    """Zeroes the ``fixed_rows`` of their gradients, adds the penalty to the loss and its gradient to each weight's.

    Needs ``grads``, ``loss_value``; leaves ``penalized`` (gradients) and ``total_loss``."""
    tape = _RegionTape(s.fused.graph, "penalty")
    grads, loss_value = list(s.grads), s.loss_value
    _zero_rows(tape, grads, s.ws, s.fixed_rows)
    if s.pen is not None:
        terms = []
        for i, w in enumerate(s.ws):
            p, pg = _penalty_and_grad(s.fused, s.pen, w, s.source)
            terms.append(p)
            grads[i] = tape.op("Add", [grads[i], pg])
        loss_value = tape.op("Add", [loss_value, terms[0] if len(terms) == 1 else tape.op("Sum", terms)])
    s.penalized, s.total_loss = grads, loss_value


def _clip_stage(s: CompileState) -> None:
    """Clips the penalized gradients to the rule's global norm (``clip_norm``), if any.

    Needs ``penalized``; leaves ``clipped``."""
    clip = s.rule.clip_norm
    s.clipped = s.penalized if clip is None else _clip(_RegionTape(s.fused.graph, "update"), s.penalized, clip)


def _schedule(s: CompileState) -> None:
    """Adds the step counter input and the learning rate the schedule computes from it.

    Needs ``ws``; leaves ``step_next`` (the counter + 1), ``t`` (it in the weights' type) and ``lr``."""
    tape = _RegionTape(s.fused.graph, "schedule")
    step = graphs.new_input(s.fused.graph, STEP, dtype=ir.DataType.INT64, shape=[])
    s.step_next = tape.op("Add", [step, tape.op("Constant", [], {"value": ir.tensor(np.array(1, np.int64))})])
    s.t = tape.op("CastLike", [s.step_next, s.ws[0]])
    s.lr = graphs.call(s.fused, s.sched.fn, [s.t], s.sched.call_attrs(), "schedule")[0]


def _update(s: CompileState) -> None:
    """Applies the update rule: new weights and optimizer state (one multi-tensor call for a stateful rule).

    Needs ``clipped``, ``lr``, ``t``; leaves ``outputs``, ``out_names``, ``state_names``, ``packs``, ``splits``."""
    rule, ws, g = s.rule, s.ws, s.fused.graph
    outputs, out_names, state_names, packs, splits = [], [], [], {}, []
    # NOTE: a stateful elementwise rule runs once on all weights concatenated (docs/fused_step.md): Adam costs
    # ~13 kernels instead of ~13 per weight; SGD stays per weight, where its Gemm form folds the update in.
    if rule.state and len(ws) > 1 and all(w.shape is not None and w.shape.is_static() for w in ws) \
            and is_elementwise(rule):
        tape = _RegionTape(g, "update")
        outputs, out_names, state_names, packs, splits = multi_tensor(s.fused, rule, ws, s.clipped, s.lr, s.t, tape)
    for w, gw in zip(ws, s.clipped) if not packs else ():
        states = [graphs.new_input(g, f"{w.name}.{st}", like=w) for st in rule.state]
        state_names += [st.name for st in states]
        args = [w, gw, s.lr, *states] + ([s.t] if rule.uses_step else [])
        outputs += graphs.call(s.fused, rule.fn, args, rule.call_attrs(), f"update/{w.name}", 1 + len(states))
        out_names += [src.name + NEW for src in [w, *states]]
    s.outputs, s.out_names, s.state_names, s.packs, s.splits = outputs, out_names, state_names, packs, splits


def _outputs(s: CompileState) -> None:
    """Sets the step's outputs (loss, new weights and state, counter, statistics, prediction); weights as initializers.

    Needs ``total_loss``, ``outputs``, ``step_next``, ``stats``; leaves ``output_names``."""
    prediction = [s.y] if s.external_grad else []
    buffers = running_updates(s.fused, s.stats)
    s.fused.graph.outputs.extend([s.total_loss, *s.outputs, s.step_next, *(v for v, _ in buffers), *prediction])
    for w in s.ws:
        w.const_value = s.initial[w.name]
        s.fused.graph.register_initializer(w)
    s.output_names = ["loss", *s.out_names, STEP + NEW, *(n for _, n in buffers), *[v.name for v in prediction]]


def _lower(s: CompileState) -> None:
    """Lowers the training-only ops onnxruntime lacks or runs wrong; fuses optimizer kernels (training build).

    Needs ``output_names``; leaves ``lowered`` (``finish`` needs it: its constant folding folds the lowerings'
    CastLike'd constants)."""
    dtype = s.initial[s.names[0]].dtype
    lower_training_ops(s.fused, None if s.portable else broken_kernels(dtype))
    if not s.portable:  # NOTE: onnxruntime-training's fused optimizer kernels, where they match the rule exactly
        optimizer_kernels(s.fused, s.rule, dtype)
    s.lowered = True


def _finish_stage(s: CompileState) -> None:
    """Inlines the DSL calls, names the outputs, folds constants, drops dead nodes, sets versions (``_finish``).

    Needs ``lowered``; leaves ``finished``."""
    _finish(s.fused, s.output_names, s.initial[s.names[0]].dtype)
    s.finished = True


def _optimize(s: CompileState) -> None:
    """Fuses the update into the gradient's products, folds transposes, names the packs; checks a portable step;
    drops the initializers no node reads.

    Needs ``finished``; leaves ``optimized``."""
    fuse_update(s.fused, kernels=not s.portable)
    transposes_into_products(s.fused)
    name_packs(s.packs, s.splits)
    if s.portable:
        crops_as_slices(s.fused)
        check_portable(s.fused)
    RemoveUnreadInitializersPass()(s.fused)  # NOTE: what the rewrites above left; ORT 1.32 warns about each
    s.optimized = True


def _package(s: CompileState) -> None:
    """Wraps the step graph and its roles (data, target, weights, state, buffers) as a ``TrainStep``.

    Needs ``optimized``; leaves ``step``."""
    data_inputs = [v.name for v in s.model.graph.inputs if v.name not in s.model.graph.initializers]
    if s.external_grad:
        target_name = sw_name = None
    elif s.loss_decl is None:  # NOTE: a model from add_loss_output names its extra inputs target/sample_weight
        target_name = "target" if "target" in data_inputs else None
        sw_name = "sample_weight" if "sample_weight" in data_inputs else None
        data_inputs = [n for n in data_inputs if n not in (target_name, sw_name)]
    else:
        target_name, sw_name = s.target.name, s.sample_weight.name if s.sample_weight is not None else None
    loss_decl, y = s.loss_decl, s.y
    s.step = TrainStep(
        model=ir.to_proto(s.fused), inputs=data_inputs, target=target_name, sample_weight=sw_name, loss="loss",
        weights=s.names,
        state=[*s.state_names, STEP], buffers=[st.name for st in s.stats],
        target_kind=loss_decl.target if loss_decl else "float",
        classes=y.shape[-1] if target_name and loss_decl is not None and loss_decl.target == "index" and y.shape
        and isinstance(y.shape[-1], int) else None,
        inference=s.inference.SerializeToString(),
        output_grad=y.name + GRAD if s.external_grad else None, prediction=y.name if s.external_grad else None,
    )


STAGES: tuple[Stage, ...] = (
    Stage("load", _load, (), ("model", "source", "portable")),
    Stage("tie", _tie, ("model",), ("ties", "weights", "frozen", "fixed_rows")),
    Stage("inference", _inference, ("ties",), ("inference",)),
    Stage("check", _check, ("loss",), ("rule", "pen", "sched", "loss_decl", "by_output")),
    Stage("select", _select, ("model", "by_output"), ("y",)),
    Stage("modes", _modes, ("y",), ("stats",)),
    Stage("weights", _trained, ("stats",), ("names", "initial")),
    Stage("functions", _functions, ("names", "rule", "inference"), ("checked",)),
    Stage("differentiate", _differentiate, ("names", "initial", "checked"), ("fused", "y", "grads", "ws")),
    Stage("loss", _loss, ("fused", "y"), ("loss_value", "target", "sample_weight")),
    Stage("penalty", _penalty, ("grads", "loss_value"), ("penalized", "total_loss")),
    Stage("clip", _clip_stage, ("penalized",), ("clipped",)),
    Stage("schedule", _schedule, ("ws", "sched"), ("step_next", "t", "lr")),
    Stage("update", _update, ("clipped", "lr", "t"), ("outputs", "out_names", "state_names", "packs", "splits")),
    Stage("outputs", _outputs, ("total_loss", "outputs", "step_next", "stats"), ("output_names",)),
    Stage("lower", _lower, ("output_names",), ("lowered",)),
    Stage("finish", _finish_stage, ("lowered",), ("finished",)),
    Stage("optimize", _optimize, ("finished",), ("optimized",)),
    Stage("package", _package, ("optimized",), ("step",)),
)


def compile_train_step(
    model: ModelLike,
    loss: str | Loss | None = "square",
    update: str | UpdateRule = "sgd",
    penalty: str | Penalty | None = None,
    learning_rate: float | str | Schedule = 1e-2,
    weights: Sequence[str] | None = None,
    output: str | None = None,
    loss_output: str | None = None,
    external_grad: bool = False,
    mode: str = "train",
    frozen: Sequence[str] | None = None,
    portable: bool = False,
    tie: bool = True,
    fixed_rows: dict[str, Sequence[int]] | None = None,
    gradient: str | None = None,
) -> TrainStep:
    """Compiles one training step of ``model`` into a single ONNX graph (see ``step.TrainStep`` for its names):
    runs ``STAGES`` (load, tie, inference, check, select, modes, weights, functions, differentiate, loss, penalty,
    clip, schedule, update, outputs, lower, finish, optimize, package) on the arguments.

    Args:
        model: the inference model (proto, ir.Model or path).
        loss: a loss name, a ``dsl.losses.X(...)`` or ``@dsl.loss`` declaration; None when the model already
            outputs its loss, named by ``loss_output``; "auto" as ``Trainer``'s (``tasks.choose_loss``: the
            cross-entropy of a converted classifier's scores or probabilities, else square).
        update: an update-rule name or declaration (``dsl.updates``, ``@dsl.update_rule``).
        penalty: None, a penalty name or declaration applied to every trained weight.
        learning_rate: a float (constant) or a schedule (``dsl.schedules``), computed in the graph.
        weights: initializers to train; None = every real weight (``train_initializers``).
        output: the output the loss reads when the model has several.
        loss_output: with ``loss=None``, the output holding the loss.
        external_grad: with ``loss=None``, the gradient on ``output`` is an input ``<output>.grad`` given by
            the caller; the step also outputs the prediction ``<output>`` (docs/fused_step.md).
        mode: "train" (torch's ``module.train()``: Dropout active, BatchNormalization on batch statistics, its
            running statistics carried as ``TrainStep.buffers``) or "eval" (both as at inference).
        frozen: initializers never trained, even when ``weights=None`` picks them.
        portable: lower the training-only ops of the backward graph to standard ONNX (``passes.lower``): the
            step then runs on stock onnxruntime, onnxruntime-gpu or onnx.reference (docs/portable.md). Always
            on when onnxruntime is not the training build.
        gradient: "onnxopt" (its own rules, any onnxruntime), "builder" (onnxruntime-training's), or None/"auto"
            (``gradient.gradient_source``); docs/gradients.md compares them.
        tie: train the initializers an exporter duplicated (``A`` and a copy of ``A`` or ``A^T``) as one
            parameter, exported tied (``passes.tie``); False trains them apart.
        fixed_rows: {weight: rows} whose gradient is zero, as torch's ``Embedding(padding_idx=...)`` makes it
            (exporters drop ``padding_idx``); a penalty still moves them, as torch's weight decay does.
    """
    # NOTE: the arguments, as the options the stages read (``model`` as ``model_arg``: ``load`` leaves the ir.Model)
    return run_stages(STAGES, _options(locals())).step


def _options(arguments: dict) -> CompileState:
    options = dict(arguments)
    options["model_arg"] = options.pop("model")
    return CompileState(**options)


def _bound(model: ModelLike, kwargs: dict) -> CompileState:
    """A state of ``compile_train_step``'s arguments ``kwargs``, its defaults for those not given."""
    arguments = inspect.signature(compile_train_step).bind(model, **kwargs)
    arguments.apply_defaults()
    return _options(arguments.arguments)


def explain_train_step(model: ModelLike, **kwargs) -> tuple[TrainStep, list[StageReport]]:
    """``compile_train_step(model, **kwargs)`` and what each stage did (``onnxopt compile --explain``)."""
    report: list[StageReport] = []
    return run_stages(STAGES, _bound(model, kwargs), report=report).step, report


def run_part(model: ModelLike | CompileState, names: Collection[str], **options) -> CompileState:
    """Runs the stages ``names`` of ``STAGES``, in the list's order: the part of the compiler that ``grad``, partial
    training and the facades run instead of their own copies (docs/fused_step.md).

    ``model`` is a model, then the state holds ``compile_train_step``'s options (its defaults for those not given)
    plus the other ``options`` (what a client passes for a stage it does not run); or the state an earlier part
    left, ``options`` added."""
    if not isinstance(model, CompileState):
        known = inspect.signature(compile_train_step).parameters
        model = _bound(model, {k: v for k, v in options.items() if k in known})
    model.__dict__["_values"].update(options)
    return run_stages(STAGES, model, only=names)


def _zero_rows(tape: ir.tape.Tape, grads: list[ir.Value], ws: list[ir.Value], fixed_rows: dict) -> None:
    """Multiplies each gradient of ``fixed_rows`` by a mask whose listed rows (first axis) are 0."""
    unknown = sorted(set(fixed_rows) - {w.name for w in ws})
    if unknown:
        raise WeightError(f"fixed_rows: {unknown} are not trained weights (expected some of {[w.name for w in ws]})")
    for i, w in enumerate(ws):
        if w.name not in fixed_rows:
            continue
        rows, n = [int(r) for r in fixed_rows[w.name]], w.shape[0]
        if any(not -n <= r < n for r in rows):
            raise WeightError(f"fixed_rows: rows {rows} of {w.name!r} out of range (it has {n} rows)")
        mask = np.ones((n,) + (1,) * (len(w.shape) - 1), w.dtype.numpy())
        mask[rows] = 0
        grads[i] = tape.op("Mul", [grads[i], tape.op("Constant", [], {"value": ir.tensor(mask)})])


class _RegionTape(ir.tape.Tape):
    """A tape whose nodes carry the region they belong to (penalty, update, schedule)."""

    def __init__(self, graph: ir.Graph, region: str):
        super().__init__(graph)
        self.region = region

    def op(self, *args, **kwargs):
        return super().op(*args, metadata_props={graphs.REGION: self.region}, **kwargs)


# NOTE: ops whose ONNX shape inference gives the output input 0's element type, and its shape (unary) or the two
# inputs' broadcast shape (binary); _FoldConstants computes them in Python for tensor inputs of known types/shapes
_SAME_SHAPE = frozenset({"Neg", "Relu", "Sign", "Sqrt", "Exp", "Log", "Abs", "Identity", "Sigmoid", "Tanh",
                         "Reciprocal", "Erf", "Floor", "Ceil"})
_BROADCAST = frozenset({"Add", "Sub", "Mul", "Div"})
_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _elementwise_type(node: ir.Node) -> tuple[ir.DataType, ir.Shape] | None:
    """(element type, shape) ONNX shape inference gives the output of an elementwise ``node`` whose inputs are
    tensors of known types and shapes without denotations, in the cases computed exactly here (one input;
    two inputs of one type whose shapes are equal, or one of them all ones of no larger rank), else None."""
    if node.domain not in ("", "ai.onnx") or len(node.outputs) != 1 or any(v is None for v in node.inputs):
        return None
    unary = node.op_type in _SAME_SHAPE and len(node.inputs) == 1
    if not unary and not (node.op_type in _BROADCAST and len(node.inputs) == 2):
        return None
    shapes = []
    for v in node.inputs:
        if not isinstance(v.type, ir.TensorType) or v.shape is None or \
                any(v.shape.get_denotation(i) is not None for i in range(len(v.shape))):
            return None
        shapes.append(list(v.shape))
    dtype = node.inputs[0].dtype
    if dtype not in _FLOATS if unary else dtype not in (*_FLOATS, ir.DataType.INT32, ir.DataType.INT64):
        return None  # NOTE: the types every op here accepts (ONNX would refuse others)
    if unary:
        return dtype, ir.Shape(shapes[0])
    if node.inputs[1].dtype != dtype:
        return None
    a, b = shapes
    ones = lambda dims: all(isinstance(d, int) and d == 1 for d in dims)  # noqa: E731
    if len(a) == len(b) and all(type(x) is type(y) and x == y for x, y in zip(a, b)):
        return dtype, ir.Shape(a)
    if len(b) <= len(a) and ones(b):
        return dtype, ir.Shape(a)
    if len(a) <= len(b) and ones(a):
        return dtype, ir.Shape(b)
    return None


def _dims(value: ir.Value) -> list | None:
    """``value``'s dimensions (ints and ``ir.SymbolicDim``) when it is a tensor of known shape without
    denotations, else None."""
    shape = value.shape
    if not isinstance(value.type, ir.TensorType) or shape is None or \
            any(shape.get_denotation(i) is not None for i in range(len(shape))):
        return None
    return list(shape)


def _small_ints(value: ir.Value | None) -> list[int] | None:
    """The values of a constant int64 tensor of at most 20 elements (what onnxscript gives ONNX's inference as
    input data), else None."""
    tensor = None if value is None else value.const_value
    if tensor is None or tensor.dtype != ir.DataType.INT64 or tensor.size > 20:
        return None
    return [int(v) for v in tensor.numpy().reshape(-1)]


def _unknown(dim) -> bool:
    return isinstance(dim, ir.SymbolicDim) and dim.value is None


def _shape_type(node: ir.Node):
    dims = _dims(node.inputs[0])
    if dims is None:
        return None
    start, end = node.attributes.get_int("start", 0), node.attributes.get_int("end", len(dims))
    return ir.DataType.INT64, [len(range(len(dims))[start:end])]


def _size_type(node: ir.Node):
    return ir.DataType.INT64, []


def _cast_type(node: ir.Node):
    to = node.attributes.get_int("to")
    x = node.inputs[0]
    dims = _dims(x)
    if to is None or to not in {t.value for t in ir.DataType} or (dims is None and x.shape is not None):
        return None
    return ir.DataType(to), dims


def _cast_like_type(node: ir.Node):
    if len(node.inputs) != 2:
        return None
    x, like = node.inputs
    dims = _dims(x)
    if like is None or like.dtype is None or (dims is None and x.shape is not None):
        return None
    return like.dtype, dims


def _transpose_type(node: ir.Node):
    x = node.inputs[0]
    dims = _dims(x)
    if dims is None:
        return (x.dtype, None) if x.shape is None else None
    perm = node.attributes.get_ints("perm", list(range(len(dims)))[::-1])
    if sorted(perm) != list(range(len(dims))):
        return None
    return x.dtype, [dims[p] for p in perm]


def _reshape_type(node: ir.Node):
    if len(node.inputs) != 2:
        return None
    x, target = node.inputs[0], _small_ints(node.inputs[1])
    dims = _dims(x)
    shape = node.inputs[1].shape
    if node.inputs[1].const_value is None and shape is not None and len(shape) == 1 and isinstance(shape[0], int):
        return x.dtype, [None] * shape[0]  # NOTE: ONNX's without the target's values: its rank
    if target is None or node.attributes.get_int("allowzero", 0) != 0 or (dims is None and x.shape is not None):
        return None
    out, product, unresolved, negative = [], 1, set(), None
    for i, t in enumerate(target):
        if t > 0:
            out.append(t)
            product *= t
        elif t == 0:
            if dims is None:
                out.append(None)
                unresolved.add(i)
            elif i >= len(dims):
                return None
            else:
                out.append(dims[i])
                if isinstance(dims[i], int):
                    product *= dims[i]
                else:
                    unresolved.add(i)
        elif t == -1 and negative is None:
            negative = i
            out.append(None)
        else:
            return None
    if negative is not None and dims is not None:
        total = 1
        for i, d in enumerate(dims):
            if isinstance(d, int):
                total *= d
            elif i not in unresolved:
                total = None
                break
        if total is not None:
            if product == 0 or total % product:
                return None
            out[negative] = total // product
    return x.dtype, out


def _concat_type(node: ir.Node):
    shapes = [_dims(v) for v in node.inputs]
    if any(v is None for v in node.inputs) or not shapes:
        return None
    if any(s is None for s in shapes):
        return (None, None) if all(isinstance(v.type, ir.TensorType) for v in node.inputs) else None
    rank = len(shapes[0])
    axis = node.attributes.get_int("axis")
    if axis is None or any(len(s) != rank for s in shapes) or not -rank <= axis < rank:
        return None
    axis %= rank
    out = []
    for j in range(rank):
        if j == axis:
            lengths = [s[j] for s in shapes]
            out.append(sum(lengths) if all(isinstance(d, int) for d in lengths) else None)
            continue
        merged = None
        for s in shapes:
            d = s[j]
            if isinstance(d, int):
                if isinstance(merged, int) and merged != d:
                    return None
                merged = d
            elif not isinstance(merged, int) and (merged is None or _unknown(merged)) and not _unknown(d):
                merged = d
        out.append(merged)
    return node.inputs[0].dtype, out


def _gemm_type(node: ir.Node):
    if len(node.inputs) < 2 or node.inputs[1] is None:
        return None
    a, b = (_dims(v) for v in node.inputs[:2])
    if a is None or b is None or len(a) != 2 or len(b) != 2:
        return None
    trans_a, trans_b = node.attributes.get_int("transA", 0), node.attributes.get_int("transB", 0)
    k_a, k_b = a[0 if trans_a else 1], b[1 if trans_b else 0]
    if isinstance(k_a, int) and isinstance(k_b, int) and k_a != k_b:
        return None  # NOTE: ONNX's inference fails there
    return node.inputs[0].dtype, [a[1 if trans_a else 0], b[0 if trans_b else 1]]


def _broadcast(shapes: list[list]) -> list | None:
    """ONNX's multidirectional broadcast of ``shapes`` (its shape inference's rule: a dimension other than 1 wins,
    one symbol is kept, different symbols give an unknown dimension), None where ONNX's would fail."""
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        value, symbols = 1, []
        for s in shapes:
            k = i - (rank - len(s))
            if k < 0:
                continue
            d = s[k]
            if isinstance(d, int):
                if value != 1 and d not in (1, value):
                    return None
                if value == 1:
                    value = d
            elif not symbols or d.value != symbols[0].value:
                symbols.append(d)
        out.append(value if value != 1 or not symbols else symbols[0] if len(symbols) == 1 else None)
    return out


def _binary_type(node: ir.Node):
    if len(node.inputs) != 2 or node.inputs[1] is None or node.inputs[0].dtype != node.inputs[1].dtype or \
            node.inputs[0].dtype not in (*_FLOATS, ir.DataType.INT32, ir.DataType.INT64):
        return None
    shapes = [_dims(v) for v in node.inputs]
    return None if any(s is None for s in shapes) else (node.inputs[0].dtype, _broadcast(shapes))


def _matmul_type(node: ir.Node):
    if len(node.inputs) != 2 or node.inputs[1] is None:
        return None
    a, b = (_dims(v) for v in node.inputs)
    if a is None or b is None or not a or not b:
        return None
    left, right = ([1, *a] if len(a) == 1 else a), ([*b, 1] if len(b) == 1 else b)
    if isinstance(left[-1], int) and isinstance(right[-2], int) and left[-1] != right[-2]:
        return None
    batch = _broadcast([left[:-2], right[:-2]]) if len(left) > 2 or len(right) > 2 else []
    if batch is None:
        return None
    return node.inputs[0].dtype, [*batch, *([left[-2]] if len(a) != 1 else []), *([right[-1]] if len(b) != 1 else [])]


def _reduce_type(node: ir.Node):
    dims = _dims(node.inputs[0])
    if dims is None:
        return None
    if "axes" in node.attributes:
        axes = list(node.attributes.get_ints("axes"))
    elif len(node.inputs) > 1 and node.inputs[1] is not None:
        axes = _small_ints(node.inputs[1])
        if axes is None:
            return None
    else:
        axes = []
    keep = node.attributes.get_int("keepdims", 1)
    if not axes and node.attributes.get_int("noop_with_empty_axes", 0):
        return node.inputs[0].dtype, dims
    if any(not -len(dims) <= a < len(dims) for a in axes):
        return None
    axes = {a % len(dims) for a in axes} if axes else set(range(len(dims)))
    return node.inputs[0].dtype, [1 if j in axes else d for j, d in enumerate(dims) if keep or j not in axes]


# NOTE: what ONNX's shape inference gives these ops' single output, computed here for the cases listed (any
# other case, a None, goes to ONNX): (element type or None = input 0's, dims or None = no shape)
_INFER = {"Shape": _shape_type, "Size": _size_type, "Cast": _cast_type, "CastLike": _cast_like_type,
          "Transpose": _transpose_type, "Reshape": _reshape_type, "Concat": _concat_type, "Gemm": _gemm_type,
          "MatMul": _matmul_type, "ReduceSum": _reduce_type, "ReduceMean": _reduce_type,
          **{op: _binary_type for op in _BROADCAST}}


def _known_type(node: ir.Node) -> tuple[ir.DataType, ir.Shape | None] | None:
    """(element type, shape or None) ONNX shape inference gives the one output of ``node``, for the ops and
    cases computed exactly here (``_elementwise_type``, ``_INFER``), else None."""
    known = _elementwise_type(node)
    if known is not None:
        return known
    infer = _INFER.get(node.op_type)
    if infer is None or node.domain not in ("", "ai.onnx") or len(node.outputs) != 1 or not node.inputs or \
            node.inputs[0] is None or any(v is not None and not isinstance(v.type, ir.TensorType) for v in node.inputs):
        return None
    try:
        result = infer(node)
    except (TypeError, ValueError, AttributeError):  # NOTE: an attribute of another type or a reference
        return None
    if result is None:
        return None
    dtype, dims = result
    dtype = dtype if dtype is not None else node.inputs[0].dtype
    return None if dtype is None else (dtype, None if dims is None else ir.Shape(dims))


_CASTS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.INT32, ir.DataType.INT64)


class _FoldConstants(constant_folding.FoldConstantsPass):
    """onnxscript's constant folding with a cheaper shape inference: none for a node whose outputs all have a
    type and a static shape already (it could only confirm them), none for a node with an input of unknown type
    (onnxscript's skips it too), the result computed directly for the common ops (``_known_type``); onnxscript's
    per-node ONNX inference (a serialization of the node and its input types each) is most of the pass's time
    otherwise."""

    def process_node(self, node: ir.Node, is_function: bool):
        folded = None if is_function else self._cast_constant(node) or self._concat_constant(node)
        return folded if folded is not None else super().process_node(node, is_function)

    def _concat_constant(self, node: ir.Node):
        """A Concat (axis 0) of small 1-D int64 constants, a shape the rules build from pieces known only now,
        folded with NumPy's ``concatenate`` instead of ONNX's reference Concat (~1 ms a node); else None."""
        if node.op_type != "Concat" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2 or \
                len(node.outputs) != 1 or node.outputs[0].is_graph_output() or len(node.attributes) != 1 or \
                node.attributes.get_int("axis") != 0:
            return None
        arrays = []
        for x in node.inputs:
            tensor = None if x is None or x.is_graph_input() else x.const_value
            if tensor is None or tensor.dtype != ir.DataType.INT64 or len(tensor.shape) != 1 or tensor.size > 64:
                return None
            arrays.append(tensor.numpy())
        value = self.new_initializer(node, np.concatenate(arrays))
        if value is None:
            return None
        node.graph.register_initializer(value)
        return constant_folding.Replacement([value], [])

    def _cast_constant(self, node: ir.Node):
        """The Cast or CastLike of a small constant between float, double, int32 and int64 folded with NumPy's
        ``astype``, as onnxscript's folding does through ONNX's reference Cast (~0.5 ms a node to load and build
        it; CastLike first becomes a Cast node, folded next): the DSL's hyper-parameters, cast to the weights'
        type (R1: 31). The same initializer, named after the node's output; any other case goes to onnxscript."""
        if node.op_type not in ("Cast", "CastLike") or node.domain not in ("", "ai.onnx") or not node.inputs or \
                len(node.outputs) != 1 or node.outputs[0].is_graph_output():
            return None
        x = node.inputs[0]
        tensor = None if x is None or x.is_graph_input() else x.const_value
        if tensor is None or tensor.dtype not in _CASTS or tensor.size > self.input_size_limit:
            return None
        if node.op_type == "Cast":
            to = node.attributes.get("to")
            if len(node.attributes) != 1 or to is None or to.type != ir.AttributeType.INT or len(node.inputs) != 1:
                return None
            target = ir.DataType(to.value) if to.value in {t.value for t in _CASTS} else None
        else:
            like = node.inputs[1] if len(node.inputs) == 2 else None
            target = like.dtype if like is not None and not node.attributes else None
        if target not in _CASTS or target == tensor.dtype:
            return None  # NOTE: the same type: onnxscript's Identity
        value = self.new_initializer(node, tensor.numpy().astype(target.numpy()))
        if value is None:
            return None
        node.graph.register_initializer(value)
        return constant_folding.Replacement([value], [])

    def _do_inference(self, node: ir.Node) -> None:
        if all(o.type is not None and o.shape is not None and o.shape.is_static() for o in node.outputs):
            return
        if any(v is not None and v.type is None for v in node.inputs):
            return
        merge = getattr(constant_folding, "_merge_shapes", None)
        known = _known_type(node) if merge is not None else None
        if known is None:
            super()._do_inference(node)
            return
        output = node.outputs[0]
        try:  # NOTE: as onnxscript's: a rank conflict (ValueError) leaves the output as it is
            output.shape = merge(output.shape, known[1])
            output.type = ir.TensorType(known[0])
        except ValueError:
            pass


def _finish(model: ir.Model, output_names: list[str], dtype: ir.DataType) -> None:
    """Inlines the DSL calls, names the outputs, drops dead nodes and functions, sets versions ORT loads."""
    passes.InlinePass()(model)
    for value, name in zip(model.graph.outputs, output_names):
        value.name = name
    widen_float_constants(model, dtype)
    graphs.tag(model.graph, "backward")
    # NOTE: onnxscript's constant folding and CSE fold the DSL's CastLike'd constants and merge repeated
    # subexpressions, which onnxruntime leaves as kernels: Adam's step drops from ~210 to ~110 kernels. Warnings about
    # weights it cannot deduplicate (they are graph inputs, on purpose) are noise here.
    dedup_log = logging.getLogger("onnx_ir.passes.common.initializer_deduplication")
    level = dedup_log.level
    dedup_log.setLevel(logging.ERROR)
    try:  # NOTE: not onnxscript.optimizer.optimize: its rewrite rules drop ``x + 1e-8`` as ``x + 0``
        ir.passes.Sequential(
            passes.CommonSubexpressionEliminationPass(),
            _FoldConstants(shape_inference=True, input_size_limit=8192, output_size_limit=8192),
            passes.RemoveUnusedNodesPass(),
            passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
            passes.DeduplicateInitializersPass(),
            passes.CommonSubexpressionEliminationPass(),
        )(model)
    finally:
        dedup_log.setLevel(level)
    # NOTE: no second RemoveUnusedNodesPass: the one after folding leaves nothing for the passes after it to kill
    # (lifting, initializer deduplication and CSE each remove what they replace), ~0.025 ms per node
    for p in (passes.RemoveUnusedFunctionsPass(), passes.RemoveUnusedOpsetsPass(), passes.TopologicalSortPass()):
        p(model)
    model.ir_version = runtime_limits()[0]
    model.opset_imports.pop("onnxopt.dsl", None)
    model.producer_name = "onnxopt"
