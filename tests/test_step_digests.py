"""Every quick case of ``tests/data/make_step_digests.py`` compiles to the step stored in ``step_digests.json``.

The digests were taken before ``compile_train_step`` became stages (issue 41): a difference names the step and
what changed (inputs, outputs, op counts, initializers). The quick cases are the benchmark MLPs (W1-W5), a few
option combinations, the skl2onnx zoo and the TorchScript exports of the torch zoo (~20 s); ``python
tests/data/make_step_digests.py --check`` compares the rest too (dynamo exports, R1, T1: minutes). After an
intended change: ``PYTHONPATH=src python tests/data/make_step_digests.py`` rewrites the file.
"""

from __future__ import annotations

import json

import pytest

from data import make_step_digests as digests

STORED = json.loads(digests.OUT.read_text())


def test_digest_sees_a_change():
    """The digest is not blind: other initial weights change the initializers, another rule the nodes."""
    import onnxopt
    from onnxopt.examples import mlp

    base = digests.digest(onnxopt.compile_train_step(mlp([4, 3, 1], seed=0), learning_rate=0.1))
    seed = digests.digest(onnxopt.compile_train_step(mlp([4, 3, 1], seed=1), learning_rate=0.1))
    rule = digests.digest(onnxopt.compile_train_step(mlp([4, 3, 1], seed=0), learning_rate=0.1, update="momentum"))
    assert digests.compare(base, base) == []
    assert [line.split(":")[0] for line in digests.compare(base, seed)] == ["initializers"]
    assert {line.split(":")[0] for line in digests.compare(base, rule)} >= {"inputs", "nodes"}


def test_quick_steps_unchanged():
    stored_versions, here = STORED["versions"], digests.versions()
    other = {k: (v, here.get(k)) for k, v in stored_versions.items() if here.get(k) != v}
    if other:
        pytest.skip(f"the digests were taken with other versions {other}: regenerate them with "
                    f"tests/data/make_step_digests.py")
    got = digests.build_all(quick=True)
    missing = sorted(set(got) - set(STORED["steps"]))
    assert not missing, f"cases without a stored digest (regenerate the file): {missing}"
    bad = {name: digests.compare(STORED["steps"][name], d) for name, d in got.items()}
    bad = {name: lines for name, lines in bad.items() if lines}
    assert not bad, "compiled steps differ from the stored digests:\n" + "\n".join(
        f"{name}:\n  " + "\n  ".join(lines) for name, lines in bad.items())
    assert len(got) >= 60
