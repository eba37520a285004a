"""One small class per competitor: ``setup(workload, X, y, weights)`` then ``epoch() -> per-step losses``.

Each trains the same model from the same initial weights on the same batches, with the same update rule,
and reports how many session runs and graph nodes a step costs. A competitor whose package is missing,
or which cannot express the workload, raises ``Skipped`` with the reason.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import tempfile
import time

import numpy as np
import onnx

from onnxopt.bench.memory import rss
from onnxopt.bench.workloads import Workload

__all__ = ["Skipped", "Competitor", "COMPETITORS", "REFERENCES", "ort_kernels", "runner_model"]



@contextlib.contextmanager
def _stderr_to_devnull():
    """File descriptor 2 points to /dev/null inside the block (C++ logging writes there, not to sys.stderr)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)

class Skipped(Exception):
    """The competitor cannot run this workload here; the message says why."""


def ort_kernels(model: onnx.ModelProto | str, threads: int = 1) -> int:
    """Nodes ORT runs for ``model`` after its graph optimizations (ORT_ENABLE_ALL): kernels per run, or per
    iteration of the ``Scan`` of an epoch model (``Runner.epoch``)."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as d:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.intra_op_num_threads = threads
        opts.optimized_model_filepath = os.path.join(d, "optimized.onnx")
        src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
        ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])
        nodes = onnx.load(opts.optimized_model_filepath).graph.node
        scan = next((n for n in nodes if n.op_type == "Scan"), None)
        return len(nodes if scan is None else next(a.g.node for a in scan.attribute if a.name == "body"))


def _mlp_only(wl: Workload) -> None:
    if wl.arch:
        raise Skipped("set up for the MLP workloads only (W1-W5)")


class Competitor:
    """Common interface; ``session_runs`` and ``nodes`` per step are None where they do not apply."""

    name = "?"
    session_runs: float | None = None
    nodes: int | None = None
    note = ""

    def setup(self, wl: Workload, X: np.ndarray, y: np.ndarray, weights: dict[str, np.ndarray]) -> None:
        raise NotImplementedError

    def epoch(self) -> list[float]:
        raise NotImplementedError

    def _batches(self, X, y, batch):
        self.batches = [(X[i:i + batch], y[i:i + batch]) for i in range(0, len(X), batch)]


class Onnxopt(Competitor):
    """onnxopt's fused step run by ``Runner``: ``Runner.epoch`` (as ``Trainer`` trains: the batches of a small
    model in one session run, an ONNX Scan), else one ``step`` per batch."""

    name = "onnxopt"
    per_step = False
    gradient = "onnxopt"

    def setup(self, wl, X, y, weights):
        import onnxopt
        from onnxopt.gradient import has_training_build

        if self.gradient == "builder" and not has_training_build():
            raise Skipped("gradient='builder' needs onnxruntime-training (Python <= 3.12)")
        step = onnxopt.compile_train_step(wl.model(), loss=wl.loss, update=_onnxopt_update(wl.update),
                                          learning_rate=wl.lr, gradient=self.gradient)
        # NOTE: counted before the memory baseline: the counting session's memory is not the runner's
        self.nodes = ort_kernels(runner_model(step, wl.batch, wl.threads), wl.threads)
        self.rss_before = rss()  # NOTE: the runner's memory is measured from here, after compiling
        self.runner = onnxopt.Runner(step, batch_size=wl.batch)
        self.X, self.y = X, y
        self.looped = not self.per_step and hasattr(self.runner, "epoch")
        if self.looped:
            self.note = "epoch() per epoch: its full batches in one run (ONNX Scan)"
            if self.runner._size * wl.batch < onnxopt.runner.SMALL_STEP:  # NOTE: per step: the Scan's body
                self.runner._epochs.session()
                self.nodes = ort_kernels(self.runner._epochs.model, wl.threads)
            else:
                self.note = "epoch(): one step per batch (a large step)"
        else:
            # NOTE: use the runner's deferred-loss path when it has one (losses read once per epoch)
            params = inspect.signature(self.runner.step).parameters
            self.deferred = "read_loss" in params and hasattr(self.runner, "sync")
            self.note = "step(read_loss=False) + sync() per epoch" if self.deferred else "step() per batch"
        self._batches(X, y, wl.batch)

    def epoch(self):
        runner = self.runner
        before = getattr(runner, "n_runs", None)
        if self.looped:
            losses = runner.epoch(self.X, self.y).tolist()
        elif self.deferred:
            for xb, yb in self.batches:
                runner.step(xb, yb, read_loss=False)
            losses = list(runner.sync())
        else:
            losses = [runner.step(xb, yb) for xb, yb in self.batches]
        if before is not None:
            self.session_runs = (runner.n_runs - before) / len(self.batches)
        return losses

    def weights(self):
        return self.runner.get_weights()


class OnnxoptStep(Onnxopt):
    """The same Runner driven one ``step(read_loss=False)`` per batch, losses read once per epoch."""

    name = "onnxopt step()"
    per_step = True


class OnnxoptBuilder(Onnxopt):
    """The same Runner on a step whose backward graph comes from onnxruntime-training's builder."""

    name = "onnxopt, builder gradient"
    gradient = "builder"


def runner_model(step, batch_size: int = 32, threads: int = 1) -> onnx.ModelProto:
    """The model the Runner runs on CPU (``runner.cpu_model``: packs bound, the loss's batch bookkeeping out)."""
    from onnxopt.runner import cpu_model

    return cpu_model(step, batch_size, threads).model


def _onnxopt_update(update: str):
    from onnxopt import dsl

    return {"sgd": dsl.updates.sgd(), "nesterov": dsl.updates.nesterov(momentum=0.9),
            "adam": dsl.updates.adam(eps=1e-8)}[update]


class TorchEager(Competitor):
    """PyTorch eager: nn.Sequential of Linear/ReLU, torch.optim; losses read once per epoch."""

    name = "torch eager"
    compiled = False

    def setup(self, wl, X, y, weights):
        try:
            import torch
        except ImportError as exc:
            raise Skipped("torch is not installed (pip install -e '.[bench]' in the repository)") from exc
        torch.set_num_threads(wl.threads)
        self.torch = torch
        layers = []
        n_layers = 0 if wl.arch else len(wl.sizes) - 1
        for k in range(n_layers):
            suffix = f"_{k}" if n_layers > 1 else ""
            lin = torch.nn.Linear(wl.sizes[k], wl.sizes[k + 1])
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(weights["coef" + suffix].T.copy()))
                lin.bias.copy_(torch.from_numpy(np.array(weights["bias" + suffix])))
            layers += [lin, torch.nn.ReLU()]
        # NOTE: a real model is the module onnxopt's export came from, its seed giving the same initial weights
        self.model = wl.network().train() if wl.arch else torch.nn.Sequential(*layers[:-1])
        params = self.model.parameters()
        self.opt = {"sgd": lambda: torch.optim.SGD(params, lr=wl.lr),
                    "nesterov": lambda: torch.optim.SGD(params, lr=wl.lr, momentum=0.9, nesterov=True),
                    "adam": lambda: torch.optim.Adam(params, lr=wl.lr, eps=1e-8)}[wl.update]()
        self.loss_fn = {"regression": torch.nn.MSELoss(), "binary": torch.nn.BCEWithLogitsLoss(),
                        "multiclass": torch.nn.CrossEntropyLoss()}[wl.task]
        yt = torch.from_numpy(y) if wl.task == "multiclass" else torch.from_numpy(y).reshape(-1, 1)
        self.forward = self.model
        if self.compiled:
            self._compile(wl, X, yt)
        self._batches(torch.from_numpy(X), yt, wl.batch)
        self.nodes = self._count_ops()

    def _compile(self, wl, X, yt):
        t0 = time.perf_counter()
        try:
            self.forward = self.torch.compile(self.model)
            self._throwaway(lambda: self._step(self.torch.from_numpy(X[:wl.batch]), yt[:wl.batch]))
        except Exception as exc:  # noqa: BLE001  (any backend failure means "does not work here")
            first = (str(exc).splitlines() or [""])[0][:100]
            raise Skipped(f"torch.compile failed: {type(exc).__name__}: {first}") from exc
        self.note = f"compile {time.perf_counter() - t0:.0f} s (model; optimizer eager)"

    def _throwaway(self, fn) -> None:
        """Runs ``fn`` (a step), then puts weights and optimizer state back: training still starts at step 1."""
        import copy

        saved = copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.opt.state_dict())
        fn()
        self.model.load_state_dict(saved[0])
        self.opt.load_state_dict(saved[1])
        self.opt.state.clear()

    def _step(self, xb, yb):
        self.opt.zero_grad()
        loss = self.loss_fn(self.forward(xb), yb)
        loss.backward()
        self.opt.step()
        return loss.detach()

    def _count_ops(self) -> int | None:
        """aten ops dispatched by one step (forward, backward, update), on a throwaway step."""
        if self.compiled:
            return None
        from torch.utils._python_dispatch import TorchDispatchMode

        class Count(TorchDispatchMode):
            n = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                Count.n += 1
                return func(*args, **(kwargs or {}))

        def counted():
            with Count():
                self._step(*self.batches[0])

        self._throwaway(counted)
        return Count.n

    def epoch(self):
        return self.torch.stack([self._step(xb, yb) for xb, yb in self.batches]).tolist()

    def weights(self):
        out = {}
        linears = [m for m in self.model.modules() if isinstance(m, self.torch.nn.Linear)]
        for k, lin in enumerate(linears):
            suffix = f"_{k}" if len(linears) > 1 else ""
            out["coef" + suffix] = lin.weight.detach().numpy().T.copy()
            out["bias" + suffix] = lin.bias.detach().numpy().copy()
        return out


class TorchCompile(TorchEager):
    """PyTorch with ``torch.compile`` on the model (inductor, CPU); skipped by --quick (compiling takes ~30 s)."""

    name = "torch.compile"
    compiled = True


class OrtTraining(Competitor):
    """ONNX Runtime on-device training: generate_artifacts + api.Module/Optimizer/CheckpointState."""

    name = "ORT on-device"

    def setup(self, wl, X, y, weights):
        try:
            import onnxruntime as ort
            from onnxruntime.training import artifacts, onnxblock
            from onnxruntime.training.api import CheckpointState, Module, Optimizer
        except ImportError as exc:
            raise Skipped(f"onnxruntime.training.api is not importable: {exc}") from exc
        _mlp_only(wl)
        if wl.update == "nesterov":
            raise Skipped("ORT on-device training offers SGD and AdamW only (no momentum/Nesterov)")
        ort.set_default_logger_severity(3)
        model = wl.model()
        loss = {"regression": artifacts.LossType.MSELoss, "binary": artifacts.LossType.BCEWithLogitsLoss,
                "multiclass": artifacts.LossType.CrossEntropyLoss}[wl.task]
        optim = (artifacts.OptimType.SGD if wl.update == "sgd"
                 else onnxblock.optim.AdamW(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0))
        self._dir = tempfile.TemporaryDirectory(prefix="onnxopt-bench-")
        d = self._dir.name
        with _stderr_to_devnull():  # NOTE: its gradient builder logs ~140 INFO lines whatever ORT's severity
            artifacts.generate_artifacts(model, requires_grad=[i.name for i in model.graph.initializer], loss=loss,
                                         optimizer=optim, artifact_directory=d)
        for f in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
            m = onnx.load(os.path.join(d, f))
            m.ir_version = 10  # NOTE: onnx 1.19 writes IR 12 for the optimizer model; ORT 1.19 reads up to 10
            onnx.save(m, os.path.join(d, f))
        self.nodes = sum(ort_kernels(os.path.join(d, f), wl.threads) for f in ("training_model.onnx",
                                                                                 "optimizer_model.onnx"))
        self.state = CheckpointState.load_checkpoint(os.path.join(d, "checkpoint"))
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = wl.threads
        opts.inter_op_num_threads = 1
        self.module = Module(os.path.join(d, "training_model.onnx"), self.state, device="cpu",
                             session_options=opts)
        self.opt = Optimizer(os.path.join(d, "optimizer_model.onnx"), self.module)
        self.opt.set_learning_rate(wl.lr)
        self.module.train()
        self.session_runs = 2  # NOTE: the training session, then the optimizer session
        self.note = "AdamW(weight_decay=0), HF-style eps" if wl.update == "adam" else ""
        self._batches(X, y if wl.task == "multiclass" else y.reshape(-1, 1), wl.batch)

    def epoch(self):
        losses = []
        for xb, yb in self.batches:
            losses.append(float(self.module(xb, yb)))
            self.opt.step()
            self.module.lazy_reset_grad()
        return losses

    def weights(self):
        return {name: self.state.parameters[name].data.copy() for name in self.state.parameters}


class Sklearn(Competitor):
    """scikit-learn's MLPRegressor/MLPClassifier, one ``partial_fit`` per epoch (its own batch loop).

    Its squared error is halved, so SGD gets twice the learning rate; it reports one mean loss per epoch.
    """

    name = "scikit-learn"

    def setup(self, wl, X, y, weights):
        try:
            from sklearn.neural_network import MLPClassifier, MLPRegressor
        except ImportError as exc:
            raise Skipped("scikit-learn is not installed") from exc
        _mlp_only(wl)
        from threadpoolctl import threadpool_limits

        self.limits = threadpool_limits(wl.threads)
        regression = wl.task == "regression"
        lr = wl.lr * 2 if regression and wl.update != "adam" else wl.lr
        cls = MLPRegressor if regression else MLPClassifier
        self.est = cls(hidden_layer_sizes=wl.sizes[1:-1], activation="relu", alpha=0.0, batch_size=wl.batch,
                       learning_rate_init=lr, solver="adam" if wl.update == "adam" else "sgd", shuffle=False,
                       momentum=0.9 if wl.update == "nesterov" else 0.0,
                       nesterovs_momentum=wl.update == "nesterov",
                       epsilon=1e-8)
        yy = y.astype(np.int64) if wl.task == "binary" else y
        kwargs = {} if regression else {"classes": np.arange(max(2, wl.sizes[-1]))}
        self.est.partial_fit(X[:wl.batch], yy[:wl.batch], **kwargs)  # NOTE: builds its state; weights reset below
        n_layers = len(wl.sizes) - 1
        for k in range(n_layers):
            suffix = f"_{k}" if n_layers > 1 else ""
            self.est.coefs_[k][...] = weights["coef" + suffix]
            self.est.intercepts_[k][...] = weights["bias" + suffix]
        del self.est._optimizer  # NOTE: a fresh optimizer (zero velocity/moments) on the next partial_fit
        self.est.loss_curve_ = []
        self.scale = 2.0 if regression else 1.0
        self.X, self.y = X, yy
        self.note = "one mean loss per epoch"

    def epoch(self):
        self.est.partial_fit(self.X, self.y)
        return [self.est.loss_curve_[-1] * self.scale]


class Matmul(Competitor):
    """A reference, not a trainer: one plain float32 matmul of the workload's biggest layer per step (``wl.layer``),
    timed in the same rounds as the trainers, for the GFLOP/s share of W3 and W5."""

    reference = True

    def setup(self, wl, X, y, weights):
        m, k, n = wl.layer
        rng = np.random.default_rng(0)
        self.a, self.b = (rng.normal(size=s).astype(np.float32) for s in ((m, k), (k, n)))
        self.steps = wl.steps
        self._setup(wl.threads)

    def epoch(self):
        for _ in range(self.steps):
            self._matmul()
        return []


class NumpyMatmul(Matmul):
    """numpy's BLAS (OpenBLAS here), limited to the workload's threads."""

    name = "numpy matmul"

    def _setup(self, threads):
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:  # NOTE: comes with scikit-learn; without it numpy keeps its own thread count
            return
        self.limits = threadpool_limits(threads)

    def _matmul(self):
        self.a @ self.b


class OrtMatmul(Matmul):
    """ORT's own MatMul kernel (MLAS) in a one-node session with the workload's threads."""

    name = "ORT MatMul (MLAS)"

    def _setup(self, threads):
        import onnxruntime as ort
        from onnx import TensorProto, helper

        k, n = self.b.shape
        graph = helper.make_graph([helper.make_node("MatMul", ["A", "B"], ["Y"])], "matmul",
                                  [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k]),
                                   helper.make_tensor_value_info("B", TensorProto.FLOAT, [k, n])],
                                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.log_severity_level = threads, 3
        self.sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        self.feeds = {"A": self.a, "B": self.b}

    def _matmul(self):
        self.sess.run(None, self.feeds)


COMPETITORS = [Onnxopt, OnnxoptBuilder, OnnxoptStep, TorchEager, TorchCompile, OrtTraining, Sklearn]
REFERENCES = [NumpyMatmul, OrtMatmul]  # NOTE: timed with the trainers on W3 and W5
