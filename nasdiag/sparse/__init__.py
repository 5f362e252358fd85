"""Sparse-group-lasso primitives of SparseNAS (``../shared/papers/sparse-supernet.txt``).

- `prox_l1` (eq 9), `prox_group` (eq 10), `prox_sgl` (eq 5): the hierarchical proximal operator of
  Ω_SGL(A) = λα‖A‖₁ + λ(1−α) Σ_n √|A_(n)| ‖A_(n)‖₂ (eq 2), exact zeros by soft-thresholding;
- `sgl_penalty`: Ω_SGL itself;
- `HAPG`, `AdamHAPG`: the hierarchical accelerated proximal gradient optimizers (eq 6–8), as
  ``torch.optim.Optimizer`` s usable on any parameters.

Pure tensor maths: nothing here knows a supernet, a probe or a record.
"""

from nasdiag.sparse.optim import HAPG, AdamHAPG
from nasdiag.sparse.prox import group_norms, prox_group, prox_l1, prox_sgl, sgl_penalty

__all__ = ["AdamHAPG", "HAPG", "group_norms", "prox_group", "prox_l1", "prox_sgl", "sgl_penalty"]
