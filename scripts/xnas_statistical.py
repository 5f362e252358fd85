#!/usr/bin/env python
"""XNAS §8.3 / Fig. 8: regret and correct selection of XNAS vs GD with softmax, Monte Carlo.

N experts with biases b_i ~ N(0, 1) give rewards R_t,i ~ N(b_i, sigma^2); both forecasters see the
same rewards, R runs x T steps each (paper: 1000 x 1000), all runs batched in torch. Three sweeps:

- ``vs_n``: N over ``--n-grid`` at sigma = ``--sigma``            (Fig. 8 left)
- ``vs_sigma``: sigma over ``--sigma-grid`` at N = ``--n-experts``  (Fig. 8 right)
- ``vs_lr``: both learning rates times ``--lr-multipliers`` at (N, sigma) fixed (not in the paper;
  shows how the comparison depends on eta, which §8.3 does not state)

Both use eta* of eq 4 with L = 3 sqrt(1 + sigma^2) unless scaled by the vs_lr sweep.
Every grid point is one row of an HDF5 record (``nasdiag.record``), holding the per-run results;
the figure and the fits are then computed from the record read back, so ``--plot-only`` redraws
them from an old run.

    python scripts/xnas_statistical.py --out runs/xnas_statistical
    python scripts/xnas_statistical.py --out runs/xnas_statistical --plot-only
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import numpy as np
from nasdiag.errors import run_script
from script_args import (
    Parser, UsageError, at_least, number, numbers, refuse_other_figures, refuse_other_records, refuse_other_tables,
    refuse_overflowing_lr, refuse_past_memory, seed as seed_number, threads as thread_count, torch_threads, write_table,
)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

SWEEPS = ("vs_n", "vs_sigma", "vs_lr")
METHODS = {"xnas": "XNAS", "gd": "GD with softmax"}


def parse_args(argv=None):
    parser = Parser(description=__doc__.split("\n\n")[0], plot_options=('out',))  # the rest: refused with --plot-only
    parser.add_argument("--out", default="runs/xnas_statistical", help="output folder (record.h5, fig8.png, fits.json)")
    parser.add_argument("--runs", type=at_least(1), default=1000)
    parser.add_argument("--steps", type=at_least(1), default=1000)
    # N = 1 has no eta* (ln 1 = 0): the run's RegretError, after the folder and the record were made
    parser.add_argument("--n-grid", type=numbers(at_least(2)), default="2,4,8,16,32,64,128")
    parser.add_argument("--sigma-grid", type=numbers(number(0, low_open=False)), default="0.25,0.5,1,2,4,8,16")
    parser.add_argument("--lr-multipliers", type=numbers(number(), empty=True), default="1,4,16,64",
                        help="empty to skip the vs_lr sweep")
    parser.add_argument("--n-experts", type=at_least(2), default=8, help="N of the vs_sigma and vs_lr sweeps")
    parser.add_argument("--sigma", type=number(0, low_open=False), default=1.0, help="sigma of the vs_n and vs_lr sweeps")
    parser.add_argument("--seed", type=seed_number(), default=0)
    parser.add_argument("--threads", type=thread_count(), default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--plot-only", action="store_true", help="redraw figure and fits from an existing record")
    return parser.parse_args(argv)


def floats(text):
    return [float(v) for v in text.split(",") if v.strip()]


def grid(args):
    """(sweep, N, sigma, lr multiplier) for every row, Fig. 8's sweeps first."""
    points = [("vs_n", int(n), args.sigma, 1.0) for n in floats(args.n_grid)]
    points += [("vs_sigma", args.n_experts, s, 1.0) for s in floats(args.sigma_grid)]
    points += [("vs_lr", args.n_experts, args.sigma, k) for k in floats(args.lr_multipliers)]
    return points


def refuse_overflowing_lrs(args) -> None:
    """Every grid point's learning rate checked before any work: --lr-multipliers 1e308 ran the Fig. 8 sweeps, then
    stopped in the forecaster's RegretError, the record holding the points before it."""
    from nasdiag.regret import Forecaster, default_loss_bound

    for _, n, sigma, multiplier in grid(args):  # eta* L T = sqrt(2 T ln N): only a multiplier takes it past float64
        loss_bound = default_loss_bound(sigma)
        refuse_overflowing_lr("--lr-multipliers", args.lr_multipliers,
                              multiplier * Forecaster.optimal_lr(args.steps, loss_bound, n), loss_bound, args.steps)


#: (runs, N) float64 tensors a point's simulation holds at once, at least: the forecasters' states, the biases, the
#: rewards and their temporaries (about 21 measured at 1000 runs of 4000 experts, torch 2.13 on CPU)
STATE_TENSORS = 16


def refuse_oversized_grid(args) -> None:
    """Every grid point's simulation checked against the machine's memory before any work: ``--n-grid 2,10000000000``
    ran the first point, replacing record.h5 by a record of it, then stopped in torch's "can't allocate memory"
    traceback (exit 1)."""
    for sweep, n, _, _ in grid(args):
        option = "--n-grid" if sweep == "vs_n" else "--n-experts"
        refuse_past_memory(STATE_TENSORS * 8 * args.runs * n, f"the simulation of --runs {args.runs} runs of {n} experts "
                           f"({option})", f"give fewer --runs or a smaller {option}")


def run_experiment(args, record_path):
    """The simulation of every grid point into ``record_path``, with torch at ``--threads`` for it only
    (`script_args.torch_threads`)."""
    with torch_threads(args.threads):
        _run_experiment(args, record_path)


def _run_experiment(args, record_path):
    import torch

    from nasdiag.record import Recorder
    from nasdiag.regret import Forecaster, default_loss_bound, simulate_gaussian_experts

    points = grid(args)
    meta = {
        "method": "xnas_statistical",
        "seed": args.seed,
        "config": {
            "runs": args.runs,
            "steps": args.steps,
            "n_grid": args.n_grid,
            "sigma_grid": args.sigma_grid,
            "lr_multipliers": args.lr_multipliers,
            "n_experts": args.n_experts,
            "sigma": args.sigma,
            "lr_rule": "eta* of eq 4 times the vs_lr multiplier, same for XNAS and GD",
            "loss_bound_rule": "L = 3 sqrt(1 + sigma^2)",
            "dtype": "float64",
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
    }
    generator = torch.Generator().manual_seed(args.seed)
    timings = {}
    started = time.perf_counter()
    with Recorder(record_path, meta=meta, overwrite=True) as rec:
        for step, (sweep, n, sigma, multiplier) in enumerate(points):
            tic = time.perf_counter()
            loss_bound = default_loss_bound(sigma)
            lr = multiplier * Forecaster.optimal_lr(args.steps, loss_bound, n)
            out = simulate_gaussian_experts(
                n, sigma, args.runs, args.steps, lr=lr, gd_lr=lr, loss_bound=loss_bound, generator=generator
            )
            seconds = time.perf_counter() - tic
            timings[sweep] = timings.get(sweep, 0.0) + seconds
            group = f"regret/{sweep}"
            rec.log(step, {
                f"{group}/n_experts": n,
                f"{group}/sigma": float(sigma),
                f"{group}/lr_multiplier": float(multiplier),
                f"{group}/lr": out.lr,
                f"{group}/loss_bound": out.loss_bound,
                f"{group}/xnas/regret": out.xnas_regret,
                f"{group}/gd/regret": out.gd_regret,
                f"{group}/uniform/regret": out.uniform_regret,
                f"{group}/xnas/correct": out.xnas_correct,
                f"{group}/gd/correct": out.gd_correct,
                f"{group}/xnas/bound": out.xnas_bound,
                f"{group}/xnas/gamma": out.xnas_gamma,
                f"{group}/xnas/alive": out.xnas_alive,
                f"{group}/xnas/bound_violations": out.bound_violations,
                "scalars/seconds": seconds,
            })
            print(
                f"[{step + 1:2d}/{len(points)}] {sweep:8s} N={n:4d} sigma={sigma:6.2f} x{multiplier:<4g} "
                f"regret xnas {float(out.xnas_regret.mean()):8.1f} gd {float(out.gd_regret.mean()):8.1f}  "
                f"correct xnas {float(out.xnas_correct.double().mean()):.3f} "
                f"gd {float(out.gd_correct.double().mean()):.3f}  ({seconds:.1f} s)",
                flush=True,
            )
    total = time.perf_counter() - started
    fig8 = timings.get("vs_n", 0.0) + timings.get("vs_sigma", 0.0)
    print(f"Fig. 8 grid (vs_n + vs_sigma): {fig8:.1f} s; all sweeps: {total:.1f} s "
          f"({torch.get_num_threads()} threads)")


def sweep_table(data, sweep):
    """Per-row arrays of one sweep, read from the loaded record."""
    group = f"regret/{sweep}"
    key = f"{group}/n_experts"
    if key not in data:
        return None
    rows = data[f"valid/{key}"]
    table = {name: data[f"{group}/{name}"][rows] for name in ("n_experts", "sigma", "lr_multiplier", "lr", "loss_bound")}
    for method in METHODS:
        for name in ("regret", "correct"):
            table[f"{method}/{name}"] = data[f"{group}/{method}/{name}"][rows]
    for name in ("bound", "gamma", "alive", "bound_violations"):
        table[f"xnas/{name}"] = data[f"{group}/xnas/{name}"][rows]
    table["uniform/regret"] = data[f"{group}/uniform/regret"][rows]
    return table


def one_parameter_fit(x, y):
    """Least squares y ~ a x through the origin; returns a and R^2 (about the mean of y)."""
    a = float(np.dot(x, y) / np.dot(x, x))
    residual = y - a * x
    r2 = 1.0 - float(np.dot(residual, residual)) / float(np.dot(y - y.mean(), y - y.mean()))
    return a, r2


def fits(table):
    """How the mean regret grows with N: one-parameter fits a sqrt(ln N) and b sqrt(N), log-log slope."""
    n = table["n_experts"].astype(float)
    result = {}
    for method in METHODS:
        mean = table[f"{method}/regret"].mean(1)
        a_ln, r2_ln = one_parameter_fit(np.sqrt(np.log(n)), mean)
        a_sq, r2_sq = one_parameter_fit(np.sqrt(n), mean)
        slope = float(np.polyfit(np.log(n), np.log(mean), 1)[0])
        result[method] = {
            "sqrt_ln_n": {"coefficient": a_ln, "r2": r2_ln},
            "sqrt_n": {"coefficient": a_sq, "r2": r2_sq},
            "loglog_slope": slope,
            "mean_regret": dict(zip(map(str, table["n_experts"].tolist()), mean.tolist())),
        }
    return result


def summarize(data):
    summary = {}
    for sweep in SWEEPS:
        table = sweep_table(data, sweep)
        if table is None:
            continue
        rows = []
        for i in range(len(table["n_experts"])):
            row = {k: float(table[k][i]) for k in ("n_experts", "sigma", "lr_multiplier", "lr", "loss_bound")}
            for method in METHODS:
                row[f"{method}_regret_mean"] = float(table[f"{method}/regret"][i].mean())
                row[f"{method}_correct_fraction"] = float(table[f"{method}/correct"][i].mean())
            row["uniform_regret_mean"] = float(table["uniform/regret"][i].mean())
            regret, bound = table["xnas/regret"][i], table["xnas/bound"][i]
            # a NaN regret (or bound) compared False and was counted as a run above the bound: NaN, as its mean is
            row["xnas_regret_below_bound_fraction"] = (float("nan") if np.isnan(regret).any() or np.isnan(bound).any()
                                                       else float((regret <= bound).mean()))
            row["xnas_bound_mean"] = float(table["xnas/bound"][i].mean())
            row["xnas_runs_with_bound_violations"] = float((table["xnas/bound_violations"][i] > 0).mean())
            rows.append(row)
        summary[sweep] = {"rows": rows}
        # a fit of one N divided 0 by 0 (a run stopped or still writing after its first point), and one N given twice
        # (--n-grid 2,2) fitted a log-log slope through two points above one another (numpy's RankWarning, any slope)
        if sweep == "vs_n" and np.unique(table["n_experts"]).size > 1:
            summary[sweep]["fits"] = fits(table)
    return summary


def plot(data, summary, figure_path, runs):
    """Fig. 8 from the record's ``data`` and its ``summary``, into ``figure_path``, in seaborn's theme for this figure
    only: ``sns.set_theme`` wrote it into the session's rcParams, so main() called in a session (a notebook, a test)
    left every later figure of it with seaborn's grid, colours and sizes."""
    import matplotlib

    with matplotlib.rc_context():
        _plot(data, summary, figure_path, runs)


def _plot(data, summary, figure_path, runs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import seaborn as sns

    from nasdiag.plot.style import mark_nonfinite, plot_series

    sns.set_theme(style="whitegrid", context="paper")
    sweeps = [s for s in SWEEPS if s in summary]
    xkey = {"vs_n": "n_experts", "vs_sigma": "sigma", "vs_lr": "lr_multiplier"}
    xlabel = {"vs_n": "number of experts N", "vs_sigma": r"reward noise $\sigma_R$",
              "vs_lr": r"learning rate / $\eta^*$ (both methods)"}
    colors = dict(zip(METHODS, sns.color_palette("deep", 2)))
    # GD is drawn first and wider so that XNAS stays visible where the two coincide
    style = {"gd": dict(marker="s", ms=6, lw=2.2, zorder=2), "xnas": dict(marker="o", ms=3.5, lw=1.2, zorder=3)}
    fig, axes = plt.subplots(2, len(sweeps), figsize=(4.2 * len(sweeps), 6.4), squeeze=False)
    for col, sweep in enumerate(sweeps):
        table = sweep_table(data, sweep)
        x = table[xkey[sweep]].astype(float)
        for method, label in reversed(list(METHODS.items())):
            regret = table[f"{method}/regret"]
            # one run has no spread: its std (ddof=1) was numpy's 'Degrees of freedom <= 0' warnings and NaN bars
            mean, half = regret.mean(1), 1.96 * regret.std(1, ddof=1) / math.sqrt(regret.shape[1]) if runs > 1 else None
            axes[0, col].errorbar(x, mean, yerr=half, capsize=2, color=colors[method], label=label, **style[method])
            mark_nonfinite(axes[0, col], x, mean, colors[method])  # a NaN mean was a point left out without a mark
            correct = table[f"{method}/correct"].astype(float)
            frac = correct.mean(1)
            half = 1.96 * np.sqrt(frac * (1 - frac) / correct.shape[1]) if runs > 1 else None
            axes[1, col].errorbar(x, frac, yerr=half, capsize=2, color=colors[method], label=label, **style[method])
        plot_series(axes[0, col], x, table["uniform/regret"].mean(1), color="0.55", lw=1, ls="-.",
                    label="uniform mixture (no learning)")
        if "fits" in summary[sweep]:
            fine = np.geomspace(x.min(), x.max(), 100)
            f = summary[sweep]["fits"]
            axes[0, col].plot(fine, f["xnas"]["sqrt_ln_n"]["coefficient"] * np.sqrt(np.log(fine)), "--",
                              color=colors["xnas"], lw=1, label=r"fit $a\sqrt{\ln N}$")
            axes[0, col].plot(fine, f["gd"]["sqrt_n"]["coefficient"] * np.sqrt(fine), ":",
                              color=colors["gd"], lw=1, label=r"fit $b\sqrt{N}$")
        positive = x[x > 0]
        for row in range(2):
            if x.min() > 0:
                axes[row, col].set_xscale("log")
            else:  # σ_R = 0 (no noise) has no logarithm: on a log axis σ = 1 and 2 fell on one point at its edge
                axes[row, col].set_xscale("symlog", linthresh=float(positive.min()) if positive.size else 1.0)
            # the grid values as the only labels: over less than a decade matplotlib labels its minor log
            # ticks too ("2×10⁰ 3×10⁰ 4×10⁰ ..."), which overlap
            axes[row, col].set_xticks(x, [f"{v:g}" for v in x])
            axes[row, col].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            axes[row, col].set_xlabel(xlabel[sweep])
        axes[0, col].set_ylabel(f"mean regret (eq 2), T = {data['config_steps']}")
        axes[1, col].set_ylabel("fraction of correct selections")
        axes[0, col].legend(fontsize=7)
    spread = "95% CI" if runs > 1 else "one run: no confidence interval"
    fig.suptitle(f"XNAS vs GD with softmax, {runs} run{'s' if runs > 1 else ''} per point ({spread})", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(figure_path)), exist_ok=True)
    from nasdiag.plot.registry import save

    # nasdiag's save: written under a fresh name and renamed over the figure (savefig on its name left a truncated
    # fig8.png after a Ctrl-C mid-write), through a link, with nasdiag's mark (a rerun replaces it, the user's own
    # fig8.png is refused), then closed
    save(fig, figure_path, 130)


def fits_written_here(text: str) -> bool:
    """Whether ``text`` is a fits.json of this script: its summary of at least one sweep and the record's config."""
    try:
        summary = json.loads(text)
    except ValueError:
        return False
    return isinstance(summary, dict) and isinstance(summary.get("config"), dict) and any(s in summary for s in SWEEPS)


def main(argv=None):
    args = parse_args(argv)
    record_path = os.path.join(args.out, "record.h5")
    refuse_other_figures(args.out, ["fig8"], "png")
    refuse_other_tables([os.path.join(args.out, "fits.json")], fits_written_here)
    refuse_other_records([record_path], "xnas_statistical", plot_only=args.plot_only)
    if not args.plot_only:
        refuse_overflowing_lrs(args)
        refuse_oversized_grid(args)
        os.makedirs(args.out, exist_ok=True)  # not for --plot-only: its refusal left an empty folder
        run_experiment(args, record_path)
    from nasdiag.record import load, load_meta

    data = load(record_path)
    config = load_meta(record_path)["config"]
    data["config_steps"] = config["steps"]
    summary = summarize(data)
    if not summary:  # a run stopped before its first point, or still writing it: a ValueError traceback from matplotlib
        raise UsageError(f"{record_path} holds no finished point yet (a run stopped before its first point, or one "
                         "still writing it); let the run write one, or run again without --plot-only")
    summary["config"] = config
    # renamed over the old one: open("w") emptied it first, and Ctrl-C mid-write left a truncated fits.json
    write_table(os.path.join(args.out, "fits.json"), json.dumps(summary, indent=1))
    figure_path = os.path.join(args.out, "fig8.png")
    plot(data, summary, figure_path, config["runs"])
    if "fits" in summary.get("vs_n", {}):
        for method, f in summary["vs_n"]["fits"].items():
            print(f"{METHODS[method]:16s} regret vs N: a sqrt(ln N) R^2 = {f['sqrt_ln_n']['r2']:.3f}, "
                  f"b sqrt(N) R^2 = {f['sqrt_n']['r2']:.3f}, log-log slope {f['loglog_slope']:.3f}")
    print(f"wrote {record_path}, {figure_path}, {os.path.join(args.out, 'fits.json')}")


if __name__ == "__main__":
    sys.exit(run_script("xnas_statistical", main))
