"""The results as markdown tables and matplotlib PNGs (loss against step, scaling curves).

``write_markdown`` replaces only the part of the page between ``BEGIN`` and ``END`` when the page has
them, so the hand-written analysis around the tables survives a re-run.
"""

from __future__ import annotations

import itertools
import os
import platform
import re
import statistics

import numpy as np

from onnxopt import atomic
from onnxopt.bench.timing import Result
from onnxopt.bench.workloads import Workload

__all__ = ["BEGIN", "END", "machine", "tables", "write_markdown", "append_markdown", "plot_losses",
           "plot_scaling", "curve_gap"]

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
REF = "onnxopt"
STEP_REF = "onnxopt step()"  # NOTE: the same Runner, one step per batch: the time targets give its ratio too
# (workload prefixes, competitor, highest allowed onnxopt/competitor time ratio)
TARGETS = [(("W1", "W2", "W4"), "ORT on-device", 0.5), (("W1", "W2", "W4"), "torch eager", 0.1),
           (("batch-4096",), "torch eager", 1.0)]
GFLOPS_TARGET = ("ORT MatMul (MLAS)", 0.75)  # W3, W5: at least this share of ORT's own MatMul on the biggest layer
MEMORY_TARGET = 2.0


def machine() -> str:
    """CPU model, cores and library versions, one line."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = [f"Python {platform.python_version()}"]
    for mod in ("onnxruntime", "numpy", "torch", "sklearn"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            versions.append(f"{mod} missing")
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()}; " + ", ".join(versions)


def _fmt(x, spec=".1f", none="–"):
    return none if x is None else format(x, spec)


def curve_gap(res: Result, ref: Result) -> float | None:
    """Largest |loss - onnxopt's loss| over the run, relative to onnxopt's largest loss (per step or epoch)."""
    if not res.losses or not ref.losses:
        return None
    if res.per_epoch == ref.per_epoch:
        a, b = np.asarray(res.losses, np.float64), np.asarray(ref.losses, np.float64)
    else:
        a, b = res.epoch_means(), ref.epoch_means()
    n = min(len(a), len(b))
    return float(np.max(np.abs(a[:n] - b[:n])) / np.max(np.abs(b[:n])))


def _by_workload(results: list[Result]) -> dict[str, dict[str, Result]]:
    out: dict[str, dict[str, Result]] = {}
    for r in results:
        out.setdefault(r.workload, {})[r.competitor] = r
    return out


def _main_table(groups, workloads) -> list[str]:
    lines = ["| workload | competitor | threads | us/step | onnxopt / it | final loss | loss gap | "
             "runs/step | kernels/step | note |", "|" + " --- |" * 10]
    for wl in workloads:
        row = groups.get(wl.name, {})
        ref = row.get(REF)
        for name, r in row.items():
            if r.reference:
                continue
            if r.skipped:
                lines.append(f"| {wl.name} | {name} | | skipped | | | | | | {r.skipped} |")
                continue
            ratio = _ratio(ref, r) if ref and ref.us_per_step else None
            gap = curve_gap(r, ref) if ref and name != REF else None
            lines.append(f"| {wl.name} | {name} | {wl.threads} | {r.us_per_step:.1f} | {_fmt(ratio, '.2f')} | "
                         f"{r.final_loss:.5g} | {_fmt(gap, '.1e')} | {_fmt(r.session_runs, 'g')} | "
                         f"{_fmt(r.nodes, 'd')} | {r.note} |")
    return lines


def _ratio(a: Result, b: Result) -> float:
    """a's time per step over b's, the median over rounds: each block is taken relative to onnxopt's blocks
    just before and after it (``run_workload``), so the machine's drift over seconds cancels; the ratio of
    the medians for results timed otherwise."""
    ra, rb = _relative(a, b), _relative(b, a)
    if ra and rb and len(ra) == len(rb):
        return statistics.median(x / y for x, y in zip(ra, rb))
    return a.us_per_step / b.us_per_step


def _relative(r: Result, other: Result) -> list[float] | None:
    """r's blocks over onnxopt's around them; 1 for onnxopt itself, as many rounds as ``other`` was timed."""
    if r.ref_us:
        return [x / o for x, o in zip(r.block_us, r.ref_us)]
    return [1.0] * len(other.ref_us) if r.competitor == REF and r.block_us else None


def _targets(groups, memory, workloads=()) -> list[str]:
    lines = ["| workload | target | measured | with step() per batch | holds |", "| --- | --- | --- | --- | --- |"]
    for prefixes, comp, limit in TARGETS:
        for name, row in groups.items():
            if not name.startswith(prefixes) or comp not in row or REF not in row:
                continue
            r, ref, per_step = row[comp], row[REF], row.get(STEP_REF)
            if r.skipped or ref.skipped:
                lines.append(f"| {name} | time ≤ {limit} × {comp}'s | {comp} skipped | – | – |")
                continue
            ratio = _ratio(ref, r)
            alt = _ratio(per_step, r) if per_step and not per_step.skipped else None
            lines.append(f"| {name} | time ≤ {limit} × {comp}'s | {ratio:.2f} | {_fmt(alt, '.2f')} | "
                         f"{'yes' if ratio <= limit else 'no'} |")
    ref_name, share = GFLOPS_TARGET
    for wl in workloads:
        ours, matmul = groups.get(wl.name, {}).get(REF), groups.get(wl.name, {}).get(ref_name)
        if ours and matmul and not ours.skipped and not matmul.skipped:
            got = _share(wl, ours, matmul)
            lines.append(f"| {wl.name} | GFLOP/s ≥ {share} × {ref_name} {_layer(wl)} | {got:.2f} | – | "
                         f"{'yes' if got >= share else 'no'} |")
    for name, (measured, expected) in memory.items():
        if measured is not None:
            ratio = measured / expected
            lines.append(f"| {name} | runner RSS ≤ {MEMORY_TARGET} × (weights + state + activations) | "
                         f"{ratio:.1f} | – | {'yes' if ratio <= MEMORY_TARGET else 'no'} |")
    return lines


def _state_floats(wl: Workload) -> int:
    return {"sgd": 0, "nesterov": 1, "adam": 2}[wl.update] * wl.n_parameters


MEMORY_COMPETITORS = ("onnxopt", "ORT on-device", "torch eager")


def _memory(memory: dict[str, dict[str, float | None]], workloads) -> tuple[dict, list[str]]:
    """Fresh-process RSS growth per competitor against the tensors a step needs."""
    lines = ["| workload | weights + state + activations (MB) | " + " | ".join(f"{c} (MB)" for c in MEMORY_COMPETITORS)
             + " | onnxopt ratio |", "| --- |" + " --- |" * (len(MEMORY_COMPETITORS) + 2)]
    judged = {}
    for wl in workloads:
        if wl.name not in memory:
            continue
        row = memory[wl.name]
        expected = (wl.n_parameters + _state_floats(wl) + wl.activations) * 4 / 2**20
        ours = row.get(REF)
        if ours is not None:
            judged[wl.name] = (ours, expected)
        cells = " | ".join(_fmt(row.get(c)) for c in MEMORY_COMPETITORS)
        lines.append(f"| {wl.name} | {expected:.2f} | {cells} | {_fmt(ours / expected if ours else None)} |")
    return judged, lines


def _share(wl: Workload, r: Result, matmul: Result) -> float:
    """r's GFLOP/s over the reference matmul's, from their paired time ratio."""
    m, k, n = wl.layer
    return wl.flops / (2.0 * m * k * n) * _ratio(matmul, r)


def _gflops(groups, workloads) -> list[str]:
    lines = ["| workload | competitor | GFLOP/s | share of the faster sgemm |", "| --- | --- | --- | --- |"]
    for wl in workloads:
        row = groups.get(wl.name, {})
        refs = [r for r in row.values() if r.reference and not r.skipped]
        if not refs:
            continue
        m, k, n = wl.layer
        peak = min(refs, key=lambda r: r.us_per_step)
        for r in refs:
            lines.append(f"| {wl.name} | {r.competitor} {_layer(wl)} | {2.0 * m * k * n / r.us_per_step / 1e3:.1f} "
                         f"| {_ratio(peak, r):.2f} |")
        for name, r in row.items():
            if not r.skipped and not r.reference:
                lines.append(f"| {wl.name} | {name} | {wl.flops / r.us_per_step / 1e3:.1f} | "
                             f"{_share(wl, r, peak):.2f} |")
    return lines


def _layer(wl: Workload) -> str:
    m, k, n = wl.layer
    return f"({m}×{k})·({k}×{n})"


def _scaling(groups, workloads) -> list[str]:
    rows = [wl for wl in workloads if wl.name.startswith(("batch-", "width-"))]
    if not rows:
        return []
    lines = ["| point | sizes | batch | onnxopt us/step | torch eager us/step | onnxopt / torch |",
             "| --- | --- | --- | --- | --- | --- |"]
    for wl in rows:
        row = groups.get(wl.name, {})
        o, t = row.get(REF), row.get("torch eager")
        ou = o.us_per_step if o and not o.skipped else None
        tu = t.us_per_step if t and not t.skipped else None
        ratio = ou / tu if ou and tu else None
        lines.append(f"| {wl.name} | {'-'.join(map(str, wl.sizes))} | {wl.batch} | {_fmt(ou)} | {_fmt(tu)} | "
                     f"{_fmt(ratio, '.2f')} |")
    return lines


CAPTIONS = {"loss against step": "Mean training loss of each epoch against the step, one panel per workload and one "
                                 "line per competitor (same data, model and initial weights).",
            "scaling": "Time per step against the batch size and against the hidden width, onnxopt and PyTorch eager."}


def tables(results: list[Result], workloads: list[Workload], memory: dict[str, dict[str, float | None]], images: dict[str, str], header: str) -> str:
    """The generated part of the page."""
    groups = _by_workload(results)
    main = [wl for wl in workloads if not wl.name.startswith(("batch-", "width-"))]
    judged, mem_lines = _memory(memory, main)
    out = [header, "", "`onnxopt / it`: onnxopt's time per step divided by the competitor's, the median over "
           "rounds of the competitor's block timed between two of onnxopt's (below 1: onnxopt is faster; "
           "`us/step` is each one's median over rounds). `loss gap`: largest difference from onnxopt's loss over the run (per step, or per "
           "epoch for scikit-learn), relative to onnxopt's largest loss. `kernels/step`: ORT nodes after its "
           "graph optimizations (both sessions for ORT on-device), aten ops dispatched for torch eager.", "",
           *_main_table(groups, main), ""]
    out += ["Targets, as ratios within this run:", "", *_targets(groups, judged, main), ""]
    if any(r.reference for r in results):
        out += ["Achieved GFLOP/s (2·multiply-adds of forward and backward per step / time) against plain "
                "float32 matmuls of the biggest layer (numpy's BLAS, ORT's MLAS) timed in the same rounds, same "
                "threads; shares are paired ratios like the times:", "", *_gflops(groups, main), ""]
    if len(mem_lines) > 2:
        out += ["Memory: psutil RSS growth in a fresh process (`python -m onnxopt.bench.memory W C`, median of "
                "3) from setup (onnxopt: from `Runner(step)`) to the end of the first epoch, against float32 "
                "weights + optimizer state + activations (batch, every layer before and after ReLU):", "",
                *mem_lines, ""]
    scaling = _scaling(groups, workloads)
    if scaling:
        out += ["Scaling (W1 with SGD, onnxopt and PyTorch eager):", "", *scaling, ""]
    out += [f"![{alt}]({path})\n\n*{CAPTIONS.get(alt, alt)}*\n" for alt, path in images.items()]
    return "\n".join(out) + "\n"


def write_markdown(path: str, body: str, title: str = "# Benchmarks") -> None:
    """Puts ``body`` between the markers of the page at ``path`` (a new page when it has none)."""
    block = f"{BEGIN}\n{body}{END}\n"
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END) + "\n?", lambda _: block, text, flags=re.S)
    else:
        text = f"{title}\n\n{block}"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic.write(path, text)


def append_markdown(path: str, body: str) -> None:
    """Adds ``body`` at the end of the generated part (before ``END``) of the page ``write_markdown`` wrote."""
    text = open(path, encoding="utf-8").read()
    if END not in text:
        raise ValueError(f"{path}: expected the {END} marker write_markdown writes, found none")
    atomic.write(path, text.replace(END, body + END, 1))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_losses(results: list[Result], workloads: list[Workload], path: str) -> None:
    """Mean loss of each epoch against step, one panel per workload, one line per competitor."""
    plt = _pyplot()
    groups = _by_workload(results)
    main = [wl for wl in workloads if wl.name in groups and not wl.name.startswith(("batch-", "width-"))]
    cols = min(3, len(main))
    rows = -(-len(main) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
    styles = [dict(lw=4, alpha=0.35), dict(lw=1.2, ls="--"), dict(lw=1, ls=":"), dict(lw=1, marker="x", ms=4),
              dict(lw=0.8, marker="o", ms=2, ls="-.")]
    for ax, wl in zip(axes.flat, main):
        # NOTE: styles go to the plotted curves only; skipped peers and references used to take scikit-learn's
        plotted = [(name, r) for name, r in groups[wl.name].items() if not (r.skipped or r.reference)]
        for style, (name, r) in zip(itertools.cycle(styles), plotted):
            means = r.epoch_means()  # NOTE: per-step losses are batch noise; epoch means show agreement
            ax.plot((np.arange(len(means)) + 1) * wl.steps, means, label=name, **style)
        ax.set_title(f"{wl.name}: {wl.title}", fontsize=9)
        ax.set_yscale("log")
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(main):]:
        ax.axis("off")
    fig.tight_layout()
    atomic.save_figure(fig, path, dpi=80)
    plt.close(fig)


def plot_scaling(results: list[Result], workloads: list[Workload], path: str) -> None:
    """µs/step against batch size and against hidden width (log-log), onnxopt and PyTorch eager."""
    plt = _pyplot()
    groups = _by_workload(results)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, prefix, xlabel in ((axes[0], "batch-", "batch size (W1 100-50-10-1)"),
                               (axes[1], "width-", "hidden width w (100-w-w/5-1, batch 15)")):
        pts = [wl for wl in workloads if wl.name.startswith(prefix)]
        for comp in (REF, "torch eager"):
            xs, ys = [], []
            for wl in pts:
                r = groups.get(wl.name, {}).get(comp)
                if r and not r.skipped:
                    xs.append(int(wl.name[len(prefix):]))
                    ys.append(r.us_per_step)
            if xs:
                ax.plot(xs, ys, marker="o", label=comp)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel("µs / step", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    atomic.save_figure(fig, path, dpi=80)
    plt.close(fig)

