"""``Trainer``: a scikit-learn-style estimator that trains an ONNX model with one fused run per batch.

It follows scikit-learn's conventions (parameters stored as given, ``get_params``/``set_params``, ``fit``
returns self, fitted attributes end with ``_``) and its SGD/MLP estimators' stopping rule, without
depending on scikit-learn. Epochs are deterministic given ``random_state`` and the epoch number, which makes
a run resumed from ``checkpoint_dir`` equal an uninterrupted one.
"""

from __future__ import annotations

import inspect
import os
import time
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as passes
import onnxruntime as ort
from tqdm.auto import tqdm

from onnxopt import distributed, stream
from onnxopt.atomic import check_writable, remove_stale
from onnxopt.data import check_batch_size, check_feature_shape, check_features, check_sample_weight, check_target
from onnxopt.dsl import losses
from onnxopt.errors import CheckpointError, ConvergenceError, DataError, ModelError
from onnxopt.fuse import compile_train_step
from onnxopt.loss_output import add_loss_output
from onnxopt.modelio import load_model
from onnxopt.resolve import resolve_loss
from onnxopt.runner import (FIXED_BATCH, Runner, default_session_options, fixed_rows, several_inputs,
                            step_work)
from onnxopt.scaling import fit_scaling, scale_mode
from onnxopt.step import _KEY as STEP_KEY, TrainStep
from onnxopt.tasks import choose_loss

__all__ = ["Trainer"]

_CHECKPOINT, _KIND = "trainer.ckpt", "onnxopt.Trainer"


class Trainer:
    """Trains ``model`` (an ONNX model or path) like a scikit-learn estimator.

    ``model`` may also be a step compiled elsewhere (a ``TrainStep`` or the path of a saved one, e.g. a portable
    step on Python 3.13+): it is trained as compiled, pass the ``loss`` it was compiled with (for classes and
    scores); ``update``, ``penalty``, ``learning_rate``, ``weights``, ``mode`` and ``frozen`` are then unused.

    Classifiers are recognised by their loss: ``log`` (binary, labels of two classes) and ``cross_entropy``
    (labels of any classes, kept in ``classes_``); ``score`` is then the accuracy, else R².
    ``train_losses_`` holds the mean training loss of each epoch (penalty included),
    ``validation_losses_`` the loss on the held-out fraction when ``early_stopping`` is set (penalty
    excluded); training stops when that loss (or the training loss) has not improved by ``tol`` for more
    than ``n_iter_no_change`` epochs, like scikit-learn's MLP. ``tol=None`` runs all ``max_iter`` epochs.
    ``mode`` ("train" or "eval"), ``frozen`` and ``gradient`` go to ``compile_train_step``; in mode "train" the running
    statistics of BatchNormalization are updated and written into ``trained_model_``.
    ``sync_every`` K > 1 accumulates the gradients of K batches of ``batch_size`` rows before each update (the
    weights of one process with batch K·``batch_size``, on any number of ranks: ``onnxopt.distributed``);
    ``compress`` ("bf16" or "fp16") sends the gradients of data-parallel ranks as 16-bit floats (not bit-equal).
    """

    def __init__(self, model, loss="auto", update="adam", penalty=None, learning_rate=3e-3, batch_size=32,
                 max_iter=200, shuffle=True, random_state=0, device="cpu", early_stopping=False,
                 validation_fraction=0.1, n_iter_no_change=10, tol=1e-4, verbose=0, weights=None, output=None,
                 loss_output=None, warm_start=False, checkpoint_dir=None, allow_nan=False, mode="train", frozen=None,
                 scale="auto", gradient=None, sync_every=1, compress=None):
        self.model, self.loss, self.update, self.penalty = model, loss, update, penalty
        self.learning_rate, self.batch_size, self.max_iter, self.shuffle = learning_rate, batch_size, max_iter, shuffle
        self.random_state, self.device, self.early_stopping = random_state, device, early_stopping
        self.validation_fraction, self.n_iter_no_change, self.tol = validation_fraction, n_iter_no_change, tol
        self.verbose, self.weights, self.output, self.loss_output = verbose, weights, output, loss_output
        self.warm_start, self.checkpoint_dir, self.allow_nan = warm_start, checkpoint_dir, allow_nan
        self.mode, self.frozen, self.scale, self.gradient = mode, frozen, scale, gradient
        self.sync_every, self.compress = sync_every, compress
        if checkpoint_dir is not None:  # NOTE: a file or a read-only folder would fail only after the first epoch
            check_writable(checkpoint_dir, "checkpoint_dir", folder=True, error=CheckpointError)

    # -- scikit-learn protocol ---------------------------------------------------------------------------
    @classmethod
    def _param_names(cls) -> list[str]:
        return [p for p in inspect.signature(cls.__init__).parameters if p != "self"]

    def get_params(self, deep: bool = True) -> dict:
        """The constructor's parameters (``deep`` is accepted for scikit-learn and has no effect)."""
        return {name: getattr(self, name) for name in self._param_names()}

    def set_params(self, **params) -> Trainer:
        """Sets constructor parameters; the next ``fit`` uses them (it recompiles unless ``warm_start``)."""
        for name, value in params.items():
            if name not in self._param_names():
                raise ValueError(f"set_params: unknown parameter {name!r}; expected one of {self._param_names()}")
            setattr(self, name, value)
        return self

    def __repr__(self) -> str:
        defaults = {p.name: p.default for p in inspect.signature(type(self).__init__).parameters.values()}
        shown = [f"{k}={v!r}" for k, v in self.get_params().items()
                 if k != "model" and not _same(v, defaults.get(k))]
        return f"{type(self).__name__}({', '.join(shown)})"

    def __sklearn_tags__(self):
        """What scikit-learn >= 1.6 asks (``is_classifier``, ``check_is_fitted``, ``cross_val_score``)."""
        from sklearn.utils import ClassifierTags, InputTags, RegressorTags, Tags, TargetTags  # NOTE: only it calls this

        loss = choose_loss(self.model, self.loss, self.output)[0] if not isinstance(self.model, TrainStep) else self.loss
        classifier = loss is not None and _task(resolve_loss(loss)) != "regression"
        return Tags(estimator_type="classifier" if classifier else "regressor",
                    target_tags=TargetTags(required=self.loss is not None),
                    classifier_tags=ClassifierTags() if classifier else None,
                    regressor_tags=None if classifier else RegressorTags(),
                    input_tags=InputTags(allow_nan=bool(self.allow_nan)))

    def __getstate__(self) -> dict:
        """Parameters, fitted attributes and the weights and optimizer state as NumPy, without sessions."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("runner_", "_predictor", "_evaluator", "_loss")}
        if hasattr(self, "runner_"):
            state["_arrays"] = {**self.runner_.get_weights(), **self.runner_.get_state()}
        return state

    def __setstate__(self, state: dict) -> None:
        arrays = state.pop("_arrays", None)
        self.__dict__.update(state)
        if arrays is not None:  # NOTE: sessions are rebuilt from the pickled TrainStep; weights continue bit for bit
            self.runner_ = self._make_runner()
            self.runner_.set_weights(arrays)
            self._chosen = self.__dict__.get("_chosen", (self.loss, self.output))  # NOTE: pickled before issue 28
            self._loss = resolve_loss(self._chosen[0]) if self._chosen[0] is not None else None
            self._predictor = self._evaluator = None

    # -- setup -------------------------------------------------------------------------------------------
    def _make_runner(self, decoded: bool = False, rows: int | None = None) -> Runner:
        batch = self.batch_size if isinstance(self.batch_size, int) and self.batch_size > 0 else 32
        batch = min(batch, rows) if rows else batch  # NOTE: fit clips batches to the data: sessions are made for that
        if getattr(self, "_parallel", None) is not None:  # NOTE: under torch.distributed (onnxopt.distributed)
            return distributed.DataParallelRunner(*self._parallel, device=self.device, batch_size=self._rows(batch),
                                                  sync_every=self.sync_every, compress=self.compress,
                                                  fused=getattr(self, "_fused", None))
        opts = None
        if decoded and self.device == "cpu" and (os.cpu_count() or 1) < 4:
            # NOTE: a reader that decodes (Parquet, the user's batches) needs the cores ORT's threads would spin on.
            # A memmap's reader only copies (W3: 13 ms an epoch of 300): the pool spins, as in memory (W3 from
            # .npy on 2 cores: 0.91 of in memory spinning, 0.88 sleeping, in one run). With 4 CPUs or more it
            # spins: waking a sleeping pool before each op grows with its threads, while the reader finds a CPU
            opts = default_session_options(step_work(self.train_step_), batch, spinning=False)
        return Runner(self.train_step_, device=self.device, batch_size=batch, session_options=opts)

    def _initialize(self, X=None, y=None) -> None:
        saved = _saved_step(self.model)
        self.scaling_, self._unfolded, self._x_folded, model = None, {}, False, self.model
        # NOTE: a saved step's loss="auto" is read from the inference model it was compiled from
        inference = model if saved is None else onnx.ModelProto.FromString(saved.inference) if saved.inference else None
        self._chosen = loss, output = choose_loss(inference, self.loss, self.output)
        if saved is None and loss is not None:  # NOTE: a model outputting its own loss also reads its target
            names = [v.name for v in load_model(model).graph.inputs if not v.is_initializer()]
            if len(names) > 1:
                raise several_inputs(names)
        self._scale = scale_mode(self.scale)
        if X is not None and _in_memory(X) and self._scale != "never" and loss is not None and self.loss_output is None:
            targets = y if _task(resolve_loss(loss)) == "regression" else None
            self.scaling_ = fit_scaling(_floats(X), _floats(targets), self._scale)
            if saved is None:  # NOTE: a compiled step starts from its weights as they are
                model = load_model(model)
                x = next(v for v in model.graph.inputs if not v.is_initializer())
                if x.shape is not None:  # NOTE: statistics of other columns must not be folded into the model
                    check_feature_shape(np.shape(X), [d if isinstance(d, int) else None for d in x.shape],
                                        getattr(self, "_columns", None))
                self._unfolded, self._x_folded = self.scaling_.fold(model)
        kwargs = dict(loss=loss, update=self.update, penalty=self.penalty, learning_rate=self.learning_rate,
                      weights=self.weights, output=output, loss_output=self.loss_output, mode=self.mode,
                      frozen=self.frozen, gradient=getattr(self, "gradient", None))
        self._parallel = self._fused = None
        if distributed.world()[1] > 1 or getattr(self, "sync_every", 1) != 1:
            if saved is not None:
                raise ModelError("model: data-parallel training compiles its gradient and update steps from the "
                                 "ONNX model, got a compiled TrainStep; pass the model")
            self._parallel = distributed.split_step(model, **kwargs)
            if distributed._averages(self._parallel[1], self.device, self.sync_every, self.compress):
                self._fused = compile_train_step(model, **kwargs)  # NOTE: mode "weights" (not for Adam, clipping...)
        self.train_step_ = saved or (self._parallel[0] if self._parallel else compile_train_step(model, **kwargs))
        if saved is not None and loss is not None and resolve_loss(loss).target != saved.target_kind:
            raise ModelError(f"loss: the saved step takes {saved.target_kind!r} targets, loss {loss!r} takes "
                             f"{resolve_loss(loss).target!r} ones; pass the loss the step was compiled with")
        rows = fixed_rows(self.train_step_)
        if rows is not None:  # NOTE: batches, the last one and validation rows would all need that length
            raise ModelError(f"model: {FIXED_BATCH.format(name=self.train_step_.inputs[0], rows=rows)}; Trainer needs "
                             f"batches of any length (Runner.step trains such a model on batches of {rows} rows)")
        source = stream.as_stream(X)  # NOTE: the rows fit has: its batches are clipped to them
        n = getattr(source, "rows", None) if source is not None else np.shape(X)[0] if _in_memory(X) and np.ndim(X) \
            else None
        self.runner_ = self._make_runner(decoded=source is not None and source.decodes, rows=n)
        self._loss = resolve_loss(loss) if loss is not None else None
        self._kind = _task(self._loss)
        self.n_iter_, self.train_losses_, self.validation_losses_ = 0, [], []
        self._seed = _seed(self.random_state)
        self._best = (np.inf, 0, None)  # NOTE: best loss, epochs without improvement, weights of the best
        self._position = None  # NOTE: (epoch, blocks, loss sum, rows) of a streamed epoch resumed mid-way
        x = next(i for i in self.train_step_.model.graph.input if i.name == self.runner_.roles.data[0])
        self._x_shape = [d.dim_value if d.HasField("dim_value") else d.dim_param or None
                         for d in x.type.tensor_type.shape.dim]  # NOTE: as compiled (the runner fixes the batch)
        self._y_shape = None
        self._predictor = self._evaluator = None
        self.__dict__.pop("classes_", None)

    def _sessions(self) -> None:
        """The prediction session, its weights inputs bound to the runner's OrtValues at each call."""
        exported = self._export()
        out = _prediction_output(exported, self._chosen[1], self.loss_output if self._loss is None else None)
        self._predictor = _session(exported, [out], self._bound(), self.runner_.dtype)
        pred = next(o for o in self._predictor.get_outputs() if o.name == out)
        self._y_shape, self._out = pred.shape, out

    def _evaluation_session(self) -> ort.InferenceSession:
        """The validation-loss session, built on first use (only early stopping needs it)."""
        if self._evaluator is None:
            exported = self.runner_.export()
            if self._loss is None:
                self._evaluator = _session(exported, [self.loss_output], self._bound(), self.runner_.dtype)
            else:
                with_loss = add_loss_output(exported, self._loss, output=self._chosen[1])
                self._evaluator = _session(with_loss, ["loss"], self._bound(), self.runner_.dtype)
        return self._evaluator

    def _export(self) -> onnx.ModelProto:
        """The trained model, reading raw inputs and predicting raw targets when they were scaled."""
        exported = self.runner_.export()
        if getattr(self, "scaling_", None) is None:
            return exported
        out = _prediction_output(exported, self._chosen[1], self.loss_output if self._loss is None else None)
        return self.scaling_.wrap(exported, out)

    def _bound(self) -> list[str]:
        """The runner's tensors a prediction reads: weights and running statistics (mode="train")."""
        roles = self.runner_.roles  # NOTE: read from the step's protocol
        return [*roles.weights, *roles.buffers]

    def _run(self, session: ort.InferenceSession, feeds: dict) -> np.ndarray:
        binding = session.io_binding()
        current = self.runner_.current_values()
        names = {i.name for i in session.get_inputs()}
        on_host = self.runner_.device == "cpu"  # NOTE: these sessions run on CPU: CUDA weights are copied to host
        for name in self._bound():
            value = current[name] if on_host else ort.OrtValue.ortvalue_from_numpy(current[name].numpy())
            binding.bind_ortvalue_input(name, value)
        for name, value in feeds.items():
            if name in names and value is not None:
                binding.bind_cpu_input(name, value)
        binding.bind_output(session.get_outputs()[0].name)
        session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]

    # -- data --------------------------------------------------------------------------------------------
    def _validate(self, X, y, sample_weight, fit: bool):
        dtype = self.runner_.dtype
        X = check_features(X, self._x_shape, self.runner_.x_dtype, self.allow_nan)
        n = X.shape[0]
        roles = self.runner_.roles
        if roles.target is None:
            if y is not None:
                raise DataError(f"y: the model computes its own loss ({self.loss_output!r}) and has no target "
                                "input, got an array")
        else:
            y = self._encode(y, n, fit)
        sw = check_sample_weight(sample_weight, n, dtype)
        if sw is not None and roles.sample_weight is None:
            raise DataError("sample_weight: the compiled loss takes no sample weight, got an array")
        return X, y, sw

    def _encode(self, y, n: int, fit: bool) -> np.ndarray:
        """Class labels -> what the loss reads (indices, 0/1 or one-hot); regression targets as they are."""
        if self._loss is None:  # NOTE: the model computes its own loss: y goes in as its target input declares it
            kind = next(i.type for i in self.runner_.session.get_inputs() if i.name == self.runner_.roles.target)
            dtype = {"tensor(int64)": np.int64, "tensor(double)": np.float64}.get(kind, np.float32)
            return check_target(y, n, dtype, None, self.allow_nan)
        if self._kind == "regression":
            return check_target(y, n, self.runner_.dtype, self._y_shape, self.allow_nan)
        labels = np.asarray(y)
        if labels.ndim == 2 and labels.shape[1] == 1:  # NOTE: a column of labels, as onnxcustom took them
            labels = labels.reshape(-1)
        if labels.ndim != 1 or labels.shape[0] != n:
            raise DataError(f"y: expected {n} class labels shaped ({n},), got shape {labels.shape}")
        if fit and not hasattr(self, "classes_"):
            self._set_classes(labels, "y")
        index = np.searchsorted(self.classes_, labels)
        unknown = (index >= len(self.classes_)) | (self.classes_[np.minimum(index, len(self.classes_) - 1)] != labels)
        if unknown.any():
            raise DataError(f"y: label {labels[unknown][:1].tolist()[0]!r} was not seen by fit (classes {self.classes_.tolist()})")
        if self._kind == "binary":
            return (index == len(self.classes_) - 1).astype(self.runner_.dtype) if len(self.classes_) == 2 \
                else np.zeros(n, self.runner_.dtype)
        if self._loss.target == "index":
            return index.astype(np.int64)
        width = self._y_shape[-1] if isinstance(self._y_shape[-1], int) else len(self.classes_)
        return np.eye(width, dtype=self.runner_.dtype)[index]

    def _set_classes(self, labels: np.ndarray, name: str) -> None:
        classes = np.unique(labels)
        if self._kind == "binary" and len(classes) > 2:
            raise DataError(f"{name}: the 'log' loss is binary, expected at most 2 classes, got {len(classes)}: "
                            f"{classes[:10].tolist()} (use loss='cross_entropy')")
        self.classes_ = classes

    # -- training ----------------------------------------------------------------------------------------
    def fit(self, X, y=None, sample_weight=None, features=None, target=None) -> Trainer:
        """Trains up to ``max_iter`` epochs; returns self.

        With ``warm_start`` and a fitted estimator, ``max_iter`` more epochs from the current weights (as
        scikit-learn's MLP does); else from the model's weights, or from ``checkpoint_dir``'s last epoch,
        up to ``max_iter`` epochs in all. ``X`` may also be streamed (``onnxopt.stream``): an iterable of
        batches ``(X, y[, sample_weight])``, numpy memmaps, a Parquet file or folder or a
        ``pyarrow.dataset.Dataset`` whose ``features`` and ``target`` columns are named (``sample_weight`` then
        names a column); a source larger than ``stream.CACHE_BYTES`` then also checkpoints its position within an
        epoch (at most every ``stream.CHECKPOINT_SECONDS``), and a fit resumed from it continues mid-epoch.
        """
        data = stream.as_stream(X, y, sample_weight, features, target)
        if isinstance(data, stream._Parquet):  # NOTE: checked as read: the error names the column and the row
            data.finite = not self.allow_nan
        self._columns = data.features if getattr(data, "scalars", False) else None  # NOTE: named in X's errors
        if data is not None and data.small:  # NOTE: read whole, trained as arrays (split, scaling, shuffle)
            X, y, sample_weight = data.read_all()
        elif data is not None:
            X, y, sample_weight = data, None, None
        if self.warm_start and hasattr(self, "runner_"):
            until = self.n_iter_ + self.max_iter
        else:
            self._initialize(X, y)
            self._resume()
            until = self.max_iter
        self._fit(X, y, sample_weight, until)
        return self

    def partial_fit(self, X, y=None, sample_weight=None, classes=None) -> Trainer:
        """One more epoch over (X, y) from the current weights; returns self.

        ``classes`` (classifiers, first call) lists every label later calls may bring, as in scikit-learn.
        """
        if not hasattr(self, "runner_"):
            self._initialize()
        if classes is not None and self._kind != "regression" and not hasattr(self, "classes_"):
            self._set_classes(np.asarray(classes), "classes")
        self._fit(X, y, sample_weight, self.n_iter_ + 1, stop=False)
        return self

    def _fit(self, X, y, sample_weight, until: int, stop: bool = True) -> None:
        if self._predictor is None:
            self._sessions()
        data = stream.as_stream(X, y, sample_weight)
        if data is not None and data.small:
            X, y, sample_weight = data.read_all()
            data = None
        if data is not None:
            train, validate, n_batches = self._stream(data, stop)
        else:
            X, y, sw = self._validate(X, y, sample_weight, fit=True)
            if self.scaling_ is not None and self.scaling_.x is not None and not getattr(self, "_x_folded", True) and \
                    getattr(self, "_scale", "auto") == "auto" and self.n_iter_ == 0:
                self._scale_inputs_if_better(X, y, sw)
            if self.scaling_ is not None:
                X, y = self.scaling_.transform(X, y)
            if self._unfolded and self.n_iter_ == 0:
                self._start_from_better(X, y, sw)
            val = None
            if self.early_stopping and stop:
                X, y, sw, val = self._split(X, y, sw)
            batch = self._rows(check_batch_size(self.batch_size, X.shape[0]), X.shape[0])
            n_batches = -(-X.shape[0] // batch)
            train = lambda bar: self._epoch(X, y, sw, batch, bar)  # noqa: E731
            validate = None if val is None else lambda: self._validation_loss(*val)  # noqa: E731
        total = None if n_batches is None else (until - self.n_iter_) * n_batches
        bar = tqdm(total=total, unit="step", disable=not self.verbose, leave=True)
        try:
            while self.n_iter_ < until:
                self.train_losses_.append(train(bar))
                self.n_iter_ += 1
                if validate is not None:
                    self.validation_losses_.append(validate())
                bar.set_postfix(epoch=self.n_iter_, loss=f"{self.train_losses_[-1]:.4g}")
                done = stop and self._no_improvement()
                self._save_checkpoint()
                if done:
                    break
        except KeyboardInterrupt:  # NOTE: like scikit-learn's MLP: keep the last completed step, return
            warnings.warn(f"fit interrupted at epoch {self.n_iter_ + 1}; the estimator keeps the weights of the last "
                          f"completed step ({self.runner_.step_count})", UserWarning, stacklevel=3)
        finally:
            bar.close()
            if validate is not None and self._best[2] is not None:
                self.runner_.set_weights(self._best[2])  # NOTE: scikit-learn keeps the best validation weights
            self.trained_model_ = self._export()

    def _scale_inputs_if_better(self, X, y, sw) -> None:
        """Leaves the inputs raw when the model, its input layer not folded (onnxopt.scaling), fits them better
        raw than scaled: a converted pipeline that scales its inputs itself keeps what it learnt."""
        scaled, target = self.scaling_.transform(X, y)
        raw = self.scaling_.without_x()
        if self._validation_loss(X, raw.transform(X, y)[1], sw) < self._validation_loss(scaled, target, sw):
            self.scaling_, self._predictor = raw, None  # NOTE: the predictor wrapped the inputs' scaling

    def _start_from_better(self, X, y, sw) -> None:
        """Keeps the folded initial weights or the unfolded ones (see onnxopt.scaling), whichever fits X better."""
        unfolded = {k: v for k, v in self._unfolded.items() if k in self.runner_.roles.weights}
        folded = {k: v for k, v in self.runner_.get_weights().items() if k in unfolded}
        self._unfolded = {}
        before = self._validation_loss(X, y, sw)
        self.runner_.set_weights(unfolded)
        if not self._validation_loss(X, y, sw) < before:  # NOTE: a NaN loss keeps the folded weights too
            self.runner_.set_weights(folded)

    def _stream(self, data, stop: bool):
        """(train one epoch, validation loss or None, batches per epoch or None) on a stream (``onnxopt.stream``)."""
        if self._kind != "regression" and not hasattr(self, "classes_"):  # NOTE: one pass over the targets
            self._set_classes(np.unique(np.concatenate([np.unique(c[1]) for c in data.chunks(None, None, 65536)])), "y")
        batch = self._rows(check_batch_size(self.batch_size, data.rows or self.batch_size), data.rows)
        if getattr(self, "_columns", None) is not None:  # NOTE: before reading: the columns are known
            check_feature_shape((data.rows or 1, len(self._columns)), self._x_shape, self._columns)
        held = self.early_stopping and stop
        if held and not 0 < self.validation_fraction < 1:
            raise DataError(f"validation_fraction: expected a fraction in (0, 1), got {self.validation_fraction!r}")
        fraction = (self.validation_fraction, self._seed)  # NOTE: held-out rows (stream.held_rows), every epoch

        def block(X, y, sw, b, bar=None):  # NOTE: a last block shorter than a batch is that batch
            return self._epoch(X, y, sw, min(b, len(X)), bar, shuffle=False) if bar is not None \
                else self._validation_loss(X, y, sw)

        def prepare(X, y, sw):  # NOTE: in the reading thread: checks and label encoding off the training thread
            return self._validate(X, y, sw, fit=True)

        def train(bar):
            rng = np.random.default_rng([self._seed, self.n_iter_]) if self.shuffle else None
            part = ("train", *fraction) if held else None
            position, self._position = getattr(self, "_position", None), None
            start = tuple(position[1:]) if position and position[0] == self.n_iter_ else (0, 0.0, 0)
            last = [time.monotonic()]

            def after(blocks, total, rows):  # NOTE: the stream's position, resumed by the next fit (mid-epoch)
                if self.checkpoint_dir is not None and time.monotonic() - last[0] >= stream.CHECKPOINT_SECONDS:
                    self._save_checkpoint(position=[self.n_iter_, blocks, total, rows])
                    last[0] = time.monotonic()

            return stream.epoch(lambda *b: block(*b, bar), data, batch, rng, part, self.runner_.x_dtype, prepare,
                                start, after)[0]

        def validate():
            return stream.epoch(block, data, batch, None, ("validation", *fraction), self.runner_.x_dtype, prepare)[0]

        return train, validate if held else None, -(-data.rows // batch) if data.rows and not data.batched else None

    def _rows(self, batch: int, n: int | None = None) -> int:
        """The rows of one update: ``sync_every`` batches (at most the ``n`` rows of the data)."""
        rows = batch * getattr(self, "sync_every", 1) if getattr(self, "_parallel", None) is not None else batch
        return min(rows, n) if n else rows

    def _epoch(self, X, y, sw, batch: int, bar, shuffle: bool | None = None) -> float:
        n, shuffle = X.shape[0], self.shuffle if shuffle is None else shuffle
        if shuffle:  # NOTE: one shuffle and one gather per epoch; batches below are views of these
            order = np.random.default_rng([self._seed, self.n_iter_]).permutation(n)
            X = X[order]
            y = y[order] if y is not None else None
            sw = sw[order] if sw is not None else None
        step, total, show = self.runner_.step, 0.0, self.verbose > 0
        if sw is None:  # NOTE: the same steps, the full batches of a small model in one run (Runner.epoch)
            try:
                losses = self.runner_.epoch(X, y, batch_size=batch).tolist()
            except ConvergenceError as exc:
                raise ConvergenceError(f"epoch {self.n_iter_ + 1}, {exc}") from exc
            for k, loss in enumerate(losses):
                total += loss * ((min(k * batch + batch, n) - k * batch) / n)
            bar.update(len(losses) if show else 0)
        for k, start in enumerate(range(0, n, batch) if sw is not None else []):
            stop = start + batch
            if not sw[start:stop].any():  # NOTE: a batch of zero weight teaches nothing (0/0)
                continue
            try:
                loss = step(X[start:stop], y[start:stop] if y is not None else None, sw[start:stop])
            except ConvergenceError as exc:
                raise ConvergenceError(f"epoch {self.n_iter_ + 1}, batch {k + 1}: {exc}") from exc
            total += loss * ((min(stop, n) - start) / n)  # NOTE: loss * n_batch alone can overflow near 1e308
            if show:
                bar.update(1)
        try:  # NOTE: a finite last loss can still overflow its update; never save or return such weights
            self.runner_.check_weights()
        except ConvergenceError as exc:
            raise ConvergenceError(f"epoch {self.n_iter_ + 1}, batch {-(-n // batch)}: {exc}") from exc
        return total

    def _split(self, X, y, sw):
        n_val = int(np.ceil(self.validation_fraction * X.shape[0]))
        if not 0 < self.validation_fraction < 1 or n_val >= X.shape[0]:
            raise DataError(f"validation_fraction: expected a fraction in (0, 1) leaving training samples, got "
                            f"{self.validation_fraction!r} for {X.shape[0]} samples")
        train, val = split_index(X.shape[0], self.validation_fraction, self._seed)
        pick = lambda a, i: None if a is None else a[i]  # noqa: E731
        return X[train], pick(y, train), pick(sw, train), (X[val], pick(y, val), pick(sw, val))

    def _validation_loss(self, X, y, sw) -> float:
        ones = np.ones(X.shape[0], self.runner_.dtype)
        feeds = {self.runner_.roles.data[0]: X, "target": y, "sample_weight": ones if sw is None else sw}
        return float(self._run(self._evaluation_session(), feeds))

    def _no_improvement(self) -> bool:
        """scikit-learn's MLP rule: stop after more than n_iter_no_change epochs without a tol improvement."""
        if self.tol is None:
            return False
        current = self.validation_losses_[-1] if self.validation_losses_ and self.early_stopping else self.train_losses_[-1]
        best, count, weights = self._best
        count = count + 1 if current > best - self.tol else 0
        if current < best:
            best = current
            weights = self.runner_.get_weights() if self.early_stopping else None
        self._best = (best, count, weights)
        return count > self.n_iter_no_change

    # -- checkpoints -------------------------------------------------------------------------------------
    def _save_checkpoint(self, position: list | None = None) -> None:
        """Weights, optimizer state and the epoch history in one file, atomic and checksummed; ``position``
        (epoch, blocks, loss sum, rows) of a streamed epoch saved mid-way."""
        if self.checkpoint_dir is None:
            return
        os.makedirs(self.checkpoint_dir, exist_ok=True)
        meta = {"kind": _KIND, "n_iter": self.n_iter_, "seed": self._seed, "train_losses": self.train_losses_,
                "validation_losses": self.validation_losses_, "best": list(self._best[:2]), "position": position,
                "scaled_x": self.scaling_ is not None and self.scaling_.x is not None}
        self.runner_.save_checkpoint(os.path.join(self.checkpoint_dir, _CHECKPOINT), meta)

    def _resume(self) -> None:
        path = None if self.checkpoint_dir is None else os.path.join(self.checkpoint_dir, _CHECKPOINT)
        if path is not None:  # NOTE: writes killed mid-way; the next one may never come (nothing left to train)
            remove_stale(self.checkpoint_dir)
        if path is None or not os.path.exists(path):
            return
        meta = self.runner_.load_checkpoint(path, kind=_KIND)
        self.n_iter_, self._seed = meta["n_iter"], meta["seed"]
        self.train_losses_, self.validation_losses_ = meta["train_losses"], meta["validation_losses"]
        self._best = (*meta["best"], None)
        self._position = meta.get("position")  # NOTE: a streamed epoch saved mid-way resumes there
        if not meta.get("scaled_x", True) and self.scaling_ is not None:  # NOTE: as the first fit chose
            self.scaling_, self._predictor = self.scaling_.without_x(), None

    # -- inference ---------------------------------------------------------------------------------------
    def _raw_predict(self, X) -> np.ndarray:
        if not hasattr(self, "runner_"):
            raise AttributeError(f"This {type(self).__name__} is not fitted yet; call fit first")
        if self._predictor is None:
            self._sessions()
        X = check_features(X, self._x_shape, self.runner_.x_dtype, self.allow_nan)
        return self._run(self._predictor, {self.runner_.roles.data[0]: X})

    def predict(self, X) -> np.ndarray:
        """Predictions of the model with the current weights; class labels for classifiers."""
        out = self._raw_predict(X)
        if self._kind == "regression":
            return out.ravel() if out.ndim == 2 and out.shape[1] == 1 else out
        if self._kind == "binary":
            score = out.reshape(out.shape[0], -1)[:, -1]
            return self.classes_[(score > (0.0 if self._loss.fn is losses.log_logits else 0.5)).astype(int)
                                 if len(self.classes_) == 2 else np.zeros(len(score), int)]
        return self.classes_[out.argmax(axis=1)]

    def score(self, X, y, sample_weight=None) -> float:
        """Accuracy for classifiers, R² (averaged over outputs) for regression."""
        pred = self.predict(X)
        w = None if sample_weight is None else np.asarray(sample_weight, np.float64)
        if self._kind != "regression":
            return float(np.average(pred == np.asarray(y), weights=w))
        t = np.asarray(y, np.float64).reshape(pred.shape)
        mean = np.average(t, axis=0, weights=w)
        res = np.average((t - pred) ** 2, axis=0, weights=w)
        tot = np.average((t - mean) ** 2, axis=0, weights=w)
        return float(np.mean(1 - res / np.where(tot == 0, 1, tot)))


def _in_memory(X) -> bool:
    """Arrays and data frames (scaled, when the model does not scale); streamed sources are not."""
    return hasattr(X, "__array__") and not isinstance(X, np.memmap)


def _saved_step(model) -> TrainStep | None:
    """``model`` as a compiled step: a TrainStep, or the path of one saved by ``TrainStep.save``; else None."""
    if isinstance(model, TrainStep):
        return model
    if isinstance(model, (str, os.PathLike)) and os.path.isfile(model):
        # NOTE: the metadata alone, without the weights (external data), says whether it is a step
        meta = onnx.load(os.fspath(model), load_external_data=False).metadata_props
        if any(p.key == STEP_KEY for p in meta):
            return TrainStep.load(model)
    return None


def split_index(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, validation rows) of early stopping: ceil(fraction * n) rows drawn from ``seed``."""
    order = np.random.default_rng([seed, 2**31]).permutation(n)
    n_val = int(np.ceil(fraction * n))
    return order[n_val:], order[:n_val]


def _floats(a) -> np.ndarray | None:
    """``a`` as float64 for its statistics, None when it is not numeric (labels, strings)."""
    try:
        return None if a is None else np.asarray(a, np.float64)
    except (TypeError, ValueError, OverflowError):  # NOTE: the data checks that follow say what is wrong
        return None


def _task(loss) -> str:
    if loss is None or loss.name not in ("log", "cross_entropy"):
        return "regression"
    return "binary" if loss.name == "log" else "multiclass"


def _seed(random_state) -> int:
    if random_state is None:
        return int(np.random.SeedSequence().entropy % 2**63)
    if isinstance(random_state, np.random.RandomState):
        return int(random_state.randint(2**31))
    return int(random_state)


def _same(a, b) -> bool:
    try:
        return bool(a == b) if not isinstance(a, np.ndarray) else False
    except Exception:  # noqa: BLE001  NOTE: objects whose == does not return a bool are shown
        return False


def _prediction_output(model: onnx.ModelProto, output: str | None, loss_output: str | None) -> str:
    names = [o.name for o in model.graph.output if o.name != loss_output]
    if output is not None:
        if output not in names:
            raise ModelError(f"output: {output!r} is not an output of the model (expected one of {names})")
        return output
    if len(names) != 1:
        raise ModelError(f"output: the model has {len(names)} prediction outputs {names}; pass output= to pick one")
    return names[0]


def _session(model: onnx.ModelProto, outputs: list[str], weights: list[str], dtype) -> ort.InferenceSession:
    """A session computing ``outputs`` only, with ``weights`` as overridable inputs."""
    from onnxopt.ml_rules import drop_zipmap  # NOTE: predictions read the probabilities, not ZipMap's dicts

    m = ir.serde.deserialize_model(drop_zipmap(model))
    keep = [v for v in m.graph.outputs if v.name in outputs]
    m.graph.outputs.clear()
    m.graph.outputs.extend(keep)
    passes.RemoveUnusedNodesPass()(m)
    for value in [v for v in m.graph.inputs if not v.uses() and v.name not in weights]:
        m.graph.inputs.remove(value)
    for name in weights:
        m.graph.inputs.append(m.graph.initializers[name])
    n = sum(int(np.prod(m.graph.initializers[w].shape.numpy())) for w in weights)
    return ort.InferenceSession(ir.to_proto(m).SerializeToString(), default_session_options(n),
                                providers=["CPUExecutionProvider"])
