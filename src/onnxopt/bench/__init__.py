"""``onnxopt bench``: onnxopt's fused step against PyTorch (eager, compile), ORT on-device training and
scikit-learn, on the same data, model and initial weights, timed in rounds within one process.

``main(argv)`` runs the workloads, prints progress, and writes the markdown tables and PNG plots.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import time

from onnxopt import atomic

__all__ = ["main", "run"]

DEFAULT_WORKLOADS = ["W1", "W2", "W3", "W4", "W5", "R1", "T1", "scaling"]
COMPUTE_BOUND = ("W3", "W5")
QUICK = "--quick, not a measurement"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="onnxopt bench", description=(
        "Time onnxopt's fused training step against PyTorch (eager, torch.compile), ORT on-device training "
        "and scikit-learn on the same data, model and initial weights; write a markdown page and PNG plots."))
    p.add_argument("--workloads", nargs="+", default=DEFAULT_WORKLOADS, metavar="NAME",
                   help="W1 (its 3 optimizers), W1-sgd, W1-nesterov, W1-adam, W2, W3, W4, W5, R1 (ResNet-style CNN), "
                        "T1 (transformer encoder), scaling, batch-<B>, width-<w>")
    p.add_argument("--quick", action="store_true",
                   help="2 rounds of 1 epoch, no torch.compile: a smoke run, not a measurement")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed blocks per competitor (default 5; 2 with --quick)")
    p.add_argument("--out-md", default=None,
                   help="markdown page (default onnxopt-bench/benchmarks.md, with --quick benchmarks-quick.md); only "
                        "the part between its bench markers is replaced; --quick never replaces a page of "
                        "measurements (docs/benchmarks.md is the repository's)")
    p.add_argument("--img-dir", default=os.path.join("onnxopt-bench", "img"),
                   help="folder for loss_curves.png and scaling.png (docs/img is the repository's)")
    p.add_argument("--out-json", default=None, help="also write every result (with loss curves) as JSON")
    p.add_argument("--portable-python", default=None, metavar="PATH",
                   help="Python 3.13+ with stock onnxruntime (default: .venv313/bin/python): time the portable "
                        "step there against the training build's on W1 and W3")
    return p


def run(workloads, quick: bool = False, rounds: int | None = None, log=print):
    """Times every competitor on ``workloads``.

    Returns the results (with a plain matmul of the biggest layer, numpy's and ORT's, timed in the same rounds
    on the compute-bound workloads) and, unless ``quick``, the fresh-process memory (MB) of onnxopt, ORT
    on-device and torch eager on them.
    """
    from onnxopt.bench import competitors as c
    from onnxopt.bench.memory import fresh_rss
    from onnxopt.bench.report import MEMORY_COMPETITORS
    from onnxopt.bench.timing import run_workload

    rounds = rounds or (2 if quick else 5)
    results, memory = [], {}
    for wl in workloads:
        if wl.name.startswith(("batch-", "width-")):
            comps = [c.Onnxopt, c.TorchEager]
        else:
            comps = [x for x in c.COMPETITORS if not (quick and x is c.TorchCompile)]
            comps += c.REFERENCES if wl.name.startswith(COMPUTE_BOUND) else []
        t0 = time.perf_counter()
        log(f"{wl.name} ({wl.title}): {wl.arch or 'sizes'} {wl.sizes}, batch {wl.batch}, {wl.n} samples, {wl.update}")
        res = run_workload(wl, comps, rounds, epochs=1 if quick else None, log=log)
        if quick and c.TorchCompile in c.COMPETITORS and not wl.name.startswith(("batch-", "width-")):
            from onnxopt.bench.timing import Result

            res.insert(2, Result(wl.name, c.TorchCompile.name, skipped="--quick (compiling takes ~30 s)"))
        results += res
        if wl.name.startswith(COMPUTE_BOUND) and not quick:
            memory[wl.name] = {c: _median([fresh_rss(wl.name, c) for _ in range(3)]) for c in MEMORY_COMPETITORS}
        log(f"  ({time.perf_counter() - t0:.0f} s)")
    return results, memory


def _median(values):
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``onnxopt bench`` and ``benchmarks/run.py``."""
    from onnxopt.bench import report
    from onnxopt.bench.workloads import select
    from onnxopt.errors import DataError

    import onnxruntime

    onnxruntime.set_default_logger_severity(3)  # NOTE: generate_artifacts logs ~140 INFO lines otherwise
    parser = _parser()
    args = parser.parse_args(argv)
    if args.out_md is None:
        args.out_md = os.path.join("onnxopt-bench", "benchmarks-quick.md" if args.quick else "benchmarks.md")
    if args.quick and os.path.exists(args.out_md) and QUICK not in open(args.out_md, encoding="utf-8").read():
        parser.error(f"--out-md: --quick never overwrites a page of measurements, and {args.out_md!r} is one; "
                     "pass another --out-md")
    try:
        workloads = select(args.workloads)
    except DataError as exc:
        parser.error(str(exc))
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds: expected a positive integer, got {args.rounds}")
    t0 = time.perf_counter()
    results, memory = run(workloads, quick=args.quick, rounds=args.rounds)
    os.makedirs(args.img_dir, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out_md)), exist_ok=True)
    images = {}
    workloads_to_plot = workloads
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: no plots (pip install -e '.[bench]' in the repository)", file=sys.stderr)
        workloads_to_plot = []
    if any(not wl.name.startswith(("batch-", "width-")) for wl in workloads_to_plot):
        report.plot_losses(results, workloads, os.path.join(args.img_dir, "loss_curves.png"))
        images["loss against step"] = "loss_curves.png"
    if any(wl.name.startswith(("batch-", "width-")) for wl in workloads_to_plot):
        report.plot_scaling(results, workloads, os.path.join(args.img_dir, "scaling.png"))
        images["scaling"] = "scaling.png"
    rel = os.path.relpath(args.img_dir, os.path.dirname(os.path.abspath(args.out_md)))
    images = {alt: os.path.join(rel, name).replace(os.sep, "/") for alt, name in images.items()}
    rounds = args.rounds or (2 if args.quick else 5)
    header = (f"Run of {datetime.date.today()} ({QUICK if args.quick else 'full'}, "
              f"{rounds} rounds, {time.perf_counter() - t0:.0f} s): {report.machine()}.")
    report.write_markdown(args.out_md, report.tables(results, workloads, memory, images, header))
    if args.out_json:
        atomic.write(args.out_json, json.dumps({"results": [vars(r) for r in results], "memory": memory}))
    print(f"wrote {args.out_md} and {len(images)} plot(s) in {args.img_dir}", file=sys.stderr)
    # NOTE: the portable comparison runs in other processes, after the suite, and adds a section to its page
    from onnxopt.bench.portable import bench_section

    bench_section([*(sys.argv[1:] if argv is None else argv), "--out-md", args.out_md], args.portable_python)
    return 0
