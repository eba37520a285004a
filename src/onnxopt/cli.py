"""The ``onnxopt`` command line: demo, compile, fit, show, bench.

Wrong arguments (a missing file, a bad spec, an unknown name) print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import csv
import inspect
import os
import sys
import time
from collections import Counter
from typing import Any

import numpy as np

from onnxopt import atomic
from onnxopt.errors import DataError, OnnxoptError
from onnxopt.scaling import SCALE_MODES
from onnxopt.stream import as_stream

__all__ = ["main"]

SPEC_HELP = "NAME or NAME:k=v,k2=v2 (see `onnxopt compile --list`)"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``onnxopt compile: error: ... (see --help)``."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Fail(Exception):
    """A command-line mistake found by a command: printed as one line, exit code 2."""


# -- shared option helpers --------------------------------------------------------------------------------
def _learning_rate(text: str) -> float | str:
    """``--lr``: a float, or a schedule spec such as ``invscaling:eta0=0.05``."""
    try:
        return float(text)
    except ValueError:
        return text


def _tol(text: str) -> float | None:
    """``--tol``: a float or ``none``."""
    return None if text.lower() == "none" else float(text)


_tol.__name__ = "tolerance"  # NOTE: argparse names the type in its error: "invalid tolerance value"


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Examples kept as written, every option's default shown."""


def _add_training_options(p: argparse.ArgumentParser, update: str = "sgd", lr: float = 1e-2) -> None:
    p.add_argument("--loss", default="auto",
                   help=f"loss, {SPEC_HELP}; auto: for a classifier converted by skl2onnx (an int64 or string "
                        "label output), the cross-entropy of its scores or probabilities (the log loss for one "
                        "column); else square")
    p.add_argument("--loss-output", default=None,
                   help="the model already outputs its loss under this name (no --loss then)")
    p.add_argument("--update", default=update, help=f"update rule, {SPEC_HELP}")
    p.add_argument("--penalty", default=None, help=f"penalty on every trained weight, {SPEC_HELP}")
    p.add_argument("--lr", "--learning-rate", dest="lr", type=_learning_rate, default=lr,
                   help="learning rate: a float or a schedule spec, e.g. invscaling:eta0=0.05")
    p.add_argument("--weights", default=None, help="comma-separated initializers to train (default: every weight)")
    p.add_argument("--output", default=None, help="the model output the loss reads when there are several")
    p.add_argument("--frozen", default=None, help="comma-separated initializers never trained")
    p.add_argument("--gradient", default=None, choices=["onnxopt", "builder", "auto"],
                   help="where the backward graph comes from: onnxopt's own rules or onnxruntime-training's builder "
                        "(Python <= 3.12) (default: auto = $ONNXOPT_GRADIENT, else onnxopt; docs/gradients.md)")
    p.add_argument("--mode", default="train", choices=["train", "eval"],
                   help="train: Dropout active, BatchNorm on batch statistics, its running statistics updated; "
                        "eval: both as at inference")


def _training_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from onnxopt.resolve import resolve_loss, resolve_penalty, resolve_schedule, resolve_update

    # NOTE: resolving here rejects a bad spec before any model is loaded.
    loss = None if args.loss_output else args.loss if args.loss == "auto" else resolve_loss(args.loss)
    return dict(loss=loss, update=resolve_update(args.update), penalty=resolve_penalty(args.penalty),
                learning_rate=resolve_schedule(args.lr),
                weights=args.weights.split(",") if args.weights else None, output=args.output,
                loss_output=args.loss_output, mode=args.mode, gradient=args.gradient,
                frozen=args.frozen.split(",") if args.frozen else None)


def _check_ext(path: str, exts: tuple[str, ...], what: str) -> str:
    if os.path.splitext(path)[1].lower() not in exts:
        raise _Fail(f"{what}: expected a file ending in {' or '.join(exts)}, got {path!r}")
    return path


def _check_exists(path: str, what: str) -> str:
    if not os.path.isfile(path):
        raise _Fail(f"{what}: file {path!r} does not exist")
    return path


# -- compile ----------------------------------------------------------------------------------------------
def _list_registries() -> int:
    from onnxopt.dsl import losses, penalties, schedules, updates

    for title, registry in (("losses (--loss)", losses.LOSSES), ("updates (--update)", updates.UPDATES),
                            ("penalties (--penalty)", penalties.PENALTIES),
                            ("schedules (--lr)", schedules.SCHEDULES)):
        print(title)
        for name, factory in registry.items():
            params = ", ".join(f"{p.name}={p.default!r}" for p in inspect.signature(factory).parameters.values())
            doc = (inspect.getdoc(factory) or "").splitlines()[0]
            print(f"  {name:<14} {params}")
            print(f"  {'':<14} {doc}")
    print("spec form: NAME:k=v,k2=v2, e.g. --update nesterov:momentum=0.9 --lr invscaling:eta0=0.05,power_t=0.25")
    return 0


def _regions(model) -> str:
    from onnxopt.draw import _region

    counts = Counter(_region(n) for n in model.graph.node)
    return ", ".join(f"{r} {counts[r]}" for r in ("forward", "loss", "backward", "penalty", "schedule", "update",
                                                   "other") if counts[r])


def _compile(args: argparse.Namespace) -> int:
    if args.list:
        return _list_registries()
    if args.model is None or args.out is None:
        raise _Fail("compile: MODEL and -o STEP.onnx are required (or --list)")
    from onnxopt import compile_train_step
    from onnxopt.fuse import explain_train_step
    from onnxopt.stages import format_report
    from onnxopt.tasks import choose_loss

    kwargs = _training_kwargs(args)
    atomic.check_writable(_check_ext(args.out, (".onnx",), "-o"), "-o")
    kwargs["loss"], kwargs["output"] = choose_loss(_check_exists(args.model, "MODEL"), kwargs["loss"], args.output)
    if args.explain:
        step, report = explain_train_step(args.model, portable=args.portable or args.js, **kwargs)
        print(format_report(report))
    else:
        step = compile_train_step(args.model, portable=args.portable or args.js, **kwargs)
    if args.js:
        from onnxopt.ship import for_js

        step = for_js(step)
    step.save(args.out)
    print(f"wrote {args.out}: {len(step.model.graph.node)} nodes ({_regions(step.model)})")
    print(f"inputs:  {', '.join(i.name for i in step.model.graph.input)}")
    print(f"outputs: {', '.join(o.name for o in step.model.graph.output)}")
    print(f"weights: {', '.join(step.weights)}")
    if step.buffers:
        print(f"running statistics: {', '.join(step.buffers)}")
    return 0


# -- fit --------------------------------------------------------------------------------------------------
def load_data(path: str, target: str | None, features: list[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Reads (X, y) from a .npz (arrays ``X`` and ``target`` or ``y``) or a .csv with a header row (``features``
    names its feature columns, in the model's order; default: every column but ``target``); a Parquet file or
    folder is returned as ``(path, None)``, streamed by the Trainer (``onnxopt.stream``)."""
    if os.path.isfile(os.path.join(path, "X.npy")):  # NOTE: `onnxopt convert`'s arrays, streamed as memmaps
        return path, None
    if os.path.isdir(path) or path.lower().endswith(".parquet"):
        if target is None:
            raise _Fail(f"--target: a Parquet DATA needs its target column named, got none for {path!r}")
        return _check_exists(path, "DATA") if os.path.isfile(path) else path, None
    _check_exists(path, "DATA")
    if _check_ext(path, (".npz", ".csv"), "DATA").lower().endswith(".npz"):
        if features is not None:  # NOTE: silently ignored, it would train on every column of X
            raise _Fail(f"--features: names columns of a .csv or Parquet DATA, got {path!r}, whose X has none "
                        "(select the columns of X before saving it)")
        with np.load(path) as arrays:
            name = target or "y"
            missing = [k for k in ("X", name) if k not in arrays.files]
            if missing:
                raise DataError(f"DATA: {path!r} has arrays {arrays.files}, expected 'X' and {name!r} "
                                f"(--target names the target array)")
            return arrays["X"], arrays[name]
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    if not rows:
        raise DataError(f"DATA: {path!r} is empty, expected a header row then numbers")
    header = [h.strip() for h in rows[0]]
    if target not in header:
        raise DataError(f"--target: expected one of the columns {header} of {path!r}, got {target!r}")
    lines = [(i, row) for i, row in enumerate(rows[1:], start=2) if row]
    if not lines:
        raise DataError(f"DATA: {path!r} has a header and no data rows, expected at least one row of numbers")
    for i, row in lines:
        if len(row) != len(header):
            raise DataError(f"DATA: {path!r} line {i} has {len(row)} values, expected {len(header)} like the header")
    col = header.index(target)
    named = features is not None
    if not named:
        features = [k for k in range(len(header)) if k != col]
    else:  # NOTE: it was ignored for a CSV, which then trained on every column but the target
        unknown = [name for name in features if name not in header]
        if unknown or target in features or len(set(features)) != len(features):
            what = f"{unknown} not among them" if unknown else \
                "the target among them" if target in features else "names repeated"
            raise DataError(f"--features: expected distinct columns of {path!r} {header} other than --target "
                            f"{target!r}, got {features} ({what})")
        features = [header.index(name) for name in features]
    empty = next((i for i, row in lines if not row[col].strip()), None)
    if empty is not None:  # NOTE: else read as a class label "" and refused as text by a regression
        raise DataError(f"DATA: {path!r} line {empty}, column {target!r} (--target): expected a number or a class "
                        "label, got a missing value (fill or drop it, e.g. pandas' fillna/dropna)")
    try:
        X = np.array([[_number(row[k]) for k in features] for _, row in lines], dtype=np.float64)
    except ValueError:
        i, k, v = next((i, k, row[k]) for i, row in lines for k in features if not _is_number(row[k]))
        what = "a missing value (fill or drop it, e.g. pandas' fillna/dropna)" if not v.strip() else repr(v)
        which = "a --features column" if named else "every column but --target is a feature"
        raise DataError(f"DATA: {path!r} line {i}, column {header[k]!r}: expected a number or True/False "
                        f"({which}), got {what}") from None
    labels = [row[col].strip() for _, row in lines]  # NOTE: numbers, or a classifier's labels as they are
    return X, np.array([_number(v) for v in labels], np.float64) if all(map(_is_number, labels)) else np.array(labels)


def _csv_hint(message: str, args: argparse.Namespace, X: np.ndarray, y: np.ndarray, features) -> str:
    """A Trainer's DataError on arrays read from a CSV, with the columns or the value it is about."""
    if message.startswith("y: expected numbers") and y.dtype.kind in "USO":
        j = next((j for j, v in enumerate(y) if not _is_number(str(v))), None)
        return message if j is None else \
            f"{message}: column {args.target!r} (--target) holds {str(y[j])!r} in data row {j + 1}"
    wide = message.startswith("X: expected") and "values on axis 1" in message
    if not wide and not message.startswith(("X: expected finite values", "y: expected finite values")):
        return message
    if features is None:
        with open(args.data, newline="", encoding="utf-8") as f:
            columns = [h for h in (h.strip() for h in next(csv.reader(f))) if h != args.target]
    if wide:
        return f"{message} from the {len(features)} --features columns {features}" if features is not None else \
            f"{message} from the {len(columns)} feature columns {columns} (name the model's with --features)"
    names = (features or columns) if message[0] == "X" else [args.target]
    arr = np.asarray(X if message[0] == "X" else y, np.float64).reshape(len(X), -1)
    bad = np.argwhere(~np.isfinite(arr))
    if not len(bad):  # NOTE: finite as read, infinite once cast to a float32 model's type
        over = np.argwhere(np.abs(arr) > np.finfo(np.float32).max)
        if not len(over):  # NOTE: another type's overflow (float16): the Trainer's own message
            return message
        i, j = (int(v) for v in over[0])
        return (f"DATA: {args.data!r} data row {i + 1}, column {names[j]!r}: {arr[i, j]:g} is infinite as the "
                f"model's float32, expected a finite number (rescale or drop that row)")
    i, j = (int(v) for v in bad[0])
    return (f"DATA: {args.data!r} data row {i + 1}, column {names[j]!r}: expected a finite number, got "
            f"{arr[i, j]} (replace or drop that row)")


_BOOLEANS = {"true": 1.0, "false": 0.0}  # NOTE: what pandas writes for a bool column (Parquet keeps it boolean)


def _number(text: str) -> float:
    """A CSV feature value: a number, or True/False as 1/0."""
    key = text.strip().lower()
    return _BOOLEANS[key] if key in _BOOLEANS else float(text)


def _is_number(text: str) -> bool:
    try:
        _number(text)
    except ValueError:
        return False
    return True


def _fit(args: argparse.Namespace) -> int:
    from onnxopt import Trainer
    from onnxopt.errors import CheckpointError

    kwargs = _training_kwargs(args)
    atomic.check_writable(_check_ext(args.out, (".onnx",), "-o"), "-o")
    if args.checkpoint:
        atomic.check_writable(args.checkpoint, "--checkpoint", folder=True)
    _check_exists(args.model, "MODEL")
    features = args.features.split(",") if args.features else None
    X, y = load_data(args.data, args.target, features)  # NOTE: the Trainer casts them to the model's dtype
    if args.workers < 1:
        raise _Fail(f"--workers: expected an integer >= 1, got {args.workers}")
    if args.sync_every < 1:
        raise _Fail(f"--sync-every: expected an integer >= 1, got {args.sync_every}")
    if not 0 <= args.validation_fraction < 1:
        raise _Fail(f"--validation-fraction: expected a fraction in [0, 1), got {args.validation_fraction}")
    done = _checkpoint_epochs(args.checkpoint)
    if done is not None and done >= args.epochs:
        raise _Fail(f"--checkpoint: {args.checkpoint!r} already holds {done} epochs, --epochs is {args.epochs}: "
                    "nothing left to train; raise --epochs or use a new --checkpoint folder")
    if args.workers > 1 and "WORLD_SIZE" not in os.environ:
        return _launch(args)
    rank = int(os.environ.get("RANK", 0))  # NOTE: under a launcher, rank 0 alone prints and writes
    if rank:  # NOTE: its warnings too (every rank meets the same data)
        import warnings

        warnings.simplefilter("ignore")
    if done is not None and rank == 0:
        print(f"resuming from the checkpoint in {args.checkpoint} after epoch {done}")
    est = Trainer(args.model, batch_size=args.batch_size, max_iter=args.epochs, random_state=args.seed,
                  verbose=0 if args.quiet or rank else 1, checkpoint_dir=args.checkpoint, tol=args.tol,
                  early_stopping=args.validation_fraction > 0, validation_fraction=args.validation_fraction or 0.1,
                  n_iter_no_change=args.n_iter_no_change, scale=args.scale, sync_every=args.sync_every,
                  compress=args.compress, device=args.device, **kwargs)
    t0 = time.perf_counter()
    if y is None:  # NOTE: opened once (the Trainer reads a small source whole and trains it as arrays)
        X = as_stream(X, features=features, target=args.target)
        if not X.small and getattr(X, "scalars", False) and not rank and not args.quiet:
            print(f"hint: {args.data} is decoded from {len(X.features)} Parquet columns every epoch; `onnxopt convert "
                  f"{args.data} --target {args.target} -o DIR` writes it row-major (.npy), which `onnxopt fit` streams "
                  "without decoding", file=sys.stderr)
    try:
        est.fit(X, y, features=features if y is None else None, target=args.target if y is None else None)
    except CheckpointError as exc:
        raise _Fail(f"{exc}; use a new --checkpoint folder for another model or optimizer") from exc
    except DataError as exc:  # NOTE: arrays from a CSV: name its columns, as a Parquet DATA's errors do
        if y is None or not args.data.lower().endswith(".csv"):
            raise
        raise DataError(_csv_hint(str(exc), args, X, y, features)) from exc
    seconds = time.perf_counter() - t0
    if y is None and X.small:  # NOTE: read again for the metrics below
        X, y, _ = X.read_all()
    if rank:
        return 0
    atomic.write(args.out, est.trained_model_.SerializeToString())
    _print_losses(est.train_losses_)
    early = f" (stopped early: improvement below --tol {args.tol})" if est.n_iter_ < args.epochs else ""
    trained = est.n_iter_ - (done or 0)
    n = len(X) if y is not None else X.rows
    print(f"trained {trained} epochs{early} on {n} samples in {seconds:.2f} s; wrote {args.out}")
    if y is not None:  # NOTE: a streamed source is read once more by its metrics: not here
        _print_metrics(est, X, y, args.validation_fraction)
    return 0

def _convert(args: argparse.Namespace) -> int:
    from onnxopt.stream import write_npy

    source = as_stream(load_data(args.data, args.target)[0], features=args.features.split(",") if args.features
                       else None, target=args.target)
    print(f"wrote {write_npy(source, args.out)} rows to {args.out} (X.npy, y.npy)")
    return 0


# NOTE: torch.distributed.run's agent, ending with the failed rank's exit code instead of its ChildFailedError
# traceback and error log (the rank has printed its own one-line error)
_AGENT = """import logging, sys
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run
logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
for name in list(logging.root.manager.loggerDict):
    if name.startswith("torch.distributed.elastic"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
try:
    run(parse_args(sys.argv[1:]))
except ChildFailedError as exc:
    code = exc.get_first_failure()[1].exitcode
    sys.exit(code if code > 0 else 128 - code)
"""


def _launch(args: argparse.Namespace) -> int:
    """Runs this command again on ``--workers`` local ranks through ``torch.distributed.run`` (gloo)."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("torch") is None:  # NOTE: not imported here: ~3 s the agent and the ranks pay anyway
        raise _Fail(f"--workers: {args.workers} ranks need torch, which is not installed "
                    "(pip install -e '.[torch]' in the repository)")
    env = {**os.environ, "ONNXOPT_TIMEOUT": str(args.timeout), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", _AGENT, "--standalone", f"--nproc-per-node={args.workers}", "--module", "onnxopt",
           *args.argv]
    code = subprocess.call(cmd, env=env)
    if code:
        print(f"onnxopt fit: error: a rank of {args.workers} failed (exit code {code}); see its message above",
              file=sys.stderr)
    return code

def _checkpoint_epochs(folder: str | None) -> int | None:
    """The epochs a Trainer checkpoint in ``folder`` holds, None without one."""
    from onnxopt.checkpoint import load_arrays

    path = os.path.join(folder, "trainer.ckpt") if folder else None
    if folder:  # NOTE: as the Trainer's resume does: a refused resume trains (and writes) nothing
        atomic.remove_stale(folder)
    return load_arrays(path)[1].get("n_iter") if path and os.path.isfile(path) else None


def _print_metrics(est, X: np.ndarray, y: np.ndarray, fraction: float) -> None:
    """The final line: the loss's metric on the training and validation rows (the Trainer's split)."""
    from onnxopt.tasks import metrics
    from onnxopt.trainer import split_index

    train, val = split_index(len(X), fraction, est._seed) if fraction > 0 else (np.arange(len(X)), None)
    parts = {"train": metrics(est, X[train], y[train])}
    if val is not None:
        parts["validation"] = metrics(est, X[val], y[val])
    print("; ".join(f"{name} ({len(rows)} rows): " + ", ".join(f"{k} {v:.4f}" for k, v in m.items())
                    for (name, m), rows in zip(parts.items(), (train, val))))
    if est._kind == "regression" and parts["train"]["R²"] < 0.05:
        print("hint: the loss stays at the target's variance (R² near 0: the model predicts the mean); try "
              "--scale always, another --lr (e.g. 10 times larger or smaller) or more --epochs")

def _print_losses(losses, us_per_step: list[float] | None = None) -> None:
    print(f"{'epoch':>5}  {'mean loss':>12}" + (f"  {'us/step':>8}" if us_per_step else ""))
    for i, loss in enumerate(losses):
        print(f"{i + 1:>5}  {loss:>12.6g}" + (f"  {us_per_step[i]:>8.1f}" if us_per_step else ""))


# -- show -------------------------------------------------------------------------------------------------
def _show(args: argparse.Namespace) -> int:
    import onnx

    from onnxopt.draw import FORMATS, render
    from onnxopt.modelio import load_model

    atomic.check_writable(_check_ext(args.out, FORMATS, "-o"), "-o")
    # NOTE: loaded through load_model for its one-line errors; drawn from the file's own proto.
    load_model(_check_exists(args.model, "MODEL"), "MODEL")
    written, done = render(onnx.load(args.model, load_external_data=False), args.out, title=args.title)
    if done:
        print(f"wrote {written}")
    else:
        print(f"graphviz `dot` is not on PATH: wrote {written}; install graphviz (apt-get install graphviz, "
              f"brew install graphviz) and run `dot -T{os.path.splitext(args.out)[1][1:]} {written} -o {args.out}`")
    return 0


# -- bench ------------------------------------------------------------------------------------------------
def _bench(argv: list[str]) -> int:
    import importlib

    try:
        bench = importlib.import_module("onnxopt.bench")
    except ImportError as exc:
        raise _Fail(f"bench: the benchmark suite onnxopt.bench is not available ({exc})") from exc
    try:
        return int(bench.main(argv) or 0)
    except SystemExit as exc:  # NOTE: its own argparse: --help exits 0, a usage error 2
        return int(exc.code or 0)


# -- demo -------------------------------------------------------------------------------------------------
def _demo_model(X: np.ndarray, y: np.ndarray, sizes: list[int], seed: int, use_sklearn: bool):
    """The demo's MLP: scikit-learn's MLPRegressor converted with skl2onnx when both are installed."""
    if use_sklearn:
        try:
            import warnings

            from skl2onnx import to_onnx
            from sklearn.neural_network import MLPRegressor
        except ImportError:
            pass
        else:
            reg = MLPRegressor(hidden_layer_sizes=tuple(sizes[1:-1]), random_state=seed)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                reg.partial_fit(X[:1], y[:1])  # NOTE: only to draw the initial weights; onnxopt trains them
            return to_onnx(reg, X[:1], target_opset=18), "scikit-learn MLPRegressor converted by skl2onnx"
    from onnxopt.examples import mlp

    return mlp(sizes, seed=seed), "onnxopt.examples.mlp"


def _plot(curves: dict[str, list[float]], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    for label, values in curves.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", markersize=3, label=label)
    ax.set(xlabel="epoch", ylabel="mean training loss", yscale="log", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic.save_figure(fig, path)
    plt.close(fig)
    return True


def _demo(args: argparse.Namespace) -> int:
    from onnxopt import Trainer, dsl

    atomic.check_writable(args.out, "--out", folder=True)
    rng = np.random.default_rng(args.seed)
    n = args.samples + args.samples // 4  # NOTE: a fifth of the data is held out for the R² printed at the end
    X_all = rng.normal(size=(n, args.features)).astype(np.float32)
    coef = rng.normal(size=args.features).astype(np.float32)
    y_all = (np.tanh(X_all @ coef / np.sqrt(args.features)) * 3 + 0.1 * rng.normal(size=n)).astype(np.float32)
    X, y = X_all[:args.samples], y_all[:args.samples]
    model, source = _demo_model(X, y, [args.features, 50, 10, 1], args.seed, not args.no_sklearn)
    print(f"model: {source}, {args.features}-50-10-1; data: {args.samples} samples, synthetic regression")
    est = Trainer(model, loss="square", update=dsl.updates.nesterov(momentum=0.9),
                  learning_rate=dsl.schedules.invscaling(eta0=args.lr, power_t=0.25), batch_size=args.batch_size,
                  max_iter=args.epochs, random_state=args.seed, verbose=0 if args.quiet else 1)
    t0 = time.perf_counter()
    est.fit(X, y)
    fit_seconds = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    written = [os.path.join(args.out, "train_step.onnx"), os.path.join(args.out, "trained.onnx")]
    est.train_step_.save(written[0])
    atomic.write(written[1], est.trained_model_.SerializeToString())
    # NOTE: per-step time measured on the fitted runner, one more pass over the data after training.
    runner, times = est.runner_, []
    for i in range(0, args.samples - args.batch_size + 1, args.batch_size):
        t = time.perf_counter()
        runner.step(X[i:i + args.batch_size], y[i:i + args.batch_size])
        times.append(time.perf_counter() - t)
    _print_losses(est.train_losses_)
    steps = est.n_iter_ * -(-args.samples // args.batch_size)
    print(f"fit: {fit_seconds:.2f} s for {steps} steps, compile included; "
          f"one step: {np.median(times) * 1e6:.1f} us (median of {len(times)})")
    if n > args.samples:
        print(f"R² on {n - args.samples} held-out samples: {est.score(X_all[args.samples:], y_all[args.samples:]):.3f}")
    png = os.path.join(args.out, "loss.png")
    if _plot({"onnxopt": list(est.train_losses_)}, png, "onnxopt demo: MLP, Nesterov, invscaling"):
        written.append(png)
    else:
        print("matplotlib is not installed: no loss.png (pip install -e '.[demo]' in the repository)")
    print("wrote " + ", ".join(written))
    return 0


# -- parser -----------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="onnxopt", formatter_class=_Formatter,
                     description="Compile the training step of an ONNX model into one ONNX graph and run it.",
                     epilog="examples:\n  onnxopt demo\n  onnxopt compile --list\n"
                            "  onnxopt compile model.onnx --update nesterov:momentum=0.9 -o step.onnx\n"
                            "  onnxopt fit model.onnx data.csv --target y -o trained.onnx\n"
                            "  onnxopt show step.onnx -o step.svg\n  onnxopt bench --help")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", formatter_class=_Formatter, help="train an MLP on synthetic data (no download)",
                          description="Synthetic regression, an MLP (skl2onnx-converted when installed), "
                                      "trained with Nesterov momentum and an invscaling learning rate.",
                          epilog="examples:\n  onnxopt demo\n  onnxopt demo --epochs 5 --out /tmp/demo --quiet")
    demo.add_argument("--out", default="onnxopt-demo", help="folder for train_step.onnx, trained.onnx, loss.png")
    demo.add_argument("--epochs", type=int, default=15, help="epochs (no early stopping)")
    demo.add_argument("--samples", type=int, default=750, help="training samples (and a quarter more held out)")
    demo.add_argument("--features", type=int, default=100, help="features per sample")
    demo.add_argument("--batch-size", type=int, default=15, help="samples per step")
    demo.add_argument("--lr", type=float, default=5e-3, help="eta0 of the invscaling schedule")
    demo.add_argument("--seed", type=int, default=0, help="random state of the data, weights and shuffling")
    demo.add_argument("--no-sklearn", action="store_true", help="use onnxopt.examples.mlp even if skl2onnx exists")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.set_defaults(func=_demo)

    comp = sub.add_parser("compile", formatter_class=_Formatter, help="compile a model's training step into STEP.onnx",
                          description="Fuse forward, loss, backward, penalty, schedule and update into one graph.",
                          epilog="examples:\n  onnxopt compile --list\n"
                                 "  onnxopt compile model.onnx --loss square --update nesterov:momentum=0.9 \\\n"
                                 "      --penalty elastic:l1=0.1,l2=0.9 --lr invscaling:eta0=0.05 -o step.onnx\n"
                                 "  onnxopt compile with_loss.onnx --loss-output loss --update adam -o step.onnx\n"
                                 "  onnxopt compile model.onnx --loss cross_entropy --portable -o step.onnx\n"
                                 "  onnxopt compile model.onnx --loss cross_entropy --js -o step.onnx\n"
                                 "  onnxopt compile model.onnx --explain -o step.onnx")
    comp.add_argument("model", nargs="?", metavar="MODEL.onnx", help="the inference model")
    comp.add_argument("-o", dest="out", metavar="STEP.onnx", help="where to write the fused step")
    comp.add_argument("--list", action="store_true", help="list losses, updates, penalties, schedules and exit")
    comp.add_argument("--explain", action="store_true",
                      help="print the compiler's stages: nodes each added and removed, and its time")
    comp.add_argument("--portable", action="store_true",
                      help="standard ONNX only: the step runs on stock onnxruntime (Python 3.13+, onnxruntime-gpu) "
                           "and onnx.reference, see docs/portable.md")
    comp.add_argument("--js", action="store_true",
                      help="for the npm package onnxopt (Node, browsers): --portable, plus the step's epoch form in "
                           "the file, see docs/js.md")
    _add_training_options(comp, update="adam", lr=3e-3)  # NOTE: fit's defaults, for a step fit trains elsewhere
    comp.set_defaults(func=_compile)

    fit = sub.add_parser("fit", formatter_class=_Formatter, help="train a model on .npz, .csv or Parquet data",
                         description="Train MODEL on DATA: a .npz with arrays X and y, a .csv with a header "
                                     "(every column but --target is a feature, or the --features), or a Parquet file or folder, "
                                     "streamed with bounded memory (--target, --features name its columns).",
                         epilog="examples:\n  onnxopt fit model.onnx data.npz -o trained.onnx\n"
                                "  onnxopt fit model.onnx data.parquet --target y --workers 2 -o trained.onnx\n"
                                "  onnxopt fit model.onnx data.csv --target price --epochs 20 --batch-size 64 \\\n"
                                "      --update adam --lr 0.001 --checkpoint ckpt/ -o trained.onnx")
    fit.add_argument("model", metavar="MODEL.onnx", help="the inference model, or a step from onnxopt compile")
    fit.add_argument("data", metavar="DATA",
                     help=".npz (arrays X and y), .csv with a header row, or a Parquet file or folder (streamed)")
    fit.add_argument("--target", default=None, help="target column (.csv, required) or array (.npz, default y)")
    fit.add_argument("-o", dest="out", required=True, metavar="TRAINED.onnx", help="where to write the model")
    fit.add_argument("--epochs", "--max-iter", dest="epochs", type=int, default=200,
                     help="epochs at most (scikit-learn's MLP max_iter)")
    fit.add_argument("--batch-size", type=int, default=32, help="samples per step")
    fit.add_argument("--seed", "--random-state", dest="seed", type=int, default=0,
                     help="random state of the shuffling and the validation split")
    fit.add_argument("--tol", type=_tol, default=1e-4,
                     help="stop when the validation loss (the training loss with --validation-fraction 0) improves "
                          "by less than this for --n-iter-no-change epochs (scikit-learn's); 'none' runs every epoch")
    fit.add_argument("--n-iter-no-change", type=int, default=10,
                     help="epochs without an improvement of --tol before training stops (scikit-learn's)")
    fit.add_argument("--validation-fraction", type=float, default=0.1,
                     help="rows held out (as scikit-learn's early stopping): training stops on their loss and keeps "
                          "the best weights; 0 trains on every row")
    fit.add_argument("--scale", choices=SCALE_MODES, default="auto",
                     help="standardize inputs and regression targets for training (the written model reads raw "
                          "ones); auto: when a column's std is outside [0.1, 10] or its mean beyond ±3")
    fit.add_argument("--checkpoint", "--checkpoint-dir", dest="checkpoint", metavar="DIR", default=None,
                     help="save a checkpoint each epoch and resume from it when present")
    fit.add_argument("--quiet", action="store_true", help="no progress bar")
    fit.add_argument("--features", default=None, help="comma-separated feature columns of a .csv or Parquet "
                     "DATA, in the model's order (default: every column but --target)")
    fit.add_argument("--workers", type=int, default=1, help="local ranks training data-parallel on "
                     "torch.distributed (gloo); --batch-size stays the global batch")
    fit.add_argument("--sync-every", type=int, default=1, metavar="K",
                     help="accumulate the gradients of K batches before each update (the weights of one process "
                          "with K times --batch-size; fewer all-reduces under --workers)")
    fit.add_argument("--compress", choices=["bf16", "fp16"], default=None,
                     help="send the ranks' gradients as 16-bit floats (over gloo; not bit-equal to one process)")
    fit.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                     help="where the step runs: cuda needs onnxruntime-gpu's CUDAExecutionProvider")
    fit.add_argument("--timeout", type=float, default=300.0,
                     help="seconds a rank waits for the others before stopping with an error")
    _add_training_options(fit, update="adam", lr=3e-3)
    fit.set_defaults(func=_fit)

    conv = sub.add_parser("convert", formatter_class=_Formatter, help="write a Parquet DATA as .npy arrays that "
                          "fit streams without decoding", description="Write the rows of a Parquet DATA, in order, as "
                          "OUT/X.npy and OUT/y.npy: rows side by side, read by `onnxopt fit model.onnx OUT` as memmaps.")
    conv.add_argument("data", metavar="DATA", help="a Parquet file or folder")
    conv.add_argument("--target", required=True, help="the target column")
    conv.add_argument("--features", default=None, help="comma-separated feature columns (default: all but --target)")
    conv.add_argument("-o", dest="out", required=True, metavar="OUT", help="the folder to write")
    conv.set_defaults(func=_convert)

    show = sub.add_parser("show", formatter_class=_Formatter, help="draw a (fused) graph, regions coloured",
                          description="Draw MODEL with graphviz `dot`, nodes coloured by region (forward, loss, "
                                      "backward, penalty, schedule, update); without dot, write the .dot text.",
                          epilog="examples:\n  onnxopt show step.onnx -o step.svg\n"
                                 "  onnxopt show model.onnx -o model.dot")
    show.add_argument("model", metavar="MODEL.onnx", help="any ONNX model, a fused step included")
    show.add_argument("-o", dest="out", required=True, metavar="OUT", help="OUT.svg, OUT.png or OUT.dot")
    show.add_argument("--title", default=None, help="title drawn above the graph")
    show.set_defaults(func=_show)

    sub.add_parser("bench", add_help=False, help="run the benchmark suite (`onnxopt bench --help` for its options)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``onnxopt`` console script; returns the exit code."""
    parser = _parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if args.command != "bench" and extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help (0) or a usage error, already printed on one line (2)
        return int(exc.code or 0)
    try:
        args.argv = list(sys.argv[1:] if argv is None else argv)
        return _bench(extra) if args.command == "bench" else args.func(args)
    except ImportError as exc:  # NOTE: compiling on Python 3.13+ (no onnxruntime-training), missing extras
        print(f"onnxopt {args.command}: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    except (_Fail, OnnxoptError, OSError, ValueError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        # NOTE: under --workers every rank meets the same bad input: rank 0 says it; a rank's own failure
        # (DistributedError: a peer died, hung or disagrees) is said by each rank
        if int(os.environ.get("RANK", 0)) == 0 or type(exc).__name__ == "DistributedError":
            print(f"onnxopt {args.command}: error: {message}", file=sys.stderr)
        return 2
    except Exception as exc:  # NOTE: onnxruntime's own errors (not RuntimeError subclasses): one line, exit 1
        if not type(exc).__module__.startswith("onnxruntime") or os.environ.get("ONNXOPT_TRACEBACK"):
            raise
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        print(f"onnxopt {args.command}: error: onnxruntime: {first} (with a valid model and data, an onnxopt bug: "
              "please report it; ONNXOPT_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        return 1
