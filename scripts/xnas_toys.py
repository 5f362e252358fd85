#!/usr/bin/env python
"""XNAS supplement §8.1-8.2, Figs 3-7: the deterministic toy problems where each expert is an axis.

Experts predict constant unit vectors f_i = e_i, so the forecaster's prediction is its weight vector
p = u on the simplex (eq 38-39, 48-49). Both forecasters see the gradient of the loss at their own
prediction; their rewards are R_i = -grad_p l . f_i (``nasdiag.regret.rewards_from_gradient``).
XNAS is ``nasdiag.regret.Forecaster`` (EG step + wipeout, Algorithm 1), GD with softmax is
``nasdiag.regret.SoftmaxGD`` (eq 5-6: the reward attenuated by the expert's own weight).

Problems (one record row per step, then figures drawn from the record):

- ``fig3``  §8.1: l1 = 2z for 30 steps, then l2 = -y - 2z for 90 steps (3 experts), lr 0.1. Left: the 3D
  trajectories; middle: projected on the simplex, darker = earlier; right: the update term of z.
- ``fig4``  §8.2.1: l = -x, balanced initialization alpha_x = alpha_y, lr 0.1, 50 steps.
- ``fig5``  §8.2.2: l = -x, imbalanced initialization alpha_x = 0 < 5 = alpha_y.
- ``fig7``  §8.2.4: l = 0.5 (x-1)^2 + 0.5 y^2 (higher curvature), balanced initialization.
  Figs 4, 5, 7 show the trajectories on the (x, y) plane with the loss contours and the simplex
  (dashed), the distance from the optimum and the magnitude of the update term of x.
- ``fig6``  §8.2.3: the attenuation factor x*y of GD with softmax, along the simplex and versus alpha_x
  at alpha_y = 0, computed as GD's effective reward for R = (1, 0) (``nasdiag.regret.gd_softmax_reward``).

What differs from the paper: §8.1 gives no learning rate; 0.1 (the §8.2 value) is used. XNAS's wipeout
uses L = max |R| of the problem and T = the number of steps. Runs in about 10 s on one CPU core.

    python scripts/xnas_toys.py --out runs/xnas_toys
    python scripts/xnas_toys.py --out runs/xnas_toys --plot-only
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from nasdiag.errors import NasdiagError, run_script
from script_args import Parser, number, refuse_other_figures, refuse_other_records, refuse_overflowing_lr

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

OPTIMIZERS = {"xnas": "XNAS", "gd": "GD with softmax"}


def parse_args(argv=None):
    parser = Parser(description=__doc__.split("\n\n")[0], plot_options=('out', 'format'))  # the rest: refused with --plot-only
    parser.add_argument("--out", default="runs/xnas_toys", help="output folder (record.h5, fig*.png)")
    parser.add_argument("--lr", type=number(), default=0.1, help="learning rate of both optimizers (§8.2: 0.1)")
    parser.add_argument("--format", default="png", choices=("png", "pdf", "svg"))
    parser.add_argument("--plot-only", action="store_true", help="redraw the figures from an existing record")
    return parser.parse_args(argv)


# -- the problems: (experts, steps, gradient of the loss at p (t, p) -> grad, loss(p), initial alpha, optimum)
def _problems():
    import torch

    def grad3(t, p):  # l1 = 2z for 30 steps, then l2 = -y - 2z
        return torch.tensor([0.0, 0.0, 2.0] if t < 30 else [0.0, -1.0, -2.0], dtype=torch.float64)

    def linear(t, p):  # l = -x
        return torch.tensor([-1.0, 0.0], dtype=torch.float64)

    def quadratic(t, p):  # l = 0.5 (x - 1)^2 + 0.5 y^2
        return torch.stack([p[0] - 1.0, p[1]])

    return {
        "fig3": dict(n=3, steps=120, grad=grad3, alpha=(0.0, 0.0, 0.0), optimum=(0.0, 0.0, 1.0), bound=2.0,
                     loss=lambda p, t: 2 * p[2] if t < 30 else -p[1] - 2 * p[2]),
        "fig4": dict(n=2, steps=50, grad=linear, alpha=(0.0, 0.0), optimum=(1.0, 0.0), bound=1.0, loss=lambda p, t: -p[0]),
        "fig5": dict(n=2, steps=50, grad=linear, alpha=(0.0, 5.0), optimum=(1.0, 0.0), bound=1.0, loss=lambda p, t: -p[0]),
        "fig7": dict(n=2, steps=50, grad=quadratic, alpha=(0.0, 0.0), optimum=(1.0, 0.0), bound=1.0,
                     loss=lambda p, t: 0.5 * (p[0] - 1) ** 2 + 0.5 * p[1] ** 2),
    }


def play(problem, optimizer: str, lr: float):
    """Run one optimizer on one problem: (predictions before each round (T, N), update terms (T, N), losses (T,))."""
    import torch

    from nasdiag.regret import Forecaster, SoftmaxGD, rewards_from_gradient

    n, steps = problem["n"], problem["steps"]
    alpha = torch.tensor(problem["alpha"], dtype=torch.float64)
    if optimizer == "xnas":
        # a non-uniform start voids only the bound of Theorem 1, which these figures do not use
        fc = Forecaster(n, lr, problem["bound"], steps, init_log_weights=alpha)
    else:
        fc = SoftmaxGD(n, lr, init_log_weights=alpha)
    axes = torch.eye(n, dtype=torch.float64)  # f_i = e_i (eq 38, 48)
    predictions, updates, losses = [], [], []
    for t in range(steps):
        p = fc.weights.clone()
        rewards = rewards_from_gradient(problem["grad"](t, p), axes)
        applied = fc.update(rewards)
        predictions.append(p)
        # XNAS's update term is the reward itself (eq 45-47), GD's the effective reward (eq 42-44)
        updates.append(rewards if optimizer == "xnas" else applied)
        losses.append(float(problem["loss"](p, t)))
    return torch.stack(predictions).numpy(), torch.stack(updates).numpy(), np.asarray(losses)


def attenuation(points: int = 201):
    """(x on the simplex, x*y there, alpha_x grid, x*y at alpha_y = 0): GD's effective reward of expert x
    for R = (1, 0) is u_x (1 - u_x) = x*y (eq 52)."""
    import torch

    from nasdiag.regret import gd_softmax_reward

    x = torch.linspace(0, 1, points, dtype=torch.float64)
    u = torch.stack([x, 1 - x], -1)
    reward = torch.tensor([1.0, 0.0], dtype=torch.float64)
    along = gd_softmax_reward(reward.expand_as(u), u)[:, 0]
    alpha_x = torch.linspace(-6, 6, points, dtype=torch.float64)
    u_alpha = torch.softmax(torch.stack([alpha_x, torch.zeros_like(alpha_x)], -1), -1)
    versus = gd_softmax_reward(reward.expand_as(u_alpha), u_alpha)[:, 0]
    return x.numpy(), along.numpy(), alpha_x.numpy(), versus.numpy()


def write_record(path: str, lr: float) -> None:
    from nasdiag.record import Recorder

    problems = _problems()
    meta = {"method": "xnas_toys", "config": {"lr": lr, "problems": {k: {"steps": v["steps"], "alpha": v["alpha"],
                                                                          "optimum": v["optimum"]} for k, v in problems.items()}}}
    runs = {name: {opt: play(problem, opt, lr) for opt in OPTIMIZERS} for name, problem in problems.items()}
    x, along, alpha_x, versus = attenuation()
    rows = max(max(v["steps"] for v in problems.values()), x.size)
    with Recorder(path, meta=meta, overwrite=True) as rec:
        for t in range(rows):
            row = {}
            for name, by_opt in runs.items():
                for opt, (pred, upd, loss) in by_opt.items():
                    if t < len(loss):
                        row[f"toy/{name}/{opt}/p"] = pred[t]
                        row[f"toy/{name}/{opt}/update"] = upd[t]
                        row[f"toy/{name}/{opt}/loss"] = loss[t]
            if t < x.size:
                row.update({"toy/fig6/x": x[t], "toy/fig6/factor_simplex": along[t],
                            "toy/fig6/alpha_x": alpha_x[t], "toy/fig6/factor_alpha": versus[t]})
            rec.log(t, row)


def _series(record, path):
    rows = record[f"valid/{path}"]
    return record["step"][rows], record[path][rows]


def draw(record_path: str, out: str, fmt: str) -> list:
    from nasdiag.plot.style import PAGE, paper_style, plt
    from nasdiag.record import load
    from nasdiag.record.schema import loads_json

    record = load(record_path)
    config = loads_json(str(record["meta/config"]))
    problems = config["problems"]
    for name, problem in problems.items():  # a run stopped before its last row: a traceback of no row, or cut curves
        done = int(np.sum(record.get(f"valid/toy/{name}/xnas/p", 0)))
        if done < problem["steps"]:
            raise NasdiagError(f"{record_path} holds {done} of the {problem['steps']} steps of {name}: its run stopped "
                               f"before it finished (interrupted, or a full disk); run again without --plot-only")
    colors = {"xnas": "#d62728", "gd": "#1f77b4"}
    written = []
    with paper_style():
        # Fig. 3: 3D trajectories, the simplex projection coloured by time, the update term of z
        fig = plt.figure(figsize=(PAGE, 2.4))
        ax3 = fig.add_subplot(1, 3, 1, projection="3d")
        ax_s, ax_u = fig.add_subplot(1, 3, 2), fig.add_subplot(1, 3, 3)
        corners = np.array([[0.0, 0.0], [1.0, 0.0], [0.5, np.sqrt(3) / 2]])  # x, y, z corners of the simplex
        ax_s.plot(*np.vstack([corners, corners[:1]]).T, color="0.6", lw=0.8)
        for (cx, cy), lab in zip(corners, "xyz"):
            ax_s.annotate(lab, (cx, cy), textcoords="offset points", xytext=(0, -9 if lab != "z" else 4), ha="center")
        for opt, name in OPTIMIZERS.items():
            steps, p = _series(record, f"toy/fig3/{opt}/p")
            ax3.plot(p[:, 0], p[:, 1], p[:, 2], color=colors[opt], lw=1.2, label=name)
            flat = p @ corners
            # reversed maps: the first step darkest, the last lightest (but not white), as in the paper's Fig. 3
            cmap = "Reds_r" if opt == "xnas" else "Blues_r"
            ax_s.scatter(flat[:, 0], flat[:, 1], c=steps, cmap=cmap, s=6, vmax=steps.max() + 40, label=name)
            steps, u = _series(record, f"toy/fig3/{opt}/update")
            ax_u.plot(steps, u[:, 2], color=colors[opt], lw=1.2, label=name)
        ax3.set_xlabel("x"), ax3.set_ylabel("y"), ax3.set_zlabel("z")
        ax3.set_title("trajectories in 3D", loc="left")
        ax_s.set_aspect("equal"), ax_s.axis("off")
        ax_s.set_title("on the simplex (darker = earlier)", loc="left")
        ax_u.axvline(30, color="0.5", ls=":", lw=0.8)
        ax_u.set_xlabel("step"), ax_u.set_ylabel("update term of z")
        ax_u.set_title("l = 2z, then -y - 2z from step 30", loc="left")
        ax_u.legend(frameon=False)
        fig.suptitle(f"XNAS Fig. 3: recovery of a late bloomer (lr {config['lr']})")
        written.append(_save(fig, out, "fig3", fmt))

        for name, title in (("fig4", "l = -x, balanced initialization"), ("fig5", "l = -x, imbalanced initialization α = (0, 5)"),
                            ("fig7", "l = ½(x-1)² + ½y², higher curvature")):
            fig, (ax_t, ax_d, ax_g) = plt.subplots(1, 3, figsize=(PAGE, 2.2))
            grid = np.linspace(-0.1, 1.1, 121)
            X, Y = np.meshgrid(grid, grid)
            L = -X if name != "fig7" else 0.5 * (X - 1) ** 2 + 0.5 * Y**2
            ax_t.contour(X, Y, L, levels=10, colors="0.8", linewidths=0.6)
            ax_t.plot([0, 1], [1, 0], "k--", lw=0.8, label="simplex x + y = 1")
            optimum = np.asarray(problems[name]["optimum"])
            for opt, label in OPTIMIZERS.items():
                steps, p = _series(record, f"toy/{name}/{opt}/p")
                ax_t.plot(p[:, 0], p[:, 1], color=colors[opt], lw=1.2, label=label)
                ax_t.plot(p[-1, 0], p[-1, 1], "o", color=colors[opt], ms=4)
                ax_d.plot(steps, np.linalg.norm(p - optimum, axis=1), color=colors[opt], lw=1.2, label=label)
                steps, u = _series(record, f"toy/{name}/{opt}/update")
                ax_g.plot(steps, np.abs(u[:, 0]), color=colors[opt], lw=1.2, label=label)
            ax_t.set_xlabel("x"), ax_t.set_ylabel("y"), ax_t.set_aspect("equal")
            ax_t.set_title("trajectories", loc="left")
            ax_d.set_xlabel("step"), ax_d.set_ylabel("‖p − p*‖₂"), ax_d.set_title("distance from the optimum", loc="left")
            ax_g.set_xlabel("step"), ax_g.set_ylabel("|update term of x|"), ax_g.set_title("gradient magnitude", loc="left")
            ax_d.legend(frameon=False)
            fig.suptitle(f"XNAS Fig. {name[3:]}: {title} (lr {config['lr']})")
            written.append(_save(fig, out, name, fmt))

        fig, (ax_a, ax_b) = plt.subplots(1, 2, figsize=(PAGE * 0.7, 2.0))
        _, x = _series(record, "toy/fig6/x")
        _, along = _series(record, "toy/fig6/factor_simplex")
        _, alpha_x = _series(record, "toy/fig6/alpha_x")
        _, versus = _series(record, "toy/fig6/factor_alpha")
        ax_a.plot(x, along, color="#1f77b4")
        ax_a.set_xlabel("x  (y = 1 − x)"), ax_a.set_ylabel("attenuation x·y"), ax_a.set_title("along the simplex", loc="left")
        ax_b.plot(alpha_x, versus, color="#1f77b4")
        ax_b.set_xlabel("α_x  (α_y = 0)"), ax_b.set_ylabel("attenuation x·y"), ax_b.set_title("versus α_x", loc="left")
        fig.suptitle("XNAS Fig. 6: attenuation factor of GD with softmax")
        written.append(_save(fig, out, "fig6", fmt))
    return written


def _save(fig, out, name, fmt):
    from nasdiag.plot.registry import save

    path = os.path.join(out, f"{name}.{fmt}")
    save(fig, path, dpi=150)
    return path


def main(argv=None):
    args = parse_args(argv)
    record = os.path.join(args.out, "record.h5")
    refuse_other_figures(args.out, ["fig3", "fig4", "fig5", "fig6", "fig7"], args.format)
    refuse_other_records([record], "xnas_toys", plot_only=args.plot_only)
    if not args.plot_only:
        for problem in _problems().values():  # --lr 1e308: the forecaster's RegretError, the folder made
            refuse_overflowing_lr("--lr", args.lr, args.lr, problem["bound"], problem["steps"])
        os.makedirs(args.out, exist_ok=True)  # not for --plot-only: its refusal left an empty folder
        start = time.perf_counter()
        write_record(record, args.lr)
        print(f"record: {record} ({time.perf_counter() - start:.1f} s)")
    elif not os.path.exists(record):
        raise NasdiagError(f"no record at {record}; run without --plot-only first")
    for path in draw(record, args.out, args.format):
        print(path)


if __name__ == "__main__":
    sys.exit(run_script("xnas_toys", main))
