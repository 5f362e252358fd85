"""DSNAS: the composed α-gradient (Z·C)(Z − p) against autograd through a surrogate whose forward
value is the one-hot sample and whose α-derivative is the score function, in float64, on nasdiag's
supernet and on an adapted DARTS-code supernet; only sampled ops computed; the Fig. 6b cost protocol;
NaN handling; exact resume.

The reference surrogate is Z(α) = Z₀ ⊙ exp(log p(α) − sg(log p(α))), sg = stop-gradient: its value is
exactly the one-hot Z₀ and ∂Z_s/∂α = ∇_α log p_s, so autograd gives C_s ∇_α log p_s, the DSNAS
estimator at that sample. (The straight-through form Z₀ − sg(p) + p would instead give (diag p − ppᵀ)·C,
the BinaryConnect map of ProxylessNAS, which tests/test_method_proxyless.py checks.) The reference
forward is the dense one (every op computed, zero weights off the sample).
"""

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nasdiag import vocabulary as V
from nasdiag.search import SearchError, get_method
from test_method_snas import SCHEDULE, frozen, reference_batch, reference_supernet, supernet_and_batches


@pytest.mark.parametrize("kind", ["reference", "foreign"])
def test_alpha_gradient_equals_autograd_through_the_score_function_surrogate(kind):
    net, train, _ = supernet_and_batches(kind, 3)
    method = frozen(get_method("dsnas")(net, get_method("dsnas").Hyperparameters(grad_clip=1e9), schedule=SCHEDULE))
    stats = method.step(train)
    alphas = {t: a.detach().clone().requires_grad_(True) for t, a in net.alphas().items()}
    z = {}
    for t, a in alphas.items():
        onehot = stats[V.SAMPLE_ONEHOT.path(cell=t)]
        assert torch.equal(onehot.sum(-1), torch.ones(onehot.shape[0], dtype=onehot.dtype))
        logp = torch.log_softmax(a, -1)
        z[t] = onehot * torch.exp(logp - logp.detach())
    loss = F.cross_entropy(net(train[0], z), train[1])
    weights = net.weight_parameters()
    grads = torch.autograd.grad(loss, list(alphas.values()) + weights, allow_unused=True)
    for (t, a), g in zip(net.alphas().items(), grads):
        torch.testing.assert_close(a.grad, g, rtol=1e-9, atol=1e-13)
    for w, g in zip(weights, grads[len(alphas):]):
        torch.testing.assert_close(w.grad if w.grad is not None else torch.zeros_like(w),
                                   g if g is not None else torch.zeros_like(w), rtol=1e-9, atol=1e-13)
    torch.testing.assert_close(stats["scalars/train_loss"], loss.detach())


def test_only_sampled_ops_are_computed_and_costs_follow_the_sample_counts():
    net, train, _ = supernet_and_batches("reference", 4)
    method = get_method("dsnas")(net, schedule=SCHEDULE)
    calls = {}
    handles = [op.register_forward_hook(lambda m, i, o, key=(s.cell_index, s.edge_index, k): calls.__setitem__(key, calls.get(key, 0) + 1))
               for s in net.edge_specs() for k, op in enumerate(s.module.ops)]
    try:
        stats = method.step(train)
    finally:
        for h in handles:
            h.remove()
    expected = {(s.cell_index, s.edge_index, k): 1 for s in net.edge_specs()
                for k in stats[V.SAMPLE_ONEHOT.path(cell=s.cell_type)][s.edge_index].nonzero().flatten().tolist()}
    assert calls == expected
    for _ in range(3):
        stats = method.step(train)
    diag = method.diagnostics()
    cells_of = {t: sum(c.cell_type == t for c in net.cells) for t in net.cell_types}
    for t in net.cell_types:
        counts = stats[V.SAMPLE_COUNT.path(cell=t)]
        assert counts.sum() == 4 * net.num_edges
        # Fig. 6b protocol: a cost is observed only when its op was sampled (once per cell of the type)
        assert torch.equal(diag[V.COST_COUNT.path(cell=t)], counts * cells_of[t])
        assert torch.isnan(diag[V.COST_MEAN.path(cell=t)][counts == 0]).all()


def test_nan_loss_stops_with_a_clear_error_before_any_update():
    net, (x, y), _ = supernet_and_batches("reference", 5)
    method = get_method("dsnas")(net, schedule=SCHEDULE)
    before = copy.deepcopy(net.state_dict())
    x = x.clone()
    x[0, 0, 0, 0] = float("nan")
    with pytest.raises(SearchError, match="not finite") as err:
        method.step((x, y))
    assert torch.isnan(err.value.statistics["scalars/train_loss"])
    assert err.value.statistics["scalars/nonfinite_loss"] == 1
    for k, v in net.state_dict().items():
        if not k.endswith(("running_mean", "running_var", "num_batches_tracked")):
            assert torch.equal(v, before[k]), k


def test_resume_continues_bit_identically():
    batches = [reference_batch(s) for s in range(20, 23)]
    first = get_method("dsnas")(reference_supernet(6), schedule=SCHEDULE, seed=1)
    first.step(batches[0])
    state = copy.deepcopy(first.state_dict())
    second = get_method("dsnas")(reference_supernet(7), schedule=SCHEDULE, seed=2)
    second.load_state_dict(state)
    for b in batches[1:]:
        s1, s2 = first.step(b), second.step(b)
        for path in s1:
            assert torch.equal(s1[path], s2[path]), path
    assert all(V.family_of(path) is not None for path in s1)


@pytest.mark.slow  # draws with matplotlib
def test_sampling_figures_draw_from_a_record_of_the_steps(tmp_path):
    from nasdiag.plot import write_figures
    from nasdiag.plot.sampling import sample_counts
    from nasdiag.record import Recorder, load

    net, train, _ = supernet_and_batches("reference", 12)
    snas = get_method("snas")(copy.deepcopy(net), schedule=SCHEDULE)
    dsnas = get_method("dsnas")(net, schedule=SCHEDULE)
    path = tmp_path / "run.h5"
    with Recorder(str(path), meta={"method": "dsnas", "op_names": net.primitives}) as rec:
        for step in range(1, 4):
            stats = {**snas.step(train), **dsnas.step(train)}
            snas.epoch_end(step)
            rec.log(step, stats)
    record = load(str(path))
    hm = sample_counts(record, "normal", 2)
    assert hm.matrix.sum() == 3 * net.num_edges and list(hm.cols) == net.primitives
    np.testing.assert_array_equal(hm.matrix, stats[V.SAMPLE_COUNT.path(cell="normal")].numpy())
    written = write_figures(str(path), tmp_path / "figs", figures=["sampling", "sample_counts"])
    names = sorted(Path(p).name for p in written)
    assert names == ["sample_count_normal_heatmap.png", "sample_count_reduce_heatmap.png", "sampling_temperature_entropy.png"]


@pytest.mark.slow  # two short searches on digits
def test_search_run_records_samples_and_resumes(tmp_path):
    from nasdiag.record import load
    from nasdiag.search import SearchConfig, run

    small = dict(method="dsnas", C=4, layers=3, steps=2, batch_size=240, diagnostics=("cost",), progress=False,
                 record=str(tmp_path / "dsnas.h5"))
    run(SearchConfig(epochs=1, **small))
    run(SearchConfig(epochs=2, resume=True, **small))
    rec = load(str(tmp_path / "dsnas.h5"))
    S = 719 // 240
    assert rec["step"].tolist() == list(range(1, 2 * S + 1))
    counts = rec[V.SAMPLE_COUNT.path(cell="normal")]
    # cumulative across the resume: one sample per edge and step
    np.testing.assert_array_equal(counts.sum(axis=(1, 2)), 5 * np.arange(1, 2 * S + 1))
    assert (np.diff(counts, axis=0) >= 0).all()
    epoch_rows = np.flatnonzero(rec[f"valid/{V.COST_COUNT.path(cell='normal')}"])
    # the cost is observed only for sampled ops, once per normal cell (one of three cells) per step
    np.testing.assert_array_equal(rec[V.COST_COUNT.path(cell="normal")][epoch_rows[-1]],
                                  counts[epoch_rows[-1]] - counts[epoch_rows[0]])
    assert np.isfinite(rec["scalars/search_val_acc"][epoch_rows]).all()


def test_sample_counts_restored_on_the_cpu_count_on_with_samples_of_another_device():
    """A checkpoint is loaded on the CPU; the samples of a CUDA run are on the GPU (a resumed DSNAS run on CUDA
    crashed: 'Expected all tensors to be on the same device'). The meta device stands in for CUDA here."""
    from nasdiag.search.methods._sampling import SampleCounts

    counts = SampleCounts()
    counts.load_state_dict({"normal": torch.tensor([[2, 0, 1]])})
    counts.update({"normal": torch.tensor([[0.0, 1.0, 0.0]], device="meta")})
    assert counts.counts["normal"].device.type == "meta" and counts.counts["normal"].shape == (1, 3)
    counts.load_state_dict({"normal": torch.tensor([[2, 0, 1]])})
    counts.update({"normal": torch.tensor([[0.0, 1.0, 0.0]])})
    assert counts.counts["normal"].tolist() == [[2, 1, 1]]
