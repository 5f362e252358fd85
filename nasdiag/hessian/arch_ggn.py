"""Generalized Gauss-Newton diagonal of the mixing weights Z: curvature that tracks the exact one cheaply.

For a loss ``L = Σ_n ℓ_n(f_n)`` of per-sample outputs ``f_n`` (mean reduction: the 1/N is inside ℓ_n),
``∂²L/∂Z² = Σ_n J_nᵀ H_n J_n + Σ_n Σ_o (∂ℓ_n/∂f_no) ∂²f_no/∂Z²`` with ``J_n = ∂f_n/∂Z`` and
``H_n = ∂²ℓ_n/∂f_n²``. The first term is the generalized Gauss-Newton matrix G (for cross-entropy,
the Fisher); it keeps exactly what C.3.1-C.3.2 (bayesnas-appendix) drop, the couplings between
candidate ops, channels, positions and samples inside ``B_kᵀ H_j B_k``, and drops only the residual.

How, without one backward per output. Factor each ``H_n = Σ_c λ_nc u_nc u_ncᵀ`` (eigh of the
per-sample (D, D) block, D = outputs per sample). Give every edge a per-sample shift δ_e of shape
(B, K) (zero), so that the mixing weights of sample n are ``Z_e + δ_{e,n}``. One backward of
``Σ_n ⟨v_n, f_n⟩`` gives ``∂/∂δ_{e,n}`` for all n at once, and

* ``"ggn"``: with ``v_n = √λ_nc u_nc`` for each c (D backwards, batched), ``Σ_c Σ_n (∂/∂δ_{e,n,k})²``;
* ``"ggn_mc"``: with ``v_n = Σ_c ε_nc √λ_nc u_nc``, ε Rademacher (E[v vᵀ] = H_n), ``samples``
  backwards, ``mean_s Σ_n (∂/∂δ_{e,n,k})²``: one extra backward for one sample. ε is drawn on the CPU from
  the seed and u_nc carries canonical signs (below), so a seed gives the same numbers on any device (where the
  eigenvalues of each block are distinct: a repeated one leaves its eigenvectors to the solver). For cross-entropy this
  is the Fisher at labels sampled from the model's predictive distribution in expectation.

Both equal ``diag G`` exactly when samples do not interact in the forward (BatchNorm in eval mode,
LayerNorm/InstanceNorm, no BN). With train-mode BatchNorm, sample n's shift also moves the batch
statistics and so every other sample's output: ``∂/∂δ_n`` then carries ``Σ_m J_{m,n}ᵀ v_m`` instead
of ``J_{n,n}ᵀ v_n``. Then the two differ:

* ``"ggn"`` is ``Σ_c Σ_n (Σ_m √λ_mc u_mcᵀ J_mn)²``: row c pairs the c-th directions of all samples, so the
  signs of the eigenvectors enter; they are made canonical (largest-magnitude entry positive, the first of those
  equal up to √eps) so that the number does not depend on the eigensolver's convention (device, LAPACK build);
* ``"ggn_mc"`` has expectation ``Σ_{m,n} diag(J_mnᵀ H_m J_mn)`` (independent ε per sample: no cross pairs),
  which ``"ggn"`` could only match with one backward per sample and direction (B·D).

Neither is the Gauss-Newton matrix of the shared Z, ``Σ_m J_mᵀ H_m J_m`` with ``J_m = Σ_n J_mn``. docs/hessian.md
measures the results against ``exact``. Half-precision blocks are factored in float32 (eigh has no float16 kernels).
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from nasdiag.hessian._hvp import call_model, check_probe_memory, preserved_buffers, scalar_loss
from nasdiag.hessian.arch_exact import refuse_loss_beyond_outputs
from nasdiag.hessian.loss_curvature import output_hessian_blocks
from nasdiag.edges import weights_parameter
from nasdiag.hessian.modes import CurvatureError, CurvatureTypeError, no_weights_refusal
from nasdiag.hooks import Hooks

__all__ = ["ggn_arch_diag", "ggn_factor_rows"]


def _per_sample_tolerance(output: torch.Tensor, reference: torch.Tensor) -> float:
    """Relative tolerance of the check that a mixed op returns for (B, K) weights what it returns for (K,): 1e-5, or,
    where the two calls may round differently, 16 ulp of the coarsest dtype they compute in. That is under autocast
    (a mix by einsum/matmul runs in its dtype) and where the two outputs' dtypes differ: under CPU bfloat16 autocast a
    0-dim weight times a bfloat16 op output stays bfloat16 and a (B, 1, 1, 1) weight promotes it to float32, so
    nasdiag's own MixedOp (and the DARTS code's ``w * op(x)``) differ by bfloat16 rounding (0.4% of the largest entry
    on a 2-cell supernet), which was refused as a mixed op pairing the batch rows with its ops. A pairing of rows with
    ops differs by the outputs themselves, far more than 16 ulp."""
    dtypes = {output.dtype, reference.dtype}
    if torch.is_autocast_enabled(output.device.type):
        dtypes.add(torch.get_autocast_dtype(output.device.type))
    if len(dtypes) == 1:
        return 1e-5
    return max(1e-5, 16 * max(torch.finfo(d).eps for d in dtypes))


class _PerSampleShift:
    """Forward pre-hooks that add a (B, K) zero leaf δ_e to each mixed op's weights (tied calls share it)."""

    def __init__(self, names: List[str], n_ops: List[int]):
        self.names, self.n_ops = names, n_ops
        self.leaves: Dict[str, torch.Tensor] = {}
        self.observed: Dict[str, List[torch.Tensor]] = {n: [] for n in names}
        self.with_graph: Dict[str, torch.Tensor] = {}  # first call's weights, still attached (the softmax check)
        #: the mixed ops whose forward has begun and not yet returned, innermost last (to name a failing one)
        self.running: List[str] = []
        #: first call of an edge given (K,) weights: its arguments and RNG state, to check the (B, K) call against
        self.pending: Dict[str, tuple] = {}

    def done(self, module, args, output):
        name = self.running.pop() if self.running else None
        if name in self.pending:
            self._check_per_sample(name, module, output, *self.pending.pop(name))

    def _check_per_sample(self, name, module, output, args, kwargs, cpu_state, device, cuda_state):
        """The op given the (B, K) weights (rows all equal to its (K,) weights) must return what it returns for the
        (K,) weights: a DARTS-code ``sum(w * op(x) for w, op in zip(weights, self._ops))`` pairs the batch rows with
        the ops instead, which fails on most shapes but broadcasts silently when the output's last size is K."""
        if not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if cuda_state is not None else []):
            torch.set_rng_state(cpu_state)  # the same dropout draws as the call being checked
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, device)
            reference = module.forward(*args, **kwargs)
        if not isinstance(reference, torch.Tensor) or reference.shape == output.shape and bool(
                ((output.detach() - reference).abs().amax() <= _per_sample_tolerance(output, reference)
                 * reference.abs().amax() + torch.finfo(reference.dtype).tiny) or not torch.isfinite(reference).all()):
            return
        if self._forward_takes_per_sample_weights(module, args, kwargs, reference, cpu_state, device, cuda_state):
            # forward alone mixes (B, K) weights right: the call differed by a user's hook, not by the pairing
            hooked = self._own_hooks_of(module) or ["hook"]
            raise CurvatureError(
                f"edge {name!r}: the mixed op has a {' and a '.join(hooked)} of its own that changes its output, which "
                "the GGN modes (ggn, ggn_mc, and the control variate of hutchinson:<k>) cannot check their per-sample "
                "(B, K) weights through; remove the hook for this call, or use mode='exact', which runs it"
            )
        x = args[0] if args else kwargs.get("x")
        if isinstance(x, torch.Tensor) and x.dim() == 1:  # one unbatched sample: not a pairing of rows with ops
            raise CurvatureError(
                f"edge {name!r}: the mixed op's input has shape {tuple(x.shape)}, read by the GGN modes (ggn, ggn_mc, and "
                f"the control variate of hutchinson:<k>) as {x.shape[0]} samples to mix each with its own weights (one "
                "unbatched sample?); for one sample pass a batch of one (inputs.unsqueeze(0), targets.unsqueeze(0)), or "
                "use mode='exact'"
            )
        raise CurvatureError(
            f"edge {name!r}: the GGN modes (ggn, ggn_mc, and the control variate of hutchinson:<k>) mix each sample "
            "with its own weights, shape (B, K), and the mixed op returned another output for them than for its (K,) "
            "weights (e.g. zip(weights, self._ops) pairs the batch rows with the ops); let its forward take (B, K) "
            "weights as well as (K,) (weights[..., k] broadcast over each sample's output), or use mode='exact' or 'diag'"
        )

    @staticmethod
    def _forward_takes_per_sample_weights(module, args, kwargs, reference, cpu_state, device, cuda_state) -> bool:
        """Whether ``module.forward`` alone returns ``reference`` for the (K,) weights repeated as (B, K) rows."""
        key = weights_parameter(module)
        weights = kwargs[key] if key in kwargs else (args[1] if len(args) >= 2 else None)
        x = args[0] if args else kwargs.get("x")
        if not isinstance(weights, torch.Tensor) or not isinstance(x, torch.Tensor) or weights.dim() != 1:
            return False
        rows = weights.expand(x.shape[0], -1)
        args, kwargs = ((args, {**kwargs, key: rows}) if key in kwargs else ((args[0], rows, *args[2:]), kwargs))
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if cuda_state is not None else []):
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, device)
            try:
                alone = module.forward(*args, **kwargs)
            except Exception:  # a forward that cannot take (B, K) weights: the pairing message stands
                return False
        return (isinstance(alone, torch.Tensor) and alone.shape == reference.shape
                and bool((alone - reference).abs().amax() <= 1e-5 * reference.abs().amax() + torch.finfo(reference.dtype).tiny))

    def _own_hooks_of(self, module) -> List[str]:
        """The kinds of forward hooks on ``module`` that nasdiag did not put there."""
        def ours(fn) -> bool:
            return str(getattr(getattr(fn, "func", fn), "__module__", "") or "").startswith("nasdiag.")

        return [kind for kind, hooks in (("forward pre-hook", module._forward_pre_hooks), ("forward hook", module._forward_hooks))
                if any(not ours(fn) for fn in hooks.values())]

    def hook(self, i: int):
        name, K = self.names[i], self.n_ops[i]

        def hook(module, args, kwargs):
            key = weights_parameter(module)  # the weights by keyword: op(x, mix=w) for forward(x, mix)
            weights = kwargs[key] if key in kwargs else (args[1] if len(args) >= 2 else None)
            x = args[0] if args else kwargs.get("x")
            if not isinstance(weights, torch.Tensor):
                raise CurvatureError(no_weights_refusal(name, weights))
            if weights.dim() not in (1, 2) or weights.shape[-1] != K:
                shape = tuple(weights.shape)
                raise CurvatureError(
                    f"edge {name!r}: mixing weights must have shape (K,) or (B, K) with K={K} (the candidate ops listed), "
                    f"got {shape}; list exactly the ops the mixed op mixes, and pass its weights as forward(x, weights)"
                )
            if not isinstance(x, torch.Tensor):
                raise CurvatureTypeError(
                    f"edge {name!r}: the mixed op's first argument must be the input tensor (B, ...), got "
                    f"{type(x).__name__}; call it as forward(x, weights), or use mode='exact'"
                )
            if name not in self.leaves:
                self.leaves[name] = torch.zeros(x.shape[0], K, dtype=weights.dtype, device=weights.device, requires_grad=True)
                if weights.dim() == 1 and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
                    cuda = x.device if x.is_cuda else None
                    self.pending[name] = (args, kwargs, torch.get_rng_state(), cuda,
                                          torch.cuda.get_rng_state(cuda) if cuda is not None else None)
            self.observed[name].append(weights.detach())
            self.with_graph.setdefault(name, weights)
            shifted = weights + self.leaves[name]
            self.running.append(name)
            if key in kwargs:
                return args, {**kwargs, key: shifted}
            return (args[0], shifted, *args[2:]), kwargs

        return hook


def ggn_arch_diag(
    model: nn.Module,
    loss_fn: Callable,
    inputs,
    targets,
    names: List[str],
    modules: List[nn.Module],
    n_ops: List[int],
    *,
    monte_carlo: bool,
    samples: int = 1,
    generator: Optional[torch.Generator] = None,
    check_weights: Optional[Callable] = None,
):
    """``({edge: (K,) diag G}, {edge: (K,) ∂L/∂Z}, {edge: observed weights})`` (see the module docstring).

    Raises:
        CurvatureError: the loss has negative curvature in the outputs (GGN needs a convex per-sample loss).
        CurvatureError (also a ``ValueError``): an edge never ran, or ran with weights of the wrong shape.
    """
    rows, gradient, observed = ggn_factor_rows(
        model, loss_fn, inputs, targets, names, modules, n_ops, monte_carlo=monte_carlo, samples=samples, generator=generator,
        check_weights=check_weights, refuse_beyond_outputs=True,
    )
    return {n: r.square().sum((0, 1)) for n, r in rows.items()}, gradient, observed


def ggn_factor_rows(
    model: nn.Module,
    loss_fn: Callable,
    inputs,
    targets,
    names: List[str],
    modules: List[nn.Module],
    n_ops: List[int],
    *,
    monte_carlo: bool,
    samples: int = 1,
    generator: Optional[torch.Generator] = None,
    check_weights: Optional[Callable] = None,
    warn_unused: bool = True,
    refuse_beyond_outputs: bool = False,
    what: Optional[str] = None,
):
    """The factor of the (Monte-Carlo) GGN: ``({edge: (R, B, K)}, {edge: (K,) ∂L/∂Z}, {edge: observed weights})``.

    Row ``(r, n)`` of edge e is ``∂/∂δ_{e,n}`` of ``Σ_m ⟨v_{r,m}, f_m⟩`` (module docstring), scaled by
    ``1/√samples`` for ``monte_carlo``, so that over all edges stacked along K the matrix
    ``C = Σ_{r,n} row_{r,n} row_{r,n}ᵀ`` (N × N, cross-edge blocks included) has ``diag C`` = the
    ``ggn``/``ggn_mc`` result and ``C ε = Rᵀ(R ε)`` costs two small matrix products: the control
    variate of :mod:`nasdiag.hessian.arch_hutchinson`. Rows are NaN where the loss curvature was not finite,
    zeros for an edge the loss does not depend on. ``what`` names the caller's mode in a refusal (default: the GGN modes).
    """
    shift = _PerSampleShift(names, n_ops)
    hooks = Hooks()
    for i, module in enumerate(modules):
        hooks.forward_pre(module, shift.hook(i), with_kwargs=True)
        hooks.forward(module, shift.done)
    try:
        hooks.install()
        with preserved_buffers(model), torch.enable_grad():
            try:
                outputs = call_model(model, inputs)
            except RuntimeError as err:
                if not shift.running or isinstance(err, torch.OutOfMemoryError):
                    raise
                raise CurvatureError(
                    f"edge {shift.running[-1]!r}: the GGN modes (ggn, ggn_mc, and the control variate of hutchinson:<k>) "
                    "mix each sample with its own weights, shape (B, K), and the mixed op failed on them "
                    f"({type(err).__name__}: {str(err)[:160]}); let its forward take (B, K) weights as well as (K,) "
                    "(weights[..., k] broadcast over each sample's output), or use mode='exact' or 'diag'"
                ) from err
            never = [n for n in names if n not in shift.leaves]
            if never:
                raise CurvatureError(
                    f"mixed op(s) {never} never ran in the forward pass, so their curvature is undefined; "
                    "pass only edges that model(inputs) actually uses"
                )
            if not isinstance(outputs, torch.Tensor):
                raise CurvatureTypeError(
                    f"model must return one tensor for the GGN modes, got {type(outputs).__name__}; return the outputs "
                    "alone (or wrap the model), or use mode='exact'"
                )
            if check_weights is not None:
                check_weights(shift.observed, shift.with_graph)
            loss = scalar_loss(loss_fn, outputs, targets)
            leaves = [shift.leaves[n] for n in names]
            if refuse_beyond_outputs:  # the GGN is of the loss in the outputs: a term elsewhere would be left out
                refuse_loss_beyond_outputs(loss, outputs, f"mode={'ggn_mc' if monte_carlo else 'ggn'!r}",
                                           reached={id(leaf): n for n, leaf in zip(names, leaves)},
                                           weights=shift.with_graph if check_weights is not None else None)
            blocks = output_hessian_blocks(loss_fn, outputs.detach(), targets)  # (N, D, D), of the scalar
            finite = bool(torch.isfinite(blocks).all())  # a NaN is reported as NaN, not an eigh failure
            # the blocks' round-off, also where they are factored in float32, or computed by a loss in a coarser dtype
            # than the outputs' (F.cross_entropy(outputs.float(), t) of a float64 model was refused as non-convex):
            round_off = max(torch.finfo(blocks.dtype).eps, torch.finfo(loss.dtype).eps)
            blocks = blocks.to(torch.promote_types(blocks.dtype, torch.float32))  # eigh has no float16/bfloat16 kernels
            lam, U = torch.linalg.eigh(blocks if finite else torch.nan_to_num(blocks, 0.0, 0.0, 0.0))
            # round-off of the O(1) quantities the blocks come from (softmax p − p² for CE) is ~eps/N in the blocks
            # of a batch-mean loss even when every block is tiny (near one-hot predictions): floor the scale at 1/N
            scale = torch.maximum(lam.abs().amax(), lam.new_tensor(1.0 / lam.shape[0]))
            if bool((lam < -1e3 * round_off * scale).any()):
                asked = what or "mode 'ggn'/'ggn_mc'"
                raise CurvatureError(
                    f"{asked} needs a loss with non-negative curvature in the model outputs (a "
                    "convex per-sample loss such as cross-entropy or MSE); use mode='exact' or 'diag'"
                )
            # eigenvector signs made canonical (largest-magnitude entry positive), so that the number does not depend
            # on the eigensolver's convention (device, LAPACK build): in ggn_mc each draw ε_nc multiplies u_nc, and
            # where samples couple (train-mode BN) ggn's row c sums sample m's direction c over m. Entries of equal
            # magnitude (two-class cross-entropy: (1, −1)/√2) differ by round-off only, so the first entry within
            # √eps of the largest is taken, not the largest itself
            mag = U.abs()
            near_max = mag >= mag.amax(1, keepdim=True) * (1 - torch.finfo(U.dtype).eps ** 0.5)
            pick = near_max.to(U.dtype).argmax(1, keepdim=True)  # (N, 1, D): argmax returns the first maximum
            sign = torch.where(torch.gather(U, 1, pick) < 0, -1.0, 1.0).to(U.dtype)
            root = U * sign * lam.clamp_min(0).sqrt()[:, None, :]  # (N, D, D): column c is √λ_c u_c
            if monte_carlo:
                check_probe_memory(samples * lam.numel() * (8 + 2 * lam.dtype.itemsize), None, lam.device,
                                   f"mode 'ggn_mc' with samples={samples}", "lower samples (each draw is one more backward)",
                                   settable=False)  # ggn_mc refuses max_memory=
                # drawn on the CPU (the generator's device), so a seed gives the same draws on any device
                eps = torch.randint(0, 2, (samples, *lam.shape), generator=generator).to(lam.device)
                eps = (2 * eps - 1).to(lam.dtype)  # (S, N, D) Rademacher
                V = torch.einsum("ndc,snc->snd", root, eps) / samples**0.5  # (S, N, D)
            else:
                V = root.permute(2, 0, 1)  # (D, N, D): direction c for every sample
            V = V.reshape(V.shape[0], *outputs.shape).to(outputs.dtype)
            (grad_out,) = torch.autograd.grad(loss, outputs, retain_graph=True)
            rows = torch.cat([grad_out.unsqueeze(0), V])  # row 0: the gradient, for ∂L/∂Z
            per_sample, unused = _batched_vjp(outputs, leaves, rows)
    finally:
        hooks.remove()
    if warn_unused and unused:  # as the exact and diag routes say it
        warnings.warn(
            f"the loss does not depend on edge(s) {[names[i] for i in unused]}: their curvature is reported as zeros",
            RuntimeWarning,
            stacklevel=4,
        )
    factor, gradient = {}, {}
    for i, (name, g) in enumerate(zip(names, per_sample)):  # g: (1 + R, B, K)
        # a non-finite loss curvature is NaN for every edge it reaches; one the loss ignores keeps its zeros
        factor[name] = g[1:].detach() if finite or i in unused else torch.full_like(g[1:], float("nan"))
        gradient[name] = g[0].sum(0).detach()
    return factor, gradient, shift.observed


def _batched_vjp(outputs: torch.Tensor, leaves: List[torch.Tensor], rows: torch.Tensor) -> Tuple[List[torch.Tensor], List[int]]:
    """``[(R, *leaf.shape)]``: vector-Jacobian products of ``outputs`` w.r.t. ``leaves`` for each of the R rows
    (zeros for a leaf the outputs do not depend on), and the indices of those leaves."""
    try:
        grads = torch.autograd.grad(outputs, leaves, rows, retain_graph=True, is_grads_batched=True, allow_unused=True)
    except RuntimeError:  # an op without a batching rule for its backward: one row at a time
        per_row = [torch.autograd.grad(outputs, leaves, r, retain_graph=True, allow_unused=True) for r in rows]
        grads = [None if parts[0] is None else torch.stack(parts) for parts in zip(*per_row)]
    unused = [i for i, g in enumerate(grads) if g is None]
    return [torch.zeros(rows.shape[0], *t.shape, dtype=t.dtype, device=t.device) if g is None else g for g, t in zip(grads, leaves)], unused
