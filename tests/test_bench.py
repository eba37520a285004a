"""The benchmark suite: a --quick run writes its page and plot, and competitors train on equal work.

W2 (linear regression, 10 steps an epoch) is run by ``onnxopt.bench.main``; the loss curves it records
for onnxopt and PyTorch eager (same initial weights, same batches, SGD) must agree step by step.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from onnxopt.bench import main
from onnxopt.bench.competitors import Onnxopt
from onnxopt.bench.report import BEGIN, END, write_markdown
from onnxopt.bench.workloads import WORKLOADS, select
from conftest import needs_training_build


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    md = out / "docs" / "benchmarks.md"
    md.parent.mkdir()
    page = f"# Benchmarks\n\nhand-written analysis\n\n{BEGIN}\nold table\n{END}\nmore prose\n"
    md.write_text(page)
    with pytest.raises(SystemExit):  # NOTE: --quick never overwrites a page (issue 28)
        main(["--quick", "--workloads", "W2", "--out-md", str(md)])
    assert md.read_text() == page
    md.unlink()
    assert main(["--quick", "--workloads", "W2", "--out-md", str(md), "--img-dir", str(out / "docs" / "img"),
                 "--out-json", str(out / "results.json")]) == 0
    results = json.loads((out / "results.json").read_text())["results"]
    return md, out / "docs" / "img", {r["competitor"]: r for r in results}


def test_quick_run_writes_page_and_plot(quick_run):
    pytest.importorskip("matplotlib")
    md, img, results = quick_run
    text = md.read_text()
    assert BEGIN in text and END in text
    assert "| W2 | onnxopt | 1 |" in text
    assert "](img/loss_curves.png)" in text
    png = (img / "loss_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 150_000
    onnxopt, per_step = results["onnxopt"], results["onnxopt step()"]
    assert onnxopt["session_runs"] == 0.1 and per_step["session_runs"] == 1  # NOTE: one Loop run an epoch
    assert onnxopt["losses"] == per_step["losses"]  # NOTE: Runner.epoch: the numbers of step(), bit for bit
    # 1 setup epoch + 2 rounds x (1 warm-up + 1 timed) epochs of 10 steps
    assert len(onnxopt["losses"]) == 5 * WORKLOADS["W2"].steps
    assert onnxopt["losses"][-1] < onnxopt["losses"][0] / 2


def test_loss_curves_agree_with_torch(quick_run):
    pytest.importorskip("torch")
    _, _, results = quick_run
    ours, theirs = (np.array(results[name]["losses"]) for name in ("onnxopt", "torch eager"))
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6)


def test_ort_training_and_sklearn_agree(quick_run):
    _, _, results = quick_run
    ours = np.array(results["onnxopt"]["losses"])
    for name in ("ORT on-device", "scikit-learn"):
        if results[name]["skipped"]:
            continue
        theirs = np.array(results[name]["losses"])
        ref = ours if len(theirs) == len(ours) else ours.reshape(len(theirs), -1).mean(axis=1)
        np.testing.assert_allclose(theirs, ref, rtol=1e-4, atol=1e-6, err_msg=name)


def test_markdown_without_markers_is_a_new_page(tmp_path):
    path = tmp_path / "b.md"
    write_markdown(str(path), "table\n")
    assert path.read_text() == f"# Benchmarks\n\n{BEGIN}\ntable\n{END}\n"


def test_select_names_workloads():
    assert [w.name for w in select(["W1"])] == ["W1-sgd", "W1-nesterov", "W1-adam"]
    assert {w.name for w in select(["scaling"])} >= {"batch-1", "batch-4096", "width-16", "width-2048"}
    with pytest.raises(SystemExit):
        main(["--workloads", "W9"])


def test_memory_in_a_fresh_process_and_matmul_references():
    from onnxopt.bench.competitors import REFERENCES
    from onnxopt.bench.memory import fresh_rss
    from onnxopt.bench.timing import run_workload

    assert isinstance(fresh_rss("W2", "onnxopt"), float)
    assert fresh_rss("W2", "no such competitor") is None
    wl = WORKLOADS["W2"]
    results = run_workload(wl, [Onnxopt, *REFERENCES], rounds=2, epochs=1, log=lambda _: None)
    ours, *refs = results
    assert [r.competitor for r in refs] == ["numpy matmul", "ORT MatMul (MLAS)"] and all(r.reference for r in refs)
    assert all(len(r.block_us) == len(r.ref_us) == 2 and r.us_per_step > 0 and not r.losses for r in refs)
    assert len(ours.block_us) == 2 * 3  # NOTE: before the first reference and after each, every round
    assert len(ours.losses) == (1 + 2 * 2) * wl.steps  # NOTE: its extra blocks stay out of the loss curve


@needs_training_build  # NOTE: compares the training build with stock onnxruntime
def test_portable_comparison_says_why_it_skipped(tmp_path, capsys):
    import sys

    from onnxopt.bench.portable import bench_section
    from onnxopt.cli import main as cli

    md = tmp_path / "b.md"
    write_markdown(str(md), "table\n")
    bench_section(["--workloads", "W2", "--out-md", str(md)], None, log=lambda _: None)
    # NOTE: this interpreter's onnxruntime is the training build: nothing to compare with
    bench_section(["--workloads", "W1-sgd", "--out-md", str(md)], sys.executable, log=lambda _: None)
    text = md.read_text()
    assert text.index("Skipped: none of W1-sgd") < text.index(f"Skipped: {sys.executable} has onnxruntime-training")
    assert text.index("expected stock onnxruntime") < text.index(END)
    assert cli(["bench", "--help"]) == 0 and "--portable-python PATH" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["R1", "T1"])
def test_real_model_workloads_train_like_torch(name):
    """R1 (ResNet-style CNN, BatchNorm on batch statistics) and T1 (transformer encoder): onnxopt's step on
    the TorchScript export and torch eager on the module give the same losses over two batches."""
    import dataclasses

    pytest.importorskip("torch")
    from onnxopt.bench.competitors import TorchEager

    wl = dataclasses.replace(WORKLOADS[name], n=2 * WORKLOADS[name].batch)
    assert select([name]) == [WORKLOADS[name]] and wl.arch
    X, y = wl.data()
    losses = []
    for cls in (Onnxopt, TorchEager):
        comp = cls()
        comp.setup(wl, X, y, {})
        losses.append(comp.epoch())
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
