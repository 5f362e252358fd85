"""Accuracy and cost of every curvature mode against ``exact``: the table of docs/hessian.md.

For each net: relative error ‖mode − exact‖/‖exact‖, Spearman ρ over the entries (exact zeros left
out), time as a multiple of one forward+backward of the same batch (median of ``--repeats``; one run for the
mixing weights' random modes, timed at seed 0), and
for the mixing weights the share of op pairs of an edge that the mode tells apart where exact does.
The mixing weights are measured w.r.t. Z and w.r.t. α (per edge, against ``exact_per_edge``); their
random modes (``ggn_mc``, ``hutchinson:<k>``) report the mean over ``--seeds`` seeds (the weight nets'
``hutchinson:<k>``: seed 0, the only one ``diag_hessian`` draws).

    python scripts/curvature_accuracy.py                               # the docs table (CPU, minutes)
    python scripts/curvature_accuracy.py --only darts --device cuda --out runs/curvature   # the DARTS row on a GPU
    python scripts/curvature_accuracy.py --only darts --size tiny --out /tmp/curv          # the same, tiny, CPU check

``--out DIR`` writes ``DIR/curvature_accuracy.json`` (the rows and the setting) and
``DIR/curvature_accuracy.md`` (the printed table).

Nets (float64, torch's CPU unless --device): ``tanh_mlp`` and ``conv_bn`` (weight modes of
``diag_hessian``), ``cell_train`` / ``cell_eval`` (one minimal cell of the reference supernet, BatchNorm
in train / eval mode; mixing-weight modes of ``arch_diag_hessian``), ``darts`` (alias ``search``: the
DARTS search supernet's cells, train-mode BN; ``--size small`` (default): 3 cells (normal, reduce,
reduce) of 4 nodes and 14 edges × 8 ops, C=8, 8×8 inputs, 10 classes, batch 16; ``tiny``: 2 nodes,
C=4, 6×6, batch 4; ``paper``: the DARTS search setting, 8 cells, C=16, 32×32×3, batch 64).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from scipy.stats import spearmanr
from torch import nn

from nasdiag.errors import run_script
from nasdiag.hessian import arch_diag_hessian, diag_hessian
from nasdiag.supernet import Network
from script_args import (Parser, UsageError, at_least, device as device_name, given_options, refuse_other_tables,
                         refuse_repeats, write_table)

DT = torch.float64
CHEAP_ARCH = ("diag", "approx", "ggn", "ggn_mc", "hutchinson:1", "hutchinson:4", "hutchinson:16")
CHEAP_WEIGHTS = ("diag", "approx", "hutchinson:1", "hutchinson:4", "hutchinson:16")
RANDOM = ("ggn_mc", "hutchinson:1", "hutchinson:4", "hutchinson:16")


def tanh_mlp(device):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 4))
    return net.to(device, DT), torch.randn(16, 6, dtype=DT, device=device), torch.randint(0, 4, (16,), device=device)


def conv_bn(device):
    torch.manual_seed(1)
    net = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
    )
    return net.to(device, DT), torch.randn(8, 2, 6, 6, dtype=DT, device=device), torch.randint(0, 3, (8,), device=device)


def cell(train: bool):
    def build(device):
        torch.manual_seed(2)
        net = Network.minimal(4, 3, 1, in_channels=2, reductions=[]).to(device, DT)
        with torch.no_grad():
            for a in net.arch_parameters():
                a.normal_(0, 0.5)
        x, y = torch.randn(8, 2, 6, 6, dtype=DT, device=device), torch.randint(0, 3, (8,), device=device)
        if not train:
            net(x)
            net.eval()
        return net, x, y

    return build


SIZES = {  # (C, layers, steps, in_channels, batch, side)
    "tiny": (4, 3, 2, 1, 4, 6),
    "small": (8, 3, 4, 1, 16, 8),
    "paper": (16, 8, 4, 3, 64, 32),
}


def search(size):
    C, layers, steps, channels, batch, side = SIZES[size]

    def build(device):
        torch.manual_seed(3)
        net = Network(C, 10, layers, in_channels=channels, steps=steps, multiplier=steps).to(device, DT)
        with torch.no_grad():
            for a in net.arch_parameters():
                a.normal_(0, 0.3)
        x = torch.randn(batch, channels, side, side, dtype=DT, device=device)
        return net, x, torch.randint(0, 10, (batch,), device=device)

    return build


NETS = {
    "tanh_mlp": "weights",
    "conv_bn": "weights",
    "cell_train": "Z",
    "cell_eval": "Z",
    "darts": "Z",
}
ALIASES = {"search": "darts"}


def builder(name, size):
    return {"tanh_mlp": tanh_mlp, "conv_bn": conv_bn, "cell_train": cell(True), "cell_eval": cell(False), "darts": search(size)}[name]


def _timed(fn, repeats, device):
    times, out = [], None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return out, statistics.median(times)


def _accuracy(got, exact):
    g = torch.cat([got[k].reshape(-1) for k in exact])
    e = torch.cat([exact[k].reshape(-1) for k in exact])
    keep = e.abs() > 1e-12 * e.abs().max()
    return float((g - e).norm() / e.norm()), float(spearmanr(g[keep].cpu().numpy(), e[keep].cpu().numpy()).statistic)


def _ops_told_apart(got, exact):
    """Share of (edge, op pair) where exact differs by > 5% of the edge's largest entry and the mode differs
    by > 0.1% of its own largest entry too (what a heatmap with 3 decimals shows)."""
    hits = total = 0
    for k in exact:
        e, g = exact[k], got[k]
        differ = (e[:, None] - e[None, :]).abs() > 0.05 * e.abs().max()
        total += int(differ.sum())
        hits += int(((g[:, None] - g[None, :]).abs() > 1e-3 * g.abs().max().clamp_min(1e-300))[differ].sum())
    return hits / max(total, 1)


def measure(name, repeats, device, seeds=3, size="small"):
    """Rows ``(net, w.r.t., mode, rel. error, ρ, time / (fwd+bwd), ops told apart)`` of one net."""
    kind = NETS[name]
    net, x, y = builder(name, size)(device)

    def fwd_bwd():
        net.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()

    fwd_bwd()
    _, base = _timed(fwd_bwd, repeats, device)
    rows = []
    if kind == "weights":
        exact, t_exact = _timed(lambda: diag_hessian(net, F.cross_entropy, x, y, mode="exact"), 1, device)
        rows.append((name, "weights", "exact", 0.0, 1.0, t_exact / base, None))
        for mode in CHEAP_WEIGHTS:
            got, t = _timed(lambda: diag_hessian(net, F.cross_entropy, x, y, mode=mode), repeats, device)
            err, rho = _accuracy(got, exact)
            rows.append((name, "weights", mode, err, rho, t / base, None))
        return rows
    edges = net.edge_specs()

    def arch(mode, wrt="Z", seed=0):
        # seed= is refused by the deterministic modes (an option they would ignore)
        seeded = {"seed": seed} if mode in RANDOM else {}
        return arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode, wrt=wrt, **seeded)

    exact, t_exact = _timed(lambda: arch("exact_per_edge"), 1, device)
    exact_alpha = arch("exact_per_edge", "alpha")
    rows.append((name, "Z", "exact", 0.0, 1.0, t_exact / base, 1.0))
    rows.append((name, "α", "exact", 0.0, 1.0, None, None))
    for mode in CHEAP_ARCH:
        got, t = _timed(lambda: arch(mode), repeats if mode not in RANDOM else 1, device)
        z_runs = [got] + [arch(mode, seed=s) for s in range(1, seeds if mode in RANDOM else 1)]
        a_runs = [arch(mode, "alpha", seed=s) for s in range(seeds if mode in RANDOM else 1)]
        z_acc = [_accuracy(g, exact) for g in z_runs]
        a_acc = [_accuracy(g, exact_alpha) for g in a_runs]
        apart = statistics.mean(_ops_told_apart(g, exact) for g in z_runs)
        rows.append((name, "Z", mode, *_mean_pair(z_acc), t / base, apart))
        rows.append((name, "α", mode, *_mean_pair(a_acc), None, None))
    return rows


def _mean_pair(pairs):
    return statistics.mean(p[0] for p in pairs), statistics.mean(p[1] for p in pairs)


def _line(row):
    net, kind, mode, err, rho, cost, apart = row
    shown = "—" if apart is None else f"{apart:.2f}"
    timing = "—" if cost is None else f"{cost:.1f}×"
    return f"| {net} | {kind} | `{mode}` | {err:.3f} | {rho:.3f} | {timing} | {shown} |"


def table_written_here(text: str) -> bool:
    """Whether ``text`` is a curvature_accuracy.json or .md of this script (its rows under its setting line)."""
    if text.startswith("torch ") and "\n| net | w.r.t. | mode |" in text:
        return True
    try:
        table = json.loads(text)
    except ValueError:
        return False
    return isinstance(table, dict) and isinstance(table.get("setting"), str) and isinstance(table.get("rows"), list)


def refuse_idle_options(parser, argv, names, size_option="--size") -> None:
    """One line for ``--size`` given without the darts net (it shapes that net alone) and ``--seeds`` given with weight
    nets alone (their ``hutchinson:<k>`` rows are seed 0, the only one ``diag_hessian`` draws): each was taken and
    did nothing, the table's setting line naming the size and seeds it was not measured at."""
    given = {max(a.option_strings, key=len) for a in given_options(parser, argv)}
    why = {size_option: "it shapes the darts net alone",
           "--seeds": "it averages the mixing-weight nets' random modes (the weight nets' hutchinson:<k> rows are seed 0)"}
    idle = [option for option, used in ((size_option, "darts" in names),
                                        ("--seeds", any(NETS[n] == "Z" for n in names))) if option in given and not used]
    if idle:
        raise UsageError(f"{' and '.join(idle)} {'does' if len(idle) == 1 else 'do'} nothing for {', '.join(names)}: "
                         f"{'; '.join(f'{o} because {why[o]}' for o in idle)}; drop {'it' if len(idle) == 1 else 'them'}, "
                         "or add a net it acts on")


def main(argv=None):
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nets", "--only", dest="nets", default="tanh_mlp,conv_bn,cell_train,cell_eval",
                        help=f"comma-separated, of {', '.join(NETS)} (search = darts)")
    parser.add_argument("--size", default="small", choices=tuple(SIZES), help="shape of the darts net (default: small)")
    parser.add_argument("--repeats", type=at_least(1), default=3, help="timings: median of this many runs (the mixing weights' random modes: one)")
    parser.add_argument("--seeds", type=at_least(1), default=3, help="random modes: accuracy averaged over this many seeds")
    parser.add_argument("--device", type=device_name, default="cpu")  # a bad or absent one was torch's traceback
    parser.add_argument("--out", default=None, help="directory for curvature_accuracy.json and .md")
    args = parser.parse_args(argv)
    names = [ALIASES.get(n.strip(), n.strip()) for n in args.nets.split(",") if n.strip()]
    unknown = [n for n in names if n not in NETS]
    if unknown:
        parser.error(f"unknown net(s) {unknown}; choose from {', '.join(NETS)}")
    if not names:  # it printed the table's head, wrote a table of no row and exited 0
        parser.error(f"--nets {args.nets!r} names no net; give comma-separated names of {', '.join(NETS)}")
    refuse_repeats(names, "--nets (search is darts)" if "search" in args.nets else "--nets")  # measured twice, two rows
    refuse_idle_options(parser, argv, names)
    out = Path(args.out) if args.out else None
    if out is not None:  # the user's own curvature_accuracy.md (or .json) there was replaced without a word
        refuse_other_tables([str(out / "curvature_accuracy.json"), str(out / "curvature_accuracy.md")], table_written_here)
        out.mkdir(parents=True, exist_ok=True)  # before the measurements: an unwritable folder fails at once
    device = torch.device(args.device)
    setting = (f"torch {torch.__version__}, {device}"
               + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
               + f", {torch.get_num_threads()} threads, float64, darts size {args.size}, {args.seeds} seeds")
    lines = [setting, "", "| net | w.r.t. | mode | rel. error | Spearman ρ | time / (fwd+bwd) | ops told apart |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for line in lines:
        print(line, flush=True)
    rows = []
    for name in names:
        for row in measure(name, args.repeats, device, args.seeds, args.size):
            rows.append(row)
            lines.append(_line(row))
            print(lines[-1], flush=True)
    if out is not None:
        keys = ("net", "wrt", "mode", "rel_error", "spearman", "time_over_fwd_bwd", "ops_told_apart")
        # each renamed over the old one: write_text emptied it first, and Ctrl-C mid-write left a truncated table
        write_table(out / "curvature_accuracy.json",
                    json.dumps({"setting": setting, "rows": [dict(zip(keys, r)) for r in rows]}, indent=1,
                               ensure_ascii=False) + "\n")
        write_table(out / "curvature_accuracy.md", "\n".join(lines) + "\n")
        print(f"wrote {out / 'curvature_accuracy.json'} and {out / 'curvature_accuracy.md'}")


if __name__ == "__main__":
    sys.exit(run_script("curvature_accuracy", main))
