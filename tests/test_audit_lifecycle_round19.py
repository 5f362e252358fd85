"""Audit round 19, resource lifecycle (nasdiag/hooks.py, nasdiag/probe/, nasdiag/memory.py, the per-step resources of
nasdiag/search, nasdiag/record/callbacks.py).

Found: the CPU's free memory read from a container's cgroup counted its page cache as used (``memory.current``
includes it), so a run that had read its dataset and written its record, with the cache grown to the limit, was
refused a record's row buffer (and an exact curvature) for want of memory the kernel reclaims on demand.
And only the root folder of the cgroup mount was read: a batch job's cgroup below it (Slurm on cgroup v2, no
namespace), whose limit is on the job's level, got the host's MemAvailable, so the cap meant to keep a batch of
exact products inside the memory the process may use did not see the job's limit.
probe.hessian(wrt="alpha") after the usual block ``net(x, softmax(α))`` + ``backward()`` kept the recorded weights with the
graph the backward had freed, and the softmax check of the chain rule stopped in torch's "backward through the graph a
second time" traceback, in every mode.
With path_split a step's captures formed a reference cycle (an edge call and its cell call), so every step's captured
activations outlived its block until Python's cyclic collector ran: several steps of them at a time (1390 objects
freed by a full collection after 30 steps of a 2-cell supernet).
The diagonal curvature recursions (diag/approx of arch_diag_hessian, probe.hessian, diag_hessian) kept their hook plans
on the tracer and the edge recorder, whose hooks are their own bound methods and closures: a reference cycle holding the
traced forward's tensors (298 of them per probe.hessian() here) after every call, until a collection (fixed in
nasdiag/hessian/trace.py and arch.py, outside this area: the plan is dropped on exit).

Checked and right (own references: every hook dict of every module, torch's global module hooks, the saved-tensor
hook stack, BN buffers, ``.grad``, grad mode, default dtype, the deterministic flag and the global RNG compared
before and after; ``gc``/``tracemalloc`` censuses): a probe's block with path_split, norm_deviation and hessian
leaves nothing behind when the body, a user's forward hook, a candidate op, a user's tensor hook in the backward or
KeyboardInterrupt raises, when a generator holding the block is closed or dropped, with two probes nested on one
model; a backward outside the block on the block's graph (retained or never run) calls none of the probe's code;
probe.hessian in every mode, with a loss_fn raising (also KeyboardInterrupt), leaves buffers, .grad and the RNG as
they were; a dropped probe is freed without gc (no cycle; the model does not hold it); the methods' curvature()
and evaluate(), also interrupted mid-forward, restore buffers and RNG; every built-in method run 200 steps with a
probe (all options) and hessian diagnostics holds a constant number of live tensors (the few hundred bytes a step
tracemalloc shows are torch's own pybind11 records, there without nasdiag's probe too); no tensor nasdiag keeps after a
method's step has a grad_fn; a user loop with every probe result and hessian() each step stays flat; run() interrupted by
KeyboardInterrupt in a callback restores torch's threads and the signal handlers and leaves a readable record.

Left alone: with path_split, micro-batches accumulated in one block keep their activations until the block ends (the
split of an incomplete backward is finished there; now said in docs/probe.md); cgroup v1 limits are not read (the
module says v2); ASM-NAS swaps its network's mixed ops when built, so a probe attached before the method is one
"attach again" line at the first step.
"""

import numpy as np
import pytest
import torch
from torch import nn

import nasdiag
from nasdiag import memory
from nasdiag.probe import ProbeError

from conftest import float64_batch, tiny_network


def _cgroup(tmp_path, monkeypatch, *, limit: int, current: int, inactive_file: int, available: int):
    tmp_path.mkdir(parents=True, exist_ok=True)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {4 * available // 1024} kB\nMemAvailable:   {available // 1024} kB\n")
    folder = tmp_path / "cgroup"
    folder.mkdir()
    (folder / "memory.max").write_text(f"{limit}\n")
    (folder / "memory.current").write_text(f"{current}\n")
    # the layout of a cgroup v2 memory.stat: flat keys in bytes, inactive_file among them (not first)
    (folder / "memory.stat").write_text(f"anon {current - 2 * inactive_file}\nfile {2 * inactive_file}\n"
                                        f"active_file {inactive_file}\ninactive_file {inactive_file}\n"
                                        "inactive_anon 0\n")
    monkeypatch.setattr(memory, "MEMINFO", str(meminfo))
    monkeypatch.setattr(memory, "CGROUP_MEMORY", (str(folder / "memory.max"), str(folder / "memory.current")))


def test_a_cgroups_reclaimable_page_cache_counts_as_free_memory_and_a_record_buffer_fits_in_it(tmp_path, monkeypatch):
    """A container at its limit, most of it inactive page cache (what the kernel hands back first): free is the limit
    less the working set (usage − inactive_file, as cAdvisor and the kubelet count it), not limit − usage ≈ 0."""
    from nasdiag.record import Recorder

    gib, mib = 2**30, 2**20
    limit, cache = 8 * gib, 6 * gib
    _cgroup(tmp_path, monkeypatch, limit=limit, current=limit - 64 * 1024, inactive_file=cache, available=64 * gib)
    assert memory.free_cpu_memory() == limit - (limit - 64 * 1024 - cache)
    # the kernel's own estimate stays the bound where it is smaller
    _cgroup(tmp_path / "b", monkeypatch, limit=limit, current=limit - mib, inactive_file=cache, available=gib)
    assert memory.free_cpu_memory() == gib
    # a stat without inactive_file, or none at all: the usage as it is (no memory made up)
    _cgroup(tmp_path / "c", monkeypatch, limit=limit, current=limit - mib, inactive_file=cache, available=64 * gib)
    (tmp_path / "c" / "cgroup" / "memory.stat").write_text("anon 5\nfile 7\n")
    assert memory.free_cpu_memory() == mib
    (tmp_path / "c" / "cgroup" / "memory.stat").unlink()
    assert memory.free_cpu_memory() == mib

    # the consequence: a 4 MiB row buffer (64 rows of 8192 float64) in a container whose usage is all but 64 KiB of
    # its limit, 6 GiB of that page cache, was refused as not fitting in memory
    _cgroup(tmp_path / "d", monkeypatch, limit=limit, current=limit - 64 * 1024, inactive_file=cache, available=64 * gib)
    with Recorder(tmp_path / "run.h5") as rec:
        rec.log(1, {"cost/normal/mean": np.zeros(8192)})
    assert (tmp_path / "run.h5").exists()


def test_the_limit_of_a_batch_jobs_cgroup_below_the_root_bounds_the_free_memory(tmp_path, monkeypatch):
    """A Slurm job on a cgroup v2 host without a cgroup namespace: /proc/self/cgroup names .../job_7/step_0; the root
    folder has no memory.max (the root cgroup has none), the step's is "max" and the job's holds the limit. Free is
    what the job's limit leaves (it was the host's MemAvailable, 60 GiB here, for a job of 4 GiB: a batch of exact
    products sized to half of it is the kill without a message the cap is there to prevent)."""
    gib = 2**30
    root = tmp_path / "fs"
    job, step = root / "system.slice" / "slurmstepd.scope" / "job_7", root / "system.slice" / "slurmstepd.scope" / "job_7" / "step_0"
    step.mkdir(parents=True)
    (root / "memory.stat").write_text("anon 1\ninactive_file 1\n")  # the root cgroup: statistics, no limit
    (step / "memory.max").write_text("max\n")
    (step / "memory.current").write_text(f"{gib}\n")
    (job / "memory.max").write_text(f"{4 * gib}\n")
    (job / "memory.current").write_text(f"{gib + gib // 2}\n")
    (job / "memory.stat").write_text(f"anon {gib}\ninactive_file {gib // 4}\n")
    (tmp_path / "meminfo").write_text(f"MemAvailable:   {60 * gib // 1024} kB\n")
    (tmp_path / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_7/step_0\n")
    monkeypatch.setattr(memory, "MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(memory, "CGROUP_MEMORY", (str(root / "memory.max"), str(root / "memory.current")))
    monkeypatch.setattr(memory, "PROC_CGROUP", str(tmp_path / "cgroup"), raising=False)
    assert memory.free_cpu_memory() == 4 * gib - (gib + gib // 2 - gib // 4)
    # the step's own limit, where tighter, is the bound
    (step / "memory.max").write_text(f"{gib + gib // 8}\n")
    assert memory.free_cpu_memory() == gib // 8
    # a cgroup outside this namespace's root ("/../x"): no folder here is it; the root's files, where present, count
    (tmp_path / "cgroup").write_text("0::/../other/job_9\n")
    assert memory.free_cpu_memory() == 60 * gib


def _per_edge_alpha_hessian(net, x, y, cell: int, edge: int) -> torch.Tensor:
    """diag ∂²L/∂a² of the mean cross-entropy where edge ``edge`` of cell ``cell`` mixes by softmax(a), a its type's α
    row, every other edge at softmax(α) as a constant: the per-edge number (no cross-cell term), by autograd."""
    alphas = {t: a.detach() for t, a in net.alphas().items()}
    t = net.cells[cell].cell_type

    def loss(a):
        per_cell = [torch.softmax(alphas[c.cell_type], -1) for c in net.cells]
        rows = list(per_cell[cell].unbind(0))
        rows[edge] = torch.softmax(a, -1)
        per_cell[cell] = torch.stack(rows)
        return nn.functional.cross_entropy(net(x, per_cell), y)

    return torch.diagonal(torch.autograd.functional.hessian(loss, alphas[t][edge].clone()))


def test_hessian_wrt_alpha_of_a_block_given_softmax_weights_is_the_per_edge_alpha_curvature():
    net = tiny_network(2).eval()  # eval: the reference's forwards leave the running statistics alone
    x, y = float64_batch(4)
    probe = nasdiag.attach(net, hessian="exact_per_edge")
    with probe.record(targets=y):
        nn.functional.cross_entropy(net(x, net.softmax_weights()), y).backward()
    net.zero_grad(set_to_none=True)
    got = probe.hessian(wrt="alpha")  # was torch's "backward through the graph a second time" traceback
    for name, (c, e) in (("cells.0.edges.0", (0, 0)), ("cells.1.edges.3", (1, 3)), ("cells.0.edges.4", (0, 4))):
        want = _per_edge_alpha_hessian(net, x, y, c, e)
        torch.testing.assert_close(got[name], want, rtol=1e-9, atol=1e-13)
    # the recursions give their numbers too (they were the same traceback), and exact, which reads shared α from the
    # graph, says in one line why it cannot
    assert set(probe.hessian(wrt="alpha", mode="diag")) == set(got)
    with pytest.raises(ProbeError, match=r"wrt='alpha', mode='exact'.*freed.*retain_graph=True") as info:
        probe.hessian(wrt="alpha", mode="exact")
    assert "\n" not in str(info.value)
    assert all(p.grad is None for p in net.parameters())


def test_a_path_split_steps_captured_activations_are_freed_when_its_block_ends_without_the_cyclic_collector():
    """The captures of a block reference each other (an edge call its cell call, the cell call its edge calls); with
    the collector off (as between its runs), a candidate op's output, which the step captured, must be gone once the
    block and the caller's references end: it lived on, a step's activations per block, until a collection."""
    import gc
    import weakref

    from nasdiag.probe.capture import CellCall, EdgeCall

    net = tiny_network(2)
    x, y = float64_batch(4)
    probe = nasdiag.attach(net, path_split=True)
    seen = []
    op = net.cells[1].edges[2].ops[3]  # a candidate op of an edge whose start node has incoming edges (it is split)
    handle = op.register_forward_hook(lambda m, a, out: seen.append(weakref.ref(out)))
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            with probe.record():
                loss = nn.functional.cross_entropy(net(x, net.softmax_weights()), y)
                loss.backward()
            del loss
            assert seen and seen[-1]() is None, "the candidate output captured by the step outlived its block"
            assert not [o for o in gc.get_objects() if isinstance(o, (EdgeCall, CellCall))]
        probe.path_costs()  # the results are kept
    finally:
        handle.remove()
        if enabled:
            gc.enable()


@pytest.mark.parametrize("route", ["probe.hessian", "diag_hessian"])
def test_the_diagonal_recursions_free_their_traced_forward_when_they_return_without_the_cyclic_collector(route):
    """The curvature recursions (modes diag/approx) trace a forward with hooks that are the tracer's own bound methods
    (and the edge recorder's closures); the plans kept on them closed reference cycles holding the traced forward's
    tensors (298 tensors, 559 KiB per probe.hessian() on a 2-cell supernet) until Python's cyclic collector ran."""
    import gc
    import weakref

    from nasdiag.hessian import diag_hessian

    net = tiny_network(2).eval()
    x, y = float64_batch(4)
    probe = nasdiag.attach(net, hessian="diag")
    with probe.record(targets=y):
        nn.functional.cross_entropy(net(x, net.softmax_weights()), y).backward()
    net.zero_grad(set_to_none=True)

    def call():
        if route == "probe.hessian":
            return probe.hessian()
        return diag_hessian(net, nn.functional.cross_entropy, (x, net.softmax_weights()), y, mode="diag")

    call()  # the first call imports parts of torch (torch.func), whose import frames hold it in a cycle once
    seen = []
    op = net.cells[0].edges[1].ops[4]
    handle = op.register_forward_hook(lambda m, a, out: seen.append(weakref.ref(out)))
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        assert call() and seen
        assert all(ref() is None for ref in seen), "a candidate output of the traced forward outlived the call"
    finally:
        handle.remove()
        if enabled:
            gc.enable()
