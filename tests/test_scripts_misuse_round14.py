"""Round 14: a user turning records into heatmaps with the batch scripts (scripts/wiring_*.py, xnas_*.py) and the
figure registry: misuse of a script is one line on stderr, exit code 2, nothing left behind; the heatmaps drawn from a
record whose values this file plants itself (plain `nasdiag.record.Recorder` rows, docs/schema.md) show those values
in the labelled rows and columns, on the stated colour scale, with the stated step span.

Checked and found right (not repeated as tests; references built here, not with nasdiag): the cost, cost_std and
hessian heatmaps of a planted record (Recorder rows of known (E, K) values with NaN, +inf, -inf and negatives) read
back from the drawn image (AxesImage array, tick labels, annotation texts, title): rows and columns in meta's order,
every value in its cell, NaN/±inf hatched and counted in the title and kept out of the colour limits, a signed map
symmetric about 0 (±max |finite|), a non-negative Hessian sequential from min to max, integers annotated as such; the
title's step span ("step 0 (before training)", "steps 1-5 (epoch 0)") on one segment and on a resumed record of two
segments whose killed epoch row was replaced (the replayed row drawn, "steps 5-8 (epoch 1)", --at 7 drawing step 4);
the comparison of two runs whose ops and edges differ in order and number (columns and rows aligned by name, a dash
for the missing op, one colour scale); wiring_cost_heatmaps' per-op counts (one sampled op per edge and observation);
xnas_toys' fig4 trajectories against my own EG and softmax-GD recursion (GD exact; XNAS equal until the wipeout of y
at t = 34, where log v_x - log v_y = 3.4 first exceeds 2 eta L (T - t) = 3.2); make_readme_figures and
wiring_evolution --plot-only on a resumed nasdiag search record of three segments; every option of every script
reaching the run (a value past the split's batches was not: fixed).
"""

from __future__ import annotations

import numpy as np
import pytest

from test_cli_misuse_round13 import _script  # runs a script in-process, the folder checked unchanged


@pytest.mark.parametrize("script,extra", [("wiring_cost_heatmaps", ["--configs", "minimal1"]),
                                          ("wiring_variants", ["--variants", "batch"]),
                                          ("wiring_output_cost", [])])
def test_a_wiring_batch_larger_than_the_training_split_is_one_line_before_any_folder(script, extra, tmp_path, capsys):
    """``--batch-size 5000`` on digits (719 training images): no step in an epoch. It was the Schedule's 'steps_per_epoch
    must be an integer >= 1, got 0', naming no option, after the output folder was made (left behind, empty)."""
    out = tmp_path / "out"
    code, err = _script(script, ["--out", str(out), "--batch-size", "5000", "--epochs", "1", *extra], tmp_path, capsys)
    assert code == 2 and len(err) == 1, err
    assert "--batch-size 5000" in err[0] and "719" in err[0], err
    assert not out.exists()


def test_xnas_statistical_fits_no_line_through_one_number_of_experts_given_twice(tmp_path, capsys):
    """``--n-grid 2,2``: the regret-vs-N fits ran on one N twice; a log-log slope through two points at one x is no slope
    (numpy's polyfit warns the fit is poorly conditioned and returns a number anyway, printed and written to fits.json
    as 'log-log slope 0.924'). As for one N (round 13): the points are drawn, no fit."""
    import importlib
    import json

    from nasdiag.errors import run_script

    out = tmp_path / "out"
    argv = ["--out", str(out), "--runs", "2", "--steps", "2", "--n-grid", "2,2", "--sigma-grid", "1", "--lr-multipliers", ""]
    assert run_script("xnas_statistical", importlib.import_module("xnas_statistical").main, argv) == 0, capsys.readouterr()
    assert "log-log slope" not in capsys.readouterr().out
    summary = json.loads((out / "fits.json").read_text())
    assert [row["n_experts"] for row in summary["vs_n"]["rows"]] == [2.0, 2.0] and "fits" not in summary["vs_n"], summary


@pytest.mark.parametrize("script,extra", [("wiring_cost_heatmaps", ["--configs", "minimal1"]),
                                          ("wiring_variants", ["--variants", "batch"])])
def test_observing_more_batches_than_the_split_holds_is_one_line_not_a_silent_cap(script, extra, tmp_path, capsys):
    """``--observe-batches`` past the training split's batches (719 digits images: 11 batches of 64) observed the 11
    there are: --observe-batches 12 or 1000 gave the same record as 11, without a word. One line, before any folder."""
    out = tmp_path / "out"
    code, err = _script(script, ["--out", str(out), "--observe-batches", "12", "--epochs", "1", *extra], tmp_path, capsys)
    assert code == 2 and len(err) == 1, err
    assert "--observe-batches 12" in err[0] and "11 batches of 64" in err[0], err
    assert not out.exists()


def _record_of(path, method):
    from nasdiag.record import Recorder

    path.parent.mkdir(parents=True, exist_ok=True)
    with Recorder(str(path), meta={"method": method}) as rec:
        rec.log(0, {"scalars/loss": np.float32(1.0)})


@pytest.mark.parametrize("script,argv,where,own", [
    ("xnas_toys", [], "record.h5", "xnas_toys"),
    ("xnas_statistical", ["--runs", "2", "--steps", "2", "--n-grid", "2,4", "--sigma-grid", "1", "--lr-multipliers", ""],
     "record.h5", "xnas_statistical"),
    ("wiring_output_cost", ["--epochs", "1"], "record.h5", "fixed_architecture"),
    ("wiring_cost_heatmaps", ["--configs", "minimal1,minimal8", "--epochs", "1"], "minimal8/record.h5", "fixed_architecture"),
    ("wiring_evolution", ["--methods", "darts", "--epochs", "1"], "darts/record.h5", "darts"),
])
@pytest.mark.parametrize("other", ["a search's record", "a file of the user's"])
def test_a_script_replaces_no_record_but_its_own(script, argv, where, own, other, tmp_path, capsys):
    """The scripts write ``<out>/record.h5`` (``<out>/<config>/record.h5``) with ``overwrite=True`` (``force``): a
    user's own file of that name in the folder, a search's record and every segment of it, was deleted without a word
    and replaced by the script's. Refused in one line before any work (every config's record before the first run);
    a record the script wrote itself is still replaced (the rerun test below)."""
    target = tmp_path / "out" / where
    if other == "a search's record":
        _record_of(target, "snas" if own != "snas" else "darts")
    else:
        target.parent.mkdir(parents=True)
        target.write_text("my notes\n")
    code, err = _script(script, ["--out", str(tmp_path / "out"), *argv], tmp_path, capsys)
    assert code == 2 and len(err) == 1, err
    assert str(target) in err[0] and "give another --out" in err[0], err


def test_a_script_rerun_replaces_its_own_record(tmp_path, capsys):
    """The refusals above and below keep a rerun into the same folder working: the script's own record and figures are
    replaced."""
    import importlib

    from nasdiag.errors import run_script
    from nasdiag.record import load_meta

    target = tmp_path / "record.h5"
    _record_of(target, "xnas_toys")
    for _ in range(2):  # the second run replaces the script's own figures too (they carry nasdiag's mark)
        assert run_script("xnas_toys", importlib.import_module("xnas_toys").main, ["--out", str(tmp_path)]) == 0, capsys.readouterr()
    assert "lr" in load_meta(str(target))["config"]


def test_a_heatmap_the_script_cannot_draw_is_said_not_silently_left_out(tmp_path, capsys):
    """``wiring_cost_heatmaps.py --plot-only`` of a record whose cost at initialization is NaN in every cell (a run
    whose loss diverged there) drew the final heatmap only and exited 0 without a word of the missing one: the
    registry's skipped lines were dropped. One line on stderr names it, as ``nasdiag plot`` does."""
    import importlib

    from nasdiag.errors import run_script
    from nasdiag.record import Recorder

    edges, ops = ["0->2", "1->2", "0->3", "1->3", "2->3"], ["none", "skip_connect"]
    meta = {"method": "fixed_architecture", "op_names": ops, "edge_names": {"normal": edges}, "cell_types": ["normal"]}
    from nasdiag.record import RecordWarning

    with pytest.warns(RecordWarning, match="NaN"):  # the planted NaN row is flagged when written (not the script's line)
        with Recorder(str(tmp_path / "minimal1" / "record.h5"), meta=meta) as rec:
            rec.log(0, {"cost/normal/mean": np.full((5, 2), np.nan, np.float32), "scalars/epoch": np.float32(-1)})
            rec.log(3, {"cost/normal/mean": np.ones((5, 2), np.float32), "scalars/epoch": np.float32(0)})
    capsys.readouterr()
    argv = ["--out", str(tmp_path), "--configs", "minimal1", "--plot-only"]
    assert run_script("wiring_cost_heatmaps", importlib.import_module("wiring_cost_heatmaps").main, argv) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("skipped cost_normal_heatmap_init") and "NaN" in err[0], err
    # round 23: and the NaN of the drawn family counted, as nasdiag plot counts them
    assert len(err) == 2 and "10 NaN" in err[1] and "cost/normal/mean" in err[1], err
    assert sorted(p.name for p in (tmp_path / "minimal1").glob("*.png")) == ["cost_normal_heatmap_final.png"]


@pytest.mark.parametrize("script,argv,where", [
    ("xnas_toys", [], "fig5.png"),
    ("xnas_statistical", ["--runs", "2", "--steps", "2", "--n-grid", "2,4", "--sigma-grid", "1", "--lr-multipliers", ""],
     "fig8.png"),
    ("wiring_output_cost", ["--epochs", "1"], "fig14_16.png"),
    ("wiring_variants", ["--variants", "batch", "--epochs", "1"], "batch/cost_normal_heatmap_final.png"),
    ("wiring_evolution", ["--methods", "darts", "--plot-only"], "darts/wiring_normal.png"),
])
def test_a_script_replaces_no_figure_file_of_the_users(script, argv, where, tmp_path, capsys):
    """A user's own ``fig5.png`` (a paper's folder given as --out) was replaced by the script's figure without a word,
    as ``nasdiag plot`` did before round 12: refused in one line before any work, the file kept."""
    target = tmp_path / "out" / where
    target.parent.mkdir(parents=True)
    target.write_bytes(b"\x89PNG my own figure")
    code, err = _script(script, ["--out", str(tmp_path / "out"), *argv], tmp_path, capsys)
    assert code == 2 and len(err) == 1, err
    assert target.name in err[0] and "not drawn by nasdiag" in err[0], err


def test_xnas_statistical_of_one_run_draws_no_interval_and_warns_nothing(tmp_path, capsys):
    """``--runs 1`` (taken: at least 1): the 95% intervals of one run were a std with ddof=1 of one value, numpy's
    'Degrees of freedom <= 0' and 'invalid value' RuntimeWarnings on stderr and NaN bars, the title still saying
    '1 runs per point (95% CI)'. Drawn without bars, the title saying there is no interval."""
    import importlib
    import warnings

    import matplotlib.figure

    from nasdiag.errors import run_script

    titles = []
    real = matplotlib.figure.Figure.suptitle

    def spy(self, text, **kwargs):
        titles.append(text)
        return real(self, text, **kwargs)

    argv = ["--out", str(tmp_path), "--runs", "1", "--steps", "3", "--n-grid", "2,4", "--sigma-grid", "1",
            "--lr-multipliers", ""]
    with warnings.catch_warnings(record=True) as caught, pytest.MonkeyPatch.context() as mp:
        warnings.simplefilter("always")
        mp.setattr(matplotlib.figure.Figure, "suptitle", spy)
        assert run_script("xnas_statistical", importlib.import_module("xnas_statistical").main, argv) == 0
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    assert titles and "1 run per point" in titles[-1] and "95% CI" not in titles[-1], titles
    # fig8.png carries nasdiag's mark: a rerun into the folder replaces it (a user's own fig8.png is refused)
    assert run_script("xnas_statistical", importlib.import_module("xnas_statistical").main, argv) == 0, capsys.readouterr()


@pytest.mark.parametrize("script,argv,said", [
    ("wiring_cost_heatmaps", ["--configs", "minimal1, minimal1"], "--configs names minimal1 more than once"),
    ("wiring_variants", ["--variants", "batch,layer,batch"], "--variants names batch more than once"),
    ("wiring_evolution", ["--methods", "darts,darts"], "--methods names darts more than once"),
])
def test_a_configuration_named_twice_is_one_line_not_two_runs_into_one_folder(script, argv, said, tmp_path, capsys):
    """``--configs minimal1,minimal1`` trained the configuration twice into one folder, the second run replacing the
    first: minutes (darts8: most of an hour) spent for nothing without a word. One line before any work."""
    code, err = _script(script, ["--out", str(tmp_path / "out"), *argv], tmp_path, capsys)
    assert code == 2 and len(err) == 1 and said in err[0], err


@pytest.mark.parametrize("script,other", [("xnas_toys", "xnas_statistical"), ("xnas_statistical", "xnas_toys")])
def test_plot_only_of_another_scripts_record_is_one_line(script, other, tmp_path, capsys):
    """Both scripts keep ``<out>/record.h5``: ``xnas_toys.py --plot-only`` given xnas_statistical's folder (or the
    other way round) was a KeyError traceback ('problems', 'steps'), exit 1. One line naming whose record it is."""
    _record_of(tmp_path / "out" / "record.h5", other)
    code, err = _script(script, ["--out", str(tmp_path / "out"), "--plot-only"], tmp_path, capsys)
    assert code == 2 and len(err) == 1 and f"a record of {other}" in err[0] and "--plot-only" in err[0], err
