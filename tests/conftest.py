import os
import sys

import numpy as np
import onnxruntime as ort
import pytest

from onnxopt.gradient import has_training_build

ort.set_default_logger_severity(3)

TRAINING_BUILD = has_training_build()
# NOTE: tests that take onnxruntime-training's builder or kernels as the oracle; on Python 3.13+ (stock
# onnxruntime) they skip, and CI runs them in its second environment (.ci/run)
needs_training_build = pytest.mark.skipif(not TRAINING_BUILD, reason="needs onnxruntime-training (Python <= 3.12)")


def pytest_addoption(parser):
    """Without pytest-xdist (a test extra), pyproject's ``-n auto --dist worksteal`` are accepted and ignored: the
    suite then runs in one process, as before, instead of failing on an unknown option."""
    try:
        import xdist  # noqa: F401
    except ImportError:
        group = parser.getgroup("xdist", "pytest-xdist is not installed: these options are ignored")
        group._addoption("-n", dest="numprocesses", default=None, help="ignored (pip install pytest-xdist)")
        group.addoption("--dist", dest="dist", default="no", help="ignored (pip install pytest-xdist)")


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# -- the suite leaves the checkout clean (issue 28) ----------------------------------------------------------
_ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _git_status() -> set[str] | None:
    """``git status --porcelain`` lines of the checkout and the names in its root (ignored files included, such
    as a stray ``*.onnx``), None outside a git checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=_ROOT,
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    skip = ("__pycache__", ".pytest_cache", ".hypothesis", ".venv313", ".venv313.lock")
    return set(out.stdout.splitlines()) | {f"root: {p.name}" for p in _ROOT.iterdir() if p.name not in skip}


def pytest_sessionstart(session):
    if os.environ.get("CI") == "true" and sys.version_info < (3, 13) and not TRAINING_BUILD:
        pytest.exit("CI: below Python 3.13 the suite runs on onnxruntime-training, found stock onnxruntime", 2)
    if getattr(session.config, "workerinput", None) is None:  # NOTE: xdist: the controller alone compares
        session.config._status_before = _git_status()


def pytest_sessionfinish(session, exitstatus):
    """Fails the run when it added or changed files in the checkout (compared with its state at the start)."""
    before = getattr(session.config, "_status_before", None)
    after = _git_status()
    if before is None or after is None or getattr(session.config, "workerinput", None) is not None:
        return
    new = sorted(after - before)
    if new:
        print(f"\nthe test suite changed the checkout ({len(new)} entries of git status): {new[:10]}")
        session.exitstatus = 1


# -- long suites: marked here, deselected by pyproject's addopts, run by `pytest -m "long and not slow"` (.ci/run)
# NOTE: test ids (paths from the root) starting with one of these; the bench runs and the two-rank fits took 4
# of the default run's 18 minutes (serial, shared machine; --durations)
LONG = ("tests/zoo/", "tests/upstream_onnxcustom/", "tests/test_distributed.py", "tests/test_bench.py",
        "tests/test_cli_parquet.py::test_two_workers_")


@pytest.hookimpl(tryfirst=True)  # NOTE: before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(LONG):
            item.add_marker(pytest.mark.long)


# NOTE: scripts other processes run (one rank, the 3.13 environment's side): not test modules to import
collect_ignore = ["distributed_worker.py", "portable_worker.py"]
