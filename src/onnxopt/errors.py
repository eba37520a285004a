"""Exception types of onnxopt: each names the input, what was expected and what was given."""

from __future__ import annotations

__all__ = ["OnnxoptError", "ModelError", "ModelFormatError", "ModelVersionError", "WeightError",
           "NotDifferentiableError", "DslError", "DataError", "ConvergenceError", "CheckpointError"]


class OnnxoptError(Exception):
    """Base class of every error onnxopt raises on purpose."""


class ModelError(OnnxoptError, ValueError):
    """The ONNX model cannot be used as given (unknown weight, missing output, unsupported version...)."""


class ModelFormatError(ModelError):
    """The input is not a readable ONNX model: missing, empty, truncated or another kind of file."""


class ModelVersionError(ModelError):
    """The model's IR version or opset is newer than the installed onnxruntime loads and cannot be lowered."""


class WeightError(ModelError):
    """The weights to train are missing, unknown (``weights=`` names no initializer) or not floating point."""


class NotDifferentiableError(ModelError):
    """onnxruntime-training has no gradient for some nodes of the model; ``nodes`` lists (op_type, node name)."""

    def __init__(self, message: str, nodes: list[tuple[str, str]]):
        super().__init__(message)
        self.nodes = nodes


class DslError(OnnxoptError, TypeError):
    """A loss, penalty, update rule or schedule is malformed (wrong signature, outputs or parameters)."""


class DataError(OnnxoptError, ValueError):
    """Training data does not match the compiled step (shape, dtype, length, non-finite values)."""


class ConvergenceError(OnnxoptError, ArithmeticError):
    """The loss or the weights became NaN or infinite; the last finite weights were kept."""


class CheckpointError(OnnxoptError, ValueError):
    """A checkpoint file is truncated, corrupted or does not match the runner; nothing was loaded."""
