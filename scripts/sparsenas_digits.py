"""The DIGITS pruning ablation of SparseNAS (sparse-supernet Fig. 3 and its text), as a batch script.

Regenerates: sparse-supernet Fig. 3 — a 64-40-20-10 MLP on DIGITS trained with SGD / Adam / HAPG / AdamHAPG
under Lasso, Group Lasso (GL) and Sparse Group Lasso (SGL) penalties (eq 2) over a range of λ; four panels
against λ: valid accuracy of the stand-alone sparse network, selected input features, remaining inner neurons,
weight sparsity. The paper's claims (§Ablation Study): at comparable valid accuracy HAPG and AdamHAPG with SGL
give more group (features, neurons) and element (weights) sparsity than SGD and Adam, and with HAPG, SGL beats
Lasso and GL in both. `claim_holds` checks them on the grid.

Every default and where it comes from:

| setting | default | source |
| --- | --- | --- |
| network | 64-40-20-10 MLP, ReLU | §Ablation Study ("two hidden layers (40 and 20 hidden neurons)"); ReLU: Scardapane et al. 2017 |
| data | sklearn digits (8×8 → 64 inputs / 16), stratified 80/20 train/valid split | §Ablation Study (DIGITS, flattened 8×8); the split is ours (the paper does not give it) |
| groups | the outgoing weights of each input feature and hidden neuron (columns of each weight matrix); biases unpenalised | Scardapane et al. 2017, which the paper follows |
| α | Lasso 1, GL 0, SGL 0.5 | eq 2 (α = 1: ℓ1 only, α = 0: group only); SGL 0.5 as in Tables 4, 5 |
| λ | 10^-5, 10^-4.5, 10^-4, 10^-3.7, 10^-3.3, 10^-3 | §Ablation Study: "λ ranging from 10^-5 to 10^-3.7"; the last two continue it, where the group sparsity differs most (accuracy still ≥ 0.94 on seed 0) |
| search | 500 epochs, batch 256 | appendix, Ablation Study |
| SGD | lr 0.025, momentum 0.9, cosine to 0 | appendix |
| Adam | lr 3e-4, betas (0.5, 0.999), constant | appendix |
| HAPG | lr 0.05, cosine to 0 | appendix |
| AdamHAPG | lr 3e-4, betas (0.5, 0.999), constant | appendix |
| SGD / Adam penalty | autograd (sub)gradients of l + Ω (eq 2) | §Optimization, appendix ("SGD and Adam cannot directly derive a sparse network") |
| pruning | HAPG/AdamHAPG: exact zeros; SGD/Adam: \\|w\\| < 10^-3 removed; a neuron with every outgoing weight removed is removed with its incoming weights | appendix, Architecture Evaluation |
| stand-alone training | the pruned network, mask fixed, Adam 3e-4 (0.5, 0.999), batch 256, **100 epochs** | appendix (3000 epochs there: cut for the ≤ 5 min budget) |

What differs from the paper: the stand-alone training is 100 epochs instead of 3000 (`--retrain-epochs`);
one seed (`--seed`); λ is the sparsity strength of a mean-over-batch cross-entropy (the paper does not say
which); the λ grid adds two stronger values.

Writes ``<out>/fig3.h5`` (one row per configuration: λ, accuracy, features, neurons, sparsity, seconds; the
configurations and settings in the record's meta) and ``<out>/fig3.<fmt>`` drawn from the record only;
``--plot-only`` redraws from an existing record. Prints both paths, a table, and the claims.

    python scripts/sparsenas_digits.py --out runs/sparsenas-digits
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from nasdiag.errors import NasdiagError, run_script
from nasdiag.sparse import HAPG, AdamHAPG, sgl_penalty

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # script_args, also when loaded from a file path
from script_args import (refuse_bad_paths, refuse_other_figures, refuse_other_records, refuse_repeats,  # noqa: E402
                         refuse_unexpanded_home, refuse_with_plot_only, seed as seed_number)

OPTIMIZERS = ("sgd", "adam", "hapg", "adamhapg")
PROXIMAL = ("hapg", "adamhapg")
SUBGRADIENT = ("sgd", "adam")
PENALTIES = {"lasso": 1.0, "gl": 0.0, "sgl": 0.5}  # α of eq 2
LAMBDAS = "1e-5,1e-4.5,1e-4,1e-3.7,1e-3.3,1e-3"
PAPER_LAMBDA_RANGE = (1e-5, 10 ** -3.7)  # §Ablation Study
LR = {"sgd": 0.025, "adam": 3e-4, "hapg": 0.05, "adamhapg": 3e-4}  # appendix, Ablation Study
BETAS = (0.5, 0.999)  # appendix: Adam and AdamHAPG "momentum (0.5, 0.999)"
SGD_MOMENTUM = 0.9
COSINE = ("sgd", "hapg")  # appendix: "an annealing cosine decay schedule" for these two
BATCH_SIZE = 256
PRUNE_THRESHOLD = 1e-3  # appendix: SGD/Adam weights below 0.001 are discarded
HIDDEN = (40, 20)


class UsageError(ValueError):
    """A bad command-line setting; reported in one line, exit code 2."""


@dataclass
class Result:
    """One configuration: stand-alone valid ``accuracy`` of the pruned network, ``features`` (of 64) and
    ``neurons`` (of 60) left, ``sparsity`` = fraction of the weights removed, ``seconds`` of wall time."""

    optimizer: str
    penalty: str
    lam: float
    accuracy: float
    features: int
    neurons: int
    sparsity: float
    seconds: float = 0.0

    @property
    def groups(self) -> int:
        """Groups left (input features + inner neurons): the group sparsity of eq 2's ℓ1/ℓ2 term."""
        return self.features + self.neurons


def digits_tensors(seed: int = 0):
    """DIGITS (sklearn, 8×8 → 64 features scaled to [0, 1]); stratified 80/20 train/valid split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xtr, xva, ytr, yva = train_test_split(x / 16.0, y, test_size=0.2, stratify=y, random_state=seed)
    t = lambda a, dt: torch.tensor(a, dtype=dt)  # noqa: E731
    return t(xtr, torch.float32), t(ytr, torch.long), t(xva, torch.float32), t(yva, torch.long)


def mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    (h1, h2) = HIDDEN
    return nn.Sequential(nn.Linear(64, h1), nn.ReLU(), nn.Linear(h1, h2), nn.ReLU(), nn.Linear(h2, 10))


def _linears(net: nn.Sequential) -> List[nn.Linear]:
    return [m for m in net if isinstance(m, nn.Linear)]


def weight_groups(net: nn.Sequential) -> List[torch.Tensor]:
    """Group ids per weight matrix (out, in): column j, all outgoing weights of input unit j, is group j."""
    return [torch.arange(m.in_features).expand(m.out_features, m.in_features).contiguous() for m in _linears(net)]


def make_optimizer(optimizer: str, net: nn.Sequential, lam: float, alpha: float) -> torch.optim.Optimizer:
    """The appendix's optimizer; for HAPG/AdamHAPG Ω (eq 2) on the weights, biases unpenalised (λ = 0)."""
    lin = _linears(net)
    if optimizer == "sgd":
        return torch.optim.SGD(net.parameters(), lr=LR["sgd"], momentum=SGD_MOMENTUM)
    if optimizer == "adam":
        return torch.optim.Adam(net.parameters(), lr=LR["adam"], betas=BETAS)
    groups = [{"params": [m.weight for m in lin], "groups": weight_groups(net), "lam": lam, "alpha": alpha},
              {"params": [m.bias for m in lin], "lam": 0.0}]
    if optimizer == "hapg":
        return HAPG(groups, lr=LR["hapg"])
    return AdamHAPG(groups, lr=LR["adamhapg"], betas=BETAS)


def _batches(n: int, generator: torch.Generator):
    return torch.randperm(n, generator=generator).split(BATCH_SIZE)


def train(optimizer: str, alpha: float, lam: float, data, epochs: int, seed: int) -> nn.Sequential:
    """Search stage: minimise the mean cross-entropy + Ω_SGL (eq 2) for ``epochs`` epochs. SGD and Adam take
    autograd (sub)gradients of the sum; HAPG and AdamHAPG take the gradient of the loss and the proximal
    step of Ω (eq 6–10)."""
    xtr, ytr = data[0], data[1]
    net = mlp(seed)
    weights = [m.weight for m in _linears(net)]
    groups = weight_groups(net)
    opt = make_optimizer(optimizer, net, lam, alpha)
    steps = epochs * math.ceil(len(xtr) / BATCH_SIZE)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps) if optimizer in COSINE else None
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in _batches(len(xtr), g):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(net(xtr[idx]), ytr[idx])
            if optimizer in SUBGRADIENT:
                loss = loss + sum(sgl_penalty(w, lam, alpha, gr) for w, gr in zip(weights, groups))
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
    return net


def prune_masks(net: nn.Sequential, exact_zeros: bool) -> List[torch.Tensor]:
    """Kept-weight masks: non-zero weights (proximal methods) or |w| ≥ 10^-3 (SGD/Adam); then, from the
    output backwards, every hidden unit whose outgoing weights are all removed loses its incoming weights."""
    ws = [m.weight.detach() for m in _linears(net)]
    masks = [(w != 0) if exact_zeros else (w.abs() >= PRUNE_THRESHOLD) for w in ws]
    for i in range(len(masks) - 1, 0, -1):
        alive = masks[i].any(0)  # (in,) units of layer i with an outgoing weight
        masks[i - 1] &= alive.unsqueeze(1)
    return masks


def retrain_and_evaluate(net: nn.Sequential, masks: Sequence[torch.Tensor], data, epochs: int, seed: int) -> float:
    """The stand-alone sparse network: removed weights set to 0 and kept at 0 (masked gradients), trained with
    Adam 3e-4 (0.5, 0.999) for ``epochs`` epochs; returns its valid accuracy."""
    xtr, ytr, xva, yva = data
    lin = _linears(net)
    with torch.no_grad():
        for m, mask in zip(lin, masks):
            m.weight.mul_(mask)
    opt = torch.optim.Adam(net.parameters(), lr=LR["adam"], betas=BETAS)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(epochs):
        for idx in _batches(len(xtr), g):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(net(xtr[idx]), ytr[idx]).backward()
            for m, mask in zip(lin, masks):  # removed connections stay removed (Adam keeps a zero-grad weight fixed)
                m.weight.grad.mul_(mask)
            opt.step()
    with torch.no_grad():
        return float((net(xva).argmax(1) == yva).float().mean())


def run_config(optimizer: str, penalty: str, lam: float, data, epochs: int, retrain_epochs: int, seed: int) -> Result:
    t0 = time.perf_counter()
    net = train(optimizer, PENALTIES[penalty], lam, data, epochs, seed)
    masks = prune_masks(net, exact_zeros=optimizer in PROXIMAL)
    features = int(masks[0].any(0).sum())
    neurons = int(sum(int(m.any(0).sum()) for m in masks[1:]))
    sparsity = 1.0 - float(sum(int(m.sum()) for m in masks)) / sum(m.numel() for m in masks)
    acc = retrain_and_evaluate(net, masks, data, retrain_epochs, seed)
    return Result(optimizer, penalty, lam, acc, features, neurons, sparsity, time.perf_counter() - t0)


def _run_one(args) -> Result:
    optimizer, penalty, lam, epochs, retrain_epochs, seed = args
    torch.set_num_threads(1)  # one process per core: a tiny MLP gains nothing from intra-op threads
    return run_config(optimizer, penalty, lam, digits_tensors(seed), epochs, retrain_epochs, seed)


def run_grid(optimizers: Sequence[str], penalties: Sequence[str], lambdas: Sequence[float], epochs: int,
             retrain_epochs: int, seed: int = 0, workers: int = 1, progress: bool = True) -> List[Result]:
    """Every optimizer × penalty × λ; ``workers`` > 1 runs configurations in that many processes."""
    jobs = [(o, p, lam, epochs, retrain_epochs, seed) for o, p, lam in itertools.product(optimizers, penalties, lambdas)]
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        def tqdm(it, **_):
            return it
    bar = dict(total=len(jobs), disable=not progress, unit="config")
    if workers <= 1:
        data = digits_tensors(seed)
        return [run_config(o, p, lam, data, e, r, s) for o, p, lam, e, r, s in tqdm(jobs, **bar)]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers) as pool:
        return list(tqdm(pool.map(_run_one, jobs), **bar))


# -- record ------------------------------------------------------------------------------------------
COLUMNS = {"lambda": "lam", "valid_acc": "accuracy", "selected_features": "features", "remaining_neurons": "neurons",
           "weight_sparsity": "sparsity", "seconds": "seconds"}


def write_record(results: Sequence[Result], path: Path, settings: Dict) -> None:
    """One record row per configuration (``scalars/<column>``); which optimizer and penalty in ``meta/rows``."""
    from nasdiag.record import Recorder

    meta = {"method": "sparsenas-digits-ablation", "config": settings,
            "rows": [{"optimizer": r.optimizer, "penalty": r.penalty} for r in results]}
    with Recorder(str(path), meta=meta, overwrite=True) as rec:
        for i, r in enumerate(results, start=1):
            rec.log(i, {f"scalars/{col}": float(getattr(r, attr)) for col, attr in COLUMNS.items()})


def read_record(path: Path) -> List[Result]:
    from nasdiag.record import load, load_meta

    rec, rows = load(str(path)), load_meta(str(path))["rows"]
    if len(rec["step"]) < len(rows):  # its write stopped (interrupted, a full disk): a KeyError or IndexError traceback
        raise NasdiagError(f"{path} holds {len(rec['step'])} of the {len(rows)} configurations of its run: its write "
                           f"stopped before it finished (interrupted, or a full disk); run again without --plot-only")
    col = {attr: rec[f"scalars/{name}"] for name, attr in COLUMNS.items()}
    return [Result(row["optimizer"], row["penalty"], float(col["lam"][i]), float(col["accuracy"][i]),
                   int(col["features"][i]), int(col["neurons"][i]), float(col["sparsity"][i]), float(col["seconds"][i]))
            for i, row in enumerate(rows)]


# -- figure ------------------------------------------------------------------------------------------
PANELS = (("accuracy", "valid accuracy (stand-alone)"), ("features", "selected input features (of 64)"),
          ("neurons", "remaining inner neurons (of 60)"), ("sparsity", "weight sparsity (fraction removed)"))
COLORS = {"sgd": "tab:gray", "adam": "tab:blue", "hapg": "tab:orange", "adamhapg": "tab:red"}
MARKERS = {"lasso": "s", "gl": "^", "sgl": "o"}


def draw(results: Sequence[Result], path: Path) -> Path:
    """The four panels of Fig. 3 against λ (log axis): solid lines SGL, dotted Lasso, dashed GL; the paper's
    λ range shaded."""
    from nasdiag.plot.style import PAGE, paper_style, plt

    with paper_style():
        fig, axes = plt.subplots(1, 4, figsize=(PAGE * 1.5, 2.6))
        for opt, pen in sorted({(r.optimizer, r.penalty) for r in results}, key=lambda k: (OPTIMIZERS.index(k[0]), k[1])):
            rows = sorted((r for r in results if r.optimizer == opt and r.penalty == pen), key=lambda r: r.lam)
            for ax, (attr, _) in zip(axes, PANELS):
                ax.plot([r.lam for r in rows], [getattr(r, attr) for r in rows], color=COLORS[opt], marker=MARKERS[pen],
                        ms=3.5, lw=1.4 if pen == "sgl" else 0.9, ls={"sgl": "-", "lasso": ":", "gl": "--"}[pen],
                        label=f"{opt} + {pen}")
        for ax, (_, label) in zip(axes, PANELS):
            ax.set_xscale("log")
            ax.axvspan(*PAPER_LAMBDA_RANGE, color="0.92", zorder=0)
            ax.set_xlabel("λ (eq 2)")
            ax.set_title(label, loc="left")
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside right center", frameon=False, fontsize=6)
        fig.suptitle("sparse-supernet Fig. 3: pruning a 64-40-20-10 MLP on DIGITS (shaded: the paper's λ range)")
        from nasdiag.plot.registry import save

        # nasdiag's save: written under a fresh name and renamed over the figure (savefig on its name left a truncated
        # fig3 after a Ctrl-C mid-write), through a link, with nasdiag's mark (a rerun replaces it), then closed
        save(fig, path, 150)
    return path


# -- the claims --------------------------------------------------------------------------------------
#: the comparisons of the paper's §Ablation Study: (name, side A, side B), a side = (optimizers, penalty)
COMPARISONS = (("prox_vs_subgradient", (PROXIMAL, "sgl"), (SUBGRADIENT, "sgl")),
               ("sgl_vs_lasso", (("hapg",), "sgl"), (("hapg",), "lasso")),
               ("sgl_vs_gl", (("hapg",), "sgl"), (("hapg",), "gl")))


@dataclass
class Comparison:
    """Side A against side B over the λ grid: at each λ, each side's largest weight sparsity and fewest groups
    (features + neurons) among its configurations of comparable accuracy; ``element`` and ``group`` are the
    means over the λ values both sides have of A's sparsity minus B's and of B's groups minus A's (> 0: A is
    sparser); ``lambdas``: how many λ values were compared."""

    element: float
    group: float
    lambdas: int
    element_holds: bool
    group_holds: bool


@dataclass
class Claims:
    """The paper's claims on a grid (see `claim_holds`): ``comparisons[name]`` for ``prox_vs_subgradient``
    (HAPG/AdamHAPG + SGL against SGD/Adam + SGL), ``sgl_vs_lasso`` and ``sgl_vs_gl`` (with HAPG); ``floor``:
    the accuracy counted as comparable."""

    floor: float
    comparisons: Dict[str, Comparison] = field(default_factory=dict)

    def holds(self, name: str, part: str = "both") -> bool:
        """Whether comparison ``name`` holds in ``element`` sparsity, in ``group`` sparsity, or ``both``."""
        c = self.comparisons.get(name)
        if c is None:
            return False
        return {"element": c.element_holds, "group": c.group_holds, "both": c.element_holds and c.group_holds}[part]

    def summary(self) -> str:
        if not self.comparisons:  # it printed "claims: " and nothing after it
            return ("none checked: each comparison needs both its sides (HAPG/AdamHAPG against SGD/Adam, each with SGL; "
                    "HAPG with SGL against HAPG with Lasso or GL) at one λ, of comparable accuracy")
        return ", ".join(f"{name}: element {c.element:+.3f} ({'holds' if c.element_holds else 'fails'}), group "
                         f"{c.group:+.1f} ({'holds' if c.group_holds else 'fails'}) over {c.lambdas} λ"
                         for name, c in self.comparisons.items())


def claim_holds(results: Sequence[Result], accuracy_slack: float = 0.03, sparsity_margin: float = 0.05,
                group_margin: float = 3.0) -> Claims:
    """The paper's claims on a grid, read off Fig. 3's curves: a configuration is of comparable accuracy when
    its stand-alone accuracy is within ``accuracy_slack`` of the best on the grid. For each comparison of
    `COMPARISONS` and each λ, each side's best weight sparsity and fewest groups among its comparable
    configurations are taken; the claim holds in element sparsity when side A's sparsity exceeds B's by at
    least ``sparsity_margin`` on average over λ, and in group sparsity when A keeps at least ``group_margin``
    fewer groups (features + neurons) on average. A comparison with no λ where both sides are comparable
    is absent (does not hold)."""
    best = max((r.accuracy for r in results), default=0.0)
    floor = best - accuracy_slack
    comparable = [r for r in results if r.accuracy >= floor]

    def side(optimizers, penalty, lam):
        return [r for r in comparable if r.optimizer in optimizers and r.penalty == penalty and r.lam == lam]

    claims = Claims(floor)
    for name, a, b in COMPARISONS:
        d_element, d_group = [], []
        for lam in sorted({r.lam for r in results}):
            ra, rb = side(*a, lam), side(*b, lam)
            if ra and rb:
                d_element.append(max(r.sparsity for r in ra) - max(r.sparsity for r in rb))
                d_group.append(min(r.groups for r in rb) - min(r.groups for r in ra))
        if d_element:
            e, g = sum(d_element) / len(d_element), sum(d_group) / len(d_group)
            claims.comparisons[name] = Comparison(e, g, len(d_element), e >= sparsity_margin, g >= group_margin)
    return claims


def _shown(lam: float) -> str:
    """``10^-3.7`` for a power of ten with one decimal (the default grid), else ``lam`` itself: 10^{log10(λ):.2g} headed
    3e-5 and 10^-4.5 (and 2e-4 and 10^-3.7) alike, two columns of one label."""
    power = round(math.log10(lam), 1)
    return f"10^{power:g}" if math.isclose(10 ** power, lam, rel_tol=1e-9) else f"{lam:g}"


def table(results: Sequence[Result]) -> str:
    """Markdown: one row per optimizer × penalty, one column per λ, cells ``acc / features / neurons / sparsity``."""
    lambdas = sorted({r.lam for r in results})
    by = {(r.optimizer, r.penalty, r.lam): r for r in results}
    head = "| optimizer | penalty | " + " | ".join(f"λ = {_shown(lam)}" for lam in lambdas) + " |"
    lines = [head, "|" + " --- |" * (2 + len(lambdas))]
    for opt, pen in itertools.product(OPTIMIZERS, PENALTIES):
        if not any((opt, pen, lam) in by for lam in lambdas):
            continue
        cells = [(lambda r: f"{r.accuracy:.3f} / {r.features} / {r.neurons} / {r.sparsity:.2f}")(by[(opt, pen, lam)])
                 if (opt, pen, lam) in by else "" for lam in lambdas]
        lines.append(f"| {opt} | {pen} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- command line ------------------------------------------------------------------------------------
_POWER = re.compile(r"^1e([+-]?\d+(?:\.\d+)?)$", re.IGNORECASE)  # 1E-3.7 too: it was "not a number"


def parse_lambdas(text: str) -> List[float]:
    """``"1e-5,1e-3.7,0.002"`` -> [1e-5, 10^-3.7, 0.002]: ``1e<x>`` means 10^x, also for fractional x."""
    out = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        m = _POWER.match(token)
        try:
            lam = 10 ** float(m.group(1)) if m else float(token)
        except ValueError:
            raise UsageError(f"λ {token!r} is not a number; give values like 1e-4 or 1e-3.7 (= 10^-3.7)") from None
        except OverflowError:  # 1e400 read as 10^400 (an OverflowError traceback): refused below as not finite
            lam = math.inf
        if not (lam > 0 and math.isfinite(lam)):
            raise UsageError(f"λ must be > 0 and finite (eq 2's sparsity strength), got {token}")
        out.append(lam)
    if not out:
        raise UsageError("--lambdas is empty; give comma-separated values like 1e-5,1e-4")
    return out


def _choices(text: str, allowed: Sequence[str], what: str) -> List[str]:
    chosen = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in chosen if t not in allowed]
    if bad or not chosen:
        raise UsageError(f"unknown {what} {', '.join(bad) or '(none given)'}; choose from {', '.join(allowed)}")
    return chosen


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors in one line too, exit 2 through main
        raise UsageError(f"{message} (see --help)")


def parse(argv) -> Tuple[argparse.Namespace, List[str], List[str], List[float]]:
    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/sparsenas-digits", help="folder for the record and the figure")
    p.add_argument("--epochs", type=int, default=500, help="search epochs (paper: 500)")
    p.add_argument("--retrain-epochs", type=int, default=100, help="stand-alone training epochs (paper: 3000)")
    p.add_argument("--lambdas", default=LAMBDAS, help="comma-separated λ values; '1e-3.7' means 10^-3.7")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--penalties", default=",".join(PENALTIES))
    p.add_argument("--seed", type=seed_number(2 ** 32 - 1), default=0)  # sklearn's random_state
    p.add_argument("--workers", type=int, default=2, help="processes, one torch thread each (default: 2 cores)")
    p.add_argument("--format", default="png", choices=("png", "pdf", "svg"))
    p.add_argument("--plot-only", action="store_true", help="redraw the figure from the existing record")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    refuse_bad_paths(p, args)  # --out '' wrote into the current folder
    refuse_unexpanded_home(p, args)  # --out=~/sp made a folder named ~ here (its own parser skipped script_args's)
    opts = _choices(args.optimizers, OPTIMIZERS, "optimizer(s)")
    pens = _choices(args.penalties, tuple(PENALTIES), "penalty(ies)")
    lambdas = parse_lambdas(args.lambdas)
    try:  # --lambdas 1e-3,0.001 (--optimizers sgd,sgd) trained each configuration twice, drawn as two points at one λ
        shown = [f"{lam:g}" for lam in lambdas]  # 1e-3 and 0.001 alike
        for items, option in ((opts, "--optimizers"), (pens, "--penalties"), (shown, "--lambdas")):
            refuse_repeats(items, option)
    except NasdiagError as err:
        raise UsageError(str(err)) from None
    for name, low in (("epochs", 1), ("retrain_epochs", 0), ("workers", 1)):
        if getattr(args, name) < low:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    cpus = os.cpu_count() or 1
    if args.workers > max(cpus, 2):  # --workers 100000 started processes until the machine stalled (2: the default)
        raise UsageError(f"--workers {args.workers} is more than this machine's {cpus} CPUs (one process each); give at "
                         f"most {max(cpus, 2)}")
    try:  # an option of the run with --plot-only was silently ignored
        refuse_with_plot_only(p, argv, args, ("out", "format"))
    except NasdiagError as err:
        raise UsageError(str(err)) from None
    return args, opts, pens, lambdas


def main(argv=None) -> int:
    try:
        args, opts, pens, lambdas = parse(argv)
    except UsageError as err:
        print(f"sparsenas_digits: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    record = out / "fig3.h5"
    # a file of either name the script did not write (a search's record, the user's fig3.png) was replaced without a word
    refuse_other_figures(str(out), ["fig3"], args.format)
    refuse_other_records([str(record)], "sparsenas-digits-ablation", plot_only=args.plot_only)
    if args.plot_only:
        if not record.exists():
            print(f"sparsenas_digits: error: no record at {record}; run without --plot-only first", file=sys.stderr)
            return 2
    else:
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        results = run_grid(opts, pens, lambdas, args.epochs, args.retrain_epochs, args.seed, args.workers,
                           progress=not args.no_progress)
        settings = {"epochs": args.epochs, "retrain_epochs": args.retrain_epochs, "lambdas": lambdas, "seed": args.seed,
                    "workers": args.workers, "batch_size": BATCH_SIZE, "lr": LR, "betas": list(BETAS),
                    "prune_threshold": PRUNE_THRESHOLD, "alpha": PENALTIES, "torch": torch.__version__,
                    "seconds": round(time.perf_counter() - t0, 1)}
        write_record(results, record, settings)
        print(f"record: {record} ({settings['seconds']} s)")
    results = read_record(record)
    print(f"figure: {draw(results, out / f'fig3.{args.format}')}")
    print(table(results))
    claims = claim_holds(results)
    print(f"comparable accuracy: >= {claims.floor:.3f}")
    print(f"claims: {claims.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(run_script("sparsenas_digits", main))
