"""One rank of tests/test_distributed.py: fits a Trainer on a stream of batches, with a fault if asked.

Usage: python distributed_worker.py '<json config>' (RANK, WORLD_SIZE, MASTER_ADDR/PORT set by the test).
fault: "kill" (rank 1 SIGKILLs itself in epoch 2), "hang" (rank 1 sleeps there), "disagree" (rank 1's learning
rate differs), None. With "runs" in the config: DataParallelRunner epochs for each run's options instead (rank 0
writes each run's weights, losses, transport and mode to "out"/<run>.npz; a run with "options" passes the fused
step too, one with "nan_rank" then steps on a batch with a NaN target in that rank's rows and each rank writes
<run><rank>.npz).
"""

import atexit
import json
import os
import signal
import sys
import time

import numpy as np
import torch.distributed as dist

import onnxopt
from onnxopt import dsl

# NOTE: registered before onnxopt initializes the group, so it runs after onnxopt's own exit handler
atexit.register(lambda: print("group left at exit:", not dist.is_initialized(), flush=True))
cfg = json.loads(sys.argv[1])
rank = int(os.environ["RANK"])
with np.load(cfg["data"]) as data:
    X, y = data["X"], data["y"]
epochs = [0]


def options(spec: str) -> dict:
    """compile_train_step's options from a run's spec, a Python expression over ``dsl`` (as the test writes them)."""
    return eval(spec, {"dsl": dsl})  # noqa: S307


def batches():
    epochs[0] += 1
    for i in range(0, len(X), 32):
        if rank == 1 and epochs[0] == 2 and i == 64:
            if cfg["fault"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if cfg["fault"] == "hang":
                time.sleep(600)
        yield X[i:i + 32], y[i:i + 32]


if "runs" in cfg:
    from onnxopt import distributed

    with np.load(cfg["data"]) as data:
        X, y, sw = data["X"], data["y"], data["sw"]
    for name, run in cfg["runs"].items():
        kw = options(run["options"]) if "options" in run else dict(update=cfg["update"], learning_rate=cfg["lr"])
        steps = distributed.split_step(cfg["model"], loss="square", **kw)
        fused = onnxopt.compile_train_step(cfg["model"], loss="square", **kw) if "options" in run else None
        dp = distributed.DataParallelRunner(*steps, batch_size=run["batch"], sync_every=run.get("sync_every", 1),
                                            transport=run.get("transport", "auto"), buckets=run.get("buckets", 1),
                                            compress=run.get("compress"), device=run.get("device", "cpu"), fused=fused)
        losses = np.concatenate([dp.epoch(X, y, sw if run.get("weighted") else None, batch_size=run["batch"])
                                 for _ in range(2)])
        extra = {}
        if "nan_rank" in run:  # NOTE: a NaN target in that rank's rows of one batch, then one more good batch
            bad, before, count = y[:run["batch"]].copy(), dp.get_weights(), dp.step_count
            bad[run["batch"] // 2 * run["nan_rank"]] = np.nan
            try:
                dp.step(X[:run["batch"]], bad)
                extra["raised"] = False
            except onnxopt.errors.ConvergenceError:
                extra["raised"] = True
            kept = dp.get_weights()
            extra["kept"] = all(np.array_equal(kept[k], v) for k, v in before.items()) and dp.step_count == count
            dp.step(X[:run["batch"]], y[:run["batch"]])
        if rank == 0 or extra:
            np.savez(os.path.join(cfg["out"], f"{name}{rank if extra else ''}.npz"), losses=losses,
                     transport=str(dp.transport), pieces=len(dp._pieces), reduces=dp.reduces, **extra,
                     **dp.get_weights())
    sys.exit(0)

lr = cfg["lr"] * (2 if rank == 1 and cfg["fault"] == "disagree" else 1)
est = onnxopt.Trainer(cfg["model"], update=cfg["update"], learning_rate=lr, batch_size=32, max_iter=3, tol=None,
                      checkpoint_dir=cfg["ckpt"], shuffle=False)
est.fit(batches)
print("done", rank, est.n_iter_)
