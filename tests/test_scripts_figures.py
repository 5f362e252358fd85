"""The paper-figure scripts write records and redraw their figures from them (``--plot-only``), and what
they record shows what the papers state: XNAS §8.1-8.2 (late bloomers, initialization), wiring
supplement eq 16 (affine-free InstanceNorm nullifies every cost), Theorem 2 (C_Z = L − H), and the
DSNAS sampling protocol (one op per edge per observation)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from nasdiag.record import load

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "scripts"))


def pngs(folder):
    return sorted(p for p in os.listdir(folder) if p.endswith(".png"))


def test_xnas_toys(tmp_path):
    import xnas_toys

    xnas_toys.main(["--out", str(tmp_path)])
    record = load(tmp_path / "record.h5")

    def final(problem, opt):
        rows = record[f"valid/toy/{problem}/{opt}/p"]
        return record[f"toy/{problem}/{opt}/p"][rows][-1]

    # §8.2.2: from alpha = (0, 5) GD with softmax makes no progress, XNAS does (constant update terms)
    assert final("fig5", "gd")[0] < 0.01 < 0.4 < final("fig5", "xnas")[0]
    # §8.1: z is penalised for 30 steps, then rewarded; XNAS recovers it, GD's attenuated rewards do not
    assert final("fig3", "xnas")[2] > 0.99 > 0.8 > final("fig3", "gd")[2]
    # §8.2.3 (eq 52): GD's attenuation factor along the simplex is x (1 - x)
    x = record["toy/fig6/x"][record["valid/toy/fig6/x"]]
    np.testing.assert_allclose(record["toy/fig6/factor_simplex"][record["valid/toy/fig6/x"]], x * (1 - x), atol=1e-12)
    for p in tmp_path.glob("*.png"):
        p.unlink()
    xnas_toys.main(["--out", str(tmp_path), "--plot-only"])
    assert pngs(tmp_path) == ["fig3.png", "fig4.png", "fig5.png", "fig6.png", "fig7.png"]


@pytest.mark.slow
def test_wiring_variants_instance_norm_nullifies_costs(tmp_path):
    import wiring_variants

    wiring_variants.main(["--out", str(tmp_path), "--variants", "instance,batch", "--epochs", "1", "--C", "4",
                          "--observe-batches", "2"])
    means = {v: load(tmp_path / v / "record.h5")["cost/normal/mean"] for v in ("instance", "batch")}
    # eq 16: with affine-free InstanceNorm every cost mean is 0, before and after training (float32 rounding)
    assert np.nanmax(np.abs(means["instance"])) < 1e-5
    assert np.nanmax(np.abs(means["batch"])) > 1e-3  # BatchNorm does not nullify the input edges' costs
    assert pngs(tmp_path / "instance") == ["cost_normal_heatmap_final.png", "cost_normal_heatmap_init.png"]


@pytest.mark.slow
def test_wiring_output_cost_is_loss_minus_entropy(tmp_path):
    import wiring_output_cost

    wiring_output_cost.main(["--out", str(tmp_path), "--epochs", "1", "--C", "4"])
    record = load(tmp_path / "record.h5")
    rows = record["valid/scalars/cz_train"]
    assert rows.sum() == 2  # before training and after the epoch
    for split in ("train", "search"):
        # Theorem 2, per sample: the probe's output-edge cost equals L - H computed from the logits
        assert np.max(record[f"scalars/thm2_max_abs_error_{split}"][rows]) < 1e-5
        np.testing.assert_allclose(record[f"scalars/cz_{split}"][rows],
                                   record[f"scalars/loss_{split}"][rows] - record[f"scalars/entropy_{split}"][rows], atol=1e-5)
        # negatively related to accuracy: lower for the correctly classified samples
        assert np.all(record[f"scalars/cz_{split}_correct"][rows] < record[f"scalars/cz_{split}_wrong"][rows])
    os.remove(tmp_path / "fig14_16.png")
    wiring_output_cost.main(["--out", str(tmp_path), "--plot-only"])
    assert pngs(tmp_path) == ["fig11_12_13.png", "fig14_16.png"]


@pytest.mark.slow
def test_wiring_cost_heatmaps_dsnas_protocol(tmp_path):
    import wiring_cost_heatmaps

    wiring_cost_heatmaps.main(["--out", str(tmp_path), "--configs", "minimal1", "--epochs", "1", "--C", "4",
                               "--observe-batches", "3"])
    record = load(tmp_path / "minimal1" / "record.h5")
    rows = np.flatnonzero(record["valid/cost/normal/count"])
    counts = record["cost/normal/count"][rows]
    config = json.loads(str(record["meta/config"]))
    assert config["protocol"] == "dsnas" and counts.shape[1:] == (5, 8)
    # one sampled op per edge and observation: 3 batches before training, one epoch of steps after
    assert (counts[0].sum(1) == 3).all()
    assert (counts[1].sum(1) == record["step"][rows[1]]).all()
    os.remove(tmp_path / "minimal1" / "cost_normal_heatmap_init.png")
    wiring_cost_heatmaps.main(["--out", str(tmp_path), "--configs", "minimal1", "--plot-only"])
    assert pngs(tmp_path / "minimal1") == ["cost_normal_heatmap_final.png", "cost_normal_heatmap_init.png"]


PAPER_SCRIPTS = ["asmnas_stability", "bayes_compression", "curvature_accuracy", "make_readme_figures", "sparsenas_digits",
                 "wiring_cost_heatmaps", "wiring_evolution", "wiring_output_cost", "wiring_variants", "xnas_statistical",
                 "xnas_toys"]


@pytest.mark.parametrize("name", PAPER_SCRIPTS)
def test_script_with_an_output_folder_it_cannot_create_says_so_in_one_line(name, tmp_path, capsys):
    import importlib

    from nasdiag.errors import run_script

    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    before = sorted(p.name for p in tmp_path.iterdir())
    code = run_script(name, importlib.import_module(name).main, ["--out", str(blocker / "figs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"{name}: error: ") and "a_file" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == before and blocker.read_text() == "not a folder"


def test_run_script_maps_user_errors_and_keeps_bugs_loud(capsys):
    from nasdiag.errors import NasdiagError, run_script

    def raises(exc):
        def main(argv):
            raise exc
        return main

    assert run_script("s", lambda argv: None) == 0
    assert run_script("s", lambda argv: 3) == 3
    assert run_script("s", raises(NasdiagError("bad value\n  use another"))) == 2
    assert capsys.readouterr().err == "s: error: bad value use another\n"
    assert run_script("s", raises(KeyboardInterrupt())) == 130
    with pytest.raises(ZeroDivisionError):
        run_script("s", raises(ZeroDivisionError()))
