"""Where the exact mixing-weight curvature comes from under train-mode BatchNorm (docs/hessian.md, "Reading").

A mixing weight Z_k of an edge x_i → x_j enters the loss only through the node, x_j = Σ_k Z_k B_k + (other
edges) with B_k = O_k(x_i) independent of Z_k, so ``∂²L/∂Z_k² = d²/dt² L(x_j + t·B_k)`` at t = 0. The
second-order chain rule splits that line derivative exactly into

* the Gauss-Newton term ``(J B_k)ᵀ H_out (J B_k)`` (J: Jacobian of the logits w.r.t. x_j, H_out: the
  loss's Hessian in the logits), which the ``ggn``/``ggn_mc`` modes estimate, and
* the residual ``Σ_m ⟨g_m, ∂²m[δ_m, δ_m]⟩`` over every module m downstream of x_j (g_m: the gradient at its
  output, δ_m: the first-order tangent at its input); with train-mode BatchNorm it is the BatchNorms'
  second derivative through their batch statistics.

The script measures, against the exact diagonal, the Gauss-Newton term alone and the Gauss-Newton term plus
the residual of x_j's *immediate* consumers only (the mixed ops of the edges leaving node j and, for a
cell's output node, the next cells' preprocessing, each evaluated on x_j + t·B_k with every other input
held): the most any cheap mode that looks one op past the node could reach. Float64, direct autograd
along each line (one forward and a double backward per mixing weight, so small nets only); ``--check``
also compares the line derivatives with ``arch_diag_hessian(mode="exact_per_edge")``.

    python scripts/curvature_residual.py --net cell_train
    python scripts/curvature_residual.py --net darts --size tiny
    python scripts/curvature_residual.py --net darts --size small      # ~5 min on 2 CPU cores
    python scripts/curvature_residual.py --net cell_train --sketch 1,16,256

``--sketch S1,S2,...`` also measures an unbiased estimator of the whole exact diagonal that needs backward
passes only (``output_space_sketch``): the residual of every downstream BatchNorm is a sum over its channels of
products of linear functionals of the tangent at the BatchNorm's input (``batchnorm_curvature_pieces``), so
random seeds at every BatchNorm input and at the logits, pulled back to the nodes by two backward passes per
sample, give ``(B_k·a)(B_k·b)`` with expectation ``∂²L/∂Z_k²`` for all mixing weights at once. It is measured to
show why it is not a mode: its variance (docs/hessian.md).

Needs nasdiag's ``Network`` (edges with source and target nodes, cells with ``output_node_slices`` and
``preprocess0``/``preprocess1``); the nets are those of ``scripts/curvature_accuracy.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from curvature_accuracy import SIZES, _accuracy, _ops_told_apart, builder  # noqa: E402

from nasdiag.errors import run_script  # noqa: E402
from script_args import Parser, UsageError, at_least, given_options, numbers  # noqa: E402
from nasdiag.hessian import arch_diag_hessian  # noqa: E402
from nasdiag.hessian._hvp import preserved_buffers  # noqa: E402
from nasdiag.hooks import Hooks  # noqa: E402

NETS = ("cell_train", "cell_eval", "darts")


def _second_derivative(value: torch.Tensor, t: torch.Tensor, retain: bool = False) -> torch.Tensor:
    """d²value/dt² for a scalar ``value`` of the scalar leaf ``t`` (0 where it does not depend on t)."""
    if not value.requires_grad:
        return torch.zeros((), dtype=t.dtype)
    (first,) = torch.autograd.grad(value, t, create_graph=True, retain_graph=True, allow_unused=True)
    if first is None or not first.requires_grad:
        return torch.zeros((), dtype=t.dtype)
    (second,) = torch.autograd.grad(first, t, retain_graph=retain, allow_unused=True)
    return torch.zeros((), dtype=t.dtype) if second is None else second.detach()


def _baseline(net, x, y, edges):
    """One forward and backward: each op's output B, each edge's input call, the gradient at each edge's
    output (= at its target node) and at each cell's preprocessing outputs, with the preprocessing inputs."""
    op_out, edge_call, edge_out, pre_call, pre_out = {}, {}, {}, {}, {}

    def keep(store, key):
        def hook(module, args, output):
            output.retain_grad()
            store[key] = output
        return hook

    with Hooks() as hooks:
        for e in edges:
            for k, op in enumerate(e.ops):
                hooks.forward(op, lambda m, a, o, n=e.name, k=k: op_out.__setitem__((n, k), o.detach()))
            hooks.forward_pre(e.module, lambda m, a, kw, n=e.name: edge_call.__setitem__(n, (a, kw)), with_kwargs=True)
            hooks.forward(e.module, keep(edge_out, e.name))
        for ci, cell in enumerate(net.cells):
            for attr in ("preprocess0", "preprocess1"):
                key = (ci, attr)
                hooks.forward_pre(getattr(cell, attr), lambda m, a, key=key: pre_call.__setitem__(key, a[0].detach()))
                hooks.forward(getattr(cell, attr), keep(pre_out, key))
        with preserved_buffers(net):
            F.cross_entropy(net(x), y).backward()
    net.zero_grad(set_to_none=True)
    grads = {n: o.grad.detach() for n, o in edge_out.items()}
    pre_grads = {k: o.grad.detach() for k, o in pre_out.items()}
    return op_out, edge_call, grads, pre_call, pre_grads


def _consumers(net, e, edges) -> Tuple[List, List]:
    """The edges reading node ``e.dst`` of its cell, and the preprocessing ``(cell, attr, channel slice)``
    of later cells reading it through the cell's output."""
    readers = [e2 for e2 in edges if e2.cell_index == e.cell_index and e2.src == e.dst]
    cell = net.cells[e.cell_index]
    pre = []
    if e.dst in cell.output_node_slices:
        for later, attr in ((e.cell_index + 1, "preprocess1"), (e.cell_index + 2, "preprocess0")):
            if later < len(net.cells):
                pre.append((later, attr, cell.output_node_slices[e.dst]))
    return readers, pre


def decompose(net, x, y) -> Dict[str, Dict[str, torch.Tensor]]:
    """``{"exact", "ggn_exact", "immediate_residual"}``, each ``{edge name: (K,)}`` w.r.t. Z."""
    net.set_engine("eager")  # the per-op modules carry the hooks
    edges = net.edge_specs()
    op_out, edge_call, grads, pre_call, pre_grads = _baseline(net, x, y, edges)
    out = {"exact": {}, "ggn_exact": {}, "immediate_residual": {}}
    for e in edges:
        readers, pre = _consumers(net, e, edges)
        rows = {key: [] for key in out}
        for k in range(len(e.ops)):
            direction = op_out[(e.name, k)]
            t = torch.zeros((), dtype=x.dtype, requires_grad=True)
            with Hooks() as hooks, preserved_buffers(net):
                hooks.forward(e.module, lambda m, a, o: o + t * direction)
                logits = net(x)
                loss = F.cross_entropy(logits, y)
            rows["exact"].append(_second_derivative(loss, t, retain=True))
            # Gauss-Newton: J·B_k at the logits (double-backward trick), then its quadratic form with H_out
            u = torch.zeros_like(logits, requires_grad=True)
            (jt_u,) = torch.autograd.grad(logits, t, grad_outputs=u, create_graph=True)
            (jv,) = torch.autograd.grad(jt_u, u)
            p = logits.detach().softmax(-1)
            rows["ggn_exact"].append(((jv.square() * p).sum() - (jv * p).sum(-1).square().sum()) / x.shape[0])
            # the immediate consumers, each on x_j + t·B_k with its other inputs held
            with preserved_buffers(net):
                phi = torch.zeros((), dtype=x.dtype)
                for e2 in readers:
                    args, kwargs = edge_call[e2.name]
                    phi = phi + (grads[e2.name] * e2.module(args[0] + t * direction, *args[1:], **kwargs)).sum()
                for later, attr, (lo, hi) in pre:
                    inp = pre_call[(later, attr)]
                    shift = torch.zeros_like(inp)
                    shift[:, lo:hi] = direction
                    phi = phi + (pre_grads[(later, attr)] * getattr(net.cells[later], attr)(inp + t * shift)).sum()
            rows["immediate_residual"].append(_second_derivative(phi, t))
        for key in out:
            out[key][e.name] = torch.stack(rows[key]).detach()
    return out


def batchnorm_curvature_pieces(module, inp: torch.Tensor, grad_out: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The second derivative of a train-mode BatchNorm along a tangent u at its input, as per-channel pieces.

    With c = x − μ, s = √(var + eps) (biased variance, statistics over every dim but the channels, M entries
    per channel) and g the gradient at the normalized x̂ (the output's gradient times γ), the chain rule
    through μ(x + tu) and s(x + tu) gives, per channel,

        ⟨g, d²x̂/dt²⟩ = −(2/s³)(ℓ₁·u)(ℓ₂·u) + (3G/s⁵)(ℓ₂·u)² − (G/s³)·(|u − ū|²/M),

    with ℓ₁ = g − Σg/M (so ℓ₁·u = g·u − ū Σg), ℓ₂ = c/M (ℓ₂·u = mean(c u)) and G = g·c. Returns ``l1``, ``l2``
    (shaped like ``inp``), ``G``, ``s`` (per channel, broadcastable), ``M`` and the reduced ``dims``.
    """
    dims = [0] + list(range(2, inp.dim()))
    M = inp.numel() // inp.shape[1]
    c = inp - inp.mean(dims, keepdim=True)
    s = (c.square().mean(dims, keepdim=True) + module.eps).sqrt()
    g = grad_out if module.weight is None else grad_out * module.weight.detach().view([1, -1] + [1] * (inp.dim() - 2))
    return {"l1": g - g.sum(dims, keepdim=True) / M, "l2": c / M, "G": (g * c).sum(dims, keepdim=True), "s": s,
            "M": torch.tensor(M), "dims": dims}


def output_space_sketch(net, x, y, samples: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """An unbiased estimate of the exact Z-diagonal ``{edge name: (K,)}`` from ``2·samples`` backward passes.

    exact = Gauss-Newton + Σ over downstream train-mode BatchNorms of their residual (ReLU, pools, convs, the
    classifier have none). Each term is a sum of products (p·u)(q·u) of the tangent u = J B_k at a BatchNorm
    input or at the logits; with independent signs per channel (Gaussians for the |u − ū|² term, a sampled
    label for the Gauss-Newton term) two seeds a, b at every such place, pulled back to the edges' outputs by
    one backward each, give E[(B_k·Jᵀa)(B_k·Jᵀb)] = ∂²L/∂Z_k² for every k and edge. Float64 experiment only.
    """
    net.set_engine("eager")
    edges = net.edge_specs()
    gen = torch.Generator(device=x.device).manual_seed(seed)
    op_out, edge_out, norms = {}, {}, []
    with Hooks() as hooks:
        for e in edges:
            for k, op in enumerate(e.ops):
                hooks.forward(op, lambda m, a, o, n=e.name, k=k: op_out.__setitem__((n, k), o.detach()))
            hooks.forward(e.module, lambda m, a, o, n=e.name: edge_out.__setitem__(n, o))
        for m in net.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                hooks.forward(m, lambda m, a, o: norms.append((m, a[0], o)))
        with preserved_buffers(net):
            logits = net(x)
            loss = F.cross_entropy(logits, y)
    names = list(edge_out)
    grads = torch.autograd.grad(loss, [o for _, _, o in norms], retain_graph=True)
    pieces = [batchnorm_curvature_pieces(m, i.detach(), g) for (m, i, _), g in zip(norms, grads)]
    p = logits.detach().softmax(-1)
    places = [i for _, i, _ in norms] + [logits]
    est = {n: torch.zeros(len(e.ops), dtype=x.dtype, device=x.device) for n, e in zip(names, edges)}

    def sign(shape):
        return torch.randint(0, 2, shape, generator=gen, device=x.device).to(x.dtype) * 2 - 1

    for _ in range(samples):
        seeds_a, seeds_b = [], []
        for (_, inp, _), pc in zip(norms, pieces):
            r1, r2 = sign(pc["G"].shape), sign(pc["G"].shape)
            xi = torch.randn(inp.shape, generator=gen, dtype=x.dtype, device=x.device)
            xi = xi - xi.mean(pc["dims"], keepdim=True)
            s = pc["s"]
            seeds_a.append(-2 * r1 * pc["l1"] / s**3 + 3 * r2 * pc["G"] * pc["l2"] / s**5 - pc["G"] * xi / (pc["M"] * s**3))
            seeds_b.append((r1 + r2) * pc["l2"] + xi)
        label = torch.multinomial(p, 1, generator=gen).squeeze(1)
        r = (p - F.one_hot(label, p.shape[1]).to(p.dtype)) / x.shape[0] ** 0.5
        pulled_a = torch.autograd.grad(places, [edge_out[n] for n in names], seeds_a + [r], retain_graph=True, allow_unused=True)
        pulled_b = torch.autograd.grad(places, [edge_out[n] for n in names], seeds_b + [r], retain_graph=True, allow_unused=True)
        for n, e, a, b in zip(names, edges, pulled_a, pulled_b):
            if a is None:
                continue
            for k in range(len(e.ops)):
                B = op_out[(n, k)]
                est[n][k] += (B * a).sum() * (B * b).sum() / samples
    return est


def main(argv=None):
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--net", default="cell_train", choices=NETS)
    parser.add_argument("--size", default="small", choices=tuple(SIZES), help="shape of the darts net")
    parser.add_argument("--check", action="store_true", help="compare the line derivatives with exact_per_edge")
    parser.add_argument("--sketch", type=numbers(at_least(1), empty=True), default="", metavar="S1,S2,...",  # checked before the minutes of the decomposition (after them before)
                        help="also the output-space sketch with these numbers of samples (seeds 0-2 each)")
    args = parser.parse_args(argv)
    if args.net != "darts" and any(a.dest == "size" for a in given_options(parser, argv)):  # taken and ignored
        raise UsageError(f"--size does nothing for --net {args.net}: it shapes the darts net alone; drop it, or give "
                         "--net darts")
    net, x, y = builder(args.net, args.size)(torch.device("cpu"))
    parts = decompose(net, x, y)
    exact = parts["exact"]
    if args.check:
        ref = arch_diag_hessian(net, F.cross_entropy, x, y, net.edge_specs(), mode="exact_per_edge")
        gap = max(float((ref[n] - exact[n]).abs().max()) for n in exact)
        print(f"line derivatives vs exact_per_edge: max |difference| {gap:.2e}")
    modes = {m: arch_diag_hessian(net, F.cross_entropy, x, y, net.edge_specs(), mode=m) for m in ("diag", "approx", "ggn", "ggn_mc")}
    rows = {**{f"`{m}`": v for m, v in modes.items()},
            "Gauss-Newton term (exact)": parts["ggn_exact"],
            "Gauss-Newton + immediate consumers' residual": {n: parts["ggn_exact"][n] + parts["immediate_residual"][n] for n in exact},
            "immediate consumers' residual alone": parts["immediate_residual"]}
    print(f"{args.net}{' ' + args.size if args.net == 'darts' else ''}: {sum(v.numel() for v in exact.values())} mixing weights, "
          f"torch {torch.__version__}, float64")
    print("| w.r.t. Z | rel. error | Spearman ρ | ops told apart |\n| --- | --- | --- | --- |")
    for label, got in rows.items():
        err, rho = _accuracy(got, exact)
        print(f"| {label} | {err:.3f} | {rho:.3f} | {_ops_told_apart(got, exact):.2f} |")
    for samples in _counts(args.sketch):
        runs = [_accuracy(output_space_sketch(net, x, y, samples, seed), exact) for seed in range(3)]
        err, rho = (sum(r[i] for r in runs) / len(runs) for i in (0, 1))
        print(f"| output-space sketch, {samples} sample(s) (mean of 3 seeds) | {err:.3f} | {rho:.3f} | — |")


def _counts(text: str) -> List[int]:
    """The numbers of samples of ``--sketch`` (checked by its argparse type)."""
    return [int(v) for v in text.split(",") if v.strip()]


if __name__ == "__main__":
    sys.exit(run_script("curvature_residual", main))
