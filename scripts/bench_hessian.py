"""Benchmark of nasdiag.hessian (issue 4 §4): cost of each Hessian mode side by side, the §C.1
MAC-count scaling check, and the accuracy of ``diag``/``approx`` against ``exact``.

Sections (``--sections``, default ``speed,scaling``; ``speed`` = ``supernet,convnet``):

* ``speed``: on the reference supernet, a plain forward+backward, the α-diagonal in each mode
  (``approx``/``diag``, and ``exact`` by Hessian-vector products), and the weight diagonals; on a
  Sequential sigmoid convnet (DeepOBS-style 3c3d, where BackPACK applies), a plain forward+backward,
  weight ``approx``/``diag``, BackPACK DiagGGNExact and DiagHessian, and ``exact`` by HVPs. Every row
  catches out-of-memory and prints ``OOM`` instead of dying. Targets: α ``approx`` ≤ 3× forward+backward;
  weight ``approx`` ≤ DiagGGNExact.
* ``scaling``: an MLP of width w: the full pre-activation recursion (C.1.2-C.1.3, ``exact``), the
  diagonal one (C.1.4-C.1.5, ``diag``) and ``approx`` timed over w, with fitted log-log slopes next to
  the appendix's MAC counts n(2m²+2n²+4mn+3m−1) and n(2+4m) (n = m = w).
* ``accuracy``: relative errors of ``diag``/``approx`` against ``exact`` (weights and α), small nets.

Examples::

    python scripts/bench_hessian.py                                  # CPU, default sizes
    python scripts/bench_hessian.py --device cuda --batch 64 --C 16 --layers 8 \\
        --conv-batch 64 --conv-width 1 --exact-arch run              # the issue's GPU setting
    python scripts/bench_hessian.py --sections accuracy
"""

from __future__ import annotations

import copy
import os
import gc
import math
import statistics
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hessian import arch_diag_hessian, diag_hessian, exact_arch_diag_hessian
from nasdiag.hessian.rules import NormRule
from nasdiag.errors import run_script
from nasdiag.supernet import Network

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from script_args import Parser, at_least, channels, number, numbers, seed as seed_number  # noqa: E402
from script_args import device as device_name, names as section_names, supernet, threads as thread_count  # noqa: E402


# -- timing --------------------------------------------------------------------------------------
class Timer:
    def __init__(self, device: torch.device, repeat: int):
        self.device, self.repeat = device, repeat

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], object], repeat: Optional[int] = None):
        """Best wall time of ``repeat`` runs after one warm-up, and peak GPU memory; ``"OOM"`` on OOM."""
        repeat = repeat or self.repeat
        try:
            fn()
            self.sync()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            times = []
            for _ in range(repeat):
                start = time.perf_counter()
                fn()
                self.sync()
                times.append(time.perf_counter() - start)
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
            return min(times), peak
        except Exception as err:  # noqa: BLE001 - a row must not kill the table
            if _is_oom(err):
                return "OOM", None
            return f"error: {type(err).__name__}: {str(err)[:120]}", None
        finally:
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()


def _is_oom(err: BaseException) -> bool:
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return True
    text = str(err).lower()
    return "out of memory" in text or "can't allocate memory" in text or "not enough memory" in text


def _fmt_row(name: str, result, base: Optional[float], ref: Optional[float] = None, ref_name: str = "") -> str:
    seconds, peak = result
    if isinstance(seconds, str):
        return f"  {name:<44} {seconds}"
    shown = f"{seconds * 1e3:10.1f} ms" if seconds < 100 else f"{seconds:10.4g}  s"
    line = f"  {name:<44} {shown}   {seconds / base:6.3g}× fwd+bwd" if base else f"  {name:<44} {shown}"
    if ref:
        line += f"   {seconds / ref:6.2f}× {ref_name}"
    if peak is not None:
        line += f"   peak {peak:6.2f} GiB"
    return line


# -- models --------------------------------------------------------------------------------------
def sigmoid_convnet(width: float, image: int, in_channels: int = 3, classes: int = 10) -> nn.Sequential:
    """DeepOBS-style 3c3d with sigmoid activations (BackPACK's DiagHessian supports it)."""
    c1, c2, c3, f1, f2 = (max(1, round(c * width)) for c in (64, 96, 128, 512, 256))
    convs = nn.Sequential(
        nn.Conv2d(in_channels, c1, 5), nn.Sigmoid(), nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(c1, c2, 3), nn.Sigmoid(), nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(c2, c3, 3, padding=1), nn.Sigmoid(), nn.MaxPool2d(3, 2, 1),
    )
    with torch.no_grad():
        n_flat = convs(torch.zeros(1, in_channels, image, image)).numel()
    return nn.Sequential(
        *convs, nn.Flatten(), nn.Linear(n_flat, f1), nn.Sigmoid(), nn.Linear(f1, f2), nn.Sigmoid(), nn.Linear(f2, classes)
    )


def supernet_batch(args, device, dtype):
    torch.manual_seed(args.seed)
    net = supernet(lambda: Network(args.C, 10, args.layers, in_channels=args.in_channels), device,
                   dtype).to(device=device, dtype=dtype)
    if args.image == 8 and args.in_channels == 1:
        from nasdiag.data import digits

        data = digits(seed=args.seed, dtype=dtype).train.tensors
        x, y = data[0][: args.batch].to(device), data[1][: args.batch].to(device)
    else:
        x = torch.randn(args.batch, args.in_channels, args.image, args.image, device=device, dtype=dtype)
        y = torch.randint(0, 10, (args.batch,), device=device)
    return net, x, y


def count_params(named) -> int:
    return sum(p.numel() for _, p in named)


# -- speed ---------------------------------------------------------------------------------------
def speed_supernet(args, device, dtype, timer: Timer):
    net, x, y = supernet_batch(args, device, dtype)
    edges = {s.name: s for s in net.edge_specs()}
    weights = list(net.named_weight_parameters())
    n_z = sum(len(s.ops) for s in edges.values())
    print(
        f"\nReference supernet: Network(C={args.C}, layers={args.layers}, steps=4, K=8), batch {args.batch}×"
        f"{args.in_channels}×{args.image}×{args.image}, {len(edges)} edges ({n_z} mixing weights), "
        f"{count_params(weights)} weights"
    )

    def fwd_bwd():
        net.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()

    base = timer(fwd_bwd)
    print(_fmt_row("plain forward + backward", base, None))
    b = base[0] if not isinstance(base[0], str) else None
    for mode in ("approx", "diag", "ggn_mc"):
        r = timer(lambda: arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode, wrt="alpha"))
        print(_fmt_row(f"α diagonal, mode={mode}", r, b) + ("   (target ≤ 3×)" if mode in ("approx", "ggn_mc") else ""))
    print(_exact_arch_row(args, net, x, y, edges, timer, b))
    for mode in ("approx", "diag"):
        r = timer(lambda: diag_hessian(net, F.cross_entropy, x, y, mode=mode, params=weights))
        print(_fmt_row(f"weight diagonal, mode={mode}", r, b))


def speed_convnet(args, device, dtype, timer: Timer):
    torch.manual_seed(args.seed)
    conv = sigmoid_convnet(args.conv_width, args.conv_image).to(device=device, dtype=dtype)
    cx = torch.randn(args.conv_batch, 3, args.conv_image, args.conv_image, device=device, dtype=dtype)
    cy = torch.randint(0, 10, (args.conv_batch,), device=device)
    n_conv = count_params(conv.named_parameters())
    print(
        f"\nSigmoid 3c3d convnet (Sequential, no BN), width ×{args.conv_width}, batch {args.conv_batch}×3×"
        f"{args.conv_image}×{args.conv_image}, {n_conv} weights"
    )

    def conv_fwd_bwd():
        conv.zero_grad(set_to_none=True)
        F.cross_entropy(conv(cx), cy).backward()

    base = timer(conv_fwd_bwd)
    b = base[0] if not isinstance(base[0], str) else None
    ggn = _backpack_row(conv, cx, cy, "DiagGGNExact", timer)
    g = ggn[0] if not isinstance(ggn[0], str) else None
    print(_fmt_row("plain forward + backward", base, None))
    for mode in ("approx", "diag"):
        r = timer(lambda: diag_hessian(conv, F.cross_entropy, cx, cy, mode=mode))
        print(_fmt_row(f"weight diagonal, mode={mode}", r, b, g, "DiagGGNExact") + ("   (target ≤ 1× GGN)" if mode == "approx" else ""))
    print(_fmt_row("BackPACK DiagGGNExact", ggn, b))
    print(_fmt_row("BackPACK DiagHessian (exact)", _backpack_row(conv, cx, cy, "DiagHessian", timer), b, g, "DiagGGNExact"))
    print(_exact_weights_row(args, conv, cx, cy, timer, b))


def _backpack_row(model, x, y, extension: str, timer: Timer):
    try:
        from backpack import backpack, extend, extensions
    except ImportError:  # a reference only, in the test and bench extras, not a dependency of nasdiag
        return "not measured: BackPACK is not installed (pip install -e \".[bench]\")", None

    bp_model = extend(copy.deepcopy(model))  # its hooks must not touch the model we time otherwise
    loss_fn = extend(nn.CrossEntropyLoss())
    ext = getattr(extensions, extension)

    def run():
        bp_model.zero_grad(set_to_none=True)
        for p in bp_model.parameters():
            for attr in ("diag_h", "diag_ggn_exact"):
                if hasattr(p, attr):
                    delattr(p, attr)
        with warnings.catch_warnings(), backpack(ext()):
            warnings.simplefilter("ignore", UserWarning)  # BackPACK's full-backward-hook notice
            loss_fn(bp_model(x), y).backward()

    try:
        return timer(run, repeat=1)
    finally:
        del bp_model


def _exact_arch_row(args, net, x, y, edges, timer: Timer, base) -> str:
    name = "α diagonal, mode=exact (HVPs)"
    if args.exact_arch == "skip":
        return f"  {name:<44} skipped (--exact-arch skip)"
    if args.exact_arch == "run":
        return _fmt_row(name, timer(lambda: exact_arch_diag_hessian(net, F.cross_entropy, x, y, edges, wrt="alpha", shared_alpha="per_edge"), 1), base)
    # estimate: the HVP count is the number of mixing weights; time a subset of edges and scale
    subset = dict(list(edges.items())[: args.exact_estimate_edges])
    seconds, peak = timer(lambda: exact_arch_diag_hessian(net, F.cross_entropy, x, y, subset, wrt="alpha", shared_alpha="per_edge"), 1)
    if isinstance(seconds, str):
        return f"  {name:<44} {seconds}"
    est = seconds * len(edges) / len(subset)
    return _fmt_row(name, (est, peak), base) + f"   (est. from {len(subset)}/{len(edges)} edges)"


def _exact_weights_row(args, model, x, y, timer: Timer, base) -> str:
    """Exact diagonal by one HVP per weight: timed on one tensor, extrapolated by the weight count."""
    name = "weight diagonal, mode=exact (HVPs)"
    named = list(model.named_parameters())
    total = count_params(named)
    if args.exact_weights == "skip":
        return f"  {name:<44} skipped"
    if args.exact_weights == "run" or total <= 64:
        return _fmt_row(name, timer(lambda: diag_hessian(model, F.cross_entropy, x, y, mode="exact"), 1), base)
    # the smallest tensor that fills a chunk of batched HVPs, so the fixed forward/backward is amortized
    small = min((kv for kv in named if kv[1].numel() >= 32), key=lambda kv: kv[1].numel(), default=named[0])
    seconds, peak = timer(lambda: diag_hessian(model, F.cross_entropy, x, y, mode="exact", params=[small[0]]), 1)
    if isinstance(seconds, str):
        return f"  {name:<44} {seconds}"
    return _fmt_row(name, (seconds * total / small[1].numel(), peak), base) + f"   (est. from {small[1].numel()} of {total} HVPs)"


# -- scaling (§C.1 MAC counts) -------------------------------------------------------------------
def scaling(args, device, dtype, timer: Timer):
    widths = [int(w) for w in args.scaling_widths.split(",") if w.strip()]
    N = args.scaling_batch
    print(
        f"\n§C.1 scaling: MLP w→w→w→10 (sigmoid), batch {N}; per-layer MACs per sample from the appendix: "
        "full n(2m²+2n²+4mn+3m−1), diagonal n(2+4m), n = m = w"
    )
    print(f"  {'w':>6} {'full MACs':>12} {'diag MACs':>10} {'exact (C.1.3)':>14} {'diag (C.1.5)':>13} {'approx':>10}")
    rows: Dict[str, List[float]] = {"exact": [], "diag": [], "approx": []}
    for w in widths:
        torch.manual_seed(args.seed)
        mlp = nn.Sequential(nn.Linear(w, w), nn.Sigmoid(), nn.Linear(w, w), nn.Sigmoid(), nn.Linear(w, 10))
        mlp = mlp.to(device=device, dtype=dtype)
        x = torch.randn(N, w, device=device, dtype=dtype)
        y = torch.randint(0, 10, (N,), device=device)
        cells = []
        for mode in ("exact", "diag", "approx"):
            if mode == "exact" and w > args.scaling_exact_max:
                rows[mode].append(math.nan)
                cells.append("-")
                continue
            seconds, _ = timer(lambda: diag_hessian(mlp, F.cross_entropy, x, y, mode=mode))
            rows[mode].append(seconds if not isinstance(seconds, str) else math.nan)
            cells.append(f"{seconds * 1e3:9.1f} ms" if not isinstance(seconds, str) else f"{seconds:>12}")
        full = w * (2 * w * w + 2 * w * w + 4 * w * w + 3 * w - 1)
        print(f"  {w:>6} {full:>12.3g} {w * (2 + 4 * w):>10.3g} {cells[0]:>14} {cells[1]:>13} {cells[2]:>10}")
    logs = [math.log(w) for w in widths]
    for mode, ts in rows.items():
        pts = [(lw, math.log(t)) for lw, t in zip(logs, ts) if t == t and t > 0]
        if len(pts) >= 2:
            slope = _slope(pts[-3:] if len(pts) >= 3 else pts)
            print(f"  log-log slope of {mode:<6} over the largest widths: {slope:4.2f}")
    print("  (appendix: full ∝ w³ per layer and sample, diagonal ∝ w²; the slopes include fixed overheads)")


def _slope(pts):
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    return sum((a - mx) * (b - my) for a, b in pts) / sum((a - mx) ** 2 for a, _ in pts)


# -- accuracy ------------------------------------------------------------------------------------
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten() - a.mean(), b.flatten() - b.mean()
    return (a @ b / (a.norm() * b.norm()).clamp_min(1e-300)).item()


def _weights_report(title, model, loss_fn, x, y, rules=None):
    exact = diag_hessian(model, loss_fn, x, y, mode="exact")
    names = list(exact)
    flat_e = torch.cat([exact[n].flatten() for n in names])
    for mode in ("diag", "approx"):
        got = diag_hessian(model, loss_fn, x, y, mode=mode, rules=rules)
        flat_g = torch.cat([got[n].flatten() for n in names])
        per = [f"{n}: {_rel(got[n], exact[n]):.2f}" for n in names if n.endswith("weight")]
        print(f"  {title:<34} {mode:<6} all: rel {_rel(flat_g, flat_e):5.2f}, corr {_corr(flat_g, flat_e):5.2f} | {', '.join(per)}")


def accuracy(args, device, timer):
    dt = torch.float64
    torch.manual_seed(args.seed)
    print("\nAccuracy against mode='exact' (float64): rel = ‖got − exact‖/‖exact‖, corr = Pearson over entries")
    x, y = torch.randn(32, 10, dtype=dt), torch.randint(0, 10, (32,))
    mlp = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 10)).to(dt)
    _weights_report("MLP tanh 10-16-16-10, CE", mlp, F.cross_entropy, x, y)
    cx, cy = torch.randn(16, 3, 16, 16, dtype=dt), torch.randint(0, 10, (16,))
    conv = sigmoid_convnet(1 / 16, 16).to(dt)
    _weights_report("sigmoid 3c3d ×1/16 on 16×16, CE", conv, F.cross_entropy, cx, cy)
    cx, cy = cx[:, :, :8, :8], cy
    bn = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 6, 3, padding=1, bias=False),
        nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 10),
    ).to(dt)
    _weights_report("conv-BN-ReLU ×2, BN through stats", bn, F.cross_entropy, cx, cy)
    affine = {nn.BatchNorm2d: NormRule(through_statistics=False)}
    _weights_report("conv-BN-ReLU ×2, BN as affine map", bn, F.cross_entropy, cx, cy, rules=affine)

    net = Network.minimal(4, 10, 3, in_channels=1).to(dt)
    from nasdiag.data import digits

    data = digits(seed=args.seed, dtype=dt).train.tensors
    sx, sy = data[0][:16], data[1][:16]
    edges = {s.name: s for s in net.edge_specs()}
    for wrt in ("Z", "alpha"):
        exact = exact_arch_diag_hessian(net, F.cross_entropy, sx, sy, edges, wrt=wrt)
        fe = torch.cat(list(exact.values()))
        for mode in ("diag", "approx"):
            got = arch_diag_hessian(net, F.cross_entropy, sx, sy, edges, mode=mode, wrt=wrt)
            fg = torch.cat(list(got.values()))
            per_edge = [_rel(got[k], exact[k]) for k in edges]
            print(
                f"  minimal supernet C=4 L=3, {wrt:<5} {mode:<6} all: rel {_rel(fg, fe):5.2f}, corr {_corr(fg, fe):5.2f}, "
                f"per-edge rel median {statistics.median(per_edge):.2f} (min {min(per_edge):.2f}, max {max(per_edge):.2f})"
            )


def main(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", type=device_name, default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--threads", type=thread_count(), default=None, help="torch CPU threads")
    p.add_argument("--repeat", type=at_least(1), default=3, help="timed runs per row (best is reported)")
    p.add_argument("--seed", type=seed_number(), default=0)
    p.add_argument("--sections", type=section_names(('speed', 'supernet', 'convnet', 'scaling', 'accuracy'), "section"), default="speed,scaling")
    p.add_argument("--C", type=channels, default=8, help="supernet channels")
    p.add_argument("--layers", type=at_least(1), default=5, help="supernet cells")
    p.add_argument("--batch", type=at_least(1), default=64, help="supernet batch")
    p.add_argument("--image", type=at_least(1), default=8, help="supernet input size (8 with 1 channel: sklearn digits)")
    p.add_argument("--in-channels", type=at_least(1), default=1)
    p.add_argument("--conv-batch", type=at_least(1), default=16)
    p.add_argument("--conv-width", type=number(), default=0.25, help="3c3d channel/width multiplier (1 = DeepOBS)")
    p.add_argument("--conv-image", type=at_least(1), default=32)
    p.add_argument("--exact-arch", default="estimate", choices=["run", "estimate", "skip"])
    p.add_argument("--exact-estimate-edges", type=at_least(1), default=2)
    p.add_argument("--exact-weights", default="estimate", choices=["run", "estimate", "skip"])
    p.add_argument("--scaling-widths", type=numbers(at_least(1)), default="64,128,256,512,1024,2048,4096")
    p.add_argument("--scaling-exact-max", type=at_least(1), default=1024, help="largest width for the O(w³) full recursion")
    p.add_argument("--scaling-batch", type=at_least(1), default=32)
    p.add_argument(
        "--cpu-memory-limit-gb",
        type=number(),
        default=None,
        help="address-space cap on CPU so an allocation that cannot fit raises (printed as OOM) instead of "
        "waking the kernel's OOM killer; default 60%% of MemTotal",
    )
    args = p.parse_args(argv)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = _cpu_name()
    print(f"device: {name} ({device}); torch {torch.__version__}; dtype {args.dtype}; threads {torch.get_num_threads()}")
    if device.type == "cpu":
        limit = _limit_cpu_memory(args.cpu_memory_limit_gb)
        print(f"CPU address-space cap: {limit:.1f} GiB (allocations beyond it are reported as OOM)")
    timer = Timer(device, args.repeat)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if "speed" in sections or "supernet" in sections:
        speed_supernet(args, device, dtype, timer)
    if "speed" in sections or "convnet" in sections:
        speed_convnet(args, device, dtype, timer)
    if "scaling" in sections:
        scaling(args, device, dtype, timer)
    if "accuracy" in sections:
        accuracy(args, device, timer)


def _limit_cpu_memory(gib: Optional[float]) -> float:
    import resource

    if gib is None:
        with open("/proc/meminfo") as f:
            total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
        gib = 0.6 * total_kib / 2**20
    cap = int(gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return gib


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "CPU"


if __name__ == "__main__":
    sys.exit(run_script("bench_hessian", main))
