import os
import sys

import numpy as np
import onnxruntime as ort
import pytest

from onnxopt.gradient import has_training_build

ort.set_default_logger_severity(3)

TRAINING_BUILD = has_training_build()
# NOTE: tests that take onnxruntime-training's builder or kernels as the oracle; on Python 3.13+ (stock
# onnxruntime) they skip, and CI runs them in its second environment (.ci/run)
needs_training_build = pytest.mark.skipif(not TRAINING_BUILD, reason="needs onnxruntime-training (Python <= 3.12)")


def pytest_sessionstart(session):
    if os.environ.get("CI") == "true" and sys.version_info < (3, 13) and not TRAINING_BUILD:
        pytest.exit("CI: below Python 3.13 the suite runs on onnxruntime-training, found stock onnxruntime", 2)


@pytest.fixture
def rng():
    return np.random.default_rng(0)
