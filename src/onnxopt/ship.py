"""Shipping a step to runners outside Python (the npm package ``onnxopt`` in ``js/``): one file, read by any
onnxruntime binding.

A file ``TrainStep.save`` writes already holds what such a runner needs: the fused model, the initial weights
(its initializers), and the protocol (``onnxopt.protocol``: each input's role, which output feeds which input).
``for_js`` adds the step's epoch form: the step as the body of an ONNX ``Scan`` over stacked batches
(``passes.epoch``), stored in the metadata under ``EPOCH_KEY`` as JSON ``{"version": 1, "model": <base64 of the
epoch model>, "batch_inputs": [X, target], "carried": [...]}``. Its carried tensors are plain inputs (no
initializers: the runner feeds them), so a runner trains a whole epoch in one session run. A step the Scan
cannot hold (control flow, random ops: ``passes.epoch.scannable``) is returned without one; runners then run
the epoch one step per batch.
"""

from __future__ import annotations

import base64
import dataclasses
import json

import onnx

from onnxopt.errors import ModelError
from onnxopt.passes.epoch import epoch_model, scannable
from onnxopt.step import TrainStep

__all__ = ["EPOCH_KEY", "for_js"]

EPOCH_KEY = "onnxopt.epoch"


def for_js(step: TrainStep) -> TrainStep:
    """A copy of ``step`` whose saved file also holds its epoch form (``EPOCH_KEY``), when it has one.

    Raises ModelError for a step the JavaScript runner cannot drive (one compiled with ``external_grad=True``, or
    reading several data inputs).
    """
    if step.output_grad is not None or len(step.inputs) != 1:
        raise ModelError(f"step: the JavaScript runner feeds one data input and a target; this step reads inputs "
                         f"{step.inputs} and output gradient {step.output_grad!r}")
    model = onnx.ModelProto()
    model.CopyFrom(step.model)
    carried = [*step.weights, *step.buffers, *step.state]
    # NOTE: carried tensors are fed by the runner: as initializers too, the Scan's body would shadow its state
    keep = [t for t in model.graph.initializer if t.name not in carried]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    props = [p for p in model.metadata_props if p.key != EPOCH_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(props)
    batch_inputs = [step.inputs[0], *([step.target] if step.target else [])]
    shipped = dataclasses.replace(step, model=onnx.ModelProto())
    shipped.model.CopyFrom(step.model)
    del shipped.model.metadata_props[:]
    shipped.model.metadata_props.extend(props)
    if step.target is None or not scannable(model):
        return shipped
    epoch = epoch_model(model, batch_inputs, carried, None, step.loss)
    entry = {"version": 1, "model": base64.b64encode(epoch.SerializeToString()).decode("ascii"),
             "batch_inputs": batch_inputs, "carried": carried}
    shipped.model.metadata_props.add(key=EPOCH_KEY, value=json.dumps(entry))
    return shipped
