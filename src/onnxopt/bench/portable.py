"""A portable step on stock onnxruntime against the training build's step, each run by its own process.

``onnxopt bench`` runs ``compare`` when it finds an interpreter with stock onnxruntime (``--portable-python
PATH``, else a ``.venv313``); ``python -m onnxopt.bench.portable --python PATH --workloads W1 W3`` runs it
alone. Both steps are compiled here (training build). One worker process per configuration (the training
build's step; the portable step on the other interpreter's onnxruntime; the portable step on the training
build) sets up its Runner and trains an untimed epoch, then times a block of epochs each time it is asked.
The workers take turns, one computing at a time, 50 ms apart (ORT's threads spin for tens of ms after a
run); each portable block is timed between two of the training build's, and a ratio is the median over
turns of the portable-on-stock block over the mean of the two around it (this VM's speed moves ~2x in
phases of seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from statistics import median
from subprocess import PIPE

__all__ = ["WORKLOADS", "serve", "compare", "find_python", "markdown", "bench_section"]

WORKLOADS = ("W1-sgd", "W1-nesterov", "W1-adam", "W3")  # NOTE: the target: within 1.1x on W1 and W3
TARGET = 1.1
REF = "training build"


def serve(path: str, workload: str, epochs: int, stdin=sys.stdin, stdout=sys.stdout) -> None:
    """The worker: prints its onnxruntime version and kernels per step, then for each line read times
    ``epochs`` epochs (after 10 untimed steps) and prints [wall, CPU] µs per step."""
    import onnx
    import onnxruntime as ort

    import onnxopt
    from onnxopt.bench.workloads import WORKLOADS as ALL
    from onnxopt.runner import default_session_options

    wl = ALL[workload]
    X, y = wl.data()
    batches = [(X[i:i + wl.batch], y[i:i + wl.batch]) for i in range(0, wl.n, wl.batch)]
    with tempfile.TemporaryDirectory() as tmp:  # NOTE: the kernels of the Runner's own session (weights bound)
        opts = default_session_options(wl.n_parameters, wl.batch)
        opts.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
        onnxopt.Runner(path, batch_size=wl.batch, session_options=opts)
        kernels = len(onnx.load(opts.optimized_model_filepath).graph.node)
    runner = onnxopt.Runner(path, batch_size=wl.batch)

    def run(steps):
        for xb, yb in steps:
            runner.step(xb, yb, read_loss=False)
        runner.sync()

    run(batches)
    print(json.dumps({"onnxruntime": ort.__version__, "python": sys.version.split()[0], "kernels": kernels}),
          file=stdout, flush=True)
    for _ in stdin:
        run(batches[:10])
        t0, c0, steps = time.perf_counter(), time.process_time(), epochs * len(batches)
        for _ in range(epochs):
            run(batches)
        print(json.dumps([(time.perf_counter() - t0) / steps * 1e6, (time.process_time() - c0) / steps * 1e6]),
              file=stdout, flush=True)


def _read(proc: subprocess.Popen, log: str):
    for line in proc.stdout:  # NOTE: the next JSON line; anything an import prints before it is skipped
        if line.startswith(("{", "[")):
            return json.loads(line)
    with open(log) as f:
        raise RuntimeError(f"portable bench worker {proc.args[0]} died: {f.read()[-2000:]}")


def compare(workloads: list[str], python: str, turns: int = 20, epochs: int | None = None, log=print) -> dict:
    """{workload: {configuration: {wall, cpu (median µs/step), kernels, onnxruntime, python}, "ratio":
    (wall, CPU)}}: the ratio is portable on stock / training build, median over turns."""
    import onnxopt
    from onnxopt.bench.competitors import _onnxopt_update
    from onnxopt.bench.workloads import select

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for wl in select(workloads):
            paths = {portable: os.path.join(tmp, f"{wl.name}-{portable}.onnx") for portable in (False, True)}
            for portable, path in paths.items():
                onnxopt.compile_train_step(wl.model(), loss=wl.loss, update=_onnxopt_update(wl.update),
                                           learning_rate=wl.lr, portable=portable).save(path)
            configs = {"training build": (sys.executable, paths[False]), "portable, stock": (python, paths[True]),
                       "portable, training build": (sys.executable, paths[True])}
            workers, logs = {}, {}
            for name, (exe, path) in configs.items():  # NOTE: started together: their setup is not timed
                logs[name] = os.path.join(tmp, f"{len(logs)}.log")
                with open(logs[name], "w") as err:
                    workers[name] = subprocess.Popen([exe, "-m", "onnxopt.bench.portable", "--serve", path,
                                                      "--workload", wl.name, "--epochs", str(epochs or wl.epochs)],
                                                     text=True, stdin=PIPE, stdout=PIPE, stderr=err)
            try:
                row = {name: _read(w, logs[name]) for name, w in workers.items()}
                times, pairs = {name: [] for name in workers}, []

                def block(name):
                    time.sleep(0.05)
                    workers[name].stdin.write("\n")
                    workers[name].stdin.flush()
                    times[name].append(_read(workers[name], logs[name]))
                    return times[name][-1]

                for turn in range(turns):  # NOTE: each portable block between two of the training build's
                    before = block(REF)
                    for name in [*configs][1:][::1 if turn % 2 else -1]:
                        ours, after = block(name), block(REF)
                        if name == "portable, stock":
                            pairs.append([o / ((b + a) / 2) for o, b, a in zip(ours, before, after)])
                        before = after
            finally:
                for w in workers.values():
                    w.stdin.close()
                    w.wait(timeout=60)
            for name, values in times.items():
                row[name].update(wall=median(v[0] for v in values), cpu=median(v[1] for v in values))
            row["ratio"] = tuple(median(p[i] for p in pairs) for i in (0, 1))
            results[wl.name] = row
            log(f"{wl.name}: " + ", ".join(f"{k} {v['wall']:.1f} us ({v['cpu']:.1f} CPU, {v['kernels']} kernels)"
                                           for k, v in row.items() if k != "ratio")
                + f"; portable on stock / training build = {row['ratio'][0]:.3f} wall, {row['ratio'][1]:.3f} CPU")
    return results


def find_python(python: str | None = None) -> tuple[str | None, str]:
    """(interpreter, "Python x, onnxruntime y") of ``python``, else of ``.venv313`` in the working folder (the
    repository's, where the tests create it); (None, why not) when there is none or it lacks stock onnxruntime."""
    exe = python or os.path.join(os.getcwd(), ".venv313", "bin", "python")
    if python is None and not os.path.exists(exe):
        return None, "no --portable-python given and no .venv313/bin/python here (tests/test_portable.py creates one)"
    probe = ("import importlib.util, json, sys, onnxruntime, onnxopt; print(json.dumps([sys.version.split()[0], "
             "onnxruntime.__version__, importlib.util.find_spec('onnxruntime.training') is not None]))")
    try:
        out = subprocess.run([exe, "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"cannot run {exe} ({exc})"
    if out.returncode != 0:
        return None, f"{exe} cannot import onnxruntime and onnxopt: {(out.stderr.strip().splitlines() or ['?'])[-1]}"
    version, ort_version, training = json.loads(out.stdout.strip().splitlines()[-1])
    if training:
        return None, (f"{exe} has onnxruntime-training {ort_version}; expected stock onnxruntime (Python 3.13+: "
                      "`pip install -e .` from the repository there)")
    return exe, f"Python {version}, onnxruntime {ort_version}"


def markdown(results: dict | None, note: str) -> str:
    """The section of the benchmarks page: one row per configuration, and the target per workload."""
    lines = ["", "### Portable step on stock onnxruntime", "", note, ""]
    if not results:
        return "\n".join(lines) + "\n"
    lines += ["| workload | configuration | Python | onnxruntime | kernels/step | us/step | CPU us/step |",
              "|" + " --- |" * 7]
    for wl, row in results.items():
        lines += [f"| {wl} | {name} | {r['python']} | {r['onnxruntime']} | {r['kernels']} | {r['wall']:.1f} | "
                  f"{r['cpu']:.1f} |" for name, r in row.items() if name != "ratio"]
    lines += ["", "| workload | target | measured (wall) | CPU time | holds |", "| --- | --- | --- | --- | --- |"]
    for wl, row in results.items():
        wall, cpu = row["ratio"]
        lines.append(f"| {wl} | portable on stock / training build ≤ {TARGET} | {wall:.2f} | {cpu:.2f} | "
                     f"{'yes' if wall <= TARGET else 'no'} |")
    return "\n".join(lines) + "\n"


def bench_section(argv: list[str], python: str | None, log=print) -> str:
    """The section ``onnxopt bench argv`` adds to its page: ``compare`` on its W1/W3 workloads (``--quick``:
    2 turns of one epoch; else 4 turns per round), or the reason it skipped."""
    from onnxopt.bench import _parser
    from onnxopt.bench.report import append_markdown
    from onnxopt.bench.workloads import select

    args = _parser().parse_known_args(argv)[0]
    chosen = [wl.name for wl in select(args.workloads) if wl.name in WORKLOADS]
    exe, about = find_python(python) if chosen else (None, f"none of {', '.join(WORKLOADS)} among the workloads run")
    if exe is None:
        section = markdown(None, f"Skipped: {about}.")
        log(f"portable step on stock onnxruntime: skipped ({about})")
    else:
        log(f"portable step on stock onnxruntime ({about}): {', '.join(chosen)}")
        turns = 2 if args.quick else 4 * (args.rounds or 5)
        try:
            results = compare(chosen, exe, turns=turns, epochs=1 if args.quick else None, log=log)
            section = markdown(results, f"Each configuration in its own process ({about} for the portable step "
                                        f"on stock onnxruntime), {turns} turns; ratio: median over turns of the "
                                        "portable block over the mean of the training build's blocks around it"
                                        + (" (--quick: not a measurement)." if args.quick else "."))
        except RuntimeError as exc:  # NOTE: a worker died: the suite's tables are still worth keeping
            section = markdown(None, f"Failed: {str(exc).splitlines()[0]}")
            log(f"portable step on stock onnxruntime: failed ({exc})")
    append_markdown(args.out_md, section)
    return section


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m onnxopt.bench.portable", description=__doc__.split("\n\n")[0])
    p.add_argument("--python", help="interpreter with stock onnxruntime and onnxopt installed (default: .venv313)")
    p.add_argument("--workloads", nargs="+", default=["W1", "W3"])
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--serve", metavar="STEP.onnx", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--epochs", type=int, default=None, help="epochs per timed block (default: the workload's)")
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve, args.workload, args.epochs or 1)
        return 0
    exe, about = find_python(args.python)
    if exe is None:
        p.error(about)
    compare(args.workloads, exe, args.turns, args.epochs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
