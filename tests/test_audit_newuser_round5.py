"""Audit round 5 — a new NAS researcher adopting nasdiag from its README and docs only.

Written here from scratch, in float64, in the style of the public search code (not imported from nasdiag):

* a DARTS ``model_search.py``-style supernet whose cells call their mixed ops with the weights *by keyword*
  (``self._ops[e](h, mix=weights[e])``) and keep α in an ``nn.ParameterList``, searched by the docs' toy method
  (``docs/methods.md``, one class in tests/test_toy_method.py) through ``SearchMethod`` on ``adapt(model, alphas=...)``;
* an NB-201-style supernet with its own names: candidates in an ``nn.ModuleDict``, α in an ``nn.ParameterList``,
  the mixing weights passed as keyword arguments, attached with ``nasdiag.attach(model, edges=...)``;
* a tiny MLP supernet run data-parallel on 2 gloo ranks (``torch.multiprocessing.spawn``) through the probe and
  ``RecorderCallback``, as the README says a user's own loop does it.

References are autograd w.r.t. explicit mixing-weight leaves (C = ∂L/∂Z, wiring supplement §2.1), the docs' toy
update rule written out (Z ← Z·exp(−η·C) renormalised, w ← w − lr·∂L/∂w), ``torch.autograd.functional.hessian``
of L in one edge's Z, and numpy's mean/var over every rank's per-step costs on the concatenated batch.

Defects found (each test says which):

* ``adapt`` (the supernet interface a method needs, ``nasdiag.search.supernet``) refused a DARTS-style cell that
  passes each mixed op its weights by keyword (``op(h, mix=w)``, legal for ``forward(x, mix)``) with "was called
  without its mixing weights", although the probe reads the same op's weights by that name
  (``test_a_method_on_an_adapted_supernet_whose_cells_pass_weights_by_keyword_equals_the_toy_rule_by_hand``);
* on an adapted supernet the pre-hooks of a probe (``SearchMethod(probe=nasdiag.attach(network))``, documented for
  foreign supernets) and of the curvature routes ran before the adapter's substitution of Z: the probe stopped its
  first step blaming the model ("not Σ_k w_k·op_k(x) ... relative deviation 0.9"), and a method's ``exact_per_edge`` /
  ``ggn`` curvature came back as zeros (their shift of Z was overwritten)
  (``test_a_probe_and_the_curvature_of_a_method_on_an_adapted_supernet_see_the_mixing_weights_the_method_passes``).
"""

import copy
import math
import os
import tempfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nasdiag
from nasdiag.search import Schedule
from nasdiag.search.supernet import adapt

from conftest import assert_no_module_hooks, free_port
from test_toy_method import Toy



# the docs' toy method (docs/methods.md), defined in one file as the docs show: tests/test_toy_method.py


# -- a DARTS model_search.py-style supernet: weights by keyword, α in a ParameterList -----------------------------------
class Zero(nn.Module):
    def forward(self, x):
        return x.mul(0.0)


def darts_ops(C):
    return [Zero(), nn.Identity(), nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 3, padding=1, bias=False)),
            nn.AvgPool2d(3, 1, 1, count_include_pad=False)]


DARTS_NAMES = ["none", "skip_connect", "relu_conv_3x3", "avg_pool_3x3"]


class KwMixedOp(nn.Module):
    """DARTS's MixedOp, its weights parameter named ``mix``."""

    def __init__(self, C):
        super().__init__()
        self._ops = nn.ModuleList(darts_ops(C))

    def forward(self, x, mix):
        return sum(w * op(x) for w, op in zip(mix, self._ops))


class KwCell(nn.Module):
    """DARTS's search Cell (2 steps, both nodes concatenated), calling each mixed op as ``op(h, mix=w)``."""

    def __init__(self, C, reduction, by_keyword=True):
        super().__init__()
        self.reduction, self.by_keyword = reduction, by_keyword
        self._steps, self._multiplier = 2, 2
        self.pre0 = nn.Conv2d(2 * C, C, 1, bias=False)
        self.pre1 = nn.Conv2d(2 * C, C, 1, bias=False)
        self._ops = nn.ModuleList(KwMixedOp(C) for _ in range(5))

    def forward(self, s0, s1, weights):
        states, offset = [self.pre0(s0), self.pre1(s1)], 0
        for _ in range(self._steps):
            states.append(sum(self._ops[offset + j](h, mix=weights[offset + j]) if self.by_keyword
                              else self._ops[offset + j](h, weights[offset + j]) for j, h in enumerate(states)))
            offset += len(states) - 1
        return torch.cat(states[-self._multiplier:], dim=1)


class KwNetwork(nn.Module):
    """stem → normal, reduce, normal cells (no stride: 'reduce' is the second α) → GAP → linear."""

    def __init__(self, C=3, classes=4, seed=0, by_keyword=True):
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Conv2d(1, 2 * C, 3, padding=1, bias=False)
        self.cells = nn.ModuleList([KwCell(C, r, by_keyword) for r in (False, True, False)])
        self.classifier = nn.Linear(2 * C, classes)
        g = torch.Generator().manual_seed(seed + 1)
        self.arch = nn.ParameterList([nn.Parameter(0.5 * torch.randn(5, 4, generator=g)) for _ in range(2)])

    def forward(self, x, per_cell=None):
        s0 = s1 = self.stem(x)
        for k, cell in enumerate(self.cells):
            w = F.softmax(self.arch[int(cell.reduction)], -1) if per_cell is None else per_cell[k]
            s0, s1 = s1, cell(s0, s1, w)
        return self.classifier(s1.mean((2, 3)))


def image_batch(seed, B=5, classes=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, classes, (B,), generator=g)


def test_a_method_on_an_adapted_supernet_whose_cells_pass_weights_by_keyword_equals_the_toy_rule_by_hand():
    """Defect: ``adapt`` refused a cell calling its mixed ops as ``op(h, mix=w)`` — "mixed op KwMixedOp was called
    without its mixing weights" — at the method's first forward, though it was called with them (by keyword) and the
    probe reads them by that name. Now: two steps of the docs' toy method on ``adapt(model, alphas={...})`` (α an
    ``nn.ParameterList``) equal the rule written out with autograd on the user's own forward (float64, 1e-12)."""
    model = KwNetwork().double()
    reference = copy.deepcopy(model)
    net = adapt(model, alphas={"normal": model.arch[0], "reduce": model.arch[1]}, primitives=DARTS_NAMES)
    assert net.cell_types == ["normal", "reduce"] and [c.cell_type for c in net.cells] == ["normal", "reduce", "normal"]
    assert [a is b for a, b in zip(net.arch_parameters(), model.arch)] == [True, True]
    method = Toy(net, Toy.Hyperparameters(eta=1.5, w_lr=0.1), schedule=Schedule(epochs=1, steps_per_epoch=2))

    z = {t: torch.full((5, 4), 0.25, dtype=torch.float64) for t in ("normal", "reduce")}
    weights = [p for n, p in reference.named_parameters() if not n.startswith("arch.")]
    for step in range(2):
        train, val = image_batch(2 * step), image_batch(2 * step + 1)
        stats = method.step(train, val)
        # the rule by hand: C = ∂L_val/∂Z per cell (Z a leaf per cell), summed over the cells of a type
        leaves = [z["reduce" if cell.reduction else "normal"].clone().requires_grad_(True) for cell in reference.cells]
        val_loss = F.cross_entropy(reference(val[0], leaves), val[1])
        grads = torch.autograd.grad(val_loss, leaves)
        cost = {"normal": grads[0] + grads[2], "reduce": grads[1]}
        z = {t: z[t] * torch.exp(-1.5 * cost[t]) for t in z}
        z = {t: v / v.sum(-1, keepdim=True) for t, v in z.items()}
        train_loss = F.cross_entropy(reference(train[0], [z["reduce" if c.reduction else "normal"] for c in reference.cells]),
                                     train[1])
        g = torch.autograd.grad(train_loss, weights)
        with torch.no_grad():
            for p, gp in zip(weights, g):
                p -= 0.1 * gp
        for t in z:
            torch.testing.assert_close(method.z[t], z[t], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(stats["scalars/val_loss"], val_loss.detach(), rtol=1e-12, atol=0)
        torch.testing.assert_close(stats["scalars/train_loss"], train_loss.detach(), rtol=1e-12, atol=0)
    for (n, p), q in zip([(n, p) for n, p in model.named_parameters() if not n.startswith("arch.")], weights):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14, msg=n)
    assert_no_module_hooks(model)


def adapted_leaves(reference, z):
    return [z["reduce" if cell.reduction else "normal"].clone().requires_grad_(True) for cell in reference.cells]


def test_a_probe_and_the_curvature_of_a_method_on_an_adapted_supernet_see_the_mixing_weights_the_method_passes():
    """Defect: on an adapted supernet (positional weights, as DARTS's code), ``nasdiag.attach(network)`` — the probe
    ``SearchMethod(probe=...)`` documents for foreign supernets — stopped the first recorded step with "its output is
    not Σ_k w_k·op_k(x) ... (relative deviation 0.9)", and a method's ``curvature`` in ``exact_per_edge`` / ``ggn``
    mode returned zeros ("the loss does not depend on edge(s) ..."): their pre-hooks ran before the adapter's, so they
    read (and shifted) softmax(α) of the user's cell, which the adapter then replaced by the method's Z. Now the
    adapter's substitution runs first: the probe's costs, its exact curvature and the method's ``exact_per_edge``
    curvature at Z ≠ softmax(α) equal autograd (float64), and the GGN modes, which this mixed op cannot run per sample
    (``w * op(x)`` with (B, K) weights), are one ``CurvatureError`` line instead of zeros."""
    from nasdiag.hessian import CurvatureError

    model = KwNetwork(by_keyword=False).double()
    reference = copy.deepcopy(model)
    net = adapt(model, alphas={"normal": model.arch[0], "reduce": model.arch[1]}, primitives=DARTS_NAMES)
    g = torch.Generator().manual_seed(5)
    z = {t: torch.softmax(torch.randn(5, 4, generator=g, dtype=torch.float64), -1) for t in ("normal", "reduce")}
    x, y = image_batch(7)
    leaves = adapted_leaves(reference, z)
    grads = torch.autograd.grad(F.cross_entropy(reference(x, leaves), y), leaves)

    probe = nasdiag.attach(net, hessian="exact")
    with probe.record(targets=y):
        F.cross_entropy(net(x, z), y).backward()
    costs, curvature = probe.costs(), probe.hessian()
    assert_no_module_hooks(model)
    for e in probe.edges:
        torch.testing.assert_close(costs[e.name], grads[e.cell_index][e.edge_index], rtol=1e-10, atol=1e-14)

    def edge_hessian(k, e):
        def loss(row):
            zs = [t.detach().clone() for t in adapted_leaves(reference, z)]
            zs[k] = torch.cat([zs[k][:e], row[None], zs[k][e + 1:]])
            return F.cross_entropy(reference(x, zs), y)
        return torch.autograd.functional.hessian(loss, z["reduce" if reference.cells[k].reduction else "normal"][e])

    by_type = {t: torch.zeros(5, 4, dtype=torch.float64) for t in z}
    for e in probe.edges:
        h = edge_hessian(e.cell_index, e.edge_index).diagonal()
        torch.testing.assert_close(curvature[e.name], h, rtol=1e-9, atol=1e-12)
        by_type[e.cell_type][e.edge_index] += h

    class Fixed(Toy):  # the toy method whose distribution is the Z above (eval_weights = probabilities)
        def build(self):
            super().build()
            self.z = {t: v.clone() for t, v in z.items()}

    method = Fixed(net, schedule=Schedule(epochs=1, steps_per_epoch=1), hessian_mode="exact_per_edge")
    stats = method.curvature(x, y)
    for t in z:
        torch.testing.assert_close(stats[f"hessian/{t}/diag"], by_type[t], rtol=1e-9, atol=1e-12)
    method = Fixed(net, schedule=Schedule(epochs=1, steps_per_epoch=1), hessian_mode="ggn")
    with pytest.raises(CurvatureError) as err:
        method.curvature(x, y)
    assert "\n" not in str(err.value) and "(B, K)" in str(err.value)
    assert_no_module_hooks(model)
