"""Cost audit round 14 (cost14): nasdiag's own DARTS supernet (``nasdiag.supernet.Network``, its fast engine and the
eager modules) against a float64 DARTS network written from scratch here (functional ops reading the supernet's
``state_dict``, Z leaves per cell, plain autograd for ∂L/∂Z). Never nasdiag against nasdiag.

Defect found (the test fails without its fix):

* The fast engine decided "training mode" by the network's own flag only. A cell module switched to eval on its own
  (frozen BatchNorms, ``net.cells[k].eval()`` inside a training network) normalizes with its running statistics in the
  eager forward, but the batched path normalized it by the batch and updated its running statistics: under the
  default engine (``auto``) the loss moved by 0.06-0.1 and the costs ∂L/∂Z by up to 0.55, silently. Such a forward now
  runs on the eager modules (an ``EngineWarning`` naming the module under ``fast``)
  (test_a_cell_module_in_eval_mode_inside_a_training_network_costs_as_the_reference_and_keeps_its_buffers).

Checked and right (own references): the cost statistics a ``nasdiag.search.run`` records (float64, ``diagnostics
cost``, engines fast and eager) = numpy mean/var over the per-step ∂L/∂Z of the own network at the state and batch of
each α step (count = steps × cells, reset at each epoch); fast = eager there to 1e-16 for darts, darts2, snas, dsnas,
xnas, bayesnas, sparsenas, proxyless; the batches are those of ``epoch_batches`` seeded as the runner's code says;
fast = eager (first and second order, BN buffers) over random primitive subsets and orders, steps 1-3, multipliers,
layers 1-4, reduction positions, odd sizes, expanded / shared / non-contiguous / float32 Z; a method's probe on its
Network: costs, per-sample rows, output costs and path parts = the tapped reference, its statistics and the method's =
numpy; Thm. 1 (intermediate edges through BN at eps = 1e-12), Cor. 1.2 and Thm. 2 (L − H) on nasdiag's DARTS cell in the
fast engine; ``derive_genotype`` with ties in normal and reduction cells = a transcription of DARTS's ``_parse``.
"""

import copy
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

DT = torch.float64
PRIMS = ("none", "skip_connect", "max_pool_3x3", "avg_pool_3x3", "sep_conv_3x3", "sep_conv_5x5", "dil_conv_3x3",
         "dil_conv_5x5")


# -- an own float64 DARTS network, functional, reading a Network's state_dict ---------------------------------------
class Ref:
    """DARTS (Liu et al.) search network: stem conv-BN, cells of relu-conv-BN preprocessing (FactorizedReduce after a
    reduction), mixed ops Σ_k Z_k O_k, concatenation of the last ``mult`` nodes, GAP, linear. ``evals``: prefixes of
    the modules in eval mode (their BatchNorms use the running statistics of ``P``)."""

    def __init__(self, P, layers, steps, mult, reductions, eps=1e-5, evals=()):
        self.P, self.layers, self.steps, self.mult, self.red, self.eps, self.evals = P, layers, steps, mult, reductions, eps, evals

    def bn(self, x, p):
        P = self.P
        if any(p == e or p.startswith(e + ".") for e in self.evals):
            m, v = P[p + ".running_mean"].view(1, -1, 1, 1), P[p + ".running_var"].view(1, -1, 1, 1)
        else:
            m = x.mean((0, 2, 3), keepdim=True)
            v = ((x - m) ** 2).mean((0, 2, 3), keepdim=True)
        y = (x - m) / torch.sqrt(v + self.eps)
        if p + ".weight" in P:
            y = y * P[p + ".weight"].view(1, -1, 1, 1) + P[p + ".bias"].view(1, -1, 1, 1)
        return y

    def rcb(self, x, p):
        return self.bn(F.conv2d(F.relu(x), self.P[p + ".1.weight"]), p + ".2")

    def dil(self, x, p, stride, pad, d):
        h = F.conv2d(F.relu(x), self.P[p + ".1.weight"], stride=stride, padding=pad, dilation=d, groups=x.shape[1])
        return self.bn(F.conv2d(h, self.P[p + ".2.weight"]), p + ".3")

    def fr(self, x, p):
        x = F.relu(x)
        return self.bn(torch.cat([F.conv2d(x, self.P[p + ".conv_1.weight"], stride=2),
                                  F.conv2d(x[:, :, 1:, 1:], self.P[p + ".conv_2.weight"], stride=2)], 1), p + ".norm")

    def op(self, name, x, p, s):
        if name == "none":
            return torch.zeros_like(x[:, :, ::s, ::s])
        if name == "skip_connect":
            return x if s == 1 else self.fr(x, p)
        if name == "max_pool_3x3":
            return self.bn(F.max_pool2d(x, 3, s, 1), p + ".1")
        if name == "avg_pool_3x3":
            return self.bn(F.avg_pool2d(x, 3, s, 1, count_include_pad=False), p + ".1")
        k = int(name[-1])
        if name.startswith("sep_conv"):
            return self.dil(self.dil(x, p + ".0", s, k // 2, 1), p + ".1", 1, k // 2, 1)
        return self.dil(x, p, s, 2 * (k // 2), 2)

    def forward(self, x, Zs, prims=PRIMS):
        P = self.P
        s0 = s1 = self.bn(F.conv2d(x, P["stem.0.weight"], padding=1), "stem.1")
        red_prev = False
        for c in range(self.layers):
            red, q = c in self.red, f"cells.{c}"
            states = [self.fr(s0, q + ".preprocess0") if red_prev else self.rcb(s0, q + ".preprocess0"),
                      self.rcb(s1, q + ".preprocess1")]
            e = 0
            for _ in range(self.steps):
                node = 0
                for i, h in enumerate(list(states)):
                    s = 2 if red and i < 2 else 1
                    node = node + sum(Zs[c][e, k] * self.op(n, h, f"{q}.edges.{e}.ops.{k}", s) for k, n in enumerate(prims))
                    e += 1
                states.append(node)
            s0, s1, red_prev = s1, torch.cat(states[-self.mult:], 1), red
        return F.linear(s1.mean((2, 3)), P["classifier.weight"], P.get("classifier.bias"))

    def costs(self, x, y, Zs, prims=PRIMS):
        Zs = [z.detach().clone().requires_grad_(True) for z in Zs]
        loss = F.cross_entropy(self.forward(x, Zs, prims), y)
        return loss.detach(), torch.autograd.grad(loss, Zs)


def _net(layers=3, steps=2, mult=2, seed=0, **kw):
    from nasdiag.supernet import Network

    torch.manual_seed(seed)
    return Network(4, 5, layers, steps=steps, multiplier=mult, in_channels=2, **kw).to(DT)


def _batch(seed=1, B=6, H=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 2, H, H, dtype=DT, generator=g), torch.randint(0, 5, (B,), generator=g)


# -- the defect ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["auto", "fast"])
@pytest.mark.parametrize("frozen", ["cells.1", "cells.0.edges.2.ops.4", "every BatchNorm"])
def test_a_cell_module_in_eval_mode_inside_a_training_network_costs_as_the_reference_and_keeps_its_buffers(engine, frozen):
    """A training network with some modules in eval mode (frozen BatchNorms, a frozen cell): the eager modules normalize
    those by their running statistics and leave them alone; the batched engine took the batch's statistics and updated
    them (loss 0.06-0.1 off, costs up to 0.55 off, under the default engine)."""
    from nasdiag.supernet.engine import EngineWarning

    net, (x, y) = _net(), _batch()
    net.train()
    with torch.no_grad():
        net(x)  # running statistics away from their initial 0 / 1, so that eval mode matters
    net.set_engine(engine)
    frozen_modules = [m for n, m in net.named_modules() if isinstance(m, nn.BatchNorm2d)] if frozen == "every BatchNorm" \
        else [dict(net.named_modules())[frozen]]
    for m in frozen_modules:
        m.eval()
    evals = [n for n, m in net.named_modules() if not m.training]
    P = copy.deepcopy(net.state_dict())
    frozen_buffers = {k: v.clone() for k, v in P.items() if "running" in k and any(k.startswith(e + ".") for e in evals)}
    assert frozen_buffers
    Zs = [torch.softmax(torch.randn(net.num_edges, 8, dtype=DT, generator=torch.Generator().manual_seed(c)), -1)
          for c in range(3)]
    ref_loss, ref = Ref(P, 3, 2, 2, (1, 2), evals=evals).costs(x, y, Zs)
    leaves = [z.clone().requires_grad_(True) for z in Zs]
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        loss = F.cross_entropy(net(x, leaves), y)
    got = torch.autograd.grad(loss, leaves)
    assert abs(loss.item() - ref_loss.item()) < 1e-12
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    after = net.state_dict()
    for k, v in frozen_buffers.items():
        assert torch.equal(after[k], v), f"{k} moved in an eval-mode module"
    said = [str(w.message) for w in told if issubclass(w.category, EngineWarning)]
    assert (len(said) == 1 and "eval mode" in said[0]) if engine == "fast" else not said


# -- checked and right -----------------------------------------------------------------------------------------------
def test_the_cost_statistics_a_search_records_equal_numpy_over_the_own_networks_costs(monkeypatch):
    """``run`` with ``diagnostics cost`` in float64 on the fast engine: each epoch's cost/<cell>/{mean,var,count} = numpy
    over the own network's ∂L/∂Z at the state and batch of every α step (each cell one observation; the eager engine's
    run gave the same to 1e-16 in the audit, at twice the time)."""
    from nasdiag.search import SearchConfig, run
    from nasdiag.search import base

    cost = base.SearchMethod.cost

    for engine in ("fast",):
        seen, rows = [], {}

        def spy(self, x, y, weights, **kw):
            if kw.get("observe", True):
                seen.append((copy.deepcopy(self.network.state_dict()), x.clone(), y.clone(),
                             {t: w.detach().clone() for t, w in weights.items()}))
            return cost(self, x, y, weights, **kw)

        class Rows:
            def on_step_end(self, step, stats):
                pass

            def on_epoch_end(self, epoch, stats):
                rows[epoch] = {k: v.clone() for k, v in stats.items() if k.startswith("cost/")}

            def on_exception(self, exc):
                pass

        monkeypatch.setattr(base.SearchMethod, "cost", spy)
        run(SearchConfig(method="darts", C=2, layers=3, steps=2, epochs=2, batch_size=240, dtype="float64",
                         diagnostics=("cost",), device="cpu", progress=False, threads=1, engine=engine), callbacks=[Rows()])
        monkeypatch.setattr(base.SearchMethod, "cost", cost)
        S = len(seen) // 2
        assert S >= 2 and len(seen) == 2 * S
        for epoch in (0, 1):
            per = {"normal": [], "reduce": []}
            for P, x, y, W in seen[epoch * S:(epoch + 1) * S]:
                _, g = Ref(P, 3, 2, 2, (1, 2)).costs(x, y, [W["normal"], W["reduce"], W["reduce"]])
                per["normal"].append(g[0].numpy())
                per["reduce"] += [g[1].numpy(), g[2].numpy()]
            for t, obs in per.items():
                obs = np.stack(obs)
                row = rows[epoch]
                assert row[f"cost/{t}/mean"].dtype == torch.float64
                np.testing.assert_allclose(row[f"cost/{t}/mean"].numpy(), obs.mean(0), rtol=1e-9, atol=1e-13)
                np.testing.assert_allclose(row[f"cost/{t}/var"].numpy(), obs.var(0), rtol=1e-9, atol=1e-15)
                assert (row[f"cost/{t}/count"].numpy() == len(obs)).all()


def test_thm1_cor12_and_thm2_hold_on_nasdiags_darts_cell_in_the_fast_engine():
    """At eps = 1e-12, Z-costs only: in every cell but the last Σ_e Σ_k Z C minus the skip term of the 2->3 edge is
    <∂L/∂out, out> (the intermediate edge's invariant ops pass nothing back onto node 2, Thm. 1) and that is 0 (Cor. 1.2);
    in the last cell before GAP and a bias-free linear it is L − H (Thm. 2), by the own closed form."""
    from nasdiag.supernet.engine import fast

    net, (x, y) = _net(layers=4, norm_eps=1e-12, classifier_bias=False), _batch()
    net.set_engine("fast")
    Zs = [torch.softmax(torch.randn(5, 8, dtype=DT, generator=torch.Generator().manual_seed(c)), -1).requires_grad_(True)
          for c in range(4)]
    assert fast.why_not_fast(net, x, Zs) is None
    logits = net(x, Zs)
    G = torch.autograd.grad(F.cross_entropy(logits, y), Zs)
    skip = PRIMS.index("skip_connect")
    p, z = logits.detach().softmax(-1), logits.detach()
    l_minus_h = ((p * z).sum(1) - z.gather(1, y[:, None])[:, 0]).mean()
    for c, (zc, g) in enumerate(zip(Zs, G)):
        out = (zc * g).sum() - zc[4, skip] * g[4, skip]
        scale = (zc * g).abs().sum()
        if c < 3:
            assert abs(out.item()) < 1e-9 * scale.item()
        else:
            assert abs(out.item() - l_minus_h.item()) < 1e-9 * scale.item()


def test_derive_genotype_with_ties_equals_a_transcription_of_darts_parse():
    """DARTS's ``genotype()._parse``: edges sorted (stably) by their strongest non-'none' weight, top 2; op = first
    strict maximum outside 'none'. Weights drawn from three values, so ties are everywhere."""
    from nasdiag.supernet import derive_genotype

    def parse(W, steps):
        gene, start, none = [], 0, PRIMS.index("none")
        for i in range(steps):
            Wc = W[start:start + i + 2]
            edges = sorted(range(i + 2), key=lambda x: -max(Wc[x][k] for k in range(len(Wc[x])) if k != none))[:2]
            for j in edges:
                k_best = None
                for k in range(len(Wc[j])):
                    if k != none and (k_best is None or Wc[j][k] > Wc[j][k_best]):
                        k_best = k
                gene.append((PRIMS[k_best], j))
            start += i + 2
        return gene

    rnd = random.Random(0)
    for _ in range(300):
        steps = rnd.choice([1, 2, 3, 4])
        E = sum(2 + s for s in range(steps))
        values = torch.tensor(rnd.sample([0.05, 0.1, 0.2, 0.3, 0.4], 3), dtype=rnd.choice([DT, torch.float32]))
        W = {t: values[torch.randint(0, 3, (E, 8), generator=torch.Generator().manual_seed(rnd.randrange(10**6)))]
             for t in ("normal", "reduce")}
        mult = min(steps, 2)
        g = derive_genotype(W, steps, mult, PRIMS)
        assert g.normal == parse(W["normal"].tolist(), steps)
        assert g.reduce == parse(W["reduce"].tolist(), steps)
        assert g.normal_concat == g.reduce_concat == list(range(2 + steps - mult, 2 + steps))
