"""passes/tie.py on three-node models: a transposed copy and a plain copy are tied (and run the same), equal
constants and distinct values are not, the dynamo export's record names the source, tie=False unties."""

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import onnxopt
from helpers import session
from onnxopt.passes.tie import FOLDED_FROM, retarget, tie_parameters

RNG = np.random.default_rng(0)
A = RNG.normal(size=(5, 3)).astype(np.float32)


def _model(b: np.ndarray, c: np.ndarray, record: str | None = None) -> ir.Model:
    """Y = Gather(A, ids) @ B + C: A the table, B (3, 5), C (5,)."""
    m = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (int64[N] ids) => (float[N, 5] Y) {
            h = Gather(A, ids)
            z = MatMul(h, B)
            Y = Add(z, C)
        }""")
    for name, value in (("A", A), ("B", b), ("C", c)):
        v = ir.Value(name=name, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(value.shape),
                     const_value=ir.tensor(value, name=name))
        m.graph.register_initializer(v)
        for node in m.graph:
            for i, x in enumerate(node.inputs):
                if x is not None and x.name == name:
                    node.replace_input_with(i, v)
    if record:
        m.graph.initializers["B"].metadata_props[FOLDED_FROM] = record
    return m


def _run(m: ir.Model) -> np.ndarray:
    return session(ir.to_proto(m)).run(None, {"ids": np.array([0, 3, 4])})[0]


def test_transposed_copy_is_tied_and_runs_the_same():
    m = _model(A.T.copy(), np.zeros(5, np.float32))
    before = _run(m)
    assert tie_parameters(m) == {"B": "A"}
    assert [n.op_type for n in m.graph] == ["Transpose", "Gather", "MatMul", "Add"]
    assert sorted(m.graph.initializers) == ["A", "C"]
    onnx.checker.check_model(ir.to_proto(m), full_check=True)
    np.testing.assert_array_equal(_run(m), before)


def test_constants_and_distinct_values_are_not_tied():
    m = _model(RNG.normal(size=(3, 5)).astype(np.float32), np.ones(5, np.float32))
    m.graph.initializers["A"].const_value = ir.tensor(np.ones((5, 3), np.float32), name="A")
    assert tie_parameters(m) == {}
    assert tie_parameters(_model(A.T.copy(), np.zeros(5, np.float32)), tie=False) == {}


def test_record_names_the_source_and_is_checked():
    assert tie_parameters(_model(A.T.copy(), np.zeros(5, np.float32), record="['A']")) == {"B": "A"}
    wrong = _model(A.T.copy() + 1, np.zeros(5, np.float32), record="['A']")  # NOTE: a record whose values differ
    assert tie_parameters(wrong) == {}
    assert retarget(["C", "B", "A"], {"B": "A"}) == ["C", "A"] and retarget(None, {}) is None


def test_parts_and_repeats_are_tied_and_run_the_same():
    """B = A[::-1]^T (a folded flip of a parameter), C = elements of A's second column repeated (as a folded
    ``repeat_interleave``): each becomes a Gather of A's elements; a 0/1 table is not taken for a part of a
    parameter holding 0 and 1."""
    m = _model(A[::-1].T.copy(), A[[0, 0, 2, 2, 4], 1].copy())
    before = _run(m)
    assert tie_parameters(m) == {"B": "A", "C": "A"}
    assert sorted(n.op_type for n in m.graph) == ["Add", "Gather", "Gather", "Gather", "MatMul", "Reshape", "Reshape"]
    onnx.checker.check_model(ir.to_proto(m), full_check=True)
    np.testing.assert_array_equal(_run(m), before)
    b = RNG.normal(size=(3, 5)).astype(np.float32)
    table = A.copy()
    table.flat[:2] = [0.0, 1.0]
    mask = _model(b, np.array([0, 1, 1, 0, 1], np.float32))
    mask.graph.initializers["A"].const_value = ir.tensor(table, name="A")
    assert tie_parameters(mask) == {}


@pytest.mark.parametrize("tie", [True, False])
def test_tied_gradient_is_the_sum(tie):
    """compile_train_step against the gradient by hand: tied, A's is its Gather part plus B's transposed;
    untied, B is a weight of its own."""
    from zoo.common import gradient_out

    C = RNG.normal(size=5).astype(np.float32)
    m = ir.to_proto(_model(A.T.copy(), C))
    ids, y = np.array([0, 3, 3]), RNG.normal(size=(3, 5)).astype(np.float32)
    step = onnxopt.compile_train_step(m, loss="square", update=gradient_out, weights=["A", "B", "C"], tie=tie)
    runner = onnxopt.Runner(step)
    runner.step(ids, y)
    grads = runner.get_weights()
    h = A[ids].astype(np.float64)
    dY = 2 * (h @ A.T + C - y) / y.size
    gather = np.zeros_like(h, shape=A.shape)
    np.add.at(gather, ids, dY @ A)
    np.testing.assert_allclose(grads["C"], dY.sum(axis=0), rtol=1e-5, atol=1e-7)
    if tie:
        assert step.weights == ["A", "C"]
        np.testing.assert_allclose(grads["A"], gather + (h.T @ dY).T, rtol=1e-5, atol=1e-7)
    else:
        np.testing.assert_allclose(grads["A"], gather, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(grads["B"], h.T @ dY, rtol=1e-5, atol=1e-7)
