"""Writes the examples' inputs into a folder: ``classifier.onnx`` (an MLP 4 -> 16 -> 3, untrained) and ``data.csv``
(600 rows: four features and a ``label`` column, three classes, one Gaussian blob each). Then compile the step:

    python js/examples/make_data.py out
    onnxopt compile out/classifier.onnx --loss cross_entropy --update adam --lr 0.01 --js -o out/step.onnx
"""

import sys
from pathlib import Path

import numpy as np
import onnx

from onnxopt import examples

out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
out.mkdir(parents=True, exist_ok=True)
onnx.save(examples.mlp([4, 16, 3], seed=0), out / "classifier.onnx")
rng = np.random.default_rng(0)
centers = rng.normal(0, 2.0, (3, 4))
labels = rng.integers(0, 3, 600)
features = centers[labels] + rng.normal(0, 1.0, (600, 4))
with open(out / "data.csv", "w") as f:
    f.write("f0,f1,f2,f3,label\n")
    for row, label in zip(features, labels):
        f.write(",".join(f"{v:.5f}" for v in row) + f",{label}\n")
print(f"wrote {out / 'classifier.onnx'} and {out / 'data.csv'}")
