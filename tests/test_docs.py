"""Every ```python block of README.md and docs/**/*.md runs, page by page, so the docs cannot rot."""

import pathlib
import re
import runpy

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_code_blocks_run(page, tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    # NOTE: onnxscript reads a function's source with inspect, so the blocks run from a real file.
    script = tmp_path / f"docs_{page.stem}.py"
    script.write_text("\n".join(blocks))
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(script), run_name="__docs__")
