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
import logging
import os
import warnings
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

try:
    from sklearn.base import BaseEstimator
except ImportError as _exc:  # NOTE: scikit-learn is an extra: the rest of onnxopt.compat works without it
    _MISSING = _exc

    class BaseEstimator:  # type: ignore[no-redef]
        """Stands in for scikit-learn's base class: constructing an estimator says which extra installs it."""

        def __new__(cls, *args, **kwargs):
            raise ImportError(f"{cls.__name__} needs scikit-learn ({_MISSING}); install it: pip install -e "
                              "'.[sklearn]' in the repository")

from onnxopt import atomic
from onnxopt.compat._learning import LearningRateSGD, select_loss, select_penalty, select_rate
from onnxopt.errors import ConvergenceError, DataError, DslError, ModelError, WeightError
from onnxopt.fuse import compile_train_step, run_part
from onnxopt.modelio import ModelLike, load_model
from onnxopt.trainer import Trainer

__all__ = ["OrtGradientForwardBackwardOptimizer", "OrtGradientOptimizer", "ConvergenceWarning"]

_LOGGER = logging.getLogger("onnxcustom")  # NOTE: onnxcustom's logger name, so existing logging setups keep working


class ConvergenceWarning(UserWarning):
    """Warned instead of raising ``ConvergenceError`` when the estimator has ``exc=False``."""


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


def _column(a) -> np.ndarray | None:
    """Labels and weights shaped (N, 1), as onnxcustom took them, as (N,)."""
    a = None if a is None else np.asarray(a)
    return a.reshape(-1) if a is not None and a.ndim == 2 and a.shape[1] == 1 else a


class _Base(BaseEstimator):
    """What both estimators share: parameters, starting weights, the Trainer run, state and trained model."""

    # NOTE: scikit-learn's get_params/set_params/clone read the constructor's parameters; GridSearchCV works.
    def set_params(self, **params):
        selectors = {"learning_rate": select_rate, "learning_loss": select_loss, "learning_penalty": select_penalty}
        for key, value in params.items():
            setattr(self, key, selectors[key](value) if key in selectors else value)
        return self

    def __getstate__(self) -> dict:
        """Parameters, weights and losses; the Trainer and its compiled step (sessions, DSL functions) are dropped
        and rebuilt by the next fit or save_onnx_graph."""
        return {k: v for k, v in self.__dict__.items() if k not in ("trainer_", "train_step_")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

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

    def _every(self) -> int:
        """Validation every ``validation_every`` epochs (a fraction < 1 means that fraction of ``max_iter``)."""
        every = self.validation_every
        return max(1, int(self.max_iter * every)) if every < 1 else int(every)

    def _run(self, trainer: Trainer, X, y, sample_weight, X_val, y_val, scale: float = 1.0) -> None:
        """Trains ``max_iter`` epochs, in chunks of ``validation_every`` epochs when there is a validation set
        (``validation_losses_`` then gets one loss per chunk); losses are multiplied by ``scale``."""
        self.learning_rate.init_learning_rate()
        self.trainer_, self.train_losses_, self.validation_losses_ = trainer, [], []
        chunk = self._every() if X_val is not None or self.enable_logging else self.max_iter
        done = 0
        try:
            while done < self.max_iter:
                trainer.max_iter, trainer.warm_start = min(chunk, self.max_iter - done), done > 0
                try:
                    trainer.fit(X, y, sample_weight)
                finally:
                    self._collect(trainer, scale)
                done += trainer.max_iter
                if X_val is not None:
                    self.validation_losses_.append(self._validation_loss(X_val, y_val))
        except ConvergenceError as exc:
            if self.exc:
                raise
            warnings.warn(f"{type(self).__name__}: {exc}; training stopped with the last finite weights",
                          ConvergenceWarning, stacklevel=3)
            self.train_losses_.append(float("nan"))  # NOTE: onnxcustom recorded the diverging epoch as NaN

    def _collect(self, trainer: Trainer, scale: float) -> None:
        """Weights, step and epoch losses from ``trainer`` (also after a ConvergenceError: finite ones only)."""
        self._weights = trainer.runner_.get_weights() if hasattr(trainer, "runner_") else {}
        self.train_step_ = getattr(trainer, "train_step_", None)
        new = [loss * scale for loss in trainer.train_losses_[len(self.train_losses_):]]
        if self.enable_logging:
            for k, loss in enumerate(new, len(self.train_losses_)):
                _LOGGER.debug("[%s._iteration] epoch %d: loss=%g", type(self).__name__, k, loss)
        self.train_losses_ += new
        if self.train_losses_:
            self.learning_rate.update_learning_rate(len(self.train_losses_) - 1)
        self._fitted = True

    def _predict(self, X) -> np.ndarray:
        """The first output of the trained model (the prediction) on X."""
        model = self.get_trained_onnx()
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        dtype = ir.from_proto(model).graph.inputs[0].dtype.numpy()
        return sess.run([sess.get_outputs()[0].name], {sess.get_inputs()[0].name: np.asarray(X, dtype)})[0]

    def _check_fitted(self) -> None:
        if not getattr(self, "_fitted", False):
            raise AttributeError(f"Method fit must be called before (this {type(self).__name__} is not fitted).")

    def get_trained_onnx(self, model: ModelLike | None = None) -> onnx.ModelProto:
        """``model`` (default: the trained one) with its initializers replaced by the trained weights."""
        self._check_fitted()
        return ir.to_proto(_with_weights(self.model_onnx if model is None else model, self._weights))

    def set_state(self, state: Sequence | Mapping) -> None:
        """Sets the weights the next ``fit`` with ``warm_start=True`` starts from (list in ``get_state`` order)."""
        names = self._names()
        items = state.items() if isinstance(state, Mapping) else zip(names, state)
        self._weights = {k: v.numpy() if isinstance(v, ort.OrtValue) else np.asarray(v) for k, v in items}

    def save_onnx_graph(self, folder: str | type | None = None) -> dict:
        """The fused training step and the trained model (the starting model before ``fit``): written as files
        in ``folder`` (paths returned) or returned serialized when ``folder`` is None or ``bytes``. onnxopt has
        one graph where onnxcustom had several; before ``fit`` the schedule counts one step per epoch."""
        step = getattr(self, "train_step_", None)
        if step is None:
            m, names = self._loaded()
            step = compile_train_step(ir.to_proto(self._as_step_model(m)), **self._step_args(m, names, 1))
        trained = self.get_trained_onnx() if getattr(self, "_fitted", False) else ir.to_proto(load_model(self.model_onnx))
        graphs = {"train_step": step.model, "trained_onnx": trained}
        if folder is None or folder is bytes:
            return {k: v.SerializeToString() for k, v in graphs.items()}
        os.makedirs(folder, exist_ok=True)
        paths = {k: os.path.join(folder, f"{type(self).__name__}.{k}.onnx") for k in graphs}
        for key, model in graphs.items():
            atomic.write(paths[key], model.SerializeToString())
        return paths

    def _names(self) -> list[str]:
        """The trained weights' names: the last fit's, else ``weights_to_train``, else the model's real weights."""
        if getattr(self, "_fitted", False) and self._weights:
            return list(self._weights)
        return self._loaded()[1]

    def _loaded(self) -> tuple[ir.Model, list[str]]:
        """``model_onnx`` and ``weights_to_train`` checked: the compiler's load and weights stages (no mode applied
        before: ``stats=()``)."""
        part = run_part(self.model_onnx, ("load", "weights"), weights=self.weights_to_train, stats=())
        return part.model, part.names

    def _as_step_model(self, m: ir.Model) -> ir.Model:
        return m

    def score(self, X, y, sample_weight=None) -> float:
        """Minus the mean loss per sample (scikit-learn's convention: higher is better)."""
        return -float(np.sum(self.losses(X, y, sample_weight))) / len(X)


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

    def _ordered(self) -> tuple[ir.Model, list[str]]:
        """onnxcustom's rule for this estimator: ``weights_to_train`` in the initializers' order (get_state's)."""
        m, names = self._loaded()
        order = [n for n in m.graph.initializers if n in set(names)]
        if names != order:
            raise WeightError(f"weights_to_train: expected names in the initializers' order {order} (as onnxcustom "
                              f"required), got {names}; reorder them or rename them with onnx_rename_weights(model)")
        return m, names

    def _step_args(self, m: ir.Model, names: list[str], steps: int) -> dict:
        return dict(loss=self.learning_loss.to_dsl(), update=self.learning_rate.update(),
                    penalty=self.learning_penalty.to_dsl(), learning_rate=self.learning_rate.schedule(steps),
                    weights=names, output=m.graph.outputs[0].name)

    def fit(self, X, y, sample_weight=None, X_val=None, y_val=None):
        """Trains ``max_iter`` epochs (``validation_losses_`` on X_val, y_val every ``validation_every``);
        returns self."""
        m, names = self._ordered()
        steps = -(-len(X) // max(1, min(self.batch_size, len(X))))
        trainer = Trainer(ir.to_proto(self._start(m, names)), **self._step_args(m, names, steps),
                          batch_size=self.batch_size, device=self.device, tol=None, verbose=self.verbose,
                          scale="never")  # NOTE: onnxcustom trained on the data as given
        self._run(trainer, X, _column(y), _column(sample_weight), X_val, _column(y_val))
        return self

    def losses(self, X, y, sample_weight=None) -> np.ndarray:
        """The loss of each sample (``learning_loss`` on the trained model's prediction)."""
        return self.learning_loss.loss_scores(y, self._predict(X), _column(sample_weight))

    def _validation_loss(self, X_val, y_val) -> float:
        return float(np.mean(self.losses(X_val, y_val)))

    def get_state(self) -> list[ort.OrtValue]:
        """The trained weights, as OrtValues (``.numpy()`` gives arrays), in ``weights_to_train`` order."""
        self._check_fitted()
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
        self.sample_weight_name, self.exc, self.enable_logging = sample_weight_name, True, False
        self._check()
        if self.learning_rate.needs_grad:
            raise NotImplementedError(f"learning_rate: OrtGradientOptimizer only does plain SGD (as onnxcustom's), got "
                                      f"{type(self.learning_rate).__name__}; use OrtGradientForwardBackwardOptimizer")

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
        if data[1].dtype == ir.DataType.INT64:  # NOTE: the step feeds targets in the weights' dtype; class labels
            label, x = data[1], data[0]           # (small integers) cast back to int64 exactly inside the graph
            target = ir.Value(name="target", type=ir.TensorType(x.dtype), shape=label.shape)
            label.name = "target/int64"
            cast = ir.node("Cast", [target], {"to": ir.DataType.INT64})
            m.graph.insert_before(next(iter(m.graph)), cast)
            ir.convenience.replace_all_uses_with(label, cast.outputs[0])
            m.graph.inputs[list(m.graph.inputs).index(label)] = target
        if len(data) == 3:
            data[2].name = "sample_weight"
        outs = list(m.graph.outputs)
        loss = next((v for v in outs if v.name == self.loss_output_name), None)
        if loss is not None and loss.shape is not None and len(loss.shape) > 0:  # NOTE: onnxcustom's (1, 1) loss
            tape = ir.tape.Tape(m.graph)
            scalar = tape.op("Reshape", [loss, tape.op("Constant", [], {"value": ir.tensor(np.array([], np.int64))})])
            m.graph.outputs[outs.index(loss)] = scalar
            loss.name, scalar.name = f"{loss.name}/unshaped", self.loss_output_name
        return m

    def _step_args(self, m: ir.Model, names: list[str], steps: int, batch: int = 1) -> dict:
        output = next((v.name for v in m.graph.outputs if v.name != self.loss_output_name
                       and v.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE)), None)
        return dict(loss=None, loss_output=self.loss_output_name, update=self.learning_rate.update(), output=output,
                    learning_rate=self.learning_rate.schedule(steps, scale=1.0 / batch), weights=names)

    def _as_step_model(self, m: ir.Model) -> ir.Model:
        return self._renamed(m, False)

    def _label(self, m: ir.Model, y):
        """y shaped like the label input: (N, 1) when the input is 2-D."""
        label = next(v for v in m.graph.inputs if v.name == "target")
        y = np.asarray(y)
        if label.shape is not None and len(label.shape) == 2 and y.ndim == 1:
            y = y.reshape(-1, 1)  # NOTE: the label input has the prediction's shape (N, 1)
        return y

    def fit(self, X, y, sample_weight=None, X_val=None, y_val=None, use_numpy=False):
        """Trains ``max_iter`` epochs (``validation_losses_`` on X_val, y_val every ``validation_every``);
        returns self. ``use_numpy`` is accepted and ignored (onnxopt has one way to feed batches)."""
        m, names = self._loaded()
        m = self._renamed(self._start(m, names), sample_weight is not None)
        batch = max(1, min(self.batch_size, len(X)))
        trainer = Trainer(ir.to_proto(m), **self._step_args(m, names, -(-len(X) // batch), batch),
                          batch_size=self.batch_size, device=self.device, tol=None, verbose=self.verbose,
                          scale="never")  # NOTE: onnxcustom trained on the data as given
        self._run(trainer, X, self._label(m, y), _column(sample_weight), X_val,
                  None if y_val is None else self._label(m, y_val), scale=1.0 / batch)
        if self.saved_gradient is not None:  # NOTE: onnxcustom saved its gradient graph; the fused step holds it
            atomic.write(self.saved_gradient, self.train_step_.model.SerializeToString())
        return self

    def score(self, X, y, sample_weight=None) -> float:
        """Minus the model's loss output on (X, y) divided by the number of samples."""
        m = self._renamed(load_model(self.model_onnx), sample_weight is not None)
        return -self._validation_loss(X, self._label(m, y), _column(sample_weight))

    def _validation_loss(self, X_val, y_val, sample_weight=None) -> float:
        """The loss output of the trained model on the validation set, per sample."""
        model = self.get_trained_onnx()
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        data = [i for i in sess.get_inputs()]
        inputs = ir.from_proto(model).graph.inputs
        dtype = inputs[0].dtype.numpy()
        feeds = {data[0].name: np.asarray(X_val, dtype), data[1].name: np.asarray(y_val, inputs[1].dtype.numpy())}
        if len(data) == 3:
            feeds[data[2].name] = np.ones(len(X_val), dtype) if sample_weight is None else np.asarray(sample_weight, dtype)
        return float(np.asarray(sess.run([self.loss_output_name], feeds)[0]).sum()) / len(X_val)

    def get_state(self) -> dict[str, np.ndarray]:
        """``{name: array}`` of the trained weights."""
        self._check_fitted()
        return {n: self._weights[n].copy() for n in self._names()}

    @property
    def trained_coef_(self) -> dict[str, np.ndarray]:
        return self.get_state()
