"""Audit (round 23, tidy23): small contract gaps left from round 22.

Found and fixed:

* XNAS ``scalars/reward_clip_fraction`` is documented (docs/xnas.md, the vocabulary) as clipped / finite rewards of
  alive experts. In a step where no alive expert's reward was finite that is 0/0, and it was recorded as 0 (the
  denominator was ``max(counted, 1)``): a step that clipped nothing, where in truth no reward was seen at all. It is
  NaN now (counted by the record's ``nonfinite_counts``, with every edge flagged in ``regret/<cell>/nonfinite``).
* ``nasdiag.plot.registry``: every figure written listed the whole figure folder again for the temporaries of killed
  writers; a drawing pass (``draw_record``, ``write_comparison``) lists each folder it wrote into once, at its end.
* ``probe.hessian()`` outside autocast after a bf16 autocast step whose forward made its mixing weights in bfloat16
  said "α changed since the block (an optimizer step ...)"; it now names both dtypes and autocast.

Checked and documented (docs/probe.md): the re-run takes the autocast state of the hessian() call (outside: the
float32 model's curvature; inside: the autocast forward's); a forward the block never backwards adds no per-sample rows.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from nasdiag.search import Schedule, get_method
from nasdiag.supernet import Network


# --- XNAS: the clip fraction of a step without a finite reward is 0/0 -------------------------------------------

def _xnas(cls, **hp):
    torch.manual_seed(0)
    net = Network(4, 5, 3, steps=2, multiplier=2, in_channels=1).double()
    return cls(net, cls.Hyperparameters(**hp), schedule=Schedule(epochs=1, steps_per_epoch=3, batch_size=6))


def _data(n):
    g = torch.Generator().manual_seed(1)
    b = lambda: (torch.randn(6, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (6,), generator=g))  # noqa: E731
    return [(b(), b()) for _ in range(n)]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_xnas_clip_fraction_of_a_step_without_a_finite_reward_is_nan_and_flagged(tmp_path, bad):
    """Step 2 gets a non-finite reward for every op of every edge (val loss finite). The documented fraction is
    (clipped finite rewards of alive experts) / (finite rewards of alive experts) = 0/0: NaN, not the 0 of a step
    that clipped nothing; every edge is flagged and the record counts the NaN. Steps 1 and 3 (finite rewards,
    L small so that some are clipped) keep the fraction of the definition, counted here from their rewards."""
    from nasdiag.record import RecordWarning, Recorder, load, load_meta

    L = 2e-3

    class NoFiniteRewardAtStep2(get_method("xnas")):
        seen = []

        def rewards(self, per_cell):
            out = super().rewards(per_cell)
            if self.rounds_played == 1:
                for r in out.values():
                    r.fill_(bad)
            type(self).seen.append({t: (r.clone(), self.forecasters[t].alive.clone()) for t, r in out.items()})
            return out

    method = _xnas(NoFiniteRewardAtStep2, reward_bound=L)
    path = tmp_path / "x.h5"
    with pytest.warns(RecordWarning):
        with Recorder(str(path), meta={"method": "xnas", "op_names": method.network.primitives}) as rec:
            rows = []
            for step, b in enumerate(_data(3), start=1):
                rows.append(method.step(*b))
                rec.log(step, {k: v.cpu().numpy() for k, v in rows[-1].items()})
    for i in (0, 2):  # the definition, from the rewards the method computed
        clipped = sum(int(((r.abs() > L) & torch.isfinite(r))[:, a].sum()) for r, a in NoFiniteRewardAtStep2.seen[i].values())
        counted = sum(int(torch.isfinite(r)[:, a].sum()) for r, a in NoFiniteRewardAtStep2.seen[i].values())
        assert counted > 0 and clipped > 0
        assert float(rows[i]["scalars/reward_clip_fraction"]) == clipped / counted
    assert math.isnan(float(rows[1]["scalars/reward_clip_fraction"]))
    assert rows[1]["regret/normal/nonfinite"].all() and rows[1]["regret/reduce/nonfinite"].all()
    record = load(str(path))
    assert np.isnan(record["scalars/reward_clip_fraction"][1]) and np.isfinite(record["scalars/reward_clip_fraction"][[0, 2]]).all()
    assert load_meta(str(path))["nonfinite_counts"]["scalars/reward_clip_fraction"] == 1


# --- plot: the killed writers' temporaries are looked for once per drawing pass --------------------------------

def _dead_pid():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("how", ["draw_record", "write_comparison"])
def test_stale_figure_temporaries_are_looked_for_once_per_drawing_pass(tmp_path, monkeypatch, how):
    """Every figure written listed the whole figure folder again to find the temporaries of killed writers (15 listings
    for a search's figures). One drawing pass of two figures now lists it once, and removes just what it removed before:
    the temporaries of the drawn figures whose process is gone, not one of a live process, not one of a figure the pass
    did not draw, not a link named as one."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from plot_records import write_record

    from nasdiag.plot.registry import draw_record, write_comparison
    from nasdiag.record import load

    record = load(write_record(tmp_path / "run.h5", epochs=1, steps_per_epoch=4, cells=("normal",)))
    out = tmp_path / "figs"
    out.mkdir()
    dead, live = _dead_pid(), os.getppid()
    stale = [f".{dead}.0123abcd.arch_normal_heatmap_init.png.tmp", f".{dead}.89abcdef.arch_normal_heatmap_final.png.tmp"]
    kept = [f".{live}.0123abcd.arch_normal_heatmap_init.png.tmp", f".{dead}.0123abcd.scalars.png.tmp"]
    for name in stale + kept:
        (out / name).write_bytes(b"half a figure")
    (tmp_path / "notes.txt").write_text("mine")
    (out / f".{dead}.feedbeef.arch_normal_heatmap_final.png.tmp").symlink_to(tmp_path / "notes.txt")
    kept.append(f".{dead}.feedbeef.arch_normal_heatmap_final.png.tmp")
    listed = []
    real = os.listdir

    def listdir(path="."):
        if os.path.realpath(path) == os.path.realpath(out):
            listed.append(path)
        return real(path)

    monkeypatch.setattr(os, "listdir", listdir)
    if how == "draw_record":
        files = draw_record(record, out, "png", "arch", "init,final", 30).files
    else:
        files = write_comparison({"a": record, "b": record}, out, "png", "arch", "init,final", 30).files
    monkeypatch.undo()
    assert sorted(f.name for f in files) == ["arch_normal_heatmap_final.png", "arch_normal_heatmap_init.png"]
    assert len(listed) == 1, listed
    assert sorted(real(out)) == sorted(kept + [f.name for f in files])
    assert (tmp_path / "notes.txt").read_text() == "mine"


# --- probe.hessian() after a step under bf16 CPU autocast -----------------------------------------------------

class _Mix(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self._ops = torch.nn.ModuleList([torch.nn.Linear(w, w), torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(w, w, bias=False)),
                                         torch.nn.Identity()])

    def forward(self, x, weights):
        return sum(wk * op(x) for wk, op in zip(weights, self._ops))


class _Net(torch.nn.Module):
    """n1 = e0(n0); n2 = e1(n0) + e2(n1); ``matmul_z``: Z = softmax(α·I), which autocast computes in bfloat16."""

    def __init__(self, matmul_z=False, w=5):
        super().__init__()
        self.stem, self.head = torch.nn.Linear(4, w), torch.nn.Linear(w, 3)
        self.e = torch.nn.ModuleList([_Mix(w) for _ in range(3)])
        self.alpha = torch.nn.Parameter(torch.randn(3, 3) * 0.5)
        self.matmul_z = matmul_z

    def forward(self, x, Z=None):
        if Z is None:
            Z = torch.softmax(self.alpha @ torch.eye(3) if self.matmul_z else self.alpha, -1)
        n0 = torch.tanh(self.stem(x))
        n1 = self.e[0](n0, Z[0])
        return self.head(self.e[1](n0, Z[1]) + self.e[2](n1, Z[2]))


def _autograd_diag(net, x, y, Z, autocast):
    """diag ∂²L/∂Z² per edge (E, K) by torch.autograd.functional.hessian, Z a leaf, under bf16 autocast or not."""
    import torch.nn.functional as F

    def loss(z):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return F.cross_entropy(net(x, z), y)

    H = torch.autograd.functional.hessian(loss, Z)
    return torch.stack([H[e, :, e, :].diagonal() for e in range(3)]).float()


def _bf16_step(net):
    import torch.nn.functional as F

    import nasdiag

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, 4, generator=g) * 3, torch.randint(0, 3, (64,), generator=g)
    probe = nasdiag.attach(net, hessian="exact")
    with probe.record(targets=y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(net(x), y)
        loss.backward()
    return probe, x, y


def _stacked(h):
    return torch.stack([h[f"e.{e}"] for e in range(3)]).float()


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_hessian_after_a_bf16_autocast_step_is_the_float32_models_outside_autocast_and_the_autocast_forwards_inside():
    """docs/probe.md: the re-run takes the autocast state of the hessian() call. Z = softmax(α) in float32 (autocast
    keeps softmax in float32): outside autocast the float32 model's curvature (float32 autograd), inside it the autocast
    forward's (autograd under the same autocast); the two differ by bf16's rounding of the forward."""
    torch.manual_seed(0)
    net = _Net()
    probe, x, y = _bf16_step(net)
    Z = torch.softmax(net.alpha, -1).detach().clone()
    f32, bf16 = _autograd_diag(net, x, y, Z, False), _autograd_diag(net, x, y, Z, True)
    outside = _stacked(probe.hessian())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = _stacked(probe.hessian())
    assert _rel(outside, f32) < 1e-6 and _rel(inside, bf16) < 1e-6
    assert _rel(outside, bf16) > 1e-4  # the two references are told apart


def test_hessian_outside_autocast_of_a_step_whose_forward_made_bf16_mixing_weights_says_autocast_not_alpha_changed():
    """Z = softmax(α·I): under autocast the matmul, hence Z, is bfloat16. hessian() outside autocast re-runs in float32,
    so the recorded-weights check saw other weights and said "α changed since the block (an optimizer step ...)", which
    it had not. Now the line names both dtypes and autocast; inside the step's autocast it is the autocast forward's
    curvature, and hessian(inputs=, targets=) the float32 model's (autograd references)."""
    from nasdiag.probe import ProbeError

    torch.manual_seed(0)
    net = _Net(matmul_z=True)
    probe, x, y = _bf16_step(net)
    with pytest.raises(ProbeError) as info:
        probe.hessian()
    line = str(info.value)
    assert "\n" not in line and "float32" in line and "bfloat16" in line and "torch.autocast" in line, line
    assert "optimizer" not in line, line
    with torch.autocast("cpu", dtype=torch.bfloat16):
        Zb = torch.softmax(net.alpha @ torch.eye(3), -1).detach().clone()
        inside = _stacked(probe.hessian())
    assert _rel(inside, _autograd_diag(net, x, y, Zb, True)) < 2e-2  # bf16 results
    f32 = _autograd_diag(net, x, y, torch.softmax(net.alpha, -1).detach().clone(), False)
    assert _rel(_stacked(probe.hessian(inputs=x, targets=y)), f32) < 1e-6


def test_forwards_a_block_never_backwards_add_no_per_sample_rows():
    """docs/probe.md (costs(per_sample=True)): a forward with grad mode on that the block never backwards (a validation
    pass without no_grad) between two backwarded micro-batches, and one under no_grad, add no rows: the 6 + 3 rows are
    the backwarded samples' ∂ℓ_b/∂Z in call order (autograd per sample, float64), with no warning."""
    import warnings

    import torch.nn.functional as F

    import nasdiag

    torch.manual_seed(0)
    net = _Net().double()
    g = torch.Generator().manual_seed(1)
    batch = lambda b: (torch.randn(b, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (b,), generator=g))  # noqa: E731
    (x1, y1), (xv, yv), (x2, y2) = batch(6), batch(4), batch(3)
    probe = nasdiag.attach(net)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with probe.record():
            first = F.cross_entropy(net(x1), y1, reduction="sum")
            F.cross_entropy(net(xv), yv)  # grad mode on, never backwarded
            with torch.no_grad():
                net(xv)
            (first + F.cross_entropy(net(x2), y2, reduction="sum")).backward()
    rows = probe.costs(per_sample=True)
    Z = torch.softmax(net.alpha, -1).detach()
    want = []
    for x, y in ((x1, y1), (x2, y2)):
        for b in range(len(y)):
            z = Z.clone().requires_grad_()
            F.cross_entropy(net(x[b:b + 1], z), y[b:b + 1], reduction="sum").backward()
            want.append(z.grad)
    want = torch.stack(want)  # (9, E, K)
    for e in range(3):
        assert rows[f"e.{e}"].shape == (9, 3)
        torch.testing.assert_close(rows[f"e.{e}"], want[:, e], rtol=0, atol=1e-14)
