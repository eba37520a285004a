"""Bad input and faults: every case of docs/reliability.md raises its onnxopt error or keeps working.

Each test builds the faulty input itself (a cut file, a newer opset, a wrong DSL function...) and checks the
exception type and that its message names the input, what was expected and what was given.
"""

import importlib.util
import os
import pathlib

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest
from onnx import TensorProto, numpy_helper

import onnxopt
from onnxopt import checkpoint, modelio
from onnxopt.dsl import loss, op, update_rule
from onnxopt.errors import CheckpointError, DslError, ModelError, ModelFormatError, ModelVersionError, WeightError
from onnxopt.examples import mlp
from onnxopt.modelio import load_model
from conftest import needs_training_build

X = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
Y = X.sum(axis=1)


def _one_step(model, **kw) -> dict[str, np.ndarray]:
    """Weights after one SGD step on (X, Y)."""
    runner = onnxopt.Runner(onnxopt.compile_train_step(model, loss="square", update="sgd", **kw))
    runner.step(X, Y)
    return runner.get_weights()


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


# -- model files ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"", b"hello, not a model\n" * 3, b"PK\x03\x04" + bytes(range(200))],
                         ids=["empty", "text", "zip"])
def test_not_onnx_file_raises_model_format_error(tmp_path, content):
    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    with pytest.raises(ModelFormatError, match="bad.onnx") as info:
        onnxopt.compile_train_step(path)
    assert "expected" in str(info.value) and ("bytes" in str(info.value) or "ONNX" in str(info.value))


def test_missing_file_raises_model_format_error(tmp_path):
    with pytest.raises(ModelFormatError, match="does not exist"):
        load_model(tmp_path / "nowhere.onnx")


def test_truncated_file_raises_model_format_error(tmp_path):
    data = mlp([4, 8, 1]).SerializeToString()
    path = tmp_path / "cut.onnx"
    for cut in range(1, len(data), 23):
        path.write_bytes(data[:cut])
        with pytest.raises(ModelFormatError, match="cut.onnx|opset") as info:
            load_model(path)
        assert isinstance(info.value, ModelError)


def test_newer_ir_version_is_lowered_when_types_allow():
    model = _copy(mlp([4, 8, 1]))
    model.ir_version = 12
    assert load_model(model).ir_version == modelio.runtime_limits()[0]
    reference = _one_step(mlp([4, 8, 1]))
    for name, value in _one_step(model).items():
        np.testing.assert_array_equal(value, reference[name])


def test_newer_ir_version_with_newer_type_raises_model_version_error():
    model = _copy(mlp([4, 8, 1]))
    model.ir_version = 11
    model.graph.input.append(oh.make_tensor_value_info("packed", TensorProto.FLOAT4E2M1, [4]))
    with pytest.raises(ModelVersionError, match=r"IR version 11 uses types \['FLOAT4E2M1'\].*expected IR version <= 10"):
        load_model(model)


@pytest.mark.skipif(modelio.runtime_limits()[1] >= 23, reason="this onnxruntime loads opset 23 as is")
def test_newer_opset_with_unchanged_ops_is_lowered():
    model = _copy(mlp([4, 8, 1]))
    model.opset_import[0].version = 23
    assert load_model(model).opset_imports[""] == modelio.runtime_limits()[1]
    reference = _one_step(mlp([4, 8, 1]))
    for name, value in _one_step(model).items():
        np.testing.assert_array_equal(value, reference[name])


def _reshape_model(opset: int) -> onnx.ModelProto:
    """Y = Reshape(X @ W, [-1, 1]): Reshape changed in opset 23, so lowering it needs the converter."""
    w = np.linspace(-1, 1, 4, dtype=np.float32).reshape(4, 1)
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["X", "W"], ["h"]), oh.make_node("Reshape", ["h", "shape"], ["Y"])], "g",
        [oh.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
        [oh.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array([-1, 1], np.int64), "shape")])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)], ir_version=11 if opset > 21 else 10)


@pytest.mark.skipif(modelio.runtime_limits()[1] >= 23, reason="this onnxruntime loads opset 23 as is")
def test_newer_opset_with_changed_ops_is_converted():
    lowered = load_model(_reshape_model(23))
    assert lowered.opset_imports[""] == modelio.runtime_limits()[1]
    reference = _one_step(_reshape_model(18))
    np.testing.assert_array_equal(_one_step(_reshape_model(23))["W"], reference["W"])
    # NOTE: one SGD step of a linear model: W - lr * 2/N * X^T (XW - y), computed here without onnxopt
    w0 = np.linspace(-1, 1, 4, dtype=np.float32).reshape(4, 1)
    expected = w0 - 1e-2 * 2 / len(X) * X.T @ (X @ w0 - Y[:, None])
    np.testing.assert_allclose(reference["W"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(modelio.runtime_limits()[1] >= 23, reason="this onnxruntime loads opset 23 as is")
def test_newer_opset_that_cannot_be_lowered_raises_model_version_error():
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["X", "W"], ["h"]), oh.make_node("Attention", ["h", "h", "h"], ["Y"])], "g",
        [oh.make_tensor_value_info("X", TensorProto.FLOAT, [1, 2, 3, 4])],
        [oh.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.eye(4, dtype=np.float32), "W")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 23)], ir_version=11)
    with pytest.raises(ModelVersionError, match=r"opset 23 .*\['Attention'\].*expected opset 18\.\.21"):
        load_model(model)


# -- weights --------------------------------------------------------------------------------------------------
def _no_weight_model() -> onnx.ModelProto:
    graph = oh.make_graph(
        [oh.make_node("Mul", ["X", "X"], ["sq"]), oh.make_node("Reshape", ["sq", "shape"], ["Y"])], "g",
        [oh.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 1])],
        [oh.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(np.array([-1, 1], np.int64), "shape")])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=10)


def test_no_float_initializer_raises_weight_error():
    with pytest.raises(WeightError, match=r"no float initializer to train \(expected at least one.*'shape': 'INT64'"):
        onnxopt.compile_train_step(_no_weight_model())


def test_unknown_weight_name_suggests_close_names():
    with pytest.raises(WeightError, match=r"'coef_O' is not an initializer.*did you mean \[.*'coef_0'"):
        onnxopt.compile_train_step(mlp([4, 8, 1]), weights=["coef_O"])


def test_non_float_weight_raises_weight_error():
    with pytest.raises(WeightError, match=r"'shape' is not a float initializer.*expected FLOAT.*found INT64"):
        onnxopt.compile_train_step(_no_weight_model(), weights=["shape"])


def test_empty_weight_list_raises_weight_error():
    with pytest.raises(WeightError, match=r"expected at least one initializer name, got \[\]"):
        onnxopt.compile_train_step(mlp([4, 1]), weights=[])


def test_op_without_gradient_names_op_type_and_node():
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["X", "W"], ["h"], name="dense"),
         oh.make_node("ReduceProd", ["h"], ["Y"], name="my_prod", keepdims=1)], "g",
        [oh.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
        [oh.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(np.ones((4, 1), np.float32), "W")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=10)
    with pytest.raises(onnxopt.NotDifferentiableError, match=r"ReduceProd \(node 'my_prod'\).*expected") as info:
        onnxopt.compile_train_step(model)
    assert info.value.nodes == [("ReduceProd", "my_prod")]


def test_several_outputs_need_output_argument():
    model = _copy(mlp([4, 8, 1]))
    model.graph.output.append(oh.make_tensor_value_info("bias_0", TensorProto.FLOAT, [8]))
    with pytest.raises(ModelError, match=r"output: the model has 2 outputs \['Y', 'bias_0'\]; pass output="):
        onnxopt.compile_train_step(model)
    with pytest.raises(ModelError, match=r"'Z' is not an output of the model \(expected one of \['Y', 'bias_0'\]\)"):
        onnxopt.compile_train_step(model, output="Z")
    assert onnxopt.compile_train_step(model, output="Y").weights == ["coef_0", "bias_0", "coef_1", "bias_1"]


# -- external data --------------------------------------------------------------------------------------------
def _save_external(tmp_path: pathlib.Path) -> pathlib.Path:
    folder = tmp_path / "model"
    folder.mkdir()
    onnx.save_model(mlp([4, 8, 1]), folder / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.data", size_threshold=0)
    return folder / "m.onnx"


def test_external_data_model_loads_compiles_and_steps(tmp_path, monkeypatch):
    path = _save_external(tmp_path)
    assert os.path.getsize(path.with_name("m.data")) == 4 * (4 * 8 + 8 + 8 + 1)  # every weight is outside
    monkeypatch.chdir(tmp_path)  # NOTE: external data must be found next to the model, not in the cwd
    loaded = load_model(path)
    assert not any(isinstance(v.const_value, ir.ExternalTensor) for v in loaded.graph.initializers.values())
    reference = _one_step(mlp([4, 8, 1]))
    for model in (path, ir.load(path)):
        for name, value in _one_step(model).items():
            np.testing.assert_array_equal(value, reference[name])


def test_external_data_not_loaded_raises_model_format_error(tmp_path, monkeypatch):
    proto = onnx.load(_save_external(tmp_path), load_external_data=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelFormatError, match=r"'coef_0' keeps its data in external file 'm.data'.*expected"):
        onnxopt.compile_train_step(proto)


@needs_training_build
def test_protobuf_limit_is_checked_before_the_gradient_builder(monkeypatch):
    monkeypatch.setattr(modelio, "PROTOBUF_LIMIT", 100)  # the 4-8-1 MLP holds 196 bytes of weights
    with pytest.raises(ModelError, match=r"one serialized protobuf, expected < "):
        onnxopt.compile_train_step(mlp([4, 8, 1]), gradient="builder")


# -- DSL ------------------------------------------------------------------------------------------------------
@loss
def per_sample_loss(y, t):
    d = op.Sub(y, op.Reshape(t, op.Shape(y)))
    return op.Mul(d, d)


@loss
def per_sample_broadcast(y, t):
    d = op.Sub(y, t)
    return op.Mul(d, d)


@pytest.mark.parametrize("fn, shape", [(per_sample_loss, r"\['N', 1\]"), (per_sample_broadcast, r"\[2, 1\]")])
def test_non_scalar_loss_raises_dsl_error_at_compile_time(fn, shape):
    with pytest.raises(DslError, match=rf"loss {fn.name} \(.*test_reliability.py:\d+\): output 0 .*has shape "
                                       rf"{shape}, expected a scalar"):
        onnxopt.compile_train_step(mlp([4, 3, 1]), loss=fn)


def test_update_rule_outputs_must_match_state():
    with pytest.raises(DslError, match=r"update_rule two_states: returns 3 tensors, expected 2 .*\['velocity'\]"):
        @update_rule(state=["velocity"])
        def two_states(w, g, lr, velocity):
            return op.Sub(w, op.Mul(lr, g)), velocity, velocity


def test_update_rule_state_of_wrong_shape_raises_dsl_error():
    @update_rule(state=["velocity"])
    def shrinking(w, g, lr, velocity):
        return op.Sub(w, op.Mul(lr, g)), op.ReduceSum(velocity)

    with pytest.raises(DslError, match=r"update_rule shrinking .*output 1 \(new velocity\) has shape \[1, 1\], "
                                       r"expected \[4, 3\]"):
        onnxopt.compile_train_step(mlp([4, 3, 1]), update=shrinking)


@update_rule
def half_step_f64(w, g, lr):
    return op.Sub(w, op.Mul(op.Constant(value=ir.tensor(np.array(0.5))), op.Mul(lr, g)))


@update_rule
def half_step(w, g, lr):
    return op.Sub(w, op.Mul(op.CastLike(op.Constant(value=ir.tensor(np.array(0.5))), w), op.Mul(lr, g)))


def test_float64_constant_in_float32_rule_raises_dsl_error():
    with pytest.raises(DslError, match=r"update_rule half_step_f64 \(.*test_reliability.py:\d+\): ONNX type .*"
                                       r"w: FLOAT\[4,3\].*inconsistent type.*CastLike"):
        onnxopt.compile_train_step(mlp([4, 3, 1]), update=half_step_f64)
    # the same rule with CastLike compiles and halves the SGD step, in float32 and in float64
    for dtype in (np.float32, np.float64):
        full = onnxopt.Runner(onnxopt.compile_train_step(mlp([4, 1], dtype=dtype), update="sgd"))
        half = onnxopt.Runner(onnxopt.compile_train_step(mlp([4, 1], dtype=dtype), update=half_step))
        w0 = half.get_weights()
        full.step(X.astype(dtype), Y.astype(dtype))
        half.step(X.astype(dtype), Y.astype(dtype))
        for name, w in half.get_weights().items():
            np.testing.assert_allclose(w - w0[name], (full.get_weights()[name] - w0[name]) / 2, rtol=1e-5, atol=1e-7)


def test_float64_constant_in_loss_raises_dsl_error():
    @loss
    def doubled(y, t):
        d = op.Sub(y, op.Reshape(t, op.Shape(y)))
        return op.ReduceMean(op.Mul(op.Constant(value=ir.tensor(np.array(2.0))), op.Mul(d, d)))

    with pytest.raises(DslError, match=r"loss doubled .*inconsistent type"):
        onnxopt.compile_train_step(mlp([4, 1]), loss=doubled)


# -- checkpoints ----------------------------------------------------------------------------------------------
def _arrays():
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": np.array(7, np.int64),
            "v": np.linspace(0, 1, 5)}


def _expected(arrays):
    return {k: (v.shape, v.dtype) for k, v in arrays.items()}


def test_checkpoint_round_trip_keeps_bits_shapes_and_meta(tmp_path):
    arrays = _arrays()
    checkpoint.save_arrays(tmp_path / "c.ckpt", arrays, {"step": 7, "note": "x"})
    loaded, meta = checkpoint.load_arrays(tmp_path / "c.ckpt", _expected(arrays))
    assert meta == {"step": 7, "note": "x"}
    for name, value in arrays.items():
        assert loaded[name].dtype == value.dtype and loaded[name].shape == value.shape
        np.testing.assert_array_equal(loaded[name], value)
    assert os.listdir(tmp_path) == ["c.ckpt"]  # no temporary file left


def test_truncated_or_corrupted_checkpoint_is_refused(tmp_path):
    path = tmp_path / "c.ckpt"
    checkpoint.save_arrays(path, _arrays(), {})
    data = path.read_bytes()
    for cut in range(0, len(data), 17):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated|not an onnxopt checkpoint"):
            checkpoint.load_arrays(path)
    for pos in range(len(checkpoint.MAGIC), len(data), 13):
        flipped = bytearray(data)
        flipped[pos] ^= 0x01
        path.write_bytes(bytes(flipped))
        with pytest.raises(CheckpointError, match="truncated or corrupted"):
            checkpoint.load_arrays(path)


def test_checkpoint_with_wrong_content_is_refused(tmp_path):
    path = tmp_path / "c.ckpt"
    arrays = _arrays()
    checkpoint.save_arrays(path, arrays, {})
    np.savez(tmp_path / "plain.npz", **arrays)
    with pytest.raises(CheckpointError, match="not an onnxopt checkpoint"):
        checkpoint.load_arrays(tmp_path / "plain.npz")
    with pytest.raises(CheckpointError, match=r"1 missing, e.g. \['u'\]; 1 unexpected, e.g. \['v'\]"):
        checkpoint.load_arrays(path, {**{k: v for k, v in _expected(arrays).items() if k != "v"},
                                      "u": ((5,), np.float64)})
    with pytest.raises(CheckpointError, match=r"'w' is float32\[3, 4\], expected float32\[4, 3\]"):
        checkpoint.load_arrays(path, {**_expected(arrays), "w": ((4, 3), np.float32)})
    with pytest.raises(CheckpointError, match=r"'v' is float64\[5\], expected float32\[5\]"):
        checkpoint.load_arrays(path, {**_expected(arrays), "v": ((5,), np.float32)})


def test_failed_checkpoint_write_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "c.ckpt"
    checkpoint.save_arrays(path, _arrays(), {"version": 1})
    before = path.read_bytes()

    def crash(fd):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_arrays(path, {"w": np.zeros(3)}, {"version": 2})
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["c.ckpt"]


def test_runner_refuses_bad_checkpoint_and_keeps_its_weights(tmp_path):
    step = onnxopt.compile_train_step(mlp([4, 8, 1]), loss="square", update="adam")
    runner = onnxopt.Runner(step)
    runner.step(X, Y)
    runner.save_checkpoint(tmp_path / "good.ckpt")
    runner.step(X, Y)
    weights, state = runner.get_weights(), runner.get_state()
    data = (tmp_path / "good.ckpt").read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) - 40])
    other = onnxopt.Runner(onnxopt.compile_train_step(mlp([4, 5, 1]), loss="square", update="adam"))
    other.save_checkpoint(tmp_path / "other.ckpt")
    sgd = onnxopt.Runner(onnxopt.compile_train_step(mlp([4, 8, 1]), loss="square", update="sgd"))
    sgd.save_checkpoint(tmp_path / "sgd.ckpt")
    for name, match in [("cut", "truncated or corrupted"), ("other", r"'coef_0' is float32\[4, 5\], expected "
                        r"float32\[4, 8\]"), ("sgd", r"8 missing, e.g. \['coef_0.exp_avg'")]:
        with pytest.raises(CheckpointError, match=match):
            runner.load_checkpoint(tmp_path / f"{name}.ckpt")
        for key, value in {**runner.get_weights(), **runner.get_state()}.items():
            np.testing.assert_array_equal(value, {**weights, **state}[key])
    runner.load_checkpoint(tmp_path / "good.ckpt")
    assert runner.step_count == 1


# -- soak -----------------------------------------------------------------------------------------------------
def _soak_module():
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "soak.py"
    spec = importlib.util.spec_from_file_location("soak", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_short_soak_reuses_runner_buffers():
    result = _soak_module().soak(steps=3_000, every=500, warmup=500)
    assert result["runner_ortvalues_same_objects"] and result["runner_ortvalues"] > 0
    assert result["live_ortvalues_end"] == result["live_ortvalues_after_warmup"]
    assert result["finite"] and result["losses"][-1] < result["losses"][0]


@pytest.mark.slow
def test_soak_200k_steps_memory_flat():
    result = _soak_module().soak(steps=200_000, every=10_000, warmup=10_000)
    assert result["rss_growth_pct"] < 5, result
    assert result["runner_ortvalues_same_objects"] and result["finite"], result
    assert result["live_ortvalues_end"] == result["live_ortvalues_after_warmup"], result
