"""Accuracy and cost of every curvature mode against ``exact``: the table of docs/hessian.md.

For each net: relative error ‖mode − exact‖/‖exact‖, Spearman ρ over the entries (exact zeros left
out), time as a multiple of one forward+backward of the same batch (median of ``--repeats``), and
for the mixing weights the share of edges whose ops the mode tells apart where exact does.

    python scripts/curvature_accuracy.py                  # all nets, markdown table on stdout
    python scripts/curvature_accuracy.py --nets search    # the DARTS search supernet shape only (slow on CPU)

Nets (float64, torch's CPU unless --device): ``tanh_mlp`` and ``conv_bn`` (weight modes of
``diag_hessian``), ``cell_train`` / ``cell_eval`` (one minimal cell of the reference supernet, BatchNorm
in train / eval mode; mixing-weight modes of ``arch_diag_hessian``), ``search`` (the DARTS search
supernet's cells scaled to CPU: 3 cells (normal, reduce, reduce) of 4 nodes and 14 edges × 8 ops, C=8,
8×8 inputs, 10 classes, batch 16, train-mode BN).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from scipy.stats import spearmanr
from torch import nn

from nasdiag.hessian import arch_diag_hessian, diag_hessian
from nasdiag.supernet import Network

DT = torch.float64
CHEAP_ARCH = ("diag", "approx", "ggn", "ggn_mc")


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


def search(device):
    torch.manual_seed(3)
    net = Network(8, 10, 3, in_channels=1).to(device, DT)
    with torch.no_grad():
        for a in net.arch_parameters():
            a.normal_(0, 0.3)
    return net, torch.randn(16, 1, 8, 8, dtype=DT, device=device), torch.randint(0, 10, (16,), device=device)


NETS = {
    "tanh_mlp": (tanh_mlp, "weights"),
    "conv_bn": (conv_bn, "weights"),
    "cell_train": (cell(True), "Z"),
    "cell_eval": (cell(False), "Z"),
    "search": (search, "Z"),
}


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


def measure(name, repeats, device):
    build, kind = NETS[name]
    net, x, y = build(device)

    def fwd_bwd():
        net.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()

    fwd_bwd()
    _, base = _timed(fwd_bwd, repeats, device)
    rows = []
    if kind == "weights":
        run = {m: (lambda m=m: diag_hessian(net, F.cross_entropy, x, y, mode=m)) for m in ("exact", "diag", "approx")}
    else:
        edges = net.edge_specs()
        run = {m: (lambda m=m: arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=m)) for m in ("exact", *CHEAP_ARCH)}
    exact, t_exact = _timed(run.pop("exact"), 1, device)
    rows.append((name, kind, "exact", 0.0, 1.0, t_exact / base, 1.0 if kind == "Z" else None))
    for mode, fn in run.items():
        got, t = _timed(fn, repeats, device)
        err, rho = _accuracy(got, exact)
        rows.append((name, kind, mode, err, rho, t / base, _ops_told_apart(got, exact) if kind == "Z" else None))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nets", default="tanh_mlp,conv_bn,cell_train,cell_eval", help=f"comma-separated, of {', '.join(NETS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads, float64")
    print("| net | w.r.t. | mode | rel. error | Spearman ρ | time / (fwd+bwd) | ops told apart |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.nets.split(","):
        for net, kind, mode, err, rho, cost, apart in measure(name.strip(), args.repeats, device):
            shown = "—" if apart is None else f"{apart:.2f}"
            print(f"| {net} | {kind} | `{mode}` | {err:.3f} | {rho:.3f} | {cost:.1f}× | {shown} |", flush=True)


if __name__ == "__main__":
    main()
