"""Round-8 new-user audit: a researcher's own DARTS-code supernet (α in a plain list, mixed ops with ``_ops``),
attached with ``nasdiag.attach`` and run in their own loop.

References are written here from scratch, in float64: the costs C_ek = ∂L/∂Z_ek by ``torch.autograd.grad`` with Z
an explicit leaf fed through the same candidate ops (no nasdiag code).

Checked and right: two probes attached to one model and recorded nested, and a probe on ``nn.DataParallel`` (CPU,
edges named ``module.<path>``), both equal autograd's ∂L/∂Z.
Found: ``probe.hessian()`` after the user's ``optimizer.step()`` on α was refused as "a forward that draws its Z (a
Gumbel sample)", advice that does not apply to a deterministic DARTS supernet; the line now names the optimizer step.
Found: a second thread entering the ``record()`` block of a probe another thread was recording with was told
"blocks cannot be nested"; the line now says another thread is recording and to attach a probe per thread's model.
Checked and right: three threads, each with its own model and probe, 10 steps each, equal autograd.
Found: a supernet whose edges have different op sets (statistics: one group per edge, each (1, K_e), as
docs/probe.md promises) recorded fine, but ``nasdiag plot`` left every edge but the first out ("K = 3, but
cost/blocks.0/mean gives K = 2"): the figures checked one K for the whole record; K is now checked per cell type
(nasdiag/plot/registry.py, outside this area, one line).
Found: the DARTS-code mixed op ``sum(w * op(x) for w, op in zip(weights, self._ops))`` given the (B, K) weights of the
GGN modes pairs batch rows with ops; where the output's last size is K (8 ops on 8x8 maps) it broadcasts, and
``probe.hessian()`` in ``ggn`` returned silently wrong numbers (checked against J^T H J by autograd); now one
CurvatureError line (nasdiag/hessian/arch_ggn.py, outside this area).
Found: a candidate op (or a whole mixed op) replaced or pruned after ``attach`` gave NaN with a warning to "run every
candidate op" (every op had run; the probe's hooks were on the old modules); now one ProbeError line to attach again.
"""

import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nasdiag
from nasdiag.hessian.modes import CurvatureError
from nasdiag.probe import ProbeError


class _Mixed(nn.Module):  # DARTS code's MixedOp: candidates in `_ops`, forward (x, weights)
    def __init__(self, C):
        super().__init__()
        self._ops = nn.ModuleList([nn.Identity(), nn.Linear(C, C, bias=False), nn.Sequential(nn.ReLU(), nn.Linear(C, C))])

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self._ops))


class _Net(nn.Module):  # α in a plain Python list, as DARTS code keeps `_arch_parameters`
    def __init__(self, C=4, E=3):
        super().__init__()
        self.stem = nn.Linear(5, C)
        self._ops = nn.ModuleList([_Mixed(C) for _ in range(E)])
        self.head = nn.Linear(C, 3)
        self.alphas = [torch.randn(E, 3, dtype=torch.float64, requires_grad=True)]

    def forward(self, x):
        h = self.stem(x)
        w = F.softmax(self.alphas[0], -1)
        for e, m in enumerate(self._ops):
            h = m(h, w[e])
        return self.head(h)


def _reference_costs(net, x, y):
    """∂L/∂Z by autograd, Z a leaf equal to softmax(α), each edge Σ_k Z_ek·op_k(h)."""
    Z = F.softmax(net.alphas[0], -1).detach().requires_grad_(True)
    h = net.stem(x)
    for e, m in enumerate(net._ops):
        h = sum(Z[e, k] * op(h) for k, op in enumerate(m._ops))
    return torch.autograd.grad(F.cross_entropy(net.head(h), y), Z)[0]


def _setup(seed=0):
    torch.manual_seed(seed)
    net = _Net().double()
    return net, torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _max_error(costs, ref, prefix=""):
    return max((costs[f"{prefix}_ops.{e}"] - ref[e]).abs().max().item() for e in range(ref.shape[0]))


def test_two_probes_nested_equal_autograd():
    net, x, y = _setup()
    ref = _reference_costs(net, x, y)
    p1, p2 = nasdiag.attach(net), nasdiag.attach(net)
    with p1.record(), p2.record():
        F.cross_entropy(net(x), y).backward()
    # float64, one product per entry: agreement to rounding
    assert _max_error(p1.costs(), ref) < 1e-12 and _max_error(p2.costs(), ref) < 1e-12
    assert _hooks(net) == 0
    # nn.DataParallel: tests/test_probe_data_parallel.py (on a CUDA host its default device_ids are the GPUs)


@pytest.mark.parametrize("change", ["replace candidate", "prune candidate", "replace mixed op"])
def test_a_candidate_op_or_mixed_op_replaced_after_attach_is_one_line(change):
    net, x, y = _setup()
    probe = nasdiag.attach(net)
    if change == "replace candidate":
        net._ops[1]._ops[1] = nn.Linear(4, 4, bias=False).double()
    elif change == "prune candidate":
        for m in net._ops:
            del m._ops[2]
        net.alphas[0] = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    else:
        net._ops[1] = _Mixed(4).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no NaN warning instead of the error
        with pytest.raises(ProbeError, match="changed since nasdiag.attach") as info:
            with probe.record():
                F.cross_entropy(net(x), y).backward()
    assert "\n" not in str(info.value) and "attach again" in str(info.value)
    assert _hooks(net) == 0
    with pytest.raises(ProbeError):
        probe.costs()  # no step is left behind
    fresh = nasdiag.attach(net)
    with fresh.record():
        F.cross_entropy(net(x), y).backward()
    assert _max_error(fresh.costs(), _reference_costs(net, x, y)) < 1e-12


def _reference_z_hessian_diagonal(net, x, y):
    """diag ∂²L/∂Z² by torch.autograd.functional.hessian over the full (E·K) Z, mean cross-entropy."""
    def loss(Z):
        h = net.stem(x)
        for e, m in enumerate(net._ops):
            h = sum(Z[e, k] * op(h) for k, op in enumerate(m._ops))
        return F.cross_entropy(net.head(h), y)

    Z = F.softmax(net.alphas[0], -1).detach()
    n = Z.numel()
    return torch.autograd.functional.hessian(loss, Z).reshape(n, n).diagonal().reshape(Z.shape)


def test_hessian_after_the_users_alpha_step_names_the_optimizer_step_and_before_it_equals_autograd():
    net, x, y = _setup()
    ref = _reference_z_hessian_diagonal(net, x, y)
    probe = nasdiag.attach(net, hessian="exact")
    opt = torch.optim.Adam(net.alphas, lr=0.01)
    with probe.record(targets=y):
        F.cross_entropy(net(x), y).backward()
    got = probe.hessian()
    # edges in a chain: the exact per-edge diagonal is the full Hessian's diagonal; float64 HVPs agree to rounding
    assert max((got[f"_ops.{e}"] - ref[e]).abs().max().item() for e in range(3)) < 1e-12
    opt.step()
    with pytest.raises(ProbeError, match=r"optimizer\.step\(\)") as info:
        probe.hessian()
    assert "\n" not in str(info.value)
    assert _hooks(net) == 0


def test_threads_with_their_own_probe_equal_autograd_and_a_probe_shared_by_two_threads_is_one_line():
    errors, failures = [], []

    def own_model(seed):
        try:
            net, x, y = _setup(seed)
            probe = nasdiag.attach(net)
            for _ in range(10):
                x = torch.randn_like(x)
                ref = _reference_costs(net, x, y)
                with probe.record():
                    F.cross_entropy(net(x), y).backward()
                errors.append(_max_error(probe.costs(), ref))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=own_model, args=(seed,)) for seed in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures and len(errors) == 30 and max(errors) < 1e-12

    net, x, y = _setup()
    probe = nasdiag.attach(net)
    inside, done, seen = threading.Event(), threading.Event(), []

    def second():
        inside.wait(30)
        try:
            with probe.record():
                pass
        except ProbeError as exc:
            seen.append(str(exc))
        finally:
            done.set()

    t = threading.Thread(target=second)
    t.start()
    with probe.record():
        inside.set()
        done.wait(30)
        F.cross_entropy(net(x), y).backward()
    t.join()
    assert len(seen) == 1 and "another thread" in seen[0] and "\n" not in seen[0]
    assert _max_error(probe.costs(), _reference_costs(net, x, y)) < 1e-12  # the first thread's step is intact
    assert _hooks(net) == 0


class _UnevenNet(nn.Module):
    """Two edges with 2 and 3 candidate ops, α per edge in a ParameterList."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(5, 4)
        self.blocks = nn.ModuleList([_Mixed(4), _Mixed(4)])
        del self.blocks[0]._ops[2]
        self.head = nn.Linear(4, 3)
        self.alpha = nn.ParameterList([nn.Parameter(torch.randn(2)), nn.Parameter(torch.randn(3))])

    def forward(self, x, Z=None):
        h = self.stem(x)
        for e, (block, a) in enumerate(zip(self.blocks, self.alpha)):
            h = torch.tanh(block(h, F.softmax(a, 0) if Z is None else Z[e]))
        return self.head(h)


def test_a_record_of_edges_with_different_op_sets_equals_autograd_and_is_drawn_for_every_edge(tmp_path, capsys):
    from nasdiag.cli import main
    from nasdiag.record import RecorderCallback, load

    torch.manual_seed(3)
    net = _UnevenNet().double()
    probe = nasdiag.attach(net)
    path, refs = str(tmp_path / "mine.h5"), []
    with RecorderCallback(path, meta={"method": "mine"}) as callback:
        for step in range(3):
            x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
            Z = [F.softmax(a, 0).detach().requires_grad_(True) for a in net.alpha]
            refs.append(torch.autograd.grad(F.cross_entropy(net(x, Z), y), Z))
            with probe.record():
                F.cross_entropy(net(x), y).backward()
            callback.on_step_end(step, {**probe.statistics(), "scalars/loss": 0.0})
        callback.on_epoch_end(0)
    record = load(path)
    for e in range(2):
        mean = torch.stack([r[e] for r in refs]).mean(0)
        # float64 throughout: the running mean of three steps agrees to rounding
        assert record[f"cost/blocks.{e}/mean"].shape == (3, 1, 2 + e)
        assert abs(record[f"cost/blocks.{e}/mean"][-1, 0] - mean.numpy()).max() < 1e-12
    code = main(["plot", path, "--out", str(tmp_path / "figs")])
    err = capsys.readouterr().err
    assert code == 0 and "left out" not in err, err
    assert all((tmp_path / "figs" / f"cost_blocks.{e}_heatmap.png").exists() for e in range(2))


def _conv_supernet(per_sample_weights: bool):
    K = 4

    class Mixed(nn.Module):
        def __init__(self, C):
            super().__init__()
            self._ops = nn.ModuleList([nn.Conv2d(C, C, 3, padding=1, bias=False) for _ in range(K)])

        def forward(self, x, weights):
            if per_sample_weights:
                w = [weights[..., k].reshape(-1, 1, 1, 1) if weights.dim() == 2 else weights[k] for k in range(K)]
                return sum(wk * op(x) for wk, op in zip(w, self._ops))
            return sum(w * op(x) for w, op in zip(weights, self._ops))  # the DARTS code, (K,) weights only

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(1, 3, 3, padding=1)
            self.edges = nn.ModuleList([Mixed(3), Mixed(3)])
            self.head = nn.Linear(3, 3)
            self.alpha = nn.Parameter(torch.randn(2, K))

        def forward(self, x, Z=None):
            h = self.stem(x)
            Z = F.softmax(self.alpha, -1) if Z is None else Z
            for e, m in enumerate(self.edges):
                h = torch.tanh(m(h, Z[e]))
            return self.head(h.mean((2, 3)))

    torch.manual_seed(4)
    return Net().double(), K


@pytest.mark.parametrize("per_sample_weights", [True, False])
def test_ggn_of_a_darts_code_mixed_op_on_maps_as_wide_as_k_equals_autograd_or_is_one_line(per_sample_weights):
    net, K = _conv_supernet(per_sample_weights)
    B = 6
    x, y = torch.randn(B, 1, K, K, dtype=torch.float64), torch.randint(0, 3, (B,))  # map width == K
    Z = F.softmax(net.alpha, -1).detach()
    J = torch.autograd.functional.jacobian(lambda z: net(x, z), Z).reshape(B, 3, Z.numel())
    p = F.softmax(net(x, Z), -1).detach()
    H = (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]) / B  # mean cross-entropy's Hessian in the logits
    ggn = torch.einsum("bci,bcd,bdi->i", J, H, J).reshape(Z.shape)  # diag of Jᵀ H J
    probe = nasdiag.attach(net, hessian="ggn")
    with probe.record(targets=y):
        F.cross_entropy(net(x), y).backward()
    if per_sample_weights:
        got = probe.hessian()
        assert max((got[f"edges.{e}"] - ggn[e]).abs().max().item() for e in range(2)) < 1e-12 * ggn.abs().max().item() + 1e-16
    else:
        with pytest.raises(CurvatureError, match="zip") as info:
            probe.hessian()
        assert "\n" not in str(info.value)
    assert _hooks(net) == 0
