"""The CUDA path (Runner, Trainer and onnxopt fit on onnxruntime-gpu's CUDAExecutionProvider): skipped where no
CUDA provider is installed; benchmarks/gpu_check.py runs the zoo's steps and the timings on a GPU machine."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnxopt
from onnxopt.cli import main
from onnxopt.examples import mlp
from onnxopt.runner import cuda_model

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


def _strided_deconv(pads=(1, 1, 0, 0)) -> onnx.ModelProto:
    """Conv 1x1, then a ConvTranspose 3x3, stride 2, with ``pads`` on 5x5 images. R1's strided-Conv input gradient
    was such a node until onnxopt's rule wrote it with output_padding; a user's ConvTranspose can still be one."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w0, w = (rng.normal(size=s).astype(np.float32) for s in ((2, 2, 1, 1), (2, 4, 3, 3)))
    graph = helper.make_graph(
        [helper.make_node("Conv", ["X", "W0"], ["g"]),
         helper.make_node("ConvTranspose", ["g", "W"], ["h"], strides=[2, 2], pads=list(pads)),
         helper.make_node("GlobalAveragePool", ["h"], ["p"]), helper.make_node("Flatten", ["p"], ["Y"])],
        "deconv", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2, 5, 5])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(w0, "W0"), numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_cuda_model_evens_convtranspose_pads_exactly():
    """The CUDA specialization's ConvTranspose (even pads, then a Slice) gives the compiled step's own values, on
    onnxruntime's CPU provider: every output of the train step (loss, new weights) to the last bit."""
    step = onnxopt.compile_train_step(_strided_deconv(), loss="square", update="sgd", learning_rate=0.1)
    uneven = [list(a.ints) for n in step.model.graph.node if n.op_type == "ConvTranspose" for a in n.attribute
              if a.name == "pads"]
    assert [1, 1, 0, 0] in uneven, uneven  # NOTE: what the CUDA provider leaves to the CPU
    model = cuda_model(step.model)
    pads = [list(a.ints) for n in model.graph.node if n.op_type == "ConvTranspose" for a in n.attribute
            if a.name == "pads"]
    assert pads and all(p[: len(p) // 2] == p[len(p) // 2:] for p in pads), pads
    rng = np.random.default_rng(1)
    feeds = {"X": rng.normal(size=(5, 2, 5, 5)).astype(np.float32),
             step.target: rng.normal(size=(5, 4)).astype(np.float32)}
    sessions = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
                for m in (step.model, model)]
    names = {i.name for i in sessions[0].get_inputs()}
    feeds.update({k: v for k, v in step.initial_weights().items() if k in names})
    for name in names - feeds.keys():  # NOTE: sample weights, learning rate, step counter...
        i = next(i for i in sessions[0].get_inputs() if i.name == name)
        feeds[name] = np.ones([5 if not isinstance(d, int) else d for d in i.shape],
                              np.int64 if "int64" in i.type else np.float32)
    want, got = (s.run(None, feeds) for s in sessions)
    assert len(want) == len(got) > 1
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    even = onnxopt.compile_train_step(_strided_deconv((1, 1, 1, 1)), loss="square")
    assert cuda_model(even.model) is even.model  # NOTE: nothing to rewrite: the model itself
