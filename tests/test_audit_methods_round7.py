"""Audit round 7 of the search methods (nasdiag/search/methods, nasdiag/sparse, nasdiag/search/unrolled.py, base.py).

Each test states the contract it holds the code to (the method docstrings, docs/darts2.md, docs/methods.md) and checks
it with its own float64 computation: the state a failing step must leave (α, w, BatchNorm's running statistics, the
optimizers' state, compared to deep copies taken before), torch forward hooks on the attention modules for ASM-NAS's
recorded attention mean, plain arithmetic for the rest. Nothing here uses nasdiag to compute a reference.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from nasdiag.errors import NasdiagError
from nasdiag.search import Schedule, SearchError, get_method
from nasdiag.supernet import Network
from test_audit_methods_round3 import _assert_same as _same  # equal tensors, dicts, sequences, values

CLASSES = 10


def _net(seed=0, primitives=None):
    torch.manual_seed(seed)
    kwargs = {} if primitives is None else {"primitives": primitives}
    return Network(2, CLASSES, 3, steps=1, multiplier=1, in_channels=1, **kwargs).double()


def _batch(seed, B=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, CLASSES, (B,), generator=g)


def _method(name, net, **hp):
    cls = get_method(name)
    return cls(net, cls.Hyperparameters(**hp), schedule=Schedule(epochs=2, steps_per_epoch=3, batch_size=4))


def _snapshot(method):
    """Everything a step may change: network parameters and buffers, each optimizer's state, the generator."""
    return copy.deepcopy({"net": method.network.state_dict(),
                          "objects": {k: v.state_dict() for k, v in method._stateful().items()},
                          "generator": method.generator.get_state()})


# -- the unrolled step: the losses at w± are unrolled forwards too -------------------------------------------------
@pytest.mark.parametrize("name", ["darts2", "sparsenas"])
def test_a_nonfinite_loss_at_the_finite_differences_w_plus_minus_stops_the_step_before_alpha_moves(name):
    """docs/darts2.md: "A non-finite loss (of an unrolled forward, or of the w step's forward) raises SearchError
    before the update that would use it". The finite difference of eq 13 evaluates L_train at w^± = w ± εv with
    ε = r/‖v‖, i.e. at distance r from w. With r = 1e300 those losses are NaN while L_train(w) and L_val(w') are
    finite: the step must stop there, every piece of state as before (the α step applied the NaN hypergradient and
    the w step's check raised afterwards, blaming the search-train batch, with α NaN)."""
    net = _net(1, primitives=("skip_connect", "avg_pool_3x3", "sep_conv_3x3") if name == "sparsenas" else None)
    method = _method(name, net, fd_eps_scale=1e300)
    train, val = _batch(2), _batch(3)
    before = _snapshot(method)
    with pytest.raises(SearchError) as info:
        method.step(train, val)
    message = str(info.value)
    assert "\n" not in message and "w ± εv" in message and "fd_eps_scale" in message, message
    _same(before, _snapshot(method))
    assert all(torch.isfinite(a).all() for a in net.arch_parameters())
    stats = info.value.statistics
    assert float(stats["scalars/nonfinite_loss"]) == 1.0
    # ε of the failing step is in its row: r / ‖∇_w' L_val‖, finite and huge
    assert float(stats["scalars/fd_eps"]) > 1e290
    # the same step with DARTS's r goes through and keeps α finite (the refusal is about the perturbed losses alone)
    method.hp.fd_eps_scale = 0.01
    method.step(train, val)
    assert all(torch.isfinite(a).all() for a in net.arch_parameters())


def test_a_nan_search_train_loss_of_the_w_step_is_one_error_and_no_warning():
    """SparseNAS (first order) checks the w step's loss before its backward (``check_train_loss``); its message
    formatted the loss with float() on a tensor that requires grad, so torch's UserWarning ("Converting a tensor with
    requires_grad=True to a scalar") came out beside the one-line error."""
    net = _net(4, primitives=("skip_connect", "avg_pool_3x3", "sep_conv_3x3"))
    method = _method("sparsenas", net, first_order=True)
    x, y = _batch(5)
    x[0, 0, 0, 0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(SearchError, match="search-train loss is nan"):
            method.step((x, y), _batch(6))
    assert [str(w.message) for w in caught] == []


# -- a batch the supernet cannot take -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["darts", "darts2", "snas", "dsnas", "proxyless", "sparsenas", "asmnas"])
@pytest.mark.parametrize("bad", [CLASSES, -1, -100], ids=["past-the-classifier", "negative", "ignore-index"])
def test_a_label_outside_the_classifiers_classes_is_one_line_before_any_update(name, bad):
    """check_batch (docs/methods.md): "a batch the supernet cannot take is one SearchError line before any update". A
    label ≥ num_classes stopped the step in cross-entropy's IndexError ("Target 10 is out of bounds") after a forward
    had moved BatchNorm's running statistics; -100 (cross-entropy's ignore_index) was silently left out of the mean
    loss. Either split's labels are checked."""
    primitives = ("skip_connect", "avg_pool_3x3", "sep_conv_3x3") if name == "sparsenas" else None
    method = _method(name, _net(7, primitives=primitives))
    before = _snapshot(method)
    good = _batch(8)
    x, y = _batch(9)
    y = y.clone()
    y[2] = bad
    for train, val in (((x, y), good), (good, (x, y))):
        with pytest.raises(NasdiagError) as info:
            method.step(train, val)
        message = str(info.value)
        assert "\n" not in message and f"[0, {CLASSES})" in message and str(bad) in message, message
        _same(before, _snapshot(method))
        assert all(p.grad is None for p in method.network.parameters())


# -- the run's shape ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("epochs", 0), ("epochs", -1), ("epochs", 2.5), ("epochs", "2"),
                                          ("steps_per_epoch", 0), ("batch_size", 0), ("world_size", 0),
                                          ("train_size", -1), ("epochs", True)])
def test_a_schedule_that_is_no_run_shape_is_one_config_error(field, value):
    """`Schedule` is "the run's shape" a hand-built method is given (docs/methods.md). It took anything: 0 epochs
    stopped the first epoch end in the cosine schedule's ZeroDivisionError, -1 epochs dropped w's learning rate from
    0.025 to its minimum 0.001 after one epoch (cosine over T_max = -1), 2.5 annealed over a fractional period, '2'
    failed inside torch's scheduler with a TypeError."""
    from nasdiag.errors import ConfigError

    fields = {"epochs": 2, "steps_per_epoch": 3, field: value}
    with pytest.raises(ConfigError) as info:
        Schedule(**fields)
    assert "\n" not in str(info.value) and field in str(info.value)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # epoch ends without steps
def test_a_valid_schedule_still_anneals_w_as_darts_cosine():
    """The check refuses nothing valid: 3 epochs of DARTS anneal w's rate as lr_min + (lr0 − lr_min)(1 + cos(πe/3))/2
    (DARTS's cosine schedule, written out here)."""
    import math

    method = get_method("darts")(_net(0), schedule=Schedule(epochs=3, steps_per_epoch=1, train_size=0, val_size=0))
    h = method.hp
    for epoch in range(3):
        want = h.w_lr_min + (h.w_lr - h.w_lr_min) * (1 + math.cos(math.pi * epoch / 3)) / 2
        assert method.w_optimizer.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12)
        method.epoch_end(epoch)


# -- SparseNAS: what a second-order step records ------------------------------------------------------------------
def test_a_second_order_sparsenas_step_records_the_loss_at_w_prime_and_the_norm_of_the_exact_hypergradient():
    """docs/sparsenas.md: with the second-order step `scalars/val_loss`/`val_acc` are at the unrolled
    w' = w − ξ(∇_w l_train(w, A) + μb + λw) (b = 0 at the first step) and `scalars/alpha_grad_norm` is ‖g‖ of eq 12
    (before the prox). Reference: w' written out here and g = d/dA l_val(w'(A), A) by autograd through w'(A), on a
    smooth supernet (tanh for ReLU) where eq 13's central difference with r = 1e-5 is within ~1e-9 of it."""
    from torch import nn
    from torch.func import functional_call
    import torch.nn.functional as F

    net = _net(11, primitives=("skip_connect", "avg_pool_3x3", "sep_conv_3x3"))
    for module in list(net.modules()):
        for child_name, child in module.named_children():
            if isinstance(child, nn.ReLU):
                setattr(module, child_name, nn.Tanh())
    method = _method("sparsenas", net, fd_eps_scale=1e-5, w_lr=0.3, w_lr_min=0.3, init_scale=0.2)
    (xt, yt), (xv, yv) = _batch(12, B=6), _batch(13, B=6)
    arch = {id(a) for a in net.arch_parameters()}
    names = [n for n, p in net.named_parameters() if id(p) not in arch]
    w0 = {n: p.detach().clone() for n, p in net.named_parameters() if id(p) not in arch}
    buffers = lambda: {n: b.clone() for n, b in net.named_buffers()}  # noqa: E731
    A = {t: a.detach().clone().requires_grad_(True) for t, a in net.alphas().items()}
    w = [w0[n].clone().requires_grad_(True) for n in names]
    loss_t = F.cross_entropy(functional_call(net, {**dict(zip(names, w)), **buffers()}, (xt, A)), yt)
    grads = torch.autograd.grad(loss_t, w, create_graph=True, allow_unused=True)
    xi, wd = 0.3, method.hp.w_weight_decay
    w1 = {n: w0[n] - xi * ((torch.zeros_like(w0[n]) if g is None else g) + wd * w0[n]) for n, g in zip(names, grads)}
    logits = functional_call(net, {**w1, **buffers()}, (xv, A))
    loss_v = F.cross_entropy(logits, yv)
    exact = torch.autograd.grad(loss_v, list(A.values()))
    stats = method.step((xt, yt), (xv, yv))
    torch.testing.assert_close(stats["scalars/val_loss"], loss_v.detach(), rtol=1e-10, atol=0)
    torch.testing.assert_close(stats["scalars/val_acc"], (logits.argmax(1) == yv).double().mean(), rtol=0, atol=0)
    norm = torch.sqrt(sum((g ** 2).sum() for g in exact))
    # first order (l_val at w) would differ from it here: the check sees which one was recorded
    loss_w = F.cross_entropy(functional_call(net, {**w0, **buffers()}, (xv, A)), yv)
    assert abs(float(loss_w.detach()) - float(loss_v.detach())) > 1e-3
    torch.testing.assert_close(stats["scalars/alpha_grad_norm"], norm.detach(), rtol=1e-7, atol=0)


@pytest.mark.parametrize("name", ["darts", "darts2", "proxyless", "sparsenas", "xnas"])
def test_a_bilevel_step_without_its_search_val_batch_is_one_line_before_any_update(name):
    """`step(train_batch, val_batch)`: a bi-level method (α on search-val) called with the training batch alone was a
    TypeError ("argument after * must be an iterable, not NoneType"); ProxylessNAS and XNAS had taken their w step
    on it by then. Single-level methods (SNAS, DSNAS, ASM-NAS) still take the training batch alone."""
    primitives = ("skip_connect", "avg_pool_3x3", "sep_conv_3x3") if name == "sparsenas" else None
    method = _method(name, _net(14, primitives=primitives))
    before = _snapshot(method)
    with pytest.raises(SearchError) as info:
        method.step(_batch(15))
    assert "\n" not in str(info.value) and "search-val" in str(info.value) and name in str(info.value)
    _same(before, _snapshot(method))
    single = _method("snas", _net(14))
    single.step(_batch(15))
    assert not single.network.alphas()["normal"].equal(_net(14).alphas()["normal"])


# -- loading a state ------------------------------------------------------------------------------------------------
def test_a_state_of_another_supernet_or_lacking_an_object_is_one_line_and_loads_nothing():
    """`load_state_dict` of a state saved from a supernet of another shape raised torch's 200-line RuntimeError
    after copying every tensor whose shape fitted (α and the classifier's bias were replaced); a state lacking one of
    the method's stateful objects was refused only after the network had been loaded."""
    small = _method("darts", _net(16))
    torch.manual_seed(17)
    wide = _method("darts", Network(4, CLASSES, 3, steps=1, multiplier=1, in_channels=1).double())
    before = _snapshot(wide)
    with pytest.raises(NasdiagError) as info:
        wide.load_state_dict(small.state_dict())
    assert "\n" not in str(info.value) and "another supernet" in str(info.value), str(info.value)[:300]
    _same(before, _snapshot(wide))

    twin = _method("darts", _net(18))
    state = copy.deepcopy(small.state_dict())
    del state["objects"]["scheduler"]
    before = _snapshot(twin)
    with pytest.raises(NasdiagError, match="lacks"):
        twin.load_state_dict(state)
    _same(before, _snapshot(twin))
    # the whole state of the same shape loads as before
    twin.load_state_dict(small.state_dict())
    _same(_snapshot(small), _snapshot(twin))


def test_proxyless_on_a_supernet_of_one_candidate_op_is_refused_when_built():
    """ProxylessNAS's α step draws two distinct paths per edge. On a supernet with one candidate op its first step
    took the w step and then stopped in torch.multinomial's RuntimeError ("cannot sample n_sample > prob_dist.size(-1)
    samples without replacement"); it is refused when the method is built."""
    with pytest.raises(SearchError) as info:
        _method("proxyless", _net(19, primitives=("sep_conv_3x3",)))
    assert "\n" not in str(info.value) and "at least 2" in str(info.value)
    method = _method("proxyless", _net(19, primitives=("skip_connect", "sep_conv_3x3")))
    stats = method.step(_batch(20), _batch(21))
    assert torch.equal(stats["sample/normal/paths"].sum(-1), torch.full((method.network.num_edges,), 2.0))


# -- nasdiag.sparse ------------------------------------------------------------------------------------------------
def test_sgl_penalty_refuses_what_eq_2_is_not_defined_for_and_prox_l1_a_threshold_of_another_shape():
    """Ω_SGL (eq 2) is a penalty for λ ≥ 0 and α ∈ [0, 1]: sgl_penalty(λ = −1) returned a negative number, α = 2 a
    value with a negative group weight λ(1 − α). prox_l1's threshold "broadcastable to z" of another shape was
    torch's RuntimeError. Each is one ConfigError line; the valid call equals eq 2 written out here."""
    import math

    from nasdiag.errors import ConfigError
    from nasdiag.sparse import prox_l1, sgl_penalty

    a = torch.tensor([[0.5, -1.0], [0.0, 2.0], [-3.0, 0.25]], dtype=torch.float64)
    groups = torch.tensor([[0, 0], [0, 0], [1, 1]])
    for lam, alpha in ((-1.0, 0.5), (1.0, 2.0), (1.0, -0.1), (float("nan"), 0.5)):
        with pytest.raises(ConfigError) as info:
            sgl_penalty(a, lam, alpha, groups)
        assert "\n" not in str(info.value)
    want = 0.3 * 0.25 * 6.75 + 0.3 * 0.75 * (math.sqrt(4) * math.sqrt(0.25 + 1 + 4) + math.sqrt(2) * math.sqrt(9 + 0.0625))
    assert float(sgl_penalty(a, 0.3, 0.25, groups)) == pytest.approx(want, rel=1e-14)
    with pytest.raises(ConfigError) as info:
        prox_l1(a, torch.ones(3))
    assert "\n" not in str(info.value) and "(3, 2)" in str(info.value)
    torch.testing.assert_close(prox_l1(a, torch.tensor([0.5, 1.0])),
                               torch.tensor([[0.0, 0.0], [0.0, 1.0], [-2.5, 0.0]], dtype=torch.float64), rtol=0, atol=0)


def _ref_prox(z, l1, group_t, groups):
    """Eq 9 then eq 10, written out element by element and group by group (float64)."""
    out = torch.where(z.abs() > l1, z - torch.sign(z) * l1, torch.zeros_like(z))
    for n in groups.unique().tolist():
        where = groups == n
        norm = float(out[where].norm())
        size = int(where.sum())
        scale = max(0.0, 1 - size ** 0.5 * float(group_t[n]) / norm) if norm > 0 else 0.0
        out[where] = out[where] * scale
    return out


@pytest.mark.parametrize("kind", ["hapg", "adamhapg"])
def test_hapg_and_adamhapg_follow_eq_6_to_10_over_five_steps_with_the_momentum_of_eq_7(kind):
    """Five steps of eq 6-10 on two parameters with their own groups, λ changed after step 2, the second parameter
    without a gradient at step 3 (it skips the step, its t does not advance). The momentum term u_{t-1}·v_{t-1} of
    eq 7 has a non-zero coefficient only from a parameter's third step on (u_t = (t − 2)/(t + 1), first step t = 2):
    earlier audits compared two steps, where it is 0. AdamHAPG: per-weight η_i in eq 9, the group's lower median η_i
    in eq 10 (sparse-supernet §Hierarchical Proximal Optimization)."""
    from nasdiag.sparse import HAPG, AdamHAPG

    g = torch.Generator().manual_seed(22)
    shapes = [(3, 4), (5,)]
    groups = [torch.tensor([[0] * 4, [0] * 4, [1] * 4]), torch.tensor([0, 0, 1, 1, 1])]
    start = [0.4 * torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    params = [torch.nn.Parameter(a.clone()) for a in start]
    lr, alpha, betas, eps = 0.3, 0.4, (0.6, 0.9), 1e-8
    lams = [0.05, 0.05, 0.2, 0.2, 0.2]
    if kind == "hapg":
        opt = HAPG([{"params": params, "groups": groups}], lr=lr, lam=lams[0], alpha=alpha)
    else:  # Adam's η_i ≈ lr/|g|: a larger λ so that the thresholds act
        lr, lams = 0.05, [10 * lam for lam in lams]
        opt = AdamHAPG([{"params": params, "groups": groups}], lr=lr, betas=betas, eps=eps, lam=lams[0], alpha=alpha)
    u = lambda t: (t - 2) / (t + 1)  # noqa: E731
    ref = [{"A": a.clone(), "v": torch.zeros_like(a), "t": 1, "m": torch.zeros_like(a), "s": torch.zeros_like(a), "n": 0}
           for a in start]
    momentum_used = zeros_seen = False
    for step, lam in enumerate(lams):
        opt.param_groups[0]["lam"] = lam
        grads = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
        if step == 2:
            grads[1] = None
        for p, grad, r, grp in zip(params, grads, ref, groups):
            p.grad = None if grad is None else grad.clone()
            if grad is None:
                continue
            r["t"] += 1
            if kind == "hapg":
                eta = torch.full_like(r["A"], lr)
                z = r["A"] - lr * grad  # eq 6
            else:
                r["n"] += 1
                r["m"] = betas[0] * r["m"] + (1 - betas[0]) * grad
                r["s"] = betas[1] * r["s"] + (1 - betas[1]) * grad * grad
                eta = lr / (1 - betas[0] ** r["n"]) / ((r["s"] / (1 - betas[1] ** r["n"])).sqrt() + eps)
                z = r["A"] - eta * r["m"]
            group_eta = {}
            for n in grp.unique().tolist():
                values = eta[grp == n].sort().values
                group_eta[n] = values[(values.numel() - 1) // 2]
            prox = _ref_prox(z, eta * lam * alpha, {n: e * lam * (1 - alpha) for n, e in group_eta.items()}, grp)
            momentum_used |= u(r["t"] - 1) != 0 and bool(r["v"].abs().sum() > 0)
            zeros_seen |= bool((prox == 0).any())
            v = prox - r["A"] + u(r["t"] - 1) * r["v"]  # eq 7
            r["A"], r["v"] = prox + u(r["t"]) * v, v  # eq 8
        opt.step()
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.detach(), r["A"], rtol=1e-12, atol=1e-14)
    assert momentum_used
    assert zeros_seen  # the thresholds acted: the prox of eq 9-10 made exact zeros (the momentum of eq 8 may move them)


def test_another_methods_hyperparameters_are_named_by_their_method_in_the_refusal():
    """Every method's dataclass is called "Hyperparameters", so "SNAS takes SNAS.Hyperparameters, got
    Hyperparameters" (for DSNAS's) did not say what was passed; the refusal names it DSNAS.Hyperparameters."""
    with pytest.raises(NasdiagError) as info:
        get_method("snas")(_net(23), get_method("dsnas").Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=1))
    assert "got DSNAS.Hyperparameters" in str(info.value) and "SNAS.Hyperparameters(" in str(info.value)


# -- SNAS: the law of the relaxed sample -----------------------------------------------------------------------------
def test_snas_relaxed_samples_follow_the_concrete_law_at_their_temperature():
    """Z = softmax((α + G)/τ), G i.i.d. Gumbel(0, 1). For K = 2, Z_1 = σ((Δ + L)/τ) with Δ = α_1 − α_2 and
    L = G_1 − G_2 ~ Logistic(0, 1), so P(Z_1 ≤ z) = σ(τ·logit(z) − Δ) (derived here). The probability integral
    transform u = σ(τ·logit(Z_1) − Δ) of the method's own draws must be Uniform(0, 1): Kolmogorov-Smirnov distance
    below 1.95/√n (the 0.1 % level; the draws are seeded, so the test is deterministic). The τ-free Gumbel-max check
    of round 4 cannot see the temperature; this one can (τ ↦ 2τ or τ/2 moves the distance to 0.32, 1.2τ to 0.10)."""
    net = _net(24, primitives=("skip_connect", "avg_pool_3x3"))
    with torch.no_grad():
        for a in net.arch_parameters():
            a.copy_(torch.randn(a.shape, generator=torch.Generator().manual_seed(25), dtype=a.dtype) * 1.5)
    method = _method("snas", net, tau0=0.4)
    tau = method.temperature
    u = []
    for _ in range(800):
        for t, z in method.forward_weights().items():
            alpha = net.alphas()[t].detach()
            delta = alpha[:, 0] - alpha[:, 1]
            u.append(torch.sigmoid(tau * torch.logit(z[:, 0]) - delta))
    u = torch.cat(u).sort().values
    n = u.numel()
    grid = torch.arange(1, n + 1, dtype=u.dtype) / n
    distance = float(torch.maximum((grid - u).abs(), (u - (grid - 1 / n)).abs()).max())
    assert distance < 1.95 / n ** 0.5, (distance, n)


@pytest.mark.parametrize("name", ["dsnas", "proxyless"])
def test_a_sampling_method_with_nan_architecture_parameters_is_one_search_error_before_any_update(name):
    """DSNAS and ProxylessNAS sample from p = softmax(α): with a NaN in α (a diverged search, a state loaded from
    one) the step stopped in torch.multinomial's RuntimeError ("probability tensor contains either inf, nan or
    element < 0"); SNAS, DARTS2 and SparseNAS stop such a step with a SearchError. It is one SearchError naming the
    cell type and edge, before any update."""
    method = _method(name, _net(26))
    with torch.no_grad():
        method.network.alphas()["reduce"][1, 2] = float("nan")
    before = _snapshot(method)
    with pytest.raises(SearchError) as info:
        method.step(_batch(27), _batch(28))
    message = str(info.value)
    assert "\n" not in message and "reduce" in message and "[1]" in message and "sampled" in message, message
    after = _snapshot(method)
    for key in ("alphas_normal", "alphas_reduce"):  # the NaN is kept where it was (NaN ≠ NaN for torch.equal)
        torch.testing.assert_close(after["net"].pop(key), before["net"].pop(key), rtol=0, atol=0, equal_nan=True)
    _same(before, after)


def test_sparsenas_builds_and_steps_on_an_adapted_darts_convention_supernet():
    """docs/methods.md: "To search a supernet of your own with any registered method, build the method on it"
    (`nasdiag.search.supernet.adapt`). SparseNAS read `network.edge_nodes`, which the adapted supernet does not have:
    its build stopped in an AttributeError. Its node groups (eq 2) are those of the DARTS edge order, written out
    here: node n = 2, 3, ... receives n edges, group n − 2."""
    from test_foreign_supernet import batch, foreign_supernet

    net, _ = foreign_supernet(3)
    method = _method("sparsenas", net, first_order=True, alpha_lr=0.05)
    want = torch.tensor([n for n in range(net.steps) for _ in range(n + 2)])
    for cell_type in net.alphas():
        groups = method.node_groups(cell_type)
        assert torch.equal(groups, want.unsqueeze(1).expand_as(groups))
    before = {t: a.detach().clone() for t, a in net.alphas().items()}
    stats = method.step(batch(4), batch(5))
    assert torch.isfinite(stats["scalars/val_loss"])
    assert all(not torch.equal(before[t], a) for t, a in net.alphas().items())


def test_bayesnas_builds_and_runs_an_epoch_on_an_adapted_darts_convention_supernet():
    """The same for BayesNAS (its parent matrix of A.2.14 read `network.edge_nodes`: AttributeError at the build). Its
    parent matrix equals the one it builds on nasdiag's own supernet of the same steps (both in the DARTS edge order);
    with a curvature mode the DARTS-convention mixed op can take (diag), an epoch runs to its update."""
    from test_foreign_supernet import batch, foreign_supernet

    net, _ = foreign_supernet(3)
    cls = get_method("bayesnas")
    method = cls(net, cls.Hyperparameters(hessian_mode="diag"), schedule=Schedule(epochs=2, steps_per_epoch=2))
    own = cls(Network(2, CLASSES, 3, steps=net.steps, multiplier=net.multiplier, in_channels=1),
              schedule=Schedule(epochs=2, steps_per_epoch=2))
    assert torch.equal(method._parents.cpu(), own._parents.cpu())
    for i in range(2):
        stats = method.step(batch(6 + i), batch(8 + i))
    method.epoch_end(0)
    assert torch.isfinite(stats["scalars/train_loss"]) and method.genotype().normal


@pytest.mark.parametrize("name", ["darts2", "sparsenas"])
def test_arch_gradient_checks_its_batches_as_the_step_does(name):
    """`arch_gradient(train_batch, val_batch)` (docs/darts2.md: the hypergradient the next step would apply) took
    batches step() refuses: float32 inputs on a float64 supernet stopped in the convolution's RuntimeError, a label
    past the classifier in cross-entropy's IndexError. One SearchError line each, as from step()."""
    primitives = ("skip_connect", "avg_pool_3x3", "sep_conv_3x3") if name == "sparsenas" else None
    method = _method(name, _net(29, primitives=primitives))
    good = _batch(30)
    x, y = _batch(31)
    for bad in ((x.float(), y), (x, torch.full_like(y, CLASSES))):
        for train, val in ((bad, good), (good, bad)):
            with pytest.raises(SearchError) as info:
                method.arch_gradient(train, val)
            assert "\n" not in str(info.value)
    assert all(torch.isfinite(g).all() for g in method.arch_gradient(good, _batch(32)).values())
