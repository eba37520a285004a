"""compile_train_step as a list of named stages (``fuse.STAGES``, ``stages.run_stages``): order checked by the state,
prefixes, ``--explain``."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import onnxopt
from onnxopt.examples import mlp
from onnxopt.fuse import STAGES, _options, explain_train_step
from onnxopt.stages import CompileState, Stage, StageError, format_report, run_stages


def _state(**kwargs) -> CompileState:
    defaults = dict(model=mlp([4, 3, 2], seed=0), loss="cross_entropy", update="adam", penalty=None,
                    learning_rate=0.01, weights=None, output=None, loss_output=None, external_grad=False,
                    mode="train", frozen=None, portable=False, tie=True, fixed_rows=None, gradient=None)
    return _options({**defaults, **kwargs})


def test_stage_list_is_data():
    names = [s.name for s in STAGES]
    assert names[:2] == ["load", "tie"] and names[-1] == "package"
    assert {"differentiate", "loss", "penalty", "clip", "schedule", "update", "lower", "finish", "optimize"} <= set(names)
    assert len(set(names)) == len(names)
    for s in STAGES:  # NOTE: every stage says what it does, needs and leaves
        assert s.summary and "Needs" in s.fn.__doc__ and "leaves" in s.fn.__doc__, s.name
    made = set(_state().__dict__["_values"])
    for s in STAGES:  # NOTE: in the order given, every need was left before (the list is consistent)
        assert set(s.needs) <= made, (s.name, set(s.needs) - made)
        made |= set(s.leaves)


def test_a_stage_out_of_order_names_what_it_lacks():
    by_name = {s.name: s for s in STAGES}
    order = [s for s in STAGES if s.name != "penalty"]
    order.insert(order.index(by_name["update"]) + 1, by_name["penalty"])  # NOTE: clip before penalty
    with pytest.raises(StageError, match=r"stage 'clip' needs \['penalized'\], left by stage\(s\) \['penalty'\]"):
        run_stages(order, _state())
    with pytest.raises(StageError, match=r"stage 'finish' needs \['lowered'\]"):
        run_stages([s for s in STAGES if s.name != "lower"], _state())


def test_reading_a_value_no_stage_left():
    state = _state()
    with pytest.raises(StageError, match=r"reads 'fused', which no earlier stage left"):
        state.fused
    broken = Stage("broken", lambda s: None, (), ("never",))
    with pytest.raises(StageError, match=r"stage 'broken' did not leave \['never'\]"):
        run_stages([broken], state)


def test_prefix_stops_after_the_named_stage():
    state = run_stages(STAGES, _state(), until="differentiate")
    assert "fused" in state and "grads" in state and "step" not in state
    assert [g.name for g in state.grads] == [n + "_grad" for n in state.names]
    with pytest.raises(StageError, match=r"until: 'nope' is not a stage"):
        run_stages(STAGES, _state(), until="nope")


def test_explain_reports_each_stage_and_the_same_step():
    model = mlp([4, 3, 2], seed=0)
    step, report = explain_train_step(model, loss="cross_entropy", update="adam", mode="train")
    plain = onnxopt.compile_train_step(model, loss="cross_entropy", update="adam", mode="train")
    assert step.model.SerializeToString() == plain.model.SerializeToString()
    assert [r.name for r in report] == [s.name for s in STAGES]
    assert report[-1].nodes == len(step.model.graph.node)
    assert report[0].nodes == report[0].added == len(model.graph.node)
    for before, after in zip(report, report[1:]):
        if after.name != "differentiate":  # NOTE: a new model: every forward node is copied
            assert after.nodes == before.nodes + after.added - after.removed, after.name
    assert next(r for r in report if r.name == "update").added > 0
    text = format_report(report)
    assert text.splitlines()[0].split()[:4] == ["stage", "nodes", "added", "removed"]
    assert all(s.name in text for s in STAGES)


def test_cli_explain(tmp_path, capsys):
    from onnxopt.cli import main

    onnx.save(mlp([4, 3, 1], seed=0), tmp_path / "m.onnx")
    assert main(["compile", str(tmp_path / "m.onnx"), "--loss", "square", "--explain", "-o",
                 str(tmp_path / "s.onnx")]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines()[1:len(STAGES) + 1]]
    assert rows == [s.name for s in STAGES]
    step = onnxopt.TrainStep.load(tmp_path / "s.onnx")
    runner = onnxopt.Runner(step)
    assert np.isfinite(runner.step(np.ones((2, 4), np.float32), np.ones((2, 1), np.float32)))
