"""Named compile stages over one state: the compiler's order as data (``fuse.STAGES``), checked as it runs.

A stage is a function of a ``CompileState`` that reads the values it ``needs`` and sets the values it ``leaves``
(``Stage``); ``run_stages`` runs a list of them, refusing a stage whose needs no earlier stage left (a
``StageError`` naming the stage, the value and who makes it) and one that did not leave what it promised. The
same list runs whole (``compile_train_step``), as a prefix (``until=``) or explained (``onnxopt compile
--explain``: each stage's nodes added and removed, and its time). Like onnx-ir's passes run by a PassManager.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Collection, Iterator, Sequence

import onnx_ir as ir

from onnxopt.errors import OnnxoptError

__all__ = ["Stage", "CompileState", "StageError", "StageReport", "run_stages", "format_report", "recorded"]

_RECORDERS: list[list[str]] = []


@contextlib.contextmanager
def recorded() -> Iterator[list[str]]:
    """The names of the stages every ``run_stages`` runs inside the ``with`` block, in order: which part of the
    list a client (``grad``, partial training, a facade) runs."""
    names: list[str] = []
    _RECORDERS.append(names)
    try:
        yield names
    finally:
        _RECORDERS.remove(names)


class StageError(OnnxoptError, RuntimeError):
    """A stage list in an impossible order: a stage needs a value no earlier stage left."""


@dataclasses.dataclass(frozen=True)
class Stage:
    """One named step of a compilation: ``fn(state)`` reads ``needs`` and sets ``leaves``."""

    name: str
    fn: Callable[[CompileState], None]
    needs: tuple[str, ...] = ()
    leaves: tuple[str, ...] = ()

    @property
    def summary(self) -> str:
        """The first line of the stage function's docstring."""
        return (self.fn.__doc__ or "").strip().splitlines()[0] if self.fn.__doc__ else ""


class CompileState:
    """The options of one compilation and the values its stages leave, read as attributes.

    Reading a value no stage has left raises ``StageError``, so a stage run too early says what it lacks.
    """

    def __init__(self, **options):
        self.__dict__["_values"] = dict(options)
        self.__dict__["_stage"] = None

    def __getattr__(self, name: str):
        values = self.__dict__["_values"]
        if name in values:
            return values[name]
        if name.startswith("__"):
            raise AttributeError(name)
        stage = self.__dict__["_stage"]
        raise StageError(f"stage {stage!r} reads {name!r}, which no earlier stage left; expected one of "
                         f"{sorted(values)}")

    def __setattr__(self, name: str, value) -> None:
        self.__dict__["_values"][name] = value

    def __contains__(self, name: str) -> bool:
        return name in self.__dict__["_values"]

    def graph_model(self) -> ir.Model | None:
        """The model the stages are rewriting now: the fused step once differentiated, the input model before."""
        values = self.__dict__["_values"]
        model = values.get("fused", values.get("model"))
        return model if isinstance(model, ir.Model) else None


@dataclasses.dataclass
class StageReport:
    """What one stage did: nodes of the model it left, added and removed (top graph), and its time."""

    name: str
    nodes: int
    added: int
    removed: int
    seconds: float
    summary: str


def _node_ids(state: CompileState) -> set[int]:
    model = state.graph_model()
    return set() if model is None else {id(n) for n in model.graph}


def run_stages(stages: Sequence[Stage], state: CompileState, until: str | None = None,
               report: list[StageReport] | None = None, only: Collection[str] | None = None) -> CompileState:
    """Runs ``stages`` in order on ``state`` (up to and including the stage named ``until``; when ``only`` is given,
    those it names: a client's part of the list); appends a ``StageReport`` per stage to ``report`` when given
    (counting nodes costs a set per stage)."""
    names = [s.name for s in stages]
    if until is not None and until not in names:
        raise StageError(f"until: {until!r} is not a stage (expected one of {names})")
    if only is not None and set(only) - set(names):
        raise StageError(f"only: {sorted(set(only) - set(names))} are not stages (expected some of {names})")
    made_by = {name: s.name for s in stages for name in s.leaves}
    for stage in stages if only is None else [s for s in stages if s.name in only]:
        missing = [n for n in stage.needs if n not in state]
        if missing:
            raise StageError(f"stage {stage.name!r} needs {missing}, left by stage(s) "
                             f"{[made_by.get(n, '(none)') for n in missing]} which did not run before it")
        before = _node_ids(state) if report is not None else None
        state.__dict__["_stage"] = stage.name
        start = time.perf_counter()
        stage.fn(state)
        seconds = time.perf_counter() - start
        for recorder in _RECORDERS:
            recorder.append(stage.name)
        unmade = [n for n in stage.leaves if n not in state]
        if unmade:
            raise StageError(f"stage {stage.name!r} did not leave {unmade}")
        if report is not None:
            after = _node_ids(state)
            report.append(StageReport(stage.name, len(after), len(after - before), len(before - after), seconds,
                                      stage.summary))
        if stage.name == until:
            break
    state.__dict__["_stage"] = None
    return state


def format_report(report: Sequence[StageReport]) -> str:
    """The table ``onnxopt compile --explain`` prints: one row per stage."""
    rows = [f"{'stage':<14}{'nodes':>7}{'added':>8}{'removed':>9}{'ms':>9}  what"]
    for r in report:
        rows.append(f"{r.name:<14}{r.nodes:>7}{'+' + str(r.added):>8}{'-' + str(r.removed):>9}"
                    f"{r.seconds * 1e3:>9.1f}  {r.summary}")
    rows.append(f"{'total':<14}{'':>24}{sum(r.seconds for r in report) * 1e3:>9.1f}")
    return "\n".join(rows)
