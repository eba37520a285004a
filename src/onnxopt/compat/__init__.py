"""onnxcustom's training API on top of onnxopt: code written for onnxcustom runs after changing its imports.

Every ``from onnxcustom.<module> import X`` of the names below becomes ``from onnxopt.compat import X``;
everything compiles to one fused training step run by ``onnxopt.Trainer``. Behaviour kept from onnxcustom:
epoch-counted learning-rate schedules, random starting weights unless ``warm_start``, losses summed over
the batch in ``add_loss_output`` graphs. See docs/migration.md for what differs.

>>> import numpy as np
>>> from onnxopt.compat import OrtGradientForwardBackwardOptimizer, LearningRateSGD, get_train_initializer
>>> from onnxopt.examples import linear_regression
>>> onx = linear_regression(2)
>>> sorted(get_train_initializer(onx))
['bias', 'coef']
>>> X = np.random.default_rng(0).normal(size=(100, 2)).astype(np.float32)
>>> y = X @ np.array([1.5, -2.0], np.float32) + 0.5
>>> np.random.seed(0)
>>> est = OrtGradientForwardBackwardOptimizer(onx, ["coef", "bias"], learning_rate=LearningRateSGD(0.05),
...                                           max_iter=30, batch_size=10).fit(X, y)
>>> est.train_losses_[0] > 100 * est.train_losses_[-1], [w.numpy().shape for w in est.get_state()]
(True, [(2, 1), (1,)])
"""

from onnxopt.compat._graphs import (
    DerivativeOptions, QuantizedWeightError, add_loss_output, get_train_initializer, onnx_derivative,
    onnx_rename_weights,
)
from onnxopt.compat._learning import (
    AbsoluteLearningLoss, BaseLearningLoss, BaseLearningPenalty, BaseLearningRate, ElasticLearningLoss,
    ElasticLearningPenalty, LearningRateSGD, LearningRateSGDNesterov, NegLogLearningLoss, NoLearningPenalty,
    SquareLearningLoss,
)
from onnxopt.compat._optimizers import ConvergenceWarning, OrtGradientForwardBackwardOptimizer, OrtGradientOptimizer
from onnxopt.errors import ConvergenceError


def device_to_providers(device: str) -> list[str]:
    """onnxcustom's helper: the onnxruntime providers of 'cpu' or 'cuda'."""
    return ["CUDAExecutionProvider", "CPUExecutionProvider"] if "cuda" in str(device) else ["CPUExecutionProvider"]


__all__ = ["OrtGradientForwardBackwardOptimizer", "OrtGradientOptimizer", "LearningRateSGD", "LearningRateSGDNesterov",
           "SquareLearningLoss", "AbsoluteLearningLoss", "ElasticLearningLoss", "NegLogLearningLoss",
           "NoLearningPenalty", "ElasticLearningPenalty", "get_train_initializer", "add_loss_output", "onnx_derivative",
           "DerivativeOptions", "onnx_rename_weights", "BaseLearningRate", "BaseLearningLoss", "BaseLearningPenalty",
           "ConvergenceError", "ConvergenceWarning", "QuantizedWeightError", "device_to_providers"]
