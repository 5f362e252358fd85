"""Audit round 17 of data parallelism: 2 gloo ranks on CPU (one launch, ``ranks``), against references built here in
float64 (autograd on the concatenated batch, Python integers).

Found, in ``nasdiag.distributed.reduce_statistics``: the ``sum``, ``min`` and ``max`` of integer paths ran through the
float64 collectives, so past 2**53 they were rounded: the sum of 2**53 + 1 and 2 came back 2**53 + 2, the min of
2**53 + 1 and 2**53 + 3 came back 2**53 and their max 2**53 + 4 (values no rank held), the max of the uint64 2**63 + 1
and 2**63 + 2 came back 2**63; they are reduced exactly in 64 bits now (round 14 fixed ``same`` alike). A ``pooled``
mean and var of ints came back in the ints' dtype, truncated: the pooled mean of the samples 1 and 2 was 1, their
variance 0; float64 now, as the ``mean`` of ints.
In ``Probe.hessian`` of a DistributedDataParallel-wrapped supernet: the re-run forward went through the wrapper, whose
forward broadcasts rank 0's buffers (BatchNorm's running statistics), a collective: ``probe.hessian()`` on one rank
alone (diagnostics on rank 0) paired that broadcast with the other rank's next forward, and both ranks stalled in
mismatched collectives until gloo's timeout (30 minutes by default). The wrapped module is re-run now, no collective.
In ``RecorderCallback``: a rank that opens no recorder took ``int()`` of ``flush_every`` (0, 2.5, True accepted where
rank 0's Recorder refuses them, so rank 1 went on into its loop alone; a string was int()'s ValueError traceback).

Checked and found right (references here or in scratch): a `Probe` on a DistributedDataParallel-wrapped LayerNorm
supernet with unequal rank batches (5 and 4 samples, an epoch's last): each rank's per-sample cost rows are
∂ℓ_b/∂Z / B_r, so scaled by B_r / B and concatenated in rank order they are the concatenated batch's rows; each rank's
``exact`` diagonal Hessian is that of its own mean loss, and their sample-weighted mean (5 H_0 + 4 H_1) / 9 the
concatenated batch's (1e-12; the plain rank mean of the docs holds for equal batches only, as documented); a training
step after ``probe.hessian()`` still all-reduces the weight gradients (the re-run forward through the DDP wrapper
leaves its reducer usable); a NaN diagonal on one rank only is NaN in the one record rank 0 writes, its ``nonfinite``
flag set and counted, not averaged away. In scratch, not kept (earlier rounds cover them): ``nasdiag.search.run`` on 2
ranks (DARTS, LayerNorm, float64) leaves only the record and its checkpoint in the folder, α and every weight bitwise
the same on both ranks after every step; a disk error (ENOSPC) of rank 0's recorder at an epoch end stops rank 0 with
it and rank 1 with one RankLostError line, in seconds, and a 2-rank ``--resume``-style ``run`` of that record equals
the uninterrupted run (every row bitwise, steps 1..88 once; α and weights after every resumed step).
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import free_port, launch_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

D = torch.float64
SIZES = (5, 4)  # samples of rank 0 and rank 1: unequal, as the last batches of an epoch
BIG = 2**53 + 1
# per rank: (value, rule); the reference is Python's integer arithmetic on the two ranks' values
INTS = {"x/sum": ((np.int64(BIG), np.int64(2)), "sum"),
        "x/min": ((np.int64(BIG), np.int64(BIG + 2)), "min"),
        "x/max": ((np.int64(-BIG - 2), np.int64(-BIG)), "max"),
        "x/umax": ((np.uint64(2**63 + 1), np.uint64(2**63 + 2)), "max"),
        "x/narrow": ((np.uint8(200), np.uint8(201)), "sum")}


class Mix(nn.Module):
    """A DARTS-convention mixed op of three candidates; weights (K,) or per sample (B, K)."""

    def __init__(self, d):
        super().__init__()
        self._ops = nn.ModuleList([nn.Linear(d, d, bias=False), nn.Sequential(nn.Tanh(), nn.Linear(d, d)), nn.Identity()])

    def forward(self, x, weights):
        return sum(weights[..., k].unsqueeze(-1) * op(x) for k, op in enumerate(self._ops))


class Net(nn.Module):
    """LayerNorm (no sample couples another), three mixed edges, Z = softmax(α) when none is given."""

    def __init__(self, d=5):
        super().__init__()
        self.inp, self.norm = nn.Linear(3, d), nn.LayerNorm(d)
        self.e = nn.ModuleList([Mix(d) for _ in range(3)])
        self.alpha = nn.Parameter(torch.randn(3, 3))
        self.out = nn.Linear(d, 4)

    def forward(self, x, Z=None):
        Z = F.softmax(self.alpha, -1) if Z is None else Z
        h0 = self.norm(self.inp(x))
        h1 = self.e[0](h0, Z[0])
        return self.out(torch.tanh(self.e[1](h0, Z[1]) + self.e[2](h1, Z[2])))


def network(norm: str = "layer"):
    torch.manual_seed(0)
    net = Net().double()
    if norm == "batch":  # train mode: each rank normalises with its own batch
        net.norm = nn.BatchNorm1d(5).double()
    return net


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(sum(SIZES), 3, generator=g, dtype=D), torch.randint(0, 4, (sum(SIZES),), generator=g)


def part(rank: int) -> slice:
    start = sum(SIZES[:rank])
    return slice(start, start + SIZES[rank])


WORKER = textwrap.dedent(
    """
    import datetime, sys
    import numpy as np
    import torch, torch.distributed as dist, torch.nn.functional as F
    from test_audit_ddp_round17 import INTS, batch, network, part
    import nasdiag
    from nasdiag.distributed import reduce_statistics
    from nasdiag.record import RecorderCallback

    rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    res = {}
    try:
        res["ints"] = reduce_statistics({p: v[rank] for p, (v, _) in INTS.items()}, rules={p: r for p, (_, r) in INTS.items()})
    except Exception as err:  # recorded for the test
        res["ints"] = f"{type(err).__name__}: {err}"
    # one integer sample per rank (1 and 2), its int mean and var pooled as the docs advise for unequal batches
    res["pooled_int"] = reduce_statistics({"x/mean": np.int64(1 + rank), "x/var": np.int64(0), "x/count": np.int64(1)},
                                          rules={"x/mean": "pooled"})
    x, y = batch()
    x, y = x[part(rank)], y[part(rank)]
    net = network()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    probe = nasdiag.attach(ddp, hessian="exact")
    with probe.record():
        F.cross_entropy(ddp(x), y).backward()
    res["rows"] = {k: v.detach().clone() for k, v in probe.costs(per_sample=True).items()}
    res["hessian"] = {k: v.detach().clone() for k, v in probe.hessian().items()}
    for p in net.parameters():
        p.grad = None
    with probe.record():  # a step after hessian(): DDP must still average the weight gradients
        F.cross_entropy(ddp(x), y).backward()
    res["grad"] = {n: p.grad.clone() for n, p in net.named_parameters() if n != "alpha"}
    # BatchNorm (DDP broadcasts its buffers at every forward): hessian() on rank 0 alone, then a step on both ranks
    bn = network("batch")
    ddp = torch.nn.parallel.DistributedDataParallel(bn)
    probe = nasdiag.attach(ddp, hessian="exact")
    with probe.record():
        F.cross_entropy(ddp(x), y).backward()
    if rank == 0:
        res["bn_hessian"] = {k: v.detach().clone() for k, v in probe.hessian().items()}
    for p in bn.parameters():
        p.grad = None
    F.cross_entropy(ddp(x), y).backward()
    res["bn_grad"] = {n: p.grad.clone() for n, p in bn.named_parameters() if n != "alpha"}
    # a NaN diagonal on rank 1 only, flagged there: the one record rank 0 writes must keep it
    diag = torch.stack(list(res["hessian"].values()))
    if rank == 1:
        diag[1, 2] = float("nan")
    with RecorderCallback(f"{out}.h5", meta={"run": "ddp17"}) as callback:
        callback.on_step_end(1, {"hessian/edges/diag": diag, "hessian/edges/nonfinite": torch.tensor(rank == 1)})
    dist.destroy_process_group()  # after the callback's last collective: nothing is pending
    torch.save(res, f"{out}.{rank}")
    """
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of the 2 ranks of WORKER saved, and the record path: one launch (at most 60 s) for every test here."""
    folder, port = tmp_path_factory.mktemp("ddp17"), free_port()
    (folder / "worker.py").write_text(WORKER)
    out = folder / "results"
    launch_ranks(folder / "worker.py", lambda r: [r, f"tcp://127.0.0.1:{port}", out], timeout=60)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in (0, 1)], f"{out}.h5"


@pytest.mark.parametrize("path", list(INTS))
def test_an_int_summed_or_taken_min_or_max_is_exact_past_2_to_the_53(ranks, path):
    """Through float64 the sum of 2**53 + 1 and 2 was 2**53 + 2, the min of 2**53 + 1 and 2**53 + 3 was 2**53."""
    (a, b), rule = INTS[path]
    want = {"sum": int(a) + int(b), "min": min(int(a), int(b)), "max": max(int(a), int(b))}[rule]
    want_dtype = (np.uint64 if a.dtype.kind == "u" else np.int64) if rule == "sum" else a.dtype
    for rank in (0, 1):
        got = ranks[0][rank]["ints"]
        assert isinstance(got, dict), got
        assert got[path].dtype == want_dtype and int(got[path]) == want, (rank, path, got[path], want)


def test_moments_of_int_samples_pooled_are_the_samples_moments_not_truncated_to_ints(ranks):
    """Kept in the ints' dtype, the pooled mean of the samples 1 and 2 was 1 and their variance 0."""
    samples = np.array([1.0, 2.0])
    want = {"x/mean": samples.mean(), "x/var": samples.var(), "x/count": 2}
    for rank in (0, 1):
        got = ranks[0][rank]["pooled_int"]
        assert {p: float(v) for p, v in got.items()} == want, (rank, got)
        assert got["x/mean"].dtype == got["x/var"].dtype == np.float64 and got["x/count"].dtype == np.int64


def _reference(norm: str = "layer"):
    """Independent of nasdiag: per-sample ∂ℓ_b/∂Z (B, E, K) and the exact diag ∂²/∂Z² of the mean loss of each rank's
    part and of the concatenated batch, by autograd at Z = softmax(α); the weight gradients of each rank's mean loss."""
    net, (x, y) = network(norm), batch()
    Z = F.softmax(net.alpha, -1).detach()
    rows = None if norm == "batch" else torch.stack(  # a sample's own loss: train-mode BatchNorm couples them
        [torch.autograd.grad(F.cross_entropy(net(x[b:b + 1], z), y[b:b + 1]), z)[0]
         for b in range(len(y)) for z in [Z.clone().requires_grad_()]])

    def diag(sl):
        H = torch.autograd.functional.hessian(lambda z: F.cross_entropy(net(x[sl], z), y[sl]), Z)
        return H.reshape(Z.numel(), Z.numel()).diagonal().reshape(Z.shape)

    grads = [dict(zip([n for n, _ in net.named_parameters()],
                      torch.autograd.grad(F.cross_entropy(net(x[part(r)]), y[part(r)]), list(net.parameters()))))
             for r in (0, 1)]
    return rows, [diag(part(r)) for r in (0, 1)], diag(slice(None)), grads


def test_ranks_per_sample_rows_and_exact_hessians_make_the_concatenated_batchs_with_unequal_batches(ranks):
    results, _ = ranks
    rows, rank_diag, whole_diag, grads = _reference()
    names = ["module.e.0", "module.e.1", "module.e.2"]
    B = sum(SIZES)
    for r in (0, 1):
        assert sorted(results[r]["rows"]) == names
        for e, name in enumerate(names):  # a rank's rows carry its mean loss's 1/B_r
            torch.testing.assert_close(results[r]["rows"][name], rows[part(r), e] / SIZES[r], rtol=0, atol=1e-14)
            torch.testing.assert_close(results[r]["hessian"][name], rank_diag[r][e], rtol=0, atol=1e-12)
    for e, name in enumerate(names):
        gathered = torch.cat([results[r]["rows"][name] * SIZES[r] / B for r in (0, 1)])  # in rank order
        torch.testing.assert_close(gathered, rows[:, e] / B, rtol=0, atol=1e-14)
        weighted = sum(results[r]["hessian"][name] * SIZES[r] for r in (0, 1)) / B
        torch.testing.assert_close(weighted, whole_diag[e], rtol=0, atol=1e-12)
    for r in (0, 1):  # the step after hessian(): DDP's mean of the ranks' weight gradients, on both ranks
        for n, g in results[r]["grad"].items():
            torch.testing.assert_close(g, (grads[0][n] + grads[1][n]) / 2, rtol=0, atol=1e-13)


def test_a_nan_diagonal_on_one_rank_is_recorded_nan_and_flagged(ranks):
    from nasdiag.record import load

    results, record = ranks
    rec = load(record)
    want = (torch.stack(list(results[0]["hessian"].values())) + torch.stack(list(results[1]["hessian"].values()))) / 2
    got = np.asarray(rec["hessian/edges/diag"])[0]
    assert np.isnan(got[1, 2]) and np.isnan(got).sum() == 1
    finite = ~np.isnan(got)
    np.testing.assert_allclose(got[finite], want.numpy()[finite], rtol=0, atol=1e-15)
    assert bool(np.asarray(rec["hessian/edges/nonfinite"])[0])
    import h5py

    with h5py.File(record, "r") as f:
        counts = {k: int(v) for k, v in f["hessian/edges/diag"].attrs.items() if "nonfinite" in k}
    assert counts and max(counts.values()) == 1, counts


def test_hessian_of_a_ddp_batchnorm_supernet_on_one_rank_alone_is_its_batchs_and_the_next_step_goes_on(ranks):
    """The re-run forward went through the DDP wrapper, whose forward broadcasts rank 0's buffers: rank 0 alone in
    hessian() paired that broadcast with rank 1's next forward, and both ranks then timed out in mismatched collectives
    (after 30 minutes at the default timeout). The wrapped module is re-run, with no collective."""
    results, _ = ranks
    _, rank_diag, _, grads = _reference("batch")
    assert "bn_hessian" in results[0] and "bn_hessian" not in results[1]
    for e, name in enumerate(["module.e.0", "module.e.1", "module.e.2"]):
        torch.testing.assert_close(results[0]["bn_hessian"][name], rank_diag[0][e], rtol=0, atol=1e-12)
    for r in (0, 1):
        for n, g in results[r]["bn_grad"].items():
            torch.testing.assert_close(g, (grads[0][n] + grads[1][n]) / 2, rtol=0, atol=1e-13)


@pytest.mark.parametrize("flush_every", ["64", 0, 2.5, True])
def test_a_flush_every_rank_0_refuses_is_refused_alike_on_a_rank_that_writes_nothing(tmp_path, monkeypatch, flush_every):
    """Rank 0's Recorder refuses these in one line; a rank that opens no recorder took int() of them (0, 2, 1: it went
    on into its loop while rank 0 stopped) or raised int()'s ValueError traceback for the string."""
    from nasdiag.record import RecordError, RecorderCallback

    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RecordError) as writer:
        RecorderCallback(tmp_path / "run.h5", flush_every=flush_every)
    monkeypatch.setenv("RANK", "1")  # no process group: the rank a launcher's variable names
    with pytest.raises(RecordError) as other:
        RecorderCallback(tmp_path / "run.h5", flush_every=flush_every)
    assert str(other.value) == str(writer.value) and "\n" not in str(other.value) and "flush_every" in str(other.value)
    assert list(tmp_path.iterdir()) == []
