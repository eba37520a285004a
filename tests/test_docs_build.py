"""The documentation site builds with MkDocs in strict mode: no broken link, no page missing from the nav."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "tutorials" / "mlp_nesterov" / "index.html").exists()
    assert (tmp_path / "site" / "img" / "linear_regression_step.svg").exists()
