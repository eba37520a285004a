"""Per-step digests of compiled training steps: the zoo's models and the benchmark workloads.

A refactoring of the compiler (issue 41: ``compile_train_step`` as stages) must leave every compiled step the same
graph. This script compiles each case and writes, per step, hashes of its node list (op type, domain, attributes,
input and output names, in order), of its initializers (names and values), its graph inputs and outputs and its
protocol (``onnxopt.protocol.describe``), to ``tests/data/step_digests.json``; ``tests/test_step_digests.py``
recompiles the quick cases and compares. An intended change regenerates the file in one command::

    PYTHONPATH=src python tests/data/make_step_digests.py            # all cases (torch exports: a few minutes)
    PYTHONPATH=src python tests/data/make_step_digests.py --check    # compares all cases, writes nothing

Digests depend on the exporters' and optimizers' versions: the file records them, the test skips elsewhere.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
import time
import warnings

import numpy as np
import onnx
import onnx.numpy_helper

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # NOTE: the zoo's model builders (tests/zoo)
OUT = HERE / "step_digests.json"
VERSIONED = ("onnx", "onnx_ir", "onnxscript", "onnxruntime", "torch", "skl2onnx", "numpy")


def versions() -> dict[str, str]:
    import importlib

    out = {"python": "%d.%d" % sys.version_info[:2]}
    for name in VERSIONED:
        try:
            out[name] = importlib.import_module(name).__version__
        except ImportError:
            out[name] = None
    return out


def _h(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


def _attribute(a: onnx.AttributeProto) -> str:
    return str(a)  # NOTE: protobuf's text format, subgraphs (Scan, If bodies) included whole


def digest(step) -> dict:
    """The digest of a ``TrainStep``: hashes of its nodes, initializers and protocol, and what a reader of a
    difference needs (op counts, input and output names, each initializer's hash)."""
    from onnxopt.protocol import describe

    g = step.model.graph
    nodes = [[n.op_type, n.domain, list(n.input), list(n.output), sorted(_attribute(a) for a in n.attribute)]
             for n in g.node]
    inits = {t.name: _h(np.ascontiguousarray(onnx.numpy_helper.to_array(t)).tobytes()
                        + str((t.data_type, list(t.dims))).encode()) for t in g.initializer}
    ops: dict[str, int] = {}
    for n in g.node:
        key = f"{n.domain}::{n.op_type}" if n.domain else n.op_type
        ops[key] = ops.get(key, 0) + 1
    return {"nodes": _h(json.dumps(nodes).encode()), "n_nodes": len(g.node), "ops": dict(sorted(ops.items())),
            "initializers": dict(sorted(inits.items())),
            "inputs": [i.name for i in g.input], "outputs": [o.name for o in g.output],
            "protocol": _h(json.dumps(describe(step), sort_keys=True).encode()),
            "functions": len(step.model.functions), "ir_version": step.model.ir_version,
            "opsets": sorted(f"{o.domain}:{o.version}" for o in step.model.opset_import)}


def compare(want: dict, got: dict) -> list[str]:
    """How ``got`` differs from ``want``, one line per part (empty when equal)."""
    out = []
    for key in ("inputs", "outputs", "protocol", "functions", "ir_version", "opsets"):
        if want[key] != got[key]:
            out.append(f"{key}: {want[key]} -> {got[key]}")
    if want["nodes"] != got["nodes"]:
        ops = {k: (want["ops"].get(k, 0), got["ops"].get(k, 0)) for k in {*want["ops"], *got["ops"]}}
        changed = {k: f"{a}->{b}" for k, (a, b) in sorted(ops.items()) if a != b}
        out.append(f"nodes: {want['n_nodes']} -> {got['n_nodes']}, op counts changed {changed or 'none'} "
                   f"(else order, attributes or names)")
    if want["initializers"] != got["initializers"]:
        w, g = want["initializers"], got["initializers"]
        out.append(f"initializers: removed {sorted(set(w) - set(g))[:8]}, added {sorted(set(g) - set(w))[:8]}, "
                   f"values changed {sorted(k for k in set(w) & set(g) if w[k] != g[k])[:8]}")
    return out


# -- the cases --------------------------------------------------------------------------------------------------

def _quiet(fn):
    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn()
    return run


def _workload_cases(quick: bool) -> dict:
    from onnxopt.bench.workloads import WORKLOADS

    def case(w):
        def build():
            import onnxopt

            return onnxopt.compile_train_step(w.model(), loss=w.loss, update=w.update, learning_rate=w.lr)
        return build

    names = ["W1-sgd", "W1-nesterov", "W1-adam", "W2", "W3", "W4", "W5"] + ([] if quick else ["R1", "T1"])
    return {f"bench/{n}": case(WORKLOADS[n]) for n in names}


def _extra_cases() -> dict:
    """Options the workloads do not take: a penalty, clipping, a schedule, frozen weights, loss=None."""
    import onnxopt
    from onnxopt import dsl
    from onnxopt.examples import mlp

    def build(**kw):
        return lambda: onnxopt.compile_train_step(mlp([6, 5, 3], seed=1), **kw)

    return {
        "options/penalty-adam-schedule": build(loss="cross_entropy", update="adam", penalty="l2",
                                               learning_rate=dsl.schedules.cosine(0.1, 100)),
        "options/clip-frozen-fixed-rows": build(loss=dsl.losses.square(), update=dsl.updates.sgd(clip_norm=1.0),
                                                frozen=["bias_1"], fixed_rows={"coef_0": [0, 2]},
                                                learning_rate=dsl.schedules.step(0.1, 10, 0.5)),
        "options/external-grad": build(loss=None, external_grad=True),
        "options/portable-momentum": build(update="momentum", portable=True),
    }


def _torch_cases(quick: bool) -> dict:
    try:
        import torch  # noqa: F401
    except ImportError:
        return {}
    import onnxopt
    from zoo import models, models_more

    def case(module, name, exporter, mode, **kw):
        def build():
            return onnxopt.compile_train_step(module.exported(name, exporter), mode=mode,
                                              loss=module.loss_name(name), **kw)
        return build

    out = {}
    exporters = ["script"] if quick else models.EXPORTERS
    for name, spec in models.TORCH_MODELS.items():
        for exporter in exporters + (["script_train"] if spec.stateful else []):
            out[f"torch/{name}-{exporter}/eval"] = case(models, name, exporter, "eval")
            if spec.stateful:
                out[f"torch/{name}-{exporter}/train"] = case(models, name, exporter, "train")
    out["torch/mlp_batchnorm-script_train/adam"] = case(models, "mlp_batchnorm", "script_train", "train",
                                                        update="adam")
    from zoo.test_more_exports import CASES as MORE_CASES, _mode

    for name, exporter in MORE_CASES:  # NOTE: the exporters test_more_exports runs (some export with one only)
        if exporter == "script" or exporter == "script_train" or not quick:
            out[f"more/{name}-{exporter}/{_mode(exporter)}"] = case(models_more, name, exporter, _mode(exporter))
    return out


def _sklearn_cases() -> dict:
    try:
        import skl2onnx  # noqa: F401
        import sklearn  # noqa: F401
    except ImportError:
        return {}
    import onnxopt
    from zoo import test_sklearn_zoo as sk

    def case(name, dtype):
        def build():
            model = sk.converted(name, dtype)
            return onnxopt.compile_train_step(model, loss=sk._loss(name), output=sk._output(model), mode="eval")
        return build

    return {f"sklearn/{name}-{np.dtype(d).name}": case(name, d) for name in sk.CASES for d in (np.float32, np.float64)}


def cases(quick: bool) -> dict:
    """name -> a function compiling the step; ``quick``: the subset the test recompiles (no dynamo exports)."""
    return {**_workload_cases(quick), **_extra_cases(), **_sklearn_cases(), **_torch_cases(quick)}


def build_all(names=None, quick: bool = False, log=None) -> dict[str, dict]:
    out = {}
    for name, fn in cases(quick).items():
        if names is not None and name not in names:
            continue
        start = time.perf_counter()
        out[name] = digest(_quiet(fn)())
        if log:
            log(f"{time.perf_counter() - start:6.2f}s {name}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the stored digests, write nothing")
    args = parser.parse_args(argv)
    got = build_all(log=lambda s: print(s, file=sys.stderr))
    if args.check:
        stored = json.loads(OUT.read_text())["steps"]
        bad = {n: compare(stored[n], d) for n, d in got.items() if n in stored and compare(stored[n], d)}
        for n, lines in bad.items():
            print(n, *lines, sep="\n  ")
        print(f"{len(got)} steps, {len(bad)} differ, {len(set(stored) - set(got))} stored not built")
        return 1 if bad else 0
    lines = [f" {json.dumps(name)}: {json.dumps(got[name], sort_keys=True)}" for name in sorted(got)]
    OUT.write_text(f'{{"versions": {json.dumps(versions(), sort_keys=True)},\n"steps": {{\n' + ",\n".join(lines)
                   + "\n}}\n")  # NOTE: one line per step: a regenerated file diffs by step
    print(f"wrote {len(got)} digests to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
