"""Round-20 new-user audit: a NAS researcher who has never seen nasdiag installs it as README.md says, runs its main
job, then attaches it to a supernet and a training loop of their own following only docs/probe.md, docs/schema.md,
docs/methods.md and docs/figures.md, each code example copied literally into a script; the loop does what real loops
do that rounds 5/11/13/17 did not combine: gradient accumulation, bf16 autocast, a validation pass in eval mode inside
the same epoch (and inside the probed block), a KeyboardInterrupt mid-epoch, and the same under PyTorch Lightning.

References are written here from scratch: the optimizer steps a batch belongs to under gradient accumulation
(batches 2k-2 and 2k-1 make step k with accumulate_grad_batches=2), counted from the definition; each edge's diag
∂²L/∂Z² by torch.autograd.functional.hessian with that edge's Z passed in (float64); a loss whose Hessian is diagonal,
for which Hutchinson's estimate is exact.

Found and fixed:

* ``nasdiag.record.lightning_callback`` put a training batch in the row of ``trainer.global_step`` as it was at
  the batch's end, so under ``accumulate_grad_batches=2`` the micro-batches of one optimizer step were split over two
  rows (the first one, taken before the step, in the row of the step before) and each row held the last micro-batch
  of one step and the first of the next, later winning: the epoch's row (its cost statistics and ``scalars/epoch``)
  carried the scalars of the next epoch's first batch, and step 0 held a row of half a step. The docstring said
  "batches with the same global step (gradient accumulation) share a row". A batch that takes no optimizer step now
  goes into the row of the step it accumulates into (test_lightning_gradient_accumulation_puts_an_optimizer_steps_micro_batches_in_its_row).
* docs/probe.md said ``probe.hessian()`` re-runs the model "with its running statistics restored, drawing the recorded
  call's random numbers (the same dropout masks)", which reads as the recorded step's curvature; it re-runs it in its
  current train/eval mode (as its docstring says), so the loop of this audit, a validation pass under ``model.eval()``
  before the epoch's ``probe.hessian()``, got the eval-mode curvature (running statistics, no dropout; here up to
  0.07 off the step's) without a word. The doc says so and when to call it
  (test_probe_hessian_after_a_validation_pass_in_eval_mode_is_the_eval_mode_curvature_as_docs_now_say, against
  autograd's Hessian of each edge's Z in either mode, float64).
* docs/spectrum.md commented ``dg = hutchinson_diagonal(...)`` as "tuples shaped like params"; it is a
  HutchinsonEstimate whose ``estimate`` and ``stderr`` are (``len(dg)`` a TypeError). The comment says so
  (test_hutchinson_diagonal_returns_an_estimate_whose_fields_are_tuples_shaped_like_params_as_docs_spectrum_says,
  against a loss whose Hessian in θ is diagonal, which Rademacher probes give exactly).

Checked and right (scripts in a scratch folder, torch 2.13 CPU):

* README's install as the brief ran it, ``pip install torch==2.13.0`` then ``pip install -e .`` in two calls, replaced
  the CPU torch by torch 2.14.1 with its CUDA libraries (BackPACK's torchvision pins it), the case README's note warns
  about; README's own one-call ``pip install torch==2.13.0 -e .`` put torch 2.13.0+cpu back. Its main job in a fresh
  folder (on a snapshot of the committed tree: a run on the shared working tree died in its figures on another
  helper's half-made edit) printed the search-val accuracy and genotype and wrote runs/darts.h5 (steps 1-88, cost and
  Hessian rows at the 8 epoch ends) and 15 figures in runs/darts-figs (5.5 min on this loaded box); README's test
  command with ``-k`` for five tests passed in that venv.
* ``run(SearchConfig(...), callbacks=[...])`` from Python with a KeyboardInterrupt at step 5: rows 1-5 on disk, then
  ``resume=True`` gives a record and genotype equal to an uninterrupted run's (every float path bit for bit).
* docs/hessian.md's and docs/spectrum.md's blocks run as written (shapes as commented; alphas_reduce (14, 8) for
  layers=2; GraphedDiagHessian's third call equal to diag_hessian on the CPU).
* docs/probe.md's, docs/schema.md's blocks run as written (costs.h5: 6 rows, (14, 8) cost rows on the epoch rows;
  run.h5: (3,), (3, 5, 3)); docs/methods.md's "A method on your own supernet" fragment on a DARTS-convention supernet
  of this audit's own (two normal cells, no reduce cell): stats keys and shapes as its comment, ``cost/normal/mean``
  after one step equal to autograd's ∂L/∂Z of the val batch with Z a leaf per cell (1e-8, float32); docs/figures.md's
  fragment registered under another name and drawn from a record with a NaN λ.
* The node-protocol block of docs/probe.md (``MyCell`` declaring ``edges``, ``edge_nodes``, ``output_nodes``,
  ``output_node_slices``) completed with a forward: node pairs and indices as declared, ``output_costs()`` equal to
  autograd's gradient of a scalar multiplier on each node's slice, path parts summing to ``costs()`` (1e-17, float64).
* An own loop with two micro-batches of loss/2 in one block: costs equal autograd's ∂(ΣL_m/2)/∂Z (1e-17, float64);
  under bf16 autocast within 0.3 % of autograd's ∂L/∂Z under the same autocast (10 % from float64: bf16's own
  error); a validation pass in eval mode inside the block, under no_grad or with grad on, before or after the
  training forward, leaves costs, per-sample rows (B, K) and output costs those of the training batch;
  KeyboardInterrupt raised in the forward or in the backward of a block with path_split and hessian: no hook left,
  costs() refused in one line, the next step's costs exact and counted once; RecorderCallback's ``on_exception``
  and its ``with`` block after a KeyboardInterrupt keep every row handed in, the epoch's statistics in its row;
  ``nasdiag plot`` of that record titles the cost map "steps 0-4 (epoch 0)". Under Lightning (manual optimization,
  KeyboardInterrupt at batch 5, which Lightning turns into on_exception and an exit): rows 1-5, the batch that raised
  not recorded. A KeyboardInterrupt inside ``probe.hessian()`` (exact, diag, approx) leaves no hook, BatchNorm's
  buffers, the RNG state and the train flag as they were, and the next call works; ``norm_deviation`` is the same with
  eval-mode validation passes with grad on around the training forward in the block; a new
  ``RecorderCallback(path, resume=True)`` after the interrupt replaying steps 5-14 gives every step once, the later
  segment's row winning.

Noticed and left alone: the scalars figure labels a user's ``scalars/val_loss`` "(α step, batch)" (docs/figures.md
gives ``val_*`` that meaning: naming). ``probe.hessian()`` after accumulated micro-batches takes the first one (the
doc says the first model call), and its targets-of-another-size line calls that micro-batch "the batch" (wording).
With the README's install the ``[test]`` extra's Lightning fails at import (pip's torchvision for the CPU torch is a
CUDA build: ``operator torchvision::nms does not exist``); lightning_callback says so in one line and the Lightning
tests hide torchvision (the local index holds no CPU torchvision: environment).
"""

from __future__ import annotations

import importlib.metadata
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from nasdiag.record import lightning_callback, load


def _lightning(monkeypatch):
    """``lightning.pytorch`` with torchvision hidden from torchmetrics's import probe while it is imported (a torchvision
    built for another torch fails at import; nasdiag never uses it), or a skip without the lightning extra."""
    imports = pytest.importorskip("lightning_utilities.core.imports", reason="the lightning extra is not installed")
    with monkeypatch.context() as patch:
        real = imports._version
        patch.setattr(imports, "_version", lambda name: _absent(name) if name == "torchvision" else real(name))
        if "torchvision" not in sys.modules:
            patch.setitem(sys.modules, "torchvision", None)
        return pytest.importorskip("lightning.pytorch", reason="the lightning extra is not installed")


def _absent(name):
    raise importlib.metadata.PackageNotFoundError(name)


def test_lightning_gradient_accumulation_puts_an_optimizer_steps_micro_batches_in_its_row(tmp_path, monkeypatch):
    pl = _lightning(monkeypatch)
    batches, accumulate, epochs = 8, 2, 2

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 2)
            self.seen = 0

        def training_step(self, batch, batch_idx):
            self.batch = float(self.seen)  # the batch's index over the whole fit
            self.seen += 1
            return F.cross_entropy(self.layer(batch[0]), batch[1])

        def nasdiag_statistics(self):
            return {"scalars/batch": self.batch}

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(4 * batches, 3), torch.randint(0, 2, (4 * batches,)))
    record = tmp_path / "accumulated.h5"
    trainer = pl.Trainer(max_epochs=epochs, accumulate_grad_batches=accumulate, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[lightning_callback(record, epoch_statistics=lambda t, m: {"scalars/at_epoch_end": float(m.seen - 1)})])
    with warnings.catch_warnings():  # Lightning's own advice (few dataloader workers, ...)
        warnings.simplefilter("ignore")
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=4))
    got = load(record)
    # Optimizer step k (global_step k after it, 1-based) is made of batches accumulate*(k-1) ... accumulate*k - 1;
    # its row holds the last of them (later values win).
    steps = batches * epochs // accumulate
    assert got["step"].tolist() == list(range(1, steps + 1))
    assert got["scalars/batch"].tolist() == [float(accumulate * k - 1) for k in range(1, steps + 1)]
    # The epoch's row is its last step's, holding that step's batch, not the next epoch's first one.
    epoch_rows = got["valid/scalars/epoch"].nonzero()[0]
    assert got["step"][epoch_rows].tolist() == [batches // accumulate * (e + 1) for e in range(epochs)]
    assert got["scalars/batch"][epoch_rows].tolist() == got["scalars/at_epoch_end"][epoch_rows].tolist()



class _Mixed(torch.nn.Module):
    """A DARTS-convention mixed op: candidates in ``_ops``, forward (x, weights) -> Σ_k w_k·op_k(x)."""

    def __init__(self, C):
        super().__init__()
        self._ops = torch.nn.ModuleList([
            torch.nn.Identity(),
            torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Conv2d(C, C, 3, padding=1, bias=False), torch.nn.BatchNorm2d(C)),
            torch.nn.Sequential(torch.nn.Conv2d(C, C, 1, bias=False), torch.nn.BatchNorm2d(C), torch.nn.Tanh())])

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self._ops))


class _ChainNet(torch.nn.Module):
    """Two mixed ops in a chain with their own α; ``z`` replaces one edge's mixing weights (the reference's leaf)."""

    def __init__(self, C=3):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(1, C, 3, padding=1, bias=False), torch.nn.BatchNorm2d(C))
        self.edges = torch.nn.ModuleList([_Mixed(C), _Mixed(C)])
        self.head = torch.nn.Linear(C, 4)
        self.alpha = torch.nn.Parameter(torch.randn(2, 3))

    def forward(self, x, z=None, at=None):
        h = self.stem(x)
        for e, edge in enumerate(self.edges):
            h = edge(h, z if e == at else F.softmax(self.alpha[e], -1))
        return self.head(h.mean((2, 3)))


def _diag_hessian_of_each_edge(net, x, y):
    """diag ∂²L/∂Z² of each edge's own Z by autograd.functional.hessian, the model in its current mode, BatchNorm's
    running statistics put back after each evaluation."""
    import copy

    out = {}
    for e in range(len(net.edges)):
        z = F.softmax(net.alpha[e], -1).detach()
        twin = copy.deepcopy(net)
        hess = torch.autograd.functional.hessian(lambda z: F.cross_entropy(twin(x, z, e), y), z)
        out[f"edges.{e}"] = hess.diagonal()
    return out


def test_probe_hessian_after_a_validation_pass_in_eval_mode_is_the_eval_mode_curvature_as_docs_now_say():
    """The loop of this audit: a train-mode step in a block, then a validation pass in eval mode, then the epoch's
    probe.hessian(). The re-run is in the model's current mode: eval-mode curvature, not the recorded step's; docs/probe.md
    said it re-runs the recorded call with its dropout masks and did not say so."""
    import nasdiag

    torch.manual_seed(0)
    net = _ChainNet().double()
    x, y = torch.randn(6, 1, 5, 5, dtype=torch.float64), torch.randint(0, 4, (6,))
    probe = nasdiag.attach(net, hessian="exact")
    with probe.record(targets=y):
        F.cross_entropy(net(x), y).backward()
    train_reference = _diag_hessian_of_each_edge(net, x, y)
    recorded_step = probe.hessian()
    net.eval()  # the validation pass
    with torch.no_grad():
        net(torch.randn(2, 1, 5, 5, dtype=torch.float64))
    after_eval = probe.hessian()
    eval_reference = _diag_hessian_of_each_edge(net, x, y)
    for name in train_reference:
        torch.testing.assert_close(recorded_step[name], train_reference[name], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(after_eval[name], eval_reference[name], rtol=1e-9, atol=1e-12)
    # running statistics a step from their init are far from the batch's own: the two curvatures differ
    assert max(float((train_reference[n] - eval_reference[n]).abs().max()) for n in train_reference) > 1e-3
    from pathlib import Path

    doc = " ".join((Path(__file__).parents[1] / "docs" / "probe.md").read_text().split())
    assert "re-run outside the block, in its current train/eval mode" in doc
    assert "call `probe.hessian()` before `optimizer.step()` and before a validation pass's `model.eval()`" in doc


def test_hutchinson_diagonal_returns_an_estimate_whose_fields_are_tuples_shaped_like_params_as_docs_spectrum_says():
    """docs/spectrum.md commented ``dg = hutchinson_diagonal(...)`` as "tuples shaped like params": ``dg`` is a
    HutchinsonEstimate (``len(dg)``, ``dg[0]`` fail); its ``estimate`` and ``stderr`` are those tuples. Reference: a
    loss ½Σ y·(θ⊙x)² whose Hessian in θ is diagonal, diag(x²·y) summed over the batch, which Rademacher probes give
    exactly (v_i² = 1), so the estimate is exact and its standard error 0."""
    from pathlib import Path

    from nasdiag.hessian import hutchinson_diagonal

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.theta = torch.nn.Parameter(torch.randn(2, 3, dtype=torch.float64))
            self.shift = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))

        def forward(self, x):
            return self.theta * x + self.shift

    torch.manual_seed(0)
    model = Scale()
    x, y = torch.randn(5, 2, 3, dtype=torch.float64), torch.rand(5, 1, 1, dtype=torch.float64)
    dg = hutchinson_diagonal(model, lambda out, y: 0.5 * (y * out ** 2).sum(), x, y,
                             params=[model.theta], samples=8, seed=0)  # θ alone: the θ-shift block is off the diagonal
    assert isinstance(dg.estimate, tuple) and isinstance(dg.stderr, tuple)
    torch.testing.assert_close(dg.estimate[0], (x ** 2 * y).sum(0), rtol=1e-12, atol=1e-12)
    assert [t.shape for t in dg.stderr] == [model.theta.shape] and float(dg.stderr[0].abs().max()) < 1e-12
    doc = (Path(__file__).parents[1] / "docs" / "spectrum.md").read_text()
    line = next(text for text in doc.splitlines() if text.startswith("dg = hutchinson_diagonal("))
    assert "# .estimate, .stderr: tuples shaped like params" in line
