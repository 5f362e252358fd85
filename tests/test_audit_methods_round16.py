"""Audit round 16 of the search methods: the method contract and the run object against an auditor's own float64
arithmetic (references written here from the papers and plain torch; no nasdiag helper computes one): the separation
of α from the weights (optimizer parameter ids, frozen weights), darts2 at its edge cases (ξ = 0, a zero ∇_w' L_val).

Defects these tests found (each fails without its fix):

- a supernet whose weights are all frozen (``requires_grad=False``: α searched on fixed, e.g. pretrained, weights)
  stopped DARTS's and XNAS's first step in torch's "element 0 of tensors does not require grad" (the w step's
  backward of a loss without a graph) and darts2's and SparseNAS's in "Tensor list must have at least one tensor"
  (the unrolled step's foreach ops on an empty w), while SNAS, DSNAS, ProxylessNAS, BayesNAS and ASM-NAS searched
  on; docs/darts2.md promises that a frozen weight stays where it is, also in w', w^± and ‖∇_w' L_val‖.
- ``load_state_dict`` took the state of a run of another schedule (2 epochs into a method built for 6) without a word:
  the saved cosine schedule (its T_max) ran on under the method's own, so w's learning rate went back up past the
  saved run's end (0.025 → 0.001 → 0.013 → 0.025 over the next epochs) while ``method.schedule`` said 6 epochs; the
  state now holds the schedule and another one is refused in one line, before anything is loaded.
- ``extend_schedule`` of a run extended before (``--resume --epochs 4`` of a 2-epoch run, killed, then ``--resume
  --epochs 6``) annealed over ``epochs − last_epoch`` epochs, taking the scheduler's count since its restart at the
  first extension for the completed epochs: 5 epochs left instead of 4, so w's learning rate ended the run at 0.00186,
  not its minimum 0.001.
- ``evaluate(loader)`` (each epoch's supernet evaluation, or a user's on a test set) ran its train-mode forwards on the
  network's own BatchNorm buffers, so every batch it measured went into the running statistics (and batch counts) that
  an eval-mode use of the searched network then normalises with; a measurement now leaves them as they were.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.func import functional_call

from nasdiag.search import Schedule, get_method
from test_audit_methods_round14 import SMOOTH, _batches, _net

BUILT_IN = ("asmnas", "bayesnas", "darts", "darts2", "dsnas", "proxyless", "snas", "sparsenas", "xnas")


def _method(name, net, epochs=2, steps=2, **hp):
    cls = get_method(name)
    return cls(net, cls.Hyperparameters(**hp), schedule=Schedule(epochs=epochs, steps_per_epoch=steps, batch_size=4))


def _prims(name):
    cls = get_method(name)
    return cls.primitives[:4] if cls.primitives else SMOOTH


def _val_alpha_gradient(net, x, y):
    """∂L_val/∂α by autograd through Z = softmax(α) (DARTS eq 7 at ξ = 0: w' = w), on a copy of the network with
    copies of its buffers; one Z per cell, each cell's α its type's."""
    ref = copy.deepcopy(net)
    alphas = {t: a.detach().clone().requires_grad_(True) for t, a in ref.alphas().items()}
    arch = {id(a) for a in ref.arch_parameters()}
    params = {n: p.detach() for n, p in ref.named_parameters() if id(p) not in arch}
    buffers = {n: b.clone() for n, b in ref.named_buffers()}
    zs = [torch.softmax(alphas[c.cell_type], -1) for c in ref.cells]
    loss = torch.nn.functional.cross_entropy(functional_call(ref, {**params, **buffers}, (x, zs)), y)
    return dict(zip(alphas, torch.autograd.grad(loss, list(alphas.values()))))


# -- α searched on frozen weights ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["darts", "darts2", "sparsenas", "xnas"])
def test_every_method_searches_its_architecture_on_a_supernet_whose_weights_are_all_frozen(name):
    """A frozen weight (requires_grad=False) takes no step of w's optimizer and stays where it is, in the w step and
    in darts2's w', w^± and ‖∇_w' L_val‖ (docs/darts2.md); with every weight frozen a step moves only the
    architecture, as SNAS, DSNAS, ProxylessNAS, BayesNAS and ASM-NAS already did."""
    net = _net(1, _prims(name))
    for p in net.weight_parameters():
        p.requires_grad_(False)
    frozen = {n: p.detach().clone() for n, p in net.named_weight_parameters()}
    method = _method(name, net)
    before = [a.detach().clone() for a in net.arch_parameters()] + [f.log_weights for f in
                                                                    getattr(method, "forecasters", {}).values()]
    data = _batches(4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        method.step(data[0], data[1])
        method.step(data[2], data[3])
    for n, p in net.named_weight_parameters():
        assert torch.equal(p, frozen[n]) and p.grad is None, n
    after = [a.detach() for a in net.arch_parameters()] + [f.log_weights for f in
                                                           getattr(method, "forecasters", {}).values()]
    assert any(not torch.equal(a, b) for a, b in zip(before, after))  # the architecture was searched


def test_darts2_on_frozen_weights_applies_the_first_order_gradient_at_w():
    """With every weight frozen w' = w (nothing moves in the virtual step) and ∇_w' L_val is the empty (zero) vector,
    so the mixed term of eq 8 vanishes: the hypergradient is ∂L_val(w, α)/∂α, autograd through softmax(α)."""
    net = _net(2)
    for p in net.weight_parameters():
        p.requires_grad_(False)
    method = _method("darts2", net)
    (xt, yt), (xv, yv) = _batches(2, 3)
    expected = _val_alpha_gradient(net, xv, yv)
    got = method.arch_gradient((xt, yt), (xv, yv))
    for t in expected:
        torch.testing.assert_close(got[t], expected[t], rtol=1e-10, atol=1e-15)


# -- a state of another schedule -------------------------------------------------------------------------------------
def _cosine(lr0, lr_min, epoch, epochs):
    import math

    return lr_min + (lr0 - lr_min) * (1 + math.cos(math.pi * epoch / epochs)) / 2


@pytest.mark.parametrize("name", ["darts", "bayesnas"])
@pytest.mark.filterwarnings("ignore")
def test_a_state_of_a_run_of_another_schedule_is_refused_and_the_saved_schedule_extends_without_rising(name):
    """DARTS §A.1.1: w's learning rate follows a cosine annealing over the run, never rising. A state saved by a run of
    2 epochs × 3 steps, loaded into a method built for 6 × 3, is refused in one line with nothing loaded; built with
    the saved schedule and extended (extend_schedule, docs/methods.md), the rate anneals on from where it was to its
    minimum at epoch 6, the cosine restarted at the current rate."""
    from nasdiag.errors import NasdiagError

    saved = _method(name, _net(3, _prims(name)), epochs=2, steps=3)
    saved.epoch_end(0)
    state = copy.deepcopy(saved.state_dict())
    other = _method(name, _net(4, _prims(name)), epochs=6, steps=3)
    before = {k: v.clone() for k, v in other.network.state_dict().items()}
    lr_before = other.w_optimizer.param_groups[0]["lr"]
    with pytest.raises(NasdiagError, match=r"2 epochs × 3 steps.*6 × 3") as err:
        other.load_state_dict(state)
    assert "\n" not in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in other.network.state_dict().items())
    assert other.w_optimizer.param_groups[0]["lr"] == lr_before
    resumed = _method(name, _net(4, _prims(name)), epochs=2, steps=3)
    resumed.load_state_dict(state)
    resumed.extend_schedule(6)
    h = resumed.hp
    now = _cosine(h.w_lr, h.w_lr_min, 1, 2)  # after one of the saved run's 2 epochs
    for epoch in range(1, 6):
        assert resumed.w_optimizer.param_groups[0]["lr"] == pytest.approx(
            _cosine(now, h.w_lr_min, epoch - 1, 5), rel=1e-12, abs=1e-15), epoch
        resumed.epoch_end(epoch)
    assert resumed.w_optimizer.param_groups[0]["lr"] == pytest.approx(h.w_lr_min, abs=1e-15)


def test_a_run_extended_twice_anneals_to_its_minimum_at_its_last_epoch():
    """docs/methods.md: an extension anneals from the current rate to the minimum over the remaining epochs,
    lr = lr_min + (lr_now − lr_min)(1 + cos(π t / (N − e)))/2 after t more epochs. 2 epochs, extended to 4 after one,
    then to 6 after two: 4 epochs remain, and the rate reaches lr_min exactly at the sixth."""
    method = _method("darts", _net(5), epochs=2, steps=3)
    h = method.hp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "scheduler step before optimizer step": no step is taken here
        method.epoch_end(0)
        method.extend_schedule(4)
        method.epoch_end(1)
        now = method.w_optimizer.param_groups[0]["lr"]
        # the first extension: from the rate after epoch 1 of 2 over the 3 epochs left of 4
        assert now == pytest.approx(_cosine(_cosine(h.w_lr, h.w_lr_min, 1, 2), h.w_lr_min, 1, 3), rel=1e-12)
        method.extend_schedule(6)
        for t in range(1, 5):
            method.epoch_end(1 + t)
            assert method.w_optimizer.param_groups[0]["lr"] == pytest.approx(
                _cosine(now, h.w_lr_min, t, 4), rel=1e-12, abs=1e-15), t
    assert method.schedule.epochs == 6


# -- darts2 at ξ = 0 ---------------------------------------------------------------------------------------------------
def test_darts2_at_xi_zero_is_first_order_darts_bit_for_bit():
    """DARTS eq 7: ξ = 0 is the first-order approximation. With w's learning rate (ξ) 0, w' = w − 0·(…) = w and the
    mixed term is multiplied by 0, so three steps of darts2 (momentum buffers filled after the first) give the very
    statistics, α and weights of first-order DARTS from the same start (its extra forwards leave BatchNorm's running
    statistics alone, documented, which the train-mode forwards never read)."""
    first = _method("darts", _net(6), epochs=1, steps=3)
    second = _method("darts2", copy.deepcopy(first.network), epochs=1, steps=3)
    for m in (first, second):
        for group in m.w_optimizer.param_groups:
            group["lr"] = 0.0
    data = _batches(6, 7)
    for i in range(3):
        s1, s2 = first.step(data[2 * i], data[2 * i + 1]), second.step(data[2 * i], data[2 * i + 1])
        for path, value in s1.items():
            assert torch.equal(value, s2[path]), (i, path)
        assert float(s2["scalars/implicit_grad_norm"]) == 0.0 and 0 < float(s2["scalars/fd_eps"]) < float("inf")
    for (n, a), b in zip(first.network.named_parameters(), second.network.parameters()):
        assert torch.equal(a, b), n


# -- evaluate() is a measurement ---------------------------------------------------------------------------------------
def test_evaluate_is_the_batch_statistics_mean_and_leaves_the_running_statistics_alone():
    """evaluate: the mean cross-entropy (summed over samples / their number) and the top-1 accuracy of the supernet at
    the mixing weights, BatchNorm on batch statistics (train mode), here by functional_call on copies of the buffers;
    the network's buffers (running mean, var, batch counts) are bit for bit those before the call."""
    method = _method("darts", _net(8), epochs=1, steps=1)
    net = method.network
    data = _batches(3, 9, B=5)
    method.step(data[0], data[1])  # running statistics that are not the initial ones
    before = {n: b.clone() for n, b in net.named_buffers()}
    params = dict(net.named_parameters())
    z = {t: torch.softmax(a.detach(), -1) for t, a in net.alphas().items()}
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for x, y in data:
            logits = functional_call(net, {**params, **{k: v.clone() for k, v in before.items()}}, (x, z))
            loss += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
            n += len(y)
    got = method.evaluate(data)
    assert got["loss"] == pytest.approx(loss / n, rel=1e-12) and got["acc"] == correct / n
    for name, b in net.named_buffers():
        assert torch.equal(b, before[name]), name


def test_asmnas_selection_pass_leaves_the_running_statistics_alone():
    """ASM-NAS's evaluate (Algorithm 1's selection by attention counts) is a forward-only pass like
    SearchMethod.evaluate: the network's buffers are bit for bit those before it."""
    method = _method("asmnas", _net(10, _prims("asmnas")), epochs=1, steps=1)
    data = _batches(3, 11)
    method.step(data[0], data[1])
    before = {n: b.clone() for n, b in method.network.named_buffers()}
    method.evaluate(data)
    assert method.selection_counts is not None
    for name, b in method.network.named_buffers():
        assert torch.equal(b, before[name]), name
