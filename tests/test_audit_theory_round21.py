"""Audit round 21 of the wiring paper's theorems (supplement §2, §4 Thm. 1, §6 Thm. 2, §8.1-8.2) and of
``nasdiag.cost``'s theory functions, against references written here in float64: ``torch.func.jvp`` for J_f(x)·x,
plain autograd for ∂L/∂Y, closed forms re-derived by hand. Never nasdiag against nasdiag.

Defects found (each test fails without its fix):

* ``eps_deviation(norm, x)`` of a BatchNorm (or a tracking InstanceNorm) in eval mode with running statistics returned
  eps/(var + eps) of x's batch variance (1e-6 at eps = 1e-5), a deviation from invariance of order eps/var, where that
  norm is an affine map whose J_N(x)·x = γ·x/sqrt(running_var + eps) is of the order of N(x) itself (jvp: 100 % off);
  one CostError line (test_eps_deviation_of_a_norm_using_running_statistics_is_one_cost_error_line).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

DT = torch.float64


def test_eps_deviation_of_a_norm_using_running_statistics_is_one_cost_error_line():
    """In eval mode a BatchNorm with running buffers (and an InstanceNorm with track_running_stats) normalizes with
    them: y = γ (x − μ_run)/sqrt(σ²_run + eps) + β, so J_N(x)·x = γ x/sqrt(σ²_run + eps), of the order of N(x) (the
    reference: jvp). eps_deviation said eps/(var + eps) ~ 1e-6. The same norms in train mode, and an eval-mode
    BatchNorm without buffers, normalize by x's statistics and are measured: J_N(x)·x = N(x)·eps/(var + eps)."""
    from nasdiag.cost import CostError, eps_deviation

    torch.manual_seed(0)
    x = 2.0 * torch.randn(4, 3, 5, 5, dtype=DT) + 1.0
    for norm in (nn.BatchNorm2d(3), nn.InstanceNorm2d(3, track_running_stats=True)):
        norm = norm.to(DT)
        with torch.no_grad():
            norm(x)  # running statistics of one batch
        norm.eval()
        out, jx = torch.func.jvp(norm, (x,), (x,))
        assert float((jx - out).abs().max() / out.abs().max()) < 1.5  # the reference: J·x is of N(x)'s order
        assert float(jx.abs().max() / out.abs().max()) > 0.1
        buffers = [b.clone() for b in norm.buffers()]
        with pytest.raises(CostError, match="running statistics") as err:
            eps_deviation(norm, x)
        assert "\n" not in str(err.value)
        assert all(torch.equal(a, b) for a, b in zip(buffers, norm.buffers()))
        norm.train()  # batch (per-sample) statistics: measured, eps/(var + eps) per group
        bn = isinstance(norm, nn.BatchNorm2d)
        plain = (lambda t: F.batch_norm(t, None, None, training=True, eps=1e-5)) if bn else (
            lambda t: F.instance_norm(t, eps=1e-5))  # its affine-free form (jvp cannot run the tracking module)
        out, jx = torch.func.jvp(plain, (x,), (x,))
        dims = (0, 2, 3) if bn else (2, 3)
        ref = norm.eps / (x.var(dim=dims, unbiased=False) + norm.eps)
        torch.testing.assert_close(eps_deviation(norm, x), ref, rtol=1e-12, atol=0)
        torch.testing.assert_close(jx, out * (ref[None, :, None, None] if ref.dim() == 1 else ref[..., None, None]),
                                   rtol=1e-6, atol=1e-18)
    untracked = nn.BatchNorm2d(3, track_running_stats=False, affine=False).to(DT).eval()
    torch.testing.assert_close(eps_deviation(untracked, x), 1e-5 / (x.var(dim=(0, 2, 3), unbiased=False) + 1e-5),
                               rtol=1e-12, atol=0)
