"""Scripts audit, round 21 (scripts21): the batch scripts (scripts/*.py) run as their documented commands at small
sizes, their misuse at the boundaries, and what they print and write against this file's own reading of their records
(h5py, numpy) and its own arithmetic.

Defects found (each test fails without its fix):

* asmnas_stability.py checked its per-seed records (``<method>_seed<s>.h5``) only when each search began: a file of
  the user's named ``darts_seed0.h5`` in ``--out`` was refused after the ASM-NAS searches had run (minutes at the
  defaults), their records and checkpoints left in the folder; a nasdiag search record of another method so named was
  replaced by ``force`` without a word. Every record path is checked before the first search
  (test_asmnas_stability_refuses_a_file_in_the_way_of_a_later_record_before_any_search); make_readme_figures.py and
  wiring_evolution.py likewise refused a later search's record that no search may replace (a Recorder-written record
  of the method) only after the first search had run
  (test_the_searching_scripts_check_a_later_record_before_their_first_search).
* record_kill_trials.py (documented in docs/schema.md) kept plain argparse: ``--trials -1`` printed "-1/-1 SIGKILL
  trials intact" and exited 0, ``--dir`` naming a file (or empty) was os.makedirs' traceback; script_args' Parser
  (``--trials 0`` still makes the folder and runs no trial, as round 7 pins)
  (test_record_kill_trials_refuses_a_negative_count_or_a_file_as_its_folder_in_one_line).
* bayes_compression.py took a --hessian-batch or --batch-size past the 1438 images it trains on as all of them, exit
  0 (--hessian-batch 5000 drew the batch of 1438): one line before any folder; its --help now says what each
  option is (test_bayes_compression_batch_past_the_images_it_trains_on_is_one_line_not_a_silent_cap).
* curvature_accuracy.py --nets "," printed the table's head and wrote a table of no row, exit 0; a net named twice
  (also darts,search) was measured twice; --size without the darts net and --seeds with the weight nets alone were
  taken and did nothing, the setting line naming them (curvature_residual.py --size without --net darts too): one
  line each (test_curvature_scripts_refuse_a_net_list_of_nothing_or_twice_and_options_that_do_nothing).
* xnas_statistical.py (fits.json) and curvature_accuracy.py --out (curvature_accuracy.json, .md) replaced a user's file
  of those names without a word, as the scripts did figures and records before round 14; one line before any work
  unless it is a table the script wrote (script_args.refuse_other_tables)
  (test_a_table_file_of_the_users_in_out_is_not_replaced_and_a_rerun_replaces_its_own).
* a batch script's folder option inside a file (``--runs notes.txt/runs``) was os.makedirs' "Not a directory", naming
  neither option nor file, after another option's folder was made (make_readme_figures' --out); script_args refuses it
  in one line before any work (test_a_folder_option_inside_a_file_is_one_line_naming_it_before_any_folder_is_made).
* bayes_compression.py counted alive the fc1 features of a pruned conv2 filter (the filter and its bias are zeroed,
  so each of its 16 features is 0 for every input): λ = 0.1, ratio 0.9 printed 1-1-1-1 at 0.100 test accuracy, its
  one fc1 feature from a pruned filter; docs/bayesnas.md's λ = 1e-3 result 7-9-44-15 counted one such feature
  (7-9-43-15, the same run otherwise). Step 4 prunes them with their filter
  (test_bayes_compression_counts_no_fc1_feature_of_a_pruned_filter_and_its_counts_are_the_nets_nonzero_groups).
* the wiring scripts (wiring_output_cost, wiring_cost_heatmaps, wiring_variants) share their method and took a
  sibling's record for their own: wiring_output_cost --plot-only of wiring_variants' record said it "holds no
  evaluated epoch yet (a run stopped before its first evaluation...)", wiring_cost_heatmaps --plot-only of
  wiring_output_cost's drew it as a configuration's heatmaps, a run replaced a sibling's record without a word;
  refuse_other_records reads meta's config.experiment too
  (test_a_wiring_script_takes_no_record_of_a_sibling_wiring_script_for_its_own).
* asmnas_stability.py took another tool's summary.json with a "runs" list for its own: --plot-only was max()'s
  ValueError or a KeyError ('seed') traceback, a run replaced it
  (test_asmnas_stability_takes_no_summary_of_another_tool_with_a_runs_list).
* sparsenas_digits.py printed "claims: " and nothing after it for a grid that compares nothing (one optimizer);
  it says none was checked and what each comparison needs (test_sparsenas_digits_says_when_its_grid_checks_no_claim).
* sparsenas_digits.py's table headed λ as 10^{log10 λ:.2g}: 3e-5 and 10^-4.5 (2e-4 and 10^-3.7) were two columns
  of one label (test_sparsenas_digits_table_heads_two_lambdas_apart).
* sparsenas_digits.py --lambdas 1E-3.7 (a capital E, as float() reads 1E-4) was "not a number" where 1e-3.7 is
  10^-3.7 (test_sparsenas_digits_reads_a_fractional_power_with_a_capital_e).
* bayes_compression.py's compression.png drew the groups alive on a log axis: a layer pruned to 0 groups was not
  drawn (its line left the axes), and the iterations had ticks at 1.5, 2.5; linear below 1 and whole-number ticks
  (test_bayes_compression_figure_draws_a_layer_pruned_to_no_group).

Doc fixes (no test): wiring_output_cost's docstring promised "the counts" of correct and wrong samples (it records
``scalars/accuracy_<split>``); wiring_cost_heatmaps' counted 1437 digits search images (1438: 719 + 719, any seed).

Checked and found right: wiring_output_cost's evaluation (per-sample C_Z from the probe's output-edge costs times B,
the overall / correct / wrong means, accuracy, largest C_Z of a correct sample, the Thm 2 check) against this file's
float64 arithmetic on the logits (test_wiring_output_cost_evaluation_is_this_files_arithmetic_on_the_logits), and a
1-epoch run's record: each overall mean = accuracy × correct mean + (1 − accuracy) × wrong mean, mean C_Z = mean L −
mean H to 1e-9, and its docstring's wrong sample p = (0.4, 0.35, 0.25), label 1: C_Z = −0.0307; wiring_variants'
``instance`` run: every recorded cost mean |E[C]| < 1e-8 at init and after training (eq 16, Fig. 19), ``layer`` not
zero (§8.1 claims Thm 1's path nullification for it, not zero costs); sparsenas_digits' feature / neuron / sparsity
counts follow its pruning rule (removal propagated from the output backwards) and its claims' comparable-accuracy
rule is the docstring's; the printed architecture of bayes_compression is the record's last row and, read off the
trained net (groups of nonzero norm), its counts; --layers/--steps/--epochs/--workers at 0 and below, a folder option
naming a file, empty or through a dangling link, and --plot-only with run options: one line each in every script.

Left alone: wiring_evolution and asmnas_stability replace a nasdiag search record of the same method at their record
paths (a user's own darts search saved as darts_seed0.h5): nothing in a search record tells the script's runs from the
user's; xnas_statistical runs a grid value given twice (--sigma-grid 1,1) twice, as round 14 chose for --n-grid;
wiring_output_cost under the dsnas protocol warns of the NaN cost means of unsampled ops (RecordWarning, by design and
flagged, not hidden); the wiring
scripts' and xnas_statistical's --help leave most options without a line (they do what their names say).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest


def _tree(folder):
    """{relative path: bytes} of every file under ``folder``."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in Path(folder).rglob("*") if p.is_file()}


def _run(script, argv, capsys):
    """(exit code, stdout, stderr lines) of a batch script run in-process, through run_script as its command."""
    from nasdiag.errors import run_script

    code = run_script(script, importlib.import_module(script).main, argv)
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


# -- asmnas_stability -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["notes", "record of another method"])
def test_asmnas_stability_refuses_a_file_in_the_way_of_a_later_record_before_any_search(tmp_path, capsys, kind):
    """darts_seed0.h5 (the second method's record) a file of the user's: one line, exit 2, before the ASM-NAS search,
    the folder as it was (no asmnas_seed0.h5, no checkpoint)."""
    import numpy as np

    from nasdiag.record import Recorder

    path = tmp_path / "darts_seed0.h5"
    if kind == "notes":
        path.write_text("my notes\n")
    else:  # a search record of xnas (with a search's settings): --force replaces such a record
        with Recorder(str(path), meta={"method": "xnas", "config": {"method": "xnas"}, "config_hash": "0"}) as rec:
            rec.log(1, {"scalars/train_loss": np.float64(1.0)})
    before = _tree(tmp_path)
    code, out, err = _run("asmnas_stability", ["--out", str(tmp_path), "--seeds", "1", "--epochs", "1", "--threads", "1"],
                          capsys)
    assert code == 2 and len(err) == 1 and "darts_seed0.h5" in err[0], err
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("script,later,argv", [
    ("make_readme_figures", "runs/darts_seed1.h5", ["--out", "{tmp}/img", "--runs", "{tmp}/runs", "--epochs", "1"]),
    ("wiring_evolution", "darts/record.h5", ["--out", "{tmp}", "--methods", "dsnas,darts", "--epochs", "1", "--C", "4"]),
])
def test_the_searching_scripts_check_a_later_record_before_their_first_search(tmp_path, capsys, script, later, argv):
    """A record of the script's method that a user's own loop wrote (Recorder, no search settings), which a search
    refuses to replace even with force, at the second search's path: refused after the first search had run (its
    record and the --out folder left); one line before any, the folder as it was."""
    import numpy as np

    from nasdiag.record import Recorder

    (tmp_path / later).parent.mkdir(parents=True)
    with Recorder(str(tmp_path / later), meta={"method": "darts"}) as rec:
        rec.log(1, {"scalars/train_loss": np.float64(1.0)})
    before = _tree(tmp_path)
    code, out, err = _run(script, [a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert code == 2 and len(err) == 1 and later.split("/")[-1] in err[0], err
    assert _tree(tmp_path) == before and sorted(os.listdir(tmp_path)) == [later.split("/")[0]]


@pytest.mark.parametrize("script,folder,argv,other", [
    ("wiring_output_cost", "", ["--plot-only"], "wiring §8 variants"),
    ("wiring_output_cost", "", ["--epochs", "1"], "wiring cost heatmaps"),
    ("wiring_cost_heatmaps", "minimal1", ["--plot-only", "--configs", "minimal1"], "wiring Thm 2"),
    ("wiring_variants", "instance", ["--variants", "instance", "--epochs", "1"], "wiring Thm 2"),
])
def test_a_wiring_script_takes_no_record_of_a_sibling_wiring_script_for_its_own(tmp_path, capsys, script, folder, argv,
                                                                                  other):
    """The wiring scripts share their method (fixed_architecture) and tell their records apart by meta's
    config.experiment only: wiring_output_cost --plot-only of wiring_variants' record said it 'holds no evaluated epoch
    yet (a run stopped before its first evaluation...)', wiring_cost_heatmaps --plot-only of wiring_output_cost's drew
    its heatmaps as a configuration's, exit 0, and a run replaced a sibling's record without a word. One line naming
    the record's experiment, exit 2, the record as it was."""
    import numpy as np

    from nasdiag.record import Recorder

    record = tmp_path / folder / "record.h5"
    record.parent.mkdir(parents=True, exist_ok=True)
    with Recorder(str(record), meta={"method": "fixed_architecture", "config": {"experiment": other}}) as rec:
        rec.log(0, {"scalars/epoch": np.float64(-1.0), "scalars/loss_train": np.float64(2.3),
                    "cost/normal/mean": np.zeros((5, 8)), "cost/normal/var": np.zeros((5, 8)),
                    "cost/normal/count": np.ones((5, 8), np.int64)})
    before = _tree(tmp_path)
    code, out, err = _run(script, ["--out", str(tmp_path)] + argv, capsys)
    assert code == 2 and len(err) == 1 and repr(other) in err[0] and "record.h5" in err[0], err
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("runs", [[], [{"name": "sweep-1", "loss": 0.3}]])
@pytest.mark.parametrize("plot_only", [True, False])
def test_asmnas_stability_takes_no_summary_of_another_tool_with_a_runs_list(tmp_path, capsys, runs, plot_only):
    """summary.json of another tool that has a 'runs' list (a sweep's) passed the check of round 16: --plot-only was
    max()'s ValueError or a KeyError ('seed') traceback, and a run would have replaced it; one line, exit 2, the folder
    as it was."""
    import json

    (tmp_path / "summary.json").write_text(json.dumps({"runs": runs}))
    before = _tree(tmp_path)
    argv = ["--out", str(tmp_path)] + (["--plot-only"] if plot_only else ["--seeds", "1", "--epochs", "1"])
    code, out, err = _run("asmnas_stability", argv, capsys)
    assert code == 2 and len(err) == 1 and "summary.json" in err[0], err
    assert _tree(tmp_path) == before


# -- record_kill_trials ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("option", ["--trials -1", "--dir FILE", "--dir ''"])
def test_record_kill_trials_refuses_a_negative_count_or_a_file_as_its_folder_in_one_line(tmp_path, capsys, option):
    """--trials -1 printed '-1/-1 SIGKILL trials intact' and exited 0; --dir naming a file (or empty) was os.makedirs'
    traceback: one line, exit 2, the file as it was."""
    from record_kill_trials import main

    (tmp_path / "notes.txt").write_text("mine\n")
    name, value = option.split(" ")
    value = {"FILE": str(tmp_path / "notes.txt"), "''": ""}.get(value, value)
    before = _tree(tmp_path)
    code = main([name, value])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and name in err, err
    assert _tree(tmp_path) == before


# -- bayes_compression ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("option", ["--hessian-batch", "--batch-size"])
def test_bayes_compression_batch_past_the_images_it_trains_on_is_one_line_not_a_silent_cap(tmp_path, capsys, option):
    """The net trains on digits' search-train and search-val splits, fewer than sklearn's 1797 digits (a fifth is held
    out to test); a batch past them was silently all of them (--hessian-batch 5000 and 1438 drew the same Hessian
    batch, exit 0): one line naming the option and the images there are, exit 2, no folder."""
    import re

    from sklearn.datasets import load_digits

    digits = len(load_digits().target)
    out = tmp_path / "bc"
    code, stdout, err = _run("bayes_compression", ["--out", str(out), option, str(digits + 1)], capsys)
    assert code == 2 and len(err) == 1 and f"{option} {digits + 1}" in err[0], err
    named = [int(n) for n in re.findall(r"\b(\d+) images", err[0])]
    assert named and 0.75 * digits <= named[0] < digits, err
    assert not out.exists()


# -- curvature_accuracy, curvature_residual -------------------------------------------------------------------------
@pytest.mark.parametrize("script,argv,named", [
    ("curvature_accuracy", ["--nets", ","], "--nets"),  # printed the table's head, wrote a table of no row, exit 0
    ("curvature_accuracy", ["--nets", "tanh_mlp,tanh_mlp"], "tanh_mlp"),  # measured twice: two rows of one net
    ("curvature_accuracy", ["--nets", "darts,search"], "darts"),  # search is darts
    ("curvature_accuracy", ["--nets", "tanh_mlp", "--size", "tiny"], "--size"),  # shapes the darts net alone
    ("curvature_accuracy", ["--nets", "tanh_mlp,conv_bn", "--seeds", "2"], "--seeds"),  # weight nets: seed 0 alone
    ("curvature_residual", ["--net", "cell_train", "--size", "tiny"], "--size"),
])
def test_curvature_scripts_refuse_a_net_list_of_nothing_or_twice_and_options_that_do_nothing(tmp_path, capsys, script,
                                                                                               argv, named):
    """Each ran (or printed an empty table) and exited 0, the table's setting line naming a size or seeds it was not
    measured at: one line naming the option, exit 2, no --out folder."""
    out = tmp_path / "curv"
    extra = ["--out", str(out)] if script == "curvature_accuracy" else []
    code, stdout, err = _run(script, argv + extra, capsys)
    assert code == 2 and len(err) == 1 and named in err[0] and stdout == "", (stdout, err)
    assert not out.exists()


# -- a table of the user's in --out ---------------------------------------------------------------------------------
@pytest.mark.parametrize("script,name,argv", [
    ("xnas_statistical", "fits.json", ["--runs", "2", "--steps", "3", "--n-grid", "2,3", "--sigma-grid", "1",
                                       "--lr-multipliers", "1"]),
    ("curvature_accuracy", "curvature_accuracy.md", ["--nets", "tanh_mlp", "--repeats", "1"]),
])
def test_a_table_file_of_the_users_in_out_is_not_replaced_and_a_rerun_replaces_its_own(tmp_path, capsys, script, name,
                                                                                        argv):
    """A file of the user's named as one of the script's tables (fits.json: the fits of another tool) was replaced
    without a word: one line naming it, exit 2, the folder as it was; the script's own table from a first run is
    replaced by a second run (exit 0)."""
    import json

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / name).write_text(json.dumps({"a": 1}) if name.endswith(".json") else "# my notes\n")
    before = _tree(mine)
    code, out, err = _run(script, argv + ["--out", str(mine)], capsys)
    assert code == 2 and len(err) == 1 and name in err[0], err
    assert _tree(mine) == before
    own = tmp_path / "own"
    for _ in range(2):
        code, out, err = _run(script, argv + ["--out", str(own)], capsys)
        assert code == 0, err
    assert (own / name).stat().st_size > 0


# -- a folder option inside a file ----------------------------------------------------------------------------------
def test_a_folder_option_inside_a_file_is_one_line_naming_it_before_any_folder_is_made(tmp_path, capsys):
    """make_readme_figures --runs notes.txt/runs (a folder inside a file): os.makedirs' 'Not a directory', naming
    neither the option nor the file, after the --out folder was made; one line naming --runs and the file, nothing
    made."""
    (tmp_path / "notes.txt").write_text("mine\n")
    out = tmp_path / "img"
    code, stdout, err = _run("make_readme_figures", ["--out", str(out), "--runs", str(tmp_path / "notes.txt" / "runs"),
                                                     "--epochs", "1"], capsys)
    assert code == 2 and len(err) == 1 and "--runs" in err[0] and "notes.txt" in err[0] and "file" in err[0], err
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["notes.txt"]


# -- wiring_output_cost: its evaluation against this file's arithmetic on the logits --------------------------------
def test_wiring_output_cost_evaluation_is_this_files_arithmetic_on_the_logits():
    """evaluate() (Thm 2's per-sample C_Z read from the probe's output-edge costs, times B) against this file's float64
    arithmetic on the logits of the same forward (the minimal cell at uniform Z, train-mode BN, batches of 16, 16
    and 8): GAP then a bias-free linear map is 1-homogeneous in the cell's output h, so Σ_n <∂L_b/∂h_n, h_n> =
    <∂L_b/∂Y_b, Y_b> = Σ_c p_bc Y_bc − Y_b,y_b (per-sample loss, not the batch mean), which is L_b − H_b. The means
    overall and over correctly / wrongly classified samples, the accuracy, the largest C_Z of a correct sample and
    the largest |C_Z − (L − H)| are taken here with numpy."""
    import numpy as np
    import torch
    from torch.utils.data import TensorDataset

    import nasdiag
    import wiring_common as W
    import wiring_output_cost
    from nasdiag.search import Schedule

    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(40, 1, 8, 8, generator=g), torch.randint(0, 10, (40,), generator=g)
    net = W.make_network("minimal", 1, 10, 1, C=4, reductions=(), classifier_bias=False, seed=0)
    probe = nasdiag.attach(net)
    method = W.FixedArchitecture(net, W.FixedArchitecture.Hyperparameters(protocol="darts"), probe=probe, seed=0,
                                 schedule=Schedule(1, 1, 16, 40, 40))
    row = wiring_output_cost.evaluate(method, probe, TensorDataset(x, y), "train", batch_size=16)
    uniform = {t: torch.full_like(a, 1.0 / a.shape[-1]) for t, a in net.alphas().items()}
    with torch.no_grad():
        Y = torch.cat([net(x[i:i + 16], uniform) for i in range(0, 40, 16)]).double().numpy()
    Y = Y - Y.max(1, keepdims=True)
    p = np.exp(Y) / np.exp(Y).sum(1, keepdims=True)
    labels = y.numpy()
    own = {"loss": -np.log(p[np.arange(40), labels]), "entropy": -(p * np.log(p)).sum(1)}
    own["cz"] = (p * Y).sum(1) - Y[np.arange(40), labels]
    right = Y.argmax(1) == labels
    assert 0 < right.sum() < 40  # both parts have samples
    got = {k: float(v) for k, v in row.items()}
    for q, v in own.items():
        assert got[f"scalars/{q}_train"] == pytest.approx(v.mean(), rel=1e-5, abs=1e-6)
        assert got[f"scalars/{q}_train_correct"] == pytest.approx(v[right].mean(), rel=1e-5, abs=1e-6)
        assert got[f"scalars/{q}_train_wrong"] == pytest.approx(v[~right].mean(), rel=1e-5, abs=1e-6)
    assert got["scalars/accuracy_train"] == right.mean()
    assert got["scalars/cz_train_correct_max"] == pytest.approx(own["cz"][right].max(), rel=1e-5, abs=1e-6)
    assert got["scalars/cz_train_correct_max"] <= 0
    assert 0 <= got["scalars/thm2_max_abs_error_train"] < 1e-5  # float32 net: C_Z and L − H agree to its rounding


def test_bayes_compression_counts_no_fc1_feature_of_a_pruned_filter_and_its_counts_are_the_nets_nonzero_groups(
        monkeypatch, capsys):
    """The pruned architecture read off the trained net itself (groups of nonzero norm: conv filters with their
    biases, fc columns) against the row's counts; an fc1 feature is the output of one conv2 filter at one of the 4×4
    places (flatten of (16, 4, 4)), so a feature of a pruned filter is 0 for every input. Such features were counted
    alive: λ = 0.1, ratio 0.9 printed 1-1-1-1 at 0.100 accuracy, its one fc1 feature from a pruned filter."""
    import argparse

    import bayes_compression as bc

    nets = []

    class Kept(bc.SmallConvNet):
        def __init__(self):
            super().__init__()
            nets.append(self)

    monkeypatch.setattr(bc, "SmallConvNet", Kept)
    args = argparse.Namespace(seed=0, iterations=3, epochs_per_iteration=1, lam=0.1, lr=0.05, batch_size=64,
                              hessian_batch=256, prune_ratio=0.9, threads=1)
    last = bc.compress(args)[-1]
    capsys.readouterr()
    w = {n: p.detach() for n, p in nets[-1].named_parameters()}
    filters = {c: (w[f"{c}.weight"].flatten(1).norm(dim=1) > 0) | (w[f"{c}.bias"] != 0) for c in ("conv1", "conv2")}
    features = w["fc1.weight"].norm(dim=0) > 0
    assert not filters["conv2"].all()  # the case: a conv2 filter was pruned
    carrying = features & filters["conv2"].repeat_interleave(16)
    assert int(features.sum()) == int(carrying.sum()) == last["alive/fc1"]
    assert (int(filters["conv1"].sum()), int(filters["conv2"].sum())) == (last["alive/conv1"], last["alive/conv2"])
    assert int((w["fc2.weight"].norm(dim=0) > 0).sum()) == last["alive/fc2"]


# -- sparsenas_digits -----------------------------------------------------------------------------------------------
def test_sparsenas_digits_says_when_its_grid_checks_no_claim():
    """A grid of one optimizer (--optimizers sgd) compares nothing: the script printed 'claims: ' and nothing after it.
    The comparisons on a planted grid follow the docstring's rule (own arithmetic: means over λ of A's sparsity minus
    B's and of B's groups minus A's, among configurations within 0.03 of the best accuracy)."""
    from sparsenas_digits import Result, claim_holds

    alone = claim_holds([Result("sgd", "sgl", 1e-4, 0.9, 60, 50, 0.2), Result("sgd", "sgl", 1e-3, 0.91, 50, 40, 0.3)])
    assert not alone.comparisons and "none checked" in alone.summary()
    grid = [Result("hapg", "sgl", 1e-4, 0.95, 30, 20, 0.6), Result("hapg", "sgl", 1e-3, 0.93, 20, 10, 0.8),
            Result("sgd", "sgl", 1e-4, 0.96, 60, 50, 0.1), Result("adam", "sgl", 1e-4, 0.94, 50, 45, 0.3),
            Result("sgd", "sgl", 1e-3, 0.90, 10, 5, 0.9)]  # 0.90 < 0.96 − 0.03: not comparable
    c = claim_holds(grid).comparisons["prox_vs_subgradient"]
    assert c.lambdas == 1 and c.element == pytest.approx(0.6 - 0.3) and c.group == pytest.approx(95 - 50)
    assert c.element_holds and c.group_holds


def test_sparsenas_digits_table_heads_two_lambdas_apart():
    """The table headed each λ as 10^{log10 λ:.2g}: 3e-5 and 10^-4.5 (3.16e-5), or 2e-4 and 10^-3.7 (1.995e-4), two
    columns of one label over different runs. Each head reads back as its own λ (to the digits it shows)."""
    import math

    from sparsenas_digits import Result, table

    lambdas = [10 ** -4.5, 3e-5, 10 ** -3.7, 2e-4, 1e-3]
    head = table([Result("hapg", "sgl", lam, 0.9, 10, 10, 0.5) for lam in lambdas]).splitlines()[0]
    shown = [cell.strip()[len("λ = "):] for cell in head.strip("|").split("|")[2:]]
    assert len(set(shown)) == len(lambdas), head
    read = [10 ** float(t[3:]) if t.startswith("10^") else float(t) for t in shown]
    assert all(math.isclose(r, lam, rel_tol=1e-5) for r, lam in zip(read, sorted(lambdas))), head


def test_sparsenas_digits_reads_a_fractional_power_with_a_capital_e():
    """--lambdas 1E-3.7: 10^-3.7, as 1e-3.7 (and 1E-4 as float() reads it)."""
    from sparsenas_digits import parse_lambdas

    assert parse_lambdas("1E-3.7,1e-3.3,1E-4") == [10 ** -3.7, 10 ** -3.3, 1e-4]


def test_bayes_compression_figure_draws_a_layer_pruned_to_no_group(tmp_path, monkeypatch):
    """compression.png drew the groups alive on a log axis: a layer pruned to 0 (fc1 once its conv2 filters are gone)
    was not drawn, its line leaving the axes; each logged count, 0 included, lies inside the axes. Iterations are
    whole-number ticks (1.5 was one)."""
    import matplotlib.pyplot as plt
    import numpy as np

    import bayes_compression as bc
    from nasdiag.record import Recorder

    counts = {"conv1": [2, 1, 1], "conv2": [5, 1, 1], "fc1": [3, 0, 0], "fc2": [4, 1, 1]}
    record = tmp_path / "compression.h5"
    with Recorder(str(record), meta={"method": "bayes_compression"}) as rec:
        for t in range(3):
            rec.log(t + 1, {"scalars/test_acc": 0.1, **{f"scalars/alive_{k}": float(v[t]) for k, v in counts.items()}})
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    bc.plot(record, tmp_path / "compression.png")
    ax = figures[0].axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    low, high = ax.get_ylim()
    for layer, values in counts.items():
        line = lines[bc.LABELS[layer]]
        assert list(line.get_ydata()) == values
        shown = ax.transData.transform(np.column_stack([line.get_xdata(), line.get_ydata()]))[:, 1]
        bottom, top = ax.transAxes.transform([(0, 0), (0, 1)])[:, 1]
        assert np.isfinite(shown).all() and (shown >= bottom - 1e-6).all() and (shown <= top + 1e-6).all(), layer
    ticks = [t for t in ax.get_xticks() if 1 <= t <= 3]
    assert ticks == [1, 2, 3]
    plt.close(figures[0])
