"""What the wiring-supplement scripts share: the fixed-α protocol, the supernets and the record loop.

The supplement measures costs with the architecture held still: "fixing α and uniformly sampling
networks in DSNAS, updating θ" (§6, Figs 5, 11, 14) or "fix α and update θ in DARTS" (Fig. 12), then
collects the statistics again near θ's convergence (Figs 5, 6, 19-21). `FixedArchitecture` is that
protocol as a `nasdiag.search.SearchMethod`: α stays uniform, θ is trained by SGD, and every step's
cost C = ∂L/∂Z comes from the method contract's cost service (`SearchMethod.cost`), which also
streams the ``cost/<cell>/{mean,var,count}`` statistics. Nothing here computes a cost itself.

- ``dsnas`` protocol: per step and edge one op drawn uniformly (a one-hot Z); only the sampled op is
  computed (``active``), so its cost statistics are E[C | op sampled], DSNAS's credit protocol.
- ``darts`` protocol: Z = 1/K on every op of every edge (the supernet with fixed uniform α).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from nasdiag.errors import NasdiagError
from nasdiag.search import Hyperparameters, Schedule, SearchMethod, accuracy, hp  # noqa: E402

PROTOCOLS = ("dsnas", "darts")
CELLS = ("minimal", "darts")


class FixedArchitecture(SearchMethod):
    """α fixed at uniform, θ trained: the measurement protocol of the wiring supplement (§3, §6, §8)."""

    name = "fixed_architecture"
    single_level = True  # its step takes the training batch alone (a bi-level method is refused a step without search-val)

    @dataclass
    class Hyperparameters(Hyperparameters):
        protocol: str = hp("dsnas", "dsnas: θ trained on child networks sampled uniformly (one op per edge); "
                           "darts: θ trained on the supernet at uniform α.", choices=PROTOCOLS)
        w_lr: float = hp(0.05, "Initial SGD learning rate of θ (cosine schedule).", low=0, low_open=True)
        w_momentum: float = hp(0.9, "SGD momentum of θ.", low=0, high=1)
        w_weight_decay: float = hp(3e-4, "Weight decay of θ.", low=0)
        grad_clip: float = hp(5.0, "Gradient-norm clip of θ.", low=0, low_open=True)

    def build(self) -> None:
        h = self.hp
        self.w_optimizer = torch.optim.SGD(self.network.weight_parameters(), lr=h.w_lr, momentum=h.w_momentum,
                                           weight_decay=h.w_weight_decay)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.w_optimizer, self.schedule.total_steps)

    def probabilities(self) -> Dict[str, torch.Tensor]:
        return {t: torch.full_like(a, 1.0 / a.shape[-1]).detach() for t, a in self.network.alphas().items()}

    def forward_weights(self) -> Dict[str, torch.Tensor]:
        p = self.probabilities()
        if self.hp.protocol == "darts":
            return p
        # one op per edge, uniformly: a one-hot Z drawn with the method's generator
        return {t: torch.nn.functional.one_hot(torch.multinomial(q, 1, generator=self.generator).squeeze(-1),
                                               q.shape[-1]).to(q.dtype) for t, q in p.items()}

    def active_for(self, weights: Dict[str, torch.Tensor]) -> Optional[Dict[str, torch.Tensor]]:
        """Only the sampled ops run under the dsnas protocol."""
        return None if self.hp.protocol == "darts" else {t: z > 0 for t, z in weights.items()}

    def step(self, train_batch, val_batch) -> Dict[str, torch.Tensor]:
        x, y = train_batch
        weights = self.forward_weights()
        self.w_optimizer.zero_grad(set_to_none=True)
        # one backward gives ∂L/∂θ (accumulated into .grad) and the cost C = ∂L/∂Z (streamed into statistics)
        result = self.cost(x, y, weights, active=self.active_for(weights), train_weights=True)
        torch.nn.utils.clip_grad_norm_(self.network.weight_parameters(), self.hp.grad_clip)
        self.w_optimizer.step()
        self.scheduler.step()
        return {"scalars/train_loss": result.loss, "scalars/train_acc": accuracy(result.logits, y),
                "scalars/w_lr": torch.tensor(self.w_optimizer.param_groups[0]["lr"])}

    def observe(self, batch) -> None:
        """Cost statistics of one batch at the current θ, θ left unchanged."""
        x, y = batch
        weights = self.forward_weights()
        self.cost(x, y, weights, active=self.active_for(weights))



def chosen_runs(value: str, option: str, what: str, known, example: str, out: str, fmt: str, plot_only: bool,
                experiment: str) -> List[str]:
    """The comma-separated names of ``option`` (``--configs``, ``--variants``), each one of ``known`` and given once,
    with every run's folder free of other figures and records (a record of another ``experiment`` of this method, a
    sibling script's, too): all refused in one line before the first run."""
    from script_args import UsageError, refuse_other_figures, refuse_other_records, refuse_repeats

    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:  # it ran nothing and exited 0
        raise UsageError(f"{option} {value!r} names no {what}; give comma-separated names, e.g. {example}")
    unknown = [v for v in names if v not in known]
    if unknown:
        raise UsageError(f"unknown {what}(s) {unknown}; choose from {', '.join(known)}")
    refuse_repeats(names, option)
    for name in names:  # the heatmaps' folders, also for --plot-only
        refuse_other_figures(os.path.join(out, name), None, fmt)
    # every record before the first run, not after it
    records = [os.path.join(out, name, "record.h5") for name in names]
    refuse_other_records(records, FixedArchitecture.name, plot_only=plot_only, experiment=experiment)
    if plot_only:
        refuse_records_without(records, ["cost"])
    return names


def refuse_records_without(records, figures) -> None:
    """With ``--plot-only``, refuse in one line before the first figure a record that is missing or holds none of the
    families the script's ``figures`` draw: a record of the script's method without ``cost/<cell>/mean`` drew nothing
    and the script exited 0 without a word (``nasdiag plot --figures cost`` of it exits 2), and a missing record of
    the second configuration was refused after the first one's figures were drawn."""
    from nasdiag.plot.registry import iter_figures, select
    from nasdiag.record import load
    from script_args import UsageError

    for path in records:
        if not os.path.exists(path):
            raise UsageError(f"no record at {path}; run without --plot-only first")
        if next(iter(iter_figures(load(path), figures)), None) is None:
            families = ", ".join(dict.fromkeys(f.pattern for spec in select(figures) for f in spec.families))
            raise UsageError(f"{path} holds no {families}, which {', '.join(figures)} "
                             f"draw{'s' if len(figures) == 1 else ''}, so --plot-only has nothing of it to redraw; "
                             "run again without --plot-only")


def make_network(cell: str, layers: int, num_classes: int, in_channels: int, C: int = 8, norm: str = "batch",
                 order: str = "relu-conv-bn", affine: bool = False, classifier_bias: bool = True, reductions=None,
                 seed: int = 0):
    """The supernet of an experiment: the minimal cell (Fig. 7: 2 nodes, 5 edges) or the DARTS cell
    (4 nodes, 14 edges), ``layers`` cells with DARTS's reductions unless ``reductions`` is given."""
    from nasdiag.search.runner import _check_tensors_fit
    from nasdiag.supernet import Network

    kwargs = dict(in_channels=in_channels, norm=norm, order=order, affine=affine, classifier_bias=classifier_bias,
                  reductions=reductions)

    def build():
        if cell == "minimal":
            return Network.minimal(C, num_classes, layers, **kwargs)
        return Network(C, num_classes, layers, steps=4, multiplier=4, **kwargs)

    # --C 1000000 was torch's "can't allocate memory" traceback (or, with overcommit, the OOM killer), as nasdiag search
    _check_tensors_fit(build, f"the supernet (--C {C}, {layers} cell(s))", torch.device("cpu"), torch.float32,
                       "use a smaller --C")
    torch.manual_seed(seed)
    return build()


def load_splits(dataset: str, data_dir: Optional[str], seed: int, batch_size: Optional[int] = None,
                observe_batches: Optional[int] = None):
    """The search splits of ``dataset``; with ``batch_size``, refused in one line where the training split holds fewer
    images than one batch (no training step: it was the Schedule's ValueError after the output folder was made), and
    with ``observe_batches`` too, where it asks for more batches than the split has (the rest were silently not
    observed: --observe-batches 100 and 11 observed the same batches)."""
    from nasdiag.data import load_dataset

    kwargs = {"seed": seed}
    if data_dir is not None and dataset != "cifar10":  # it was silently ignored: the run was on digits
        raise NasdiagError(f"--data-dir {data_dir} is only read with --dataset cifar10, not {dataset}; add --dataset cifar10 "
                           "or drop --data-dir")
    if dataset == "cifar10":
        if not data_dir:
            raise NasdiagError("--dataset cifar10 needs --data-dir (the folder of the CIFAR-10 python batches)")
        kwargs.update(root=data_dir, limit=5000)  # a CPU-sized subset; raise it on a GPU machine
    splits = load_dataset(dataset, **kwargs)
    if batch_size is not None and batch_size > len(splits.train):
        raise NasdiagError(f"--batch-size {batch_size} is more than the {len(splits.train)} images of the training split "
                           f"of {dataset}, so an epoch has no step; give --batch-size {len(splits.train)} or less")
    if batch_size is not None and observe_batches is not None and observe_batches > len(splits.train) // batch_size:
        have = len(splits.train) // batch_size
        raise NasdiagError(f"--observe-batches {observe_batches} is more than the {have} batches of {batch_size} images the "
                           f"training split of {dataset} holds ({len(splits.train)} images); give --observe-batches {have} "
                           "or less, or a smaller --batch-size")
    return splits


def batches(dataset, batch_size: int, seed: int, shuffle: bool = True):
    from torch.utils.data import DataLoader

    g = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=shuffle, generator=g)


def numpy_row(stats: Dict[str, torch.Tensor]) -> Dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() if torch.is_tensor(v) else v for k, v in stats.items()}


def record_meta(net, config: Dict, method: str = "fixed_architecture") -> Dict:
    return {"method": method, "config": config, "seed": config.get("seed", 0), "op_names": list(net.primitives),
            "edge_names": {t: net.edge_labels() for t in net.cell_types}, "cell_types": list(net.cell_types)}


def train_fixed(net, splits, record_path: str, config: Dict, epochs: int, batch_size: int = 64,
                observe_batches: int = 8, probe=None, epoch_hook: Optional[Callable] = None, seed: int = 0) -> float:
    """Train θ under the fixed-α protocol and record it; returns the seconds it took.

    Rows: step 0 holds the cost statistics at initialization (``observe_batches`` batches, θ untouched);
    every step its scalars; each epoch's last step the cost statistics of the epoch's training steps
    (the last epoch's are "near θ's convergence"), ``scalars/epoch`` and whatever ``epoch_hook(method,
    epoch)`` returns (also called with epoch -1 at initialization).
    """
    from nasdiag.record import Recorder

    method_hp = FixedArchitecture.Hyperparameters(protocol=config["protocol"], **config.get("hp", {}))
    steps_per_epoch = len(splits.train) // batch_size
    method = FixedArchitecture(net, method_hp, probe=probe, seed=seed,
                               schedule=Schedule(epochs, steps_per_epoch, batch_size, len(splits.train), len(splits.val)))
    start = time.perf_counter()
    with Recorder(record_path, meta=record_meta(net, config), overwrite=True) as rec:
        for i, batch in enumerate(batches(splits.train, batch_size, seed)):
            if i == observe_batches:
                break
            method.observe(batch)
        row = {**method.diagnostics(), "scalars/epoch": torch.tensor(-1.0)}
        row.update(epoch_hook(method, -1) if epoch_hook else {})
        rec.log(0, numpy_row(row))
        step = 0
        for epoch in range(epochs):
            loader = list(batches(splits.train, batch_size, seed + 1 + epoch))
            for i, batch in enumerate(loader):
                step += 1
                row = method.step(batch, None)
                if i == len(loader) - 1:
                    row.update(method.diagnostics())
                    row["scalars/epoch"] = torch.tensor(float(epoch))
                    row.update(epoch_hook(method, epoch) if epoch_hook else {})
                rec.log(step, numpy_row(row))
    return time.perf_counter() - start


def draw_cost_heatmaps(record_path: str, out: str, fmt: str) -> list:
    """The cost-mean heatmaps of a record at initialization and near θ's convergence (first and last
    cost rows), drawn by nasdiag's figure registry."""
    return draw_figures(record_path, out, fmt, ["cost"], "init,final")


def draw_figures(record_path: str, out: str, fmt: str, figures, at=None) -> list:
    """`nasdiag.plot.write_figures`, with a line on stderr for each figure it skipped and one naming the NaN/inf values
    of the drawn families, as ``nasdiag plot`` says them: a heatmap whose row is NaN in every cell (a diverged run) was
    left out without a word, the script exiting 0, and the NaN and inf cells of a heatmap drawn (grey) were not said."""
    from nasdiag.plot import write_figures
    from nasdiag.plot.registry import nonfinite_summary

    written = write_figures(record_path, out, fmt=fmt, figures=figures, at=at)
    for line in written.skipped:
        print(f"skipped {line}", file=sys.stderr)
    if written.nonfinite:
        print(f"{record_path}: {nonfinite_summary(written.nonfinite)} in the drawn families, marked in the figures",
              file=sys.stderr)
    return list(written)
