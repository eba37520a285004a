"""Rules written as node templates over ``I(i)``, ``O(i)``, ``GO(i)`` -> ``GI(i)``:
``autodiff.rewrite.GRADIENTS`` (Asin, Sinh, Softplus, Mish, Mod, Det, zero gradients of Floor, Round, random
draws...), registered by the family modules and given to the training build's builder too; each rule takes
its template's family."""

from __future__ import annotations

import re

import numpy as np
import onnx_ir as ir

from onnxopt.autodiff.engine import RULES, Rule

_REF = re.compile(r"(I|O|GO|GI)\((\d+)\)")


def _run(template: list[tuple]):
    def fn(c):
        names: dict[str, ir.Value] = {}

        def value(name: str) -> ir.Value:
            ref = _REF.fullmatch(name)
            if ref is None:
                return names[name]
            kind, i = ref.group(1), int(ref.group(2))
            return c.I(i) if kind == "I" else c.O(i) if kind == "O" else c.go(i)

        for op_type, inputs, outputs, *attrs in template:
            domain, _, op_type = op_type.rpartition(":")
            attributes = dict(attrs[0]) if attrs else {}
            for k, v in attributes.items():
                if isinstance(v, (np.ndarray, np.generic)):
                    attributes[k] = ir.tensor(np.asarray(v))
            outs = c.tape.op_multi_out(op_type, [value(v) for v in inputs], attributes, domain=domain,
                                       num_outputs=len(outputs))
            names.update(zip(outputs, outs))
        return [names.get(f"GI({i})") for i in range(len(c.node.inputs))]
    return fn


def register() -> None:
    """Registers every gradient definition of ``rewrite.GRADIENTS`` as a rule (``load_rules`` fills it first)."""
    from onnxopt.autodiff.rewrite import GRADIENTS, TEMPLATE_FAMILIES

    for op_type, template in GRADIENTS.items():
        doc = "a gradient definition, as given to the training build (autodiff.rewrite.GRADIENTS)"
        RULES["", op_type] = Rule(op_type, _run(template), TEMPLATE_FAMILIES[op_type], "", None, doc)
