"""One rank of tests/test_distributed.py: fits a Trainer on a stream of batches, with a fault if asked.

Usage: python distributed_worker.py '<json config>' (RANK, WORLD_SIZE, MASTER_ADDR/PORT set by the test).
fault: "kill" (rank 1 SIGKILLs itself in epoch 2), "hang" (rank 1 sleeps there), "disagree" (rank 1's learning
rate differs), None. With "runs" in the config: DataParallelRunner epochs for each run's options instead (rank 0
writes each run's weights, losses and transport to "out"/<run>.npz).
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

# NOTE: registered before onnxopt initializes the group, so it runs after onnxopt's own exit handler
atexit.register(lambda: print("group left at exit:", not dist.is_initialized(), flush=True))
cfg = json.loads(sys.argv[1])
rank = int(os.environ["RANK"])
with np.load(cfg["data"]) as data:
    X, y = data["X"], data["y"]
epochs = [0]


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
        steps = distributed.split_step(cfg["model"], loss="square", update=cfg["update"],
                                       learning_rate=cfg["lr"])
        dp = distributed.DataParallelRunner(*steps, batch_size=run["batch"], sync_every=run.get("sync_every", 1),
                                            transport=run.get("transport", "auto"), buckets=run.get("buckets", 1),
                                            compress=run.get("compress"), device=run.get("device", "cpu"))
        losses = np.concatenate([dp.epoch(X, y, sw if run.get("weighted") else None, batch_size=run["batch"])
                                 for _ in range(2)])
        if rank == 0:
            np.savez(os.path.join(cfg["out"], name + ".npz"), losses=losses, transport=str(dp.transport),
                     pieces=len(dp._pieces),
                     **dp.get_weights())
    sys.exit(0)

lr = cfg["lr"] * (2 if rank == 1 and cfg["fault"] == "disagree" else 1)
est = onnxopt.Trainer(cfg["model"], update=cfg["update"], learning_rate=lr, batch_size=32, max_iter=3, tol=None,
                      checkpoint_dir=cfg["ckpt"], shuffle=False)
est.fit(batches)
print("done", rank, est.n_iter_)
