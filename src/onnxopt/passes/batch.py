"""The Runner's CPU model specialized for how it feeds a batch (``runner.cpu_model``), bit for bit the same:

- ``hoist``: values computed from one input alone (the sample weights' ``w / Σw``) become inputs, which the
  Runner computes once per batch length when no sample weights are given;
- ``shaped_target``: the target is fed shaped like the prediction, so ``Reshape(target, Shape(y))`` goes;
- ``drop_same_shape_reshapes``: ``Reshape(x, Shape(y))`` where shape inference proves ``x`` has ``y``'s shape;
- ``masked_relu_grads``: ``ReluGrad`` of a ``Relu``'s output as ``dy · HardSigmoid(y·2²², alpha=2¹²⁷)`` (float32)
  or ``dy · Ceil(Min(y, 1))`` (float64) where a batch makes it large, else as ``dy · Sign(y)``;
- ``summed_rows``: a sum over the rows of a matrix (a bias gradient) as ``ones · g`` for sessions on threads;
- ``row_sum_updates``: SGD on a bias, ``b - lr·Σ_rows g``, as one ``Gemm(ones, g, C=b)``, the bias read and
  written as a (1, n) row (the Runner binds views of its vectors) where every other use broadcasts a row alike.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common

from onnxopt import graphs
from onnxopt.passes.fuse_update import scalar_value
from onnxopt.passes.unread import RemoveUnreadInitializersPass

__all__ = ["RANDOM", "LARGE_RELU_GRAD", "ROW", "hoist", "shaped_target", "drop_same_shape_reshapes",
           "masked_relu_grads", "summed_rows", "row_sum_updates"]

# NOTE: onnxruntime-training's CPU ReluGrad branches per element: once half the units are dead (a random mask)
# it costs ~5 ns an element. Measured alone (2 cores): 4096x50 ReluGrad 1.0 ms, Sign + Mul 0.27, Greater + Cast
# + Mul 0.16 (128x512 on 2 threads: 256, 92, 58 µs): from LARGE_RELU_GRAD elements on three kernels win; below,
# in W1's Scan (15x50 and 15x10), Sign + Mul take 0.91-0.93 of the step's time (ReluGrad alone looks cheaper there).
# Min + Ceil + Mul skip the slow bool-to-float Cast: against Greater + Cast + Mul in the Runner's step, paired
# blocks, 0.93-0.99 of the time on batch-4096, 0.95-0.99 on batch-256, 0.95-1.00 on W3, 1.005 on W5; in float32,
# Mul + HardSigmoid + Mul against Min + Ceil + Mul: 0.94-0.97 on batch-4096, 0.93 on batch-256, 0.98 on W3 and W5
LARGE_RELU_GRAD = 8192

ROW = "batch.ones_row"  # NOTE: ``row_sum_updates``' (1, rows) ones, computed from the sample weights: hoisted

# NOTE: a value computed once must be the same at every step
RANDOM = frozenset({"Bernoulli", "Dropout", "Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform",
                    "RandomUniformLike"})


def _is_constant(value: ir.Value) -> bool:
    return value.const_value is not None and not value.is_graph_input()


def _prune(graph: ir.Graph) -> None:
    """Removes the nodes no graph output depends on, through subgraphs' outer values too: onnx-ir's
    RemoveUnusedNodesPass keeps what the body of a removed Loop or Scan read (the gradient of a recurrent layer),
    values that can depend on inputs the side model no longer has."""
    needed, keep = set(graph.outputs), set()

    def read(node: ir.Node) -> None:
        needed.update(v for v in node.inputs if v is not None)
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                for inner in attr.as_graph():
                    read(inner)
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub in attr.as_graphs():
                    for inner in sub:
                        read(inner)

    for node in reversed(list(graph)):
        if any(o in needed for o in node.outputs):
            keep.add(node)
            read(node)
    def detach(node: ir.Node) -> None:  # NOTE: a removed node's subgraphs stop reading the outer values
        for attr in node.attributes.values():
            subs = [attr.as_graph()] if attr.type == ir.AttributeType.GRAPH else \
                list(attr.as_graphs()) if attr.type == ir.AttributeType.GRAPHS else []
            for sub in subs:
                for inner in sub:
                    detach(inner)
                    for i in range(len(inner.inputs)):
                        inner.replace_input_with(i, None)

    for node in reversed(list(graph)):
        if node not in keep:
            detach(node)
            graph.remove(node, safe=False)


def hoist(model: ir.Model, name: str) -> tuple[onnx.ModelProto, list[str]] | None:
    """Makes the values computed from input ``name`` and constants alone inputs of ``model`` (in place); returns
    the side model computing them from ``name`` and [name] if ``name`` stays an input ([] if not), or None."""
    g = model.graph
    source = next(v for v in g.inputs if v.name == name)
    pure, nodes = {source}, set()
    for node in g:  # NOTE: topologically sorted: a node's inputs are classified before it
        ins = [v for v in node.inputs if v is not None]
        if ins and any(v in pure for v in ins) and all(v in pure or _is_constant(v) for v in ins) \
                and node.op_type not in RANDOM and not any(
                    a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            nodes.add(node)
            pure.update(node.outputs)
    frontier = [v for node in g if node in nodes for v in node.outputs  # NOTE: in graph order, run after run
                if v.is_graph_output() or any(u.node not in nodes for u in v.uses())]
    if not frontier or any(v.type is None or not v.name or v.is_graph_output() for v in frontier):
        return None
    side = ir.from_proto(ir.to_proto(model))
    values = {v.name: v for node in side.graph for v in node.outputs}
    side.graph.outputs.clear()
    side.graph.outputs.extend(values[v.name] for v in frontier)
    side_source = next(v for v in side.graph.inputs if v.name == name)
    side.graph.inputs.clear()
    side.graph.inputs.append(side_source)
    _prune(side.graph)
    RemoveUnreadInitializersPass()(side)  # NOTE: the pruned nodes' inputs still count as uses
    for value in frontier:
        new = ir.Value(name=value.name, type=value.type, shape=value.shape)
        value.name = None
        ir.convenience.replace_all_uses_with(value, new, replace_graph_outputs=True)
        g.inputs.append(new)
    common.RemoveUnusedNodesPass()(model)
    kept = [name] if source.uses() else []
    if not kept:
        g.inputs.remove(source)
    return ir.to_proto(side), kept


def shaped_target(model: ir.Model, name: str, batch: str) -> tuple[int, ...] | None:
    """Gives input ``name`` the prediction's shape where its only use is ``Reshape(name, Shape(y))`` and
    ``y`` has shape (``batch``, static dims...): the reshape goes. Returns the static dims, or None (unchanged)."""
    g = model.graph
    target = next(v for v in g.inputs if v.name == name)
    uses = list(target.uses())
    if len(uses) != 1 or uses[0].node.op_type != "Reshape" or uses[0].idx != 0:
        return None
    reshape = uses[0].node
    shape_of = reshape.inputs[1].producer()
    if shape_of is None or shape_of.op_type != "Shape" or shape_of.attributes \
            or reshape.attributes.get_int("allowzero", 0):
        return None
    y = shape_of.inputs[0]
    dims = list(y.shape) if y.shape is not None else []
    if not dims or not isinstance(dims[0], ir.SymbolicDim) or dims[0].value != batch \
            or not all(isinstance(d, int) for d in dims[1:]) or y.dtype != target.dtype:
        return None
    shaped = ir.Value(name=name, type=target.type, shape=ir.Shape(dims))
    ir.convenience.replace_all_uses_with(reshape.outputs[0], shaped, replace_graph_outputs=True)
    g.inputs[g.inputs.index(target)] = shaped
    common.RemoveUnusedNodesPass()(model)
    return tuple(dims[1:])


def drop_same_shape_reshapes(model: ir.Model) -> int:
    """Removes each ``Reshape(x, Shape(y))`` where ONNX shape inference gives ``x`` and ``y`` the same fully
    known shape (symbolic dimensions included); returns how many."""
    graphs.infer_shapes(model)
    dropped = 0
    for node in list(model.graph):
        shape_of = node.inputs[1].producer() if node.op_type == "Reshape" else None
        if shape_of is None or shape_of.op_type != "Shape" or shape_of.attributes:
            continue
        x, y = node.inputs[0], shape_of.inputs[0]
        if node.outputs[0].is_graph_output() or x.shape is None or y.shape is None or x.shape != y.shape or any(
                not isinstance(d, int) and (d.value is None) for d in x.shape):
            continue
        ir.convenience.replace_all_uses_with(node.outputs[0], x, replace_graph_outputs=False)
        dropped += 1
    common.RemoveUnusedNodesPass()(model)
    return dropped


def masked_relu_grads(model: ir.Model, batch_size: int) -> int:
    """Rewrites ``com.microsoft::ReluGrad(dy, y)`` of a ``Relu``'s output ``y`` (y ≥ 0) as a masked product
    (and the ``Sign(y)`` mask of onnxopt's own Relu rule, where large):
    where ``batch_size`` rows of ``y`` hold at least ``LARGE_RELU_GRAD`` elements, ``dy · HardSigmoid(y·2²²,
    alpha=2¹²⁷)`` in float32 (the smallest subnormal times 2¹⁴⁹ is 1: exact powers of two) and ``dy · Ceil(Min(y,
    1))`` in float64, else ``dy · Sign(y)``; every mask is 0 at 0 and 1 above, subnormals included. The same values
    (a dead unit's zero may take dy's sign; a masked NaN of dy stays NaN), without the kernel's branch per
    element. Returns how many."""
    done = 0
    for node in list(model.graph):
        # NOTE: onnxopt's own Relu rule writes dy · Sign(y): only its mask needs a large batch's form
        sign = node.op_type == "Sign" and node.domain in ("", "ai.onnx")
        if not sign and (node.op_type != "ReluGrad" or node.domain != "com.microsoft"):
            continue
        dy, y = (None, node.inputs[0]) if sign else node.inputs
        dims = list(y.shape) if y.shape is not None else []
        rows = (dims[0] if isinstance(dims[0], int) else batch_size) if dims else 0
        large = dims and all(isinstance(d, int) for d in dims[1:]) and rows * math.prod(dims[1:]) >= LARGE_RELU_GRAD
        relu = y.producer() is not None and y.producer().op_type == "Relu" and y.producer().domain in ("", "ai.onnx")
        if y.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE) or not relu or (sign and not large):
            continue
        tape = ir.tape.Tape()
        if large and y.dtype == ir.DataType.FLOAT:  # NOTE: HardSigmoid's alpha is a float32: up to 2^127
            scale = tape.op("Constant", [], {"value": ir.tensor(np.array(2.0**22, np.float32))})
            mask = tape.op("HardSigmoid", [tape.op("Mul", [y, scale])], {"alpha": 2.0**127, "beta": 0.0})
        elif large:
            one = tape.op("Constant", [], {"value": ir.tensor(np.array(1, y.dtype.numpy()))})
            mask = tape.op("Ceil", [tape.op("Min", [y, one])])
        else:
            mask = tape.op("Sign", [y])
        _replace(model, node, tape, mask if sign else tape.op("Mul", [dy, mask]))
        done += 1
    return done


def _replace(model: ir.Model, node: ir.Node, tape: ir.tape.Tape, out: ir.Value) -> None:
    """Puts ``tape``'s nodes before ``node``, whose only output ``out`` replaces, and removes ``node``."""
    model.graph.insert_before(node, tape.nodes)
    old = node.outputs[0]
    out.type, out.shape = old.type, old.shape
    ir.convenience.replace_all_uses_with(old, out, replace_graph_outputs=True)
    if old.name is not None and out.is_graph_output():  # NOTE: a step's output keeps its name
        out.name, old.name = old.name, None
    model.graph.remove(node, safe=True)


def summed_rows(model: ir.Model) -> int:
    """Rewrites ``ReduceSum(g, axes=[0], keepdims=0)`` of a float matrix ``g`` (the bias gradient of a dense
    layer) as ``MatMul(ones(rows), g)``; returns how many. For a session on two threads or more: there
    onnxruntime 1.19's parallel ReduceSum over the first axis costs ~100 µs on 128×512 and ~140 µs on 4096×50
    (2 cores) against ~4 and ~30 µs for the product (a vector-matrix product of MLAS), one thread ~1 µs for
    either. The sums are the same to float rounding (another summation order), not bit for bit."""
    done = 0
    for node in list(model.graph):
        g = _first_axis_sum(node)
        if g is None or g.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE) or g.shape is None \
                or len(g.shape) != 2:
            continue
        tape = ir.tape.Tape()
        rows = tape.op("Shape", [g], {"start": 0, "end": 1})
        ones = tape.op("ConstantOfShape", [rows], {"value": ir.tensor(np.ones(1, g.dtype.numpy()))})
        _replace(model, node, tape, tape.op("MatMul", [ones, g]))
        done += 1
    return done


def _first_axis_sum(node: ir.Node | None) -> ir.Value | None:
    """``g`` when ``node`` is ``ReduceSum(g, axes=[0], keepdims=0)`` (axes a constant), else None."""
    axes = node.inputs[1] if node is not None and len(node.inputs) == 2 else None
    if axes is None or node.op_type != "ReduceSum" or node.domain not in ("", "ai.onnx") \
            or axes.const_value is None or node.attributes.get_int("keepdims", 1) != 0 \
            or axes.const_value.numpy().tolist() not in ([0], [-2]):
        return None
    return node.inputs[0]


def _row_sum(value: ir.Value, rows, shapes: dict) -> ir.Value | None:
    """``g`` when ``value``, read once, is ``ReduceSum(g, axes=[0], keepdims=0)`` of a matrix ``g`` of ``rows``
    rows (its shape in ``shapes``), else None."""
    g = _first_axis_sum(value.producer()) if len(value.uses()) == 1 else None
    if g is None:
        return None
    shape = shapes.get(g.name)
    return g if shape is not None and len(shape) == 2 and shape[0] == rows else None


def _sgd_parts(node: ir.Node) -> tuple[ir.Value, ir.Value, ir.Value] | None:
    """(b, lr, s) of an update ``SGDOptimizer(lr, b, s)`` or ``Sub(b, Mul(lr, s))``, else None."""
    if node.op_type == "SGDOptimizer" and node.domain == "com.microsoft":
        lr, b, s = node.inputs
        return b, lr, s
    if node.op_type != "Sub" or node.domain not in ("", "ai.onnx") \
            or not node.metadata_props.get(graphs.REGION, "").startswith("update"):
        return None
    b, product = node.inputs
    mul = product.producer()
    if mul is None or mul.op_type != "Mul" or len(product.uses()) != 1:
        return None
    lr, s = mul.inputs if scalar_value(mul.inputs[0]) is not None else mul.inputs[::-1]
    return b, lr, s


def row_sum_updates(model: ir.Model, sample_weight: str) -> list[str]:
    """Rewrites SGD with a constant learning rate on a vector ``b`` whose gradient sums a matrix's rows (a
    dense layer's bias), ``b - lr·ReduceSum(g, axes=[0])``, as ``Gemm(ones, g, C=b, alpha=-lr)``: a
    vector-matrix product of MLAS updating the bias, where a ``ReduceSum`` and an ``SGDOptimizer`` (or ``Mul``
    and ``Sub``) ran. The (1, rows) ones are computed from input ``sample_weight``, so ``hoist`` makes them an
    input the Runner computes once per batch length; only rows that follow the sample weights' are rewritten.
    The sums are the same to float rounding (another summation order and the update inside it), not bit for
    bit. Where ``b`` is a graph input read otherwise only as a ``Gemm``'s C or against an operand of two or more
    dimensions (a (1, n) row broadcasts there to the same values), the graph reads and writes it as that row
    and the ``Gemm`` writes it; elsewhere a ``Reshape`` flattens the row. Returns the names read as rows
    (the Runner binds (1, n) views of their vectors: no ``Reshape`` runs)."""
    g = model.graph
    weights = next(v for v in g.inputs if v.name == sample_weight)
    rows = weights.shape[0] if weights.shape is not None and len(weights.shape) == 1 else None
    inferred = ir.from_proto(ir.to_proto(model))  # NOTE: on a copy: inferred names of unknown dimensions
    graphs.infer_shapes(inferred)  # would keep drop_same_shape_reshapes from matching shapes later
    shapes = {v.name: v.shape for v in [*inferred.graph.inputs, *(v for node in inferred.graph for v in node.outputs)]}
    ones = flat = None
    rowed = []
    for node in list(g):
        parts = _sgd_parts(node)
        grad = _row_sum(parts[2], rows, shapes) if parts is not None and rows is not None else None
        b, lr, _ = parts or (None, None, None)
        rate = scalar_value(lr) if grad is not None else None
        if rate is None or b.shape is None or len(b.shape) != 1 or b.dtype != grad.dtype \
                or b.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE) or float(np.float32(rate)) != rate \
                or (ones is not None and ones.dtype != b.dtype):
            continue  # NOTE: alpha is a float32 attribute, exact only for a rate that float32 holds
        tape = ir.tape.Tape()
        if ones is None:
            one = ir.Value(name=ROW + ".lead", const_value=ir.tensor(np.array([1], np.int64)))
            g.register_initializer(one)  # NOTE: an initializer, which ``hoist`` counts as a constant
            shape = tape.op("Concat", [one, tape.op("Shape", [weights])], {"axis": 0})
            ones = tape.op("ConstantOfShape", [shape], {"value": ir.tensor(np.ones(1, b.dtype.numpy()))})
            ones.name, ones.dtype = ROW, b.dtype
            flat = tape.op("Constant", [], {"value": ir.tensor(np.array([-1], np.int64))})
        summed = tape.op("Gemm", [ones, grad, b], {"alpha": -rate, "beta": 1.0})
        row = ir.Shape([1, b.shape[0]])
        if _as_row(b, node, shapes):
            _replace(model, node, tape, summed)
            summed.shape = b.shape = row
            rowed.append(b.name)
        else:
            summed.type, summed.shape = b.type, row
            _replace(model, node, tape, tape.op("Reshape", [summed, flat]))
    common.RemoveUnusedNodesPass()(model)
    return rowed


def _as_row(b: ir.Value, update: ir.Node, shapes: dict) -> bool:
    """Whether graph input ``b``, written by ``update`` as a graph output read nowhere else, can be a (1, n) row:
    its other uses are a ``Gemm``'s C or an elementwise op against an operand of two or more dimensions."""
    new = update.outputs[0]
    if not b.is_graph_input() or not new.is_graph_output() or new.uses():
        return False
    for use in b.uses():
        node, other = use.node, [v for v in use.node.inputs if v is not b]
        if node is update or (node.op_type == "Gemm" and use.idx == 2 and b not in node.inputs[:2]):
            continue
        shape = shapes.get(other[0].name) if len(other) == 1 and other[0] is not None else None
        if node.op_type not in ("Add", "Sub", "Mul", "Div") or node.domain not in ("", "ai.onnx") \
                or shape is None or len(shape) < 2:
            return False
    return True
