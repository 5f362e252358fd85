"""Round-21 audit of the NaN/inf path end to end: a NaN (or inf) is recorded and flagged, never hidden.

Defect found: the probe flagged only NaN costs. An inf cost (∂L/∂Z past the range of its dtype, with a finite loss)
was returned by ``costs()`` with no warning, and ``statistics()`` then held a mean of inf and a variance of NaN without
its 'hold NaN' warning; both warnings now cover ±inf
(``test_an_inf_cost_of_a_finite_loss_is_flagged_by_the_probe_as_a_nan_one``).

Defect found: every accuracy of the search (``scalars/train_acc``, ``val_acc``, ``search_val_acc``, each method's
``accuracy`` and both ``evaluate``) took ``argmax`` of the logits, which picks the first NaN as the largest: a diverged
network whose logits are all NaN read as the batch's share of class 0 (0.08-0.12 on digits, recorded beside NaN
losses, a flat plausible accuracy curve). A sample whose logits hold a NaN has no prediction: the accuracy is NaN; a
−inf logit (a masked class) still predicts as before
(``test_the_accuracy_of_nan_logits_is_nan_not_the_share_of_class_0``).

Defect found: every curvature route (``diag_hessian``, ``arch_diag_hessian`` exact, the spectrum: all through
``scalar_loss``) added ``0·‖y − y.detach()‖²`` to the loss to carry a NaN loss into the curvature; at a −inf output
entry (a masked class, cross-entropy finite) that is 0·(inf − inf)² = NaN, so the loss value and, through a −inf
classifier bias, the curvature of the layers before it came out NaN (12 + 4 of the 16 first-layer entries of a small
MLP; 24 of 40 mixing weights of a one-cell supernet, and the torch.func route refused itself as a 'wrong
forward-mode rule'), flagged non-finite where the loss is finite; ±inf output entries take no part now
(``test_a_masked_class_with_a_minus_inf_logit_keeps_a_finite_curvature_equal_to_autograds``).

Defect found: ASM-NAS's selection counted each sample's argmax of its attention a, so an edge whose a is NaN (a
diverged attention module) was recorded as a unanimous selection of op 0 (``attention/normal/count`` [719, 0, ...]
on digits), its selection frequency 1 and the genotype figure's eligible op; a NaN row selects nothing, and an edge
with no counted sample has NaN frequencies (the genotype refuses them as diverged)
(``test_an_asmnas_edge_of_nan_attention_is_no_selection_of_op_0``).

Checked by hand and right (scratch scripts, float64 unless said):

* an inf pixel (not NaN) in the search-train or search-val batch of every built-in method: the single-level methods
  and XNAS, darts2, SparseNAS, ProxylessNAS stop with one SearchError line whose row carries the NaN loss and
  ``scalars/nonfinite_loss`` = 1; first-order DARTS records its NaN rows and stops at the epoch end, as documented;
* a NaN in α only (weights finite): DARTS records NaN α, probabilities and losses; darts2, SparseNAS, SNAS, XNAS
  (NaN ln v), BayesNAS stop at their NaN loss; DSNAS and ProxylessNAS refuse the NaN α before sampling, in one line;
* a NaN in one BatchNorm's running_var, eval mode, under the probe: the logits, loss, costs and curvature NaN, the
  cost warning given (``evaluate`` uses batch statistics and never reads running_var);
* autocast on the CPU: bfloat16 keeps a 1e6-scaled input finite; float16 overflows to a NaN loss, costs NaN and
  warned, the statistics' warning given;
* −inf logits (a masked class): the cross-entropy, accuracy, ``loss_minus_entropy`` (0·log 0 = 0) and, after the fix
  above, the ggn/ggn_mc/hutchinson/diag/approx/exact curvature are finite (exact = autograd's reverse-over-reverse);
* XNAS's Forecaster given +inf (and −inf) rewards: the forecaster of an alive expert with an inf reward sits the round
  out when skipped (regret and weights unchanged, no bound violation counted), and without ``skip`` it is one
  RegretError, nothing changed;
* a diverged first-order DARTS record through ``nasdiag plot`` (its line counts the NaNs of the drawn families per
  path) and ``nasdiag report`` (the NaN/inf counts of the rows it shows, each accuracy 'NaN (step 2; never finite)').

Left alone: the cost and curvature of a ``none`` op stay the structural 0 in a NaN step (round 19's call); the probe
names the edges, not the samples, of a NaN per-sample cost row (the row itself is returned NaN); ``probe.hessian()``
returns NaN curvature without a warning of its own (the block's cost warning has said it).

Defect found: ``probe.hessian()`` after a block whose default cross-entropy was NaN (a NaN pixel) refused with 'they
are inferred only when the block's loss is the default mean or summed cross-entropy', naming another loss as the
reason; it says the block's ∂L/∂(model output) holds NaN/inf (``test_probe_hessian_of_a_nan_loss_block_names_the_nan``).
"""

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import nasdiag


# -- the probe's flags of an inf cost -------------------------------------------------------------------------------
class _Scale(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c

    def forward(self, x):
        return x * self.c


class _Mixed(nn.Module):
    """A DARTS-convention mixed op (``_ops``, forward ``(x, weights)``) of two candidates."""

    def __init__(self, scales):
        super().__init__()
        self._ops = nn.ModuleList([_Scale(c) for c in scales])

    def forward(self, x, w):
        return sum(wk * op(x) for wk, op in zip(w, self._ops))


class _OneEdge(nn.Module):
    def __init__(self, scales, z):
        super().__init__()
        self.m = _Mixed(scales)
        self.z = nn.Parameter(torch.tensor(z))

    def forward(self, x):
        return self.m(x, self.z)


def test_an_inf_cost_of_a_finite_loss_is_flagged_by_the_probe_as_a_nan_one():
    """L = Σ g·(z0·1e30·x + z1·x) with g = 1e10, x = 1 (3 samples, 4 features), float32: by hand C_0 = ∂L/∂z0 =
    Σ g·1e30·x = 1.2e41, past float32's 3.4e38, so inf, while L = 1.2e11 (z0 = 1e-30) is finite. The probe returned
    that inf with no warning and its statistics a mean of inf and a variance of NaN (inf − inf), again without a
    warning (both flags looked at NaN only)."""
    net = _OneEdge((1e30, 1.0), [1e-30, 1.0])
    x = torch.ones(3, 4)
    probe = nasdiag.attach(net, {"e": net.m})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.record():
            loss = (net(x) * 1e10).sum()
            loss.backward()
        assert math.isfinite(float(loss.detach()))
        cost = probe.costs()["e"]
        stats = probe.statistics()
    assert cost[0] == math.inf and cost[1] == pytest.approx(1.2e11, rel=1e-6)  # recorded as it is
    assert np.isposinf(stats["cost/edges/mean"][0, 0]) and np.isnan(stats["cost/edges/var"][0, 0])
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("NaN cost at edge(s) 'e'" in m for m in said), said
    assert any("cost statistics of 'edges' hold NaN" in m for m in said), said


def test_a_finite_cost_gives_no_nonfinite_warning():
    """The control of the test above: the same edge with a cost inside float32's range warns of nothing."""
    net = _OneEdge((1e3, 1.0), [1e-3, 1.0])
    probe = nasdiag.attach(net, {"e": net.m})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with probe.record():
            (net(torch.ones(3, 4)) * 1e10).sum().backward()
        assert torch.isfinite(probe.costs()["e"]).all()
        probe.statistics()


# -- accuracies of NaN logits ----------------------------------------------------------------------------------------
def _own_accuracy(logits, targets):
    """Own reference: the fraction of samples whose target logit exceeds every other logit; None (no accuracy) where a
    sample's logits hold a NaN."""
    rows = logits.tolist()
    if any(math.isnan(v) for row in rows for v in row):
        return None
    hits = [all(row[t] > v for k, v in enumerate(row) if k != t) for row, t in zip(rows, targets.tolist())]
    return sum(hits) / len(hits)


def test_the_accuracy_of_nan_logits_is_nan_not_the_share_of_class_0():
    """torch.argmax takes a NaN for the largest value, so logits of a diverged network (all NaN) 'predicted' class 0
    and the accuracy was the share of class 0 among the targets (here 2 of 4); one NaN logit in one sample made that
    sample predict its class. Both are NaN; −inf logits (masked classes, loss finite) predict as they should."""
    from nasdiag.search import Schedule, get_method
    from nasdiag.search.base import accuracy
    from nasdiag.supernet import Network

    targets = torch.tensor([0, 0, 1, 2])
    nan = torch.full((4, 3), math.nan, dtype=torch.float64)
    assert _own_accuracy(nan, targets) is None and torch.isnan(accuracy(nan, targets))
    one = torch.tensor([[0.0, 1, 2], [5, 1, 2], [0, math.nan, 2], [0, 1, 3]], dtype=torch.float64)
    assert _own_accuracy(one, targets) is None and torch.isnan(accuracy(one, targets))
    masked = torch.tensor([[0.0, -math.inf, -math.inf], [5, 1, -math.inf], [-math.inf, 1, 2], [0, -math.inf, 3]],
                          dtype=torch.float64)
    assert math.isfinite(float(torch.nn.functional.cross_entropy(masked, targets)))
    assert float(accuracy(masked, targets)) == _own_accuracy(masked, targets) == 0.75

    for method in ("darts", "asmnas"):  # SearchMethod.evaluate and ASM-NAS's own selection pass
        torch.manual_seed(0)
        net = Network(4, 3, 3, steps=2, multiplier=2, in_channels=1).double()
        cls = get_method(method)
        m = cls(net, cls.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=1, batch_size=4))
        x = torch.randn(4, 1, 8, 8, dtype=torch.float64)
        with torch.no_grad():
            net.classifier.weight.fill_(math.nan)  # a diverged classifier: every logit NaN
        evaluation = m.evaluate([(x, targets)])
        assert math.isnan(evaluation["loss"]) and math.isnan(evaluation["acc"]), (method, evaluation)


# -- a masked class (−inf logit) in the curvature routes --------------------------------------------------------------
def _autograd_diagonal(f, point):
    """Own reference: the diagonal of torch.autograd.functional.hessian of ``f`` at ``point`` (float64)."""
    n = point.numel()
    return torch.autograd.functional.hessian(f, point).reshape(n, n).diagonal().reshape(point.shape)


def test_a_masked_class_with_a_minus_inf_logit_keeps_a_finite_curvature_equal_to_autograds():
    """A classifier whose bias of class 3 is −inf (a masked class): p_3 = 0 and the cross-entropy of the other labels
    is finite, and so is its Hessian (autograd's reverse-over-reverse gives it). The routes gave NaN for the parameters
    before that bias (weights) and for the mixing weights of a supernet (exact), through 0·(inf − inf)²."""
    from torch.func import functional_call

    from nasdiag.hessian import arch_diag_hessian, diag_hessian
    from nasdiag.supernet import Network

    torch.manual_seed(0)
    ce = nn.functional.cross_entropy
    y = torch.tensor([0, 1, 2, 0, 1])
    mlp = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    with torch.no_grad():
        mlp[2].bias[3] = -math.inf
    x = torch.randn(5, 3, dtype=torch.float64)
    assert math.isfinite(float(ce(mlp(x), y).detach()))
    params = dict(mlp.named_parameters())
    for mode in ("exact", "diag"):
        got = diag_hessian(mlp, ce, x, y, mode=mode)
        for name in ("0.weight", "0.bias"):  # the layer before the -inf bias (diag: an approximation, finite)
            def f(p, name=name):
                return ce(functional_call(mlp, {**params, name: p}, (x,)), y)
            want = _autograd_diagonal(f, params[name].detach())
            assert torch.isfinite(want).all()
            if mode == "exact":
                torch.testing.assert_close(got[name], want, rtol=1e-10, atol=1e-14)
            else:
                assert torch.isfinite(got[name]).all(), (mode, name)

    net = Network(4, 4, 1, steps=2, multiplier=2, in_channels=1, reductions=()).double().eval()
    with torch.no_grad():
        net.classifier.bias[3] = -math.inf
    x = torch.randn(5, 1, 6, 6, dtype=torch.float64)
    z = torch.softmax(net.alphas()["normal"].detach(), -1)
    want = _autograd_diagonal(lambda w: ce(net(x, {"normal": w}), y), z)
    assert torch.isfinite(want).all()
    edges = {s.name: s for s in net.edge_specs()}
    got = arch_diag_hessian(net, ce, x, y, edges, mode="exact")
    torch.testing.assert_close(torch.stack([got[s.name] for s in net.edge_specs()]), want, rtol=1e-10, atol=1e-14)


# -- ASM-NAS's selection of a NaN attention ---------------------------------------------------------------------------
def test_an_asmnas_edge_of_nan_attention_is_no_selection_of_op_0():
    """The first attention module's parameters NaN: its a is NaN for every sample (own check through the collector),
    so no sample selects an op there; argmax counted every sample for op 0."""
    from nasdiag.search import Schedule, SearchError, get_method
    from nasdiag.supernet import Network
    from nasdiag.supernet.attention import AttentionMixedOp, attention_weights, collect_attention

    torch.manual_seed(0)
    net = Network(4, 3, 3, steps=2, multiplier=2, in_channels=1).double()
    cls = get_method("asmnas")
    m = cls(net, cls.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=1, batch_size=4))
    first = next(mod for mod in net.modules() if isinstance(mod, AttentionMixedOp))
    with torch.no_grad():
        for p in first.parameters():
            p.fill_(math.nan)
    x, y = torch.randn(4, 1, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    with torch.no_grad(), collect_attention(net) as store:
        net(x, attention_weights(net))
    a = {(k, e): t for k, row in enumerate(store) for e, t in enumerate(row)}  # (B, K) per (cell, edge)
    nan_everywhere = {key for key, t in a.items() if torch.isnan(t).any(-1).all()}
    assert (0, 0) in nan_everywhere  # the module made NaN, and what it feeds
    evaluation = m.evaluate([(x, y)])
    assert math.isnan(evaluation["loss"]) and math.isnan(evaluation["acc"])
    counts = m.selection_counts
    for (k, e), t in a.items():
        cell_type = net.cells[k].cell_type
        # own count of the NaN-free samples of this cell's edge, summed over the cells of its type
        counted = sum(int((~torch.isnan(a[(j, e)]).any(-1)).sum()) for j, c in enumerate(net.cells) if c.cell_type == cell_type)
        assert int(counts[cell_type][e].sum()) == counted, (k, e)
    t0 = net.cells[0].cell_type
    assert [c.cell_type for c in net.cells].count(t0) == 1  # edge 0 of that type: NaN in every sample of every cell
    assert int(counts[t0][0].sum()) == 0 and torch.isnan(m.probabilities()[t0][0]).all()
    with pytest.raises(SearchError, match="NaN"):
        m.genotype()


# -- probe.hessian() after a NaN loss -------------------------------------------------------------------------------
def test_probe_hessian_of_a_nan_loss_block_names_the_nan():
    """The default mean cross-entropy of a batch with a NaN pixel: its labels cannot be read from a NaN ∂L/∂logits.
    The refusal blamed the loss ('inferred only when the block's loss is the default ... cross-entropy'), which it was;
    given the targets, the curvature is NaN (recorded, as the costs)."""
    from nasdiag.probe.discovery import ProbeError
    from nasdiag.supernet import Network

    torch.manual_seed(0)
    net = Network(4, 3, 1, steps=2, multiplier=2, in_channels=1, reductions=()).double()
    probe = nasdiag.attach(net, hessian="diag")
    x, y = torch.randn(4, 1, 6, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    x[1, 0, 2, 2] = math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the NaN cost warning, tested above
        with probe.record():
            nn.functional.cross_entropy(net(x), y).backward()
        with pytest.raises(ProbeError) as err:
            probe.hessian()
        text = str(err.value)
        assert len(text.splitlines()) == 1 and "NaN" in text and "targets=y" in text
        assert "inferred only when" not in text
        h = probe.hessian(targets=y)
    assert all(torch.isnan(v).any() for v in h.values())
