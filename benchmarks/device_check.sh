#!/usr/bin/env bash
# Issue 42's checks on a lent GPU machine, in one command (about 4 minutes on 16 cores and an H100), printing
# markdown for docs/benchmarks.md ("Device results"). Run from the repository root, with onnxruntime-gpu, onnx-ir
# and this checkout's src on PYTHONPATH:
#
#     PYTHONPATH=<wheels site>:$PWD/src bash benchmarks/device_check.sh [--dry-run]
#
# (i) tests/test_cuda.py on the GPU; (iv) 2 DataParallelRunner ranks on CUDA against one process (pytest);
# (ii) benchmarks/distributed.py W3 W5: 1 process, 2 independent ones (the capacity), 2 ranks (1 thread each),
# and W3's bound (--bound: CPU time a step of the fused step against a rank's split step);
# (iii) benchmarks/streaming.py: a W3 epoch from Parquet and from the .npy folder against in memory;
# (v) gpu_check.py --placement R1: the nodes the CUDA session leaves to the CPU, with and without cuda_model.
# Without a usable GPU the GPU parts print why and are skipped (--dry-run: the tests skip with their reasons, the
# placement table runs on the CPU, and the benchmarks run with fewer rounds and 5x timeouts).
set -u
PY=${PYTHON:-python3}
ROUNDS=3 SLOW=1  # NOTE: timeouts sum to 270 s; the dry run's are 5x: it runs on a small shared machine
[ "${1:-}" = --dry-run ] && ROUNDS=1 SLOW=5
# NOTE: onnxruntime-gpu loads CUDA and cuDNN from torch's nvidia-* wheels when their folders are on the path
NV=$($PY -c "import glob, os, nvidia; print(':'.join(sorted({os.path.dirname(p) for d in nvidia.__path__
  for p in glob.glob(os.path.join(d, '**', 'lib*.so*'), recursive=True)})))" 2>/dev/null)
export LD_LIBRARY_PATH=${NV}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
PROBE=$($PY - <<'EOF' 2>&1
import numpy as np, onnxruntime as ort
from onnx import TensorProto as T, helper as h
if "CUDAExecutionProvider" not in ort.get_available_providers():
    print(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider")
else:  # NOTE: the provider may load and still find no device or no cuDNN: one Relu on the GPU says
    m = h.make_model(h.make_graph([h.make_node("Relu", ["x"], ["y"])], "g", [h.make_tensor_value_info("x", T.FLOAT, [2])],
                                  [h.make_tensor_value_info("y", T.FLOAT, [2])]),
                     ir_version=10, opset_imports=[h.make_opsetid("", 17)])  # NOTE: what onnxruntime >= 1.17 reads
    s = ort.InferenceSession(m.SerializeToString(), providers=["CUDAExecutionProvider"])
    print("GPU-OK" if s.get_providers()[0] == "CUDAExecutionProvider" else f"the session fell back to {s.get_providers()}")
EOF
)
NOGPU=$(grep -qx GPU-OK <<<"$PROBE" || tail -1 <<<"$PROBE")
part() {  # title, seconds, command...: runs it under timeout and prints how it ended
  echo; echo "### $1"; echo; local t0=$SECONDS
  timeout $(($2 * SLOW)) "${@:3}"; local rc=$?
  echo; echo "($1: exit $rc$([ $rc = 124 ] && echo ', TIMED OUT'), $((SECONDS - t0)) s)"
}
echo "## Device results ($(date -u +%F' '%H:%M) UTC, $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg))"
$PY -c "import sys, onnxruntime as o; print('python', sys.version.split()[0], 'onnxruntime', o.__version__, o.get_available_providers())"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
[ -n "$NOGPU" ] && echo && echo "### GPU parts: no usable GPU here ($NOGPU)"
if [ -z "$NOGPU" ] || [ "${1:-}" = --dry-run ]; then  # NOTE: without a GPU the tests skip, each with its reason
  part "(i), (iv) CUDA tests: Runner, Trainer, CLI; 2 DataParallelRunner ranks on one GPU = one process" 85 \
    $PY -m pytest tests/test_cuda.py "tests/test_distributed.py::test_two_ranks_on_cuda_give_one_process_with_the_global_batch" \
    -m "" -q -p no:cacheprovider -n0 -rs
  part "(v) R1: nodes on the CPU in the CUDA session (with and without cuda_model)" 25 \
    $PY benchmarks/gpu_check.py --placement R1 $([ -z "$NOGPU" ] && echo --inside || echo --dry-run)
fi
part "(ii) data parallel: 2 ranks against the capacity (2 independent processes), 1 thread each" 95 \
  $PY benchmarks/distributed.py W3 W5 --rounds 1 --epochs 1 --quick
part "(ii') what bounds W3's 2 ranks: CPU time a step, fused against a rank's split step" 25 \
  $PY benchmarks/distributed.py W3 --bound
part "(iii) streaming: a W3 epoch from Parquet and from the .npy folder against in memory" 40 \
  $PY benchmarks/streaming.py W3 W3-npy --rounds $ROUNDS --epochs 1 --rss-rows 0
echo; echo "(device_check.sh: $SECONDS s in all)"
