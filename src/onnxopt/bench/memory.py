"""Memory of one competitor on one workload, measured in a fresh process (psutil RSS growth).

Within the benchmark's process, memory freed by earlier workloads is reused and hides growth, so each
figure comes from its own interpreter: ``python -m onnxopt.bench.memory W5 onnxopt`` prints the RSS growth
in MB from the competitor's setup (for onnxopt: from ``Runner(step)``, after compiling) to the end of its
first epoch.
"""

from __future__ import annotations

import subprocess
import sys

__all__ = ["rss", "fresh_rss", "main"]


def rss() -> float | None:
    """Resident memory of this process in MB (None without psutil)."""
    try:
        import psutil
    except ImportError:
        return None
    return psutil.Process().memory_info().rss / 2**20


def fresh_rss(workload: str, competitor: str, timeout: float = 120.0) -> float | None:
    """RSS growth in MB of ``competitor`` on ``workload`` in a new interpreter; None if it cannot run."""
    try:
        out = subprocess.run([sys.executable, "-m", "onnxopt.bench.memory", workload, competitor],
                             capture_output=True, text=True, timeout=timeout, check=True).stdout
        return float(out.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return None


def main(argv: list[str] | None = None) -> int:
    from onnxopt import train_initializers
    from onnxopt.bench.competitors import COMPETITORS
    from onnxopt.bench.workloads import WORKLOADS

    workload, competitor = argv or sys.argv[1:3]
    wl = WORKLOADS[workload]
    X, y = wl.data()
    comp = next(c for c in COMPETITORS if c.name == competitor)()
    before = rss()
    comp.setup(wl, X, y, {k: v.copy() for k, v in train_initializers(wl.model()).items()})
    before = getattr(comp, "rss_before", before)
    comp.epoch()
    print(f"{rss() - before:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
