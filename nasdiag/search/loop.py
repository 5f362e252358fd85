"""The search loop: pairs search-train and search-val batches, steps a method, hands statistics to callbacks."""

from __future__ import annotations

from typing import Dict, Optional, Protocol, Sequence

import torch
from torch.utils.data import DataLoader, DistributedSampler

from nasdiag.data import Splits
from nasdiag.distributed import rank as this_rank
from nasdiag.distributed import world_size
from nasdiag.search.base import SearchMethod


class SearchCallback(Protocol):
    """What the loop calls. Statistics map record paths to tensors (see ``docs/schema.md``)."""

    def on_step_end(self, step: int, stats: Dict[str, torch.Tensor]) -> None: ...

    def on_epoch_end(self, epoch: int, stats: Dict[str, torch.Tensor]) -> None: ...

    def on_exception(self, exc: BaseException) -> None: ...


def _loader(dataset, batch_size: int, seed: int, epoch: int) -> DataLoader:
    # The order depends only on (seed, epoch), so a resumed run sees the same batches as an
    # uninterrupted one. Under torch.distributed each rank takes its own shard of that order.
    ranks, rank = world_size(), this_rank()
    if ranks > 1:
        sampler = DistributedSampler(dataset, num_replicas=ranks, rank=rank, shuffle=True, seed=seed, drop_last=True)
        sampler.set_epoch(epoch)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, generator=g)


def steps_per_epoch(splits: Splits, batch_size: int) -> int:
    """Steps of one epoch: full batches of this rank's shard of the smaller search split."""
    return min(len(splits.train), len(splits.val)) // world_size() // batch_size


def run_search(
    method: SearchMethod,
    splits: Splits,
    epochs: int,
    batch_size: int = 64,
    seed: int = 0,
    start_epoch: int = 0,
    callbacks: Sequence[SearchCallback] = (),
    eval_batch_size: int = 256,
) -> Dict[str, float]:
    """Run epochs ``start_epoch .. epochs-1`` of ``method`` on ``splits``.

    Steps are numbered from 1 across epochs (epoch e covers steps ``e*S+1 .. (e+1)*S`` with
    S = :func:`steps_per_epoch`). After each epoch the supernet is evaluated on the whole search-val
    split and ``on_epoch_end`` receives ``scalars/epoch``, ``scalars/search_val_loss`` and
    ``scalars/search_val_acc`` plus the method's :meth:`~SearchMethod.diagnostics` of the epoch (cost
    statistics, Hessian diagonal) (the recorder's callback stores them in the row of the epoch's last step).

    Returns:
        The last epoch's evaluation.
    """
    S = steps_per_epoch(splits, batch_size)
    if S == 0:
        raise ValueError(
            f"batch size {batch_size} is larger than this rank's share of the smallest split "
            f"({min(len(splits.train), len(splits.val)) // world_size()} samples)"
        )
    device = next(method.network.parameters()).device
    dtype = next(method.network.parameters()).dtype
    evaluation: Dict[str, float] = {}
    try:
        for epoch in range(start_epoch, epochs):
            batches = zip(_loader(splits.train, batch_size, seed, epoch), _loader(splits.val, batch_size, seed + 1, epoch))
            for i, ((xt, yt), (xv, yv)) in enumerate(batches):
                step = epoch * S + i + 1
                stats = method.step(
                    (xt.to(device, dtype), yt.to(device)),
                    (xv.to(device, dtype), yv.to(device)),
                )
                for cb in callbacks:
                    cb.on_step_end(step, stats)
            evaluation = method.evaluate(DataLoader(splits.val, batch_size=eval_batch_size))
            epoch_stats = {
                "scalars/epoch": torch.tensor(float(epoch)),
                "scalars/search_val_loss": torch.tensor(evaluation["loss"]),
                "scalars/search_val_acc": torch.tensor(evaluation["acc"]),
                **method.diagnostics(),
            }
            method.epoch_end(epoch)
            for cb in callbacks:
                cb.on_epoch_end(epoch, epoch_stats)
    except BaseException as exc:
        for cb in callbacks:
            cb.on_exception(exc)
        raise
    return evaluation
