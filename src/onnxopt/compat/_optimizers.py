"""onnxcustom's two estimators as thin adapters over ``onnxopt.Trainer``: one fused run per batch.

- ``OrtGradientForwardBackwardOptimizer(model, ...)``: the plain model; ``learning_loss`` (and
  ``learning_penalty``) become the loss (penalty) of the fused step, ``learning_rate`` its update rule and
  epoch-based schedule.
- ``OrtGradientOptimizer(model_with_loss, ...)``: a model that outputs its loss (``add_loss_output``), a sum
  over the batch, so the learning rate is divided by the batch size as onnxcustom did.

As in onnxcustom, ``warm_start=False`` starts every fit from random weights drawn with ``numpy.random.randn``
(seed it with ``numpy.random.seed``), ``warm_start=True`` from the current ones (the model's at first).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from onnxopt.compat._learning import LearningRateSGD, select_loss, select_penalty, select_rate
from onnxopt.errors import ConvergenceError, DataError, DslError, ModelError
from onnxopt.gradient import check_weights
from onnxopt.modelio import ModelLike, load_model
from onnxopt.trainer import Trainer

__all__ = ["OrtGradientForwardBackwardOptimizer", "OrtGradientOptimizer"]


def _with_weights(model: ModelLike, weights: Mapping[str, np.ndarray]) -> ir.Model:
    """``model`` (loaded, ai.onnx.ml ops lowered) with these initializer values."""
    m = load_model(model)
    for name, value in weights.items():
        if name not in m.graph.initializers:
            raise ModelError(f"state: {name!r} is not an initializer of the model (expected some of "
                             f"{sorted(m.graph.initializers)[:20]})")
        init = m.graph.initializers[name]
        init.const_value = ir.tensor(np.asarray(value, dtype=init.dtype.numpy()).reshape(init.shape.numpy()), name=name)
    return m


class _Base:
    """What both estimators share: parameters, starting weights, the Trainer run, state and trained model."""

    def _check(self) -> None:
        if self.training_optimizer_name != "SGDOptimizer":
            raise DslError(f"training_optimizer_name: only 'SGDOptimizer' exists, got {self.training_optimizer_name!r}")
        if self.device not in ("cpu", "cuda"):
            raise DslError(f"device: expected 'cpu' or 'cuda', got {self.device!r}")

    def __repr__(self) -> str:
        """onnxcustom's repr: long values (the model, many weights) cut to their first 10 characters."""
        shown = []
        for name in list(inspect.signature(type(self).__init__).parameters)[1:]:
            value = getattr(self, name)
            text = repr(value)
            if not isinstance(value, LearningRateSGD) and (len(text) > 50 or "\n" in text):
                text = repr(text[:10].replace("\n", " ") + "...")
            shown.append(f"{name}={text}")
        return f"{type(self).__name__}({', '.join(shown)})"

    def _start(self, m: ir.Model, names: list[str]) -> ir.Model:
        """The model the next fit starts from (see the module's docstring); keeps ``initial_weights_``."""
        if self.warm_start:
            m = _with_weights(m, getattr(self, "_weights", {}))
        else:
            m = _with_weights(m, {n: np.random.randn(*m.graph.initializers[n].shape.numpy()) for n in names})
        self.initial_weights_ = {n: m.graph.initializers[n].const_value.numpy().copy() for n in names}
        return m

    def _run(self, trainer: Trainer, X, y, sample_weight) -> None:
        self.learning_rate.init_learning_rate()
        self.trainer_ = trainer
        try:
            trainer.fit(X, y, sample_weight)
        except ConvergenceError:
            if self.exc:
                raise
            trainer.train_losses_.append(float("nan"))
        finally:
            self._weights = trainer.runner_.get_weights() if hasattr(trainer, "runner_") else {}
            self.train_step_ = getattr(trainer, "train_step_", None)
            if trainer.train_losses_:
                self.learning_rate.update_learning_rate(len(trainer.train_losses_) - 1)
        self.validation_losses_ = None

    @staticmethod
    def _no_validation(X_val) -> None:
        if X_val is not None:
            raise DataError("X_val: validation sets are not supported by onnxopt.compat, got an array; use "
                            "onnxopt.Trainer(early_stopping=True, validation_fraction=...)")

    def get_trained_onnx(self, model: ModelLike | None = None) -> onnx.ModelProto:
        """``model`` (default: the trained one) with its initializers replaced by the trained weights."""
        if not hasattr(self, "trainer_"):
            raise AttributeError(f"This {type(self).__name__} is not fitted yet; call fit first")
        return ir.to_proto(_with_weights(self.model_onnx if model is None else model, self._weights))

    def set_state(self, state: Sequence | Mapping) -> None:
        """Sets the weights the next ``fit`` with ``warm_start=True`` starts from (list in ``get_state`` order)."""
        names = self._names()
        items = state.items() if isinstance(state, Mapping) else zip(names, state)
        self._weights = {k: v.numpy() if isinstance(v, ort.OrtValue) else np.asarray(v) for k, v in items}

    def save_onnx_graph(self, folder: str | None = None) -> dict:
        """The fused training step and the trained model: written as files in ``folder`` (paths returned) or
        returned serialized when ``folder`` is None. onnxopt has one graph where onnxcustom had several."""
        graphs = {"train_step": self.train_step_.model, "trained_onnx": self.get_trained_onnx()}
        if folder is None:
            return {k: v.SerializeToString() for k, v in graphs.items()}
        os.makedirs(folder, exist_ok=True)
        paths = {k: os.path.join(folder, f"{type(self).__name__}.{k}.onnx") for k in graphs}
        for key, model in graphs.items():
            onnx.save(model, paths[key])
        return paths

    def _names(self) -> list[str]:
        """The trained weights' names: the last fit's, else ``weights_to_train``, else the model's real weights."""
        step = getattr(self, "train_step_", None)
        if step is not None:
            return list(step.weights)
        return check_weights(load_model(self.model_onnx), self.weights_to_train)


class OrtGradientForwardBackwardOptimizer(_Base):
    """Trains the plain model ``model_onnx`` (its first output) with ``learning_loss``, ``learning_penalty``
    and ``learning_rate``; ``get_state()`` returns the trained weights as OrtValues, ``train_losses_`` the
    mean loss of each epoch. ``weight_name`` (sample weights) is implied by ``fit(X, y, sample_weight)``.
    """

    def __init__(self, model_onnx, weights_to_train=None, loss_output_name="loss", max_iter=100,
                 training_optimizer_name="SGDOptimizer", batch_size=10, learning_rate="SGD", device="cpu",
                 warm_start=False, verbose=0, validation_every=0.1, learning_loss="square_error",
                 enable_logging=False, weight_name=None, learning_penalty=None, exc=True):
        self.model_onnx, self.weights_to_train, self.loss_output_name = model_onnx, weights_to_train, loss_output_name
        self.max_iter, self.training_optimizer_name, self.batch_size = max_iter, training_optimizer_name, batch_size
        self.learning_rate, self.device, self.warm_start = select_rate(learning_rate), device, warm_start
        self.verbose, self.validation_every, self.learning_loss = verbose, validation_every, select_loss(learning_loss)
        self.enable_logging, self.weight_name = enable_logging, weight_name
        self.learning_penalty, self.exc = select_penalty(learning_penalty), exc
        self._check()

    @property
    def needs_grad(self) -> bool:
        return self.learning_rate.needs_grad

    def fit(self, X, y, sample_weight=None, X_val=None, y_val=None, use_numpy=False):
        """Trains ``max_iter`` epochs; returns self."""
        self._no_validation(X_val)
        m = load_model(self.model_onnx)
        names = check_weights(m, self.weights_to_train)
        steps = -(-len(X) // max(1, min(self.batch_size, len(X))))
        trainer = Trainer(
            ir.to_proto(self._start(m, names)), loss=self.learning_loss.to_dsl(), update=self.learning_rate.update(),
            penalty=self.learning_penalty.to_dsl(), learning_rate=self.learning_rate.schedule(steps),
            batch_size=self.batch_size, max_iter=self.max_iter, device=self.device, tol=None, verbose=self.verbose,
            weights=names, output=m.graph.outputs[0].name)
        self._run(trainer, X, y, sample_weight)
        self.train_losses_ = list(trainer.train_losses_)
        return self

    def get_state(self) -> list[ort.OrtValue]:
        """The trained weights, as OrtValues (``.numpy()`` gives arrays), in ``weights_to_train`` order."""
        if not hasattr(self, "trainer_"):
            raise AttributeError("Method fit must be called before.")
        return [ort.OrtValue.ortvalue_from_numpy(self._weights[n]) for n in self._names()]

    @property
    def trained_coef_(self) -> dict[str, ort.OrtValue]:
        """``{name: OrtValue}`` of the trained weights."""
        return dict(zip(self._names(), self.get_state()))


class OrtGradientOptimizer(_Base):
    """Trains ``model_onnx``, a model whose output ``loss_output_name`` is its loss summed over the batch
    (``add_loss_output``), inputs (X, label[, sample weight]); ``get_state()`` returns ``{name: array}``."""

    def __init__(self, model_onnx, weights_to_train, loss_output_name="loss", max_iter=100,
                 training_optimizer_name="SGDOptimizer", batch_size=10, learning_rate="SGD", device="cpu",
                 warm_start=False, verbose=0, validation_every=0.1, saved_gradient=None, sample_weight_name="weight"):
        self.model_onnx, self.weights_to_train, self.loss_output_name = model_onnx, weights_to_train, loss_output_name
        self.max_iter, self.training_optimizer_name, self.batch_size = max_iter, training_optimizer_name, batch_size
        self.learning_rate, self.device, self.warm_start = select_rate(learning_rate), device, warm_start
        self.verbose, self.validation_every, self.saved_gradient = verbose, validation_every, saved_gradient
        self.sample_weight_name, self.exc = sample_weight_name, True
        self._check()

    def _renamed(self, m: ir.Model, weighted: bool) -> ir.Model:
        """Inputs (X, label[, weight]) renamed to what the fused step reads: (X, target[, sample_weight])."""
        data = [v for v in m.graph.inputs if v.name not in m.graph.initializers]
        if len(data) not in (2, 3):
            raise ModelError(f"model_onnx: expected inputs (X, label[, {self.sample_weight_name}]), got "
                             f"{[v.name for v in data]}")
        if weighted and len(data) != 3:
            raise DataError(f"sample_weight: the model has no weight input (inputs {[v.name for v in data]}), got an "
                            f"array; build it with add_loss_output(..., weight_name={self.sample_weight_name!r})")
        data[1].name = "target"
        if len(data) == 3:
            data[2].name = "sample_weight"
        return m

    def fit(self, X, y, sample_weight=None, X_val=None, y_val=None, use_numpy=False):
        """Trains ``max_iter`` epochs; returns self."""
        self._no_validation(X_val)
        m = load_model(self.model_onnx)
        names = check_weights(m, self.weights_to_train)
        m = self._renamed(self._start(m, names), sample_weight is not None)
        label = next(v for v in m.graph.inputs if v.name == "target")
        y = np.asarray(y)
        if label.shape is not None and len(label.shape) == 2 and y.ndim == 1:
            y = y.reshape(-1, 1)  # NOTE: the label input has the prediction's shape (N, 1)
        batch = max(1, min(self.batch_size, len(X)))
        trainer = Trainer(
            ir.to_proto(m), loss=None, loss_output=self.loss_output_name, update=self.learning_rate.update(),
            learning_rate=self.learning_rate.schedule(-(-len(X) // batch), scale=1.0 / batch),
            batch_size=self.batch_size, max_iter=self.max_iter, device=self.device, tol=None, verbose=self.verbose,
            weights=names)
        self._run(trainer, X, y, sample_weight)
        self.train_losses_ = [loss / batch for loss in trainer.train_losses_]
        if self.saved_gradient is not None:  # NOTE: onnxcustom saved its gradient graph; the fused step holds it
            onnx.save(self.train_step_.model, self.saved_gradient)
        return self

    def get_state(self) -> dict[str, np.ndarray]:
        """``{name: array}`` of the trained weights."""
        if not hasattr(self, "trainer_"):
            raise AttributeError("Method fit must be called before.")
        return {n: self._weights[n].copy() for n in self._names()}

    @property
    def trained_coef_(self) -> dict[str, np.ndarray]:
        return self.get_state()
