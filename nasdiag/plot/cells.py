"""Cells drawn as DAGs in the style of the DARTS paper's figures, with matplotlib only (no graphviz).

Nodes: the two cell inputs ``c_{k-2}``, ``c_{k-1}`` (green), the intermediate nodes ``0 .. steps-1``
(blue) and the output ``c_{k}`` (yellow), left to right. Every kept op is an arrow from its input node
to its node, labelled with the op name; several ops on one edge (mixed-path genotypes of SparseNAS and
BayesNAS) share the arrow and are listed one per line. Output edges (concatenation) are unlabelled.

Genes are ``(op, i, j)`` with node numbers of ``nasdiag.supernet.edge_nodes`` (0, 1 the inputs,
2 .. steps+1 the intermediate nodes).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from nasdiag.plot.registry import NothingToDraw
from nasdiag.plot.style import COLUMN, plt

Gene = Tuple[str, int, int]
INPUT_COLOR, NODE_COLOR, OUTPUT_COLOR = "#a1d99b", "#9ecae1", "#fdd49e"


def steps_of(n_edges: int) -> int:
    """Intermediate nodes of a DARTS cell with ``n_edges`` edges (E = steps (steps + 3) / 2)."""
    steps = 0
    while steps * (steps + 3) // 2 < n_edges:
        steps += 1
    if steps * (steps + 3) // 2 != n_edges:
        raise NothingToDraw(f"{n_edges} edges is not a DARTS cell (E = s(s+3)/2); cannot draw it as a cell")
    return steps


def genes_from_pairs(pairs: Sequence, steps: int) -> List[Gene]:
    """DARTS ``[(op, input node), ...]`` (the same number per node, nodes in order: two in DARTS, one or more with
    ``derive_cell(edges_per_node=...)``) or mixed ``[(op, i, j), ...]`` -> genes ``(op, i, j)``."""
    entries = [tuple(entry) for entry in pairs]
    paired = sum(len(entry) == 2 for entry in entries)
    per_node = len(entries) // steps if steps > 0 and paired and len(entries) % steps == 0 else 0
    if paired and not per_node:
        raise NothingToDraw(f"a DARTS genotype of {len(entries)} (op, input) pairs does not list the same number for "
                            f"each of the {steps} nodes; cannot tell which node each pair feeds")
    genes: List[Gene] = []
    for n, entry in enumerate(entries):
        if len(entry) == 3:
            genes.append((str(entry[0]), int(entry[1]), int(entry[2])))
        elif len(entry) == 2:
            node = 2 + n // per_node
            if not 0 <= int(entry[1]) < node:
                raise NothingToDraw(f"genotype entry {entry!r} of node {node} takes an input that is not an earlier node")
            genes.append((str(entry[0]), int(entry[1]), node))
        else:
            raise NothingToDraw(f"cannot read genotype entry {entry!r}")
    return genes


def parse_genotype(value) -> Dict[str, List]:
    """A recorded genotype (dict, JSON text or the repr of a (Mixed)Genotype namedtuple) as
    ``{"normal": [...], "normal_concat": [...], "reduce": [...], ...}``."""
    if isinstance(value, str):
        text = value.strip()
        try:
            value = json.loads(text)
        except ValueError:
            fields = dict(re.findall(r"(\w+)=(\[[^\]]*\]|range\([^)]*\))", text))
            value = {}
            for key, item in fields.items():
                value[key] = list(eval(item, {"range": range}, {})) if item.startswith("range") else ast.literal_eval(item)
        if isinstance(value, str):
            return parse_genotype(value)
    if isinstance(value, (list, tuple)) and len(value) == 4:
        value = dict(zip(("normal", "normal_concat", "reduce", "reduce_concat"), value))
    if not isinstance(value, Mapping):
        raise NothingToDraw(f"cannot read the recorded genotype {value!r}")
    return dict(value)


def short_name(op: str) -> str:
    """A compact op label for small cells: ``sep_conv_3x3`` -> ``sep3``, ``max_pool_3x3`` -> ``max3``,
    ``skip_connect`` -> ``skip``; other names unchanged."""
    op = re.sub(r"^(sep|dil)_conv_(\d+)x\d+$", r"\1\2", op)
    op = re.sub(r"^(max|avg)_pool_(\d+)x\d+$", r"\1\2", op)
    return "skip" if op == "skip_connect" else op


def _positions(steps: int) -> Dict[int, Tuple[float, float]]:
    """Inputs left (top, bottom), intermediate nodes left to right alternately above and below the
    middle line, the output right on it."""
    pos = {0: (0.0, 1.0), 1: (0.0, -1.0)}
    for k in range(steps):
        pos[k + 2] = (1.7 * (k + 1), 0.5 if k % 2 == 0 else -0.5)
    pos[-1] = (1.7 * (steps + 1), 0.0)
    return pos


def _node(ax, xy, text, color):
    ax.text(*xy, text, ha="center", va="center", fontsize=7, zorder=4,
            bbox=dict(boxstyle="round,pad=0.3", fc=color, ec="#444444", lw=0.6))


def draw_cell(ax, genes: Sequence[Gene], steps: int, concat: Optional[Sequence[int]] = None, title: str = "",
              short: bool = False) -> None:
    """Draw one cell on ``ax``.

    Args:
        genes: kept ops ``(op, i, j)``; several genes on one (i, j) are listed on one arrow.
        steps: intermediate nodes.
        concat: nodes concatenated into the output (default: all intermediate nodes).
        title: axes title.
        short: label edges with :func:`short_name` (for small panels).
    """
    import math

    from matplotlib.patches import FancyArrowPatch

    pos = _positions(steps)
    concat = list(range(2, steps + 2)) if concat is None else [int(c) for c in concat]
    low, high = -1.45, 1.45  # grows with the arcs that bow beyond the nodes
    by_edge: Dict[Tuple[int, int], List[str]] = {}
    for op, i, j in genes:
        by_edge.setdefault((int(i), int(j)), []).append(short_name(str(op)) if short else str(op))
    for (i, j), ops in by_edge.items():
        (x1, y1), (x2, y2) = pos[i], pos[j]
        # arrows that pass other nodes bow away from the middle line (up from upper sources, down from
        # lower ones), the more the more nodes they pass; arc3's rad < 0 bends a left-to-right arrow up
        skips = (j - i - 1) if i >= 2 else (j - 2)
        # (enough that an arrow from c_{k-2} to node 1 clears node 0 instead of seeming to leave it)
        rad = 0.0 if skips == 0 else -(0.25 + 0.08 * skips) * (1 if y1 > 0 else -1)
        ax.add_patch(FancyArrowPatch((x1, y1), (x2, y2), connectionstyle=f"arc3,rad={rad}", arrowstyle="-|>",
                                     mutation_scale=7, lw=0.8, color="#555555", shrinkA=10, shrinkB=10, zorder=2))
        # the label sits on the arc (matplotlib's arc3 is a quadratic Bézier with control point c): at
        # t = 0.42 on arrows between neighbours (a little towards the source, so labels of arrows
        # converging on one node separate), further along on arrows that pass other nodes, so labels of
        # arrows leaving one node separate too
        dx, dy = x2 - x1, y2 - y1
        cx, cy = (x1 + x2) / 2 + rad * dy, (y1 + y2) / 2 - rad * dx
        t = 0.42 if skips == 0 else 0.62
        mx = (1 - t) ** 2 * x1 + 2 * t * (1 - t) * cx + t**2 * x2
        my = (1 - t) ** 2 * y1 + 2 * t * (1 - t) * cy + t**2 * y2
        angle = math.degrees(math.atan2((1 - t) * (cy - y1) + t * (y2 - cy), (1 - t) * (cx - x1) + t * (x2 - cx)))
        apex = (y1 + y2) / 4 + cy / 2  # the arc's point at t = 1/2
        low, high = min(low, apex - 0.25), max(high, apex + 0.25)
        if angle > 90 or angle < -90:
            angle += 180
        ax.text(mx, my, "\n".join(ops), ha="center", va="center", fontsize=5.5, zorder=3, linespacing=1.0,
                rotation=angle, rotation_mode="anchor",
                bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.85))
    for node in concat:
        (x1, y1), (x2, y2) = pos[node], pos[-1]
        ax.add_patch(FancyArrowPatch((x1, y1), (x2, y2), connectionstyle="arc3,rad=0.0", arrowstyle="-|>",
                                     mutation_scale=7, lw=0.6, color="#999999", ls="--", shrinkA=8, shrinkB=10, zorder=1))
    _node(ax, pos[0], r"$c_{k-2}$", INPUT_COLOR)
    _node(ax, pos[1], r"$c_{k-1}$", INPUT_COLOR)
    for k in range(steps):
        _node(ax, pos[k + 2], str(k), NODE_COLOR)
    _node(ax, pos[-1], r"$c_{k}$", OUTPUT_COLOR)
    xs = [p[0] for p in pos.values()]
    ax.set_xlim(min(xs) - 0.45, max(xs) + 0.45)
    ax.set_ylim(low, high)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, loc="left")


def cell_figure(genes: Sequence[Gene], steps: int, concat: Optional[Sequence[int]] = None, title: str = ""):
    """A figure with one cell (see :func:`draw_cell`)."""
    fig, ax = plt.subplots(figsize=(max(COLUMN, 0.9 * (steps + 2)), 2.0))
    draw_cell(ax, genes, steps, concat, title)
    return fig


def genotype_figure(genotype, steps: int, title: str = ""):
    """Normal and reduction cell of a (Mixed)Genotype (or a dict of its fields) side by side."""
    g = parse_genotype(genotype) if not hasattr(genotype, "_asdict") else genotype._asdict()
    cells = [c for c in ("normal", "reduce") if g.get(c)]
    if not cells:
        raise NothingToDraw("the genotype keeps no op in any cell; nothing to draw")
    fig, axes = plt.subplots(1, len(cells), figsize=(len(cells) * max(COLUMN, 0.9 * (steps + 2)), 2.1), squeeze=False)
    for ax, c in zip(axes[0], cells):
        draw_cell(ax, genes_from_pairs(g[c], steps), steps, g.get(f"{c}_concat"), f"{c} cell")
    if title:
        fig.suptitle(title)
    return fig


def most_probable_wiring(probabilities: np.ndarray, op_names: Sequence[str]) -> List[Gene]:
    """The wiring with the largest probability under independent edges (wiring supplement Figs 1, 3):
    on each edge the op of highest probability, the edge dropped where that op is ``none``."""
    from nasdiag.supernet import edge_nodes

    steps = steps_of(probabilities.shape[0])
    best = np.nanargmax(np.where(np.isnan(probabilities), -np.inf, probabilities), axis=1)
    return [(op_names[k], i, j) for (i, j), k in zip(edge_nodes(steps), best) if op_names[k] != "none"]
