"""The main job end to end: `nasdiag search` writes a record and figures, `nasdiag plot` redraws them;
bad input gets a one-line error."""

import subprocess
import sys

import h5py
import numpy as np
import pytest

from nasdiag.cli import main
from nasdiag.record import load, load_meta

SMALL = ["--C", "4", "--layers", "3", "--steps", "2", "--batch-size", "128", "--no-progress"]


def run(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "darts.h5"
    code = main(["search", "--method", "darts", "--dataset", "digits", "--epochs", "2", "--out", str(out), *SMALL])
    assert code == 0
    return out


def test_search_writes_record_with_losses_accuracies_and_arch(finished_run):
    rec = load(finished_run)
    steps = rec["step"]
    S = 719 // 128  # steps per epoch on the digits search split
    assert steps.tolist() == list(range(1, 2 * S + 1))
    for name in ("train_loss", "train_acc", "val_loss", "val_acc", "w_lr"):
        values = rec[f"scalars/{name}"]
        assert values.shape == (2 * S,) and np.isfinite(values).all()
    assert (rec["scalars/train_acc"] >= 0).all() and (rec["scalars/train_acc"] <= 1).all()
    # epoch evaluations sit in the rows of each epoch's last step
    valid = rec["valid/scalars/search_val_acc"]
    assert steps[valid].tolist() == [S, 2 * S]
    for cell_type in ("normal", "reduce"):
        w = rec[f"arch/{cell_type}/weights"]
        a = rec[f"arch/{cell_type}/params"]
        assert w.shape == a.shape == (2 * S, 5, 8)
        # the recorded weights are the softmax of the recorded parameters
        e = np.exp(a - a.max(-1, keepdims=True))
        np.testing.assert_allclose(w, e / e.sum(-1, keepdims=True), rtol=1e-5)
        assert not np.allclose(a[0], a[-1])  # α moved
    # probe diagnostics of each epoch: cost statistics over the α steps and the mixing-weight Hessian
    for cell_type, cells in (("normal", 1), ("reduce", 2)):
        count = rec[f"cost/{cell_type}/count"][valid]
        assert (count == S * cells).all()  # every α step, every cell of the type
        mean = rec[f"cost/{cell_type}/mean"][valid]
        assert mean.shape == (2, 5, 8) and np.isfinite(mean).all()
        np.testing.assert_array_equal(mean[:, :, 0], 0.0)  # the none op's output is 0, so is its cost
        h = rec[f"hessian/{cell_type}/diag"][valid]
        assert h.shape == (2, 5, 8) and np.isfinite(h).all()
    meta = load_meta(finished_run)
    assert meta["method"] == "darts" and meta["op_names"][0] == "none"
    assert meta["edge_names"]["normal"] == ["0->2", "1->2", "0->3", "1->3", "2->3"]
    # the record is plain HDF5: readable without nasdiag
    with h5py.File(finished_run, "r", swmr=True) as f:
        assert "step" in f


def test_search_figures_and_plot_command(finished_run, tmp_path, capsys):
    figs = finished_run.with_name("darts-figs")
    names = sorted(p.name for p in figs.iterdir())
    assert {"arch_normal_heatmap.png", "arch_normal_evolution.png", "arch_reduce_heatmap.png", "scalars.png",
            "cost_normal_heatmap.png", "hessian_reduce_heatmap.png"} <= set(names)
    assert all((figs / n).stat().st_size > 5000 for n in names)
    code, out, _ = run(["plot", str(finished_run), "--out", str(tmp_path / "figs")], capsys)
    assert code == 0
    written = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert written == names
    assert (tmp_path / "figs" / "arch_normal_heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_existing_output_is_refused_then_resumed(finished_run, capsys, tmp_path):
    code, _, err = run(["search", "--epochs", "2", "--out", str(finished_run), *SMALL], capsys)
    assert code == 2 and "--resume" in err and "--force" in err
    assert len(err.strip().splitlines()) == 1
    # resuming a finished run asks for more epochs
    code, _, err = run(["search", "--epochs", "2", "--out", str(finished_run), "--resume", *SMALL], capsys)
    assert code == 2 and "already finished" in err


def test_resume_continues_where_it_stopped(tmp_path, capsys):
    out = tmp_path / "r.h5"
    assert main(["search", "--epochs", "1", "--out", str(out), "--no-figs", *SMALL]) == 0
    first = load(out)
    assert main(["search", "--epochs", "2", "--out", str(out), "--resume", "--no-figs", *SMALL]) == 0
    both = load(out)
    S = 719 // 128
    assert both["step"].tolist() == list(range(1, 2 * S + 1))
    np.testing.assert_array_equal(both["scalars/train_loss"][:S], first["scalars/train_loss"])
    # settings must match the recorded run
    code, _, err = run(["search", "--epochs", "3", "--out", str(out), "--resume", "--no-figs", *SMALL[:-3], "--batch-size", "64", "--no-progress"], capsys)
    assert code == 2 and "batch_size=64 (recorded 128)" in err


def test_resume_with_more_epochs_extends_the_cosine_schedule_without_raising_the_rate(tmp_path):
    out = tmp_path / "e.h5"
    assert main(["search", "--epochs", "2", "--out", str(out), "--no-figs", "--diagnostics", "none", *SMALL]) == 0
    assert main(["search", "--epochs", "4", "--out", str(out), "--resume", "--no-figs", "--diagnostics", "none", *SMALL]) == 0
    rec = load(out)
    S = 719 // 128
    assert rec["step"].tolist() == list(range(1, 4 * S + 1))
    lr = rec["scalars/w_lr"]
    # the first 2 epochs followed the 2-epoch cosine (0.025 then halfway), the extension anneals on from the
    # current rate (0.001 = w_lr_min after the 2-epoch schedule) and never rises
    np.testing.assert_allclose(lr[:S], 0.025, rtol=1e-6)
    np.testing.assert_allclose(lr[S:2 * S], 0.001 + (0.025 - 0.001) * 0.5, rtol=1e-6)
    np.testing.assert_allclose(lr[2 * S:], 0.001, rtol=1e-6)
    assert load_meta(out)["config"]["epochs"] == 4


def test_console_entry_point_runs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "nasdiag", "search", "--method", "nope", "--out", str(tmp_path / "x.h5")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "unknown method 'nope'" in proc.stderr


def test_float64_search_end_to_end(tmp_path):
    out = tmp_path / "f64.h5"
    assert main(["search", "--epochs", "1", "--out", str(out), "--dtype", "float64", "--no-figs", *SMALL]) == 0
    rec = load(out)
    assert rec["arch/normal/params"].dtype == np.float64
    assert np.isfinite(rec["scalars/train_loss"]).all()


def test_help_imports_neither_torch_nor_h5py_nor_matplotlib():
    # `nasdiag --help` must stay instant: building the parser (plot commands included) loads no heavy module
    code = ("import sys; from nasdiag.cli import _parser; _parser(); "
            "print(sorted(m for m in ('torch', 'h5py', 'matplotlib', 'numpy') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
