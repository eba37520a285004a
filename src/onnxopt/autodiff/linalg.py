"""Matrix products: MatMul (batched and broadcast, 1-D operands) and Gemm."""

from __future__ import annotations

import onnx_ir as ir

from onnxopt.autodiff.engine import rule
from onnxopt.passes.lower import _unbroadcast

F = "matmul/gemm"


def _product(c, a, b, ta: bool, tb: bool, ranks: tuple[int, int], double: bool):
    """a'·b' over the last two axes (batched): MatMul of Transposes, which onnxruntime fuses into FusedMatMul,
    a float-only kernel; Einsum in float64."""
    if double:
        return c.Einsum(a, b, equation=f"...{'ji' if ta else 'ij'},...{'kj' if tb else 'jk'}->...ik")
    return c.MatMul(_swap_last(c, a, ranks[0]) if ta else a, _swap_last(c, b, ranks[1]) if tb else b)


def _swap_last(c, x, rank: int):
    return c.Transpose(x, perm=[*range(rank - 2), rank - 1, rank - 2])


def _sum_to(c, g, x, rank_g: int):
    """``g`` (rank ``rank_g``) summed over the leading batch axes ``x`` lacks or broadcast, shaped as ``x``."""
    dims = c.static_dims(x)
    lead = rank_g - len(dims)
    axes = list(range(lead)) + [lead + k for k, d in enumerate(dims[:-2]) if d == 1]
    if axes:
        g = c.ReduceSum(g, c.ints(axes), keepdims=1)
    return c.Reshape(g, c.shape_of(x)) if lead or axes else g


@rule("MatMul", family=F)
def _matmul(c):
    """dA = dY·Bᵀ, dB = Aᵀ·dY, summed over broadcast batch axes (1-D operands promoted as numpy does)."""
    a, b, dy = c.I(0), c.I(1), c.go(0)
    ra, rb = c.rank(a), c.rank(b)
    if ra is None or rb is None:  # NOTE: ranks >= 2 assumed; Einsum broadcasts the batch axes, summed back
        da = c.unbroadcast(c.Einsum(dy, b, equation="...ij,...kj->...ik"), 0) if c.need(0) else None
        db = c.unbroadcast(c.Einsum(a, dy, equation="...ji,...jk->...ik"), 1) if c.need(1) else None
        return [da, db]
    if rb == 2 and ra >= 2:  # NOTE: a weight: Gemms over all rows, no batched product, no Transpose node
        k, n = c.Shape(a, start=-1), c.Shape(b, start=-1)
        a2 = a if ra == 2 else c.Reshape(a, c.Concat(c.ints([-1]), k, axis=0))
        dy2 = dy if ra == 2 else c.Reshape(dy, c.Concat(c.ints([-1]), n, axis=0))
        da = c.Gemm(dy2, b, transB=1) if c.need(0) else None
        if da is not None and ra > 2:
            da = c.Reshape(da, c.Shape(a))
        return [da, c.Gemm(a2, dy2, transA=1) if c.need(1) else None]
    a2 = a if ra >= 2 else c.Unsqueeze(a, c.ints([0]))
    b2 = b if rb >= 2 else c.Unsqueeze(b, c.ints([1]))
    ry = max(ra, rb, 2)
    double = c.dtype(a) == ir.DataType.DOUBLE
    if ra == 1:
        dy = c.Unsqueeze(dy, c.ints([-2 if rb >= 2 else 0]))
    if rb == 1:
        dy = c.Unsqueeze(dy, c.ints([-1]))
    da = db = None
    if c.need(0):
        da = _product(c, dy, b2, False, True, (ry, max(rb, 2)), double)
        da = _sum_to(c, da, a2, ry) if ra >= 2 else c.Reshape(c.ReduceSum(da, c.ints(range(ry - 1)), keepdims=0)
                                                                if ry > 2 else da, c.Shape(a))
    if c.need(1):
        db = _product(c, a2, dy, True, False, (max(ra, 2), ry), double)
        db = _sum_to(c, db, b2, ry) if rb >= 2 else c.Reshape(c.ReduceSum(db, c.ints(range(ry - 2)), keepdims=0)
                                                                if ry > 2 else db, c.Shape(b))
    return [da, db]


@rule("Gemm", family=F)
def _gemm(c):
    """Y = α·A'·B' + β·C: dA' = α·dY·B'ᵀ, dB' = α·A'ᵀ·dY, dC = β·dY summed to C's shape."""
    a, b, dy = c.I(0), c.I(1), c.go(0)
    alpha, beta = c.attr("alpha", 1.0), c.attr("beta", 1.0)
    ta, tb = c.attr("transA", 0), c.attr("transB", 0)
    da = db = dc = None
    if c.need(0):
        da = c.Gemm(dy, b, alpha=alpha, transB=1 - tb) if not ta else c.Gemm(b, dy, alpha=alpha, transA=tb, transB=1)
    if c.need(1):
        db = c.Gemm(a, dy, alpha=alpha, transA=1 - ta) if not tb else c.Gemm(dy, a, alpha=alpha, transA=1, transB=ta)
    if c.need(2):
        g = dy if beta == 1.0 else c.Mul(dy, c.const(beta, dy))
        dc = c.unbroadcast(g, 2)
    return [da, db, dc]


@rule("Einsum", family=F)
def _einsum_rule(c):
    """dA_k = Einsum(dY, the other operands; "C,B...->A_k"): the equations the rules write (batched products
    with "...", no repeated letter in an operand, every letter of A_k in C or another operand); operands
    broadcast along "..." get the sum over the broadcast axes."""
    terms, output = _einsum_terms(c.node)
    dy = c.go(0)
    batch = [_batch_dims(c, x, t) for x, t in zip(c.node.inputs, terms)]
    same = all(b is not None and b == batch[0] for b in batch)
    grads = []
    for k, (x, term) in enumerate(zip(c.node.inputs, terms)):
        others = [t for j, t in enumerate(terms) if j != k]
        if not c.need(k):
            grads.append(None)
            continue
        letters = term.replace(".", "")
        if len(set(letters)) != len(letters) or any(ch not in output + "".join(others) for ch in letters):
            raise ValueError(f"Einsum equation {c.attr('equation')!r}: operand {k} has a letter no other term "
                             "has, or a repeated letter (expected batched products)")
        eq = ",".join([output, *others]) + "->" + term
        g = c.Einsum(dy, *(v for j, v in enumerate(c.node.inputs) if j != k), equation=eq)
        grads.append(g if "..." not in term or same else _unbroadcast(c, g, x))
    return grads


def _batch_dims(c, x, term: str):
    dims = c.static_dims(x)
    if dims is None or "..." not in term:
        return () if dims is not None else None
    return tuple(dims[:len(dims) - len(term.replace(".", ""))])


# ==== rewrites ===========================================================================================
# This family's ops rewritten before differentiation into ops that have rules (``passes.decompose`` applies
# them for both gradient sources), and its gradient definitions given to the training build's builder too
# (``autodiff.rewrite``). The rules above do not depend on this section.

from onnxopt.autodiff.rewrite import _k, rewrite, template  # noqa: E402


@rewrite("Trilu", family=F)
def _trilu(op, node, x, k=None):
    """Trilu as ``Where(mask, x, 0)`` with the mask built from row and column indices at run time."""
    shape = op.Shape(x)
    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    n_rows = op.Squeeze(op.Slice(shape, op.Constant(value_ints=[-2]), op.Constant(value_ints=[-1])))
    n_cols = op.Squeeze(op.Slice(shape, op.Constant(value_ints=[-1]), op.Constant(value_ints=[2**62])))
    rows = op.Unsqueeze(op.Range(zero, n_rows, one), op.Constant(value_ints=[1]))
    cols = op.Range(zero, n_cols, one)
    offset = op.Sub(cols, rows)
    k = zero if k is None else k
    mask = op.GreaterOrEqual(offset, k) if node.attributes.get_int("upper", 1) else op.LessOrEqual(offset, k)
    return op.Where(mask, x, _k(op, 0.0, x))


def _einsum_terms(node: ir.Node) -> tuple[list[str], str]:
    equation = node.attributes.get_string("equation").replace(" ", "")
    inputs, _, output = equation.partition("->")
    terms = inputs.split(",")
    if "->" not in equation:  # NOTE: implicit output: the letters seen once, in alphabetical order
        letters = "".join(terms)
        output = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return terms, output


def _einsum_check(node: ir.Node) -> str | None:
    terms, output = _einsum_terms(node)
    if "." in "".join(terms) + output or any(len(set(t)) != len(t) for t in terms):
        return "ellipsis and repeated letters in one operand (diagonals) are not rewritten"
    return None


@rewrite("Einsum", family=F, check=_einsum_check)
def _einsum(op, node, *xs):
    """Each operand transposed to one letter order and unsqueezed to every letter, multiplied (broadcast),
    summed over the letters the output drops, transposed to the output's order."""
    terms, output = _einsum_terms(node)
    letters = list(dict.fromkeys("".join(terms)))
    product = None
    for x, term in zip(xs, terms):
        ordered = sorted(term, key=letters.index)
        y = op.Transpose(x, perm=[term.index(c) for c in ordered]) if list(term) != ordered else x
        missing = [i for i, c in enumerate(letters) if c not in term]
        y = op.Unsqueeze(y, op.Constant(value_ints=missing)) if missing else y
        product = y if product is None else op.Mul(product, y)
    summed = [i for i, c in enumerate(letters) if c not in output]
    if summed:
        product = op.ReduceSum(product, op.Constant(value_ints=summed), keepdims=0)
    kept = [c for c in letters if c in output]
    return op.Transpose(product, perm=[kept.index(c) for c in output]) if kept != list(output) else op.Identity(product)


# ---- gradient definitions: (op_type, inputs, outputs[, {attribute: value}]) per node, GI(0) = dL/dI(0)

# Det: d det(A)/dA = det(A)·A⁻ᵀ (NaN at a singular A, where the adjugate would be right)
template("Det", [("com.microsoft:Inverse", ["I(0)"], ["inv"]), ("Mul", ["GO(0)", "O(0)"], ["g"]),
                 ("Einsum", ["g", "inv"], ["GI(0)"], {"equation": "...,...ij->...ji"})], family=F)
