"""Audit round 11 of the search methods: the "runs and methods" and "search methods" contracts against an auditor's
own float64 arithmetic (references written here from the papers and plain torch; no nasdiag helper computes one).

Defects these tests found (each fails without its fix):

- every method recorded ``scalars/w_lr`` (and SparseNAS ``sparsity/lambda``) as a float32 tensor, so a float64 run
  stored its learning rate rounded to 24 bits (0.013 as 0.013000000268…) and a λ past 3.4e38 as inf, although the
  vocabulary's ``float32`` means the run's float dtype (docs/schema.md);
- a hyperparameter given as a Python int past 1.8e308 was float()'s OverflowError traceback in ``from_dict`` (so in
  ``run``) and was accepted by the dataclass (the method then overflowed in its first step);
- the vocabulary (docs/schema.md) gave XNAS's regret statistics (log_weights, regret, bound, gamma, rewards) and its
  ``scalars/active_fraction`` and ``reward_clip_fraction`` the run's dtype, but they are float64 in every run (the
  forecasters are float64), so a float32 run's record disagreed with its own schema;
- a Python int given for a float hyperparameter by hand (``alpha_betas=(0, 0.999)``) passed the checks and stopped the
  method's build in torch.optim.Adam's ValueError ("betas must be either both floats or both Tensors");
- ``load_state_dict`` of a state of another configuration: SparseNAS's HAPG state was taken by an AdamHAPG method
  (its next step a KeyError traceback), and XNAS's forecasters of another ζ refused theirs only after the network had
  been replaced (a half-loaded method); a dict without the generator, objects or network was a KeyError traceback
  (for the generator after everything else had been loaded), a string an AttributeError;
- ``cost()`` (the cost service of docs/methods.md) took mixing weights it cannot use into a KeyError, TypeError or
  torch RuntimeError traceback, or the network's ValueError after the stem's BatchNorm had taken the batch;
- ``evaluate(loader)`` with a label past the classifier or images of other channels was a torch traceback;
  ``extend_schedule`` to fewer epochs than the run's shrank its schedule silently, and a string was a TypeError;
  ``curvature(x, y)`` of images of other channels or dtype was a torch RuntimeError traceback; ``probe=`` given
  what is not a probe (a path string) was an AttributeError traceback.
"""

from __future__ import annotations

import math

import pytest
import torch

from nasdiag.search import Schedule, get_method
from nasdiag.search.registry import available_methods
from nasdiag.supernet import Network

CLASSES = 3
PRIMS = ("none", "skip_connect", "max_pool_3x3", "sep_conv_3x3")


def _net(cls, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    prims = cls.primitives[:4] if cls.primitives else PRIMS
    return Network(4, CLASSES, 3, steps=2, multiplier=2, in_channels=1, primitives=prims).to(dtype)


def _batches(n, seed, B=4, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, 1, 6, 6, generator=g, dtype=dtype), torch.randint(0, CLASSES, (B,), generator=g))
            for _ in range(n)]


def _cosine(lr0, lr_min, epoch, epochs):
    return lr_min + (lr0 - lr_min) * (1 + math.cos(math.pi * epoch / epochs)) / 2


def _builtin_methods():
    """The built-in methods' names: a test module imported earlier in this process may have registered its own
    (test_run_nan.py's 'nan-at-step-3', which has no w_lr)."""
    names = sorted(n for n, c in available_methods().items() if c.__module__.startswith("nasdiag.search.methods."))
    assert len(names) >= 9, names
    return names


# -- the recorded host numbers are in the run's dtype -----------------------------------------------------------
@pytest.mark.parametrize("name", _builtin_methods())
def test_the_recorded_learning_rate_is_the_rate_of_the_step_in_the_runs_dtype(name):
    """After an epoch end of a 3-epoch run, w's rate is the cosine value lr_min + (lr0 − lr_min)(1 + cos(π/3))/2, which
    float32 cannot hold. The step's ``scalars/w_lr`` is that number in float64 (to the last bits of the cosine's
    recursion, 4 ulp) in a float64 run, and float32 in a float32 run (the vocabulary's float32 = the run's dtype)."""
    cls = get_method(name)
    h = cls.Hyperparameters()
    data = _batches(4, 3)
    net = _net(cls)
    method = cls(net, h, schedule=Schedule(epochs=3, steps_per_epoch=1, batch_size=4))
    method.step(*data[:2])
    method.epoch_end(0)
    stats = method.step(*data[2:])
    want = _cosine(h.w_lr, h.w_lr_min, 1, 3)
    assert float(torch.tensor(want, dtype=torch.float32)) != want  # the comparison below can fail
    assert stats["scalars/w_lr"].dtype == torch.float64
    assert float(stats["scalars/w_lr"]) == pytest.approx(want, rel=1e-15, abs=0)
    small = cls(_net(cls, dtype=torch.float32), h, schedule=Schedule(epochs=3, steps_per_epoch=1, batch_size=4))
    x, y = _batches(1, 4, dtype=torch.float32)[0]
    assert small.step((x, y), (x, y))["scalars/w_lr"].dtype == torch.float32


def test_sparsenas_records_its_progressive_lambda_in_the_runs_dtype():
    """λ = lambda_step · (epochs done + 1) (sparse-supernet "pathwise" λ): after one epoch end, 2·0.03 = 0.06 in float64,
    and a λ beyond float32's range (lambda_step = 1e300) is the finite number it is, not inf."""
    cls = get_method("sparsenas")
    data = _batches(4, 5)
    for step, want in ((0.03, 0.06), (1e300, 2e300)):
        method = cls(_net(cls), cls.Hyperparameters(lambda_step=step, first_order=True),
                     schedule=Schedule(epochs=3, steps_per_epoch=1, batch_size=4))
        method.step(*data[:2])
        method.epoch_end(0)
        lam = method.step(*data[2:])["sparsity/lambda"]
        assert lam.dtype == torch.float64 and float(lam) == want


# -- second-order DARTS over several steps: DARTS's architect.py transcribed ------------------------------------
SMOOTH = ("none", "skip_connect", "avg_pool_3x3", "sep_conv_3x3")


class DartsArchitect:
    """The DARTS code's second-order search loop, written here on a copy of the supernet as a function of (w, α):
    ``architect._compute_unrolled_model`` (w' = w − ξ(∇_w L_train + μ·b + λw), b = 0 before w's first step, as its
    ``try/except``), ``_hessian_vector_product`` (R = r/‖∇_w' L_val‖, (∇_α L_train(w + Rv) − ∇_α L_train(w − Rv))/(2R)),
    ``g = ∇_α L_val(w') − ξ·that``, Adam on α (L2 weight decay), then ``train()``'s w step: clip the gradient norm,
    momentum SGD with weight decay. ∇_α by autograd through softmax; everything float64."""

    def __init__(self, net, h):
        import copy

        self.net, self.h = copy.deepcopy(net), h
        arch = {id(a) for a in self.net.arch_parameters()}
        self.w = {n: p.detach().clone() for n, p in self.net.named_parameters() if id(p) not in arch}
        self.alpha = {t: a.detach().clone() for t, a in self.net.alphas().items()}
        self.buf, self.adam, self.lr = None, {}, h.w_lr

    def loss(self, w, alpha, batch):
        from torch.func import functional_call

        x, y = batch
        buffers = {n: b.clone() for n, b in self.net.named_buffers()}
        z = {t: self.mix(a) for t, a in alpha.items()}
        return torch.nn.functional.cross_entropy(functional_call(self.net, {**w, **buffers}, (x, z)), y)

    @staticmethod
    def mix(alpha):
        """Z(α): DARTS's softmax."""
        return torch.softmax(alpha, -1)

    def arch_update(self, g):
        """α ← torch.optim.Adam(weight_decay=...) as DARTS builds it, on the hypergradient g."""
        h = self.h
        b1, b2 = h.alpha_betas
        for t, a in self.alpha.items():
            d = g[t] + h.alpha_weight_decay * a
            m, v, k = self.adam.get(t, (torch.zeros_like(a), torch.zeros_like(a), 0))
            m, v, k = b1 * m + (1 - b1) * d, b2 * v + (1 - b2) * d * d, k + 1
            self.adam[t] = (m, v, k)
            self.alpha[t] = a - h.alpha_lr * (m / (1 - b1 ** k)) / ((v / (1 - b2 ** k)).sqrt() + 1e-8)

    def grads(self, w, alpha, batch, wrt):
        w = {n: t.detach().clone().requires_grad_(wrt == "w") for n, t in w.items()}
        alpha = {t: a.detach().clone().requires_grad_(wrt == "alpha") for t, a in alpha.items()}
        leaves = w if wrt == "w" else alpha
        loss = self.loss(w, alpha, batch)
        return loss.detach(), dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))

    def step(self, train, val):
        h, xi = self.h, self.lr
        # architect.step(unrolled=True) with eta = the current lr of w
        unrolled_loss, gw = self.grads(self.w, self.alpha, train, "w")
        moment = {n: torch.zeros_like(t) for n, t in self.w.items()} if self.buf is None else \
            {n: h.w_momentum * b for n, b in self.buf.items()}
        w1 = {n: self.w[n] - xi * (moment[n] + gw[n] + h.w_weight_decay * self.w[n]) for n in self.w}
        w1 = {n: t.detach().clone().requires_grad_(True) for n, t in w1.items()}
        alpha = {t: a.clone().requires_grad_(True) for t, a in self.alpha.items()}
        val_loss = self.loss(w1, alpha, val)
        both = torch.autograd.grad(val_loss, list(alpha.values()) + list(w1.values()))
        dalpha, vector = dict(zip(alpha, both[:len(alpha)])), dict(zip(w1, both[len(alpha):]))
        R = h.fd_eps_scale / torch.sqrt(sum((v ** 2).sum() for v in vector.values()))
        _, gp = self.grads({n: self.w[n] + R * vector[n] for n in self.w}, self.alpha, train, "alpha")
        _, gn = self.grads({n: self.w[n] - R * vector[n] for n in self.w}, self.alpha, train, "alpha")
        implicit = {t: (gp[t] - gn[t]) / (2 * R) for t in self.alpha}
        g = {t: dalpha[t] - xi * implicit[t] for t in self.alpha}
        norm_of = lambda d: torch.sqrt(sum((v ** 2).sum() for v in d.values()))  # noqa: E731
        self.arch_update(g)
        # train(): w step at the new α, clip_grad_norm then SGD(momentum, weight_decay)
        train_loss, gw = self.grads(self.w, self.alpha, train, "w")
        norm = torch.sqrt(sum((g_ ** 2).sum() for g_ in gw.values()))
        scale = torch.clamp(h.grad_clip / (norm + 1e-6), max=1.0)
        d = {n: gw[n] * scale + h.w_weight_decay * self.w[n] for n in self.w}
        self.buf = d if self.buf is None else {n: h.w_momentum * self.buf[n] + d[n] for n in self.w}
        self.w = {n: self.w[n] - xi * self.buf[n] for n in self.w}
        return {"val_loss": val_loss.detach(), "fd_eps": R, "train_loss": train_loss, "unrolled_train_loss": unrolled_loss,
                "alpha_grad_norm": norm_of(g), "implicit_grad_norm": xi * norm_of(implicit)}


def test_darts2_five_steps_over_an_epoch_end_follow_dartss_architect_step_by_step():
    """Five second-order steps (3 epochs of 2 steps, cut after the 5th) against DartsArchitect above: α, w, the
    recorded ε (``scalars/fd_eps`` = r/‖∇_w' L_val‖), ``scalars/val_loss`` (at w'), ``scalars/unrolled_train_loss`` (at
    w), ``scalars/alpha_grad_norm`` (‖g‖ before Adam), ``scalars/implicit_grad_norm`` (ξ‖finite difference‖) and
    ``scalars/w_lr`` (ξ) after EVERY step, so the state carried between steps (w's momentum buffers in w' and in the w step, Adam's moments and
    bias corrections of α, ξ following the cosine after the epoch end) is held to the paper's code. ξ = 0.3 and a
    clip that binds make the second-order term, the momentum and the clip each matter (checked)."""
    cls = get_method("darts2")
    h = cls.Hyperparameters(w_lr=0.3, w_lr_min=0.01, grad_clip=0.5, alpha_lr=0.05)
    torch.manual_seed(2)
    net = Network(4, CLASSES, 3, steps=2, multiplier=2, in_channels=1, primitives=SMOOTH).double()
    with torch.no_grad():
        for a in net.arch_parameters():
            a.normal_(0, 0.5)
    method = cls(net, h, schedule=Schedule(epochs=3, steps_per_epoch=2, batch_size=4))
    ref = DartsArchitect(net, h)
    data = _batches(10, 7)
    moved = []
    for k in range(5):
        if k in (2, 4):
            method.epoch_end(k // 2 - 1)
            ref.lr = _cosine(h.w_lr, h.w_lr_min, k // 2, 3)
        train, val = data[2 * k], data[2 * k + 1]
        alpha_before = {t: a.detach().clone() for t, a in net.alphas().items()}
        stats = method.step(train, val)
        want = ref.step(train, val)
        for t, a in net.alphas().items():
            torch.testing.assert_close(a.detach(), ref.alpha[t], rtol=1e-9, atol=1e-12, msg=lambda m: f"step {k} α {t}: {m}")
            moved.append(float((a.detach() - alpha_before[t]).abs().max()))
        for n, p in net.named_parameters():
            if n in ref.w:
                torch.testing.assert_close(p.detach(), ref.w[n], rtol=1e-9, atol=1e-12, msg=lambda m: f"step {k} {n}: {m}")
        for key, rtol in (("fd_eps", 1e-12), ("val_loss", 1e-12), ("train_loss", 1e-12), ("unrolled_train_loss", 1e-12),
                          ("alpha_grad_norm", 1e-9), ("implicit_grad_norm", 1e-8)):
            torch.testing.assert_close(stats[f"scalars/{key}"], want[key], rtol=rtol, atol=0, msg=lambda m: f"step {k} {key}: {m}")
        assert float(stats["scalars/w_lr"]) == pytest.approx(ref.lr, rel=1e-14)
        assert float(stats["scalars/implicit_grad_norm"]) > 1e-3 * float(stats["scalars/alpha_grad_norm"])
    assert min(moved) > 1e-3
    assert method.w_optimizer.param_groups[0]["lr"] < h.w_lr  # the cosine moved ξ


# -- hyperparameters past the float range ------------------------------------------------------------------------
@pytest.mark.parametrize("build", [
    lambda: get_method("darts").Hyperparameters.from_dict({"w_lr": 10 ** 400}, "darts"),  # run()/SearchConfig's path
    lambda: get_method("darts").Hyperparameters.from_dict({"alpha_betas": (0.5, -10 ** 400)}, "darts"),
    lambda: get_method("darts").Hyperparameters(w_lr=10 ** 400),  # a method built by hand
    lambda: get_method("xnas").Hyperparameters(reward_bound=10 ** 309),
    lambda: get_method("bayesnas").Hyperparameters(update_every=10 ** 5000),  # str() of it fails too (4300 digits)
], ids=["from_dict", "from_dict-tuple", "dataclass", "optional-float", "int-field"])
def test_a_python_int_past_the_float_range_is_one_config_error(build):
    """docs/methods.md: "an unknown key or a bad value is a one-line ConfigError"; floats must be finite. A Python int
    past 1.8e308 given for a hyperparameter was float()'s OverflowError traceback in ``from_dict`` (so in ``run``), and
    was accepted by the dataclass (an int is a valid float there, and only float infinities were refused): the
    method then stopped its first step in an overflow. One line, with the number in a few characters."""
    from nasdiag.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        build()
    message = str(info.value)
    assert "\n" not in message and "beyond what a float holds" in message and len(message) < 250, message


def test_run_refuses_a_learning_rate_past_the_float_range_before_anything_is_written(tmp_path):
    """``run(SearchConfig(hp={"w_lr": 10**400}))``: one ConfigError line, no record or checkpoint left."""
    from nasdiag.errors import ConfigError
    from nasdiag.search import SearchConfig, run

    out = tmp_path / "r.h5"
    with pytest.raises(ConfigError, match="w_lr of method 'darts' is 1.00e400"):
        run(SearchConfig(method="darts", hp={"w_lr": 10 ** 400}, epochs=1, progress=False, record=str(out)))
    assert list(tmp_path.iterdir()) == []


# -- a run resumed inside an epoch, every method ------------------------------------------------------------------
def _nan_marked(state):
    """``state`` with each float tensor as (its NaN mask, its values with NaN as 0), for a bitwise comparison where NaN
    must meet NaN (XNAS's forecasters keep NaN for the unknown rewards of wiped-out experts; torch.equal is False on
    NaN)."""
    if torch.is_tensor(state) and state.is_floating_point():
        return state.isnan(), torch.where(state.isnan(), torch.zeros_like(state), state)
    if isinstance(state, dict):
        return {k: _nan_marked(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [_nan_marked(v) for v in state]
    return state


RUN_RESUME = {"darts": {}, "darts2": {}, "dsnas": {}, "proxyless": {}, "asmnas": {"attention_hidden": 4},
              "xnas": {"reward_bound": 2e-3, "zeta": 0.25}}  # snas, sparsenas, bayesnas: round 2/3 tests


@pytest.mark.slow  # three short run()s per method (~3 s)
@pytest.mark.parametrize("name", sorted(RUN_RESUME))
def test_a_run_killed_inside_its_second_epoch_resumes_to_the_uninterrupted_run(name, tmp_path, monkeypatch):
    """docs/methods.md: a resumed run "continues from exactly the state it stopped in" (bit-identically on the CPU). A
    float64 run of 2 epochs × 3 steps interrupted after step 5 (its checkpoint is at the epoch end, step 3: the resume
    replays step 4 from it, with the checkpoint's optimizer state, method generator and global RNG, and the data order
    of (seed, epoch)), then resumed: every recorded path of every row and the final checkpointed method state (network,
    optimizers, forecasters or sample counts, generator) equal the uninterrupted run's."""
    import dataclasses

    import numpy as np

    import nasdiag.data
    from torch.utils.data import TensorDataset

    from nasdiag.record import load
    from nasdiag.search import SearchConfig, run
    from nasdiag.search.checkpoint import load_checkpoint
    from test_audit_methods_round3 import _assert_same  # bitwise, recursively

    full = nasdiag.data.load_dataset

    def cut(dataset, **kwargs):  # 24 search-train and search-val samples: 3 steps of 8 per epoch
        s = full(dataset, **kwargs)
        return dataclasses.replace(s, train=TensorDataset(*s.train[:24]), val=TensorDataset(*s.val[:24]))

    monkeypatch.setattr(nasdiag.data, "load_dataset", cut)

    class Interrupt:
        def on_step_end(self, step, stats):
            if step == 5:
                raise KeyboardInterrupt

        def on_epoch_end(self, epoch, stats):
            pass

        def on_exception(self, exc):
            pass

    def config(out, **kw):
        return SearchConfig(method=name, C=2, layers=3, steps=2, multiplier=2, batch_size=8, epochs=2, dtype="float64",
                            diagnostics=("cost",), progress=False, threads=1, record=str(tmp_path / out),
                            device="cpu", hp=RUN_RESUME[name], **kw)  # bit-identical on the CPU (CUDA kernels need not be)

    run(config("whole.h5"))
    with pytest.raises(KeyboardInterrupt):
        run(config("cut.h5"), callbacks=[Interrupt()])
    assert load(str(tmp_path / "cut.h5"))["step"].tolist() == [1, 2, 3, 4, 5]
    run(config("cut.h5", resume=True))
    whole, resumed = load(str(tmp_path / "whole.h5")), load(str(tmp_path / "cut.h5"))
    assert whole["step"].tolist() == resumed["step"].tolist() == list(range(1, 7))
    for path in whole:
        if not path.startswith("meta/"):
            np.testing.assert_array_equal(whole[path], resumed[path], err_msg=path)
    a = load_checkpoint(str(tmp_path / "whole.h5.ckpt"))["method"]
    b = load_checkpoint(str(tmp_path / "cut.h5.ckpt"))["method"]
    assert a["generator"] is not None
    _assert_same(_nan_marked(a), _nan_marked(b), name)


# -- every statistic of a step in the dtype its family states ---------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_every_statistic_of_every_method_has_the_dtype_and_shape_of_its_family(dtype):
    """docs/schema.md: a family's dtype ``float32`` "means the run's float dtype". Two steps of every method on a
    network of ``dtype`` plus its epoch diagnostics: each statistic belongs to a family and has its dtype (float32 →
    ``dtype``) and, where the family names only E and K, its shape. In a float32 run XNAS's regret statistics and its
    two fractions are float64 (its forecasters are float64); the vocabulary said the run's dtype for them."""
    from nasdiag import vocabulary as V

    for name in _builtin_methods():
        cls = get_method(name)
        net = _net(cls, dtype=dtype)
        method = cls(net, cls.Hyperparameters(), schedule=Schedule(epochs=2, steps_per_epoch=2, batch_size=4),
                     hessian_mode="diag")
        data = _batches(4, 8, dtype=dtype)
        stats = method.step(*data[:2])
        stats.update(method.step(*data[2:]))
        stats.update(method.diagnostics())
        sizes = {"E": net.num_edges, "K": len(net.primitives)}
        for path, value in stats.items():
            family = V.family_of(path)
            assert family is not None, (name, path)
            want = {"float32": dtype, "float64": torch.float64, "bool": torch.bool, "int64": torch.int64}[family.dtype]
            assert value.dtype == want, (name, path, value.dtype, family.dtype)
            dims = [d.strip() for d in family.shape.strip("()").split(",") if d.strip()]
            if set(dims) <= set(sizes):
                assert tuple(value.shape) == tuple(sizes[d] for d in dims), (name, path, tuple(value.shape), family.shape)


# -- second-order SparseNAS over several steps: eq 1, 6-13 and the progressive λ transcribed ---------------------------
class SparseArchitect(DartsArchitect):
    """SparseNAS (sparse-supernet Alg. 1) as a function of (w, A): linear mixing Z = A (eq 1), the hypergradient of eq
    11-12 by DARTS's finite difference (eq 13 as DARTS eq 8, the docs' reading), then HAPG or AdamHAPG (eq 6-10): z = A −
    η∘m (Adam's m̂ and per-weight η_i = lr/(1 − β₁ⁿ)/(√v̂ + 1e-8) for AdamHAPG; η the cosine-annealed step size and m = g
    for HAPG), the ℓ1 soft threshold at η_i λα (eq 9), the group threshold at the lower median of the group's η_i times
    λ(1 − α)·√|group| (eq 10, groups = the edges entering a node), then eq 7-8 with u_t = (t − 2)/(t + 1), the first
    step counted as t = 2. λ = lambda_step·(epoch + 1)."""

    def __init__(self, net, h, epochs):
        super().__init__(net, h)
        self.epochs, self.lam, self.eta, self.t = epochs, h.lambda_step, h.hapg_lr, 1
        self.velocity = {t: torch.zeros_like(a) for t, a in self.alpha.items()}
        pairs = [(i, j) for j in range(2, 2 + net.steps) for i in range(j)]  # DARTS's edge order
        self.group = torch.tensor([j - 2 for _, j in pairs])

    @staticmethod
    def mix(alpha):
        return alpha

    def epoch_end(self, epoch):
        self.lr = _cosine(self.h.w_lr, self.h.w_lr_min, epoch + 1, self.epochs)
        self.eta = _cosine(self.h.hapg_lr, 0.0, epoch + 1, self.epochs)
        self.lam = self.h.lambda_step * (epoch + 2)

    def arch_update(self, g):
        h, lam, a_ = self.h, self.lam, self.h.sgl_alpha
        self.t += 1
        u = lambda t: (t - 2) / (t + 1)  # noqa: E731
        b1, b2 = h.alpha_betas
        for t, A in self.alpha.items():
            if h.optimizer == "adamhapg":
                m, v, n = self.adam.get(t, (torch.zeros_like(A), torch.zeros_like(A), 0))
                m, v, n = b1 * m + (1 - b1) * g[t], b2 * v + (1 - b2) * g[t] ** 2, n + 1
                self.adam[t] = (m, v, n)
                eta = h.alpha_lr / (1 - b1 ** n) / ((v / (1 - b2 ** n)).sqrt() + 1e-8)
                z = A - eta * m
            else:
                eta = torch.full_like(A, self.eta)
                z = A - eta * g[t]
            x = torch.sign(z) * torch.clamp(z.abs() - eta * lam * a_, min=0)
            prox = torch.zeros_like(x)
            for node in self.group.unique():
                rows = self.group == node
                eta_node = eta[rows].reshape(-1).sort().values[(rows.sum() * A.shape[1] - 1) // 2]  # lower median
                norm = x[rows].norm()
                shrink = torch.clamp(1 - math.sqrt(rows.sum() * A.shape[1]) * eta_node * lam * (1 - a_) / norm, min=0) \
                    if norm > 0 else torch.zeros(())
                prox[rows] = x[rows] * shrink
            self.velocity[t] = prox - A + u(self.t - 1) * self.velocity[t]
            self.alpha[t] = prox + u(self.t) * self.velocity[t]


@pytest.mark.parametrize("optimizer", ["adamhapg", "hapg"])
def test_sparsenas_second_order_five_steps_follow_eq_6_to_13_with_the_progressive_lambda(optimizer):
    """Five second-order SparseNAS steps over two epoch ends against SparseArchitect above: A (with its exact zeros),
    w, ``sparsity/lambda``, ``sparsity/<cell>/nonzero``, ``scalars/alpha_grad_norm`` (‖eq 13's hypergradient‖ before
    the proximal step) and ``scalars/val_loss`` (at w') after EVERY step: the AdamHAPG moments, the momentum v and
    counter t of eq 7-8, HAPG's annealed η, λ and w's momentum buffers (in w' and in the w step) carried between steps.
    The thresholds are set so that ops are zeroed and revived along the way (checked)."""
    cls = get_method("sparsenas")
    hp = dict(optimizer=optimizer, w_lr=0.3, grad_clip=0.5, init_scale=0.1)
    hp.update({"alpha_lr": 0.05, "lambda_step": 0.6} if optimizer == "adamhapg" else {"hapg_lr": 0.4, "lambda_step": 0.25})
    h = cls.Hyperparameters(**hp)
    torch.manual_seed(3)
    net = Network(4, CLASSES, 3, steps=2, multiplier=2, in_channels=1,
                  primitives=("skip_connect", "avg_pool_3x3", "sep_conv_3x3")).double()
    method = cls(net, h, schedule=Schedule(epochs=3, steps_per_epoch=2, batch_size=4), seed=5)
    ref = SparseArchitect(net, h, epochs=3)
    data = _batches(10, 9)
    zeros = []
    for k in range(5):
        if k in (2, 4):
            method.epoch_end(k // 2 - 1)
            ref.epoch_end(k // 2 - 1)
        train, val = data[2 * k], data[2 * k + 1]
        stats = method.step(train, val)
        want = ref.step(train, val)
        for t, a in net.alphas().items():
            torch.testing.assert_close(a.detach(), ref.alpha[t], rtol=1e-9, atol=1e-12, msg=lambda m: f"step {k} A {t}: {m}")
            assert torch.equal(stats[f"sparsity/{t}/nonzero"], ref.alpha[t] != 0), (k, t)
            zeros.append(int((ref.alpha[t] == 0).sum()))
        for n, p in net.named_parameters():
            if n in ref.w:
                torch.testing.assert_close(p.detach(), ref.w[n], rtol=1e-9, atol=1e-12, msg=lambda m: f"step {k} {n}: {m}")
        assert float(stats["sparsity/lambda"]) == pytest.approx(ref.lam, rel=1e-15)
        for key, rtol in (("val_loss", 1e-12), ("train_loss", 1e-12), ("alpha_grad_norm", 1e-9)):
            torch.testing.assert_close(stats[f"scalars/{key}"], want[key], rtol=rtol, atol=0, msg=lambda m: f"step {k} {key}: {m}")
    assert max(zeros) > 0 and min(zeros) < max(zeros), zeros  # the proximal steps zeroed ops (and not all at once)


@pytest.mark.parametrize("name, hp", [("darts", {"alpha_betas": (0, 0.999)}), ("proxyless", {"alpha_betas": (0, 0.999)}),
                                      ("sparsenas", {"alpha_betas": (0, 0.999)}), ("xnas", {"reward_bound": 1})])
def test_an_int_given_for_a_float_hyperparameter_is_that_float(name, hp):
    """A Python caller's ``alpha_betas=(0, 0.999)`` (ProxylessNAS's default is β₁ = 0) passed the checks (an int is a
    number) and stopped the method's build in torch.optim.Adam's "betas must be either both floats or both Tensors"
    ValueError. It is the float it stands for: the method builds and steps as with ``(0.0, 0.999)``, bit for bit."""
    cls = get_method(name)
    floats = {k: tuple(float(e) for e in v) if isinstance(v, tuple) else float(v) for k, v in hp.items()}
    runs = []
    for given in (hp, floats):
        h = cls.Hyperparameters(**given)
        assert all(type(e) is float for k in given for e in (getattr(h, k) if isinstance(getattr(h, k), tuple) else (getattr(h, k),)))
        method = cls(_net(cls), h, schedule=Schedule(epochs=1, steps_per_epoch=2, batch_size=4))
        data = _batches(4, 11)
        method.step(*data[:2])
        method.step(*data[2:])
        runs.append([p.detach().clone() for p in method.network.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# -- a state of another configuration ---------------------------------------------------------------------------------
def _everything(method):
    import copy

    return copy.deepcopy({"network": method.network.state_dict(),
                          "objects": {k: v.state_dict() for k, v in method._stateful().items()},
                          "generator": method.generator.get_state()})


@pytest.mark.parametrize("name, saved_hp, own_hp, error", [
    ("sparsenas", {"optimizer": "hapg", "first_order": True}, {"first_order": True}, "arch_optimizer is HAPG"),
    ("xnas", {"zeta": 0.5}, {"zeta": 1.0}, "configured differently"),
], ids=["sparsenas-hapg-into-adamhapg", "xnas-another-zeta"])
def test_a_state_of_another_configuration_is_one_line_and_leaves_the_method_as_it_was(name, saved_hp, own_hp, error):
    """``load_state_dict`` (base.py): a refused state loads nothing. SparseNAS's HAPG state was loaded into an AdamHAPG
    method (the optimizers' param groups of the other class) and its next step stopped in a KeyError 'betas'
    traceback; XNAS's forecasters of another ζ refused their state in one line, but only after the network (and the
    objects before them) had been replaced: a method half of one run, half of another. Now one NasdiagError line, and
    the network, every stateful object and the generator as they were: the next step equals a twin's never touched."""
    from nasdiag.errors import NasdiagError

    cls = get_method(name)
    data = _batches(6, 12)
    saved = cls(_net(cls, seed=1), cls.Hyperparameters(**saved_hp), schedule=Schedule(epochs=2, steps_per_epoch=3, batch_size=4))
    saved.step(*data[:2])
    method, twin = (cls(_net(cls, seed=2), cls.Hyperparameters(**own_hp), schedule=Schedule(epochs=2, steps_per_epoch=3,
                                                                                              batch_size=4), seed=3)
                    for _ in range(2))
    method.step(*data[2:4])
    twin.step(*data[2:4])
    before = _everything(method)
    with pytest.raises(NasdiagError, match=error) as info:
        method.load_state_dict(saved.state_dict())
    assert "\n" not in str(info.value)
    from test_audit_methods_round3 import _assert_same

    _assert_same(_nan_marked(before), _nan_marked(_everything(method)), name)
    a, b = method.step(*data[4:]), twin.step(*data[4:])
    assert all(torch.equal(a[k].nan_to_num(0.0), b[k].nan_to_num(0.0)) for k in a)


@pytest.mark.parametrize("spoil", ["generator", "objects", "network", "a string"])
def test_what_is_not_a_methods_state_is_one_line_and_loads_nothing(spoil):
    """``load_state_dict`` of a dict without the generator (or objects, or network) of ``state_dict()`` was a KeyError
    traceback, for the generator after the network and every object had been replaced; of a string an AttributeError.
    One NasdiagError line naming what is missing, and the method as it was."""
    from nasdiag.errors import NasdiagError
    from test_audit_methods_round3 import _assert_same

    cls = get_method("darts")
    method = cls(_net(cls, seed=1), cls.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=2, batch_size=4))
    other = cls(_net(cls, seed=2), cls.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=2, batch_size=4))
    other.step(*_batches(2, 13))
    state = other.state_dict()
    if spoil == "a string":
        state = "checkpoint.pt"
    else:
        del state[spoil]
    before = _everything(method)
    with pytest.raises(NasdiagError, match="lacks") as info:
        method.load_state_dict(state)
    assert "\n" not in str(info.value)
    _assert_same(before, _everything(method), spoil)


@pytest.mark.parametrize("spoil", ["a missing cell type", "K + 1 ops", "another batch", "integers", "a list"])
def test_the_cost_service_refuses_mixing_weights_it_cannot_use_in_one_line_before_any_forward(spoil):
    """docs/methods.md: ``cost(x, y, weights)`` is the service a method (a user's, as the toy) calls with
    ``{cell type: (E, K)}`` (or per-sample (E, B, K)) weights. A missing cell type was a KeyError, a list a TypeError,
    integer weights torch's "only Tensors of floating point dtype can require gradients"; wrong shapes the network's
    ValueError after the stem had run, its BatchNorm statistics moved by the refused call. One SearchError line
    naming the cell types and shapes wanted, before any forward."""
    from nasdiag.search import SearchError

    cls = get_method("darts")
    net = _net(cls)
    method = cls(net, cls.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=2, batch_size=4))
    x, y = _batches(1, 14)[0]
    p = method.probabilities()
    E, K = p["normal"].shape
    weights = {"a missing cell type": {"normal": p["normal"]},
               "K + 1 ops": {t: torch.ones(E, K + 1, dtype=torch.float64) for t in p},
               "another batch": {t: torch.ones(E, len(x) + 1, K, dtype=torch.float64) for t in p},
               "integers": {t: torch.ones(E, K, dtype=torch.int64) for t in p},
               "a list": list(p.values())}[spoil]
    buffers = {n: b.clone() for n, b in net.named_buffers()}
    with pytest.raises(SearchError, match=r"cost\(\) takes the mixing weights as \{cell type: \(E, K\)") as info:
        method.cost(x, y, weights)
    assert "\n" not in str(info.value)
    assert all(torch.equal(b, buffers[n]) for n, b in net.named_buffers())
    assert all(p_.grad is None for p_ in net.parameters())
    per_sample = {t: v.unsqueeze(1).expand(E, len(x), K) for t, v in p.items()}  # still taken, per sample
    assert tuple(method.cost(x, y, per_sample).costs["normal"].shape) == (E, len(x), K)


@pytest.mark.parametrize("name", ["darts", "asmnas"])
def test_an_evaluation_batch_the_supernet_cannot_take_is_one_line(name):
    """``evaluate(loader)`` (the supernet evaluation, ASM-NAS's selection pass): a label past the classifier was
    cross-entropy's IndexError traceback, images of other channels a convolution's RuntimeError; check_batch's one
    SearchError line, as for a step's batches."""
    from nasdiag.search import SearchError

    cls = get_method(name)
    method = cls(_net(cls), cls.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=2, batch_size=4))
    x, y = _batches(1, 15)[0]
    with pytest.raises(SearchError, match=r"evaluation labels y must be class indices in \[0, 3\)"):
        method.evaluate([(x, torch.full_like(y, CLASSES))])
    with pytest.raises(SearchError, match=r"evaluation inputs x must be images \(B, 1, H, W\)"):
        method.evaluate([(torch.randn(4, 2, 6, 6), y)])
    assert set(method.evaluate([(x.float(), y)])) == {"loss", "acc"}  # cast to the supernet's dtype, as before


@pytest.mark.parametrize("epochs", [1, "3", 2.5, True])
def test_extend_schedule_refuses_what_does_not_extend_the_run(epochs):
    """``extend_schedule(epochs)`` continues the run to ``epochs`` in all: fewer epochs than the run's shrank its
    schedule silently (the cosine of w left where it was), a string was a TypeError traceback. One SearchError line;
    the schedule as it was."""
    from nasdiag.search import SearchError

    cls = get_method("darts")
    method = cls(_net(cls), cls.Hyperparameters(), schedule=Schedule(epochs=2, steps_per_epoch=1, batch_size=4))
    method.step(*_batches(2, 16))
    method.epoch_end(0)
    with pytest.raises(SearchError, match=r"at least its 2; got"):
        method.extend_schedule(epochs)
    assert method.schedule.epochs == 2 and method.scheduler.T_max == 2
    method.extend_schedule(2)  # the run's own length: nothing to extend, accepted
    assert method.schedule.epochs == 2


def test_a_curvature_batch_the_supernet_cannot_take_is_one_line():
    """``curvature(x, y)`` (docs/spectrum.md: the run calls it every k steps; a user may call it on a batch of their
    own): images of other channels were a convolution's RuntimeError traceback, float32 images on a float64 supernet
    a dtype RuntimeError; check_batch's one SearchError line, as for a step."""
    from nasdiag.search import SearchError

    cls = get_method("darts")
    method = cls(_net(cls), cls.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=2, batch_size=4),
                 hessian_mode="diag")
    x, y = _batches(1, 17)[0]
    with pytest.raises(SearchError, match=r"curvature inputs x must be images \(B, 1, H, W\)"):
        method.curvature(torch.randn(4, 2, 6, 6, dtype=torch.float64), y)
    with pytest.raises(SearchError, match=r"curvature inputs x are torch.float32"):
        method.curvature(x.float(), y)
    assert method.curvature(x, y)["hessian/normal/diag"].shape == method.probabilities()["normal"].shape


@pytest.mark.parametrize("probe", ["run.h5", "another model's probe"])
def test_a_probe_that_is_not_the_networks_is_one_line(probe):
    """``probe=`` takes ``nasdiag.attach(network)``: a string (say, a path) was an AttributeError traceback ('str'
    object has no attribute 'model'); a probe of another model was refused, and still is, in one line."""
    import nasdiag
    from nasdiag.errors import NasdiagError

    cls = get_method("darts")
    if probe != "run.h5":
        probe = nasdiag.attach(_net(cls, seed=4))
    with pytest.raises(NasdiagError, match="the probe must be attached to the method's network") as info:
        cls(_net(cls), cls.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=2, batch_size=4), probe=probe)
    assert "\n" not in str(info.value)
