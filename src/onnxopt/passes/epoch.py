"""An epoch as one model: the Runner's CPU step as the body of an ONNX ``Loop`` over stacked batches.

``epoch_model`` wraps a step whose per-batch inputs are ``batch_inputs`` (X, the target): the Loop reads
batch ``i`` of ``epoch.<input>`` (shape ``(steps, batch, ...)``) with a ``Gather``, carries the step's
carried tensors (``<name>`` -> ``<name>.new``) from ``epoch.<name>`` to ``epoch.<name>.new``, passes each
iteration's carried inputs through (``epoch.<name>.last``: the last step's inputs, which a diverging next
step goes back to) and stacks the losses in ``epoch.losses``. A pack's members (weights bound as views of
it in the step, ``passes.update``) come from ``Split`` + ``Reshape`` of the carried pack. Every other input
(hoisted sample-weight values, constants) is read from the outer scope, so it is bound once per epoch. The
body is the step's graph, node for node: the losses and weights are those of one run per batch, bit for
bit (tests/test_epoch.py).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxopt.passes.batch import RANDOM
from onnxopt.step import NEW

__all__ = ["epoch_model", "loopable", "PREFIX", "LAST"]

PREFIX = "epoch."  # NOTE: outer names differ from the body's: ONNX forbids a subgraph to shadow outer names
LAST = ".last"


def loopable(model: onnx.ModelProto) -> bool:
    """Whether ``model`` can be a Loop body giving the numbers of one run per batch. Left out: random ops
    (Dropout: the body's kernel draws other masks than the step's) and the gradient ops onnxruntime-training
    registers in the ONNX domain, on which 1.19 crashes inside a subgraph (a segfault at session creation;
    found: MaxPoolGrad)."""
    return all(n.op_type not in RANDOM and (n.domain not in ("", "ai.onnx") or onnx.defs.has(n.op_type))
               for n in model.graph.node)


def _info(name: str, value: onnx.ValueInfoProto, lead: tuple = ()) -> onnx.ValueInfoProto:
    t = value.type.tensor_type
    dims = [*lead, *(d.dim_value or d.dim_param or None for d in t.shape.dim)] if t.HasField("shape") else None
    return helper.make_tensor_value_info(name, t.elem_type, dims)


def epoch_model(model: onnx.ModelProto, batch_inputs: list[str], carried: list[str],
                views: tuple[str, list[tuple[str, tuple[int, ...]]]] | None, loss: str) -> onnx.ModelProto:
    """The Loop model running ``model`` once per batch; outer inputs ``epoch.<batch input>``, ``epoch.steps``,
    ``epoch.<carried>`` and the step's other inputs by name; outputs ``epoch.<carried>.new``, ``epoch.losses``.
    ``views``: a carried pack and its members' (name, shape), in order, which the step reads as inputs."""
    g = model.graph
    inputs, outputs = {v.name: v for v in g.input}, {v.name: v for v in g.output}
    nodes = [helper.make_node("Gather", [PREFIX + name, PREFIX + "i"], [name]) for name in batch_inputs]
    pack, members = views or (None, [])
    consts = []
    if members:
        consts.append(numpy_helper.from_array(np.array([math.prod(s) for _, s in members], np.int64), PREFIX + "sizes"))
        nodes.append(helper.make_node("Split", [pack, consts[0].name], [f"{PREFIX}{m}.flat" for m, _ in members]))
    for m, shape in members:
        consts.append(numpy_helper.from_array(np.array(shape, np.int64), f"{PREFIX}{m}.shape"))
        nodes.append(helper.make_node("Reshape", [f"{PREFIX}{m}.flat", consts[-1].name], [m]))
    cond = helper.make_tensor_value_info(PREFIX + "cond", TensorProto.BOOL, [])
    # NOTE: the condition and each iteration's carried inputs are passed through (no copy: the same values):
    # the Loop ends with the inputs of its last step in ``epoch.<carried>.last``, as a step keeps them
    last = [_info(f"{PREFIX}{n}.previous", inputs[n]) for n in carried]
    body = helper.make_graph(
        [*nodes, *g.node], "epoch_body",
        [helper.make_tensor_value_info(PREFIX + "i", TensorProto.INT64, []), cond, *(inputs[n] for n in carried),
         *last], [cond, *(outputs[n + NEW] for n in carried), *(inputs[n] for n in carried), outputs[loss]],
        [*g.initializer, *consts])
    inner = {*batch_inputs, *carried, *(m for m, _ in members)}
    outer = [*(_info(PREFIX + n, inputs[n], (None,)) for n in batch_inputs),
             helper.make_tensor_value_info(PREFIX + "steps", TensorProto.INT64, []),
             *(_info(PREFIX + n, inputs[n]) for n in carried), *(v for v in g.input if v.name not in inner)]
    loop = helper.make_node("Loop", [PREFIX + "steps", "", *[PREFIX + n for n in carried] * 2],
                            [*(PREFIX + n + NEW for n in carried), *(PREFIX + n + LAST for n in carried),
                             PREFIX + "losses"], body=body)
    results = [*(_info(PREFIX + n + NEW, inputs[n]) for n in carried), *(_info(PREFIX + n + LAST, inputs[n])
                                                                          for n in carried),
               _info(PREFIX + "losses", outputs[loss], (None,))]
    return helper.make_model(helper.make_graph([loop], "epoch", outer, results), opset_imports=model.opset_import,
                             ir_version=model.ir_version, functions=model.functions)
