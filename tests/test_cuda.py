"""The CUDA path (Runner, Trainer and onnxopt fit on onnxruntime-gpu's CUDAExecutionProvider): skipped where no
CUDA provider is installed; benchmarks/gpu_check.py runs the zoo's steps and the timings on a GPU machine."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnxopt
from onnxopt.cli import main
from onnxopt.examples import mlp

CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs onnxruntime-gpu's CUDAExecutionProvider and a GPU "
                                "(benchmarks/gpu_check.py is the full check)")


@pytest.mark.skipif(CUDA, reason="the CUDA provider is installed")
def test_cuda_without_the_provider_is_one_clear_error():
    step = onnxopt.compile_train_step(mlp([3, 4, 1]), loss="square")
    with pytest.raises(ImportError, match="device: 'cuda' needs onnxruntime-gpu's CUDAExecutionProvider"):
        onnxopt.Runner(step, device="cuda")


@needs_cuda
@pytest.mark.parametrize("update", ["sgd", "adam"])
def test_runner_on_cuda_trains_like_on_cpu(update):
    """Weights, optimizer state and batches on the device: the losses and weights of the CPU runner (float
    tolerance: the CUDA provider's matmuls may round through TF32)."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(128, 6)).astype(np.float32)
    y = np.tanh(X.sum(1)).astype(np.float32)
    step = onnxopt.compile_train_step(mlp([6, 32, 1]), loss="square", update=update, learning_rate=0.01)
    cpu, gpu = onnxopt.Runner(step, device="cpu"), onnxopt.Runner(step, device="cuda")
    for i in range(0, 128, 16):
        assert gpu.step(X[i:i + 16], y[i:i + 16]) == pytest.approx(cpu.step(X[i:i + 16], y[i:i + 16]), rel=2e-3)
    for i in range(0, 128, 16):
        gpu.step(X[i:i + 16], y[i:i + 16], read_loss=False)
        cpu.step(X[i:i + 16], y[i:i + 16])
    assert len(gpu.sync()) == 8
    for k, v in cpu.get_weights().items():
        np.testing.assert_allclose(gpu.get_weights()[k], v, rtol=1e-2, atol=1e-4, err_msg=k)


@needs_cuda
def test_trainer_and_cli_on_cuda(tmp_path):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(200, 4)).astype(np.float32)
    y = X @ np.arange(1, 5, dtype=np.float32)
    est = onnxopt.Trainer(mlp([4, 16, 1]), device="cuda", max_iter=30, tol=None, learning_rate=0.01).fit(X, y)
    assert est.train_losses_[-1] < 0.2 * est.train_losses_[0]
    np.savez(tmp_path / "d.npz", X=X, y=y)
    onnx.save(mlp([4, 16, 1]), tmp_path / "m.onnx")
    assert main(["fit", str(tmp_path / "m.onnx"), str(tmp_path / "d.npz"), "--device", "cuda", "--epochs", "2",
                 "--quiet", "-o", str(tmp_path / "t.onnx")]) == 0
