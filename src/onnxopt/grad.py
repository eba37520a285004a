"""``grad``: a model plus the gradient of one of its outputs, as an ordinary ONNX model that ``grad`` takes again.

The gradient is onnxopt's own (``autodiff``): standard ONNX ops that have rules themselves, so a gradient
graph differentiates again (gradients of gradients: Hessian-vector products, a gradient penalty), and
``compile_train_step(..., loss=None, loss_output=...)`` trains a model whose loss reads a gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as passes

from onnxopt.errors import ModelError
from onnxopt.fuse import run_part
from onnxopt.modelio import ModelLike

__all__ = ["grad"]

_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def grad(model: ModelLike, wrt: Sequence[str], of: str | None = None, *, seed: bool = False) -> onnx.ModelProto:
    """``model`` with the same inputs and outputs plus ``<name>_grad`` for each name of ``wrt``: the gradient of
    ``sum(of)`` with respect to that graph input or initializer.

    Args:
        model: an ONNX model (proto, ``ir.Model`` or path).
        wrt: float graph inputs or initializers (an initializer stays one: its gradient is an output).
        of: the output differentiated; None: the model's only float output.
        seed: add an input ``<of>_grad`` (``of``'s type and shape) that weights the sum:
            the gradient of ``sum(of * <of>_grad)`` (a vector-Jacobian product); False: ones.

    Returns:
        An ordinary ``onnx.ModelProto``. When the model already has a value ``<name>_grad`` (the output of an
        earlier ``grad``), the new output is ``<name>_grad2`` (then ``_grad3``...).

    >>> from onnxopt.examples import linear_regression
    >>> g = grad(linear_regression(3), ["coef"])
    >>> [o.name for o in g.graph.output]
    ['Y', 'coef_grad']
    """
    part = run_part(model, ("load",), gradient="onnxopt")  # NOTE: the compiler's load stage
    m, g = part.model, part.model.graph
    wrt = [wrt] if isinstance(wrt, str) else list(wrt)
    inputs = {v.name: v for v in g.inputs}
    names = sorted({*inputs, *g.initializers})
    for name in wrt:
        value = inputs.get(name) or g.initializers.get(name)
        if value is None:
            raise ModelError(f"wrt: {name!r} is not a graph input or initializer of the model (expected some of "
                             f"{names[:20]})")
        if value.dtype not in _FLOATS:
            raise ModelError(f"wrt: {name!r} is not a float tensor (expected float, double, float16 or bfloat16, "
                             f"got {getattr(value.dtype, 'name', None)})")
    if not wrt or len(set(wrt)) != len(wrt):
        raise ModelError(f"wrt: expected distinct names of inputs or initializers, got {wrt}")
    target = _output(g, of)
    taken = {*inputs, *g.initializers, *(o.name for n in g.all_nodes() for o in n.outputs if o.name)}
    if seed and f"{target.name}_grad" in taken:
        raise ModelError(f"seed: the model already has a value {target.name + '_grad'!r}, the seed input's name "
                         "(expected a model without it: rename that value)")
    out_names = [_free(f"{name}_grad", taken) for name in wrt]
    # NOTE: initializers differentiate as inputs, made initializers again at the end
    lifted = {}
    for name in wrt:
        if name not in inputs:
            value = g.initializers.pop(name)
            lifted[name], value.const_value = value.const_value, None
            g.inputs.append(value)
    # NOTE: the compiler's modes stage, mode=None: BatchNormalization and Dropout as their training_mode says, in
    # standard ops (y: the output differentiated, which the compiler's select stage would leave)
    run_part(part, ("modes",), mode=None, y=target)
    result, kept, grads = _differentiate(m, wrt, target.name, seed)
    g = result.graph
    for name, tensor in lifted.items():
        value = next(v for v in g.inputs if v.name == name)
        g.inputs.remove(value)
        value.const_value = tensor
        g.register_initializer(value)
    for k, (value, name) in enumerate(zip(grads, out_names)):
        if value in kept or value in grads[:k] or value.is_graph_input() or value.is_initializer():
            copy = ir.node("Identity", [value])
            g.append(copy)
            grads[k] = value = copy.outputs[0]
        value.name = name
    g.outputs[:] = [*kept, *grads]
    for node in g.all_nodes():  # NOTE: a later compile_train_step tags its own regions
        node.metadata_props.pop("onnxopt.region", None)
    passes.RemoveUnusedNodesPass()(result)
    if any(n.domain == "com.microsoft" for n in g.all_nodes()):  # NOTE: Det's rule writes its Inverse
        result.opset_imports.setdefault("com.microsoft", 1)
    return ir.to_proto(result)


def _output(g: ir.Graph, of: str | None) -> ir.Value:
    floats = [o for o in g.outputs if o.dtype in _FLOATS]
    if of is None:
        if len(floats) != 1:
            raise ModelError(f"of: the model has {len(floats)} float outputs {[o.name for o in floats]}; expected "
                             "one, or of= naming the output to differentiate")
        return floats[0]
    found = [o for o in g.outputs if o.name == of]
    if not found:
        raise ModelError(f"of: {of!r} is not an output of the model (expected one of {[o.name for o in g.outputs]})")
    if found[0].dtype is not None and found[0].dtype not in _FLOATS:
        raise ModelError(f"of: output {of!r} is not a float tensor (got {getattr(found[0].dtype, 'name', None)})")
    return found[0]


def _free(name: str, taken: set[str]) -> str:
    base, k = name, 1
    while name in taken:
        k += 1
        name = f"{base}{k}"
    taken.add(name)
    return name


def _differentiate(m: ir.Model, wrt: list[str], of: str, seed: bool) -> tuple[ir.Model, list, list]:
    """``m`` (changed in place) differentiated: (the model, its outputs, the gradients of output ``of`` with
    respect to the graph inputs ``wrt``, seeded by an input ``<of>_grad`` or ones)."""
    from onnxopt.autodiff import differentiate
    from onnxopt.rules import lower_for_gradient

    lower_for_gradient(m, gradient="onnxopt")
    passes.CommonSubexpressionEliminationPass()(m)
    g = m.graph
    kept = list(g.outputs)
    target = next(o for o in kept if o.name == of)
    if target.dtype is None:
        target.type = ir.TensorType(_inferred_type(m, of))
    g.outputs[:] = [target]
    differentiate(m, [], wrt)
    grads = list(g.outputs)
    node = next(n for n in g if n.op_type == "YieldOp")
    # NOTE: the rank only, as the engine's YieldOp outputs: a declared size can be ONNX inference's (STFT's frames)
    shape = None if target.shape is None else ir.Shape([d if isinstance(d, ir.SymbolicDim) else None
                                                          for d in target.shape])
    seed_input = ir.Value(name=f"{of}_grad", type=target.type, shape=shape)
    if seed:
        g.inputs.append(seed_input)
    if node.outputs:
        if not seed:
            shape = ir.node("Shape", [target])
            ones = ir.node("Expand", [_one(g, node, target), shape.outputs[0]])
            g.insert_before(node, [shape, ones])
            seed_input = ones.outputs[0]
        ir.convenience.replace_all_uses_with(node.outputs[0], seed_input, replace_graph_outputs=True)
    g.remove(node, safe=True)
    g.outputs[:] = [*kept, *grads]
    return m, kept, grads


def _one(g: ir.Graph, before: ir.Node, like: ir.Value) -> ir.Value:
    dtype = like.dtype or ir.DataType.FLOAT
    node = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(1.0, dtype=dtype.numpy()))})
    g.insert_before(before, node)
    return node.outputs[0]


def _inferred_type(m: ir.Model, name: str) -> ir.DataType:
    """The element type ONNX shape inference gives output ``name`` (a float one), else a ModelError."""
    proto = onnx.shape_inference.infer_shapes(ir.to_proto(m), strict_mode=False)
    found = [o.type.tensor_type.elem_type for o in proto.graph.output if o.name == name]
    dtype = ir.DataType(found[0]) if found and found[0] else None
    if dtype not in _FLOATS:
        raise ModelError(f"of: output {name!r} has no float type ONNX shape inference finds (got {dtype}); "
                         "expected a float output")
    return dtype
