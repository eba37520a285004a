"""A step's protocol as data: the role of each input and output, and which output feeds which input next step.

Stored in a saved step's ``metadata_props`` under ``PROTOCOL_KEY`` as JSON, so that a runner in any language
(the Runner, the Trainer, the facades, the JavaScript package in ``js/``) drives a step from the file alone::

    {"version": 1,
     "inputs":  [{"name": "X", "role": "data"}, {"name": "target", "role": "target"},
                 {"name": "coef", "role": "weight"}, {"name": "coef.velocity", "role": "state"},
                 {"name": "optim.step", "role": "step"}, ...],
     "outputs": [{"name": "loss", "role": "loss"}, {"name": "coef.new", "role": "weight", "feeds": "coef"}, ...],
     "target_kind": "float", "classes": null}

A ``state`` input also names the weight it is shaped like (``"like": "coef"``): it starts at zeros, the step
counter at 0, weights and buffers at their initializers. Input roles: ``data``, ``target``, ``sample_weight``, ``output_grad``, ``weight``, ``state`` (optimizer state),
``step`` (the int64 step counter), ``buffer`` (running statistics). Output roles: ``loss``, ``prediction`` and
the carried roles (``weight``, ``state``, ``step``, ``buffer``), each with ``feeds``: the input it replaces in
the next step. A reader refuses a version it does not know.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, NamedTuple

from onnxopt.errors import ModelError

if TYPE_CHECKING:
    from onnxopt.step import TrainStep

__all__ = ["PROTOCOL_KEY", "VERSION", "STEP", "NEW", "describe", "loads", "swap_map", "Roles"]

PROTOCOL_KEY = "onnxopt.protocol"
VERSION = 1
INPUT_ROLES = ("data", "target", "sample_weight", "output_grad", "weight", "state", "step", "buffer")
CARRIED = ("weight", "state", "step", "buffer")
STEP = "optim.step"  # NOTE: the step counter's input; its output is STEP + NEW
NEW = ".new"  # NOTE: the suffix of a carried output: ``W.new`` replaces ``W`` in the next step


def describe(step: TrainStep) -> dict:
    """The protocol of ``step``: its inputs and outputs by role, in the order of the step's graph."""
    roles = {name: "data" for name in step.inputs}
    roles.update({step.target: "target", step.sample_weight: "sample_weight", step.output_grad: "output_grad"})
    roles.update({n: "weight" for n in step.weights})
    roles.update({n: "state" for n in step.state if n != STEP})
    roles.update({n: "buffer" for n in step.buffers})
    roles[STEP] = "step"
    roles.pop(None, None)
    graph_inputs = [i.name for i in step.model.graph.input]
    order = [n for n in graph_inputs if n in roles] + [n for n in roles if n not in graph_inputs]  # NOTE: initializers
    inputs = [{"name": n, "role": roles[n]} for n in order]
    for entry in inputs:  # NOTE: optimizer state starts at zeros shaped as its weight, ``W.<state>``
        if entry["role"] == "state":
            entry["like"] = max((w for w in step.weights if entry["name"].startswith(w + ".")), key=len)
    feeds = {name + NEW: name for name, role in roles.items() if role in CARRIED}
    outputs = []
    for out in (o.name for o in step.model.graph.output):
        if out == step.loss:
            outputs.append({"name": out, "role": "loss"})
        elif out in feeds:
            outputs.append({"name": out, "role": roles[feeds[out]], "feeds": feeds[out]})
        elif out == step.prediction:
            outputs.append({"name": out, "role": "prediction"})
    return {"version": VERSION, "inputs": inputs, "outputs": outputs, "target_kind": step.target_kind,
            "classes": step.classes}


def loads(text: str) -> dict:
    """The protocol stored as ``text``; a ``ModelError`` for a version this onnxopt does not read."""
    protocol = json.loads(text)
    version = protocol.get("version")
    if version != VERSION:
        raise ModelError(f"metadata {PROTOCOL_KEY!r}: protocol version {version!r} is not supported "
                         f"(expected {VERSION}); a newer onnxopt saved this step")
    return protocol


def swap_map(protocol: dict) -> dict[str, str]:
    """Output name -> the input it replaces in the next step."""
    return {o["name"]: o["feeds"] for o in protocol["outputs"] if "feeds" in o}


class Roles(NamedTuple):
    """A step's names by role, read from its protocol: what the Runner, the Trainer and the distributed runner
    feed, carry and read. ``state``: the optimizer state, then the step counter (as ``TrainStep.state``)."""

    data: list[str]
    target: str | None
    sample_weight: str | None
    output_grad: str | None
    weights: list[str]
    state: list[str]
    buffers: list[str]
    loss: str | None
    prediction: str | None
    swap: dict[str, str]
    target_kind: str
    classes: int | None

    @classmethod
    def of(cls, step: TrainStep | dict) -> Roles:
        """The roles of ``step`` (a ``TrainStep``, whose ``protocol`` is read, or a protocol itself)."""
        protocol = step if isinstance(step, dict) else step.protocol
        swap = swap_map(protocol)
        fed = set(swap.values())
        names: dict[str, list[str]] = {}
        for entry in protocol["inputs"]:
            names.setdefault(entry["role"], []).append(entry["name"])
        outputs = {o["role"]: o["name"] for o in protocol["outputs"] if o["role"] in ("loss", "prediction")}
        one = lambda role: names.get(role, [None])[0]  # noqa: E731
        counter = [n for n in names.get("step", []) if n in fed]  # NOTE: a gradient-only step carries none
        return cls(names.get("data", []), one("target"), one("sample_weight"), one("output_grad"),
                   names.get("weight", []), [*names.get("state", []), *counter], names.get("buffer", []),
                   outputs.get("loss"), outputs.get("prediction"), swap, protocol["target_kind"],
                   protocol["classes"])
