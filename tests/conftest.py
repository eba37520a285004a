import numpy as np
import onnxruntime as ort
import pytest

ort.set_default_logger_severity(3)


@pytest.fixture
def rng():
    return np.random.default_rng(0)
