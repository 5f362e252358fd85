"""Small synthetic records for the figure and report tests: what a DARTS search writes, with known values."""

from __future__ import annotations

import numpy as np

from nasdiag import vocabulary as V
from nasdiag.record import Recorder

OPS = ["none", "skip_connect", "max_pool_3x3", "avg_pool_3x3", "sep_conv_3x3", "sep_conv_5x5", "dil_conv_3x3", "dil_conv_5x5"]
EDGES = ["0->2", "1->2", "0->3", "1->3", "2->3"]  # the minimal cell (steps = 2)


def softmax(a):
    e = np.exp(a - a.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def write_record(path, epochs=3, steps_per_epoch=4, seed=0, nan=False, cells=("normal", "reduce"), extra=None):
    """A DARTS-like record: per-step scalars and arch rows, epoch rows with cost moments and the Hessian.

    α moves towards op ``1 + edge`` on edge ``e`` with strength growing with e, so the derived genotype is
    known: node 2 keeps 1->2 (max_pool_3x3) then 0->2 (skip_connect); node 3 keeps 2->3 (sep_conv_5x5) then
    1->3 (sep_conv_3x3).
    """
    rng = np.random.default_rng(seed)
    E, K = len(EDGES), len(OPS)
    meta = {"method": "darts", "op_names": OPS, "edge_names": {c: EDGES for c in cells}, "cell_types": list(cells),
            "config": {"dataset": "digits", "epochs": epochs, "steps": 2, "multiplier": 2, "hessian_mode": "approx"}}
    target = np.zeros((E, K))
    target[np.arange(E), 1 + np.arange(E)] = 1.0 + 0.2 * np.arange(E)
    T = epochs * steps_per_epoch
    with Recorder(str(path), meta=meta) as rec:
        for step in range(1, T + 1):
            alpha = 3.0 * step / T * target + 0.01 * rng.standard_normal((E, K))
            row = {"scalars/train_loss": 2.3 - step / T, "scalars/val_loss": 2.4 - step / T,
                   "scalars/train_acc": step / T * 0.8, "scalars/val_acc": step / T * 0.7,
                   "scalars/w_lr": 0.025 * (1 - step / (2 * T)), "scalars/alpha_grad_norm": 0.1 / step}
            for c in cells:
                row[V.ARCH_PARAMS.path(cell=c)] = alpha
                row[V.ARCH_PROBABILITIES.path(cell=c)] = softmax(alpha)
                row[V.ARCH_WEIGHTS.path(cell=c)] = softmax(alpha)
            if step % steps_per_epoch == 0:
                row["scalars/epoch"] = step // steps_per_epoch - 1
                row["scalars/search_val_loss"] = 2.35 - step / T
                row["scalars/search_val_acc"] = 0.75 * step / T
                for c in cells:
                    row[V.COST_MEAN.path(cell=c)] = 1e-3 * rng.standard_normal((E, K))
                    row[V.COST_VAR.path(cell=c)] = 1e-6 * rng.random((E, K))
                    row[V.COST_COUNT.path(cell=c)] = np.full((E, K), steps_per_epoch, np.int64)
                    row[V.HESSIAN_DIAG.path(cell=c)] = rng.random((E, K))
            if nan:
                row = {k: np.full(np.shape(v), np.nan) if np.asarray(v).dtype.kind == "f" else v for k, v in row.items()}
            row.update((extra or {}).get(step, {}))
            rec.log(step, row)
    return path
