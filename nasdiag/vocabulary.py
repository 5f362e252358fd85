"""The statistics vocabulary: every record path family nasdiag writes, in one place.

A record is a table of rows (one per step); each column is a *path* such as ``cost/normal/mean``.
Paths come in *families*: ``cost/<cell>/mean`` is one family, whatever ``<cell>`` is. This module
says, for every family, its row shape, dtype, meaning and how it is reduced across DDP ranks. The
probe, the search methods, the DDP reduction, the record schema, ``docs/schema.md`` and the figure
registry all read it; none of them spells a path on its own.

Placeholders in a pattern: ``<cell>`` a cell type (``normal``, ``reduce``), ``<name>`` any name.
Shapes use E (edges of a cell type), K (candidate ops), T (rows).

Reduction rules across R ranks (``nasdiag.distributed.reduce_statistics``):

=========  ======================================================================================
mean       (1/R) Σ_r x_r: the global batch mean for equal per-rank batches
sum        Σ_r x_r: counts
pooled     ``<prefix>/mean`` and ``<prefix>/var`` next to ``<prefix>/count``: the mean and variance
           of all samples of all ranks (see `pooled_moments`)
same       identical on every rank (parameters kept in sync by DDP); checked, not averaged
all, any   logical and / or for masks
min, max   elementwise extremes
=========  ======================================================================================

This module imports neither torch nor h5py.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

RULES = ("mean", "sum", "pooled", "same", "all", "any", "min", "max")


@dataclass(frozen=True)
class Family:
    """One record path family.

    Attributes:
        pattern: the path with placeholders, e.g. ``"cost/<cell>/mean"``.
        shape: the row shape in words, e.g. ``"(E, K)"`` or ``"()"``.
        dtype: numpy dtype name of a row (``"float32"`` for statistics kept in the run's dtype
            means "the run's float dtype").
        reduce: DDP reduction rule (one of `RULES`).
        meaning: one sentence, with the paper equation where there is one and the batch convention.
        when: ``"step"`` (every step) or ``"epoch"`` (the row of an epoch's last step) or ``"spectrum"`` (the
            rows of every k-th step, ``spectrum_every`` = k) or ``"run"``.
        section: the heading it belongs to in docs/schema.md.
    """

    pattern: str
    shape: str
    dtype: str
    reduce: str
    meaning: str
    when: str = "step"
    section: str = "core"

    @property
    def regex(self) -> re.Pattern:
        parts = re.split(r"(<[a-z]+>)", self.pattern)
        body = "".join("[A-Za-z0-9_.\\-+=]+" if p.startswith("<") else re.escape(p) for p in parts)
        return re.compile(f"^{body}$")

    def path(self, **fields: str) -> str:
        """The concrete path, e.g. ``COST_MEAN.path(cell="normal") == "cost/normal/mean"``."""
        out = self.pattern
        for key, value in fields.items():
            out = out.replace(f"<{key}>", str(value))
        if "<" in out:
            raise KeyError(f"path {self.pattern!r} needs fields {re.findall(r'<([a-z]+)>', out)}")
        return out


FAMILIES: List[Family] = []


def family(pattern: str, shape: str, dtype: str, reduce: str, meaning: str, when: str = "step", section: str = "core") -> Family:
    """Declare a family (used below; a method module may declare its own, which then appears in the
    vocabulary, the docs check and DDP reduction like the built-in ones)."""
    if reduce not in RULES:
        raise ValueError(f"reduction rule {reduce!r} of {pattern!r} is not one of {RULES}")
    for f in FAMILIES:
        if f.pattern == pattern:
            if f == Family(pattern, shape, dtype, reduce, meaning, when, section):
                return f
            raise ValueError(f"record path family {pattern!r} is already declared differently")
    fam = Family(pattern, shape, dtype, reduce, meaning, when, section)
    FAMILIES.append(fam)
    return fam


# -- scalars -------------------------------------------------------------------------------------
SCALAR = family("scalars/<name>", "()", "float32", "mean", "A per-step scalar (losses and accuracies are means over the batch).")
SCALAR_COUNT = family("scalars/<name>_count", "()", "float32", "sum", "A per-step count, summed over ranks.")
EPOCH = family("scalars/epoch", "()", "float32", "same", "Index of the epoch that ended at this row.", when="epoch")
SEARCH_VAL_LOSS = family("scalars/search_val_loss", "()", "float32", "mean",
                         "Supernet loss on the whole search-val split at the method's `eval_weights()` (softmax(α) for DARTS, the argmax one-hot for DSNAS and ProxylessNAS, A for SparseNAS; ASM-NAS mixes by its attention; mean over samples), after an epoch.", when="epoch")
SEARCH_VAL_ACC = family("scalars/search_val_acc", "()", "float32", "mean",
                        "Supernet top-1 accuracy on the whole search-val split at the method's `eval_weights()` (ASM-NAS: by its attention), after an epoch.", when="epoch")

# -- architecture --------------------------------------------------------------------------------
ARCH_PARAMS = family("arch/<cell>/params", "(E, K)", "float32", "same", "The raw architecture parameters α of a cell type (shared by its cells).")
ARCH_PROBABILITIES = family("arch/<cell>/probabilities", "(E, K)", "float32", "same",
                            "`probabilities()`: what the genotype is derived from (softmax(α), EG weights, |A|, ...; the search-val evaluation is at `eval_weights()`).")
ARCH_WEIGHTS = family("arch/<cell>/weights", "(E, K)", "float32", "mean",
                      "The mixing weights Z the step's forward used (softmax for DARTS, a relaxed or one-hot sample for SNAS/DSNAS; batch mean where per sample).")

# -- cost (wiring supplement §2) -----------------------------------------------------------------
COST_MEAN = family("cost/<cell>/mean", "(E, K)", "float64", "pooled",
                   "E[C] of C(Z) = ∂L/∂Z = <∂L/∂x_j, O(x_i)> over steps × cells of the type (mean-reduced loss), accumulated in float64 whatever the run's dtype; NaN where count is 0.", when="epoch", section="cost")
COST_VAR = family("cost/<cell>/var", "(E, K)", "float64", "pooled", "Var[C] over the same observations (ddof 0), in float64; NaN where count is 0.", when="epoch", section="cost")
COST_COUNT = family("cost/<cell>/count", "(E, K)", "int64", "sum", "Observations behind mean and var.", when="epoch", section="cost")

# -- curvature (BayesNAS appendix §C) ------------------------------------------------------------
HESSIAN_DIAG = family("hessian/<cell>/diag", "(E, K)", "float32", "mean",
                      "Diagonal of ∂²L/∂Z² for the Z shared by the cells of the type, in the run's Hessian mode (C.3.1–C.3.2, GGN, Hutchinson, exact_per_edge: per-edge numbers summed over the cells; exact: cross-cell terms included), at the method's `eval_weights()` after the epoch's last step, on the last batch the architecture step used (search-val; search-train for single-level methods).", when="epoch", section="hessian")
HESSIAN_TOP_EIGENVALUE = family("hessian/<cell>/top_eigenvalue", "()", "float32", "mean",
                                "Largest algebraic eigenvalue of the α-Hessian of the cell type through Z = softmax(α) (RobustDARTS's early-stop signal), after the step, on its α batch (search-val; search-train for single-level methods).", when="spectrum", section="hessian")
HESSIAN_JOINT_TOP_EIGENVALUE = family("hessian/top_eigenvalue", "()", "float32", "mean",
                                      "Largest algebraic eigenvalue of the Hessian in the α of every cell type jointly, cross-type terms included: RobustDARTS's dominant eigenvalue of ∇²_α L_valid (NaN, with every cell type's nonfinite flag set, when a product was not finite).", when="spectrum", section="hessian")
HESSIAN_NONFINITE = family("hessian/<cell>/nonfinite", "()", "bool", "any", "True where the curvature result held a NaN or inf (never averaged away): on the epoch rows (the diagonal), on the rows of the top eigenvalues and, for BayesNAS, on the rows of its updates (`bayes/updated`; every `update_every`-th step): the curvature the update used.", when="epoch", section="hessian")

# -- samples (SNAS, DSNAS, ProxylessNAS) ---------------------------------------------------------
SAMPLE_ONEHOT = family("sample/<cell>/onehot", "(E, K)", "float32", "mean", "The step's one-hot sample (or binary gates) per edge; rank mean under DDP.", section="sample")
SAMPLE_COUNT = family("sample/<cell>/count", "(E, K)", "int64", "same", "Cumulative number of times each op of each edge was sampled (Fig. 6b protocol); every DDP rank draws the same sample (one generator seed), so it is not summed.", section="sample")
SAMPLE_PATHS = family("sample/<cell>/paths", "(E, K)", "float32", "mean", "ProxylessNAS two-path mode: the two paths sampled per edge for the α step (1 = sampled and computed).", section="sample")
SAMPLE_TEMPERATURE = family("scalars/temperature", "()", "float64", "same", "The Gumbel-softmax temperature τ of the step's relaxed sample (SNAS), in float64 whatever the run's dtype.", section="sample")
SAMPLE_ENTROPY = family("scalars/entropy", "()", "float32", "same", "Mean over the edges of every cell type of the entropy −Σ p log p (nats) of `probabilities()`, after the step.", section="sample")

# -- regret (XNAS) -------------------------------------------------------------------------------
REGRET_LOG_WEIGHTS = family("regret/<cell>/log_weights", "(E, K)", "float64", "same", "log v of the EG forecaster per edge (Algorithm 1, lines 9-10). In float64 whatever the run's dtype (the forecasters are float64).", section="regret")
REGRET_ALIVE = family("regret/<cell>/alive", "(E, K)", "bool", "same", "Experts not wiped out (Algorithm 1, lines 11-12).", section="regret")
REGRET_REGRET = family("regret/<cell>/regret", "(E,)", "float64", "same", "Linearized regret per edge so far (eq 31) against the experts still alive (min over I_t; wiped-out ops are not computed, their later rewards unknown): eq 31 over all N experts when ζ ≥ 1 and |R| ≤ L (Lemma 1), possibly less when ζ < 1. In float64 whatever the run's dtype (the forecasters are float64).", section="regret")
REGRET_BOUND = family("regret/<cell>/bound", "(E,)", "float64", "same", "The regret bound of Theorem 1 (eq 3) per edge; it bounds the recorded regret for every ζ when |R| ≤ L (the regret over all N experts only for ζ ≥ 1, §3.2.2). In float64 whatever the run's dtype (the forecasters are float64).", section="regret")
REGRET_GAMMA = family("regret/<cell>/gamma", "(E,)", "float64", "same", "γ_T of eq 28 per edge. In float64 whatever the run's dtype (the forecasters are float64).", section="regret")
REGRET_WIPEOUTS = family("regret/<cell>/wipeouts", "(E, K)", "bool", "same", "Experts wiped out at this step.", section="regret")
REGRET_REWARDS = family("regret/<cell>/rewards", "(R, E, K)", "float64", "same",
                        "The step's rewards R = -C on the val batch (Algorithm 1 line 8), one round per cell of the type (R cells, network order), as the forecaster received them (clipped to [-L, L] with clip_rewards; NaN/inf kept, see nonfinite); 0 for ops not computed in the step (wiped out before it), which the forecaster is given as unknown. In float64 whatever the run's dtype (the forecasters are float64).", section="regret")
REGRET_ACTIVE_FRACTION = family("scalars/active_fraction", "()", "float64", "mean", "XNAS: the fraction of the supernet's (cell, edge, op) computations this step's forwards made (wiped-out experts are not computed), in float64 whatever the run's dtype.", section="regret")
REGRET_CLIP_FRACTION = family("scalars/reward_clip_fraction", "()", "float64", "mean", "XNAS: the fraction of this step's finite rewards of alive experts that were clipped to [-L, L] (clip_rewards), in float64 whatever the run's dtype; NaN in a step without a finite reward of an alive expert (0/0; every edge is then flagged in regret/<cell>/nonfinite).", section="regret")
REGRET_NONFINITE = family("regret/<cell>/nonfinite", "(E,)", "bool", "any", "True for an edge where an alive op's reward (cost) was NaN or inf in a round of the step: that edge's forecaster sat the round out (no EG step, nothing added to its regret; the round still counts towards T).", section="regret")

# -- attention (ASM-NAS) -------------------------------------------------------------------------
ATTENTION_MEAN = family("attention/<cell>/mean", "(E, K)", "float32", "mean", "Batch-mean attention a per edge and op (eq 4.5), mean over the cells of the type.", section="attention")
ATTENTION_COUNT = family("attention/<cell>/count", "(E, K)", "int64", "same", "Per-sample argmax counts of the attention over the whole validation set (Algorithm 1 selection), summed over the cells of the type: each edge's K counts add up to the validation samples × the cells of the type (the samples whose attention held a NaN count for none); every rank counts all of it.", when="epoch", section="attention")

# -- sparsity (SparseNAS) ------------------------------------------------------------------------
SPARSITY_NONZERO = family("sparsity/<cell>/nonzero", "(E, K)", "bool", "same", "Ops whose linear mixing weight A is non-zero after the proximal step (eq 9-10).", section="sparsity")
SPARSITY_LAMBDA = family("sparsity/lambda", "()", "float32", "same", "The current (progressive) sparse-group-lasso strength λ.", section="sparsity")

# -- sparse Bayesian (BayesNAS) ------------------------------------------------------------------
BAYES_GAMMA = family("bayes/<cell>/gamma", "(E, K)", "float32", "same", "Uncertainty γ per op with the edge dependency (A.2.14; γ = s on edges leaving a cell input), after the last update.", section="bayes")
BAYES_OMEGA = family("bayes/<cell>/omega", "(E, K)", "float32", "same", "ω per op, the reweighted-lasso weight √(γ(t−1) − C)/γ(t−1) (A.2.8, A.3.9), after the last update.", section="bayes")
BAYES_SWITCH = family("bayes/<cell>/switch", "(E, K)", "bool", "same", "Switches s: ops still alive after entropy pruning (Algorithm 2, step 4).", section="bayes")
BAYES_CURVATURE = family("bayes/<cell>/curvature", "(E, K)", "float32", "same", "The curvature the update used: diag ∂²(E_D/λ_w)/∂Z² (C.3) of the batch's summed loss over λ_w (A.3.1), summed over the cells of the type.", section="bayes")
BAYES_PRIOR_VARIANCE = family("bayes/<cell>/prior_variance", "(E, K)", "float32", "same", "The switch values s = ‖w_group‖₂/ω = √ℵ|w|/ω (A.2.13, A.3.8; ℵ cells of the type) of the last update: the prior variance of each op's w.", section="bayes")
BAYES_COVARIANCE = family("bayes/<cell>/covariance", "(E, K)", "float32", "same", "Posterior variance C = (1/γ(t−1) + H)⁻¹ of each op's w at the last update (A.3.2), the mean over the cells of the type; ops with no positive curvature keep their previous C.", section="bayes")
BAYES_UPDATED = family("bayes/updated", "()", "bool", "same", "This step ran the update of γ, ω, C, s and the pruning (Algorithm 2, steps 2-4).", section="bayes")


def families(section: Optional[str] = None) -> List[Family]:
    """Every declared family (of one docs section if given), in declaration order."""
    return [f for f in FAMILIES if section is None or f.section == section]


def family_of(path: str) -> Optional[Family]:
    """The family a concrete path belongs to (the most specific match), or None. Remembered per path: a search step
    checks every path it returns (`nasdiag.search.base.check_statistics`), and matching all families' regexes took
    milliseconds a step."""
    return _family_of(path, len(FAMILIES))


@functools.lru_cache(maxsize=4096)
def _family_of(path: str, n_families: int) -> Optional[Family]:
    # n_families keys the cache: a family declared later (by a method's module) may be the better match of a path
    matches = [f for f in FAMILIES[:n_families] if f.regex.match(path)]
    if not matches:
        return None
    # the most literal pattern wins: "scalars/epoch" over "scalars/<name>_count" over "scalars/<name>"
    return max(matches, key=lambda f: len(re.sub(r"<[a-z]+>", "", f.pattern)))


def reduction_rule(path: str, dtype: np.dtype) -> str:
    """How ``path`` is reduced across ranks: its family's rule, else a default from its dtype
    (bool → all, integers → same, floats → mean)."""
    fam = family_of(path)
    if fam is not None:
        return fam.reduce
    kind = np.dtype(dtype).kind
    if kind == "b":
        return "all"
    if kind in "iu":
        return "same"
    return "mean"


def cells_with(record_paths: Iterable[str], fam: Family) -> List[str]:
    """The ``<cell>`` values for which ``fam`` has a path among ``record_paths``, in order of appearance."""
    parts = fam.pattern.split("/")
    if "<cell>" not in parts:
        return []
    at = parts.index("<cell>")
    found: Dict[str, None] = {}
    for p in record_paths:
        if fam.regex.match(p):
            found[p.split("/")[at]] = None
    return list(found)


def matching(record_paths: Iterable[str], pattern: str) -> List[str]:
    """Paths matching a shell-style pattern (``"cost/*/mean"``)."""
    return [p for p in record_paths if fnmatch.fnmatchcase(p, pattern)]


def pooled_moments(counts, means, variances, ddof: int = 0, xp=np) -> Tuple:
    """Merge per-part (count, mean, variance) into those of the union of all parts.

    Args:
        counts, means, variances: stacked over parts on the first axis, (P, ...) each; ``xp`` is the
            array module (numpy or torch) so the same formula serves both.
        ddof: the delta degrees of freedom the variances were computed with.

    Returns:
        (N, mean, var) with N = Σ n_p, mean = Σ n_p m_p / N and
        var = Σ [(n_p − ddof) v_p + n_p (m_p − mean)²] / (N − ddof); NaN where N ≤ ddof. The squares are
        taken about the pooled mean (Chan et al.'s pairwise update), not as Σ n_p m_p² − N mean², which
        cancels catastrophically when the spread is small against the mean (mean 1e6, sd 1e-2: 4× off).
    """
    n = counts.sum(0)
    nf = n * 1.0
    total = (counts * means).sum(0)
    mean = total / xp.where(n > 0, nf, nf * 0 + 1)
    spread = means - mean
    second = ((counts - ddof) * variances + counts * spread * spread).sum(0)
    denom = nf - ddof
    var = second / xp.where(denom > 0, denom, denom * 0 + 1)
    nan = mean * float("nan")
    mean = xp.where(n > 0, mean, nan)
    var = xp.where(denom > 0, var, nan)
    return n, mean, var
