"""onnxopt: compile the training step of an ONNX model into one ONNX graph and run it with onnxruntime."""

from onnxopt.errors import ConvergenceError, DataError, DslError, ModelError, NotDifferentiableError, OnnxoptError
from onnxopt.gradient import gradient_model, train_initializers

__version__ = "0.1.0"
from onnxopt.fuse import compile_train_step
from onnxopt.step import TrainStep
