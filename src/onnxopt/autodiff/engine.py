"""The reverse pass: from the graph outputs back to the requested weights and inputs, one rule per node.

``differentiate`` walks the nodes in reverse topological order. Only the nodes on a path from a requested value
(a weight or an input) to a float output are differentiated; the gradient of a value read several times is the
sum of its readers' contributions; each rule returns the gradients of the inputs it is asked for (``Ctx.need``).
The result has the layout of onnxruntime-training's builder, so the passes after it do not know which ran:
forward nodes, a ``com.microsoft:YieldOp`` whose inputs are the forward outputs and whose outputs are their
gradients ``<output>_grad``, then the backward nodes; graph outputs ``<input>_grad``... and ``<weight>_grad``...
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from onnxopt.errors import ModelError, NotDifferentiableError, WeightError
from onnxopt.passes.lower import _Op, _unbroadcast

__all__ = ["Rule", "RULES", "rule", "Ctx", "differentiate", "FLOATS"]

FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
REGION = "onnxopt.region"


@dataclass(frozen=True)
class Rule:
    """The vector-Jacobian product of one op: ``fn(ctx)`` returns the gradient of each input (None: not asked
    for, or zero). ``inputs``: the positions that can carry a gradient (None: every float input)."""

    op_type: str
    fn: Callable
    family: str
    domain: str = ""
    inputs: tuple[int, ...] | None = None
    doc: str = ""


RULES: dict[tuple[str, str], Rule] = {}


def rule(*op_types: str, family: str, domain: str = "", inputs: Sequence[int] | None = None):
    """Registers the decorated function as the rule of ``op_types`` in ``RULES``."""
    def register(fn):
        doc = (fn.__doc__ or "").strip().split("\n")[0]
        for op_type in op_types:
            RULES[domain, op_type] = Rule(op_type, fn, family, domain, None if inputs is None else tuple(inputs), doc)
        return fn
    return register


class Ctx(_Op):
    """What a rule sees of its node: ``I(i)``, ``O(i)``, ``GO(i)`` (None when no gradient reaches output i),
    ``go(i)`` (zeros then), ``need(i)``, ``attr(name, default)``, and ``op.<OpType>(...)`` calls that record the
    backward nodes (``const``, ``ints``, ``dims``, ``rank`` from ``passes.lower``)."""

    def __init__(self, node: ir.Node, grads: list[ir.Value | None], need: set[int], inferred: dict | None = None,
                 types: dict | None = None, shared: dict | None = None):
        super().__init__(node, inferred)
        self._grads, self._need, self._types = grads, need, types or {}
        # NOTE: constants and shapes already written for an earlier node of the same ``differentiate`` call
        # (the caller keeps ``shared``), reused instead of written again: the finished step's
        # common-subexpression elimination and constant folding would merge or fold them, at a cost per node
        self._shared = {} if shared is None else shared
        # NOTE: the outer values the node's subgraphs read that need a gradient, and the model's opsets (the
        # engine sets them; the control-flow rules read them)
        self.captures: list[ir.Value] = []
        self.opsets: dict[str, int] = {}

    def _reuse(self, key, make: Callable[[], ir.Value]) -> ir.Value:
        value = self._shared.get(key)
        if value is None:
            value = self._shared[key] = make()
        return value

    def _typed_constant(self, array: np.ndarray) -> ir.Value:
        """A Constant node's output, typed and shaped (the lowerings read ranks: ``gather_grad``'s shape input)."""
        value = self.Constant(value=ir.Tensor(array))
        value.type, value.shape = ir.TensorType(ir.DataType.from_numpy(array.dtype)), ir.Shape(array.shape)
        return value

    def ints(self, values) -> ir.Value:
        values = tuple(int(v) for v in values)
        return self._reuse(("ints", values), lambda: self._typed_constant(np.array(values, np.int64)))

    def const(self, value: float, like: ir.Value) -> ir.Value:
        """A scalar of ``like``'s type: written in that type when it is float or double (what folding the
        CastLike of a float64 constant gives), else the CastLike."""
        dtype = self.dtype(like)
        if dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
            return super().const(value, like)
        value = float(value)
        return self._reuse(("const", value, dtype), lambda: self._typed_constant(np.array(value, dtype.numpy())))

    def CastLike(self, x: ir.Value, like: ir.Value) -> ir.Value:  # noqa: N802
        """``x`` cast to ``like``'s type as constant folding would leave it when both types are known: a Cast
        when they differ, a constant ``x`` itself when they are equal; else the CastLike."""
        source, target = self._known_dtype(x), self.dtype(like)
        if source is not None and target is not None and source != target:
            return self.Cast(x, to=target)
        if source is not None and source == target and x.producer() is not None and \
                x.producer().op_type == "Constant" and x.producer() in self.tape.nodes:
            return x
        return self.__getattr__("CastLike")(x, like)

    def _known_dtype(self, value: ir.Value) -> ir.DataType | None:
        """``value``'s element type: ``dtype``'s, else that of the tensor of the Constant node making it, or int64
        for a Shape or Size node's output."""
        dtype = self.dtype(value)
        node = value.producer()
        if dtype is not None or node is None or node.domain not in ("", "ai.onnx"):
            return dtype
        if node.op_type in ("Shape", "Size"):
            return ir.DataType.INT64
        tensor = node.attributes.get("value") if node.op_type == "Constant" else None
        return tensor.value.dtype if tensor is not None and tensor.type == ir.AttributeType.TENSOR else None

    def Shape(self, x: ir.Value, start: int | None = None, end: int | None = None) -> ir.Value:  # noqa: N802
        """One Shape node per value and range; a range of static sizes (``start`` or ``end`` given) is written as
        their constant, which constant folding would make of the node (~0.2 ms a node, ~1 ms more for each Concat
        of such constants). The whole shape stays a Shape node even when static: rules and the engine's sums
        recognise ``Expand(0, Shape(x))``; constant folding folds it."""
        if start is not None or end is not None:
            sizes = list(x.shape)[start:end] if x.shape is not None else None  # NOTE: ONNX's clamped range
            if sizes is not None and all(isinstance(d, int) for d in sizes):
                return self.ints(sizes)
        attrs = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
        return self._reuse(("Shape", x, start, end), lambda: self.__getattr__("Shape")(x, **attrs))

    def Concat(self, *xs: ir.Value, axis: int, **kwargs) -> ir.Value:  # noqa: N802
        """A Concat of constant int64 vectors (shapes: ``ints``, static ``Shape`` ranges) is written as their
        constant, as constant folding would leave it (it evaluates such a node in ONNX's reference
        implementation, ~1 ms each); other Concats as they are."""
        if axis == 0 and not kwargs:
            parts = [_int_vector(x) for x in xs]
            if xs and all(p is not None for p in parts):
                return self.ints([v for p in parts for v in p])
        return self.__getattr__("Concat")(*xs, axis=axis, **kwargs)

    def ReduceProd(self, x: ir.Value, *axes: ir.Value, keepdims: int = 1, **kwargs) -> ir.Value:  # noqa: N802
        """The product of a constant int64 vector (a static size) written as its constant, else the node."""
        values = _int_vector(x) if not axes and not kwargs else None
        if values is None:
            return self.__getattr__("ReduceProd")(x, *axes, keepdims=keepdims, **kwargs)
        n = int(np.prod(values, dtype=np.int64))
        return self.ints([n]) if keepdims else self._reuse(("size", n),
                                                           lambda: self._typed_constant(np.array(n, np.int64)))

    def Cast(self, x: ir.Value, to: int, **kwargs) -> ir.Value:  # noqa: N802
        """A constant int64 scalar or vector cast to float or double written as the constant it folds to."""
        to = ir.DataType(to)
        producer = x.producer()
        tensor = producer.attributes.get("value") if producer is not None and producer.op_type == "Constant" \
            and producer.domain in ("", "ai.onnx") and x.const_value is None and not kwargs else None
        if tensor is not None and tensor.type == ir.AttributeType.TENSOR and to in (ir.DataType.FLOAT,
                                                                                    ir.DataType.DOUBLE) \
                and tensor.value.dtype == ir.DataType.INT64 and tensor.value.size <= 64:
            array = tensor.value.numpy().astype(to.numpy())
            return self._reuse(("cast", to, array.shape, array.tobytes()), lambda: self._typed_constant(array))
        return self.__getattr__("Cast")(x, to=to, **kwargs)

    def Size(self, x: ir.Value) -> ir.Value:  # noqa: N802
        """``x``'s element count: a constant when its declared shape is static, else one Size node per value."""
        if x.shape is not None and all(isinstance(d, int) for d in x.shape):
            n = int(np.prod(list(x.shape), dtype=np.int64))
            return self._reuse(("size", n), lambda: self._typed_constant(np.array(n, np.int64)))
        return self._reuse(("Size", x), lambda: self.__getattr__("Size")(x))

    def dtype(self, value: ir.Value) -> ir.DataType | None:
        """``value``'s element type: its own, else ONNX shape inference's."""
        return value.dtype if value.dtype is not None else self._types.get(value.name)

    def I(self, i: int) -> ir.Value | None:  # noqa: E743 (the notation of gradient definitions)
        return self.node.inputs[i] if i < len(self.node.inputs) else None

    def O(self, i: int) -> ir.Value:  # noqa: E743
        return self.node.outputs[i]

    def GO(self, i: int) -> ir.Value | None:
        return self._grads[i] if i < len(self._grads) else None

    def go(self, i: int) -> ir.Value:
        g = self.GO(i)
        return g if g is not None else self.Expand(self.const(0.0, self.O(i)), self.Shape(self.O(i)))

    def go_against(self, i: int, other: ir.Value) -> ir.Value:
        """``go(i)``, or the smaller value it only Expands when ``other`` has output i's shape: an elementwise
        op of the two then broadcasts it, without writing the copy (a reduction's gradient, BatchNorm's)."""
        g = self.go(i)
        small = _expanded(g)
        if small is None:
            return g
        full, out = self.static_dims(other), self.static_dims(self.O(i))
        known = full is not None and all(isinstance(d, int) or getattr(d, "value", None) is not None for d in full)
        return small if known and full == out else g

    def need(self, i: int) -> bool:
        return i in self._need

    wanted = need  # NOTE: the lowerings of passes.lower ask ``wanted(i)`` for the gradient of input i

    def attr(self, name: str, default=None):
        a = self.node.attributes.get(name)
        return default if a is None else a.value

    def attrs(self, *names: str) -> dict:
        return {n: self.node.attributes[n].value for n in names if n in self.node.attributes}

    def static_dims(self, value: ir.Value) -> tuple | None:
        """``value``'s shape with every dimension an int or a symbol (None if its rank is unknown)."""
        if value is not None and value.shape is None and value.name in self.inferred:
            # NOTE: ranks only: ONNX inference can get sizes wrong on the rewritten graphs (STFT's frames)
            return tuple(f"?{value.name}{k}" for k in range(len(self.inferred[value.name])))
        return None if value is None or value.shape is None else tuple(value.shape)

    def unbroadcast(self, g: ir.Value, i: int) -> ir.Value:
        """``g`` summed over the axes along which input ``i`` was broadcast, shaped as input ``i``."""
        x = self.I(i)
        xs, ys = self.static_dims(x), self.static_dims(self.O(0))
        if xs is not None and ys is not None and len(ys) >= len(xs):
            lead = len(ys) - len(xs)
            known = all(isinstance(d, int) or d == ys[lead + k] for k, d in enumerate(xs))
            if known:
                inner = [lead + k for k, d in enumerate(xs) if d == 1 and ys[lead + k] != 1]
                if not lead and not inner:
                    return g
                if not inner:  # NOTE: the builder's form, which passes.batch turns into a bias Gemm for SGD
                    return self.ReduceSum(g, self.ints(range(lead)), keepdims=0)
                s = self.ReduceSum(g, self.ints([*range(lead), *inner]), keepdims=1)
                if lead:
                    shape = self.ints(xs) if all(isinstance(d, int) for d in xs) else self.Shape(x)
                    s = self.Reshape(s, shape)
                return s
        return _unbroadcast(self, g, x)


_FLOAT_TYPES = {"tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"}


@functools.lru_cache(maxsize=None)
def _float_outputs(domain: str, op_type: str, opset: int) -> tuple[bool, ...] | None:
    """Which outputs of the op's schema may be float (None when onnx does not know the op)."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return None
    allowed = {tc.type_param_str: set(tc.allowed_type_strs) for tc in schema.type_constraints}
    return tuple(bool(_FLOAT_TYPES & allowed.get(o.type_str, {o.type_str})) for o in schema.outputs)


def _is_float(v: ir.Value | None, types: dict) -> bool:
    """A value that can carry a gradient: a float, or of a type shape inference left unknown that its op's
    schema allows to be float."""
    dtype = None if v is None else v.dtype or types.get(v.name)
    if v is None or dtype is not None:
        return v is not None and dtype in FLOATS
    node = v.producer()
    if node is None:
        return True
    domain = "" if node.domain == "ai.onnx" else node.domain
    opset = node.graph.opset_imports.get(domain, 1) if node.graph is not None else 21
    floats = _float_outputs(domain, node.op_type, opset)
    if floats is None:
        return True
    return bool(floats) and floats[min(v.index(), len(floats) - 1)]


def _reads(node: ir.Node) -> list[ir.Value]:
    """The values ``node`` reads: its inputs, and the outer values its subgraphs read (an If branch or a Loop
    body captures them by name: a gradient path through them must not be missed)."""
    out = [v for v in node.inputs if v is not None]
    for attr in node.attributes.values():
        subs = [attr.as_graph()] if attr.type == ir.AttributeType.GRAPH else \
            list(attr.as_graphs()) if attr.type == ir.AttributeType.GRAPHS else []
        for sub in subs:
            for inner in sub:
                out += [v for v in _reads(inner) if v.graph is not sub]
    return out


def _active_nodes(graph: ir.Graph, wrt: set[ir.Value], types: dict) -> tuple[set, list[ir.Node]]:
    """The values depending on ``wrt`` through float values, and the nodes to differentiate (reverse order):
    those with an active input and an output from which a float graph output depends."""
    active = set(wrt)
    for node in graph:
        if any(v in active for v in _reads(node)):
            active.update(o for o in node.outputs if _is_float(o, types))
    useful = {v for v in graph.outputs if v in active}
    todo = []
    for node in reversed(list(graph)):
        if any(o in useful for o in node.outputs):
            ins = [v for v in _reads(node) if v in active]
            if ins:
                useful.update(ins)
                todo.append(node)
    return active & useful, todo


def _sum(tape_op: _Op, parts: list[ir.Value]) -> ir.Value:
    """The parts' sum. A part that only Expands a smaller gradient (a reduction's) is summed unexpanded
    when another part has the full shape: Add and Sum broadcast it without writing the copy."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0].type, ir.SequenceType):  # NOTE: a sequence read several times (SequenceAt)
        from onnxopt.autodiff.control import sequence_add

        total = parts[0]
        for p in parts[1:]:
            total = sequence_add(tape_op.tape, total, p)
        return total
    parts = _merge_scatters(tape_op, parts)
    if len(parts) == 1:
        return parts[0]
    expands = [_expanded(p) for p in parts]
    if any(e is None for e in expands):
        parts = [p if e is None else e for p, e in zip(parts, expands)]
    return tape_op.Add(*parts) if len(parts) == 2 else tape_op.Sum(*parts)


def _merge_scatters(tape_op: _Op, parts: list[ir.Value]) -> list[ir.Value]:
    """Parts that scatter-add one row each into zeros of the same shape (``Gather``'s gradient for a scalar
    index: the q, k and v an exporter gathers from one packed tensor) become one ScatterND of all the rows:
    a write of the tensor instead of a zero-filled copy per part and their sum; the rows' Concat when they are
    rows 0..n-1. Exact: the scatter adds."""
    groups: dict[ir.Value, list[int]] = {}
    for k, p in enumerate(parts):
        source = _row_scatter(p)
        if source is not None:
            groups.setdefault(source, []).append(k)
    merged = {}
    for source, ks in groups.items():
        if len(ks) < 2:
            continue
        nodes = [parts[k].producer() for k in ks]
        first = tape_op.ints([0])
        known = [_constant(_index(n.inputs[1])) for n in nodes]
        if sorted(known, key=lambda i: -1 if i is None else i) == list(range(len(known))):
            # NOTE: rows 0..n-1 once each: the rows in order, then zeros for any rows after them (none when the
            # tensor has n rows), instead of a scatter over a zero-filled copy (T1: ~0.1 ms a layer)
            rows = [tape_op.Unsqueeze(nodes[known.index(i)].inputs[2], first) for i in range(len(known))]
            dims = tape_op.dims(source)
            if not dims or dims[0] != len(known):
                rest = tape_op.Sub(tape_op.Shape(source, start=0, end=1), tape_op.ints([len(known)]))
                zero = nodes[0].inputs[0].producer().inputs[0]
                rows.append(tape_op.Expand(zero, tape_op.Concat(rest, tape_op.Shape(source, start=1), axis=0)))
            merged[ks[0]] = tape_op.Concat(*rows, axis=0)
        elif all(i is not None and i >= 0 for i in known) and len(set(known)) == len(known):
            # NOTE: distinct constant rows: a plain write (onnxruntime adds element by element, copies rows)
            rows = tape_op.Constant(value=ir.tensor(np.array(known, np.int64).reshape(-1, 1)))
            updates = tape_op.Concat(*[tape_op.Unsqueeze(n.inputs[2], first) for n in nodes], axis=0)
            merged[ks[0]] = tape_op.ScatterND(nodes[0].inputs[0], rows, updates)
        else:
            updates = tape_op.Concat(*[tape_op.Unsqueeze(n.inputs[2], first) for n in nodes], axis=0)
            rows = tape_op.Concat(*[tape_op.Unsqueeze(n.inputs[1], first) for n in nodes], axis=0)
            merged[ks[0]] = tape_op.ScatterND(nodes[0].inputs[0], rows, updates, reduction="add")
        merged.update({k: None for k in ks[1:]})
    return [merged.get(k, p) for k, p in enumerate(parts) if merged.get(k, p) is not None]


def _row_scatter(part: ir.Value) -> ir.Value | None:
    """The tensor ``x`` when ``part`` alone reads ``ScatterND(Expand(0, Shape(x)), i, u, reduction="add")`` with
    ``i`` of shape [1] (one row), else None."""
    node = part.producer()
    if node is None or node.op_type != "ScatterND" or node.domain not in ("", "ai.onnx") or part.uses() or \
            part.is_graph_output() or node.attributes.get_string("reduction", "none") != "add":
        return None
    zeros = node.inputs[0].producer()
    if not _one_row(node.inputs[1]) or zeros is None or zeros.op_type != "Expand" or not _is_zero(zeros.inputs[0]):
        return None
    shape = zeros.inputs[1].producer()
    return shape.inputs[0] if shape is not None and shape.op_type == "Shape" and not shape.attributes else None


def _one_row(rows: ir.Value) -> bool:
    """Whether ``rows`` has shape [1], as the ``Unsqueeze(i, [-1])`` of a scalar index ``i``."""
    if rows.shape is not None:
        return list(rows.shape) == [1]
    node = rows.producer()
    return node is not None and node.op_type == "Unsqueeze" and node.inputs[0].shape is not None and \
        len(node.inputs[0].shape) == 0


def _index(rows: ir.Value) -> ir.Value:
    """The scalar index ``i`` of ``rows = Unsqueeze(i, [-1])`` (``rows`` itself otherwise), read through a Cast."""
    node = rows.producer()
    if node is not None and node.op_type == "Unsqueeze":
        rows = node.inputs[0]
        node = rows.producer()
    return node.inputs[0] if node is not None and node.op_type == "Cast" else rows


def _int_vector(value: ir.Value | None) -> list[int] | None:
    """The values of a 1-D int64 constant of at most 64 elements (an initializer's, a Constant node's), else None."""
    if value is None:
        return None
    tensor, node = value.const_value, value.producer()
    if tensor is None and node is not None and node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
        attr = node.attributes.get("value_ints")
        if attr is not None and attr.type == ir.AttributeType.INTS:
            return [int(v) for v in attr.value]
        attr = node.attributes.get("value")
        tensor = attr.value if attr is not None and attr.type == ir.AttributeType.TENSOR else None
    if tensor is None or tensor.dtype != ir.DataType.INT64 or len(tensor.shape) != 1 or tensor.size > 64:
        return None
    return [int(v) for v in tensor.numpy()]


def _constant(value: ir.Value):
    """The value of a constant (an initializer's or a Constant node's) as an int or numpy array, else None."""
    tensor, node = value.const_value, value.producer()
    if tensor is None and node is not None and node.op_type == "Constant" and "value" in node.attributes:
        tensor = node.attributes["value"].value
    if tensor is None:
        return None
    array = tensor.numpy()
    return int(array.reshape(-1)[0]) if array.size == 1 and array.dtype.kind in "iu" else array


def _is_zero(value: ir.Value) -> bool:
    """Whether ``value`` is a constant zero (``Ctx.const(0.0, like)``'s CastLike of one included)."""
    node = value.producer()
    array = _constant(node.inputs[0] if node is not None and node.op_type == "CastLike" else value)
    return array is not None and not np.any(array)


def _expanded(part: ir.Value) -> ir.Value | None:
    """The input of the Expand that alone produces and reads ``part``, or None."""
    node = part.producer()
    if node is None or node.op_type != "Expand" or node.domain not in ("", "ai.onnx") or part.uses() or \
            part.is_graph_output():
        return None
    return node.inputs[0]


def _rule_of(node: ir.Node) -> Rule | None:
    return RULES.get((node.domain if node.domain != "ai.onnx" else "", node.op_type))


def _check_rules(todo: list[ir.Node], active: set) -> None:
    """Raises NotDifferentiableError listing every node on a gradient path whose op has no rule."""
    missing = [n for n in todo if _rule_of(n) is None]
    if missing:
        listed = ", ".join(f"{n.domain or 'ai.onnx'}::{n.op_type} (node {n.name!r}) whose inputs "
                           f"{list(dict.fromkeys(v.name for v in _reads(n) if v in active))} need a gradient"
                           for n in missing)
        raise NotDifferentiableError(
            f"model: onnxopt has no gradient rule for {len(missing)} node(s): {listed}; expected ops of "
            "docs/ops.md (rewrite these ops into differentiable ones, or leave the weights before them out with "
            "frozen=)", [(n.op_type, n.name or "") for n in missing])


def differentiate(m: ir.Model, weights: Sequence[str], inputs: Sequence[str] = ()) -> ir.Model:
    """Adds the YieldOp and the backward graph to ``m`` (in place; weights become graph inputs) and returns it."""
    from onnxopt.autodiff import load_rules

    load_rules()
    g = m.graph
    wrt: list[ir.Value] = [v for v in g.inputs if v.name in set(inputs)]
    wrt.sort(key=lambda v: list(inputs).index(v.name))
    for name in weights:
        value = g.initializers.pop(name)
        value.const_value = None
        g.inputs.append(value)
        wrt.append(value)
    for node in g:
        node.metadata_props.setdefault(REGION, "forward")
    dims, types = _infer(m)
    active, todo = _active_nodes(g, set(wrt), types)
    _check_rules(todo, active)
    outputs = list(g.outputs)
    no_grad = [i for i, o in enumerate(outputs) if o not in active]
    # NOTE: as the builder: one YieldOp output per differentiable forward output, the others listed
    yield_outs = [_output_grad(o, types) for o in outputs if o in active]
    yield_node = ir.node("YieldOp", outputs, domain="com.microsoft", outputs=yield_outs,
                         attributes={"non_differentiable_outputs": ir.AttrInt64s("non_differentiable_outputs", no_grad),
                                     "full_shape_outputs": ir.AttrInt64s("full_shape_outputs",
                                                                         list(range(len(outputs))))},
                         metadata_props={REGION: "backward"})
    g.append(yield_node)
    grads: dict[ir.Value, list[ir.Value]] = {}
    for o, go in zip([o for o in outputs if o in active], yield_outs):
        grads.setdefault(o, []).append(go)
    backward: list[ir.Node] = []
    shared: dict = {}
    for node in todo:
        finishing = _Op(node)
        outs = []
        for o in node.outputs:
            parts = grads.pop(o, None)
            outs.append(None if not parts else _sum(finishing, parts))
        backward += finishing.tape.nodes
        if all(go is None for go in outs):
            continue
        need = {i for i, v in enumerate(node.inputs) if v is not None and v in active}
        r = _rule_of(node)
        if r.inputs is not None:
            need &= set(r.inputs)
        # NOTE: the outer values a subgraph reads (If, Loop, Scan): their gradients follow the inputs'
        inner = _reads(node)[sum(v is not None for v in node.inputs):]
        captures = [v for v in dict.fromkeys(inner) if v in active]
        if not need and not captures:
            continue
        ctx = Ctx(node, outs, need, dims, types, shared)
        ctx.captures, ctx.opsets = captures, dict(m.opset_imports)
        try:
            gis = r.fn(ctx)
        except (ModelError, NotDifferentiableError):
            raise
        except Exception as exc:  # NOTE: a rule's own limit (a rank it needs, an attribute it lacks)
            raise ModelError(f"model: onnxopt could not differentiate {node.op_type} node {node.name!r} (inputs "
                             f"{[v.name if v is not None else '' for v in node.inputs]}): {exc}") from exc
        gis = [gis] if isinstance(gis, ir.Value) else list(gis)
        backward += ctx.tape.nodes
        targets = [*node.inputs, *captures]
        for i in [*sorted(need), *range(len(node.inputs), len(targets))]:
            gi = gis[i] if i < len(gis) else None
            if gi is None:
                continue
            x = targets[i]
            if gi.type is None:
                gi.type = x.type
            if gi.shape is None and x.shape is not None:
                gi.shape = x.shape
            grads.setdefault(x, []).append(gi)
    final = _Op(yield_node)
    results = []
    for v in wrt:
        parts = grads.pop(v, None)
        if not parts:
            if v.name in weights:
                readers = [f"{n.op_type} node {n.name!r}" for n, _ in v.uses()]
                where = f"read only by {readers}" if readers else "it does not reach the output"
                raise WeightError(f"weights: {v.name!r} gets no gradient ({where}); expected a parameter: leave it "
                                  f"out with frozen=[{v.name!r}] or weights=")
            parts = [final.Expand(final.const(0.0, v), final.Shape(v))]
        out = _sum(final, parts)
        if out in results or out.is_graph_input() or out.producer() is None or out.producer().op_type == "YieldOp":
            out = final.Identity(out)
        results.append(out)
    backward = _read_only([*backward, *final.tape.nodes], set(results))
    for n in backward:
        n.metadata_props[REGION] = "backward"
    g.extend(backward)
    for v, out in zip(wrt, results):
        out.name = f"{v.name}_grad"
        out.type, out.shape = v.type, v.shape
    _name_values(g)
    g.outputs.clear()
    g.outputs.extend(results)
    return m


def _read_only(nodes: list[ir.Node], results: set[ir.Value]) -> list[ir.Node]:
    """``nodes`` without those no node reads and making none of ``results`` (the per-row scatters
    ``_merge_scatters`` merged, and what only they read), their inputs released: they would reach the graph
    for the dead-node pass after ``differentiate`` to walk and remove (T1: 25)."""
    kept = []
    for node in reversed(nodes):
        if any(o in results or o.uses() for o in node.outputs):
            kept.append(node)
        else:
            for i in range(len(node.inputs)):
                node.replace_input_with(i, None)
    return kept[::-1]


def _output_grad(o: ir.Value, types: dict) -> ir.Value:
    """The YieldOp output ``<o>_grad``: ``o``'s type and rank (not its sizes: a declared size can be ONNX
    inference's, which onnxruntime's kernel may not follow, as STFT's frame count)."""
    dtype = o.type or (ir.TensorType(types[o.name]) if o.name in types else None)
    rank = None if o.shape is None else ir.Shape([d if isinstance(d, ir.SymbolicDim) else None for d in o.shape])
    return ir.Value(name=f"{o.name}_grad", type=dtype, shape=rank)


def _infer(m: ir.Model) -> tuple[dict, dict]:
    """(name -> dims, name -> element type) of every value by ONNX shape inference on a copy (not strict: the
    values after an op it cannot type stay unknown); the graph itself is left as the user wrote it. Nothing when
    every value already has a type and a shape (the engine reads the dicts only for values lacking them); ranks
    alone (``_propagate_ranks``) when the only values lacking one are those the inference before the rewrites
    (``graphs.infer_shapes``, stronger) could not type (``graphs.UNINFERRED``: this one finds nothing for them
    either) and the statistics outputs the rewrites gave LayerNormalization (the rule types them itself and reads
    no shape of theirs): T1's attention, ~15 ms of serializing and inferring the whole model."""
    from onnxopt.graphs import UNINFERRED

    lacking = [v for v in [*m.graph.inputs, *(o for node in m.graph for o in node.outputs)]
               if v.dtype is None or v.shape is None]
    if not lacking:
        return {}, {}
    if all(v.meta.get(UNINFERRED) or _layer_norm_statistics(v) for v in lacking):
        dims: dict = {}
        _propagate_ranks(m.graph, dims)
        return dims, {}
    try:
        proto = onnx.shape_inference.infer_shapes(ir.to_proto(m), strict_mode=False)
    except Exception:  # noqa: BLE001 (a model over 2 GB: the rules then say which rank they lack)
        return {}, {}
    dims, types = {}, {}
    for v in [*proto.graph.value_info, *proto.graph.output, *proto.graph.input]:
        t = v.type.tensor_type
        if v.type.HasField("tensor_type") and t.elem_type:
            types[v.name] = ir.DataType(t.elem_type)
            if t.HasField("shape"):
                dims[v.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
    _propagate_ranks(m.graph, dims)
    return dims, types


def _layer_norm_statistics(value: ir.Value) -> bool:
    """Whether ``value`` is the unread Mean or InvStdDev output of a LayerNormalization node."""
    node = value.producer()
    return node is not None and node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx") and \
        value.index() in (1, 2) and not value.uses() and not value.is_graph_output()


_SAME_RANK = {"Transpose", "Pad", "Slice", "Cast", "CastLike", "Identity", "Neg", "Relu", "Sigmoid", "Tanh", "Exp",
              "Log", "Abs", "Sqrt", "Softmax", "LogSoftmax", "Where", "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min",
              "Concat", "Clip", "Expand", "ScatterND", "ScatterElements", "Tile", "Erf", "LeakyRelu"}


def _propagate_ranks(graph: ir.Graph, dims: dict) -> None:
    """Ranks (unknown dimensions) of the values ONNX inference stopped before, for the common ops: rules need
    ranks, rarely sizes."""
    def rank(v):
        known = dims.get(v.name) if v is not None else None
        if known is None and v is not None and v.shape is not None:
            known = tuple(d if isinstance(d, int) else None for d in v.shape)
        return None if known is None else len(known)

    for node in graph:
        out = node.outputs[0] if node.outputs else None
        if out is None or rank(out) is not None:
            continue
        ins = [rank(v) for v in node.inputs if v is not None]
        r = None
        if node.op_type in _SAME_RANK and ins and all(i is not None for i in ins):
            r = max(ins)
        elif node.op_type == "Reshape" and node.inputs[1].const_value is not None:
            r = node.inputs[1].const_value.size
        elif node.op_type in ("Gather", "GatherElements") and None not in ins[:2]:
            r = ins[0] + ins[1] - 1 if node.op_type == "Gather" else ins[1]
        elif node.op_type == "MatMul" and None not in ins:
            r = max(ins)
        if r is not None:
            dims[out.name] = (None,) * r


def _name_values(g: ir.Graph) -> None:
    """Names every unnamed backward value ``<node>_bw<k>`` (unique in the graph)."""
    taken = {v.name for v in g.inputs} | set(g.initializers) | {o.name for n in g for o in n.outputs if o.name}
    k = 0
    for node in g:
        for o in node.outputs:
            if not o.name:
                while f"_bw{k}" in taken:
                    k += 1
                o.name = f"_bw{k}"
                taken.add(o.name)
