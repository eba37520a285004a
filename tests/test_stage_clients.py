"""Each client of the compiler runs a part of ``fuse.STAGES`` (``stages.recorded`` lists the stages run): the list
is the one place the order lives (docs/fused_step.md, "Stages")."""

from __future__ import annotations

import numpy as np
import pytest

import onnxopt
from onnxopt.examples import linear_regression, mlp
from onnxopt.fuse import STAGES, run_part
from onnxopt.stages import CompileState, Stage, StageError, recorded, run_stages

ORDER = [s.name for s in STAGES]


def _in_order(names: list[str]) -> bool:
    """``names`` is a subsequence of ``ORDER``: each stage once, in the list's order."""
    return [n for n in ORDER if n in names] == names


def test_recorded_lists_the_stages_run_in_order():
    stages = [Stage("a", lambda s: setattr(s, "x", 1), (), ("x",)),
              Stage("b", lambda s: setattr(s, "y", 1), ("x",), ("y",))]
    with recorded() as outer:
        run_stages(stages, CompileState())
        with recorded() as inner:
            run_stages(stages[:1], CompileState())
    assert outer == ["a", "b", "a"] and inner == ["a"]
    with recorded() as after:
        pass
    assert after == []
    assert not _in_order(["tie", "load"]) and not _in_order(["load", "load"]) and _in_order(["load", "weights"])


def test_compile_train_step_runs_the_whole_list():
    with recorded() as names:
        onnxopt.compile_train_step(mlp([4, 3, 2], seed=0), loss="cross_entropy", update="adam")
    assert names == ORDER


def test_grad_runs_load_and_modes():
    with recorded() as names:
        onnxopt.grad(linear_regression(3), ["coef"])
    assert names == ["load", "modes"] and _in_order(names)


@pytest.mark.parametrize("gradient", ["onnxopt", pytest.param("builder", marks=pytest.mark.skipif(
    not onnxopt.gradient.has_training_build(), reason="needs onnxruntime-training"))])
def test_partial_training_runs_load_tie_and_weights(gradient):
    with recorded() as names:
        fb = onnxopt.ForwardBackward(mlp([4, 3, 2], seed=0), gradient=gradient)
    assert names == ["load", "tie", "weights"] and _in_order(names)
    out = fb.forward(np.ones((2, 4), np.float32))
    assert set(fb.backward(np.ones_like(out[0]))) == {"X", *fb.weight_names}


def test_ort_training_artifacts_run_the_load_stage(tmp_path):
    from onnxopt.compat.onnxruntime_training import artifacts

    model = mlp([4, 3, 2], seed=0)
    with recorded() as names:
        artifacts.generate_artifacts(model, requires_grad=[i.name for i in model.graph.initializer],
                                     loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.AdamW,
                                     artifact_directory=tmp_path)
    assert names == ["load"]
    assert (tmp_path / "training_model.onnx").exists()


def test_onnxcustom_estimator_runs_load_weights_then_the_whole_list():
    pytest.importorskip("sklearn")
    from onnxopt.compat import OrtGradientForwardBackwardOptimizer

    rng = np.random.default_rng(0)
    X = rng.normal(size=(20, 3)).astype(np.float32)
    y = X @ np.array([1.0, -2.0, 0.5], np.float32)
    est = OrtGradientForwardBackwardOptimizer(linear_regression(3), max_iter=1, learning_rate=1e-3)
    with recorded() as names:
        est.fit(X, y)
    assert names[:2] == ["load", "weights"] and names[2:] == ORDER


def test_run_part_refuses_an_unknown_stage_and_a_missing_need():
    with pytest.raises(StageError, match=r"only: \['nope'\] are not stages"):
        run_part(mlp([2, 1], seed=0), ("load", "nope"))
    with pytest.raises(StageError, match=r"stage 'weights' needs \['stats'\], left by stage\(s\) \['modes'\]"):
        run_part(mlp([2, 1], seed=0), ("load", "weights"))
