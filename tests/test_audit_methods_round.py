"""Audit of the search methods against their papers: hyperparameters that are accepted must act.

SparseNAS (sparse-supernet eq 6-13, appendix settings) exposes DARTS's w settings, the two proximal optimizers'
settings (HAPG: step size η; AdamHAPG: Adam's learning rate and betas) and the second-order finite difference's
r. Each one either changes what two steps (with an epoch end between them) do to the weights and A, or is refused
with a one-line `ConfigError` when the chosen configuration does not read it; none is accepted and ignored.
"""

from __future__ import annotations

import pytest
import torch

from nasdiag.errors import ConfigError
from nasdiag.search import Schedule, get_method
from nasdiag.supernet import Network

SPARSENAS = get_method("sparsenas")

#: a changed value per key, chosen so that the setting binds on the tiny supernet below (a clip below the gradient
#: norm, betas that matter from the second Adam step on, a floor reached by the cosine after one epoch)
CHANGED = {"w_lr": 0.05, "w_lr_min": 0.01, "w_momentum": 0.5, "w_weight_decay": 0.01, "grad_clip": 1e-3,
           "alpha_lr": 0.05, "alpha_betas": (0.8, 0.9), "hapg_lr": 0.05, "sgl_alpha": 0.2, "lambda_step": 0.5,
           "fd_eps_scale": 1e-4, "init_scale": 0.1}


def two_steps(hp):
    """Parameters of a float64 minimal supernet after step, epoch end, step."""
    torch.manual_seed(0)
    net = Network.minimal(4, 3, 1, in_channels=1, primitives=SPARSENAS.primitives[:3]).double()
    method = SPARSENAS(net, hp, schedule=Schedule(epochs=3, steps_per_epoch=2, batch_size=4))
    g = torch.Generator().manual_seed(1)
    batch = lambda: (torch.randn(4, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g))  # noqa: E731
    method.step(batch(), batch())
    method.epoch_end(0)
    method.step(batch(), batch())
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("setting, refused", [
    ({}, {"hapg_lr"}),  # AdamHAPG, second order (the defaults)
    ({"optimizer": "hapg", "first_order": True}, {"alpha_lr", "alpha_betas", "fd_eps_scale"}),
])
def test_every_sparsenas_hyperparameter_changes_the_steps_or_is_refused(setting, refused):
    keys = SPARSENAS.Hyperparameters.keys()
    assert set(CHANGED) | {"optimizer", "first_order"} == set(keys), "give every hyperparameter a changed value"
    base = two_steps(SPARSENAS.Hyperparameters.from_dict(setting, method="sparsenas"))
    got_refused = set()
    for key in keys:
        value = CHANGED.get(key, {"optimizer": "hapg" if setting.get("optimizer") != "hapg" else "adamhapg",
                                  "first_order": not setting.get("first_order", False)}.get(key))
        try:
            hp = SPARSENAS.Hyperparameters.from_dict({**setting, key: value}, method="sparsenas")
        except ConfigError as exc:
            assert "\n" not in str(exc) and key in str(exc)
            got_refused.add(key)
            continue
        after = two_steps(hp)
        assert any(not torch.equal(a, b) for a, b in zip(base, after)), f"{key}={value!r} is accepted but does nothing"
    assert got_refused == refused


def test_sparsenas_has_no_weight_decay_of_a_and_keeps_the_digits_preset():
    # A's regulariser is the sparse-group-lasso penalty of eq 2, applied by the proximal step; DARTS's Adam weight
    # decay of α has no optimizer to act on in SparseNAS
    with pytest.raises(ConfigError, match="alpha_weight_decay"):
        SPARSENAS.Hyperparameters.from_dict({"alpha_weight_decay": 1e-3}, method="sparsenas")
    # the digits preset's alpha_lr is filled in whatever the optimizer, so HAPG accepts that value
    preset = {**SPARSENAS.digits_preset, "optimizer": "hapg"}
    assert SPARSENAS.Hyperparameters.from_dict(preset, method="sparsenas").alpha_lr == SPARSENAS.digits_preset["alpha_lr"]


def test_hapg_annealed_to_step_size_zero_keeps_stepping():
    # HAPG's η is cosine-annealed to 0 over the run (sparse-supernet appendix); a finished run extended by
    # `--resume --epochs` stays at η = 0 (SearchMethod.extend_schedule), so its steps must run at η = 0
    from nasdiag.sparse import HAPG

    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3, 4, generator=g, dtype=torch.float64))
    p.grad = torch.randn(3, 4, generator=g, dtype=torch.float64)
    opt = HAPG([p], lr=0.1, lam=0.3)
    opt.param_groups[0]["lr"] = 0.0
    before = p.detach().clone()
    opt.step()
    assert torch.equal(p.detach(), before)  # eq 6: z = A; eq 9-10 at zero thresholds: identity; first step: no momentum
    with pytest.raises(ConfigError, match="learning rate"):
        HAPG([p], lr=0.0)  # a step size given at construction must still be positive

    torch.manual_seed(0)
    net = Network.minimal(4, 3, 1, in_channels=1, primitives=SPARSENAS.primitives[:3]).double()
    hp = SPARSENAS.Hyperparameters(optimizer="hapg", first_order=True)
    method = SPARSENAS(net, hp, schedule=Schedule(epochs=1, steps_per_epoch=1, batch_size=4))
    batch = (torch.randn(4, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g))
    method.step(batch, batch)
    method.epoch_end(0)
    assert method.arch_optimizer.param_groups[0]["lr"] == 0.0
    method.extend_schedule(2)
    stats = method.step(batch, batch)
    assert all(torch.isfinite(a).all() for a in net.arch_parameters()) and torch.isfinite(stats["scalars/val_loss"])
