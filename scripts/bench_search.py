"""Benchmark of a search iteration on the reference supernet: the eager per-op engine and the fast engine
(batched ops + CUDA-graph capture of the whole step) side by side, in one run, on one device.

Rows (each engine on its own copy of the same initial supernet, the same batches):

* ``darts``: one first-order DARTS iteration (α step + w step), cost statistics recorded every α step:
  eager (the reference: one module per op, a loop over edges), eager + CUDA graph, fast (batched ops, no
  graph), fast + CUDA graph (the default on CUDA), the same with torch's native BatchNorm kernels; and
  fast + graph with the cost statistics switched off;
* ``darts2``: the second-order iteration, eager, fast and fast + CUDA graph;
* ``fwdbwd``: forward + backward with per-cell Z leaves (the cost primitive), eager and fast;
* ``hessian``: the α diagonal (``approx``, ``diag``) and the weight diagonal (``approx``, ``diag``),
  against a fast forward+backward;
* ``memory``: peak GPU memory of one DARTS iteration per engine, and the fast step at batch 256;
* ``bf16``: fast + graph under bf16 autocast, and its val-loss difference from float32;
* ``scaling``: fast + graph iteration over batch 32–256 and C 16–36.

``--ddp`` (under ``torchrun --nproc_per_node=N``) times the fast engine data-parallel at per-rank batch
``--batch`` (captured with the gradient all-reduce inside the graph, uncaptured, and under the
``DistributedDataParallel`` wrapper) and prints the throughput relative to one process.

Examples::

    python scripts/bench_search.py --device cuda                       # the issue's setting
    python scripts/bench_search.py --device cpu --C 8 --layers 3 --image 8 --in-channels 1 --sections darts
    torchrun --nproc_per_node=2 scripts/bench_search.py --device cuda --ddp
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import statistics
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from nasdiag.search.base import Schedule
from nasdiag.search.methods.darts import DARTS
from nasdiag.supernet import Network
from nasdiag.errors import run_script
from nasdiag.supernet.engine.graph import StepGraph

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from script_args import Parser, at_least, channels, number, numbers, seed as seed_number  # noqa: E402
from script_args import device as device_name, names as section_names, supernet, threads as thread_count  # noqa: E402
from script_args import write_table  # noqa: E402

ROWS: List[Dict] = []


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, fn: Callable[[int], object], steps: int, warmup: int, rounds: int = 2) -> float:
    """Best over ``rounds`` of the mean seconds per call of ``fn(i)`` over ``steps`` calls, after ``warmup`` calls."""
    for i in range(warmup):
        fn(i)
    sync(device)
    best = float("inf")
    for r in range(rounds):
        t = time.perf_counter()
        for i in range(steps):
            fn(warmup + r * steps + i)
        sync(device)
        best = min(best, (time.perf_counter() - t) / steps)
    return best


def peak(device, fn: Callable[[], object]) -> Optional[float]:
    """Peak GPU memory (GiB) held while ``fn`` runs: reserved by the caching allocator, which includes a
    captured graph's private pool (its tensors are not "allocated" between replays, yet the pool stays)."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    return torch.cuda.max_memory_reserved(device) / 2**30


def record(section, what, engine, seconds, ref=None, mem=None, note=""):
    row = dict(section=section, what=what, engine=engine, ms=None if seconds is None else seconds * 1e3,
               ratio=None if (ref is None or seconds is None) else ref / seconds, peak_gib=mem, note=note)
    ROWS.append(row)
    ms = "—" if seconds is None else f"{seconds * 1e3:9.1f}"
    ratio = "" if row["ratio"] is None else f"{row['ratio']:6.2f}×"
    memtxt = "" if mem is None else f"{mem:6.2f} GiB"
    print(f"{section:8s} {what:44s} {engine:22s} {ms} ms {ratio:>8s} {memtxt:>11s} {note}", flush=True)


def make_net(args, device, dtype, C=None):
    torch.manual_seed(args.seed)
    net = supernet(lambda: Network(C or args.C, 10, args.layers, in_channels=args.in_channels), device,
                   dtype).to(device, dtype)
    return net


def batches(args, device, dtype, B, n=4, image=None):
    g = torch.Generator().manual_seed(args.seed + 1)
    image = image or args.image
    out = []
    for _ in range(n):
        mk = lambda: (torch.randn(B, args.in_channels, image, image, generator=g).to(device, dtype),
                      torch.randint(0, 10, (B,), generator=g).to(device))
        out.append((mk(), mk()))
    return out


def darts_method(net, engine, cls=DARTS, epochs=10):
    net.set_engine(engine)
    return cls(net, schedule=Schedule(epochs=epochs, steps_per_epoch=100))


def step_fn(method, data, graph: bool):
    """A callable i -> one search step on batch i; graph=True forces a StepGraph (eager engine too)."""
    raw = type(method).step.__get__(method)
    step = StepGraph(raw, method._graph_state_key, prepare=method._graph_prepare) if graph else raw
    return lambda i: step(*data[i % len(data)])


def unit_affine(fn, on: bool):
    """``fn`` with the fast engine's affine-free BatchNorms given a unit scale (cuDNN's kernels, the default
    on CUDA) or not (torch's native kernels)."""
    from nasdiag.supernet.engine import fast

    def run(i):
        before = fast.UNIT_AFFINE_ON_CUDA
        fast.UNIT_AFFINE_ON_CUDA = on
        try:
            return fn(i)
        finally:
            fast.UNIT_AFFINE_ON_CUDA = before

    return run


# -- sections ---------------------------------------------------------------------------------------------
def section_darts(args, device, dtype, base):
    data = batches(args, device, dtype, args.batch)
    variants = [("eager", "eager", False, True), ("eager + CUDA graph", "eager", True, True),
                ("fast (batched ops)", "fast", False, True), ("fast + CUDA graph", "fast", True, True),
                ("fast + graph, native BatchNorm", "fast", True, False)]
    if device.type != "cuda":
        variants = [v for v in variants if not v[2]]
    ref = None
    times = {}
    for label, engine, graph, unit in variants:
        net = copy.deepcopy(base)
        m = darts_method(net, engine)
        fn = unit_affine(step_fn(m, data, graph), unit)
        steps = args.eager_steps if engine == "eager" and not graph else args.steps
        t = timed(device, fn, steps, args.warmup)
        mem = peak(device, lambda: fn(0))
        ref = ref or t
        times[label] = t
        record("darts", "1st-order iteration (α step + w step), costs on", label, t, ref, mem)
        del m, net, fn
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        try:
            net = copy.deepcopy(base)
            m = darts_method(net, "fast")
            fn = step_fn(m, data, True)
            t = timed(device, fn, args.steps, args.warmup)
            record("darts", "same, cudnn.benchmark on", "fast + CUDA graph", t, ref)
        finally:
            torch.backends.cudnn.benchmark = False
        net = copy.deepcopy(base)
        m = darts_method(net, "fast")
        m._observe_costs = lambda *a, **k: None  # cost statistics off
        fn = step_fn(m, data, True)
        t = timed(device, fn, args.steps, args.warmup)
        on = times["fast + CUDA graph"]
        record("darts", "same, cost statistics off", "fast + CUDA graph", t, ref,
               note=f"costs-on / costs-off = {on / t:.3f}× (target ≤ 1.10×)")
    return times


def section_darts2(args, device, dtype, base):
    try:
        from nasdiag.search.methods.darts2 import DARTS2
    except Exception as exc:  # not there yet
        print(f"darts2   not available ({type(exc).__name__}: {exc})")
        return
    data = batches(args, device, dtype, args.batch)
    ref = None
    variants = [("eager", "eager", False, True), ("fast (batched ops)", "fast", False, True),
                ("fast + CUDA graph", "fast", True, True), ("fast + graph, native BatchNorm", "fast", True, False)]
    for label, engine, graph, unit in variants if device.type == "cuda" else variants[:2]:
        net = copy.deepcopy(base)
        m = darts_method(net, engine, DARTS2)
        fn = unit_affine(step_fn(m, data, graph), unit)
        if graph:
            t = timed(device, fn, args.steps // 2, args.warmup)
            mem = peak(device, lambda: fn(0))
        else:
            t, mem = timed(device, fn, max(2, args.eager_steps // 2), 1), None
        ref = ref or t
        record("darts2", "2nd-order iteration (unrolled α step + w step)", label, t, ref, mem)
        del m, net, fn


def _fwd_bwd(net, x, y):
    leaves = [net.softmax_weights()[c.cell_type].detach().clone().requires_grad_(True) for c in net.cells]
    loss = F.cross_entropy(net(x, leaves), y)
    torch.autograd.grad(loss, leaves + net.weight_parameters())


def section_fwdbwd(args, device, dtype, base):
    (x, y), _ = batches(args, device, dtype, args.batch, n=1)[0]
    ref = None
    out = {}
    for engine in ("eager", "fast"):
        net = copy.deepcopy(base).set_engine(engine)
        t = timed(device, lambda i: _fwd_bwd(net, x, y), args.steps if engine == "fast" else args.eager_steps, 2)
        mem = peak(device, lambda: _fwd_bwd(net, x, y))
        ref = ref or t
        out[engine] = t
        record("fwdbwd", "forward + backward, Z leaves (costs)", engine, t, ref, mem)
    if device.type == "cuda":  # the same, captured: what the device needs once the host's launches are gone
        net = copy.deepcopy(base).set_engine("fast")

        def fb(a, b):
            _fwd_bwd(net, a, b)
            return torch.zeros((), device=a.device)

        g = StepGraph(fb, lambda: 0, name="fwd+bwd")
        t = timed(device, lambda i: g(x, y), args.steps, 3)
        out["fast + graph"] = t
        record("fwdbwd", "forward + backward, Z leaves (costs)", "fast + CUDA graph", t, ref)
    return out


def section_hessian(args, device, dtype, base, fwdbwd):
    """The curvature diagonals as a search records them: ``method.curvature`` (α: the recursion on the fast
    engine's batched ops, replayed as a CUDA graph on CUDA for diag/approx; plain calls of it and of the recursion
    on the eager modules for comparison) and :class:`~nasdiag.hessian.graphed.GraphedDiagHessian` (weights); on CUDA also the
    plain, uncaptured calls. Ratios against the fast forward+backward, uncaptured and captured."""
    from nasdiag.hessian import diag_hessian
    from nasdiag.hessian.graphed import GraphedDiagHessian

    (x, y), _ = batches(args, device, dtype, args.batch, n=1)[0]
    fb, fbg = fwdbwd.get("fast"), fwdbwd.get("fast + graph")

    def note(t):
        parts = [] if fb is None else [f"{t / fb:.2f}× fast fwd+bwd"]
        parts += [] if fbg is None else [f"{t / fbg:.2f}× captured fast fwd+bwd"]
        return " = " + ", ".join(parts) if parts else ""

    times = {}
    for mode in ("approx", "diag"):
        net = copy.deepcopy(base).set_engine("fast")
        m = DARTS(net, schedule=Schedule(epochs=1, steps_per_epoch=1), hessian_mode=mode)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if device.type == "cuda":
                eager = DARTS(copy.deepcopy(base).set_engine("eager"), schedule=Schedule(epochs=1, steps_per_epoch=1),
                              hessian_mode=mode)
                t = timed(device, lambda i: eager._mixing_curvature(x, y, eager.eval_weights()), 2, 1, rounds=1)
                record("hessian", f"α diagonal {mode}", "plain (hooks, eager modules)", t, note=note(t))
                del eager
                t = timed(device, lambda i: m._mixing_curvature(x, y, m.eval_weights()), 3, 1, rounds=1)
                record("hessian", f"α diagonal {mode}", "plain (batched ops)", t, note=note(t))
            t = timed(device, lambda i: m.curvature(x, y), 5, 2, rounds=2)
        counts = getattr(m._curvature_graph, "counts", {})
        times[("α", mode)] = t
        record("hessian", f"α diagonal {mode} (method.curvature)", "CUDA graph" if counts.get("replay") else "plain", t,
               note=note(t))
        m.release_graphs()
    for mode in ("approx", "diag"):
        net = copy.deepcopy(base).set_engine("fast")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if device.type == "cuda":
                t = timed(device, lambda i: diag_hessian(net, F.cross_entropy, x, y, mode=mode), 2, 1, rounds=1)
                record("hessian", f"weight diagonal {mode}", "plain (hooks, eager modules)", t, note=note(t))
            h = GraphedDiagHessian(net, F.cross_entropy, mode=mode)
            t = timed(device, lambda i: h(x, y), 5, 2, rounds=2)
        times[("w", mode)] = t
        record("hessian", f"weight diagonal {mode} (GraphedDiagHessian)", "CUDA graph" if h.graph.counts["replay"] else "plain",
               t, note=note(t))
        h.release()
    record("hessian", "weight approx ÷ diag", "", None,
           note=f"{times[('w', 'approx')] / times[('w', 'diag')]:.2f} (target < 1)")


def section_memory(args, device, dtype, base):
    if device.type != "cuda":
        return
    B = args.big_batch
    data = batches(args, device, dtype, B, n=2)
    net = copy.deepcopy(base)
    m = darts_method(net, "fast")
    fn = step_fn(m, data, True)
    try:
        t = timed(device, fn, 5, 3, rounds=1)
        mem = peak(device, lambda: fn(0))
        record("memory", f"fast + graph iteration at batch {B}", "fast + CUDA graph", t, mem=mem,
               note=f"target: fits in 40 GiB ({'yes' if mem <= 40 else 'NO'})")
    except torch.cuda.OutOfMemoryError:
        record("memory", f"fast + graph iteration at batch {B}", "fast + CUDA graph", None, note="OOM")
    del m, fn, net
    # a search with --diagnostics hessian: the step's graph replayed, the α curvature's captured and replayed
    # beside it (one shared memory pool)
    for B in (args.batch, args.big_batch):
        data = batches(args, device, dtype, B, n=2)
        m = DARTS(copy.deepcopy(base).set_engine("fast"), schedule=Schedule(epochs=10, steps_per_epoch=100),
                  hessian_mode="approx")

        def step_and_curvature(i, m=m, data=data):
            train, val = data[i % len(data)]
            m.step(train, val)
            m.curvature(*val)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                t = timed(device, step_and_curvature, 3, 3, rounds=1)
                mem = peak(device, lambda: step_and_curvature(0))
                record("memory", f"iteration + α approx curvature, batch {B}", "fast + CUDA graphs", t, mem=mem)
            except torch.cuda.OutOfMemoryError:
                record("memory", f"iteration + α approx curvature, batch {B}", "fast + CUDA graphs", None, note="OOM")
        m.release_graphs()
        del m, data


def section_bf16(args, device, dtype, base):
    if device.type != "cuda":
        return
    data = batches(args, device, dtype, args.batch)
    out = {}
    for label, autocast in (("float32", False), ("bf16 autocast", True)):
        net = copy.deepcopy(base)
        m = darts_method(net, "fast")
        inner = type(m).step.__get__(m)

        def stepper(train, val, inner=inner, autocast=autocast):
            ctx = torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False) if autocast else contextlib.nullcontext()
            with ctx:
                return inner(train, val)

        g = StepGraph(stepper, m._graph_state_key, prepare=m._graph_prepare)
        t = timed(device, lambda i: g(*data[i % len(data)]), args.steps, args.warmup)
        losses = [float(g(*data[i % len(data)])["scalars/val_loss"]) for i in range(4)]
        out[label] = (t, losses)
    t32, l32 = out["float32"]
    t16, l16 = out["bf16 autocast"]
    record("bf16", "fast + graph iteration", "float32", t32, t32)
    record("bf16", "fast + graph iteration", "bf16 autocast", t16, t32,
           note=f"val loss after {args.warmup + 2 * args.steps + 4} steps: {l16[-1]:.4f} vs float32 {l32[-1]:.4f}")


def section_scaling(args, device, dtype):
    if device.type != "cuda":
        return
    configs = [(b, 16) for b in (32, 64, 128, 256)] + [(64, c) for c in (24, 36)] + [(256, 36)]
    for B, C in configs:
        try:
            base = make_net(args, device, dtype, C=C)
            data = batches(args, device, dtype, B, n=2)
            m = darts_method(base, "fast")
            fn = step_fn(m, data, True)
            t = timed(device, fn, max(3, args.steps // 2), args.warmup, rounds=1)
            mem = peak(device, lambda: fn(0))
            record("scaling", f"batch {B}, C {C}", "fast + CUDA graph", t, mem=mem,
                   note=f"{B / t:.0f} samples/s")
            del m, base, data, fn
        except torch.cuda.OutOfMemoryError:
            record("scaling", f"batch {B}, C {C}", "fast + CUDA graph", None, note="OOM")
        gc.collect()
        torch.cuda.empty_cache()


def section_profile(args, device, dtype, base):
    """Where the fast step's device time goes: the top kernels of one uncaptured fast step."""
    if device.type != "cuda":
        return
    from torch.profiler import ProfilerActivity, profile

    data = batches(args, device, dtype, args.batch)
    m = darts_method(copy.deepcopy(base), "fast")
    fn = step_fn(m, data, False)
    for i in range(2):
        fn(i)
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(2)
        sync(device)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70), flush=True)


def run_ddp(args):
    import torch.distributed as dist

    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.float32
    results = {}
    import nasdiag.search.base as search_base

    all_reduce = search_base.mean_over_ranks
    # (label, processes, path): "graph" is the default path (fast engine, step captured, the weight gradients
    # averaged inside the graph), "plain" the same uncaptured, "ddp" the DistributedDataParallel wrapper with
    # find_unused_parameters=True that every method used before (no graph under it)
    variants = [("1 process, fast + graph", False, "graph"), ("1 process, fast, no graph", False, "plain"),
                (f"{world} processes, fast + graph", True, "graph"), (f"{world} processes, fast, no graph", True, "plain"),
                (f"{world} processes, DDP wrapper", True, "ddp")]
    for label, distributed, path in variants:
        base = make_net(args, device, dtype)
        data = batches(args, device, dtype, args.batch)
        m = darts_method(base, "fast")
        if distributed:
            m.distribute(device_ids=[device.index] if device.type == "cuda" else None)
            if path == "ddp":
                m._gradient_group = None
                m.model = torch.nn.parallel.DistributedDataParallel(
                    m.network, device_ids=[device.index] if device.type == "cuda" else None, find_unused_parameters=True)
        fn = step_fn(m, data, False) if path != "graph" else (lambda i, m=m: m.step(*data[i % len(data)]))
        if distributed or rank == 0:
            # the one-process baseline must not all-reduce its costs with a rank that is not stepping
            search_base.mean_over_ranks = all_reduce if distributed else (lambda tensors: tensors)
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    t = timed(device, fn, args.steps, args.warmup)
            finally:
                search_base.mean_over_ranks = all_reduce
            counts = getattr(m.step, "counts", {}) if path == "graph" else {}
            results[label] = (t, counts, [str(w.message) for w in caught][:2])
            print(f"rank {rank}: {label} {t * 1e3:.1f} ms {counts} {results[label][2]}", flush=True)
        dist.barrier()
        m.release_graphs()  # a live graph with captured collectives would hang destroy_process_group
        del m, base, fn
    if rank == 0:
        for path, key in (("graph", "1 process, fast + graph"), ("plain", "1 process, fast, no graph")):
            one = results[key]
            record("ddp", f"fast iteration, per-rank batch {args.batch}", f"1 process ({path})", one[0], one[0],
                   note=str(one[1]))
        t1 = results["1 process, fast + graph"][0]
        for label, (tn, counts, _) in results.items():
            if not label.startswith("1 process"):
                record("ddp", f"fast iteration, per-rank batch {args.batch}", label, tn,
                       note=f"throughput {world * t1 / tn:.2f}× one process with graph (target ≥ 1.8× on 2) {counts}")
    dist.destroy_process_group()


def main(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--C", type=channels, default=16)
    p.add_argument("--layers", type=at_least(1), default=8)
    p.add_argument("--batch", type=at_least(1), default=64)
    p.add_argument("--big-batch", type=at_least(1), default=256)
    p.add_argument("--image", type=at_least(1), default=32)
    p.add_argument("--in-channels", type=at_least(1), default=3)
    p.add_argument("--steps", type=at_least(1), default=20, help="timed fast steps per round")
    p.add_argument("--eager-steps", type=at_least(1), default=6, help="timed eager steps per round")
    p.add_argument("--warmup", type=at_least(0), default=3)
    p.add_argument("--threads", type=thread_count(), default=None)
    p.add_argument("--seed", type=seed_number(), default=0)
    p.add_argument("--sections", type=section_names(('darts', 'fwdbwd', 'hessian', 'memory', 'darts2', 'bf16', 'scaling', 'profile'), "section"), default="darts,fwdbwd,hessian,memory,darts2,bf16,scaling,profile")
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# device {card}; torch {torch.__version__}; C={args.C} layers={args.layers} batch={args.batch} "
          f"image={args.in_channels}x{args.image}x{args.image}; float32; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
          flush=True)
    if args.ddp:
        run_ddp(args)
    else:
        dtype = torch.float32
        base = make_net(args, device, dtype)
        sections = [s.strip() for s in args.sections.split(",") if s.strip()]
        fb = {}
        for name in sections:
            try:
                if name == "darts":
                    section_darts(args, device, dtype, base)
                elif name == "darts2":
                    section_darts2(args, device, dtype, base)
                elif name == "fwdbwd":
                    fb = section_fwdbwd(args, device, dtype, base)
                elif name == "hessian":
                    section_hessian(args, device, dtype, base, fb)
                elif name == "memory":
                    section_memory(args, device, dtype, base)
                elif name == "bf16":
                    section_bf16(args, device, dtype, base)
                elif name == "profile":
                    section_profile(args, device, dtype, base)
                elif name == "scaling":
                    section_scaling(args, device, dtype)
                else:
                    print(f"unknown section {name}")
            except Exception as exc:  # one failing section must not lose the others' numbers
                import traceback

                traceback.print_exc()
                print(f"{name:8s} FAILED: {type(exc).__name__}: {exc}", flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.json and (not args.ddp or int(os.environ.get("RANK", "0")) == 0):
        # renamed over the old one: open("w") emptied it first, and Ctrl-C mid-write left a truncated file
        write_table(args.json, json.dumps({"card": card, "torch": torch.__version__, "args": vars(args), "rows": ROWS},
                                          indent=1), "--json")


if __name__ == "__main__":
    sys.exit(run_script("bench_search", main))
