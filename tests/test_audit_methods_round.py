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
