"""Audit (round 23, tidy23): small contract gaps left from round 22.

Found and fixed:

* XNAS ``scalars/reward_clip_fraction`` is documented (docs/xnas.md, the vocabulary) as clipped / finite rewards of
  alive experts. In a step where no alive expert's reward was finite that is 0/0, and it was recorded as 0 (the
  denominator was ``max(counted, 1)``): a step that clipped nothing, where in truth no reward was seen at all. It is
  NaN now (counted by the record's ``nonfinite_counts``, with every edge flagged in ``regret/<cell>/nonfinite``).
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
