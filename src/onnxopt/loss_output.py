"""``add_loss_output``: a model that outputs its own loss (onnxcustom's full-training case)."""

from __future__ import annotations

from collections.abc import Sequence

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as passes

from onnxopt import graphs
from onnxopt.dsl.core import Loss, Penalty
from onnxopt.fuse import apply_loss, select_output, target_input
from onnxopt.gradient import check_weights
from onnxopt.modelio import ModelLike, load_model
from onnxopt.resolve import resolve_loss, resolve_penalty

__all__ = ["add_loss_output"]


def add_loss_output(
    model: ModelLike,
    loss: str | Loss = "square",
    output: str | None = None,
    penalty: str | Penalty | None = None,
    weights: Sequence[str] | None = None,
) -> onnx.ModelProto:
    """Returns ``model`` with new inputs ``target`` (and ``sample_weight`` for weighted losses) and a first
    output ``loss`` = loss(prediction, target) + Σ penalty(w) over ``weights`` (None = every real weight).

    Compile it with ``compile_train_step(model, loss=None, loss_output="loss")``.

    >>> from onnxopt.examples import linear_regression
    >>> m = add_loss_output(linear_regression(2), loss="absolute", penalty="l2")
    >>> [o.name for o in m.graph.output], [i.name for i in m.graph.input]
    (['loss', 'Y'], ['X', 'target', 'sample_weight'])
    """
    m = load_model(model)
    decl, pen = resolve_loss(loss), resolve_penalty(penalty)
    y = select_output(m, output)
    g = m.graph
    ins = [y, target_input(g, decl, y)]
    if decl.weighted:
        ins.append(graphs.new_input(g, "sample_weight", dtype=y.dtype, shape=[graphs.rows(y)]))
    value = apply_loss(m, decl, ins)
    if pen is not None:
        terms = [graphs.call(m, pen.fn, [g.initializers[n]], pen.call_attrs(), f"penalty/{n}")[0]
                 for n in check_weights(m, weights)]
        for term in terms:
            value = ir.tape.Tape(g).op("Add", [value, term], metadata_props={graphs.REGION: "penalty"})
    g.outputs.insert(0, value)
    passes.InlinePass()(m)
    g.outputs[0].name = "loss"
    graphs.tag(g, "forward")
    for p in (passes.RemoveUnusedFunctionsPass(), passes.RemoveUnusedOpsetsPass()):
        p(m)
    m.opset_imports.pop("onnxopt.dsl", None)
    return ir.to_proto(m)
