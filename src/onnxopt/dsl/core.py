"""The DSL's building blocks: a frozen declaration per loss, penalty, update rule and schedule.

Each declaration holds an onnxscript function (compiled to an ONNX function in domain ``onnxopt.dsl``) and
the values of its attributes; calling a declaration with keyword arguments returns a copy with new values,
so ``dsl.updates.momentum(momentum=0.5)`` and a user's ``my_rule(beta=0.1)`` work alike.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import onnx_ir as ir
import onnxscript
from onnxscript import DOUBLE, FLOAT, INT64, script, values
from onnxscript import opset18 as op
from onnxscript._internal import ast_utils  # NOTE: script()'s own two steps, run with our names (see _names)
from onnxscript._internal.main import script_check

from onnxopt.errors import DslError

__all__ = ["DOMAIN", "op", "FLOAT", "DOUBLE", "INT64", "Loss", "Penalty", "UpdateRule", "Schedule",
           "loss", "penalty", "update_rule", "schedule", "to_script"]

DOMAIN = values.Opset("onnxopt.dsl", 1)
_Fn = onnxscript.OnnxFunction


def to_script(fn: Callable | _Fn, what: str) -> _Fn:
    """Compiles a Python function written with ``op`` into an onnxscript function of the DSL domain."""
    if isinstance(fn, _Fn):
        return fn
    if not callable(fn) or not inspect.isfunction(fn):
        raise DslError(f"{what}: expected a function written with onnxopt.dsl.op, got {type(fn).__name__}")
    try:
        src, tree = ast_utils.get_src_and_ast(fn)
        sf = onnxscript.OnnxFunction(DOMAIN, fn, script_check(tree, DOMAIN, _names(fn, tree), src), src, {})
    except Exception as exc:
        try:
            where = f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}" if hasattr(fn, "__code__") else ""
        except (OSError, TypeError):  # NOTE: no source for functions defined in a REPL, stdin or exec
            where = "source unavailable"
        raise DslError(f"{what}: {fn.__name__} ({where}) is not a valid onnxscript function: {exc}") from exc
    for value in [*sf.function_ir.inputs, *sf.function_ir.outputs]:
        if value.dtype in _GENERIC:  # NOTE: ONNX functions are type-generic: y: FLOAT also runs on float64 models
            value.type, value.shape = None, None
    return sf


_GENERIC = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _names(fn: Callable, tree: ast.FunctionDef) -> dict[str, Any]:
    """The names ``fn`` may use, wherever it was defined: its module's globals, the locals of the frame
    defining it (still running when a decorator compiles it), its closure cells and its evaluated annotations.

    NOTE: onnxscript's ``script`` resolves module globals and closure cells only, so a rule written inside a
    function that imports ``op``/``FLOAT`` or defines a constant there failed with "Missing names".
    """
    env = dict(fn.__globals__)
    frame = inspect.currentframe()
    while frame is not None and fn.__code__ not in frame.f_code.co_consts:
        frame = frame.f_back
    if frame is not None:
        env.update(frame.f_locals)
    del frame
    env.update(inspect.getclosurevars(fn).nonlocals)
    annotated = {a.arg: a.annotation for a in [*tree.args.args, *tree.args.kwonlyargs]}
    annotated["return"] = tree.returns
    for key, node in annotated.items():
        if isinstance(node, ast.Name) and node.id not in env and key in getattr(fn, "__annotations__", {}):
            value = fn.__annotations__[key]
            if not isinstance(value, str):
                env[node.id] = value
    return env


def inputs_of(fn: _Fn) -> list[str]:
    """Tensor parameters of an onnxscript function, in order."""
    return [p.name for p in fn.function_ir.inputs]


def attributes_of(fn: _Fn) -> dict[str, Any]:
    """Attribute parameters of an onnxscript function with their defaults (None when required)."""
    sig = inspect.signature(fn.function)
    return {p.name: (None if p.default is inspect.Parameter.empty else p.default)
            for p in sig.parameters.values() if p.name not in inputs_of(fn)}


def _check_attrs(name: str, fn: _Fn, params: Mapping[str, Any]) -> dict[str, Any]:
    known = attributes_of(fn)
    out = {}
    for key, value in params.items():
        if key not in known:
            raise DslError(f"{name}: unknown parameter {key!r}; expected one of {sorted(known)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DslError(f"{name}: parameter {key!r} must be a number, got {value!r}")
        out[key] = value
    return out


@dataclasses.dataclass(frozen=True)
class _Decl:
    name: str
    fn: _Fn
    attrs: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    def __call__(self, **params: Any):
        """A copy of this declaration with new parameter values."""
        return dataclasses.replace(self, attrs=MappingProxyType({**self.attrs, **_check_attrs(self.name, self.fn, params)}))

    def call_attrs(self) -> dict[str, Any]:
        """Attribute values to put on the call node: defaults overridden by the configured ones."""
        merged = {k: v for k, v in attributes_of(self.fn).items() if v is not None}
        merged.update(self.attrs)
        return merged


@dataclasses.dataclass(frozen=True)
class Loss(_Decl):
    """``fn(y, t[, sample_weight])``: a scalar loss, or per-sample losses when ``reduction`` is "mean"/"sum".

    ``grad`` (same inputs) returns dloss/dy; None lets onnxruntime-training derive it. ``target`` is "float"
    (same dtype as the prediction) or "index" (int64 class indices).
    """

    grad: _Fn | None = None
    reduction: str | None = None
    target: str = "float"
    # NOTE: a loss may also give ``elementwise(y, t, c) -> (Σ c·f(y, t), c·∂f/∂y)`` over y and t as (N, K)
    # and per-element weights c: the fuser then emits loss and gradient in ~10 nodes where the builder's
    # derivation of ``fn`` + reduction takes ~25 (one ORT kernel each, every step).
    elementwise: _Fn | None = None
    # NOTE: how ``fn`` treats a sample's K outputs: "mean", "sum", "one" (needs K = 1), or "sample" (one loss
    # from all K: ``elementwise`` then reads y as (N, K), the target as given and c as (N, 1))
    per_output: str = "mean"

    @property
    def weighted(self) -> bool:
        """Whether the loss takes a per-sample weight."""
        return self.reduction is not None or len(inputs_of(self.fn)) == 3


@dataclasses.dataclass(frozen=True)
class Penalty(_Decl):
    """``fn(w)``: a scalar added to the loss for each trained weight; ``grad(w)`` its gradient (None: derived)."""

    grad: _Fn | None = None


@dataclasses.dataclass(frozen=True)
class UpdateRule(_Decl):
    """``fn(w, g, lr, *state[, step]) -> (new_w, *new_state)``; state tensors start at zero, ``step`` is 1-based.

    ``clip_norm`` rescales all gradients together when their global L2 norm exceeds it (torch's
    ``clip_grad_norm_``) before the rule runs.
    """

    state: tuple[str, ...] = ()
    clip_norm: float | None = None

    def __call__(self, clip_norm: float | None = None, **params: Any) -> UpdateRule:
        rule = super().__call__(**params)
        if clip_norm is not None:
            if not clip_norm > 0:
                raise DslError(f"{self.name}: clip_norm must be > 0, got {clip_norm!r}")
            rule = dataclasses.replace(rule, clip_norm=float(clip_norm))
        return rule

    @property
    def uses_step(self) -> bool:
        """Whether the rule reads the step number (Adam's bias correction does)."""
        return inputs_of(self.fn)[-1:] == ["step"]


@dataclasses.dataclass(frozen=True)
class Schedule(_Decl):
    """``fn(step) -> lr``: the learning rate from the 1-based step number, computed inside the graph."""


def _check_inputs(what: str, fn: _Fn, allowed: Sequence[Sequence[str]]) -> None:
    names = inputs_of(fn)
    if not any(len(names) == len(a) for a in allowed):
        shapes = " or ".join(f"({', '.join(a)})" for a in allowed)
        raise DslError(f"{what} {fn.name}: expected tensor inputs {shapes}, got ({', '.join(names)})")


def _n_outputs(fn: _Fn) -> int:
    return len(fn.function_ir.outputs)


def loss(fn=None, *, grad=None, target: str = "float"):
    """Declares a loss ``fn(y, t[, sample_weight]) -> scalar`` (decorator, with or without arguments)."""
    if target not in ("float", "index"):
        raise DslError(f"loss: target must be 'float' or 'index', got {target!r}")

    def wrap(f):
        sf = to_script(f, "loss")
        _check_inputs("loss", sf, [("y", "t"), ("y", "t", "sample_weight")])
        if _n_outputs(sf) != 1:
            raise DslError(f"loss {sf.name}: must return one tensor (the scalar loss), returns {_n_outputs(sf)}")
        g = to_script(grad, f"loss {sf.name} grad") if grad is not None else None
        if g is not None and inputs_of(g) and len(inputs_of(g)) != len(inputs_of(sf)):
            raise DslError(f"loss {sf.name}: grad takes {inputs_of(g)}, expected the loss inputs {inputs_of(sf)}")
        return Loss(sf.name, sf, grad=g, target=target)

    return wrap(fn) if fn is not None else wrap


def penalty(fn=None, *, grad=None):
    """Declares a penalty ``fn(w) -> scalar`` applied to each trained weight."""

    def wrap(f):
        sf = to_script(f, "penalty")
        _check_inputs("penalty", sf, [("w",)])
        return Penalty(sf.name, sf, grad=to_script(grad, f"penalty {sf.name} grad") if grad is not None else None)

    return wrap(fn) if fn is not None else wrap


def update_rule(fn=None, *, state: Sequence[str] = ()):
    """Declares an update rule ``fn(w, g, lr, *state[, step]) -> (new_w, *new_state)``."""
    state = tuple(state)

    def wrap(f):
        sf = to_script(f, "update_rule")
        names = inputs_of(sf)
        expected = ["w", "g", "lr", *state]
        if names[: len(expected)] != expected or names[len(expected):] not in ([], ["step"]):
            raise DslError(
                f"update_rule {sf.name}: expected inputs {expected} (+ optional 'step') from state={list(state)}, "
                f"got {names}"
            )
        if _n_outputs(sf) != 1 + len(state):
            raise DslError(
                f"update_rule {sf.name}: returns {_n_outputs(sf)} tensors, expected {1 + len(state)} "
                f"(the new weight, then one per state {list(state)})"
            )
        return UpdateRule(sf.name, sf, state=state)

    return wrap(fn) if fn is not None else wrap


def schedule(fn):
    """Declares a learning-rate schedule ``fn(step) -> lr``."""
    sf = to_script(fn, "schedule")
    _check_inputs("schedule", sf, [("step",)])
    return Schedule(sf.name, sf)
