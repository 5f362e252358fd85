"""Audit round 4 of the search methods, against references written here in float64.

- Second-order DARTS (DARTS eq 7-8, sparse-supernet eq 11-13): the finite-difference hypergradient against the exact
  derivative of L_val(w'(α), α) by autograd through one virtual step, with w' checked first against a real step of a
  copy of w's SGD optimizer (its momentum buffer and weight decay); the error falls like ε² (central differences),
  also with frozen weights in the supernet.
- SNAS / DSNAS statistics over many draws of the method's own sampler: Gumbel-max of the relaxed sample is Cat(p),
  and the DSNAS estimator's mean over one-hot samples is Σ_k p_k C(e_k)(e_k − p), the expectation of the score
  function scaled by the sampled op's cost, enumerated here.
- The Python API's misuse: ``SearchConfig``/``run`` and a method built by hand with values of the wrong type, the
  hyperparameters of another method, a schedule that is not a ``Schedule``, batches of the wrong shape: one
  ``NasdiagError`` line each.

Defects these tests found (each fails without its fix): the unrolled step moved frozen weights (requires_grad=False)
that w's optimizer never moves, so darts2/sparsenas followed the hypergradient of another problem (rel. error 0.24);
``SearchConfig(force="no")`` was truthy and replaced an existing record, ``hp``/``diagnostics``/``record`` of the
wrong type were TypeError/ValueError tracebacks; a method took another method's hyperparameters (SNAS's for DARTS)
and ignored their extra fields, a dict schedule, a non-integer seed or an unknown hessian_mode without a clear line;
a batch of the wrong channels, dtype, label shape or length reached torch's RuntimeError/ValueError inside the
step; ``run(dict)`` was an AttributeError.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from nasdiag.errors import NasdiagError
from nasdiag.search import Schedule, SearchConfig, get_method
from nasdiag.supernet import Network
from test_method_darts2 import smooth as _smooth  # ReLU -> tanh, max -> avg pooling: smooth in w, so ε² convergence

SMOOTH = ("none", "skip_connect", "avg_pool_3x3", "sep_conv_3x3")


def _batch(gen, B=6):
    return torch.randn(B, 1, 8, 8, generator=gen, dtype=torch.float64), torch.randint(0, 5, (B,), generator=gen)


def _virtual_step(net, opt, alphas, x, y):
    """w'(α) = w − ξ(∇_w L_train + λ w + μ b), the trainable weights only (a differentiable function of α);
    ``{name: tensor}``. ξ, λ, μ and b are read from ``opt`` (torch SGD, one group)."""
    group = opt.param_groups[0]
    xi, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
    arch = {id(a) for a in net.arch_parameters()}
    named = [(n, p) for n, p in net.named_parameters() if id(p) not in arch and p.requires_grad]
    leaves = [p.detach().clone().requires_grad_(True) for _, p in named]
    buffers = {n: b.clone() for n, b in net.named_buffers()}
    z = {t: torch.softmax(a, -1) for t, a in alphas.items()}
    loss = F.cross_entropy(functional_call(net, {**dict(zip([n for n, _ in named], leaves)), **buffers}, (x, z)), y)
    grads = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
    out = {}
    for (n, p), w, g in zip(named, leaves, grads):
        g = torch.zeros_like(w) if g is None else g
        b = opt.state[p]["momentum_buffer"] if p in opt.state else torch.zeros_like(w)
        out[n] = w.detach() - xi * (g + wd * w.detach() + mu * b)
    return out


def _exact_hypergradient(net, opt, train, val):
    """d/dα L_val(w'(α), α) by autograd through the virtual step, and w' itself (detached)."""
    alphas = {t: a.detach().clone().requires_grad_(True) for t, a in net.alphas().items()}
    w1 = _virtual_step(net, opt, alphas, *train)
    z = {t: torch.softmax(a, -1) for t, a in alphas.items()}
    buffers = {n: b.clone() for n, b in net.named_buffers()}
    loss = F.cross_entropy(functional_call(net, {**w1, **buffers}, (val[0], z)), val[1])
    grads = torch.autograd.grad(loss, list(alphas.values()))
    return dict(zip(alphas, grads)), {n: w.detach() for n, w in w1.items()}


def _rel(a, b):
    num = sum(((a[t] - b[t]) ** 2).sum() for t in b).sqrt()
    return float(num / sum((b[t] ** 2).sum() for t in b).sqrt())


@pytest.mark.parametrize("frozen", [False, True], ids=["all-trained", "frozen-stem"])
def test_darts2_hypergradient_against_autograd_through_the_virtual_sgd_step(frozen):
    torch.manual_seed(0)
    net = _smooth(Network(4, 5, 3, steps=2, multiplier=2, in_channels=1, primitives=SMOOTH).double())
    if frozen:  # a user's pretrained stem: w's optimizer never moves it, so neither may the virtual step
        for p in net.stem.parameters():
            p.requires_grad_(False)
    with torch.no_grad():
        for a in net.arch_parameters():
            a.normal_(0, 0.5)
    cls = get_method("darts2")
    method = cls(net, cls.Hyperparameters(w_lr=0.5, w_lr_min=0.5, w_weight_decay=3e-2, grad_clip=1e9),
                 schedule=Schedule(epochs=2, steps_per_epoch=4, batch_size=6))
    gen = torch.Generator().manual_seed(1)
    method.step(_batch(gen), _batch(gen))  # fills w's momentum buffers: the virtual step must use them
    train, val = _batch(gen), _batch(gen)
    exact, w1 = _exact_hypergradient(net, method.w_optimizer, train, val)

    # the virtual step is a real step of w's optimizer (a copy; unclipped, as DARTS's architect unrolls it)
    twin = copy.deepcopy(net)
    opt = torch.optim.SGD(twin.weight_parameters(), lr=0.5, momentum=0.9, weight_decay=3e-2)
    opt.load_state_dict(copy.deepcopy(method.w_optimizer.state_dict()))  # loading aliases the momentum buffers
    F.cross_entropy(twin(train[0], {t: torch.softmax(a.detach(), -1) for t, a in twin.alphas().items()}), train[1]).backward()
    opt.step()
    moved = dict(twin.named_parameters())
    assert max(float((moved[n].detach() - w).abs().max()) for n, w in w1.items()) < 1e-12
    if frozen:
        assert all(torch.equal(p, q) for p, q in zip(twin.stem.parameters(), net.stem.parameters()))

    first_order = method._unrolled(train, val).val_grad
    assert _rel(first_order, exact) > 1e-2  # the implicit term matters here, so the comparison tests it
    errors = []
    for r in (1e-2, 1e-3):
        method.hp.fd_eps_scale = r
        errors.append(_rel(method.arch_gradient(train, val), exact))
    # DARTS eq 8 is a central difference: O(ε²), 100x per decade of ε (measured r = 1e-2, 1e-3: 4.9e-4, 4.9e-6;
    # frozen stem 2.2e-4, 2.2e-6; first order 0.64 / 0.45)
    assert errors[0] < 1e-3 and errors[1] < errors[0] / 30, errors


def test_darts2_hypergradient_takes_the_virtual_weights_also_through_the_fast_engine():
    """The unrolled forwards evaluate the supernet at w', w⁺ and w⁻ with ``functional_call``; on the default ReLU
    supernet they run on the batched fast engine, which must read those weights, not the module's own: the
    hypergradient equals that of an eager copy (the smooth supernet above runs eager, so it does not cover this)."""
    from nasdiag.supernet.engine import fast

    torch.manual_seed(0)
    net = Network(2, 5, 3, steps=2, multiplier=2, in_channels=1).double()
    with torch.no_grad():
        for a in net.arch_parameters():
            a.normal_(0, 0.5)
    gen = torch.Generator().manual_seed(1)
    cls = get_method("darts2")
    method = cls(net, cls.Hyperparameters(w_lr=0.5, w_lr_min=0.5), schedule=Schedule(epochs=2, steps_per_epoch=4, batch_size=6))
    method.step(_batch(gen), _batch(gen))
    train, val = _batch(gen), _batch(gen)
    assert fast.why_not_fast(net, train[0], net._cell_weights(method.probabilities()), None) is None  # the fast path
    eager = copy.deepcopy(method)
    eager.network.set_engine("eager")
    fast_grad, eager_grad = method.arch_gradient(train, val), eager.arch_gradient(train, val)
    assert _rel(fast_grad, eager_grad) < 1e-12  # measured 1.4e-14 absolute
    assert _rel(method._unrolled(train, val).val_grad, eager_grad) > 1e-2  # the implicit term is not negligible


def test_snas_gumbel_max_of_its_relaxed_samples_is_categorical_p():
    """Gumbel-max: argmax_k (α_k + G_k) ~ Cat(softmax(α)); the relaxed sample softmax((α + G)/τ) has the same argmax
    at every τ. Over 4000 draws of the method's own sampler each frequency is within 5 binomial sd of p."""
    torch.manual_seed(0)
    net = Network(2, 10, 3, steps=1, multiplier=1, in_channels=1, primitives=SMOOTH).double()
    cls = get_method("snas")
    method = cls(net, cls.Hyperparameters(tau0=0.3), schedule=Schedule(epochs=1, steps_per_epoch=1))
    with torch.no_grad():
        for a in net.arch_parameters():
            a.copy_(torch.tensor([[-1.0, 0.0, 0.7, 1.5]]).expand_as(a) + torch.arange(a.shape[0]).unsqueeze(1) * 0.3)
    n = 4000
    counts = {t: torch.zeros_like(a) for t, a in net.alphas().items()}
    for _ in range(n):
        for t, z in method.forward_weights().items():
            assert torch.allclose(z.sum(-1), torch.ones(z.shape[0], dtype=z.dtype))
            counts[t] += F.one_hot(z.argmax(-1), z.shape[-1]).to(z.dtype)
    for t, a in net.alphas().items():
        p = torch.softmax(a.detach(), -1)
        sd = (p * (1 - p) / n).sqrt()
        assert float(((counts[t] / n - p).abs() / sd).max()) < 5


def test_dsnas_alpha_gradient_is_the_credit_of_its_child_and_its_mean_over_children_the_expectation():
    """DSNAS's α-gradient for a sampled one-hot child Z is (Z·C(Z))(Z − p), C(Z) the cost ∂L/∂Z at that child (wiring
    supplement §2: the credit is the sampled op's cost, the score function ∇_α log p(Z) = Z − p). Enumerated here
    over all 3^4 children by autograd: each of 30 steps' α.grad (w and α held: lr 1e-300, BN buffers restored) is
    the term of the child the step recorded, so the estimator's mean is Σ_children P(child)·term, its expectation
    under the sampler (Cat(p) per edge: test_audit_methods_round2.test_samplers_draw_from_p)."""
    import itertools

    torch.manual_seed(0)
    ops = ("skip_connect", "avg_pool_3x3", "sep_conv_3x3")
    net = Network(2, 10, 3, steps=1, multiplier=1, in_channels=1, primitives=ops).double()
    cls = get_method("dsnas")
    hp = cls.Hyperparameters(w_lr=1e-300, w_lr_min=0.0, alpha_lr=1e-300, alpha_weight_decay=0.0)
    method = cls(net, hp, schedule=Schedule(epochs=1, steps_per_epoch=1))
    with torch.no_grad():
        for a in net.arch_parameters():
            a.copy_(torch.randn(a.shape) * 0.7)
    x, y = torch.randn(4, 1, 8, 8, dtype=torch.float64), torch.randint(0, 10, (4,))
    probs = {t: torch.softmax(a.detach(), -1) for t, a in net.alphas().items()}
    types, K = list(probs), len(ops)
    E = probs[types[0]].shape[0]
    state = copy.deepcopy(net.state_dict())

    term, chance = {}, {}
    for choice in itertools.product(range(K), repeat=E * len(types)):
        idx = torch.tensor(choice).reshape(len(types), E)
        child = {t: F.one_hot(idx[i], K).double() for i, t in enumerate(types)}
        leaves = {t: z.clone().requires_grad_(True) for t, z in child.items()}
        cost = dict(zip(leaves, torch.autograd.grad(F.cross_entropy(net(x, leaves), y), list(leaves.values()))))
        net.load_state_dict(state)
        chance[choice] = float(torch.prod(torch.stack([(probs[t] * child[t]).sum(-1).prod() for t in types])))
        term[choice] = {t: (child[t] * cost[t]).sum(-1, keepdim=True) * (child[t] - probs[t]) for t in types}
    assert abs(sum(chance.values()) - 1) < 1e-12
    expectation = {t: sum(chance[c] * term[c][t] for c in term) for t in types}
    assert all(float(v.abs().max()) > 1e-4 for v in expectation.values())  # a gradient worth comparing

    seen = set()
    for _ in range(30):
        stats = method.step((x, y))
        choice = tuple(int(k) for t in types for k in stats[f"sample/{t}/onehot"].argmax(-1))
        seen.add(choice)
        for t, a in net.alphas().items():
            assert torch.allclose(a.grad, term[choice][t], rtol=1e-9, atol=1e-13), (t, choice)
        net.load_state_dict(state)
    assert len(seen) > 5  # the steps drew different children


# -- the Python API's misuse -----------------------------------------------------------------------------------------

def _refused(make, *words):
    with pytest.raises(NasdiagError) as info:
        make()
    text = str(info.value)
    assert "\n" not in text and all(w in text for w in words), text


@pytest.mark.parametrize("field, value, words", [
    ("hp", None, ("hp", "mapping")),
    ("hp", "w_lr=0.1", ("hp", "mapping")),
    ("diagnostics", 3, ("diagnostics",)),
    ("diagnostics", None, ("diagnostics",)),
    ("record", 5, ("record",)),
    ("figures", 5, ("figures",)),
    ("force", "no", ("force", "True or False")),
    ("resume", "yes", ("resume", "True or False")),
    ("progress", 3, ("progress", "True or False")),
])
def test_search_config_fields_of_the_wrong_type_are_one_line(field, value, words):
    from nasdiag.search import run

    _refused(lambda: run(SearchConfig(**{field: value})), *words)


def test_run_refuses_what_is_not_a_search_config():
    from nasdiag.search import run

    _refused(lambda: run({"method": "darts"}), "SearchConfig.from_dict")
    _refused(lambda: run("darts"), "SearchConfig")


@pytest.mark.slow  # one real search (~10 s on 2 busy cores) makes the record to keep
def test_a_string_force_never_replaces_a_record(tmp_path):
    """``force="no"`` was truthy: check_paths let it through and the run replaced the existing record."""
    from nasdiag.search import run

    record = tmp_path / "run.h5"
    run(SearchConfig(record=str(record), epochs=1, C=2, layers=3, steps=1, batch_size=300, diagnostics=(),
                     device="cpu", progress=False, threads=1))
    kept = record.read_bytes()
    _refused(lambda: run(SearchConfig(record=str(record), force="no", epochs=1, C=2, layers=3, steps=1, batch_size=300,
                                      diagnostics=(), device="cpu", progress=False, threads=1)), "force")
    assert record.read_bytes() == kept


def test_a_method_built_by_hand_refuses_what_it_cannot_use():
    net = Network(2, 10, 3, steps=1, multiplier=1, in_channels=1)
    S = Schedule(epochs=1, steps_per_epoch=1)
    darts, snas = get_method("darts"), get_method("snas")
    _refused(lambda: darts(net, snas.Hyperparameters(), schedule=S), "tau0", "snas")  # SNAS's fields, ignored by DARTS
    _refused(lambda: darts(net, {"w_lr": 0.1}, schedule=S), "Hyperparameters")
    _refused(lambda: darts(net, schedule={"epochs": 1}), "Schedule")
    _refused(lambda: darts(net, schedule=S, seed="a"), "seed")
    _refused(lambda: darts(net, schedule=S, hessian_mode="bogus"), "hessian_mode")


@pytest.mark.parametrize("name", ["darts", "darts2", "snas", "dsnas", "proxyless", "xnas", "sparsenas", "bayesnas", "asmnas"])
def test_a_batch_the_supernet_cannot_take_is_one_line_before_any_update(name):
    net = Network(2, 10, 3, steps=1, multiplier=1, in_channels=1)
    method = get_method(name)(net, schedule=Schedule(epochs=1, steps_per_epoch=2, batch_size=4))
    before = copy.deepcopy(net.state_dict())
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    for bad in ((torch.randn(4, 3, 8, 8), y), (x, y[:3]), (x, y.float()), (x.double(), y), (x, y.unsqueeze(1)), (x[:0], y[:0])):
        with pytest.raises(NasdiagError) as info:
            method.step(bad, bad)
        assert "\n" not in str(info.value)
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("name, module, primitive", [
    ("darts", "nasdiag.search.methods.darts", "darts_alpha_grad"),
    ("darts2", "nasdiag.search.methods.darts2", "darts_alpha_grad"),
    ("darts2", "nasdiag.search.methods.darts2", "unrolled_gradient"),
    ("snas", "nasdiag.search.methods.snas", "snas_alpha_grad"),
    ("dsnas", "nasdiag.search.methods.dsnas", "dsnas_alpha_grad"),
    ("proxyless", "nasdiag.search.methods.proxyless", "proxyless_alpha_grad"),
    ("xnas", "nasdiag.search.methods.xnas", "xnas_reward"),
    ("sparsenas", "nasdiag.search.methods.sparsenas", "unrolled_gradient"),
    ("bayesnas", "nasdiag.search.methods.bayesnas", "group_bayes_update"),
    ("bayesnas", "nasdiag.hessian", "arch_diag_hessian"),
])
def test_each_method_consumes_the_library_primitive_it_promises(name, module, primitive, monkeypatch):
    """The α gradients, rewards, curvature and Bayesian updates come from the primitives (`nasdiag.cost`, `.regret`,
    `.hessian`, `.bayes`, the unrolled step), not from a private copy that could drift from them: a spy in place of
    the primitive is called by one step, and what it returned is what the method applied (α.grad for the gradient
    maps)."""
    import importlib

    target = importlib.import_module(module)
    original, returned = getattr(target, primitive), []

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        returned.append(out)
        return out

    monkeypatch.setattr(target, primitive, spy)
    net = Network(2, 10, 3, steps=1, multiplier=1, in_channels=1).double()
    cls = get_method(name)
    hp = cls.Hyperparameters(update_every=1) if name == "bayesnas" else None
    method = cls(net, hp, schedule=Schedule(epochs=1, steps_per_epoch=1, batch_size=4))
    gen = torch.Generator().manual_seed(0)
    batch = lambda: (torch.randn(4, 1, 8, 8, generator=gen, dtype=torch.float64), torch.randint(0, 10, (4,), generator=gen))  # noqa: E731
    method.step(batch(), batch())
    assert returned, f"{name} never called {module}.{primitive}"
    if primitive.endswith("_alpha_grad"):  # one call per cell type (darts2: 3 per type), the last ones applied
        applied = returned[-len(net.alphas()):] if name != "darts2" else None
        if applied is not None:
            for a, g in zip(net.alphas().values(), applied):
                assert torch.equal(a.grad, g)
