"""onnxopt: compile the training step of an ONNX model into one ONNX graph and run it with onnxruntime."""

from onnxopt import dsl
from onnxopt.errors import ConvergenceError, DataError, DslError, ModelError, NotDifferentiableError, OnnxoptError
from onnxopt.errors import CheckpointError, ModelFormatError, ModelVersionError, WeightError
from onnxopt.forward_backward import ForwardBackward
from onnxopt.fuse import compile_train_step
from onnxopt.gradient import gradient_model, train_initializers
from onnxopt.grad import grad
from onnxopt.loss_output import add_loss_output
from onnxopt.runner import Runner
from onnxopt.step import TrainStep
from onnxopt.trainer import Trainer

__version__ = "0.1.0"
__all__ = ["dsl", "compile_train_step", "TrainStep", "Runner", "Trainer", "ForwardBackward", "gradient_model", "grad",
           "train_initializers",
           "add_loss_output", "OnnxoptError", "ModelError", "NotDifferentiableError", "DslError", "DataError",
           "ConvergenceError", "CheckpointError", "ModelFormatError", "ModelVersionError", "WeightError"]
