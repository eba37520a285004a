"""Pictures of ONNX graphs: nodes coloured by the region the fusion pass tagged them with.

``to_dot`` writes Graphviz text; ``render`` runs Graphviz's ``dot`` when it is on PATH, otherwise it
writes the ``.dot`` text and says how to render it (drawing a layered graph well is dot's job, not ours).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import onnx

from onnxopt import atomic
from onnxopt.errors import ModelError
from onnxopt.graphs import REGION

__all__ = ["COLORS", "to_dot", "render"]

# NOTE: blue is what onnxruntime-training builds (forward, backward), warm and green what onnxopt adds.
COLORS = {"forward": "#c6dbef", "backward": "#6baed6", "loss": "#fdae6b", "penalty": "#c7e9c0",
          "schedule": "#fff3b0", "update": "#74c476", "other": "#eeeeee"}
FORMATS = (".dot", ".svg", ".png")


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _region(node: onnx.NodeProto) -> str:
    region = next((p.value for p in node.metadata_props if p.key == REGION), "other")
    return region if region in COLORS else "other"


def to_dot(model: onnx.ModelProto, title: str | None = None) -> str:
    """Graphviz text of ``model``'s main graph: inputs and outputs as ellipses, nodes (not Constant) as boxes."""
    g = model.graph
    lines = ["digraph onnx {", "  rankdir=TB; node [fontname=Helvetica, fontsize=10]; edge [color=gray40];"]
    if title:
        lines.append(f"  labelloc=t; label={_q(title)}; fontname=Helvetica;")
    producer: dict[str, str] = {}
    for v in g.input:
        producer[v.name] = f"in:{v.name}"
        lines.append(f"  {_q('in:' + v.name)} [label={_q(v.name)}, shape=ellipse, style=filled, fillcolor=white];")
    used = set()
    for i, node in enumerate(g.node):
        if node.op_type == "Constant":  # NOTE: literals only clutter the picture
            continue
        nid = f"n{i}"
        region = _region(node)
        used.add(region)
        label = node.op_type if node.domain in ("", "ai.onnx") else f"{node.op_type}\n{node.domain}"
        lines.append(f"  {nid} [label={_q(label)}, shape=box, "
                     f"style=\"filled,rounded\", fillcolor={_q(COLORS[region])}];")
        for name in node.input:
            if name in producer:
                lines.append(f"  {_q(producer[name])} -> {nid};")
        for name in node.output:
            producer[name] = nid
    for v in g.output:
        lines.append(f"  {_q('out:' + v.name)} [label={_q(v.name)}, shape=ellipse, style=filled, fillcolor=white];")
        if v.name in producer:
            lines.append(f"  {_q(producer[v.name])} -> {_q('out:' + v.name)};")
    legend = [r for r in COLORS if r in used]
    if legend != ["other"]:
        lines.append("  subgraph cluster_legend { label=regions; fontname=Helvetica; style=dashed;")
        for r in legend:
            lines.append(f"    {_q('legend:' + r)} [label={_q(r)}, shape=box, style=\"filled,rounded\", "
                         f"fillcolor={_q(COLORS[r])}];")
        order = " -> ".join(_q("legend:" + r) for r in legend)
        lines.append(f"    {{rank=same; {order} [style=invis];}}" if len(legend) > 1 else "")
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render(model: onnx.ModelProto, path: str | os.PathLike, title: str | None = None) -> tuple[str, bool]:
    """Writes ``path`` (.dot, .svg or .png); returns (the file written, whether it is the requested picture).

    Without ``dot`` on PATH, an .svg/.png request writes ``<path>.dot`` instead and returns False.
    """
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise ModelError(f"output: expected a file ending in {', '.join(FORMATS)}, got {path!r}")
    text = to_dot(model, title)
    dot = shutil.which("dot")
    if ext == ".dot" or dot is None:
        out = path if ext == ".dot" else os.path.splitext(path)[0] + ".dot"
        atomic.write(out, text)
        return out, ext == ".dot"
    done = subprocess.run([dot, f"-T{ext[1:]}"], input=text.encode(), capture_output=True, check=False)
    if done.returncode != 0:
        raise ModelError(f"output: graphviz dot failed on {path!r}: {done.stderr.decode(errors='replace').strip()}")
    atomic.write(path, done.stdout)
    return path, True
