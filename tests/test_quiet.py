"""A newcomer's first commands print nothing from onnxruntime and no Python warning (issue 40).

``onnxopt demo``, the README's first Python example and ``onnxopt fit`` run in a subprocess, as a user runs
them (in one, to import once); onnxruntime 1.32 logged one warning per initializer no node reads ("Removing initializer 'val_29'")
for each session. Compiled steps, the epoch model and the Runner's side models hold no such initializer.
"""

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import onnx
import pytest

import onnxopt
from onnxopt import dsl
from onnxopt.examples import mlp
from onnxopt.runner import cpu_model, log_severity

ROOT = pathlib.Path(__file__).resolve().parents[1]
# NOTE: ORT's log lines ("... [W:onnxruntime:, graph.cc:5809 ...]") and Python's warnings ("file:line: XWarning:")
NOISE = re.compile(r"\[[VIWEF]:onnxruntime|onnxruntime.*(Removing initializer|is not used by any node)|"
                   r"\b\w*Warning\b|warnings\.warn")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ONNXOPT_LOG"}
    return {**env, "PYTHONPATH": os.pathsep.join(sys.path)}


FIRST_HOUR = """
import sys
from onnxopt.cli import main

assert main(["demo", "--out", "demo", "--epochs", "2", "--samples", "200", "--features", "10", "--quiet"]) == 0
exec(compile(sys.argv[1], "README.md", "exec"))
assert main(["fit", "model.onnx", "data.csv", "--target", "y", "--epochs", "3", "--update", "adam", "--quiet",
             "-o", "trained.onnx"]) == 0
"""


def test_demo_readme_example_and_fit_print_nothing_from_onnxruntime(tmp_path):
    """One process (imports once) runs what the commands run: ``onnxopt demo``, the README's example, ``fit``."""
    example = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    onnx.save(mlp([4, 8, 1]), tmp_path / "model.onnx")
    X = np.random.default_rng(0).normal(size=(64, 4))
    np.savetxt(tmp_path / "data.csv", np.column_stack([X, X.sum(axis=1)]), delimiter=",", header="a,b,c,d,y",
               comments="")
    run = subprocess.run([sys.executable, "-c", FIRST_HOUR, example], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600, env=_env())
    assert run.returncode == 0, run.stderr
    assert not NOISE.search(run.stderr), run.stderr
    assert "R²" in run.stdout and (tmp_path / "trained.onnx").exists() and (tmp_path / "train_step.onnx").exists()


def _unread(model: onnx.ModelProto) -> list[str]:
    """Initializers of every graph of ``model`` that no node reads and that are no graph input or output."""
    read, graphs, found = set(), [model.graph], []
    while graphs:
        g = graphs.pop()
        for node in g.node:
            read.update(node.input)
            for attr in node.attribute:
                graphs += [*attr.graphs, *([attr.g] if attr.HasField("g") else [])]
        found += [(g.name, t.name) for t in g.initializer]
    return [f"{g}/{t}" for g, t in found if t not in read]


@pytest.mark.parametrize("update", ["sgd", "adam", dsl.updates.nesterov(momentum=0.9)])
def test_steps_epoch_models_and_side_models_hold_no_unread_initializer(update, rng):
    step = onnxopt.compile_train_step(mlp([4, 8, 1]), loss="square", update=update,
                                      penalty=dsl.penalties.l2(1e-4), learning_rate=dsl.schedules.invscaling(0.05))
    assert _unread(step.model) == []
    runner = onnxopt.Runner(step)
    X = rng.normal(size=(64, 4)).astype(np.float32)
    runner.epoch(X, X.sum(axis=1), batch_size=16)
    side = cpu_model(step, 16).side  # NOTE: computes the values that depend on the sample weights alone
    assert runner._epochs.model is not None and side is not None
    for name, model in {"epoch": runner._epochs.model, "side": onnx.load_from_string(side)}.items():
        assert _unread(model) == [], name


def test_onnxopt_log_sets_the_severity_of_onnxopts_sessions(monkeypatch):
    monkeypatch.delenv("ONNXOPT_LOG", raising=False)
    assert log_severity() == 4
    for value, level in [("warning", 2), ("ERROR", 3), ("0", 0)]:
        monkeypatch.setenv("ONNXOPT_LOG", value)
        assert log_severity() == level
        assert onnxopt.runner.default_session_options(10).log_severity_level == level
    monkeypatch.setenv("ONNXOPT_LOG", "loud")
    with pytest.raises(ValueError, match=r"ONNXOPT_LOG: expected one of \['verbose', .*'fatal'\] or 0-4, got 'loud'"):
        log_severity()
