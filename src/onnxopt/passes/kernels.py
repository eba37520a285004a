"""Update rules run by onnxruntime-training's optimizer kernels (non-portable float32 steps only). The DSL
rule stays the definition; a kernel stands in for it only where it computes the same formula:

- ``adam_rule`` (``adam``, ``adamw``) -> ``com.microsoft::AdamOptimizer`` (do_bias_correction=1,
  weight_decay_mode=0: ``w - lr·(m̂/(√v̂ + eps) + λ·w)``, torch's AdamW): one kernel instead of ~20;
- ``w - lr·g`` left in an update after ``fuse_update`` (SGD on a bias, momentum's last step) ->
  ``com.microsoft::SGDOptimizer`` (``w + (-lr·g)``, bit for bit the same): 1 kernel instead of 2.

A kernel writes over an input it aliases unless the output is a graph output: the passes make sure no run
changes its graph inputs (the Runner's rollback relies on it).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRule

from onnxopt import graphs
from onnxopt.dsl.core import UpdateRule
from onnxopt.dsl.updates import adam_rule
from onnxopt.step import STEP

__all__ = ["optimizer_kernels", "sgd_kernel_rules"]

MS = "com.microsoft"


def _aliased_safely(inputs: list[ir.Value], outputs: list[ir.Value]) -> bool:
    """Whether each output is a graph output or may take over its input's buffer (read by the kernel alone)."""
    return all(out.is_graph_output() or (inp.producer() is not None and len(inp.uses()) == 1)
               for inp, out in zip(inputs, outputs))


def optimizer_kernels(model: ir.Model, rule: UpdateRule, dtype: ir.DataType) -> int:
    """Replaces the call of the built-in Adam rule in ``model`` (before inlining: the pack, or a single weight)
    by an ``AdamOptimizer`` node; returns how many. Other rules, per-weight calls, steps of another ``dtype``
    than float32 (the kernel's only one) and calls whose outputs could alias an input are kept."""
    if rule.fn is not adam_rule or dtype != ir.DataType.FLOAT:
        return 0
    g = model.graph
    step = next(v for v in g.inputs if v.name == STEP)
    calls = [n for n in g if n.op_type == adam_rule.name and n.domain == adam_rule.function_ir.domain
             and n.name.startswith("update/")]
    if len(calls) != 1:  # NOTE: each kernel writes t + 1 over its count, and CSE would merge per-call counts
        return 0
    attrs = rule.call_attrs()
    done = 0
    for node in calls:
        w, grad, lr, m, v, _t = node.inputs
        if not _aliased_safely([w, m, v], node.outputs):
            continue
        tape, meta = ir.tape.Tape(), dict(node.metadata_props)
        # NOTE: the kernel reads the 1-based step t and writes t + 1 over it (an alias): t gets its own Add,
        # never the carried counter ``optim.step.new`` (a graph output); its [1] constant keeps CSE from merging them
        one = tape.op("Constant", [], {"value": ir.tensor(np.array([1], np.int64))}, metadata_props=meta)
        count = tape.op("Add", [step, one], metadata_props=meta)
        _, m_new, v_new, w_new = tape.op_multi_out(
            "AdamOptimizer", [lr, count, w, grad, m, v], {
                "alpha": float(attrs["beta1"]), "beta": float(attrs["beta2"]), "epsilon": float(attrs["eps"]),
                "lambda": float(attrs["weight_decay"]), "do_bias_correction": 1, "weight_decay_mode": 0},
            num_outputs=4, domain=MS, name=node.name, metadata_props=meta)
        g.insert_before(node, tape.nodes)
        for old, new in zip(node.outputs, [w_new, m_new, v_new]):
            new.type, new.shape = old.type, old.shape
            ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        g.remove(node, safe=True)
        model.opset_imports.setdefault(MS, 1)
        done += 1
    return done


def _sgd(op, w, lr, g):
    return op.Sub(w, op.Mul(lr, g), _outputs=["new"])


def _sgd_swapped(op, w, lr, g):
    return op.Sub(w, op.Mul(g, lr), _outputs=["new"])


def _sgd_check(context, w, lr, g, new, **_) -> MatchResult:
    result = MatchResult()
    if not new.producer().metadata_props.get(graphs.REGION, "").startswith("update"):
        return result.fail("not an update: a model's own x - c·y keeps its ops")
    if any(v.dtype != ir.DataType.FLOAT for v in (w, lr, g)):
        return result.fail("the kernel is float32 only")
    if lr.shape is None or lr.shape.rank() > 1 or (lr.shape.rank() == 1 and lr.shape[0] != 1):
        return result.fail(f"the learning rate has shape {lr.shape}, expected one value")
    if w.shape is None or w.shape != g.shape or new.shape != w.shape:
        return result.fail(f"weight {w.shape} and gradient {g.shape} differ (the kernel does not broadcast)")
    if not _aliased_safely([w], [new]):
        return result.fail("the kernel would write the new weight over an input it shares")
    return result


def _sgd_kernel(op, w, lr, g, new):
    return op.SGDOptimizer(lr, w, g, _domain=MS)


# NOTE: applied by ``fuse_update(model, kernels=True)`` after its Gemm rules, which fold an update entirely
sgd_kernel_rules = [RewriteRule(_sgd, _sgd_kernel, _sgd_check, name="SGDKernel"),
                    RewriteRule(_sgd_swapped, _sgd_kernel, _sgd_check, name="SGDKernelSwapped")]
