"""Test helpers: run a fused step once with a plain InferenceSession, zero optimizer state."""

from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort

ort.set_default_logger_severity(3)


def importorskip(name: str):
    """``pytest.importorskip``, except under CI=true, where a missing or broken [test] dependency fails the run
    instead of turning its tests into skips (as tests/test_portable.py does for Python 3.13)."""
    import importlib
    import os

    import pytest

    if os.environ.get("CI") == "true":
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            pytest.fail(f"{name}: a [test] dependency does not import under CI=true ({exc})", pytrace=False)
    return pytest.importorskip(name)


# NOTE: the peak RSS of the process running it (VmHWM); ru_maxrss would start from the parent's, kept across fork
# and exec. A script run by ``run_script`` defines ``peak()`` with it.
PEAK = 'peak = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024'


def run_script(script: str, *args: str) -> str:
    """Runs ``script`` (after ``PEAK``) in a fresh Python with this test run's import path; returns its stdout."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", PEAK + "\n" + script, *args], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def session(model) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"],
                                disabled_optimizers=["EliminateDropout"])  # NOTE: as the Runner (runner.KEEP_DROPOUT)


def run_once(step, X, y, sample_weight=None, weights=None, state=None, step_count=0) -> dict[str, np.ndarray]:
    """One run of ``step.model``: returns every output by name (weights default to the model's)."""
    sess = session(step.model)
    weights = weights if weights is not None else step.initial_weights()
    feeds = {step.inputs[0]: X, **weights, **step.initial_buffers()}  # NOTE: running statistics: the model's
    if step.target:
        feeds[step.target] = y
    if step.sample_weight:
        dtype = next(iter(weights.values())).dtype
        feeds[step.sample_weight] = np.ones(len(X), dtype) if sample_weight is None else sample_weight
    for name in [*step.buffers, *step.state]:
        if name in step.buffers:
            feeds[name] = (state or {}).get(name, feeds[name])
        elif name == "optim.step":
            feeds[name] = np.array(step_count, np.int64)
        else:
            w = weights[name.rsplit(".", 1)[0]]
            feeds[name] = (state or {}).get(name, np.zeros_like(w))
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def cosine_ref(t: float, eta0: float, total: float, warmup: float, eta_min: float) -> float:
    """NumPy reference of dsl.schedules.cosine at the 1-based step t."""
    if t <= warmup:
        return eta0 * t / max(warmup, 1)
    frac = min((t - 1 - warmup) / max(total - warmup, 1), 1.0)  # torch's T_cur: 0 on the first step
    return eta_min + (eta0 - eta_min) * (1 + math.cos(math.pi * frac)) / 2


def count_runs(runner, monkeypatch) -> list:
    """Patches ``runner`` so that every session run (any of its sessions) appends to the returned list."""
    runs = []
    run = runner._run  # NOTE: every run of the runner's sessions goes through it

    def counting(*args):
        runs.append(1)
        return run(*args)

    monkeypatch.setattr(runner, "_run", counting)
    return runs


def under_reference(model, batches, rtol, atol=None, **kwargs):
    """Trains the portable step under onnx.reference and the training build's step on ``batches``: the same
    losses (``rtol``) and weights (10·``rtol``, ``atol`` or 10·``rtol``)."""
    from onnx.reference import ReferenceEvaluator

    import onnxopt

    plain, portable = (onnxopt.compile_train_step(model, portable=p, **kwargs) for p in (False, True))
    evaluator = ReferenceEvaluator(portable.model)
    runner = onnxopt.Runner(plain)
    feeds = {**portable.initial_weights(), **{s: np.zeros_like(portable.initial_weights()[s.rsplit(".", 1)[0]])
                                            for s in portable.state if s != "optim.step"},
             "optim.step": np.array(0, np.int64)}
    names = [o.name for o in portable.model.graph.output]
    for X, y in batches:
        weights = {portable.sample_weight: np.ones(len(X), X.dtype)} if portable.sample_weight else {}
        out = dict(zip(names, evaluator.run(None, {**feeds, portable.inputs[0]: X, portable.target: y, **weights})))
        np.testing.assert_allclose(out["loss"], runner.step(X, y), rtol=rtol)
        feeds = {name: out[name + ".new"] for name in [*portable.weights, *portable.state]}
    for name, value in runner.get_weights().items():
        np.testing.assert_allclose(feeds[name], value, rtol=10 * rtol, atol=10 * rtol if atol is None else atol)


def finite_differences(fn, params: dict[str, np.ndarray], names, eps=1e-6) -> dict[str, np.ndarray]:
    """Central differences of the scalar ``fn(params)`` with respect to each array ``params[name]``."""
    grads = {}
    for name in names:
        base = params[name]
        g = np.zeros_like(base)
        for idx in np.ndindex(base.shape):
            plus, minus = base.copy(), base.copy()
            plus[idx] += eps
            minus[idx] -= eps
            g[idx] = (fn({**params, name: plus}) - fn({**params, name: minus})) / (2 * eps)
        grads[name] = g
    return grads
