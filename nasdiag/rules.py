"""The one per-module rule registry: what nasdiag knows about a module type, and the one lookup rule.

A module type can carry rules for two aspects, each registered once per type:

* ``"hessian"``: a :class:`nasdiag.hessian.HessianRule`, the derivative maths of the diagonal
  recursions (bayesnas-appendix C.1-C.2): the squared Jacobian-transpose product ``(J∘J)ᵀ h``, the
  residual ``Σ_o g_o ∂²y_o/∂x²`` and the parameter diagonals (from the parameter Jacobian);
* ``"homogeneity"``: ``rule(module, analyse) -> Homogeneity``, the degree of positive homogeneity
  (wiring supplement §4, Thm. 1: an op with f(c·x) = f(x) passes back no cost) and how the module
  treats an additive term that is constant along some axes (a bias), which is what decides whether a
  following normalization removes that term.

Lookup (:meth:`RuleRegistry.lookup`, the same for both aspects): per-call overrides by exact type,
then the registered type nearest in the MRO, as long as the module's class does not rewrite
``forward`` (or a convolution's ``_conv_forward``) relative to it (a class defined inside ``torch.nn`` belongs to its
base's family, e.g. ``nn.Conv2d`` under ``_ConvNd``; ``torch.ao``'s fused and quantization-aware subclasses do not).
A miss is ``None``; callers raise :class:`UnsupportedModuleError` with :func:`unsupported_message`.

The reference supernet registers the rules of its own ops (``nasdiag.supernet.ops``), so neither
``nasdiag.cost`` nor ``nasdiag.hessian`` imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Dict, FrozenSet, List, Mapping, Optional, Tuple, Type

import torch
from torch import nn

from nasdiag.errors import NasdiagError

__all__ = [
    "ASPECTS",
    "REGISTRY",
    "RuleRegistry",
    "UnsupportedModuleError",
    "Homogeneity",
    "analyse",
    "compose",
    "degree_rule",
    "delegate_rule",
    "sequential_rule",
    "unsupported_message",
    "input_rank",
    "input_ranks_of",
    "BATCH",
    "CHANNEL",
    "SPATIAL",
]

ASPECTS = ("hessian", "homogeneity")


class UnsupportedModuleError(NasdiagError, NotImplementedError, TypeError):
    """A module (or an autograd op between modules) has no rule for what was asked of it. The message
    names the module, lists the supported types and says how to register a rule."""


class LazyModuleError(NasdiagError, ValueError):
    """A module with uninitialized lazy parameters or buffers (``nn.LazyConv2d`` before its first forward), which a
    forward run only to learn something about the module would create."""


#: the methods through which torch's modules compute their forward; a subclass that rewrites one has no rule by descent
_FORWARD_METHODS = ("forward", "_conv_forward")


class RuleRegistry:
    """``{aspect: {module type: rule}}`` with one lookup rule (see the module docstring)."""

    def __init__(self):
        self.tables: Dict[str, Dict[Type[nn.Module], object]] = {aspect: {} for aspect in ASPECTS}

    def table(self, aspect: str) -> Dict[Type[nn.Module], object]:
        if aspect not in self.tables:
            raise ValueError(f"unknown rule aspect {aspect!r}; choose one of {ASPECTS}")
        return self.tables[aspect]

    def register(self, aspect: str, module_type: Type[nn.Module], rule, *, overwrite: bool = False, how: str = "") -> None:
        if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
            raise TypeError(f"module_type must be an nn.Module subclass, got {module_type!r}")
        table = self.table(aspect)
        if module_type in table and not overwrite:
            raise ValueError(
                f"a {aspect} rule for {module_type.__name__} is already registered (exists); pass overwrite=True to "
                f"replace it{how}"
            )
        table[module_type] = rule

    def lookup(self, module: nn.Module, aspect: str, overrides: Optional[Mapping[type, object]] = None):
        """The rule of ``aspect`` for ``module``, or None (see the module docstring for the rule)."""
        cls = type(module)
        if overrides:
            rule = overrides.get(cls)
            if rule is not None:
                return rule
        table = self.table(aspect)
        rule = table.get(cls)
        if rule is not None:
            return rule
        for base in cls.__mro__[1:]:
            if base is nn.Module:
                break
            if base in table:
                # A subclass written outside torch.nn that rewrites forward, or a method its forward computes through (a
                # convolution's _conv_forward: weight standardization), is another function; so are torch.ao's
                # quantization-aware and fused ones (LinearReLU, ConvBn2d: a ReLU or a BatchNorm inside the call).
                if not cls.__module__.startswith("torch.nn.") and any(
                        getattr(cls, m, None) is not getattr(base, m, None) for m in _FORWARD_METHODS):
                    return None
                return table[base]
        return None

    def supported(self, aspect: str, overrides: Optional[Mapping[type, object]] = None) -> List[str]:
        """Names of the module types with a rule of ``aspect`` (``nn.Conv2d``, ``package.Module``), sorted."""
        types = set(self.table(aspect)) | set(overrides or {})
        return sorted(type_name(t) for t in types)


#: the registry every quantity is built on (like BackPACK's per-module derivatives)
REGISTRY = RuleRegistry()


def type_name(t: type) -> str:
    return f"nn.{t.__name__}" if t.__module__.startswith("torch.nn") else f"{t.__module__}.{t.__qualname__}"


def unsupported_message(aspect: str, name: str, module: nn.Module, why: str, how: str, overrides=None, table: str = "hessian") -> str:
    """One line: which module (qualified name and type), why, the supported types of the registry's
    ``table`` and how to register a rule."""
    return (
        f"module {name or '<root>'!r} ({type_name(type(module))}) {why}. "
        f"Modules with a {aspect} rule: {', '.join(REGISTRY.supported(table, overrides))}. {how}"
    )


# --- homogeneity (wiring supplement §4, Thm. 1; §8.1-8.2) --------------------------------------------

#: Axes an additive term can be constant along, in the conv-style layout (batch, channel, *spatial) that
#: the normalizations use: dim 0, dim 1, dims 2 and on. On a 2-D tensor (batch, features) there is no
#: spatial dim, so "constant along space" holds of any term there. ``nn.Linear`` acts on the last dim:
#: the channel of a 2-D input, a spatial dim of a higher-rank one; its rule needs the input's rank.
BATCH, CHANNEL, SPATIAL = "batch", "channel", "spatial"
ALL_AXES: FrozenSet[str] = frozenset((BATCH, CHANNEL, SPATIAL))
Axes = FrozenSet[str]


@dataclass(frozen=True)
class Homogeneity:
    """What one module (or a composition) does to a positive rescaling of its input and to an additive term.

    ``f(c·x) = c^d f(x) + o(c)``, where ``o`` is an additive term constant along ``offset`` (absent when
    ``offset`` is None), for all c > 0.

    Attributes:
        degree: d; 0 means scale-invariant; None: not homogeneous.
        reason: a short human-readable derivation.
        invariant_by: the module that makes the op scale-invariant (the first normalization that removes
            everything before it, or a ``Zero``), None when not invariant.
        offset: axes along which the module's own additive term (bias) is constant, None if it adds none (for a
            normalization: its β, added after the statistics; a bias before it is what ``removes`` is about).
        keeps: an additive term on the input that is constant along axes A comes out as an additive term
            constant along ``A ∩ keeps`` (linear maps, max pooling); None: the module does not pass an
            additive term through as one (ReLU: relu(y + o) ≠ relu(y) + o').
        needs: ``keeps`` holds only if the incoming term is constant along these axes (max pooling: spatial).
        removes: for a normalization (degree 0): an incoming term constant along these axes (its
            normalization groups) is removed exactly (the mean subtraction takes it, the variance ignores it).
        vacuous: axes the output has no dims along (``nn.Flatten`` to (batch, features): no spatial dim), so
            any term is constant along them: a passed term comes out constant along ``(A ∩ keeps) ∪ vacuous``.
        mixes: axes along which the module combines entries (a convolution: channel and space; ReLU: none).
            A positive factor constant along them passes: ``f(a ⊙ y) = a^d ⊙ f(y)``. None: it does not pass
            (not homogeneous, or unknown). For a normalization (degree 0): its groups; for a composition that
            ends in one, also what the modules before it mix. It divides out a factor constant along them.
        reshapes: the module only moves entries (``nn.Flatten``): constancy of a factor along axes maps as a
            term's does; for any other module a passed factor keeps its axes.
        merges_channel: the module merges the channel dim with spatial dims into its new channel dim (``nn.Flatten()``
            to (batch, features)): a term constant along channel and space (one number per sample) stays constant
            along the new channel dim.
        stats: for a normalization, the axes its statistics are constant along (batch norm: batch and space;
            group norm with one group: channel and space). When it does not remove an incoming term it still
            divides out a positive factor constant within its groups, and what comes out is a new positive factor
            constant along ``stats`` times a fixed function of the input, plus a term constant along
            ``A ∩ keeps`` (``keeps``: the statistics' and the affine map's constant axes).
        factor: for a composition that is not homogeneous in the plain sense (``degree`` None) but rescales:
            ``f(c·x) = a(c) ⊙ g(x) + o(c)`` with a positive ``a(c)`` constant along these axes (one per sample
            after a group norm with one group whose incoming bias it did not remove). A later normalization whose
            groups lie within them, and that removes ``o``, makes the composition invariant. None otherwise.
    """

    degree: Optional[float]
    reason: str
    invariant_by: Optional[nn.Module] = None
    offset: Optional[Axes] = None
    keeps: Optional[Axes] = field(default=None)
    needs: Axes = frozenset()
    removes: Optional[Axes] = None
    vacuous: Axes = frozenset()
    mixes: Optional[Axes] = None
    reshapes: bool = False
    merges_channel: bool = False
    stats: Optional[Axes] = None
    factor: Optional[Axes] = None

    @property
    def invariant(self) -> bool:
        return self.degree == 0

    def passes(self, term: Axes) -> Optional[Axes]:
        """Axes along which an incoming additive term constant along ``term`` stays constant after this
        module, or None when it no longer is an additive term. For a degree-0 module use :meth:`removes_term`."""
        if self.keeps is None or not self.needs <= term:
            return None
        merged = frozenset((CHANNEL,)) if self.merges_channel and {CHANNEL, SPATIAL} <= term else frozenset()
        return (term & self.keeps) | self.vacuous | merged

    def removes_term(self, term: Axes) -> bool:
        return self.degree == 0 and self.removes is not None and self.removes <= term

    def passes_factor(self, factor: Axes) -> Optional[Axes]:
        """Axes along which a positive factor constant along ``factor`` on the input is constant on the output,
        or None when the module does not pass it (it mixes entries the factor differs on, or is not homogeneous).
        For a normalization use :meth:`divides_factor`."""
        if self.degree is None or self.degree == 0 or self.mixes is None or not self.mixes <= factor:
            return None
        return self.passes(factor) if self.reshapes else factor

    def divides_factor(self, factor: Optional[Axes]) -> bool:
        """Whether a normalization divides out a positive factor constant along ``factor`` (None: a plain power
        of c, constant everywhere): each of its groups must see one value of it."""
        # a composition ending in a normalization (nn.Sequential(conv, InstanceNorm)) divides it out only if the
        # modules before the normalization pass it, which ``mixes`` records: a channel-mixing conv does not pass a
        # factor that differs between channels (one per group of GroupNorm(2, 4))
        return self.degree == 0 and (factor is None or (self.removes is not None and self.removes <= factor
                                                        and self.mixes is not None and self.mixes <= factor))

    def after_normalization(self, term: Axes, factor: Optional[Axes]) -> Optional[Tuple[Axes, Axes]]:
        """``(term, factor)`` axes that come out of a normalization that does not both remove the incoming term
        and divide out the incoming factor (see ``stats``), or None when that is not known (a LayerNorm at an
        unknown rank). Within one group its statistics μ, σ are numbers, so it is the affine map
        y ↦ γ (y − μ)/σ + β there: a ⊙ g + o comes out as (a/σ) ⊙ γg + (γ(o − μ)/σ + β), a positive factor
        constant along ``factor ∩ stats`` and a term constant along ``term ∩ keeps``. (Factor and term may
        depend on the input as well as on c: a later normalization removes them all the same, as long as they
        are constant within each of its groups.)"""
        if self.degree != 0 or self.stats is None or self.keeps is None:
            return None
        return term & self.keeps, self.stats if factor is None else self.stats & factor


HomogeneityRule = Callable[[nn.Module, Callable[[nn.Module], Homogeneity]], Homogeneity]


def analyse(module: nn.Module, input_ranks: Optional[Mapping[nn.Module, int]] = None) -> Homogeneity:
    """Homogeneity of ``module`` as a function of its (single) input, from its structure.

    Args:
        module: the op.
        input_ranks: ``{submodule: rank of the tensor it is called on}`` where known (e.g. from one forward,
            :func:`input_ranks_of`). Rules whose answer depends on it (``nn.Linear``, which acts on the last
            dim; ``nn.LayerNorm`` over fewer dims than channel and space) take the answer that holds at every
            rank where it is missing.

    Raises:
        UnsupportedModuleError: a module on the path has no homogeneity rule (names it, lists the supported ones).
    """
    return _Analyser(dict(input_ranks or {}))(module)


class _Analyser:
    """:func:`analyse` bound to the known input ranks; rules receive it as their ``analyse`` argument."""

    def __init__(self, input_ranks: Dict[nn.Module, int]):
        self.input_ranks = input_ranks

    def __call__(self, module: nn.Module) -> Homogeneity:
        rule = REGISTRY.lookup(module, "homogeneity")
        if rule is None:
            cls = type(module)
            raise UnsupportedModuleError(
                f"no homogeneity rule for module type {cls.__module__}.{cls.__name__}, so its scale invariance "
                f"cannot be decided. Supported: {', '.join(REGISTRY.supported('homogeneity'))}. Register one with "
                f"nasdiag.cost.register_homogeneity_rule({cls.__name__}, rule), e.g. "
                f"nasdiag.cost.delegate_rule('op') for a wrapper whose forward is self.op(x), or "
                f"nasdiag.cost.degree_rule(1.0, 'why') for a positively homogeneous map."
            )
        return rule(module, self)

    def input_rank(self, module: nn.Module) -> Optional[int]:
        return self.input_ranks.get(module)


def input_ranks_of(module: nn.Module, example_input) -> Dict[nn.Module, int]:
    """``{submodule: rank of its first input}`` from one forward of ``module`` on ``example_input`` (a tensor or
    a tuple of arguments), for :func:`analyse`. No gradient is taken, buffers (BatchNorm's running statistics)
    and the global random generators (a train-mode dropout draws from them) are restored and the hooks removed on
    every path; the forward runs on copies of the example tensors (an in-place ReLU first would change the caller's
    batch). A submodule called at two ranks is left out (unknown). A module with uninitialized lazy parameters or
    buffers (``nn.LazyConv2d`` before its first forward) is a ``LazyModuleError``: the forward would materialize them."""
    seen: Dict[nn.Module, Optional[int]] = {}

    def record(sub, args):
        rank = args[0].dim() if args and isinstance(args[0], torch.Tensor) else None
        seen[sub] = rank if seen.get(sub, rank) == rank else None

    from nasdiag.hooks import Hooks

    lazy = next((name for name, t in [*module.named_parameters(), *module.named_buffers()]
                 if isinstance(t, nn.parameter.UninitializedTensorMixin)), None)
    if lazy is not None:  # the forward would materialize it (its init drawing from the generators restored after)
        raise LazyModuleError(f"example input: the module's {lazy!r} is an uninitialized lazy parameter or buffer, which the "
                        "example's forward would create; run one forward of the model first, or pass no example input")
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    rng = torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)
    hooks = Hooks()
    for sub in module.modules():
        hooks.forward_pre(sub, record)
    try:
        with hooks, torch.no_grad():
            args = example_input if isinstance(example_input, tuple) else (example_input,)
            module(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])
    return {sub: rank for sub, rank in seen.items() if rank is not None}


def input_rank(analyse: Callable, module: nn.Module) -> Optional[int]:
    """The rank of ``module``'s input as known to ``analyse`` (None if unknown, or for a plain function)."""
    known = getattr(analyse, "input_rank", None)
    return known(module) if known is not None else None


def compose(parts: List[Tuple[str, Homogeneity]]) -> Homogeneity:
    """Homogeneity of f_n ∘ ... ∘ f_1 given each f_i's (``parts`` in application order).

    Degrees multiply; an additive term (a bias) is carried along the axes each module keeps it constant
    on. A degree-0 module (a normalization with the statistics of its own input) makes the composition
    invariant if nothing before it was non-homogeneous and any additive term is constant over its
    normalization groups (then it is removed: f(c x) = N(c^d y + o) = N(c^d y) = N(y)); nothing after it matters.
    A normalization that does not remove the term still divides out the scale: N(c^d y + o) = a(c) ⊙ g(y) + o'(c)
    with a positive a(c) constant within its groups (group norm with one group: one per sample). That factor
    passes modules that do not mix entries it differs on (ReLU, convolutions, pools for a per-sample factor),
    and a later normalization with groups inside it that removes o' makes the composition invariant
    (conv(bias) → GroupNorm(1, C) → InstanceNorm).
    """
    degree: Optional[float] = 1.0
    factor: Optional[Axes] = None  # with degree None: the axes a positive non-power factor a(c) is constant along
    term: Optional[Axes] = None  # axes along which the additive term so far is constant
    # how the composition treats a term on ITS input: kept along `keeps` (and constant along `vacuous`) if
    # constant along `needs`; (((A ∩ K1) ∪ V1) ∩ K2) ∪ V2 = (A ∩ K1 ∩ K2) ∪ (V1 ∩ K2) ∪ V2
    keeps: Optional[Axes] = ALL_AXES
    needs: Axes = frozenset()
    vacuous: Axes = frozenset()
    mixes: Optional[Axes] = frozenset()  # what the whole composition mixes, for a factor to pass it
    steps = []
    for name, h in parts:
        steps.append(f"{name}[{'not homogeneous' if h.degree is None else f'degree {h.degree:g}'}]")
        before = mixes  # what the parts so far mix
        mixes = None if mixes is None or h.mixes is None or h.reshapes else mixes | h.mixes
        if h.degree is None and h.factor is not None:  # a part that rescales (itself a composition)
            if degree is None or term is not None:
                degree = factor = term = None
            else:  # c^d x in: a(c^d) ⊙ g(x) + o out
                degree, factor, term, keeps = None, h.factor, h.offset, None
            continue
        if h.degree == 0:
            if degree is None and factor is None:
                return Homogeneity(None, " -> ".join(steps) + ": not homogeneous before the invariant map")
            if not h.divides_factor(factor) or (term is not None and not h.removes_term(term)):
                after = h.after_normalization(ALL_AXES if term is None else term, factor)  # no term: −μ/σ's
                if after is None:
                    return Homogeneity(
                        None, " -> ".join(steps) + f": an additive term constant only along {sorted(term or ())} is not "
                        f"removed, or a scale factor constant only along {sorted(factor or ())} is not divided out"
                    )
                # what a term on the composition's input does past here is not tracked: none is said to be removed
                degree, (term, factor), keeps = None, after, None
                steps[-1] += f"(keeps a term; rescales per {sorted(factor)})"
                continue
            removes = None
            if keeps is not None and h.removes is not None and h.removes - vacuous <= keeps:
                removes = (h.removes - vacuous) | needs
            why = f"invariant ({h.reason}" + (", which removes the bias before it)" if term is not None else ")")
            return Homogeneity(0.0, " -> ".join(steps) + ": " + why, h.invariant_by, removes=removes,
                               mixes=None if before is None or h.mixes is None else before | h.mixes)
        if keeps is not None:
            if h.keeps is None or not h.needs - vacuous <= keeps:
                keeps = None
            else:
                keeps, needs, vacuous = keeps & h.keeps, needs | (h.needs - vacuous), (vacuous & h.keeps) | h.vacuous
        if term is not None:
            term = h.passes(term)
            if term is None:
                degree = factor = None
        if factor is not None:
            factor = h.passes_factor(factor)
        elif h.degree is None or degree is None:
            degree = None
        else:
            degree *= h.degree
        if h.offset is not None and (degree is not None or factor is not None):
            term = h.offset if term is None else term & h.offset
    if degree is None:
        if factor is not None:
            return Homogeneity(None, " -> ".join(steps) + f": rescales by a factor constant along {sorted(factor)}",
                               offset=term, factor=factor)
        return Homogeneity(None, " -> ".join(steps))
    why = ": affine (an additive term remains)" if term is not None else ""
    return Homogeneity(degree, " -> ".join(steps) + why, offset=term, keeps=keeps, needs=needs, vacuous=vacuous,
                       mixes=mixes)


def degree_rule(degree: Optional[float], why: str, *, keeps: Optional[Axes] = None, needs: Axes = frozenset(),
                mixes: Optional[Axes] = None) -> HomogeneityRule:
    """A rule that returns a fixed degree (``0`` makes the module itself the invariance source and removes
    any additive term before it, like a module with constant output). ``keeps``/``needs``/``mixes``: see
    :class:`Homogeneity` (``mixes`` None, the default: a positive factor is not known to pass)."""

    def rule(module, analyse):
        return Homogeneity(
            degree,
            f"{type(module).__name__}: {why}",
            module if degree == 0 else None,
            keeps=keeps,
            needs=needs,
            removes=frozenset() if degree == 0 else None,
            mixes=frozenset() if degree == 0 and mixes is None else mixes,  # a constant output divides out anything
        )

    return rule


def sequential_rule(module: nn.Module, analyse) -> Homogeneity:
    """A nested ``nn.Sequential`` is composed as the run of its children (the same function): a term or a factor
    entering it is then followed module by module, not through the summary of the inner composition."""
    return compose(_sequential_parts(module, analyse, ""))


def _sequential_parts(module: nn.Module, analyse, prefix: str) -> List[Tuple[str, Homogeneity]]:
    parts = []
    for i, child in enumerate(module):
        if REGISTRY.lookup(child, "homogeneity") is sequential_rule:
            parts += _sequential_parts(child, analyse, f"{prefix}{i}.")
        else:
            parts.append((f"{prefix}{i}:{type(child).__name__}", analyse(child)))
    return parts


def delegate_rule(attr: str) -> HomogeneityRule:
    """For a wrapper whose forward is ``return self.<attr>(x)`` (e.g. DARTS ``ReLUConvBN.op``)."""

    def rule(module, analyse):
        child = getattr(module, attr)
        h = analyse(child)
        return replace(h, reason=f"{type(module).__name__}.{attr}: {h.reason}")

    return rule


def _register_homogeneity(module_type, rule) -> None:
    REGISTRY.register("homogeneity", module_type, rule)


def _affine_layer(module, analyse):
    """``nn.Conv*``: linear in x; a bias adds a term constant along batch and space. ``nn.Linear``: the same
    on a 2-D input; on a higher-rank one it mixes the last (a spatial) dim, so its bias and what it passes
    on are constant along batch and channel only; at an unknown rank, along batch only (what holds at all)."""
    has_bias = getattr(module, "bias", None) is not None
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        # a transposed convolution scatters each input pixel through the whole kernel: the border pixels of the
        # output sum fewer taps, and with stride each output pixel takes another tap, so a constant input comes
        # out as a pattern (constant only for a 1x1 kernel at stride 1, a 1x1 convolution); output_padding appends
        # rows no input tap reaches (0 there, W·o elsewhere), so with it no constant stays one
        pointwise = (all(k == 1 for k in module.kernel_size) and all(s == 1 for s in module.stride)
                     and not any(module.output_padding))
        keeps = frozenset((BATCH, SPATIAL)) if pointwise else frozenset((BATCH,))
        offset = frozenset((BATCH, SPATIAL))
        mixes = _conv_mixes(module)
        where = ""
    elif isinstance(module, nn.modules.conv._ConvNd):
        # W * o of a term o: still constant along batch; along space unless zero padding changes the borders
        unpadded = module.padding == "valid" or (not isinstance(module.padding, str) and not any(module.padding))
        keeps = frozenset((BATCH, SPATIAL)) if unpadded or module.padding_mode != "zeros" else frozenset((BATCH,))
        offset = frozenset((BATCH, SPATIAL))
        mixes = _conv_mixes(module)
        where = ""
    else:
        rank = input_rank(analyse, module)
        offset = keeps = {2: frozenset((BATCH, SPATIAL)), None: frozenset((BATCH,))}.get(rank, frozenset((BATCH, CHANNEL)))
        mixes = {2: frozenset((CHANNEL,)), None: frozenset((CHANNEL, SPATIAL))}.get(rank, frozenset((SPATIAL,)))
        where = f" on a rank-{rank} input" if rank is not None else " on an input of unknown rank"
    what = f"with bias (affine: a term constant along {', '.join(sorted(offset))})" if has_bias else "without bias (linear)"
    return Homogeneity(1.0, f"{type(module).__name__}{where} {what}", offset=offset if has_bias else None, keeps=keeps,
                       mixes=mixes)


def _conv_mixes(module) -> Axes:
    # a depthwise convolution (one input channel per group) keeps channels apart; a 1x1 kernel keeps positions apart
    depthwise = module.groups == module.in_channels
    pointwise = all(k == 1 for k in module.kernel_size)
    return frozenset(() if depthwise else (CHANNEL,)) | frozenset(() if pointwise else (SPATIAL,))


def _norm_groups(module: nn.Module, rank: Optional[int] = None) -> Axes:
    """The axes of one normalization group: a term constant along all of them is removed."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return frozenset((BATCH, SPATIAL))
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return frozenset((SPATIAL,))
    if isinstance(module, nn.GroupNorm):
        return frozenset((SPATIAL,)) if module.num_groups == module.num_channels else frozenset((CHANNEL, SPATIAL))
    # LayerNorm: the normalized trailing dims. Over fewer than channel and space (e.g. (H, W)), it removes a
    # term constant along space; over channel and space, one constant along both; over the batch dim too, all.
    normalized = len(module.normalized_shape)
    if rank is not None and normalized >= rank:
        return ALL_AXES
    if rank is not None and normalized <= rank - 2:
        return frozenset((SPATIAL,))
    return frozenset((CHANNEL, SPATIAL))


def _norm_statistics(module: nn.Module, rank: Optional[int] = None) -> Tuple[Optional[Axes], Axes]:
    """``(stats, affine_keeps)``: the axes the statistics of one normalization group are constant along (None:
    not known at an unknown rank), and those its learned affine map (if any) is constant along."""
    per_channel_affine = frozenset((BATCH, SPATIAL)) if getattr(module, "affine", False) else ALL_AXES
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return frozenset((BATCH, SPATIAL)), per_channel_affine
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return frozenset((SPATIAL,)), per_channel_affine
    if isinstance(module, nn.GroupNorm):
        # channel groups between one and all: the statistics change across groups, which no axis here describes
        return (frozenset((CHANNEL, SPATIAL)) if module.num_groups == 1 else frozenset((SPATIAL,))), per_channel_affine
    normalized = len(module.normalized_shape)
    if rank is None:
        return None, frozenset()
    stats = ALL_AXES if normalized >= rank else {rank - 1: frozenset((CHANNEL, SPATIAL)), rank - 2: frozenset((SPATIAL,))}.get(normalized, frozenset())
    # an elementwise affine map over the normalized dims is constant along the others (a spatial dim left
    # out still leaves "all of space" varying)
    elementwise = frozenset((BATCH,)) | (frozenset((CHANNEL,)) if normalized <= rank - 2 else frozenset())
    return stats, elementwise if getattr(module, "elementwise_affine", False) else ALL_AXES


def _normalization(module, why: str, rank: Optional[int] = None) -> Homogeneity:
    stats, affine_keeps = _norm_statistics(module, rank)
    groups = _norm_groups(module, rank)
    return Homogeneity(0.0, f"{type(module).__name__} {why}", module, removes=groups, stats=stats,
                       keeps=None if stats is None else stats & affine_keeps, mixes=groups,
                       offset=_norm_bias_axes(module, rank))


def _norm_bias_axes(module: nn.Module, rank: Optional[int]) -> Optional[Axes]:
    # β: one per channel (BatchNorm, InstanceNorm, GroupNorm), one per normalized entry (LayerNorm: constant along
    # the channel too when it normalizes only spatial dims, e.g. over L of (B, C, L)); None without a bias
    if getattr(module, "bias", None) is None:
        return None
    if not isinstance(module, nn.LayerNorm):
        return frozenset((BATCH, SPATIAL))
    spatial_only = rank is not None and len(module.normalized_shape) <= rank - 2
    return frozenset((BATCH, CHANNEL)) if spatial_only else frozenset((BATCH,))


def _running_statistics_affine(module):
    # x ↦ γ (x − running mean)/σ + β per channel: affine, a per-channel term stays one
    return Homogeneity(
        1.0,
        f"{type(module).__name__} in eval mode with running statistics (affine map)",
        offset=frozenset((BATCH, SPATIAL)),
        keeps=frozenset((BATCH, SPATIAL)),
        mixes=frozenset(),
    )


def _batch_norm(module, analyse):
    # as nn.BatchNorm*'s forward decides it: batch statistics in training or without running buffers; an eval-mode
    # layer whose track_running_stats was turned off after construction still normalizes with its buffers (affine)
    if module.training or (module.running_mean is None and module.running_var is None):
        return _normalization(module, "with batch statistics")
    return _running_statistics_affine(module)


def _instance_norm(module, analyse):
    if module.track_running_stats and not module.training:
        return _running_statistics_affine(module)
    return _normalization(module, "(per-sample statistics)")


def _group_norm(module, analyse):
    return _normalization(module, "(per-sample group statistics)")


def _layer_norm(module, analyse):
    return _normalization(module, "(per-sample statistics)", input_rank(analyse, module))


def _dropout(module, analyse):
    # In training, y = m ⊙ x / (1 − p) with a mask m drawn per call: positively homogeneous for that mask, but an
    # additive term comes out multiplied by the mask, constant along nothing (elementwise dropout) or along space
    # (channel dropout: one mask entry per sample and channel).
    if not module.training or module.p == 0:
        return Homogeneity(1.0, f"{type(module).__name__} in eval mode (identity)", keeps=ALL_AXES, mixes=frozenset())
    channelwise = isinstance(module, (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d))
    return Homogeneity(1.0, f"{type(module).__name__} in training (a random mask)",
                       keeps=frozenset((SPATIAL,)) if channelwise else None, mixes=frozenset())


def _flatten(module, analyse):
    # A reshape. Merging only spatial dims (start_dim >= 2, e.g. (B, C, H, W) -> (B, C, H·W) before a
    # BatchNorm1d) keeps a term's constancy along every axis; merging the channel in keeps it along batch
    # (and along the spatial dims left, if any); to (batch, features) the result has no spatial dim.
    rank = input_rank(analyse, module)
    start, end = module.start_dim, module.end_dim
    if rank is not None:
        start, end = start % rank, end % rank
    if start >= 2 or start == end >= 0:
        return Homogeneity(1.0, f"{type(module).__name__}: a reshape of the spatial dims", keeps=ALL_AXES,
                           mixes=frozenset(), reshapes=True)
    if start != 1:  # the batch dim merged (or a negative start_dim at an unknown rank): keep nothing
        return Homogeneity(1.0, f"{type(module).__name__}: a reshape", keeps=frozenset(), mixes=frozenset(), reshapes=True)
    to_2d = end == -1 or (rank is not None and end == rank - 1)
    spatial_left = not to_2d and end >= 0
    return Homogeneity(1.0, f"{type(module).__name__}: a reshape",
                       keeps=frozenset((BATCH, SPATIAL)) if spatial_left else frozenset((BATCH,)),
                       vacuous=frozenset((SPATIAL,)) if to_2d else frozenset(), mixes=frozenset(), reshapes=True,
                       merges_channel=True)


def _padding(module, analyse):
    # pad(c·x, v) = c·pad(x, 0) + v·(1 on the border): linear for v = 0, affine otherwise, with a term constant
    # along batch and channel (the border is the same in every sample and channel)
    value = getattr(module, "value", 0.0)
    keeps = frozenset((BATCH, CHANNEL))
    if value != 0:
        return Homogeneity(1.0, f"{type(module).__name__} pads with {value} (affine: a term on the border)",
                           offset=keeps, keeps=keeps, mixes=frozenset())
    return Homogeneity(1.0, f"{type(module).__name__} pads with 0", keeps=keeps, mixes=frozenset())


def _copy_padding(module, analyse):
    # reflect / replicate / circular padding copies entries of the same sample and channel to the border: linear,
    # and a term (or a positive factor) constant along an axis comes out constant along it (a copy of a constant)
    return Homogeneity(1.0, f"{type(module).__name__}: linear (copies entries to the border)", keeps=ALL_AXES,
                       mixes=frozenset())


def _avg_pool(module, analyse):
    # Without divisor_override a window divides by its count of real entries, or with count_include_pad by one
    # that counts the padding too (then the border windows average in zeros: a constant does not stay one). A
    # fixed divisor_override divides a window clipped by padding or by ceil_mode's overhang by the full count
    # too (the constant comes out smaller there): only full windows everywhere keep it constant.
    padded = getattr(module, "padding", 0) not in (0, (0, 0), (0,), (0, 0, 0))
    if getattr(module, "divisor_override", None):
        border_exact = not padded and not module.ceil_mode
    else:
        border_exact = not padded or not getattr(module, "count_include_pad", True)
    keeps = ALL_AXES if border_exact else frozenset((BATCH, CHANNEL))
    return Homogeneity(1.0, f"{type(module).__name__}: linear", keeps=keeps, mixes=frozenset((SPATIAL,)))


_register_homogeneity(nn.Identity, degree_rule(1.0, "the identity", keeps=ALL_AXES, mixes=frozenset()))
def _adaptive_avg_pool(module, analyse):
    # windows divide by their own count: a constant stays one. Pooled to size 1 everywhere, the output has no
    # spatial extent, so any term is constant along space (vacuously), as after Flatten to (batch, features)
    sizes = module.output_size if isinstance(module.output_size, tuple) else (module.output_size,)
    to_one = all(s == 1 for s in sizes)
    return Homogeneity(1.0, f"{type(module).__name__}: linear (passes an additive term)", keeps=ALL_AXES,
                       vacuous=frozenset((SPATIAL,)) if to_one else frozenset(), mixes=frozenset((SPATIAL,)))


_register_homogeneity(nn.modules.pooling._AdaptiveAvgPoolNd, _adaptive_avg_pool)
for _t in (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d):
    _register_homogeneity(_t, _dropout)
for _t in (nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd):
    # max(c y + o) = c max(y) + o when o is constant over each window
    _register_homogeneity(_t, degree_rule(1.0, "positively homogeneous of degree 1", keeps=ALL_AXES, needs=frozenset((SPATIAL,)),
                                          mixes=frozenset((SPATIAL,))))
for _t in (nn.ReLU, nn.LeakyReLU, nn.PReLU):
    # elementwise: relu(a ⊙ y) = a ⊙ relu(y) for any positive a
    _register_homogeneity(_t, degree_rule(1.0, "positively homogeneous of degree 1", mixes=frozenset()))
_register_homogeneity(nn.Flatten, _flatten)
_register_homogeneity(nn.modules.pooling._AvgPoolNd, _avg_pool)
for _t in (nn.modules.conv._ConvNd, nn.Linear):
    _register_homogeneity(_t, _affine_layer)
for _t in (nn.ZeroPad2d, nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d):
    _register_homogeneity(_t, _padding)
for _t in (nn.modules.padding._ReflectionPadNd, nn.modules.padding._ReplicationPadNd, nn.modules.padding._CircularPadNd):
    _register_homogeneity(_t, _copy_padding)
for _t in (nn.Sigmoid, nn.Tanh, nn.GELU, nn.SiLU, nn.ELU, nn.Softplus, nn.Softmax):
    _register_homogeneity(_t, degree_rule(None, "not positively homogeneous"))
_register_homogeneity(nn.modules.batchnorm._BatchNorm, _batch_norm)
_register_homogeneity(nn.modules.instancenorm._InstanceNorm, _instance_norm)
_register_homogeneity(nn.GroupNorm, _group_norm)
_register_homogeneity(nn.LayerNorm, _layer_norm)
_register_homogeneity(nn.Sequential, sequential_rule)
