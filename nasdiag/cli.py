"""``nasdiag`` command line: ``search`` runs a search and writes a record and figures; ``plot`` redraws figures.

Argument parsing, progress and wiring only; the mathematics lives in the library.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Dict, List, Optional

EXIT_USAGE = 2


class CLIError(Exception):
    """A user error, printed as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise CLIError(f"{self.prog}: {message} (see {self.prog} --help)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nasdiag", description="Diagnostics for differentiable NAS supernets.")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    s = sub.add_parser(
        "search",
        help="run a search, write an HDF5 record and figures",
        description="Run a search and write an HDF5 record and figures. Data-parallel over several processes "
        "(one per GPU, or gloo on CPUs) when launched with torchrun: torchrun --nproc_per_node=N -m nasdiag search ...; "
        "--batch-size is then per process.",
    )
    s.add_argument("--method", default="darts", help="search method (default: darts)")
    s.add_argument("--dataset", default="digits", help="digits (embedded, default), cifar10 or synthetic")
    s.add_argument("--data-dir", default=None, help="folder of the CIFAR-10 python batches (for --dataset cifar10)")
    s.add_argument("--epochs", type=int, default=8)
    s.add_argument("--batch-size", type=int, default=64)
    s.add_argument("--out", default="runs/search.h5", help="record path (HDF5)")
    s.add_argument("--figs", default=None, help="figure folder (default: <out without suffix>-figs)")
    s.add_argument("--no-figs", action="store_true", help="do not draw figures at the end")
    mode = s.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue the run recorded at --out")
    mode.add_argument("--force", action="store_true", help="replace an existing record at --out")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--C", type=int, default=8, help="channels of the first cell")
    s.add_argument("--layers", type=int, default=3, help="number of cells")
    s.add_argument("--steps", type=int, default=4, help="intermediate nodes per cell")
    s.add_argument("--multiplier", type=int, default=None, help="nodes concatenated into a cell output (default: steps)")
    s.add_argument("--order", default="relu-conv-bn", help="op stacking order: relu-conv-bn, conv-bn-relu, conv-relu-bn")
    s.add_argument("--norm", default="batch", help="batch, layer or instance")
    s.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    s.add_argument("--dtype", default="float32", choices=None, help="float32 or float64")
    s.add_argument("--diagnostics", default="cost,hessian",
                   help="comma-separated probe diagnostics recorded each epoch: cost, hessian, or none (default: cost,hessian)")
    s.add_argument("--hessian-mode", default="approx", help="mixing-weight Hessian diagonal: approx (default), diag or exact")
    s.add_argument("--no-progress", action="store_true")

    p = sub.add_parser("plot", help="draw figures from a record")
    p.add_argument("record")
    p.add_argument("--out", required=True, help="figure folder")
    p.add_argument("--format", default="png", help="png (default), pdf or svg")
    return parser


# -- search ---------------------------------------------------------------------------------------
def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise CLIError(f"unknown device {name!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    return device


def _init_distributed(device_name: str):
    """Join the process group a launcher (torchrun) describes in the environment, if any.

    Returns (rank, world size, device). One process per GPU with NCCL when CUDA is used, gloo on CPUs.
    """
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, _device(device_name)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and device_name in ("auto", "cuda")
    if device_name not in ("auto", "cuda", "cpu"):
        raise CLIError(f"under torchrun, --device must be auto, cuda or cpu (each rank takes its own GPU), not {device_name!r}")
    if device_name == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda requested but CUDA is not available; use --device cpu")
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def _dtype(name: str):
    import torch

    table = {"float32": torch.float32, "float64": torch.float64}
    if name not in table:
        raise CLIError(f"unknown dtype {name!r}; choose float32 or float64")
    return table[name]


def _checkpoint_path(out: Path) -> Path:
    return out.with_name(out.name + ".ckpt")


class _Progress:
    """tqdm over search steps, showing the latest losses and the epoch's search-val accuracy."""

    def __init__(self, total: int, initial: int, enabled: bool):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True)
        self.postfix: Dict[str, str] = {}

    def on_step_end(self, step, stats):
        for key in ("train_loss", "val_loss"):
            if f"scalars/{key}" in stats:
                self.postfix[key] = f"{float(stats[f'scalars/{key}']):.3f}"
        self.bar.set_postfix(self.postfix, refresh=False)
        self.bar.update(1)

    def on_epoch_end(self, epoch, stats):
        self.postfix["search_val_acc"] = f"{float(stats['scalars/search_val_acc']):.3f}"
        self.bar.set_postfix(self.postfix)

    def on_exception(self, exc):
        self.bar.close()

    def close(self):
        self.bar.close()


class _Checkpointer:
    """Saves the method's state after every epoch (atomically) so ``--resume`` can continue."""

    def __init__(self, path: Path, method, config: Dict):
        self.path, self.method, self.config = path, method, config

    def on_step_end(self, step, stats):
        pass

    def on_epoch_end(self, epoch, stats):
        import torch

        tmp = self.path.with_name(self.path.name + ".tmp")
        torch.save({"epoch": epoch, "config": self.config, "state": self.method.state_dict()}, tmp)
        os.replace(tmp, self.path)

    def on_exception(self, exc):
        pass


def _resume_state(ckpt: Path, config: Dict) -> Optional[Dict]:
    import torch

    if not ckpt.exists():
        return None
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    keys = ("method", "dataset", "C", "layers", "steps", "multiplier", "order", "norm", "seed", "batch_size", "dtype",
            "world_size")
    recorded = {"world_size": 1, **state["config"]}  # runs recorded before DDP support ran on one process
    changed = [k for k in keys if recorded.get(k) != config.get(k)]
    if changed:
        raise CLIError(
            "cannot resume with different settings: "
            + ", ".join(f"{k}={config.get(k)!r} (recorded {recorded.get(k)!r})" for k in changed)
        )
    return state


DIAGNOSTICS = ("cost", "hessian")
HESSIAN_MODES = ("approx", "diag", "exact")


def _probe(net, diagnostics: str, hessian_mode: str):
    """A probe for the requested diagnostics, or None for ``none``."""
    import nasdiag

    wanted = [d.strip() for d in diagnostics.split(",") if d.strip()]
    if wanted == ["none"]:
        return None
    unknown = [d for d in wanted if d not in DIAGNOSTICS]
    if unknown or not wanted:
        raise CLIError(f"unknown diagnostics {unknown or diagnostics!r}; choose from {', '.join(DIAGNOSTICS)} or none")
    if "hessian" in wanted and hessian_mode not in HESSIAN_MODES:
        raise CLIError(f"unknown --hessian-mode {hessian_mode!r}; choose one of {', '.join(HESSIAN_MODES)}")
    # costs are what the probe always measures; the Hessian is an extra pass once per epoch
    return nasdiag.attach(net, hessian=hessian_mode if "hessian" in wanted else None)


def run_search_command(args) -> int:
    from nasdiag.search import METHODS

    if args.method not in METHODS:
        raise CLIError(f"unknown method {args.method!r}; available: {', '.join(METHODS)}")
    if args.epochs < 1 or args.batch_size < 1:
        raise CLIError("--epochs and --batch-size must be >= 1")
    dtype = _dtype(args.dtype)
    rank, world, device = _init_distributed(args.device)
    try:
        return _search(args, rank, world, device, dtype)
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def _search(args, rank: int, world: int, device, dtype) -> int:
    import torch

    from nasdiag.data import load_dataset
    from nasdiag.record import RecorderCallback, RecordWarning
    from nasdiag.search import METHODS, run_search, steps_per_epoch
    from nasdiag.supernet import Network

    multiplier = args.multiplier or args.steps
    out = Path(args.out)
    ckpt = _checkpoint_path(out)
    if out.exists() and not (args.resume or args.force):
        raise CLIError(f"a record already exists at {out}; pass --resume to continue it or --force to replace it")
    if world > 1:  # every rank has checked before rank 0 creates the record
        import torch.distributed as dist

        dist.barrier()
    config = {
        "method": args.method, "dataset": args.dataset, "epochs": args.epochs, "batch_size": args.batch_size,
        "C": args.C, "layers": args.layers, "steps": args.steps, "multiplier": multiplier, "order": args.order,
        "norm": args.norm, "seed": args.seed, "dtype": args.dtype, "device": str(device),
        "diagnostics": args.diagnostics, "hessian_mode": args.hessian_mode, "world_size": world,
    }

    kwargs = {"seed": args.seed, "dtype": dtype}
    if args.dataset == "cifar10":
        if not args.data_dir:
            raise CLIError("--dataset cifar10 needs --data-dir pointing at the folder of the CIFAR-10 python batches")
        kwargs["root"] = args.data_dir
    elif args.data_dir:
        raise CLIError(f"--data-dir is only used with --dataset cifar10, not {args.dataset!r}")
    splits = load_dataset(args.dataset, **kwargs)

    torch.manual_seed(args.seed)
    try:
        net = Network(
            args.C, splits.num_classes, args.layers, steps=args.steps, multiplier=multiplier,
            in_channels=splits.in_channels, order=args.order, norm=args.norm,
        ).to(device=device, dtype=dtype)
    except (ValueError, KeyError) as exc:
        raise CLIError(f"invalid supernet settings: {exc.args[0] if exc.args else exc}") from None
    method = METHODS[args.method](net, epochs=args.epochs, probe=_probe(net, args.diagnostics, args.hessian_mode))
    if world > 1:
        method.distribute(device_ids=[device.index] if device.type == "cuda" else None)

    start_epoch = 0
    if args.resume:
        state = _resume_state(ckpt, config)
        if state is None and not out.exists():
            raise CLIError(f"nothing to resume at {out}: no record and no checkpoint {ckpt}")
        if state is not None:
            method.load_state_dict(state["state"])
            start_epoch = state["epoch"] + 1
        if start_epoch >= args.epochs:
            raise CLIError(f"the run at {out} already finished {start_epoch} epochs; raise --epochs to continue it")
    elif args.force and rank == 0:
        ckpt.unlink(missing_ok=True)

    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "method": args.method,
        "config": config,
        "seed": args.seed,
        "op_names": list(net.primitives),
        "edge_names": {t: net.edge_labels() for t in net.cell_types},
        "cell_types": list(net.cell_types),
    }
    S = steps_per_epoch(splits, args.batch_size)
    with warnings.catch_warnings():
        # _resume_state already refused every change that matters; a longer --epochs is the point of resuming
        warnings.filterwarnings("ignore", message=".*different config than stored", category=RecordWarning)
        # every rank reduces its statistics through the callback; only rank 0 opens the record
        record_cb = RecorderCallback(out, meta=meta, resume=args.resume, overwrite=args.force)
    progress = _Progress(args.epochs * S, start_epoch * S, enabled=rank == 0 and not args.no_progress)
    callbacks = [record_cb, progress] + ([_Checkpointer(ckpt, method, config)] if rank == 0 else [])
    with record_cb:
        try:
            evaluation = run_search(
                method, splits, args.epochs, batch_size=args.batch_size, seed=args.seed, start_epoch=start_epoch,
                callbacks=callbacks,
            )
        finally:
            progress.close()
    if rank != 0:
        return 0
    genotype = method.genotype()
    print(f"search-val accuracy of the supernet: {evaluation.get('acc', float('nan')):.4f}")
    print(f"genotype: {genotype}")
    print(f"record: {out}")
    if not args.no_figs:
        from nasdiag.plot import write_figures

        figs = Path(args.figs) if args.figs else out.with_name(out.stem + "-figs")
        written = write_figures(out, figs)
        print(f"figures: {figs} ({len(written)} files)")
    return 0


def run_plot_command(args) -> int:
    from nasdiag.plot import write_figures

    if not Path(args.record).exists():
        raise CLIError(f"no record at {args.record}")
    written = write_figures(args.record, args.out, fmt=args.format)
    for path in written:
        print(path)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    from nasdiag.data import DataError
    from nasdiag.plot import PlotError
    from nasdiag.record import RecordError

    try:
        args = _parser().parse_args(argv)
        if args.command == "search":
            return run_search_command(args)
        if args.command == "plot":
            return run_plot_command(args)
        raise CLIError("nasdiag: choose a command: search or plot (see nasdiag --help)")
    except (CLIError, DataError, PlotError, RecordError) as exc:
        print(f"nasdiag: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("nasdiag: interrupted; the record holds every completed step (continue with --resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
