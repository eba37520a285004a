"""Runs in the second virtual environment (Python 3.13+, stock onnxruntime): trains the steps listed in
``<dir>/cases.json`` (compiled elsewhere) and writes what it measured to ``<dir>/results.json``.

Usage: python portable_worker.py DIR   (tests/test_portable.py drives it)
"""

import json
import os
import sys


def run_case(case: dict, folder: str) -> dict:
    import numpy as np
    import onnxruntime as ort

    import onnxopt

    data = np.load(os.path.join(folder, case["data"]))
    batches = [(data[f"X{i}"], data[f"y{i}"]) for i in range(case["n_batches"])]
    path = os.path.join(folder, case["step"])
    step = onnxopt.TrainStep.load(path)
    runner = onnxopt.Runner(step)
    losses = [runner.step(X, y) for X, y in batches]
    # a checkpoint after two steps, restored in a new runner, continues to the same losses
    again = onnxopt.Runner(path)
    for X, y in batches[:2]:
        again.step(X, y)
    ckpt = os.path.join(folder, case["name"] + ".ckpt")
    again.save_checkpoint(ckpt)
    resumed = onnxopt.Runner(path)
    resumed.load_checkpoint(ckpt)
    resumed_losses = [resumed.step(X, y) for X, y in batches[2:]]
    exported = runner.export()
    sess = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    prediction = sess.run(None, {sess.get_inputs()[0].name: batches[0][0]})[0]
    X_all = np.concatenate([X for X, _ in batches])
    y_all = np.concatenate([y for _, y in batches])
    est = onnxopt.Trainer(path, loss=case["loss"], batch_size=len(batches[0][0]), max_iter=2, shuffle=False, tol=None)
    est.fit(X_all, y_all)
    return {"losses": losses, "resumed": resumed_losses, "prediction": prediction.tolist(),
            "trainer_losses": [float(v) for v in est.train_losses_]}


def main(folder: str) -> None:
    import numpy as np
    import onnxruntime as ort

    import onnxopt

    with open(os.path.join(folder, "cases.json")) as f:
        cases = json.load(f)
    results = {"python": list(sys.version_info[:2]), "onnxruntime": ort.__version__,
               "training_build": hasattr(ort.capi._pybind_state, "OrtModuleGraphBuilder"),
               "cases": {case["name"]: run_case(case, folder) for case in cases}}
    # NOTE: compiled here too, with onnxopt's rules on stock onnxruntime, from the model file
    for case in cases:
        step = onnxopt.compile_train_step(os.path.join(folder, case["model"]), **case["kwargs"])
        data = np.load(os.path.join(folder, case["data"]))
        runner = onnxopt.Runner(step)
        results["cases"][case["name"]]["compiled_here"] = [
            runner.step(data[f"X{i}"], data[f"y{i}"]) for i in range(case["n_batches"])]
    with open(os.path.join(folder, "results.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
