"""Round-11 new-user audit: a researcher's own supernet and loop (not nasdiag's Network or runner), following README.md
and docs/probe.md only, with what real loops do: gradient accumulation, loss scaling, `autograd.grad`, checkpointing,
shared op modules, α from a hypernetwork, dropped paths, `.double()` after attach, validation passes, sub-modules.

References are written here from scratch in float64: Z a leaf, ∂L/∂Z by torch.autograd.grad and diag ∂²L/∂Z² by
torch.autograd.functional.hessian of the same loss, on the same forward with Z passed in.

Checked and found right (no test needed beyond the ones below): two micro-batches of loss/2 in one block (costs =
∂(ΣL_m/2)/∂Z, per-sample rows concatenated); a loss scaled by 1024 (GradScaler-like) gives 1024× the costs (the
cost of the loss that was backwarded, as .grad); `backward(retain_graph=True)` twice adds up; `torch.autograd.grad`
of the loss w.r.t. all parameters or only α instead of backward; non-reentrant `torch.utils.checkpoint` around edges
(costs and exact curvature); one candidate op module on two edges; α from a hypernetwork (costs, exact curvature;
wrt='alpha' refused in one line); input-conditioned (B, K) weights per sample; `.double()` and `.float()` after
attach; validation forwards under no_grad / inference_mode inside the block (costs, curvature); attach to a
sub-module called once; a probe dropped and a new one attached (collected, no hook left); bf16 autocast with a
scaled loss (float32 costs within 0.6 % of float64); the whole model under reentrant and non-reentrant checkpoint
(costs, exact curvature); torch.func.grad of a functional_call inside a block; nasdiag's Network moved to
channels_last after attach; a real Lightning Trainer with manual optimization and two optimizers (rows at
global_step 2, 4, ...; E[C] to 1e-17); a RecorderCallback record of a user loop (cost/edges/{mean,var,count},
hessian/edges/diag against autograd, shapes and dtypes as docs/schema.md) drawn by `nasdiag plot`; 300 steps of
a sub-module probe and a micro-batch probe with validation forwards keep no tensor and leave no hook.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nasdiag

D = torch.float64
W = 5  # node width


class _Mix(nn.Module):
    """A DARTS-convention mixed op of three candidates of different kinds."""

    def __init__(self):
        super().__init__()
        self._ops = nn.ModuleList([nn.Linear(W, W), nn.Sequential(nn.Tanh(), nn.Linear(W, W, bias=False)), nn.Identity()])

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self._ops))


class _Net(nn.Module):
    """n1 = e0(n0); n2 = e1(n0) + e2(n1); ``drop`` skips e2 (a dropped path / a shrunk supernet at this step)."""

    def __init__(self):
        super().__init__()
        self.stem, self.head = nn.Linear(4, W), nn.Linear(W, 3)
        self.e = nn.ModuleList([_Mix() for _ in range(3)])
        self.alpha = nn.Parameter(torch.randn(3, 3) * 0.5)
        self.drop = False

    def forward(self, x, Z=None):
        Z = F.softmax(self.alpha, -1) if Z is None else Z
        n0 = torch.tanh(self.stem(x))
        n1 = self.e[0](n0, Z[0])
        n2 = self.e[1](n0, Z[1]) + (self.e[2](n1, Z[2]) if not self.drop else 0)
        return self.head(n2)


def _net(seed=0):
    torch.manual_seed(seed)
    return _Net().to(D)


def _batch(seed=1, b=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 4, generator=g, dtype=D), torch.randint(0, 3, (b,), generator=g)


def _exact_diag(net, x, y):
    """diag ∂²L/∂Z² per edge, (E, K), of the mean cross-entropy with Z = softmax(α) a leaf."""
    Z = F.softmax(net.alpha, -1).detach().clone()
    H = torch.autograd.functional.hessian(lambda z: F.cross_entropy(net(x, z), y), Z)
    return torch.stack([H[e, :, e, :].diagonal() for e in range(Z.shape[0])])


@pytest.mark.parametrize("mode", ["exact", "diag"])
def test_hessian_of_a_step_with_a_dropped_path_is_nan_there_and_the_curvature_of_the_edges_that_ran(mode):
    """Before: probe.hessian() after a step whose forward skipped an edge (drop-path, progressive shrinking) raised
    the curvature engine's "mixed op(s) ['e.2'] never ran ...; pass only edges that model(inputs) actually uses",
    advice probe.hessian() has no argument for: no curvature at all on such steps. Now the dropped edge is NaN (as
    its cost), with a warning, and the others are the curvature of the recorded forward."""
    net, (x, y) = _net(), _batch()
    net.drop = True
    probe = nasdiag.attach(net, hessian=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # e.2 never ran, e.0 feeds only e.2: the block says so
        with probe.record(targets=y):
            F.cross_entropy(net(x), y).backward()
    with pytest.warns(RuntimeWarning, match=r"did not run 1 edge\(s\) \('e\.2'\).*NaN"):
        H = probe.hessian()
    assert list(H) == ["e.0", "e.1", "e.2"] and torch.isnan(H["e.2"]).all()
    if mode == "exact":
        ref = _exact_diag(net, x, y)
        assert float((H["e.1"] - ref[1]).abs().max()) < 1e-12
        assert float(H["e.0"].abs().max()) == 0.0 == float(ref[0].abs().max())  # feeds only the dropped edge
    else:  # the recursion's own result on the edges that ran: that of the same step without the dropped edge mapped
        alone = nasdiag.attach(net, edges={"e.1": net.e[1]}, hessian=mode)
        with alone.record(targets=y):
            F.cross_entropy(net(x), y).backward()
        assert torch.equal(H["e.1"], alone.hessian()["e.1"])
    # the next step runs every edge again: every edge's curvature, no NaN, no warning
    net.drop = False
    with probe.record(targets=y):
        F.cross_entropy(net(x), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        H = probe.hessian()
    if mode == "exact":
        ref = _exact_diag(net, x, y)
        assert max(float((H[f"e.{e}"] - ref[e]).abs().max()) for e in range(3)) < 1e-12
    assert not any(bool(torch.isnan(h).any()) for h in H.values())


class _Block(nn.Module):
    """The three edges of `_Net` as a sub-module: (n0, Z) -> n2."""

    def __init__(self):
        super().__init__()
        self.e = nn.ModuleList([_Mix() for _ in range(3)])

    def forward(self, n0, Z):
        return self.e[1](n0, Z[1]) + self.e[2](self.e[0](n0, Z[0]), Z[2])


class _Deep(nn.Module):
    """One block applied at two depths (weights shared between depths); ``tied``: one Z for both, else its own each."""

    def __init__(self, tied):
        super().__init__()
        self.stem, self.head, self.block = nn.Linear(4, W), nn.Linear(W, 3), _Block()
        self.alpha = nn.Parameter(torch.randn(1 if tied else 2, 3, 3) * 0.5)

    def forward(self, x, Z=None):
        Z = F.softmax(self.alpha, -1) if Z is None else Z
        h = self.block(torch.tanh(self.stem(x)), Z[0])
        return self.head(self.block(torch.tanh(h), Z[-1]))


def _deep(tied):
    torch.manual_seed(0)
    return _Deep(tied).to(D)


def test_a_sub_module_applied_twice_in_one_forward_is_one_forward_of_it_not_two_batches():
    """Before: attached to a sub-module that the model applies at two depths, the probe counted each application as
    a forward of its own (a micro-batch): per-sample costs came back as 2B rows, and with its own Z at each depth the
    two Z's costs were silently added under one edge name (attached to the whole model the same forward is refused).
    Now an application that reads what the last one computed is the same forward: tied Z add up per sample
    (autograd's per-sample ∂ℓ_b/∂Z), two different Z are one ProbeError line, and true micro-batches (two forwards of
    the model) are still rows of their own."""
    x, y = _batch()
    B = x.shape[0]
    net = _deep(tied=True)
    probe = nasdiag.attach(net.block)
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    Z = F.softmax(net.alpha, -1).detach().clone().requires_grad_()
    g, = torch.autograd.grad(F.cross_entropy(net(x, Z), y), Z)
    rows = torch.stack([torch.autograd.grad(F.cross_entropy(net(x[b:b + 1], Z), y[b:b + 1]) / B, Z)[0][0]
                        for b in range(B)])  # (B, E, K): sample b's own term of the mean loss
    costs, per_sample = probe.costs(), probe.costs(per_sample=True)
    for e in range(3):
        assert float((costs[f"e.{e}"] - g[0, e]).abs().max()) < 1e-12
        assert per_sample[f"e.{e}"].shape == (B, 3)
        assert float((per_sample[f"e.{e}"] - rows[:, e]).abs().max()) < 1e-12

    # two micro-batches (two forwards of the model, one block): rows of each, in call order
    with probe.record():
        for part in (slice(0, 2), slice(2, B)):
            (F.cross_entropy(net(x[part]), y[part]) * (part.stop - part.start) / B).backward()
    per_sample = probe.costs(per_sample=True)
    assert all(float((per_sample[f"e.{e}"] - rows[:, e]).abs().max()) < 1e-12 for e in range(3))

    net = _deep(tied=False)
    probe = nasdiag.attach(net.block)
    with pytest.raises(nasdiag.probe.ProbeError, match=r"^edge 'e\.1': its mixed op ran twice in one forward .* two Z"):
        with probe.record():
            F.cross_entropy(net(x), y).backward()
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules()) == 0


def test_hessian_after_a_validation_forward_with_grad_on_in_the_block_is_one_line_not_the_validation_batch():
    """Before: a validation forward run without torch.no_grad() before the training step inside the block was the
    call hessian() re-ran: with probe.record(targets=y) and a validation batch of the training batch's size, it
    returned the curvature of the validation inputs under the training labels, silently (here 0.04 to 2.3
    times the training batch's). Now that
    is one ProbeError line; under no_grad the validation forward is skipped, and hessian(inputs=, targets=) is
    the curvature of the batch given."""
    net, (x, y) = _net(), _batch()
    xv, _ = _batch(seed=7)
    probe = nasdiag.attach(net, hessian="exact")
    ref = _exact_diag(net, x, y)
    with probe.record(targets=y):
        net(xv)  # a validation loss for the log, grad mode on, never backwarded
        F.cross_entropy(net(x), y).backward()
    with pytest.raises(nasdiag.probe.ProbeError, match=r"^hessian\(\): the block's first model call .* torch\.no_grad\(\)"):
        probe.hessian()
    H = probe.hessian(inputs=x, targets=y)
    assert max(float((H[f"e.{e}"] - ref[e]).abs().max()) for e in range(3)) < 1e-12
    with probe.record(targets=y):
        with torch.no_grad():
            net(xv)
        F.cross_entropy(net(x), y).backward()
    H = probe.hessian()
    assert max(float((H[f"e.{e}"] - ref[e]).abs().max()) for e in range(3)) < 1e-12


def test_accumulated_micro_batches_under_a_grad_scaler_cost_the_scaled_step_as_docs_say():
    """docs/probe.md: the micro-batches of one optimizer step in one block add up, and under a GradScaler the costs
    carry its scale (divide by get_scale()). Reference: ∂/∂Z of Σ_m L_m/M with Z a leaf, per-sample rows of each."""
    net, (x, y) = _net(), _batch(b=6)
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    parts = (slice(0, 4), slice(4, 6))
    probe = nasdiag.attach(net)
    with probe.record():
        for part in parts:
            scaler.scale(F.cross_entropy(net(x[part]), y[part]) / len(parts)).backward()
    Z = F.softmax(net.alpha, -1).detach().clone().requires_grad_()
    g, = torch.autograd.grad(sum(F.cross_entropy(net(x[p], Z), y[p]) for p in parts) / len(parts), Z)
    rows = torch.stack([torch.autograd.grad(F.cross_entropy(net(x[b:b + 1], Z), y[b:b + 1])
                                            / (len(parts) * (p.stop - p.start)), Z)[0]
                        for p in parts for b in range(p.start, p.stop)])
    costs, per_sample = probe.costs(), probe.costs(per_sample=True)
    for e in range(3):
        assert float((costs[f"e.{e}"] / scaler.get_scale() - g[e]).abs().max()) < 1e-12
        assert float((per_sample[f"e.{e}"] / scaler.get_scale() - rows[:, e]).abs().max()) < 1e-12
    assert (probe.statistics()["cost/edges/count"] == 1).all()


@pytest.mark.parametrize("result", ["costs", "output_costs", "path_costs"])
def test_per_sample_given_a_string_is_one_line_not_switched_on(result):
    """Before: costs(per_sample="no") returned the per-sample (B, K) rows (bool("no") is True), where attach refuses a
    string for its own switches (path_split, norm_deviation). Now one ProbeError line, as at attach."""
    net, (x, y) = _net(), _batch()
    probe = nasdiag.attach(net)
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    with pytest.raises(nasdiag.probe.ProbeError, match=r"^per_sample must be True or False, got 'no' \(str\)$"):
        getattr(probe, result)(per_sample="no")
    assert probe.costs(per_sample=False)["e.0"].shape == (3,)


class _Once(_Deep):
    """stem -> block -> head, the block applied once."""

    def forward(self, x, Z=None):
        Z = F.softmax(self.alpha, -1)[0] if Z is None else Z
        return self.head(self.block(torch.tanh(self.stem(x)), Z))


def test_curvature_through_a_sub_module_with_the_rest_of_the_network_in_loss_fn_is_the_models():
    """docs/probe.md: attached to a sub-module, hessian() re-runs it on its recorded inputs, and loss_fn carries the
    rest of the network. Reference: diag ∂²L/∂Z² of the whole model's loss, Z a leaf."""
    torch.manual_seed(0)
    net, (x, y) = _Once(tied=True).to(D), _batch()
    probe = nasdiag.attach(net.block, hessian="exact", loss_fn=lambda h, t: F.cross_entropy(net.head(h), t))
    with probe.record(targets=y):
        F.cross_entropy(net(x), y).backward()
    Z = F.softmax(net.alpha, -1)[0].detach().clone()
    H = torch.autograd.functional.hessian(lambda z: F.cross_entropy(net(x, z), y), Z)
    got = probe.hessian()
    assert max(float((got[f"e.{e}"] - H[e, :, e, :].diagonal()).abs().max()) for e in range(3)) < 1e-12


def test_labels_are_read_off_a_bfloat16_autocast_backward_as_off_a_float32_one():
    """Before: under torch.autocast(bfloat16) the logits' gradient is bfloat16, so softmax(z) − B·∂L/∂z missed one-hot by
    ~2e-3 (2⁻⁹ relative rounding), over the 1e-3 the recovery allowed: hessian() without targets said the loss was not
    the default cross-entropy, which it was. Now the tolerance follows the gradient's dtype; the result is the
    curvature with the true labels given."""
    torch.manual_seed(0)
    net = _Net().float()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, 4, generator=g) * 3, torch.randint(0, 3, (64,), generator=g)
    probe = nasdiag.attach(net, hessian="exact")
    with probe.record():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(net(x), y)
        loss.backward()
    inferred = probe.hessian()
    given = probe.hessian(targets=y)
    assert all(torch.equal(inferred[n], given[n]) for n in given)


def test_hessian_after_a_block_that_called_model_forward_directly_says_so():
    """model.forward(x) runs no module hooks, so the probe keeps no batch for hessian(): one line saying to call
    model(x) (not the validation-forward line, whose condition also holds here: no kept call was reached)."""
    net, (x, y) = _net(), _batch()
    probe = nasdiag.attach(net, hessian="exact")
    with probe.record(targets=y):
        F.cross_entropy(net.forward(x), y).backward()
    with pytest.raises(nasdiag.probe.ProbeError, match=r"^the model was not called .* model\.forward\(x\) runs no hooks"):
        probe.hessian()
    ref = _exact_diag(net, x, y)
    H = probe.hessian(inputs=x, targets=y)
    assert max(float((H[f"e.{e}"] - ref[e]).abs().max()) for e in range(3)) < 1e-12


def test_micro_batches_through_one_backward_keep_their_per_sample_rows_in_call_order():
    """Before: micro-batches whose losses were summed into one backward (not a backward each) came back as per-sample
    rows in the order the backward reached them, the last forward first: row b was another sample's cost, silently,
    where docs/probe.md says "concatenated in call order". Reference: autograd's ∂(ℓ_b/B)/∂Z per sample."""
    net, (x, y) = _net(), _batch()
    B, parts = x.shape[0], (slice(0, 2), slice(2, 6))
    probe = nasdiag.attach(net)
    with probe.record():
        sum(F.cross_entropy(net(x[p]), y[p]) * (p.stop - p.start) / B for p in parts).backward()
    Z = F.softmax(net.alpha, -1).detach().clone().requires_grad_()
    rows = torch.stack([torch.autograd.grad(F.cross_entropy(net(x[b:b + 1], Z), y[b:b + 1]) / B, Z)[0] for b in range(B)])
    per_sample = probe.costs(per_sample=True)
    assert all(float((per_sample[f"e.{e}"] - rows[:, e]).abs().max()) < 1e-12 for e in range(3))


class _FakeLightningCallback:
    """Stand-in for lightning.pytorch.Callback (Lightning itself may not import here)."""

    def setup(self, trainer, pl_module, stage=None):
        pass


class _Trainer:
    global_rank, global_step, current_epoch = 0, 0, 0


class _Module:
    def nasdiag_statistics(self):
        return {"scalars/loss": 1.0}


def test_lightning_validate_and_test_after_fit_leave_the_record_as_the_fit_wrote_it(tmp_path, monkeypatch):
    """Before: setup/teardown of trainer.validate(), test() or predict() opened the record for resume and closed it,
    adding an empty segment file at every call (seen with a real Trainer: run.seg0001.h5 after fit + validate), and
    made a record where there was none. They run no training batch: now they leave the files alone, and a second fit
    still continues the record."""
    import sys
    import types

    lightning, pytorch = types.ModuleType("lightning"), types.ModuleType("lightning.pytorch")
    pytorch.Callback, lightning.pytorch = _FakeLightningCallback, pytorch
    monkeypatch.setitem(sys.modules, "lightning", lightning)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", pytorch)
    from nasdiag.record import lightning_callback, load

    def fit(cb, trainer, steps):
        cb.setup(trainer, _Module(), stage="fit")
        for _ in range(steps):
            trainer.global_step += 1
            cb.on_train_batch_end(trainer, _Module(), None, None, 0)
        cb.on_train_epoch_end(trainer, _Module())
        cb.teardown(trainer, _Module(), stage="fit")

    path, trainer = tmp_path / "run.h5", _Trainer()
    cb = lightning_callback(path, flush_seconds=None)
    for stage in ("validate", "test", "predict"):  # before any fit: no record is made
        cb.setup(trainer, _Module(), stage=stage)
        cb.teardown(trainer, _Module(), stage=stage)
    assert list(tmp_path.iterdir()) == []
    fit(cb, trainer, 2)
    for stage in ("validate", "test", "predict"):
        cb.setup(trainer, _Module(), stage=stage)
        cb.teardown(trainer, _Module(), stage=stage)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5"]
    fit(cb, trainer, 2)
    assert load(path)["step"].tolist() == [1, 2, 3, 4]


def test_hessian_after_the_recorded_batch_buffer_was_refilled_is_one_line_not_the_next_batch():
    """Before: the probe keeps the recorded batch by reference, so a loop with static input buffers (CUDA graphs,
    pinned buffers) that copied the next batch in before calling hessian() got the curvature of the next batch with
    the next labels, silently (here 37% off the recorded batch's). Now one ProbeError line; a forward that modifies
    its own input in place inside the block is not taken for a refill."""
    net, (x, y) = _net(), _batch()
    ref = _exact_diag(net, x, y)
    buf_x, buf_y = x.clone(), y.clone()
    probe = nasdiag.attach(net, hessian="exact")
    with probe.record(targets=buf_y):
        F.cross_entropy(net(buf_x), buf_y).backward()
    x2, y2 = _batch(seed=9)
    buf_x.copy_(x2)
    buf_y.copy_(y2)
    with pytest.raises(nasdiag.probe.ProbeError, match=r"^hessian\(\): the recorded batch .* modified in place"):
        probe.hessian()
    H = probe.hessian(inputs=x, targets=y)
    assert max(float((H[f"e.{e}"] - ref[e]).abs().max()) for e in range(3)) < 1e-12

    class InPlace(_Net):  # scales its input in place: the re-run sees the input as the block left it
        def forward(self, x, Z=None):
            return super().forward(x.mul_(1.0), Z)
    torch.manual_seed(0)
    net = InPlace().to(D)
    probe = nasdiag.attach(net, hessian="exact")
    with probe.record(targets=y):
        F.cross_entropy(net(x.clone()), y).backward()
    H = probe.hessian()
    assert max(float((H[f"e.{e}"] - ref[e]).abs().max()) for e in range(3)) < 1e-12


def test_a_recorder_callback_of_a_single_process_with_a_stray_rank_variable_says_it_records_nothing(tmp_path, monkeypatch):
    """Before: a single process whose environment holds RANK=1 (a job array, a shell of a torchrun launch) and no
    process group took itself for a non-writing rank: RecorderCallback(path) wrote no file and dropped every row,
    without a word (the CLI refuses that environment in one line). Now a RecordWarning, once, at the first rows it
    drops. Under a process group of several ranks, where rank 0 writes the reduced rows, it stays quiet (checked
    with two gloo ranks, warnings as errors, the callback made before init_process_group)."""
    from nasdiag.record import RecordWarning, RecorderCallback

    monkeypatch.setenv("RANK", "1")
    callback = RecorderCallback(tmp_path / "run.h5")
    for step in range(3):
        callback.on_step_end(step, {"scalars/loss": 1.0})
    with pytest.warns(RecordWarning, match=r"does not write: the environment says RANK=1 and no process group"):
        callback.on_epoch_end(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback.on_step_end(4, {"scalars/loss": 1.0})
        callback.close()
    assert list(tmp_path.iterdir()) == []


def test_a_path_dropped_in_one_micro_batch_keeps_every_edges_row_b_on_sample_b():
    """Before: two micro-batches in one block, the second dropping edge e.2 (and e.0, which feeds only it): e.2's
    per-sample rows were the first micro-batch's only, so with equal micro-batches row b of e.2 and row b of e.1 were
    different samples, silently. Now the rows of a forward an edge took no
    part in are NaN, with a warning, and every other row is autograd's ∂(ℓ_b/B)/∂Z of its own sample."""
    net, (x, y) = _net(), _batch()
    B, parts = x.shape[0], (slice(0, 3), slice(3, 6))
    probe = nasdiag.attach(net)
    with pytest.warns(RuntimeWarning, match=r"took no part in some of the block's 2 model forwards"):
        with probe.record():
            for drop, p in zip((False, True), parts):
                net.drop = drop
                (F.cross_entropy(net(x[p]), y[p]) * (p.stop - p.start) / B).backward()
    Z = F.softmax(net.alpha, -1).detach().clone().requires_grad_()
    rows = []
    for b in range(B):
        net.drop = b >= 3
        rows.append(torch.autograd.grad(F.cross_entropy(net(x[b:b + 1], Z), y[b:b + 1]) / B, Z)[0])
    rows = torch.stack(rows)
    per_sample, costs = probe.costs(per_sample=True), probe.costs()
    for e in range(3):
        got = per_sample[f"e.{e}"]
        assert got.shape == (B, 3)
        ran = slice(0, 3) if e != 1 else slice(0, 6)
        assert float((got[ran] - rows[ran, e]).abs().max()) < 1e-12
        assert torch.isnan(got[3:]).all() == (e != 1)
        assert float((costs[f"e.{e}"] - rows[:, e].sum(0)).abs().max()) < 1e-12
