import pytest


@pytest.fixture(autouse=True)
def _in_a_temporary_folder(tmp_path, monkeypatch):
    """onnxcustom's tests write files into the current folder (verbose_yield.onnx): run them in one of their own."""
    monkeypatch.chdir(tmp_path)
