"""``TrainStep``: the fused training-step model plus the names a runner needs, saved as one ``.onnx``.

Naming convention of the fused graph (also in docs/fused_step.md):
inputs  = model inputs, ``target``, ``sample_weight`` (weighted losses), each weight ``W``, each state
          ``W.<state>`` (e.g. ``W.velocity``) and the step counter ``optim.step`` (int64 scalar, steps done);
          and each running statistic ``S`` of a BatchNormalization in mode="train" (``bn.running_mean``);
outputs = ``loss``, then ``W.new``, ``W.<state>.new``, ``optim.step.new``, ``S.new``.
With ``external_grad=True`` the input ``<output>.grad`` replaces ``target``/``sample_weight`` and the
prediction ``<output>`` is the last output.
Weights and running statistics keep the model's values as initializers (defaults), so a session can start
from them. Running statistics are ``TrainStep.buffers``, not optimizer state (``TrainStep.state``).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os

import numpy as np
import onnx
import onnx_ir as ir

from onnxopt import atomic
from onnxopt.errors import ModelError
from onnxopt.protocol import NEW, PROTOCOL_KEY, STEP, describe, loads

__all__ = ["TrainStep", "STEP", "NEW", "GRAD"]

GRAD = ".grad"  # the output-gradient input of a step compiled with external_grad=True
_KEY = "onnxopt.train_step"


@dataclasses.dataclass
class TrainStep:
    """A compiled training step: ``model`` runs forward, loss, backward and update in one session run."""

    model: onnx.ModelProto
    inputs: list[str]
    target: str | None
    sample_weight: str | None
    loss: str
    weights: list[str]
    state: list[str]
    target_kind: str = "float"
    inference: bytes = b""  # the user's inference model, weights stripped (see ``Runner.export``)
    output_grad: str | None = None  # external_grad=True: the input ``<output>.grad``
    prediction: str | None = None  # external_grad=True: the model output the step also returns
    buffers: list[str] = dataclasses.field(default_factory=list)  # running statistics carried in mode="train"
    classes: int | None = None  # class-index targets: the prediction's number of classes, when static

    @property
    def carry(self) -> dict[str, str]:
        """Input name -> output name of every tensor carried from one step to the next."""
        return {name: name + NEW for name in [*self.weights, *self.buffers, *self.state]}

    def _initial(self, names: list[str]) -> dict[str, np.ndarray]:
        inits = {t.name: t for t in self.model.graph.initializer}
        return {name: ir.serde.deserialize_tensor(inits[name]).numpy() for name in names}

    def initial_weights(self) -> dict[str, np.ndarray]:
        """The weights the fused model starts from (the original model's values)."""
        return self._initial(self.weights)

    def initial_buffers(self) -> dict[str, np.ndarray]:
        """The running statistics the fused model starts from (the original model's values)."""
        return self._initial(self.buffers)

    def inference_model(self, values: dict[str, np.ndarray]) -> onnx.ModelProto:
        """The user's original inference model with ``values`` (trained weights, running statistics) written into
        its initializers of the same names (``Runner.export``)."""
        model = onnx.ModelProto()
        model.ParseFromString(self.inference)
        for init in model.graph.initializer:
            if init.name in values:
                init.CopyFrom(ir.serde.serialize_tensor(ir.tensor(values[init.name], name=init.name)))
        from onnxopt.ml_rules import restore_zipmap  # NOTE: the classifier's list-of-dicts output, as converted

        return restore_zipmap(model)

    @property
    def protocol(self) -> dict:
        """The step's inputs and outputs by role and its swap map, as stored in a saved step (``protocol``)."""
        return describe(self)

    def _metadata(self) -> str:
        fields = dataclasses.asdict(self)
        fields.pop("model")
        fields["inference"] = base64.b64encode(self.inference).decode("ascii")
        return json.dumps(fields)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the fused model (with the names above in its metadata) to ``path``, atomically."""
        model = onnx.ModelProto()
        model.CopyFrom(self.model)
        props = {p.key: p.value for p in model.metadata_props}
        props[_KEY] = self._metadata()
        props[PROTOCOL_KEY] = json.dumps(self.protocol)
        del model.metadata_props[:]
        for key, value in props.items():
            model.metadata_props.add(key=key, value=value)
        atomic.write(path, model.SerializeToString())

    @classmethod
    def load(cls, path: str | os.PathLike) -> TrainStep:
        """Reads a model written by ``save``."""
        from onnxopt.modelio import load_model

        model = ir.to_proto(load_model(path, "path"))
        props = {p.key: p.value for p in model.metadata_props}
        if _KEY not in props:
            raise ModelError(f"path: {os.fspath(path)!r} is an ONNX model but not a train step saved by onnxopt "
                             f"(metadata {_KEY!r} missing)")
        if PROTOCOL_KEY in props:  # NOTE: a step saved before the protocol existed has none, and still loads
            loads(props[PROTOCOL_KEY])
        fields = json.loads(props[_KEY])
        fields["inference"] = base64.b64decode(fields["inference"])
        return cls(model=model, **fields)
