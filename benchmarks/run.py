"""Runs onnxopt's benchmark suite (the same as ``onnxopt bench``) and rewrites docs/benchmarks.md's tables.

    python benchmarks/run.py                      # every workload, about 10 minutes on 2 cores
    python benchmarks/run.py --quick --workloads W2
"""

import sys

from onnxopt.bench import main

if __name__ == "__main__":
    sys.exit(main())
