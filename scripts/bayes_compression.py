"""Structural Bayesian compression (BayesNAS appendix §B, Algorithm 3, Table S3) of a small conv net on digits.

Regenerates, in the spirit of Tables S4–S5 (LeNet on MNIST), the pruned architecture and accuracy of a small
conv net trained on sklearn's digits with the reweighted group lasso of Algorithm 3: filter-wise groups
(Table S3 (j)) for the two conv layers, column-wise groups (input features, Table S3 (c) with M = K = 1) for
the two FC layers. Every iteration t: step 1 (B.0.1) trains for ``--epochs-per-iteration`` epochs on
cross-entropy + Σ_l λ Σ_g ω_g ‖W_g‖₂; step 2 takes the diagonal weight Hessian of C.1–C.2
(``nasdiag.hessian.diag_hessian``, mode ``diag``) on one batch, scaled to the energy E_D/λ (E_D the batch's
summed loss, as for Algorithm 2); step 3 updates γ, C, α, ω (B.0.2–B.0.5, ``nasdiag.bayes.structured_update``);
step 4 prunes groups. No retraining of the pruned net: the accuracy is the one at the end of iteration t.
Seed 0, defaults (torch 2.13, CPU): 8-16-256-32 → 8-16-109-31 (filters, filters, features, neurons) at 0.967 test
accuracy, 6 s on one CPU thread, every iteration above 0.93 (docs/bayesnas.md: the last iterations' pruning depends
on the last bits of the training; with the former default λ = 3e-4 the 6th iteration pruned fc2 to 5 neurons).

| setting | default | source |
| --- | --- | --- |
| network | conv 1→8 3×3, ReLU, conv 8→16 3×3, ReLU, max-pool 2, FC 256→32, ReLU, FC 32→10 | ours (LeNet-5-like, for 8×8 digits) |
| groups | conv: filter-wise (j); FC: column-wise (c) (input features / neurons) | Table S3, as for LeNet-5 (§B.2.1) |
| T_max, epochs per iteration | 6, 3 | §B.2.1 uses 10 × 10 on MNIST; cut for a ≤ 1 min CPU budget |
| λ | 1e-4 for every layer | ours (the paper gives λ^l ∈ R+ only): on seed 0, 1e-4 → 8-16-109-31 at 0.967, 3e-4 → 8-13-58-5 at 0.176 (fc2 pruned below 10 neurons in the 6th iteration; the default before round 19), 1e-3 → 7-9-43-15 at 0.791 test accuracy |
| optimizer | SGD 0.05, momentum 0.9, batch 64 | ours |
| pruning ("prune the unimportant connections") | a group whose γ_g ≤ ``--prune-ratio`` (1e-3) × the layer's largest γ is zeroed for good (a filter with its bias, and the fc1 features it feeds); a NaN/inf training loss or energy curvature stops the script in one line | ours: the paper gives no rule for §B; Algorithm 2's entropy threshold is not scale-free for weights |

Writes ``<out>/compression.h5`` (one row per iteration: test accuracy, groups alive per layer) and
``<out>/compression.png`` drawn from the record only. Prints both paths and the pruned architecture.

    python scripts/bayes_compression.py --out runs/bayes-compression
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from nasdiag.errors import NasdiagError, run_script
from script_args import (Parser, UsageError, at_least, number, refuse_other_figures, refuse_other_records, seed as seed_number,
                         threads as thread_count, torch_threads)

LAYERS = {"conv1.weight": (0,), "conv2.weight": (0,), "fc1.weight": (1,), "fc2.weight": (1,)}  # group_dims
LABELS = {"conv1": "conv1 filters", "conv2": "conv2 filters", "fc1": "fc1 inputs (features)", "fc2": "fc2 inputs (neurons)"}


class SmallConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def zero_pruned(params, alive) -> None:
    """Zero the weights of the pruned groups, and the bias of a pruned filter (a filter-wise group owns its output
    channel: with its bias kept it would still output relu(b) everywhere, not be pruned)."""
    from nasdiag.bayes import expand_groups

    with torch.no_grad():
        for n, dims in LAYERS.items():
            params[n].mul_(expand_groups(alive[n], params[n], dims))
            bias = params.get(n.rsplit(".", 1)[0] + ".bias")
            if tuple(dims) == (0,) and bias is not None:
                bias.mul_(alive[n])


def accuracy(net, x, y) -> float:
    with torch.no_grad():
        return float((net(x).argmax(1) == y).double().mean())


def compress(args) -> list:
    from nasdiag.bayes import group_lasso_penalty, group_norms, structured_update
    from nasdiag.data import load_dataset
    from nasdiag.hessian import diag_hessian

    torch.manual_seed(args.seed)
    splits = load_dataset("digits", seed=args.seed)
    xs, ys = zip(*[splits.train[i] for i in range(len(splits.train))] + [splits.val[i] for i in range(len(splits.val))])
    x, y = torch.stack(xs), torch.stack(ys)
    xt, yt = (torch.stack(t) for t in zip(*[splits.test[i] for i in range(len(splits.test))]))
    net = SmallConvNet()
    params = dict(net.named_parameters())
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    omega = {n: torch.ones([params[n].shape[d] for d in dims]) for n, dims in LAYERS.items()}  # ω(0) = 1
    alive = {n: torch.ones_like(o, dtype=torch.bool) for n, o in omega.items()}
    rows = []
    g = torch.Generator().manual_seed(args.seed)
    for t in range(1, args.iterations + 1):
        for _ in range(args.epochs_per_iteration):  # step 1 (B.0.1)
            for idx in torch.randperm(len(y), generator=g).split(args.batch_size):
                loss = F.cross_entropy(net(x[idx]), y[idx])
                for n, dims in LAYERS.items():
                    on = alive[n]
                    loss = loss + args.lam * group_lasso_penalty(params[n], torch.where(on, omega[n], 0.0), dims)
                if not torch.isfinite(loss):  # a diverged run: its NaN γ would be read as every group pruned
                    raise NasdiagError(f"the training loss is {float(loss.detach())} (not finite) in iteration {t}: the training "
                                       "diverged; lower --lr (or --lam)")
                opt.zero_grad()
                loss.backward()
                opt.step()
                zero_pruned(params, alive)  # pruned groups stay zero
        batch = torch.randperm(len(y), generator=g)[: args.hessian_batch]
        H = diag_hessian(net, F.cross_entropy, x[batch], y[batch], mode="diag", params=list(LAYERS))  # step 2
        for n, dims in LAYERS.items():  # step 3 (B.0.2-B.0.5), energy E_D/λ
            energy = H[n] * (len(batch) / args.lam)
            if not bool(torch.isfinite(energy).all()):  # its NaN γ would be read as pruned (γ ≤ ratio × max is false)
                raise NasdiagError(f"the curvature of {n} scaled to the energy E_D/λ (× {len(batch)}/{args.lam:g}) is not "
                                   f"finite in iteration {t}; raise --lam")
            u = structured_update(params[n].detach(), energy, omega[n], dims)
            # a group without positive curvature (inputs that are always 0 after ReLU/pooling) keeps its ω: the
            # Laplace approximation needs H > 0 (ω = 0 would make γ = ∞ at the next iteration)
            informative = group_norms((H[n] > 0).double(), dims) > 0
            omega[n] = torch.where(alive[n] & informative, u.omega, omega[n])
            # step 4: ours (see the table): γ far below the layer's largest
            top = u.gamma[alive[n]].max() if alive[n].any() else torch.zeros(())
            alive[n] = alive[n] & (u.gamma > args.prune_ratio * top)
        # a pruned conv2 filter outputs zeros (its bias zeroed with it), so the fc1 features it feeds carry nothing:
        # they were counted alive (1-1-1-1 at 0.100 test accuracy, its one fc1 feature from a pruned filter)
        alive["fc1.weight"] &= alive["conv2.weight"].repeat_interleave(net.fc1.in_features // net.conv2.out_channels)
        zero_pruned(params, alive)
        row = {"iteration": t, "test_acc": accuracy(net, xt, yt), **{f"alive/{n.split('.')[0]}": int(alive[n].sum())
                                                                       for n in LAYERS}}
        rows.append(row)
        print("  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    return rows


def write_record(rows, path: Path, settings) -> None:
    from nasdiag.record import Recorder

    with Recorder(str(path), meta={"method": "bayes_compression", "script": "bayes_compression", "settings": settings}, overwrite=True) as rec:
        for r in rows:
            rec.log(r["iteration"], {f"scalars/{k.replace('/', '_')}": float(v) for k, v in r.items() if k != "iteration"})


def plot(path: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nasdiag.record import load

    rec = load(str(path))
    it = rec["step"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for key in sorted(k for k in rec if k.startswith("scalars/alive_")):
        a1.plot(it, rec[key], marker="o", label=LABELS[key.split("_", 1)[1]])
    a1.set_xlabel("iteration t (Algorithm 3)")
    a1.set_ylabel("groups alive")
    # linear up to 1, logarithmic above: a layer pruned to 0 groups was not drawn on the log axis
    a1.set_yscale("symlog", linthresh=1)
    a1.set_ylim(bottom=0)
    a1.legend()
    a2.plot(it, rec["scalars/test_acc"], marker="o")
    a2.set_xlabel("iteration t")
    from matplotlib.ticker import MaxNLocator

    for ax in (a1, a2):  # iterations are whole numbers (1.5 was a tick)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    a2.set_ylabel("test accuracy")
    fig.suptitle("BayesNAS §B structured compression on digits")
    fig.tight_layout()
    from nasdiag.plot.registry import save

    # nasdiag's save: written under a fresh name and renamed over the figure (savefig on its name left a truncated
    # compression.png after a Ctrl-C mid-write), through a link, with nasdiag's mark (a rerun replaces it, the user's
    # own is refused), then closed
    save(fig, out, 100)


def main(argv=None) -> int:
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for compression.h5 and compression.png")
    p.add_argument("--iterations", type=at_least(1), default=6, help="T_max, iterations t of Algorithm 3 (default: 6)")
    p.add_argument("--epochs-per-iteration", type=at_least(1), default=3,
                   help="training epochs of step 1 in each iteration (default: 3)")
    p.add_argument("--lam", type=number(), default=1e-4, help="λ of the reweighted group lasso, every layer (default: 1e-4)")
    p.add_argument("--lr", type=number(), default=0.05, help="SGD learning rate, momentum 0.9 (default: 0.05)")
    p.add_argument("--batch-size", type=at_least(1), default=64, help="training batch (default: 64)")
    p.add_argument("--hessian-batch", type=at_least(1), default=256,
                   help="images of the one batch of step 2's diagonal Hessian (default: 256)")
    p.add_argument("--prune-ratio", type=number(0, 1), default=1e-3,
                   help="step 4 prunes a group whose γ is at most this times its layer's largest (default: 1e-3)")
    p.add_argument("--seed", type=seed_number(), default=0, help="seed of the data split, the net and the batches")
    p.add_argument("--threads", type=thread_count(), default=1, help="torch threads (default: 1)")
    try:
        args = p.parse_args(argv)
    except UsageError as exc:  # main() returns 2 for a bad argument, as it did for --lam 0
        print(f"bayes_compression: error: {exc}", file=sys.stderr)
        return 2
    from nasdiag.data import load_dataset

    splits = load_dataset("digits", seed=args.seed)
    images = len(splits.train) + len(splits.val)  # what compress() trains on and draws the Hessian batch from
    for option, value in (("--batch-size", args.batch_size), ("--hessian-batch", args.hessian_batch)):
        if value > images:  # it was silently the whole set: --hessian-batch 5000 and 1438 took the same batch
            print(f"bayes_compression: error: {option} {value} is more than the {images} images of digits' search-train "
                  f"and search-val splits the net is trained on; give {option} {images} or less", file=sys.stderr)
            return 2
    out = Path(args.out)
    record, figure = out / "compression.h5", out / "compression.png"
    # a file of either name the script did not write (a search's record, the user's figure) was replaced without a word
    refuse_other_records([str(record)], "bayes_compression")
    refuse_other_figures(str(out), ["compression"], "png")
    out.mkdir(parents=True, exist_ok=True)
    with torch_threads(args.threads):  # for the compression only: main() in a session left torch at 1 thread
        rows = compress(args)
    write_record(rows, record, vars(args))
    plot(record, figure)
    last = rows[-1]
    print("architecture (filters-filters-features-neurons): 8-16-256-32 -> "
          f"{last['alive/conv1']}-{last['alive/conv2']}-{last['alive/fc1']}-{last['alive/fc2']}, "
          f"test accuracy {last['test_acc']:.4f}")
    print(f"record: {record}\nfigure: {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(run_script("bayes_compression", main))
