"""A search method defined in this file — no edit under nasdiag/ — registered with ``@register`` and
run through `nasdiag.search.run` and through ``nasdiag search --method``, recorded and plotted.

The toy method is exponentiated-gradient on the mixing weights (XNAS's update, Algorithm 1 without
wipeout): Z ← Z·exp(−η·C)/normaliser with the cost C = ∂L/∂Z of the search-val batch, and an SGD step on w.
The test checks its recorded update against that formula computed from the recorded costs' source,
autograd through the supernet at fixed Z.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import numpy as np
import torch
import torch.nn.functional as F

from nasdiag.cli import main
from nasdiag.record import load, load_meta
from nasdiag.search import Hyperparameters, SearchConfig, SearchMethod, hp, register, run
from nasdiag.search.base import accuracy


@register("toy")
class Toy(SearchMethod):
    """Exponentiated-gradient mixing weights with SGD on w (a test method)."""

    @dataclass
    class Hyperparameters(Hyperparameters):
        eta: float = hp(0.5, "Step size of the exponentiated-gradient update of Z.", low=0, low_open=True)
        w_lr: float = hp(0.05, "SGD learning rate of w.", low=0, low_open=True)

    digits_preset = {"eta": 2.0}
    state_attributes = ("z",)

    def build(self) -> None:
        self.z = {t: torch.full_like(a.detach(), 1.0 / a.shape[-1]) for t, a in self.network.alphas().items()}
        self.w_optimizer = torch.optim.SGD(self.network.weight_parameters(), lr=self.hp.w_lr)

    def probabilities(self) -> Dict[str, torch.Tensor]:
        return {t: z.clone() for t, z in self.z.items()}

    def step(self, train_batch, val_batch):
        result = self.cost(*val_batch, self.z)
        for t, c in result.costs.items():
            z = self.z[t] * torch.exp(-self.hp.eta * c)
            self.z[t] = z / z.sum(-1, keepdim=True)
        self.w_optimizer.zero_grad(set_to_none=True)
        x, y = train_batch
        logits = self.model(x, self.z)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        self.w_optimizer.step()
        return {"scalars/train_loss": loss.detach(), "scalars/train_acc": accuracy(logits.detach(), y),
                "scalars/val_loss": result.loss, **self.arch_statistics(self.z)}


SMALL = dict(C=4, layers=3, steps=2, batch_size=240, diagnostics=("cost",), progress=False)


def test_toy_update_is_exponentiated_gradient_of_the_cost():
    torch.manual_seed(0)
    from nasdiag.search import Schedule
    from nasdiag.supernet import Network

    net = Network(4, 5, 3, steps=2, multiplier=2, in_channels=1).double()
    method = Toy(net, Toy.Hyperparameters(eta=0.7), schedule=Schedule(epochs=1, steps_per_epoch=1))
    g = torch.Generator().manual_seed(1)
    batch = lambda: (torch.randn(6, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (6,), generator=g))
    train, val = batch(), batch()
    z0 = method.probabilities()
    # independent reference: autograd of the val loss through per-cell leaves, summed over cells of a type
    leaves = [z0[c.cell_type].clone().requires_grad_(True) for c in net.cells]
    grads = torch.autograd.grad(F.cross_entropy(net(val[0], leaves), val[1]), leaves)
    method.step(train, val)
    for t in net.cell_types:
        c = sum(gr for cell, gr in zip(net.cells, grads) if cell.cell_type == t)
        expected = z0[t] * torch.exp(-0.7 * c)
        torch.testing.assert_close(method.z[t], expected / expected.sum(-1, keepdim=True), rtol=1e-10, atol=1e-14)


def test_toy_method_through_run_and_the_cli(tmp_path, capsys):
    result = run(SearchConfig(method="toy", epochs=1, record=str(tmp_path / "api.h5"), **SMALL))
    rec = load(result.record)
    S = 719 // 240
    assert rec["step"].tolist() == list(range(1, S + 1))
    p = rec["arch/normal/probabilities"]
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-5)
    assert not np.allclose(p[0], p[-1])  # the mixing weights moved
    assert rec["valid/scalars/search_val_acc"].tolist() == [False] * (S - 1) + [True]
    assert rec["cost/normal/count"][-1].min() == S  # the cost service observed every α step
    meta = load_meta(result.record)
    assert meta["method"] == "toy" and meta["hp"] == {"eta": 2.0, "w_lr": 0.05}  # the digits preset applied

    out = tmp_path / "cli.h5"
    code = main(["search", "--method", "toy", "--hp", "eta=1.5", "--epochs", "1", "--C", "4", "--layers", "3", "--steps",
                 "2", "--batch-size", "240", "--diagnostics", "cost", "--no-progress", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert load_meta(out)["hp"]["eta"] == 1.5  # a given value wins over the preset
    assert load(out)["step"].tolist() == list(range(1, S + 1))
    figures = {p.name for p in out.with_name("cli-figs").iterdir()}
    assert "arch_normal_heatmap.png" in figures and "cost_normal_heatmap.png" in figures
    code = main(["methods"])
    listed = capsys.readouterr().out
    assert code == 0 and "toy:" in listed and "eta: float = 0.5" in listed and "darts:" in listed
