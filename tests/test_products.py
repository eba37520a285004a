"""Transposes of matrix products moved into the product (passes/products.py).

The reference is onnx's own evaluator on the graph before the rewrite; the attention exports whose backward
pass the rewrite speeds up are checked against torch autograd by zoo/test_torch_zoo.py (its transformer cases).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator

import onnxopt
from onnxopt.passes.products import transposes_into_products

SWAP = [0, 2, 1]


def _model(nodes, outputs):
    graph = oh.make_graph(
        nodes, "products",
        [oh.make_tensor_value_info("A", TensorProto.FLOAT, [2, 3, 4]),
         oh.make_tensor_value_info("B", TensorProto.FLOAT, [2, 4, 5]),
         oh.make_tensor_value_info("s", TensorProto.FLOAT, [])],
        [oh.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=10)
    return onnx.shape_inference.infer_shapes(model)


def _rewritten(model):
    m = ir.from_proto(model)
    count = transposes_into_products(m)
    return count, ir.to_proto(m)


def _run(model, feeds):
    return ReferenceEvaluator(model).run(None, feeds)


@pytest.fixture
def feeds():
    rng = np.random.default_rng(0)
    return {"A": rng.normal(size=(2, 3, 4)).astype(np.float32), "B": rng.normal(size=(2, 4, 5)).astype(np.float32),
            "s": np.array(0.5, np.float32)}


@pytest.mark.parametrize("scale", [None, "right", "left"])
def test_transposed_product_becomes_a_product_of_transposes(feeds, scale):
    """Transpose(A·B [·s]) is (Bᵀ·Aᵀ)[·s]; a Transpose already on an operand cancels."""
    nodes = [oh.make_node("Transpose", ["A"], ["At"], perm=SWAP),  # NOTE: (Aᵀ)ᵀ·... must cancel
             oh.make_node("Transpose", ["At"], ["A2"], perm=SWAP),
             oh.make_node("MatMul", ["A2", "B"], ["p"])]
    if scale:
        nodes.append(oh.make_node("Mul", ["p", "s"] if scale == "right" else ["s", "p"], ["q"]))
    nodes.append(oh.make_node("Transpose", ["q" if scale else "p"], ["Y"], perm=SWAP))
    model = _model(nodes, ["Y"])
    count, new = _rewritten(model)
    assert count == 1
    producers = {o: n.op_type for n in new.graph.node for o in n.output}
    transposes = [n for n in new.graph.node if n.op_type == "Transpose"]
    assert sorted(n.input[0] for n in transposes) == ["A", "B"], [n.op_type for n in new.graph.node]
    np.testing.assert_allclose(_run(new, feeds)[0], _run(model, feeds)[0], rtol=1e-6)


def test_product_read_elsewhere_or_other_perm_is_kept(feeds):
    nodes = [oh.make_node("MatMul", ["A", "B"], ["p"]),
             oh.make_node("Transpose", ["p"], ["Y"], perm=SWAP),
             oh.make_node("Relu", ["p"], ["Z"]),  # NOTE: the product itself is read: no rewrite
             oh.make_node("MatMul", ["A", "B"], ["p2"]),
             oh.make_node("Transpose", ["p2"], ["W"], perm=[1, 0, 2])]  # NOTE: not the last two axes
    model = _model(nodes, ["Y", "Z", "W"])
    count, new = _rewritten(model)
    assert count == 0
    assert [n.op_type for n in new.graph.node] == [n.op_type for n in model.graph.node]


def test_attention_backward_has_no_transposed_product():
    """The backward pass of torch's MultiheadAttention (Q·Kᵀ) transposes no product in the compiled step: each
    would be a copy of the score-shaped gradient."""
    pytest.importorskip("torch")
    from zoo.models import exported

    step = onnxopt.compile_train_step(exported("transformer", "script"), loss="square", mode="eval")
    graph = step.model.graph
    producers = {o: n for n in graph.node for o in n.output}

    def product(name, depth=0):
        node = producers.get(name)
        if node is None or depth > 1:
            return False
        return node.op_type == "MatMul" or (node.op_type == "Mul" and any(product(i, depth + 1) for i in node.input))

    swapped = [n.name for n in graph.node if n.op_type == "Transpose" and product(n.input[0])
               and list(oh.get_attribute_value(n.attribute[0]))[-2:] == [len(n.attribute[0].ints) - 1,
                                                                        len(n.attribute[0].ints) - 2]]
    assert not swapped
