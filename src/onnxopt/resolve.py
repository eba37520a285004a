"""Turning what users pass (a name, "name:k=v", a declaration, a float) into DSL declarations."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from onnxopt.dsl import losses, penalties, schedules, updates
from onnxopt.dsl.core import Loss, Penalty, Schedule, UpdateRule
from onnxopt.errors import DslError

__all__ = ["resolve_loss", "resolve_update", "resolve_penalty", "resolve_schedule", "parse_spec"]

T = TypeVar("T")


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Parses ``"name:k=v,k2=v2"`` (the command line's form) into a name and numeric parameters."""
    name, _, rest = spec.partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, sep, raw = item.partition("=")
        if not sep:
            raise DslError(f"{spec!r}: expected key=value after ':', got {item!r}")
        low = raw.strip().lower()
        if low in ("true", "false"):
            params[key.strip()] = low == "true"
            continue
        try:
            params[key.strip()] = int(raw) if raw.strip().lstrip("-").isdigit() else float(raw)
        except ValueError:
            params[key.strip()] = raw.strip()
    return name.strip(), params


def _resolve(what: str, value: Any, kind: type[T], registry: Mapping[str, Callable[..., T]]) -> T:
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        name, params = parse_spec(value)
        if name not in registry:
            raise DslError(f"{what}: unknown {what} {name!r}; expected one of {sorted(registry)}")
        try:
            return registry[name](**params)
        except TypeError as exc:
            raise DslError(f"{what} {name!r}: {exc}") from exc
    raise DslError(f"{what}: expected a name or a {kind.__name__} declaration, got {type(value).__name__}")


def resolve_loss(value: str | Loss) -> Loss:
    """A loss name (see ``dsl.losses.LOSSES``) or a ``Loss``."""
    return _resolve("loss", value, Loss, losses.LOSSES)


def resolve_update(value: str | UpdateRule) -> UpdateRule:
    """An update-rule name (see ``dsl.updates.UPDATES``) or an ``UpdateRule``."""
    return _resolve("update", value, UpdateRule, updates.UPDATES)


def resolve_penalty(value: str | Penalty | None) -> Penalty | None:
    """None, a penalty name (see ``dsl.penalties.PENALTIES``) or a ``Penalty``."""
    return None if value is None else _resolve("penalty", value, Penalty, penalties.PENALTIES)


def resolve_schedule(value: float | str | Schedule) -> Schedule:
    """A float (constant learning rate), a schedule name or a ``Schedule``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return schedules.constant(float(value))
    return _resolve("learning_rate", value, Schedule, schedules.SCHEDULES)
