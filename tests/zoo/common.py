"""What the zoo tests share: compiling in a mode, reading the gradient out of a step, running exports."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

import onnxopt
from onnxopt.dsl import op, update_rule


@update_rule
def gradient_out(w, g, lr):
    """An update whose new weight is the gradient: one step of it reads the exact gradient of the step."""
    return op.Identity(g)


@update_rule
def unchanged(w, g, lr):
    """An update that keeps the weights: repeated steps evaluate the same model."""
    return op.Identity(w)


def first_step(model: onnx.ModelProto, mode: str, X, y, **kwargs) -> tuple[float, dict, list[str]]:
    """The loss of the first step and the gradient of every trained weight, by one run of a fused step."""
    step = onnxopt.compile_train_step(model, mode=mode, update=gradient_out, **kwargs)
    runner = onnxopt.Runner(step)
    loss = runner.step(X, y)
    return loss, runner.get_weights(), step.weights


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def assert_same_outputs(original: onnx.ModelProto, trained: onnx.ModelProto) -> None:
    """The trained model passes onnx's full checker and keeps the original's outputs: names and types (a ZipMap
    stays a ZipMap). Callers then run it in an InferenceSession (``predict``)."""
    def outputs(m):
        return [(o.name, o.type.WhichOneof("value"), o.type.tensor_type.elem_type) for o in m.graph.output]

    onnx.checker.check_model(trained, full_check=True)
    assert outputs(trained) == outputs(original), "the exported model changed its outputs"


def predict(model: onnx.ModelProto, X: np.ndarray, output: int = 0) -> np.ndarray:
    """Runs ``model`` in a plain InferenceSession; ZipMap outputs (lists of dicts) become an array."""
    sess = session(model)
    out = sess.run(None, {sess.get_inputs()[0].name: X})[output]
    if isinstance(out, list):
        out = np.array([[row[k] for k in sorted(row)] for row in out])
    return np.asarray(out)


def locate(params: dict, weights: dict[str, np.ndarray], rtol: float = 1e-5) -> dict[str, np.ndarray]:
    """Where every element of every ONNX weight sits in the concatenation of ``params`` (flattened in
    order), found by value.

    Converters rename, transpose, reorder RNN gates and concatenate biases; with random weights each value
    is unique, so a value identifies its parameter element. Raises AssertionError naming a weight that is
    not a parameter (a statistic or an exporter constant trained as a weight).
    """
    flat = np.concatenate([np.asarray(p.detach() if hasattr(p, "detach") else p, np.float64).ravel()
                           for p in params.values()])
    order = np.argsort(flat)
    sorted_vals = flat[order]
    out = {}
    for wname, w in weights.items():
        v = np.asarray(w, np.float64).ravel()
        pos = np.clip(np.searchsorted(sorted_vals, v), 1, len(flat) - 1)
        left, right = sorted_vals[pos - 1], sorted_vals[pos]
        nearest = np.where(np.abs(v - left) <= np.abs(v - right), pos - 1, pos)
        bad = np.abs(sorted_vals[nearest] - v) > rtol * np.abs(v) + 1e-7
        assert not bad.any(), (f"weight {wname!r} (shape {w.shape}) is not a parameter: values like "
                               f"{v[bad][:3]} are in none of {list(params)}")
        out[wname] = order[nearest].reshape(w.shape)
    return out


def central_differences(flat: np.ndarray, assign, loss, h: float = 1e-6) -> np.ndarray:
    """d loss / d flat by central differences; ``assign(values)`` writes the parameters, restored at the end."""
    fd = np.zeros_like(flat)
    try:
        for k in range(len(flat)):
            for sign in (1, -1):
                shifted = flat.copy()
                shifted[k] += sign * h
                assign(shifted)
                fd[k] += sign * loss() / (2 * h)
    finally:
        assign(flat)
    return fd


def assert_gradients(grads: dict[str, np.ndarray], ref: np.ndarray, where: dict[str, np.ndarray], rtol: float,
                     atol: float) -> None:
    """Each weight's gradient against the reference's entries at its places (``locate``)."""
    for wname, g in grads.items():
        np.testing.assert_allclose(g, ref[where[wname]], rtol=rtol, atol=atol, err_msg=f"weight {wname!r}")


def assert_one_to_one(where: dict[str, np.ndarray], params: dict[str, np.ndarray]) -> None:
    """The located weights cover every parameter element exactly once."""
    sizes = {n: int(np.prod(np.shape(p))) for n, p in params.items()}
    found = np.sort(np.concatenate([w.ravel() for w in where.values()]))
    total = sum(sizes.values())
    assert len(found) == total, (f"{len(found)} trained values for {total} parameter values {sizes}; "
                                 f"trained {sorted(where)}")
    np.testing.assert_array_equal(found, np.arange(total), err_msg="a parameter is trained twice")
