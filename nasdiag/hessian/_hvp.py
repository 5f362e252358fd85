"""Hessian-vector products of a mini-batch loss, shared by the exact α-curvature and the spectrum.

Two routes, same numbers:

* :class:`HessianVectorProduct` (reverse-over-reverse): one forward and one ``create_graph`` backward,
  then every product is a second backward through the retained graph. Cheapest for products asked
  one at a time (Lanczos), and works for any module autograd can double-differentiate. Stacks of
  products go through ``torch.autograd.grad(..., is_grads_batched=True)``, whose legacy vmap falls
  back to a loop for many double-backward ops: on a GPU that is barely faster than one at a time.
* :func:`functional_hvp` (forward-over-reverse, ``torch.func``): ``vmap(jvp(grad(f)))`` over a stack of
  tangents re-runs the forward per stack but batches for real (about 10x faster per product on an
  H200 for a stack of 120, see docs/spectrum.md). Needs a model that ``torch.func`` can trace:
  train-mode BatchNorm is run without its running-statistic update (:func:`batch_statistics_only`),
  which is the same arithmetic.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from nasdiag import memory

Inputs = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


def call_model(model: nn.Module, inputs: Inputs):
    """``model(inputs)``, or ``model(*inputs)`` when ``inputs`` is a tuple.

    A forward that fails on inputs of another dtype or device than the model's parameters, or on a batch of
    one sample through train-mode BatchNorm, is refused with a :class:`~nasdiag.hessian.modes.CurvatureTypeError`
    (resp. :class:`~nasdiag.hessian.modes.CurvatureError`) saying so, chained to torch's error; any other
    failure of the forward is the model's own and propagates unchanged."""
    with forward_failures_explained(model, inputs):
        if isinstance(inputs, tuple):
            return model(*inputs)
        return model(inputs)


@torch.compiler.disable  # read by the probe's model hook, which a compiled model's dynamo traces: run it eagerly
def random_state() -> Tuple[torch.Tensor, Optional[List[torch.Tensor]]]:
    """The global generators' state (the CPU's, CUDA's where initialised), for :func:`set_random_state`: a route that
    runs the forward again (a fallback, a second pass) draws what the call's first forward drew, so with a random
    forward (train-mode dropout) every pass differentiates the one net the caller's seed gives."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)


def set_random_state(state: Tuple[torch.Tensor, Optional[List[torch.Tensor]]]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def functional_forward(model: nn.Module, values: Mapping[str, torch.Tensor], inputs: Inputs):
    """``torch.func.functional_call(model, values, inputs)``, its failures explained as :func:`call_model`'s."""
    with forward_failures_explained(model, inputs):
        return torch.func.functional_call(model, values, inputs if isinstance(inputs, tuple) else (inputs,))


@contextmanager
def forward_failures_explained(model: nn.Module, inputs: Inputs) -> Iterator[None]:
    """Run a forward of ``model`` on ``inputs``; if it fails because of the inputs (:func:`call_model`), re-raise
    as a one-line curvature error chained to torch's; any other failure propagates unchanged."""
    try:
        yield
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as err:
        from nasdiag.hessian.modes import CurvatureError

        if isinstance(err, CurvatureError) or _traced(inputs):
            raise
        _refuse_unfit_inputs(model, inputs, err)
        raise


def refuse_inference_mode(what: str) -> None:
    """Refuse a call under ``torch.inference_mode()``: ``torch.enable_grad()`` does not lift it, so no graph is
    recorded and every curvature would come out as zeros (loss "independent" of the parameters)."""
    if torch.is_inference_mode_enabled():
        from nasdiag.hessian.modes import CurvatureRuntimeError

        raise CurvatureRuntimeError(
            f"{what} was called under torch.inference_mode(), where autograd records no graph (torch.enable_grad() "
            "does not lift it), so every Hessian would come out as zeros; call it outside inference_mode "
            "(torch.no_grad() is fine)"
        )


def check_model(model, loss_fn, what: str) -> None:
    """Refuse a ``model`` that is not an ``nn.Module`` and a ``loss_fn`` that is not callable, before any work,
    and a call under ``torch.inference_mode()``."""
    from nasdiag.hessian.modes import CurvatureTypeError

    refuse_inference_mode(what)
    if not isinstance(model, nn.Module):
        raise CurvatureTypeError(f"{what}: model must be an nn.Module (called as model(inputs)), got {type(model).__name__}; "
                                 "wrap a function in an nn.Module whose forward calls it")
    if not callable(loss_fn):
        raise CurvatureTypeError(f"{what}: loss_fn must be callable as loss_fn(outputs, targets) -> scalar tensor "
                                 f"(e.g. F.cross_entropy), got {type(loss_fn).__name__}")


def _traced(inputs) -> bool:
    """Whether ``inputs`` are wrapped by a ``torch.func`` transform (vmap, grad, jvp): failures there are
    handled by the callers' fallbacks and must keep their type."""
    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    tensors = inputs if isinstance(inputs, tuple) else (inputs,)
    return wrapped is not None and any(isinstance(t, torch.Tensor) and wrapped(t) for t in tensors)


def _refuse_unfit_inputs(model: nn.Module, inputs: Inputs, err: BaseException) -> None:
    """Raise a one-line curvature error (from ``err``) when the inputs, not the model, explain why the forward failed."""
    from nasdiag.hessian.modes import CurvatureError, CurvatureTypeError

    tensors = [t for t in (inputs if isinstance(inputs, tuple) else (inputs,)) if isinstance(t, torch.Tensor)]
    held = [t for t in (*model.parameters(), *model.buffers()) if torch.is_floating_point(t) or t.is_complex()]
    if not tensors or not held:
        return
    dtypes = {t.dtype for t in held}
    devices = {t.device for t in held}
    failed = f"model(inputs) failed ({type(err).__name__}: {str(err).strip().splitlines()[0][:160] if str(err).strip() else ''})"
    meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if meta:
        raise CurvatureError(
            f"{failed}: {_listed(meta[:3])}{' ...' if len(meta) > 3 else ''} of the model are on the meta device (shapes "
            "without values); materialise them (model.to_empty(device=...), then load the weights) before the curvature"
        ) from err
    for t in tensors:
        if t.device not in devices:
            raise CurvatureTypeError(
                f"{failed}: the inputs are on {t.device} but the model's parameters on {_listed(devices)}; "
                f"move them with inputs.to({_listed(devices)!r}) (or the model with model.to(inputs.device))"
            ) from err
        if t.dtype not in dtypes and (torch.is_floating_point(t) or not _takes_indices(model)):
            kind = "floating-point" if torch.is_floating_point(t) else "non-floating-point"
            raise CurvatureTypeError(
                f"{failed}: the inputs have {kind} dtype {t.dtype} but the model's parameters {_listed(dtypes)}; "
                f"convert them with inputs.to({_listed(dtypes)}) (a Hessian is taken in the model's dtype)"
            ) from err
    batch_norms = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    if batch_norms and tensors[0].dim() > 0 and tensors[0].shape[0] == 1:
        raise CurvatureError(
            f"{failed}: a batch of one sample cannot be normalized by train-mode BatchNorm ({batch_norms[0]!r}); "
            "pass a batch of 2 or more samples, or call model.eval() to use the running statistics"
        ) from err


def _takes_indices(model: nn.Module) -> bool:
    """Whether integer inputs may be what the model expects (token ids into an embedding)."""
    return any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in model.modules())


def _listed(values) -> str:
    return ", ".join(sorted(str(v) for v in values))


@contextmanager
def batch_statistics_only(model: nn.Module) -> Iterator[None]:
    """Train-mode BatchNorm layers normalize with the batch statistics but skip the running-statistic update.

    ``torch.func`` transforms cannot update a buffer in place from a traced value; with
    ``track_running_stats`` off in train mode, ``nn.BatchNorm*`` computes exactly the same batch
    normalization and leaves its buffers alone. Eval-mode layers are not touched (they use the running
    statistics either way). Restored on exit.
    """
    toggled = [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats
    ]
    try:
        for m in toggled:
            m.track_running_stats = False
        yield
    finally:
        for m in toggled:
            m.track_running_stats = True


def _honours_tracking_flag(m: nn.Module) -> bool:
    """Whether ``m`` runs torch's own BatchNorm forward, which with ``track_running_stats`` off in train mode
    neither reads nor writes its buffers (a subclass with a forward of its own may pass them regardless)."""
    return isinstance(m, nn.modules.batchnorm._BatchNorm) and type(m).forward in (
        nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward)


@contextmanager
def preserved_buffers(model: nn.Module) -> Iterator[None]:
    """Run the block without changing any buffer of ``model``, then leave them as they were.

    Train-mode BatchNorm layers (torch's own forward) that track running statistics get
    ``track_running_stats`` off for the block (as :func:`batch_statistics_only`): they normalize with the
    batch statistics exactly as before (the Hessian is the one of the train-mode loss) and neither read
    nor write their buffers, so those
    need no copy (a copy per buffer was a kernel per BatchNorm per call, and memory). Every other buffer
    is swapped for a scratch copy and the untouched original put back afterwards. Swapping tensors
    instead of copying values back leaves the originals at their autograd version, so a graph built
    inside the block stays usable afterwards.
    """
    toggled = [m for m in model.modules() if _honours_tracking_flag(m) and m.training and m.track_running_stats]
    untouched = {id(m) for m in toggled}
    swapped = []
    for module in model.modules():
        if id(module) in untouched:
            continue
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                swapped.append((module, name, buf))
                module._buffers[name] = buf.detach().clone()
    try:
        for m in toggled:
            m.track_running_stats = False
        yield
    finally:
        for m in toggled:
            m.track_running_stats = True
        for module, name, buf in swapped:
            module._buffers[name] = buf


def scalar_loss(loss_fn: Callable, outputs, targets) -> torch.Tensor:
    """``loss_fn(outputs, targets)``, checked to be a real scalar computed from ``outputs``.

    Bad input is a one-line :class:`~nasdiag.hessian.modes.CurvatureError`: a ``loss_fn`` that is not
    callable, that fails on these targets (a batch size other than the outputs', a shape the loss does not
    take; chained to the loss's own error), that returns a non-scalar or an integer, or that does not depend
    on ``outputs`` at all."""
    from nasdiag.hessian.modes import CurvatureError, CurvatureTypeError

    refuse_inference_mode("the curvature computation")  # every route takes its loss here
    if not callable(loss_fn):
        raise CurvatureTypeError(
            f"loss_fn must be callable as loss_fn(outputs, targets) -> scalar tensor (e.g. F.cross_entropy), got {type(loss_fn).__name__}"
        )
    try:
        loss = loss_fn(outputs, targets)
    except (RuntimeError, TypeError, ValueError, IndexError) as err:
        if isinstance(err, CurvatureError) or _traced(outputs):
            raise
        raise CurvatureError(
            f"loss_fn(outputs, targets) failed on outputs {_described(outputs)} and targets {_described(targets)} "
            f"({type(err).__name__}: {str(err).strip().splitlines()[0][:160] if str(err).strip() else ''}); "
            + _targets_hint(outputs, targets)
        ) from err
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise CurvatureError(
            f"loss_fn(outputs, targets) must return a scalar tensor, got {shape}; "
            "reduce over the batch (e.g. reduction='mean') before taking a Hessian"
        )
    if not torch.is_floating_point(loss):
        raise CurvatureError(
            f"loss_fn returned dtype {loss.dtype}; a Hessian needs a floating-point loss: compute it from the outputs "
            "without casting to an integer type"
        )
    if loss.is_meta:  # every later step reads values (.item(), a copy to the host): torch's errors there name none of this
        raise CurvatureError(
            "the loss is on the meta device (the model and batch have shapes but no values), so there is no curvature "
            "to compute; materialise the model (model.to_empty(device=...), then load the weights) and pass a batch with values"
        )
    if isinstance(outputs, torch.Tensor) and outputs.requires_grad and loss.grad_fn is None and loss is not outputs:
        raise CurvatureError(
            "loss_fn(outputs, targets) does not depend on the model outputs (it returned a tensor without an autograd "
            "graph to them, e.g. a constant or a detached value), so its Hessian is not one of the model; compute the "
            "loss from outputs"
        )
    return _nonfinite_kept(loss.reshape(()), outputs)


def _nonfinite_kept(loss: torch.Tensor, outputs) -> torch.Tensor:
    """``loss``, and where its value is NaN or inf, a loss whose every derivative through ``outputs`` is NaN.

    A NaN loss must not turn into a finite curvature: cross-entropy whose every target is ``ignore_index`` is NaN
    (0/0), yet torch's backward of it is exactly zero, so every route (HVPs, the output Hessian of the recursions,
    the GGN) would report a flat loss. Adding ``c·‖y − y.detach()‖²`` with ``c = 0`` (finite loss: value,
    gradient and Hessian unchanged, exactly) or ``c = NaN`` (non-finite loss) makes the gradient and Hessian NaN
    through every output ``y`` in the second case, in every route at once. No host sync (a ``torch.where``), so
    it runs under ``torch.func`` transforms and CUDA-graph capture alike. An output entry of ±inf (a masked class's
    −inf logit, whose cross-entropy is finite) takes no part: its y − y.detach() is inf − inf = NaN, which made the
    loss value and, through the parameters before it (a −inf bias), the curvature of a finite loss NaN."""
    leaves = [t for t in tree_leaves(outputs)
              if isinstance(t, torch.Tensor) and t.requires_grad and (torch.is_floating_point(t) or t.is_complex())]
    if not leaves:
        return loss
    flag = torch.where(torch.isfinite(loss.detach()), 0.0, float("nan")).to(loss.dtype)
    spread = sum(torch.where(torch.isfinite(t.detach()), t - t.detach(), torch.zeros_like(t)).abs().square().sum()
                 .to(loss.dtype) for t in leaves)
    return loss + flag * spread


def _described(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype}"
    return type(value).__name__


def _targets_hint(outputs, targets) -> str:
    if (isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor) and outputs.dim() > 0
            and targets.dim() > 0 and targets.shape[0] != outputs.shape[0]):
        return (f"the targets hold {targets.shape[0]} samples but the model returned {outputs.shape[0]}; "
                "pass the targets of the same batch as the inputs")
    return "pass targets that loss_fn accepts for these outputs (e.g. class indices (N,) for F.cross_entropy)"


def named_tensors(params, default_owner: nn.Module | None = None) -> List[Tuple[str, torch.Tensor]]:
    """Normalize ``params`` (tensors, ``(name, tensor)`` pairs or a ``{name: tensor}`` mapping) to pairs.

    ``None`` means ``default_owner.arch_parameters()``.
    """
    from nasdiag.hessian.modes import CurvatureError, CurvatureTypeError

    if params is None:
        getter = getattr(default_owner, "named_arch_parameters", None)
        if getter is not None:
            pairs = list(getter())
        elif hasattr(default_owner, "arch_parameters"):
            pairs = [(f"arch.{i}", p) for i, p in enumerate(default_owner.arch_parameters())]
        else:
            raise CurvatureError(
                f"{type(default_owner).__name__} has no arch_parameters(); pass params= explicitly "
                "(a list of tensors, (name, tensor) pairs or a {name: tensor} dict)"
            )
    elif isinstance(params, Mapping):
        pairs = list(params.items())
    elif isinstance(params, (str, torch.Tensor)):
        raise CurvatureTypeError(
            f"params must be a collection of tensors, (name, tensor) pairs or a {{name: tensor}} dict, got one "
            f"{type(params).__name__}; wrap it in a list, e.g. params=[model.alphas_normal]"
        )
    else:
        items = list(params)
        pairs = [p if isinstance(p, tuple) else (f"param.{i}", p) for i, p in enumerate(items)]
    if not pairs:
        raise CurvatureError(
            "params is empty: there is nothing to take a Hessian with respect to; pass the tensors (requires_grad) "
            "to differentiate, e.g. params=model.arch_parameters()"
        )
    def also(name, p) -> str:  # (refusals only) a tensor given without a name is called by the model's name for it too
        owned = {id(t): n for n, t in default_owner.named_parameters()} if isinstance(default_owner, nn.Module) else {}
        return f" (the model's {owned[id(p)]!r})" if id(p) in owned and owned[id(p)] != name else ""

    for name, p in pairs:
        if not isinstance(p, torch.Tensor):
            how = (f"; pass the tensor itself, e.g. dict(model.named_parameters())[{p!r}]" if isinstance(p, str)
                   else "; pass tensors, (name, tensor) pairs or a {name: tensor} dict")
            raise CurvatureTypeError(f"params[{name!r}] is a {type(p).__name__}, not a tensor{how}")
        if not p.requires_grad:
            raise CurvatureError(f"params[{name!r}]{also(name, p)} does not require grad; call .requires_grad_(True) on it first")
    first: dict = {}
    for name, p in pairs:
        if id(p) in first:  # the products would act on [[H, H], [H, H]]: every eigenvalue and the trace twice the tensor's
            where = "params" if params is not None else f"{type(default_owner).__name__}'s arch parameters"
            raise CurvatureError(
                f"{where} list one tensor twice ({first[id(p)]!r} and {name!r}{also(name, p)}), so its Hessian block "
                "would be counted twice (eigenvalues and trace doubled); pass each tensor once"
            )
        first[id(p)] = name
    return pairs


class HessianVectorProduct:
    """``v ↦ H v`` with H the Hessian of ``loss`` w.r.t. ``wrt`` (flattened and concatenated).

    Built from a loss whose graph is still alive; keeps that graph (and its memory) until this
    object is dropped. Products are exact (autograd, no finite differences) in the loss's dtype.

    Args:
        loss: scalar tensor.
        wrt: tensors the loss depends on; the Hessian acts on ``cat([t.flatten() for t in wrt])``.
        names: labels for error messages and warnings.
        context: ``() -> context manager`` entered around every backward (the gradient and each product), e.g.
            ``lambda: preserved_buffers(model)`` around the one the forward ran in: a block under
            ``torch.utils.checkpoint(..., use_reentrant=False)`` reruns its forward inside the backwards, where a
            train-mode BatchNorm must see the forward's settings (else torch's CheckpointError, and its running
            statistics updated).

    Call with ``v`` of shape ``(dim,)`` or a stack ``(m, dim)`` (m products, one vmapped backward).
    """

    def __init__(self, loss: torch.Tensor, wrt: Sequence[torch.Tensor], names: Sequence[str] | None = None,
                 context: Optional[Callable[[], object]] = None):
        self._context = context if context is not None else nullcontext
        self.wrt = list(wrt)
        self.names = list(names) if names is not None else [f"tensor {i}" for i in range(len(self.wrt))]
        self.sizes = [t.numel() for t in self.wrt]
        self.dim = sum(self.sizes)
        self.dtype = loss.dtype
        self.device = loss.device
        with torch.enable_grad(), self._context():  # under no_grad, the graph of the gradient would be dropped
            # a loss without a graph (the model ignores every tensor in `wrt`) depends on none of them
            grads = (torch.autograd.grad(loss, self.wrt, create_graph=True, allow_unused=True) if loss.requires_grad
                     else [None] * len(self.wrt))
            self.gradient = torch.cat(
                [(torch.zeros_like(t) if g is None else g).reshape(-1) for t, g in zip(self.wrt, grads)]
            )
        self.unused = [n for n, g in zip(self.names, grads) if g is None]
        # A loss linear in `wrt` leaves a gradient without a graph: its Hessian is exactly zero.
        self.is_zero = not self.gradient.requires_grad
        self._batched_ok = True
        self._batched_checked = False

    def _check_batched(self, V: torch.Tensor, out: torch.Tensor) -> None:
        """Raise RuntimeError if the first batched products disagree with one plain product. torch's legacy vmap
        behind ``is_grads_batched`` has wrong double-backward rules for some ops, and they can run without an error:
        through ``F.group_norm(x, 1)`` with batch size equal to the channel count (torch 2.13) the stacked
        products are off by about 100%. H is linear, so a random combination of the rows checks them all at once,
        for the price of one more product, once per operator."""
        self._batched_checked = True
        weights = torch.randn(V.shape[0], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        weights = weights.to(dtype=self.dtype, device=self.device)
        want = self._products(weights @ V, batched=False)
        got = weights @ out
        if not routes_agree(got, want, want.norm() + (weights.abs() @ out.abs()).norm()):
            raise RuntimeError("the batched products disagree with a plain one (a wrong vmap rule of torch for an "
                               "op's double backward)")

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        single = v.dim() == 1
        V = v.reshape(1, -1) if single else v
        if V.dim() != 2 or V.shape[1] != self.dim:
            from nasdiag.hessian.modes import CurvatureError

            raise CurvatureError(
                f"expected vectors of shape ({self.dim},) or (m, {self.dim}) (the flattened {', '.join(self.names)}), "
                f"got {tuple(v.shape)}; reshape them to that"
            )
        V = V.to(dtype=self.dtype, device=self.device)
        if self.is_zero:
            out = torch.zeros_like(V)
        elif V.shape[0] == 1:
            out = self._products(V[0], batched=False).unsqueeze(0)
        elif self._batched_ok:
            try:
                out = self._products(V, batched=True)
                if not self._batched_checked:
                    self._check_batched(V, out)
            except RuntimeError as err:  # an op of the graph has no vmap rule for its double backward, or a wrong one
                self._batched_ok = False
                warnings.warn(
                    f"batched Hessian-vector products failed ({err}); falling back to one product at a time "
                    "(same numbers, slower)",
                    RuntimeWarning,
                    stacklevel=2,
                )
                out = torch.stack([self._products(row, batched=False) for row in V])
        else:
            out = torch.stack([self._products(row, batched=False) for row in V])
        return out[0] if single else out

    def _products(self, V: torch.Tensor, batched: bool) -> torch.Tensor:
        with self._context():
            hv = torch.autograd.grad(  # no graph is built for these: grad mode does not matter
                self.gradient,
                self.wrt,
                grad_outputs=V,
                retain_graph=True,
                allow_unused=True,
                is_grads_batched=batched,
            )
        lead = (V.shape[0],) if batched else ()
        return torch.cat(
            [
                (torch.zeros(*lead, n, dtype=self.dtype, device=self.device) if h is None else h.reshape(*lead, n))
                for h, n in zip(hv, self.sizes)
            ],
            dim=-1,
        )


def functional_hvp(loss_of: Callable[[torch.Tensor], torch.Tensor], primal: torch.Tensor, *,
                   check: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    """``V ↦ V H`` for a stack ``V`` (m, n) of tangents, H the Hessian of ``loss_of`` at ``primal`` (n,).

    Forward-over-reverse: ``vmap(v ↦ jvp(grad(loss_of), primal, v))``. Each call re-runs the forward
    (once, batched over the m tangents). ``loss_of`` must be traceable by ``torch.func``.

    With ``check`` (default), the first call first compares one product along a random direction with
    autograd's reverse-over-reverse product (one forward and two backwards more, once): ``torch.func``'s
    forward-mode rules have been wrong without an error for some ops (``jvp(jvp)`` through train-mode
    BatchNorm in torch 2.13, docs/hessian.md), and ``exact`` is the reference the other modes are judged by.
    A disagreement raises :class:`~nasdiag.hessian.modes.CurvatureRuntimeError` (a ``RuntimeError``, on which
    the callers' ``backend="auto"`` falls back to reverse-over-reverse products).
    """
    grad_fn = torch.func.grad(loss_of)

    def column(v):
        return torch.func.jvp(grad_fn, (primal,), (v,))[1]

    batched = torch.func.vmap(column)
    checked = [not check]

    def products(V: torch.Tensor) -> torch.Tensor:
        if not checked[0]:
            checked[0] = True
            _check_against_reverse(loss_of, primal, batched)
        return batched(V)

    return products


def _check_against_reverse(loss_of, primal: torch.Tensor, batched) -> None:
    u = torch.randn(primal.numel(), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    u = u.to(dtype=primal.dtype, device=primal.device).reshape(primal.shape)
    got = batched(u.unsqueeze(0))[0]
    point = primal.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(loss_of(point), point, create_graph=True)
        want = (torch.autograd.grad(grad, point, u, allow_unused=True)[0] if grad.requires_grad else None)
    want = torch.zeros_like(got) if want is None else want
    if not routes_agree(got, want, want.norm() + got.norm()):
        from nasdiag.hessian.modes import CurvatureRuntimeError

        raise CurvatureRuntimeError(
            f"torch.func's forward-over-reverse product disagrees with autograd's reverse-over-reverse one "
            f"(relative difference {float(((got - want).norm() / want.norm().clamp_min(1e-300)).detach()):.2g}): a wrong "
            "forward-mode rule of torch for an op of this model; use backend='autograd'"
        )


def routes_agree(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether two routes to the same products agree: to 1e-8 of ``scale`` in float64, to 1e-2 in float32 (GPU
    convolutions may run in TF32, about 1e-3 off), to 32 ulp in float16/bfloat16 (3% and 25%: the two routes round
    differently, measured up to 0.5% and 4% apart); the faults this guards against are of order 1."""
    got, want = got.detach(), want.detach()
    finite = torch.isfinite(got)
    if not bool(finite.all()):  # a non-finite point (a NaN batch): both routes must be NaN/inf at the same entries,
        if not torch.equal(finite, torch.isfinite(want)):  # not a fault of torch's rules, and the rest must agree
            return False
        got, want = got[finite], want[finite]
        scale = got.norm() + want.norm()
    rel = 1e-8 if got.dtype == torch.float64 else max(1e-2, 32 * torch.finfo(got.dtype).eps)
    return bool((got - want).norm() <= rel * scale + torch.finfo(got.dtype).tiny)


# -- sizes and sources ------------------------------------------------------------------------------


class SavedBytes:
    """``with SavedBytes() as s: loss = ...``: ``s.bytes`` counts what the forward saved for backward
    (each storage once), the memory an exact Hessian-vector product multiplies (:data:`PRODUCT_FACTOR`
    per product: the saved tensors, their tangents, and the dual tensors the backward saves)."""

    def __init__(self):
        self.bytes = 0
        self._seen: set = set()
        self._ctx = None

    def _pack(self, t: torch.Tensor):
        try:
            key = (t.untyped_storage().data_ptr(), t.device)
        except (RuntimeError, NotImplementedError):  # tensors without storage (functorch wrappers)
            key = id(t)
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += t.numel() * t.element_size()
        # detached: a tensor an op saves as its own output still carries that op as grad_fn, and keeping it
        # would close a cycle through autograd's C++ graph (tensor -> grad_fn -> saved variable -> tensor) that
        # no garbage collection reclaims: every call would keep its forward graph alive. Lossless: autograd
        # stores the grad_fn with the saved variable and re-attaches it on unpacking (double backward too).
        return t.detach()

    def __enter__(self) -> "SavedBytes":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


#: bytes one Hessian-vector product holds per byte saved by the forward (see :class:`SavedBytes`): measured
#: 5.9-7.2 for vmapped forward-over-reverse products on the DARTS search cells (CPU, float32, chunks of 4-16;
#: peak resident memory over the forward's saved bytes), rounded up so a chunk sized by it fits
PRODUCT_FACTOR = 8


#: share of the memory free at the call that a batch of exact products may take when no ``max_memory`` is given
DEFAULT_MEMORY_SHARE = 0.5


def free_memory(device: torch.device) -> Optional[int]:
    """Bytes free for new tensors on ``device``: on CUDA the driver's free memory plus what torch's caching
    allocator holds unused; on a CPU the kernel's ``MemAvailable`` (Linux), or what the process's cgroup
    limit leaves if that is less; None where neither can be read."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    return memory.free_cpu_memory()


#: what a caller of an exact mode whose single product does not fit can use instead (its own ``instead=`` may say better)
INSTEAD_OF_EXACT = "use mode='ggn_mc' (one extra backward) or 'approx', a smaller batch, or raise max_memory"


def fit_chunk(saved_bytes: int, max_memory: Optional[int], chunk_size: int, what: str,
              device: Union[str, torch.device, None] = None, instead: str = INSTEAD_OF_EXACT,
              settable: bool = True) -> int:
    """The largest chunk ≤ ``chunk_size`` whose products fit ``max_memory`` bytes, or a one-line
    :class:`~nasdiag.hessian.modes.CurvatureError` with the estimate and what to use instead.

    ``max_memory=None`` caps at :data:`DEFAULT_MEMORY_SHARE` of :func:`free_memory` on ``device`` (no cap
    where that is unknown): a vmapped batch of products that exhausts the machine's memory is killed
    without a message, so the default is a cap, not none. ``settable``: as :func:`check_probe_memory`'s."""
    from nasdiag.hessian.modes import CurvatureError

    check_chunk_size(chunk_size, what)
    check_max_memory(max_memory, what)
    budget, limit = _memory_budget(max_memory, device, settable)
    if budget is None:
        return chunk_size
    per_product = PRODUCT_FACTOR * max(int(saved_bytes), 1)
    fits = budget // per_product
    if fits < 1:
        raise CurvatureError(
            f"{what}: one exact Hessian-vector product needs about {_size(per_product)} "
            f"({PRODUCT_FACTOR} x {_size(saved_bytes)} saved by the forward) but {limit}; {instead}"
        )
    return min(chunk_size, fits)


def _memory_budget(max_memory: Optional[int], device, settable: bool = True) -> Tuple[Optional[int], str]:
    """``(bytes, how the cap was set)``: ``max_memory``, else :data:`DEFAULT_MEMORY_SHARE` of the free memory on
    ``device``; ``(None, "")`` where that is unknown. ``settable``: whether the caller takes ``max_memory=``."""
    if max_memory is not None:
        return int(max_memory), f"max_memory is {_size(int(max_memory))}"
    free = free_memory(device) if device is not None else None
    if free is None:
        return None, ""
    budget = int(free * DEFAULT_MEMORY_SHARE)
    return budget, f"only {_size(budget)} are free for it (half the free memory{'; max_memory= sets the cap' if settable else ''})"


def check_probe_memory(n_bytes: int, max_memory: Optional[int], device, what: str, instead: str,
                       settable: bool = True) -> None:
    """A one-line :class:`~nasdiag.hessian.modes.CurvatureError` if the probe arrays of a Hutchinson estimate
    (``n_bytes``, held at once) do not fit the cap of :func:`fit_chunk`; an allocator failure (or a machine driven
    into swap by ``hutchinson:100000000``) otherwise. ``settable=False`` for a caller without ``max_memory=``
    (``diag_hessian``, the spectrum's Hutchinson diagonal, ``ggn_mc``): the line does not point to it."""
    from nasdiag.hessian.modes import CurvatureError

    budget, limit = _memory_budget(max_memory, device, settable)
    if budget is not None and n_bytes > budget:
        raise CurvatureError(f"{what}: its probes and their products need about {_size(n_bytes)} at once but {limit}; "
                             f"{instead}")


def check_chunk_size(chunk_size, what: str) -> None:
    """Refuse a ``chunk_size`` that is not an int >= 1 (a bool, a string, a float, zero or negative)."""
    from nasdiag.hessian.modes import CurvatureError, CurvatureTypeError

    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool):
        raise CurvatureTypeError(f"{what}: chunk_size must be an int >= 1 (products per vmapped pass), got {chunk_size!r} "
                                 f"({type(chunk_size).__name__}); pass e.g. chunk_size=8")
    if chunk_size < 1:
        raise CurvatureError(f"{what}: chunk_size must be an int >= 1 (products per vmapped pass), got {chunk_size}; "
                             "pass e.g. chunk_size=8")


def check_max_memory(max_memory, what: str) -> None:
    """Refuse a ``max_memory`` that is not None or a positive number of bytes."""
    from nasdiag.hessian.modes import CurvatureError, CurvatureTypeError

    if max_memory is None:
        return
    if not isinstance(max_memory, (int, float)) or isinstance(max_memory, bool):
        raise CurvatureTypeError(f"{what}: max_memory must be a number of bytes (or None for half the free memory), got "
                                 f"{max_memory!r} ({type(max_memory).__name__}); pass e.g. max_memory=2 * 2**30 for 2 GiB")
    if not 0 < max_memory < float("inf"):  # inf was int()'s OverflowError traceback
        raise CurvatureError(f"{what}: max_memory must be a positive finite number of bytes (or None for half the free memory), "
                             f"got {max_memory!r}; pass e.g. max_memory=2 * 2**30 for 2 GiB")


def _size(n_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{int(n_bytes)} bytes"


def leaf_sources(t: torch.Tensor, limit: int = 64) -> List[torch.Tensor]:
    """The leaf tensors (e.g. α) that ``t`` was computed from, found within ``limit`` autograd nodes."""
    if t.grad_fn is None:
        return [t] if t.requires_grad else []
    found, stack, seen = {}, [t.grad_fn], set()
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found[id(variable)] = variable
        stack.extend(n for n, _ in node.next_functions)
    return list(found.values())


def distinct_weights(n: int, like: torch.Tensor) -> torch.Tensor:
    """(n,) distinct values in [0.5, 1.5) (the golden-ratio sequence ``frac(i·φ⁻¹) + 0.5``), in ``like``'s dtype
    and on its device. Where a check needs weights that no structure of the model cancels: a fixed sequence
    draws nothing from torch's global generator (a diagnostic must not shift the caller's dropout masks or
    data order) and is made on the device (no host round trip, also under CUDA-graph capture)."""
    sequence = torch.arange(1, n + 1, dtype=torch.float32, device=like.device).mul_(0.6180339887498949).frac_()
    return sequence.add_(0.5).to(like.dtype)


def source_entries(t: torch.Tensor) -> set:
    """``{(id(leaf), flat index)}``: the entries of the leaves behind ``t`` that ``t`` depends on (nonzero
    gradient of ``⟨r, t⟩``; one small backward through the graph that made ``t``).

    ``r`` is a fixed irregular sequence, not ones: mixing weights are typically ``softmax(α)``, whose entries
    sum to 1 for every α, so the gradient of ``t.sum()`` is zero in exact arithmetic and its entries are
    nonzero only by round-off (shared α was then missed at random). ``∂⟨r, softmax(α)⟩/∂α_k = z_k (r_k − r·z)``
    vanishes only where ``r_k`` equals the weighted mean of ``r``, which a sequence of distinct values
    does not hit (and one entry of a shared row suffices to find the sharing). A NaN gradient entry is no evidence:
    a NaN in one row of α makes the softmax backward NaN over that row for any ``r``, also for an edge that reads
    another row, and a NaN α was then refused as shared instead of giving its NaN curvature."""
    leaves = leaf_sources(t)
    if not leaves:
        return set()
    r = distinct_weights(t.numel(), t).view_as(t)
    grads = torch.autograd.grad(t, leaves, grad_outputs=r, retain_graph=True, allow_unused=True)
    out = set()
    for leaf, g in zip(leaves, grads):
        if g is not None:
            out.update((id(leaf), int(i)) for i in torch.nonzero(g.reshape(-1).nan_to_num(nan=0.0)).reshape(-1).tolist())
    return out


def softmax_jacobian_ratio(z: torch.Tensor) -> Optional[float]:
    """How far ``z`` (K,) is from ``softmax(α)`` of the leaf parameters behind it: ``‖∂⟨r, z⟩/∂leaves‖`` over
    ``‖z ⊙ (r − r·z)‖``, the same norm for a softmax of the leaf itself (1 then; ``1/τ`` for ``softmax(α/τ)``).

    ``r`` is the fixed irregular sequence of :func:`source_entries`; a norm, so the order of the leaf's entries
    does not matter. ``None`` where ``z`` has no graph to a leaf (nothing to check)."""
    leaves = leaf_sources(z)
    if z.grad_fn is None or not leaves:
        return None
    r = distinct_weights(z.numel(), z).view_as(z)
    grads = torch.autograd.grad(z, leaves, grad_outputs=r, retain_graph=True, allow_unused=True)
    got = sum(float(g.detach().double().square().sum()) for g in grads if g is not None)
    zd, rd = z.detach().double(), r.double()
    expected = float((zd * (rd - (rd * zd).sum())).square().sum())
    if expected == 0.0:
        return None
    return (got / expected) ** 0.5


def exact_diagonal(
    products: Callable[[torch.Tensor], torch.Tensor], dim: int, dtype, device, chunk_size: int = 64
) -> torch.Tensor:
    """``diag H`` (dim,) from ``products(V) = V H`` over the identity, ``chunk_size`` basis vectors at a time."""
    diag = torch.empty(dim, dtype=dtype, device=device)
    eye = torch.eye(dim, dtype=dtype, device=device)
    for start in range(0, dim, chunk_size):
        stop = min(start + chunk_size, dim)
        rows = products(eye[start:stop])
        diag[start:stop] = torch.diagonal(rows[:, start:stop]).detach()
    return diag
