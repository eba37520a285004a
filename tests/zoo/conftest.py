"""Fixtures of the zoo: one parameter per case; each model is exported once per session (zoo.models)."""

import onnxruntime as ort
import pytest

from helpers import importorskip  # NOTE: fails instead of skipping under CI=true
importorskip("torch")
importorskip("skl2onnx")

from zoo.models import TORCH_CASES  # noqa: E402

ort.set_default_logger_severity(3)


@pytest.fixture(params=TORCH_CASES)
def torch_case(request) -> tuple[str, str]:
    """(model name, exporter) of every torch case, e.g. ("lenet", "dynamo18")."""
    name, exporter = request.param.split("-")
    return name, exporter
