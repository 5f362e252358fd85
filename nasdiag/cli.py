"""``nasdiag`` command line: maps arguments onto `nasdiag.search.SearchConfig` and calls `nasdiag.search.run`.

``search`` runs a search (record, checkpoint, figures), ``methods`` lists the registered methods and
their hyperparameters; ``plot`` and ``report`` are `nasdiag.plot.commands`. Nothing heavy (torch, h5py, matplotlib) is imported
before the arguments are parsed, so ``nasdiag --help`` is instant. Every `NasdiagError` is printed as
one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
from pathlib import Path
from typing import List, Optional

from nasdiag.errors import ConfigError, NasdiagError, paths_on_stderr, paths_on_stdout, quiet_stdout, raised_warning

try:  # loaded now: under a memory limit, loading it when torch failed to load failed too
    import resource
except ImportError:  # pragma: no cover - not POSIX
    resource = None
from nasdiag.search.config import (DATASETS, DIAGNOSTICS, DTYPES, ENGINES, MAX_SEED, NORMS, ORDERS, SearchConfig,
                                   no_hessian_recorded)

EXIT_USAGE = 2
EXIT_SIGINT, EXIT_SIGTERM, EXIT_SIGPIPE, EXIT_SIGHUP = 130, 143, 141, 129
_KEY = re.compile(r"[A-Za-z_][\w-]*")  # what a hyperparameter's name looks like (w_lr; w-lr, misspelt, is said as such)


def _seed(text: str) -> int:
    """``--seed``: an integer the generators take (a larger one was a traceback from torch or h5py)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a whole number, not {text!r}") from None
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"{value} is too large: give a seed from 0 to at most {MAX_SEED}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")

    def _print_message(self, message, file=None):  # --help, --version: argparse dropped a failed write (> /dev/full)
        target = file or sys.stderr  # and exited 0, nothing said; it is one line and exit code 2
        if not message or target is None:
            return
        try:
            target.write(message)
            target.flush()
        except BrokenPipeError:  # | head: handled as such
            raise
        except OSError as exc:
            quiet_stdout()
            raise OSError(exc.errno, exc.strerror, "standard output" if target is sys.stdout else "standard error") from None

    def _check_value(self, action, value):  # an invalid choice names the near miss (--dataset Digits)
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as exc:
            from nasdiag.search.config import near_miss

            meant = near_miss(value, action.choices or ())
            if meant is None:
                raise
            raise argparse.ArgumentError(action, f"{exc.message}; did you mean {meant!r}?") from None


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that the search ends through its normal exception path."""


class HungUp(Terminated):
    """SIGHUP (the terminal closed, an ssh session dropped): ended as SIGTERM is, with its own exit code."""


def _parser() -> argparse.ArgumentParser:
    import nasdiag

    parser = _Parser(prog="nasdiag", description="Diagnostics for differentiable NAS supernets.")
    parser.add_argument("--version", action="version", version=f"nasdiag {nasdiag.__version__}")  # was "unrecognized"
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    parser.commands = sub.choices  # name -> its parser, which reports the command's unknown arguments
    d = SearchConfig()
    s = sub.add_parser(
        "search", help="run a search, write an HDF5 record, a checkpoint and figures",
        description="Run a search and write an HDF5 record, its checkpoint (<out>.ckpt) and figures. Data-parallel "
        "when launched with torchrun (torchrun --nproc_per_node=N -m nasdiag search ...; --batch-size is per process). "
        f"Exit code 0: done; {EXIT_USAGE}: a mistake, said in one line; {EXIT_SIGINT} (Ctrl-C), {EXIT_SIGTERM} "
        f"(SIGTERM) or {EXIT_SIGHUP} (SIGHUP, a hang-up): stopped, the line gives the command that resumes the run.")
    s.add_argument("--method", default=d.method, help="a registered method (nasdiag methods lists them; default: darts)")
    s.add_argument("--hp", action="append", default=[], metavar="KEY=VALUE",
                   help="method hyperparameter override, repeatable (nasdiag methods lists the keys)")
    s.add_argument("--dataset", default=d.dataset, choices=DATASETS,
                   help="digits (embedded), cifar10 (needs --data-dir), synthetic (default: digits)")
    s.add_argument("--data-dir", default=None, help="folder of the CIFAR-10 python batches (for --dataset cifar10)")
    s.add_argument("--epochs", type=int, default=d.epochs,
                   help=f"passes over the search-train split; with --resume, a larger value extends the run "
                        f"(default: {d.epochs})")
    s.add_argument("--batch-size", type=int, default=d.batch_size, help=f"per process (default: {d.batch_size})")
    s.add_argument("--seed", type=_seed, default=d.seed,
                   help=f"random seed of the initialization, sampling and batch order, 0 to {MAX_SEED} (default: {d.seed})")
    s.add_argument("--out", default="runs/search.h5",
                   help="record path (HDF5); the checkpoint is <out>.ckpt (default: runs/search.h5)")
    s.add_argument("--figs", default=None, help="figure folder (default: <out without suffix>-figs; a file of a "
                   "figure's name that nasdiag did not draw is never replaced)")
    s.add_argument("--no-figs", action="store_true", help="draw no figures at the end")
    mode = s.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true",
                      help="continue the run recorded at --out; the settings that define it (method, --hp, data, "
                      "supernet, seed, batch size, dtype) and what it records (--diagnostics, --hessian-mode, "
                      "--spectrum-every) must match, a mismatch is named; --device, --engine, --threads, the figures and "
                      "the progress bar may change; a larger --epochs extends the run")
    mode.add_argument("--force", action="store_true", help="replace the record at --out and the leftover files of its run (refused while it is "
                      "written, and for a file that is not a nasdiag record)")
    s.add_argument("--C", type=int, default=d.C, help=f"channels of the first cell, even (default: {d.C})")
    s.add_argument("--layers", type=int, default=d.layers, help=f"number of cells, >= 3 (default: {d.layers})")
    s.add_argument("--steps", type=int, default=d.steps, help=f"intermediate nodes per cell (default: {d.steps})")
    s.add_argument("--multiplier", type=int, default=None, help="nodes concatenated into a cell output (default: steps)")
    s.add_argument("--order", default=d.order, choices=ORDERS, help=f"op stacking order (default: {d.order})")
    s.add_argument("--norm", default=d.norm, choices=NORMS, help=f"normalization in the ops (default: {d.norm})")
    s.add_argument("--device", default=d.device, help="auto (a GPU if there is one), cpu, cuda or cuda:N (default: auto)")
    s.add_argument("--dtype", default=d.dtype, choices=DTYPES, help=f"parameter and data type (default: {d.dtype})")
    s.add_argument("--diagnostics", default=",".join(DIAGNOSTICS),
                   help=f"comma-separated, recorded each epoch: {', '.join(DIAGNOSTICS)}, or none (default: cost,hessian)")
    s.add_argument("--hessian-mode", default=None,
                   help="mixing-weight curvature mode, recorded each epoch: diag (default), approx (one value for every op of an edge "
                        "that ends in BatchNorm), ggn, ggn_mc (about one "
                        "step each), hutchinson:<k> (k products per edge), exact (the Z shared by a cell type, cross-cell terms "
                        "included) or exact_per_edge (summed per cell; both one Hessian-vector product per mixing weight: "
                        "minutes per epoch on a CPU); docs/hessian.md compares them")
    s.add_argument("--spectrum-every", type=int, default=0, metavar="K",
                   help="record the top α-Hessian eigenvalue (per cell type and joint) every K steps (0: never; default: 0)")
    s.add_argument("--engine", default=d.engine, choices=ENGINES, help=f"supernet execution engine (default: {d.engine})")
    s.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: usable CPUs, at most 4, shared among torchrun processes)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")

    m = sub.add_parser("methods", help="list the search methods with their hyperparameters and defaults",
                       description="List the registered search methods, each with its hyperparameters (--hp KEY=VALUE of "
                       "nasdiag search), their types and defaults.")
    m.add_argument("names", nargs="*", metavar="METHOD", help="list only these methods (default: all)")

    from nasdiag.plot import commands as plot_commands  # argparse only: the parser stays instant

    plot_commands.add_plot_arguments(sub)
    plot_commands.add_report_arguments(sub)
    return parser


def search_config(args: argparse.Namespace) -> SearchConfig:
    """The `SearchConfig` of ``nasdiag search`` arguments."""
    hp = {}
    for item in args.hp:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--hp expects KEY=VALUE, got {item!r} (nasdiag methods lists the keys)")
        key = key.strip()
        if not value.strip():  # an unset shell variable: an Optional one (xnas reward_bound) silently kept its default
            raise ConfigError(f"--hp {key}= gives no value; give one (nasdiag methods lists the types and defaults), or "
                              f"leave --hp {key} out for the default")
        tokens = value.replace(",", " ").split()  # w_lr=0.1,w_momentum=0.8: "w_lr must be a float, got '0.1,w_mom...'"
        # a setting begins with a key's name after a value (w_lr=1e-2=3 was "sets 2 hyperparameters at once: --hp w_lr=
        # --hp 1e-2=3", a value split off as a key and a first --hp of no value, which is refused; it is a bad value)
        starts = [i for i, t in enumerate(tokens) if "=" in t and _KEY.fullmatch(t.partition("=")[0])]
        if starts and starts[0] > 0:
            settings = [f"{key}={','.join(tokens[:starts[0]])}"] + [",".join(tokens[a:b]) for a, b in
                                                                   zip(starts, [*starts[1:], len(tokens)])]
            raise ConfigError(f"--hp {_quote(item)} sets {len(settings)} hyperparameters at once; --hp takes one "
                              f"KEY=VALUE, repeated for each: {' '.join('--hp ' + _quote(t) for t in settings)}")
        if key in hp:  # the last would silently win
            raise ConfigError(f"--hp {key} is given twice ({key}={hp[key]} and {key}={value.strip()}); pass it once")
        hp[key] = value.strip()
    _refuse_options_given_as_hp(hp, args.method)
    for option, value in (("--figs", args.figs), ("--data-dir", args.data_dir)):
        if value is not None and not value.strip():  # an unset shell variable: silently the default, or ignored
            raise ConfigError(f"{option} is empty; give a folder, or leave {option} out")
    if args.figs is not None and args.no_figs:
        raise ConfigError(f"--figs {args.figs} and --no-figs contradict each other; pass only one")
    if not args.out.strip():
        raise ConfigError("--out is empty; pass the record path, such as runs/search.h5")
    if args.out.strip() == "-":  # it wrote a record named "-" into the current folder
        raise ConfigError("--out - would name a record file '-': a record is an HDF5 file and cannot go to standard "
                          "output; pass the record path, such as runs/search.h5")
    from nasdiag.plot.commands import OTHER_FORMATS

    suffix = Path(args.out).suffix.lower()
    if suffix in OTHER_FORMATS and not os.path.lexists(args.out):  # one there (a record so named) is the user's
        raise ConfigError(f"--out {args.out} names a {suffix} file, but the search writes its record there, an HDF5 "
                          f"file (it would be HDF5 under a {suffix} name); give an .h5 path, e.g. --out "
                          f"{Path(args.out).with_suffix('.h5')} (the figures go to the folder --figs names)")
    if args.hessian_mode is not None and not args.hessian_mode.strip():  # it silently ran the default mode
        raise ConfigError("--hessian-mode is empty; give a mode such as diag, approx, ggn, hutchinson:4 or exact, or "
                          "leave the option out for the default (diag)")
    if args.out.endswith(("/", os.sep)) and not os.path.isdir(args.out):  # an existing folder has its own message
        raise ConfigError(f"--out {args.out} ends in /, so it names a folder; pass the record's file path, such as "
                          f"{args.out}run.h5")
    if args.data_dir and os.path.exists(args.data_dir) and not os.path.isdir(args.data_dir):  # not "does not exist"
        raise ConfigError(f"--data-dir {args.data_dir} is a file, not a folder; pass the folder of the CIFAR-10 python "
                          "batches (data_batch_1..5, test_batch), e.g. cifar-10-batches-py/")
    # once each: "cost,cost" was recorded as such, and its resume with "cost" refused as other settings
    wanted = list(dict.fromkeys(d.strip() for d in args.diagnostics.split(",") if d.strip()))
    if not wanted:  # an empty value (an unset shell variable) silently recorded no diagnostics
        raise ConfigError(f"--diagnostics {args.diagnostics!r} names no diagnostic; give {', '.join(DIAGNOSTICS)} "
                          "(comma-separated), or none to record no diagnostics")
    for item in wanted:  # "choose one of cost, hessian" for None, NONE, all or cost;hessian: no word of none or commas
        if item not in (*DIAGNOSTICS, "none"):
            from nasdiag.search.config import did_you_mean

            parts = [p for p in item.replace(";", " ").split() if p]
            hint = (f" did you mean {','.join(p.lower() for p in parts)!r}?" if len(parts) > 1 and
                    all(p.lower() in DIAGNOSTICS for p in parts) else did_you_mean(item, (*DIAGNOSTICS, "none")))
            raise ConfigError(f"unknown diagnostics {item!r};{hint or ''} --diagnostics takes {', '.join(DIAGNOSTICS)} "
                              "(comma-separated), or none to record no diagnostics")
    if "none" in wanted and len(wanted) > 1:  # "none" would silently lose to the others
        raise ConfigError(f"--diagnostics {args.diagnostics} contradicts itself: none records no diagnostics; "
                          "pass none alone, or only the diagnostics to record")
    out = Path(args.out)
    figures = None if args.no_figs else (args.figs or str(out.with_name(out.stem + "-figs")))
    if figures is not None:
        _refuse_figures_in_the_record(figures, args.out, str(out.with_name(out.stem + "-figs")))
        from nasdiag.plot.commands import refuse_foreign_figures, refuse_other_format

        if args.figs:  # --figs figs.pdf drew png files into a new folder so named
            refuse_other_format(args.figs, "search", "png", "--figs")

        refuse_foreign_figures(figures, "png", "--figs" if args.figs else "the figure folder",
                               instead="give another --figs" + ("" if args.figs else ", or --no-figs"))
    config = SearchConfig(
        method=args.method, hp=hp, dataset=args.dataset, data_dir=args.data_dir, C=args.C, layers=args.layers,
        steps=args.steps, multiplier=args.multiplier, order=args.order, norm=args.norm, epochs=args.epochs,
        batch_size=args.batch_size, seed=args.seed, device=args.device, dtype=args.dtype,
        diagnostics=",".join(wanted), hessian_mode=SearchConfig.hessian_mode if args.hessian_mode is None else args.hessian_mode, spectrum_every=args.spectrum_every,
        record=args.out, resume=args.resume, force=args.force, figures=figures, engine=args.engine,
        threads=args.threads, progress=not args.no_progress,
    )
    if args.hessian_mode is not None and "hessian" not in config.validate().diagnostics:  # given, even as the default:
        raise ConfigError(no_hessian_recorded(args.hessian_mode, config.diagnostics))    # it would do nothing
    return config


def _refuse_options_given_as_hp(hp: dict, method: str) -> None:
    """Refuse ``--hp KEY=VALUE`` whose key is an option of ``nasdiag search`` (``seed``, ``epochs``, ``batch_size``,
    ``hessian_mode``, ...) and no hyperparameter of ``method``: the line listed the method's keys, not the option meant,
    and for ``--hp hessian_mode=ggn`` of darts sent the user to ``--method bayesnas`` (whose own curvature it sets),
    where ``--hessian-mode ggn`` (the recorded diagnostics' mode) was meant."""
    from nasdiag.search.registry import available_methods

    cls = available_methods().get(method)
    if cls is None:  # an unknown method has its own line
        return
    options = {action.dest.lower(): action for action in _parser().commands["search"]._actions
               if action.option_strings and action.dest not in ("help", "hp")}
    for key, value in hp.items():
        action = options.get(key.replace("-", "_").lower())
        if action is None or key in cls.Hyperparameters.keys():
            continue
        option = action.option_strings[-1]
        given = f"{option}, a flag without a value" if action.nargs == 0 else f"{option} {_quote(value)}"
        others = [name for name, other in available_methods().items() if key in other.Hyperparameters.keys()]
        also = f" (or, for the hyperparameter of {', '.join(others)}, choose that --method)" if others else ""
        raise ConfigError(f"--hp {_quote(f'{key}={value}')}: {key} is an option of nasdiag search, not a hyperparameter of "
                          f"{method} (nasdiag methods {method} lists those); give it as {given}{also}")


def _refuse_deleted_folder() -> None:
    """Refuse to run in a current folder that no longer exists (removed, by another shell, since this one entered
    it): torch cannot load there, and its loader ended the process with "Intel oneMKL FATAL ERROR: Cannot load
    .../torch/lib/libtorch_cpu.so.", exit 2, as if the installation were broken (``nasdiag methods`` too)."""
    try:
        os.getcwd()
    except FileNotFoundError:
        raise ConfigError("the current folder no longer exists (removed since this shell entered it), and torch cannot "
                          "load in it; cd to a folder that exists and run the command again") from None


def _paths_given(args) -> List[tuple]:
    """``[(option, path)]`` of the paths a ``search``, ``plot`` or ``report`` command was given (``RECORD`` for a record
    argument); a path not given is None."""
    paths = [("--out", args.out)]
    if args.command == "search":
        return paths + [("--figs", args.figs), ("--data-dir", args.data_dir)]
    return paths + [("RECORD", r) for r in (args.records if args.command == "plot" else [args.record])]


def _refuse_unexpanded_home(args) -> None:
    """Refuse a path that begins with ``~`` the shell left as is (it expands it in a word of its own, not after
    ``--out=`` nor in quotes): ``--out=~/runs/a.h5`` made a folder named ``~`` in the current one and said "record:
    ~/runs/a.h5", as if in the home folder. A folder really named ``~`` here is taken as meant."""
    for option, value in _paths_given(args):
        if not value or not value.startswith("~"):
            continue
        first = Path(value).parts[0]
        expanded = os.path.expanduser(value)
        if os.path.lexists(first) or expanded == value:  # a folder named so, or no such user: the path as given
            continue
        given = f"{option}={value}" if option.startswith("-") else value
        instead = f"{option} {value} (a space, not =)" if option.startswith("-") else value + " unquoted"
        names = "would name a folder {} here" if option in ("--out", "--figs") else "names a folder {} here, which is not there"
        raise ConfigError(f"{given} begins with {first}, which the shell expands only in a word of its own, not after = "
                          f"nor in quotes, so it {names.format(first)}; write {instead}, or the full path "
                          f"{_quote(expanded)}")


def _refuse_broken_links(args) -> None:
    """Refuse an output path (``--out``, and the figure folder of ``search``) through a symbolic link that leads
    nowhere: the path itself or a folder of it a dangling link, or a loop of links. Each was an error that named
    neither ("cannot write the record under dir: File exists", "File exists (dir)", "--out x.html exists and is not a
    regular file"); for the record itself, the recorder would see a file appear."""
    import errno

    outputs = [(f"--out {args.out}", args.out, "choose another --out")]
    if args.command == "search" and not args.no_figs:
        out = Path(args.out)
        default = str(out.with_name(out.stem + "-figs"))
        outputs.append((f"--figs {args.figs}", args.figs, "choose another --figs") if args.figs else
                       (f"the figure folder {default} (of --out {args.out})", default, "pass another --figs"))
    for label, value, instead in outputs:
        if not value or not value.strip():
            continue  # refused as empty by the command
        parts = Path(value).parts
        for i in range(1, len(parts) + 1):
            level = os.path.join(*parts[:i])
            if not os.path.lexists(level):
                break  # this level and those below it are created
            if not os.path.islink(level):
                continue
            try:
                os.stat(level)
                continue
            except OSError as exc:
                loop = exc.errno == errno.ELOOP
            what = (f"{label} is a symbolic link" if i == len(parts) else
                    f"{label}: its folder {level} is a symbolic link")
            where = "a loop of links that never reaches a file or folder" if loop else "which does not exist"
            fix = "remove the link" if i == len(parts) else "remove the link or point it at a folder"
            raise ConfigError(f"{what} to {os.readlink(level)}, {where}; {fix}, or {instead}")


def _refuse_special_files(args) -> None:
    """Refuse a record path (``search --out``, the RECORD of ``plot`` and ``report``) that is a named pipe, a device or a
    socket: reading a named pipe waits for a writer, so each command hung before a word (and a search stopped then
    said "the record holds every completed step"), and /dev/null was called a damaged record."""
    import stat

    if args.command == "search":
        paths = [("--out ", args.out, "pass the record's file path, such as runs/search.h5")]
    else:
        given = args.records if args.command == "plot" else [args.record]
        paths = [("", r, "pass the .h5 record that nasdiag search (or nasdiag.record.Recorder) wrote") for r in given]
    for option, value, instead in paths:
        try:
            mode = os.stat(value).st_mode
        except (OSError, ValueError):  # missing (a search creates it) or a dangling link: said elsewhere
            continue
        if stat.S_ISREG(mode) or stat.S_ISDIR(mode):  # a folder has its own line
            continue
        kind = ("a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise ConfigError(f"{option}{value} is {kind}, not a record file, which is an HDF5 file on disk; {instead}")


def _refuse_typographic_quotes(args) -> None:
    """Refuse a path in typographic quotes (``--out “run.h5”``, copied from a rendered page): a shell removes only ASCII
    quotes, so the search wrote its record as “run.h5” and plot drew into a folder “figs”, exit code 0, files a user
    cannot name without the same characters. A file so named that exists is taken as meant."""
    from nasdiag.search.config import typographic_quotes

    for option, value in _paths_given(args):
        said = typographic_quotes(value) if value and not os.path.lexists(value) else ""
        if said:
            raise ConfigError(f"{option if option.startswith('-') else 'the record'} {said}")


def _refuse_surrounding_space(args) -> None:
    """Refuse a path that begins or ends with white space (``--out "run.h5 "``, ``"$name"`` read with its newline): the
    search wrote its record as "run.h5 ", exit code 0, a name that looks like run.h5 and that plot run.h5 then did not
    find. A file so named that exists is taken as meant; a path of white space alone has its own line."""
    for option, value in _paths_given(args):
        if value and value.strip() and value != value.strip() and not os.path.lexists(value):
            end = "begins" if value[0].isspace() else "ends"
            raise ConfigError(f"{option if option.startswith('-') else 'the record'} {_quote(value)} {end} with white space "
                              f"({_space_name(value[0] if end == 'begins' else value[-1])}), which would be part of the "
                              f"file name; type {_quote(value.strip())}")


def _refuse_slash_after_a_file(args) -> None:
    """Refuse a record path (``search --out``, the RECORD of ``plot`` and ``report``) that ends in / after an existing
    file (``run.h5/``): search said to pass a path such as run.h5/run.h5, under the file, and plot and report "no record
    at run.h5/ (no file run.h5/ ...)", the record there all along."""
    paths = [("--out", args.out)] if args.command == "search" else [(o, p) for o, p in _paths_given(args) if o == "RECORD"]
    for option, value in paths:
        if not value or not value.endswith(("/", os.sep)):
            continue
        file = value.rstrip("/" + os.sep)
        if file and os.path.isfile(file):
            raise ConfigError(f"{option if option.startswith('-') else 'the record'} {_quote(value)} ends in /, a folder's "
                              f"mark, but {_quote(file)} is a file; drop the / and give {_quote(file)}")


def _space_name(char: str) -> str:
    """``a space``, ``a newline``, or the character's Unicode name in lower case."""
    import unicodedata

    return {" ": "a space", "\n": "a newline", "\t": "a tab"}.get(char) or unicodedata.name(char, repr(char)).lower()


def _refuse_unmatched_pattern(args) -> None:
    """Refuse the one RECORD of ``plot`` or ``report`` that is a shell pattern no file matched (``runs/*.h5``, passed on
    as is): it was "no record at runs/*.h5 (no file runs/*.h5 and no segments next to it)", as if a file of that name
    were missing. Among several records of ``plot`` it is skipped as any missing record."""
    import glob

    given = args.records if args.command == "plot" else [args.record] if args.command == "report" else []
    if len(given) != 1 or not glob.has_magic(given[0]) or os.path.lexists(given[0]):
        return
    folder = os.path.dirname(given[0])
    where = (f"the folder {folder}" if os.path.isdir(folder) else f"{folder}, which is not a folder" if os.path.lexists(folder)
             else f"{folder}, which does not exist") if folder else "the current folder"
    raise ConfigError(f"no file matches {given[0]} (a shell passes on a pattern that matches nothing unexpanded); check "
                      f"the pattern against the files in {where}, or pass the record's path")


def _refuse_figures_in_the_record(figures: str, record: str, default: str) -> None:
    """The figure folder must not be the record or its checkpoint, lock or a file being built, nor lie inside one:
    the search would run to the end and then fail to draw, or its --resume be refused; nor be named as a later
    segment of the record."""
    from nasdiag.search.runner import SIDE_FILES

    folder = os.path.abspath(figures)
    for path in (record, *(record + suffix for suffix, _ in SIDE_FILES)):
        own = os.path.abspath(path)
        if folder == own or folder.startswith(own + os.sep):
            raise ConfigError(f"--figs {figures} is {'inside ' if folder != own else ''}the file {path} that the search "
                              f"writes (--out {record}); pass another --figs, such as {default}")
    from nasdiag.plot.commands import later_segment_in

    segment = later_segment_in(figures, record)
    if segment is not None:
        raise ConfigError(f"--figs {figures} is or lies in {segment}, the name of a later segment of the record {record} (its rows "
                          f"after a resume), which plot, report and --resume would read as damaged; pass another --figs, "
                          f"such as {default}")


def run_search(args) -> int:
    if args.resume and os.path.isfile(args.out):  # it said the checkpoint was missing: "start again with --force"
        from nasdiag.plot.commands import renamed_record

        renamed = renamed_record(args.out)
        if renamed is not None:
            raise ConfigError(f"cannot resume: {renamed}")
    from nasdiag.search import run  # torch: seconds, in which Ctrl-C comes before anything is replaced

    result = run(search_config(args))
    if int(os.environ.get("RANK", "").strip() or 0) != 0:  # empty: unset, as the runner reads it (int('') was a traceback)
        return 0
    print(f"search-val accuracy (at the method's evaluation weights): {result.evaluation.get('acc', float('nan')):.4f}")
    print(f"genotype: {result.genotype}")
    print(f"record: {result.record}")
    if result.figures:
        print(f"figures: {Path(result.figures[0]).parent} ({len(result.figures)} files)")
    return 0


def list_methods(args) -> int:
    from nasdiag.search.config import did_you_mean
    from nasdiag.search.registry import available_methods

    methods = available_methods()
    for name in getattr(args, "names", None) or ():  # `nasdiag methods darts` was "unrecognized arguments"
        if name not in methods:
            raise ConfigError(f"unknown method {name!r};{did_you_mean(name, methods) or ''} available: "
                              f"{', '.join(sorted(methods))} (nasdiag methods lists them all)")
    for name, cls in methods.items():
        if getattr(args, "names", None) and name not in args.names:
            continue
        doc = (cls.__doc__ or "").strip().splitlines()
        print(f"{name}: {doc[0] if doc else cls.__qualname__}")
        for line in cls.Hyperparameters.describe().splitlines():
            print(f"    {line}")
        preset = getattr(cls, "digits_preset", None)
        if preset:
            print(f"    (with --dataset digits: {', '.join(f'{k}={v!r}' for k, v in preset.items())} unless given)")
    return 0


def run_plot(args) -> int:
    from nasdiag.plot.commands import run_plot as plot

    return plot(args)


def run_report(args) -> int:
    from nasdiag.plot.commands import run_report as report

    return report(args)


COMMANDS = {"search": run_search, "methods": list_methods, "plot": run_plot, "report": run_report}


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if text.startswith("nasdiag") else f"nasdiag: error: {text}"


class _Signals:
    """The signals (Ctrl-C, SIGTERM, SIGHUP) one command receives, noted by its handlers, so that an error a library
    made of one is still reported as that signal: a Ctrl-C during nasdiag report ended at times in matplotlib's
    pybind11 "TypeError: affine_transform(): incompatible function arguments" traceback, exit code 1 (the interrupt
    raised while it converted an argument, which it then cleared), or printed "Exception ignored in: <function
    WeakKeyDictionary...> KeyboardInterrupt" and went on. One per `main` call: nothing outlives the command."""

    def __init__(self) -> None:
        self.received: List[int] = []
        self._timers: List = []  # the timers sending again a Ctrl-C a finalizer ignored
        self._previous_hook = None

    def on_sigterm(self, signum, frame):
        self.received.append(signum)
        raise Terminated()

    def on_sighup(self, signum, frame):
        self.received.append(signum)
        raise HungUp()

    def on_sigint(self, signum, frame):
        self.received.append(signum)
        raise KeyboardInterrupt

    def _interrupt_ignored(self, unraisable) -> None:
        """`sys.unraisablehook` while a command runs: a KeyboardInterrupt raised in a finalizer (a weakref callback,
        a ``__del__``), which Python prints as "Exception ignored in ..." and goes on from, is sent again to the main
        thread a moment later, once out of the finalizer; anything else goes to the previous hook."""
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            return self._previous_hook(unraisable)
        import threading

        timer = threading.Timer(0.01, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def catch_interrupts(self) -> Optional[tuple]:
        """Note each Ctrl-C and raise it again where a finalizer ignored it; only over Python's own handler. The
        previous handler, or None where nothing was installed."""
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return None
        self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._interrupt_ignored
        return signal.signal(signal.SIGINT, self.on_sigint)

    def restore_interrupts(self, previous) -> None:
        if previous is None:
            return
        for timer in self._timers:  # the command ended first
            timer.cancel()
            timer.join()
        if sys.unraisablehook == self._interrupt_ignored:
            sys.unraisablehook = self._previous_hook
        if signal.getsignal(signal.SIGINT) == self.on_sigint:  # not SIG_DFL set by `_die_on_the_next_interrupt`
            signal.signal(signal.SIGINT, previous)

    def catch_hangup(self) -> object:
        """Handle SIGHUP as SIGTERM (the rows held since the last flush were lost with the default action, as on
        kill -9), unless it is ignored (``nohup``): the previous handler, or None where nothing was installed."""
        hup = getattr(signal, "SIGHUP", None)
        if hup is None or signal.getsignal(hup) is not signal.SIG_DFL:
            return None
        return signal.signal(hup, self.on_sighup)


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    """Parse ``argv``; an unknown argument of a command is reported by that command's parser, so the
    message points at ``nasdiag <command> --help``."""
    parser = _parser()
    tokens = sys.argv[1:] if argv is None else [str(a) for a in argv]
    _refuse_options_before_the_command(tokens, parser.commands)
    _refuse_version_after_the_command(tokens, parser.commands)
    try:
        args, unknown = parser.parse_known_args(argv)
    except ConfigError as exc:  # "--out: expected one argument" for --out -x.h5, "required: RECORD" for plot -x.h5
        raise ConfigError(f"{exc}{_typographic_dash(tokens, str(exc)) or _dash_value(tokens, parser)}") from None
    if unknown and args.command == "plot" and all(_stray_record(u) for u in unknown):
        # plot a.h5 --out figs b.h5: argparse takes one run of RECORDs only, so b.h5 was "unrecognized arguments"; plot
        # takes no other argument that is not an option, so each is a record, in the order given
        args.records, unknown = [*args.records, *unknown], []
    if unknown:
        command = parser.commands.get(args.command, parser)
        empty = ("; an empty argument ('') is often a quoted shell variable that is not set: set it or drop it"
                 if any(not u.strip() for u in unknown) else "")
        hint = (_typographic_dash(unknown, "", every=True) or _hyperparameter_apart(unknown, tokens, command)
                or _meant_option(unknown, command, parser.commands)
                or _dash_value(tokens, parser))
        raise ConfigError(f"{command.prog}: unrecognized arguments: {_join(unknown)} (see {command.prog} --help)"  # quoted:
                          f"{hint}{empty}")  # an empty argument ('') was an invisible nothing
    return args


def _stray_record(token: str) -> bool:
    """Whether ``token``, left over after plot's run of RECORDs, is one more record: not empty (an unset variable) nor an
    option, also one typed with a typographic dash (—figures, said as such), unless a file is so named."""
    from nasdiag.search.config import TYPOGRAPHIC_DASHES

    return bool(token.strip()) and not token.startswith("-") and (token[:1] not in TYPOGRAPHIC_DASHES
                                                                  or os.path.lexists(token))


def _typographic_dash(tokens: List[str], message: str, every: bool = False) -> str:
    """``; '—epochs' holds '—' (em dash), ...; type --epochs`` for the first of ``tokens`` that begins with a dash that is
    not the keyboard's hyphen-minus (an option copied from a rendered page: "unrecognized arguments: '—epochs' 2", or
    "required: --out" for plot's —out), or holds one and is named in ``message`` (``--seed −1``: "takes a whole number,
    not '−1'"), or with ``every`` holds one at all (an unknown argument); else ''. A file name with an en dash given
    where it is valid is not one."""
    from nasdiag.search.config import TYPOGRAPHIC_DASHES, typographic_dash

    for token in tokens:
        if token[:1] in TYPOGRAPHIC_DASHES or (every and not os.path.lexists(token)) or (
                repr(token) in message or f" {token} " in f" {message} "):  # a file so named is no typo
            said = typographic_dash(token)
            if said:
                return f"; {said}"
    return ""


def _dash_value(tokens: List[str], parser) -> str:
    """For a value that begins with ``-`` (a file named ``-x.h5``), which argparse reads as an option: how to give it
    (``--out=-x.h5``, ``./-x.h5``); else ''. The line said only that --out expected one argument, or that the record
    (given) was required."""
    name = next((t for t in tokens if t in parser.commands), None)
    command = parser.commands[name] if name else parser
    options = command._option_string_actions
    files = name in ("plot", "report")  # the commands that take files as arguments
    for before, token in zip(["", *tokens], tokens):
        if not token.startswith("-") or token in ("-", "--") or token.split("=", 1)[0] in options:
            continue
        if before.startswith("-") and before.split("=", 1)[0] not in options:
            continue  # the value of an unknown option: that one is the mistake
        try:
            float(token)  # a negative number is read as a value
            continue
        except ValueError:
            pass
        if token.startswith("--") and any(o.startswith(token.split("=", 1)[0]) for o in options):
            continue  # an abbreviated option
        action = options.get(before)
        if action is not None and action.nargs is None:  # an option that takes one value
            return f"; {_quote(token)} begins with - and is read as an option: write {before}={_quote(token)}"
        short = _short_for_long(token, options)
        if short:  # plot RUN.h5 -o figs: "if it is a file, write ./-o"
            return short
        if files and not token.startswith("--"):
            return f"; {_quote(token)} begins with - and is read as an option: if it is a file, write ./{_quote(token)}"
    return ""


def _short_for_long(token: str, options) -> str:
    """``; did you mean --out for -o?`` for a one-letter option (the -o of other tools) that begins exactly one long option
    of ``options`` (a command's), else ''."""
    if len(token) != 2 or not token[1].isalpha() or token in options:
        return ""
    longs = [o for o in options if o.startswith(f"--{token[1]}")]
    return f"; did you mean {longs[0]} for {token}? (nasdiag's options are long)" if len(longs) == 1 else ""


def _refuse_options_before_the_command(tokens: List[str], commands) -> None:
    """``nasdiag --epochs 1 search ...`` was "invalid choice: '1'" and ``nasdiag --no-progress search ...`` said that
    search does not know --no-progress: the options of a command go after its name."""
    first = next((i for i, t in enumerate(tokens) if t in commands), None)
    if first is None:
        _refuse_a_command_option_without_the_command(tokens, commands)
    if not first or not tokens[0].startswith("-") or tokens[0] in ("-h", "--help", "--version"):
        return
    command, before = tokens[first], tokens[:first]
    if "--" in before:  # it said to run "nasdiag search -- --epochs 1", where every option after -- is a value
        moved = [t for t in before if t != "--"]
        also = ", and give options after the command" if moved else ""
        raise ConfigError(f"nasdiag: {_join(before)} is given before the command {command}; drop the --, which makes "
                          f"every argument after it a value, not an option{also}: "
                          f"nasdiag {_join([command, *moved, *tokens[first + 1:]])}")
    raise ConfigError(f"nasdiag: {_join(before)} is given before the command {command}; options go after it: "
                      f"nasdiag {_join([command, *before, *tokens[first + 1:]])}")


def _refuse_a_command_option_without_the_command(tokens: List[str], commands) -> None:
    """``nasdiag --out run.h5`` or ``nasdiag --epochs 1`` (the command forgotten) was "argument command: invalid choice:
    'run.h5'", as if the value were a misspelt command: say that the option is a command's, and give the command
    first."""
    name = tokens[0].split("=", 1)[0] if tokens else ""
    if not name.startswith("--") or name in ("--help", "--version"):
        return
    owners = [c for c, p in commands.items() if name in p._option_string_actions]
    if not owners:
        return
    whose = " and ".join([", ".join(f"nasdiag {c}" for c in owners[:-1]), f"nasdiag {owners[-1]}"] if owners[:-1] else
                         [f"nasdiag {owners[0]}"])
    example = "; for example" if len(owners) > 1 else ":"
    raise ConfigError(f"nasdiag: {name} is an option of {whose}, and no command is given; the command goes first{example} "
                      f"nasdiag {_join([owners[0], *tokens])}")


def _refuse_version_after_the_command(tokens: List[str], commands) -> None:
    """``nasdiag search --version`` was "unrecognized arguments: --version" and ``nasdiag plot --version`` "the following
    arguments are required: RECORD, --out": --version is nasdiag's own option, before any command."""
    first = next((i for i, t in enumerate(tokens) if t in commands), None)
    if first is None or "--version" not in tokens[first + 1:] or {"-h", "--help"} & set(tokens[first + 1:]):
        return  # --help is answered as such
    if "--" in tokens[first + 1:] and tokens.index("--", first + 1) < tokens.index("--version", first + 1):
        return  # a value after --: unknown, as any
    raise ConfigError(f"nasdiag: --version is an option of nasdiag itself, not of the command {tokens[first]}: "
                      "run nasdiag --version")


def _quote(arg: str) -> str:
    """``arg`` quoted for a shell, on one line: shlex.quote kept a control character (a newline in a file name) as is,
    so the command printed after Ctrl-C took two lines (and one inside an error line lost its newline to a space, a
    command naming another file); such an argument is written in ANSI-C quoting (``$'a\\nb.h5'``: bash, zsh, ksh,
    POSIX sh 2024)."""
    from shlex import quote

    if not any(ord(c) < 32 or ord(c) == 127 for c in arg):
        return quote(arg)
    escaped = "".join("\\\\" if c == "\\" else "\\'" if c == "'" else f"\\x{ord(c):02x}" if ord(c) < 32 or ord(c) == 127
                      else c for c in arg)
    return f"$'{escaped}'"


def _path_word(path: str) -> str:
    """``path`` as a shell word that a command reads as a path, not an option: ``./-run.h5`` for ``-run.h5`` (the
    command given after Ctrl-C while drawing the figures of ``--out=-run.h5`` was refused, -run.h5 read as an option)."""
    return _quote(os.path.join(".", path) if path.startswith("-") else path)


def _join(argv: List[str]) -> str:
    """``argv`` as one line of shell words (`_quote`)."""
    return " ".join(_quote(a) for a in argv)


def _hyperparameter_apart(unknown: List[str], tokens: List[str], command: argparse.ArgumentParser) -> str:
    """The ``--hp`` setting that the shell split (``--hp w_lr =0.1``, ``--hp w_lr = 0.1``, ``--hp w_lr= 0.1``, ``--hp
    alpha_betas=0.5, 0.999``: a space around '=' or after ',') or that was given several to one ``--hp`` (``--hp w_lr=0.1
    w_momentum=0.5``), as the one line's fix; these were "unrecognized arguments: =0.1 (see nasdiag search --help)",
    no word of --hp. Else ''."""
    if "--hp" not in command._option_string_actions:
        return ""

    def hp_value(k: int) -> Optional[str]:  # the value --hp took at tokens[k], or None
        if k >= 1 and tokens[k - 1] == "--hp":
            return tokens[k]
        return tokens[k][len("--hp="):] if k >= 0 and tokens[k].startswith("--hp=") else None

    for j, token in enumerate(tokens):
        if token not in unknown or token.startswith("-"):
            continue
        given = hp_value(j - 1)
        if given is None:
            continue
        if token == "=" and j + 1 < len(tokens):
            fixed = f"{given}={tokens[j + 1]}"
        elif token.startswith("=") or (given.endswith(("=", ",")) and "=" not in token):  # alpha_betas=0.5, 0.999
            fixed = given + token
        elif re.match(r"[A-Za-z_]\w*=", token):
            return f"; --hp takes one KEY=VALUE, repeated for each: --hp {_quote(given)} --hp {_quote(token)}"
        else:
            continue
        return f"; a space split the hyperparameter in two: write it as one word, --hp {_quote(fixed)}"
    return ""


def _meant_option(unknown: List[str], command: argparse.ArgumentParser, commands=None) -> str:
    """What ``unknown`` (arguments ``command`` does not take) most likely meant: ``; did you mean --batch-size for
    --batch_size?`` for an option close to one of ``command``'s (``--methods``), ``--method NAME`` for a method name
    given without its option, an option of another of ``commands`` (``report --format pdf``: plot's), and for
    ``report`` given several records, that it takes one; else ''."""
    from nasdiag.search.config import near_miss

    if "--" in unknown:  # each option after it was "unknown", and named itself as the one meant (--epochs for --epochs)
        return "; every argument after -- is read as a value, not an option: drop the --"
    options = [o for o in command._option_string_actions if o.startswith("--")]
    hints, elsewhere = [], []
    for before, token in zip(["", *unknown], unknown):
        name = token.split("=", 1)[0]
        meant = near_miss(name.lstrip("-"), [o[2:] for o in options]) if name.startswith("--") else None
        short = _short_for_long(name, command._option_string_actions)
        if short:
            return short
        others = [f"nasdiag {n}" for n, p in (commands or {}).items() if p is not command and name in p._option_string_actions]
        if meant is not None:
            hints.append(f"--{meant} for {name}")
        elif name.startswith("--") and others:  # report --format pdf was told report takes one record
            elsewhere.append(f"{name} is an option of {' and '.join([', '.join(others[:-1]), others[-1]] if others[:-1] else others)}, "
                             f"not of {command.prog}")
        elif (command.prog.endswith(" search") and not token.startswith("-") and not before.startswith("-")
              and _is_method(token)):  # not the value of an unknown option (--methods darts)
            hints.append(f"--method {token}")
    said = (f"; did you mean {', '.join(hints)}?" if hints else "") + "".join(f"; {e}" for e in elsewhere)
    if command.prog.endswith(" report") and any(  # report runs/*.h5; not the value of an unknown option (--format pdf)
            not t.startswith("-") and (not b.startswith("-") or os.path.isfile(t)) for b, t in zip(["", *unknown], unknown)):
        return (f"{said}; report writes the page of one record: run it once per record, or draw several side by side with "
                "nasdiag plot RECORD RECORD ... --out FOLDER")
    return said


def _is_method(name: str) -> bool:
    from nasdiag.search.registry import available_methods

    return name in available_methods()


def _stopped(args: Optional[argparse.Namespace], how: str, exc: Optional[BaseException] = None,
             argv: Optional[List[str]] = None) -> str:
    """The line printed when a command is interrupted (``how``): what the record holds, when there is one."""
    if args is None or args.command != "search":
        return f"nasdiag: {how}"
    complete = getattr(exc, "complete_run", None)  # set by the runner when the stop came while drawing figures
    if complete is not None:
        record, figures = complete
        return (f"nasdiag: {how} while drawing the figures; the run is complete in {record}: "  # quoted: a path with a
                f"draw them with nasdiag plot {_path_word(record)} --out {_path_word(figures)}")  # space survives a shell
    if not args.out or not os.path.exists(args.out):
        return f"nasdiag: {how} before anything was recorded; run the command again (without --resume)"
    found = getattr(args, "found", None)  # the file at --out as the command started, but for --resume
    if found is not None and _identity(args.out) == found and args.force:  # the old run's record
        return (f"nasdiag: {how} before --force replaced the record at {args.out}, which is as it was; run the command "
                "again")  # "continue it with ... --resume" continued the run --force was to replace (or was refused)
    if found is not None and _identity(args.out) == found:  # an earlier run's, which a run without --resume was to
        return (f"nasdiag: {how} before anything was recorded; {args.out} was there before this command and is as "
                "it was (a search continues it only with --resume, replaces it only with --force)")  # refuse: it said
    # "the record holds every completed step: continue it with ... --resume", which continued that earlier run
    if argv is None:
        argv = sys.argv[1:]
    return f"nasdiag: {how}; the record holds every completed step: continue it with {_resume_command(argv)}"


def _identity(path: str):
    """What tells a file at ``path`` from one written since: (inode, size, modification time), or None if missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _say(line: str) -> None:
    """``line`` on stderr in one write: print() writes the text and its newline apart, and the ranks of a torchrun
    launch refusing at once ran their lines together ("...new pathnasdiag: error: ...")."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _writing(args, exc: OSError) -> str:
    """`` (writing OUT)`` for a write of ``plot`` or ``report`` that failed for a full disk or a read-only place
    without naming its file (a page's ``f.write``, PIL's png chunks): the line said "disk full" and not where."""
    import errno

    out = getattr(args, "out", None)
    if args is None or args.command not in ("plot", "report") or not out or exc.errno not in (
            errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
        return ""
    return f" (writing {'the figures under ' if args.command == 'plot' else ''}{_quote(str(out))})"


def _with_complete_run(line: str, exc: BaseException) -> str:
    """``line`` plus, for a search that failed while drawing its figures (``exc.complete_run``: a full disk), that
    the run is complete and the command that draws them: it said only "disk full", and the same command was then
    refused as a record that exists, its --resume as a run already finished."""
    complete = getattr(exc, "complete_run", None)
    if complete is None:
        return line
    record, figures = complete
    return (f"{line}; while drawing the figures: the run is complete in {record}; draw them with nasdiag plot "
            f"{_path_word(record)} --out {_path_word(figures)}")


def _with_resume(line: str, exc: BaseException, args, argv) -> str:
    """``line`` plus, for a search that failed after it began recording (``exc.resumable``), what the record keeps
    (``exc.kept``, unless the line says it) and the command that resumes it."""
    if not getattr(exc, "resumable", False) or args is None or args.command != "search":
        return line
    kept = getattr(exc, "kept", None)
    if kept is not None:
        record, last = kept
        line += (f"; the record {record} keeps steps 1 to {last}" if last else f"; the record {record} holds no step yet") + \
            ": fix that and continue it with the same settings"
    return f"{line}: {_resume_command(sys.argv[1:] if argv is None else argv)}"


def _with_removed_folder(line: str) -> str:
    """``line`` plus, when the current folder was removed while the command ran (another shell's rm -r), that it was:
    a search recording to a relative --out ended "cannot create record segment run.h5: No such file or directory", plot
    "No such file or directory (figs)", naming a path that looked right and no way out."""
    try:
        os.getcwd()
    except FileNotFoundError:
        if "current folder no longer exists" not in line:  # refused at the start, said so
            return (f"{line}; the current folder was removed while the command ran, and with it what the command had written "
                    "there by relative paths: cd to a folder that exists and run the command again")
    return line


def _resume_command(argv: List[str]) -> str:
    """The ``nasdiag search`` command that resumes the run ``argv`` started (``--force`` dropped, ``--resume``
    added), quoted for a shell."""
    options = _parser().commands["search"]._option_string_actions

    def names(token: str, dest: str) -> bool:  # as argparse reads it: the option or a unique prefix, such as --fo
        name = token.split("=", 1)[0]
        if not name.startswith("--"):
            return False
        hits = {options[name].dest} if name in options else {a.dest for o, a in options.items() if o.startswith(name)}
        return hits == {dest}

    argv = [str(a) for a in argv if not names(str(a), "force")]
    command = _join(argv if any(names(a, "resume") for a in argv) else [*argv, "--resume"])
    return f"{_launcher()}nasdiag {command}"


def _launcher() -> str:
    """``torchrun ... -m `` for a data-parallel run (WORLD_SIZE > 1): its record resumes only with the same world size,
    so a plain ``nasdiag search ... --resume`` would be refused. Empty for one process."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "") or world)
    except ValueError:
        return ""
    if world <= 1:
        return ""
    nodes = f"--nnodes={world // local} (and the rendezvous options you launched with) " if 0 < local < world else ""
    return f"torchrun {nodes}--nproc_per_node={local} -m "


def _damaged(exc) -> str:
    """A damaged record's message in CLI terms (the library's names a Python call)."""
    if not exc.intact_rows:  # nothing to salvage: no promise of rows
        return f"nasdiag: error: record {exc.path} is damaged at {exc.where}: {exc.reason}; no row of it can be read"
    return (f"nasdiag: error: record {exc.path} is damaged at {exc.where}: {exc.reason}; its {exc.intact_rows} intact "
            "rows before it stay readable in Python (nasdiag.record.load(path, salvage=True))")


def _warning_line(message, category, filename, lineno, line=None) -> str:
    """A warning as one line on stderr (Python's format adds the file and source line of library code,
    such as torch's module.py, which tells a CLI user nothing)."""
    return f"nasdiag: warning: {' '.join(str(message).split())} ({category.__name__})\n"


def _printed(command, args) -> int:
    """Run ``command``, which only prints (``methods``), and make sure its text reached standard output: closed
    (``>&-``), print() wrote nowhere, exit code 0 and nothing said. That is a `ConfigError`, and a write that failed
    (``> /dev/full``) an OSError naming standard output (exit code 2)."""
    if sys.stdout is None:
        raise ConfigError("nasdiag: error: standard output is closed (>&-), so what this command prints is lost; run "
                          "it with standard output open, e.g. > FILE")
    try:
        code = command(args)
        sys.stdout.flush()
    except BrokenPipeError:  # | head: handled as such
        raise
    except OSError as exc:
        if exc.filename is not None:
            raise
        quiet_stdout()  # what is left is not written again at exit
        raise OSError(exc.errno, exc.strerror, "standard output") from None
    return code


def _no_stderr() -> bool:
    """Whether the command was started with standard error closed (``2>&-``, a daemon): `sys.stderr` is None, or its
    descriptor is not open for writing (a launcher's file, such as pyenv's shim script, took its number). The progress
    bar failed on it, and then the error line: exit code 1, nothing said, a record of no rows left behind."""
    if sys.stderr is None:
        return True
    try:
        fd = sys.stderr.fileno()
    except (OSError, ValueError, AttributeError):  # captured (pytest, a notebook): it takes text
        return False
    try:
        os.write(fd, b"")
    except OSError:
        return True
    return False


def _memory_limit():
    """``(ulimit option, bytes)`` of the smallest finite limit on this process's memory (address space: ``-v``, data
    segment: ``-d``), or None where there is none: under one, importing torch, scipy or matplotlib failed with a
    traceback of ImportError ("failed to map segment from shared object"), MemoryError or SystemError, exit code 1."""
    if resource is None:  # pragma: no cover - not POSIX
        return None
    limits = []
    for option, name in (("-v", "RLIMIT_AS"), ("-d", "RLIMIT_DATA")):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            soft = resource.getrlimit(getattr(resource, name))[0]
            if soft != resource.RLIM_INFINITY:
                limits.append((soft, option))
    return None if not limits else min(limits)[::-1]


def _import_numpy() -> None:
    """Import NumPy before any command imports torch: torch's C module imports NumPy itself and, on a Ctrl-C in that
    import, goes on without it, the KeyboardInterrupt lost; the command then failed on the half-imported NumPy left
    behind ("module 'numpy' has no attribute 'nonzero'", a traceback and exit code 1). Imported here, the interrupt
    reaches `main` as any other."""
    import numpy  # noqa: F401


def _omp_threads_readable(text: str) -> bool:
    """Whether OpenMP (libgomp, which torch and scikit-learn load) reads ``text`` as ``OMP_NUM_THREADS``: a
    comma-separated list of whole numbers from 1 to 2**63 - 1, ASCII white space around each, an optional ``+``
    (libgomp's ``parse_unsigned_long_list``: ``strtoul`` base 10, a value <= 0 as a C long is invalid)."""
    for item in text.split(","):
        found = re.fullmatch(r"[ \t\n\v\f\r]*\+?([0-9]+)[ \t\n\v\f\r]*", item)
        if found is None or not 1 <= int(found.group(1)) <= 2**63 - 1:
            return False
    return True


def _drop_unreadable_omp_threads() -> None:
    """Remove an ``OMP_NUM_THREADS`` that OpenMP cannot read (``0``, ``abc``, empty) before torch loads it: each
    libgomp that loads (torch's, scikit-learn's) ignored it, so nothing changes, but each printed an empty line and
    "libgomp: Invalid value for environment variable OMP_NUM_THREADS" first, and a mistake was three lines on
    stderr. torch's threads are then its default, as OpenMP's were (a search sets its own: ``--threads``). Once torch
    is loaded (a Python caller of `main`) OpenMP has read it: nothing is changed."""
    text = os.environ.get("OMP_NUM_THREADS")
    if text is not None and "torch" not in sys.modules and not _omp_threads_readable(text):
        del os.environ["OMP_NUM_THREADS"]


def _die_on_the_next_interrupt(argv, main_thread: bool) -> None:
    """After an interrupt is handled (the record closed, the line printed), a second Ctrl-C while the process exits
    ends it at once instead of printing a traceback from an exit handler of torch. Only for the command itself
    (``argv`` None): a Python caller of `main` keeps its handlers."""
    if argv is None and main_thread:
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the ``nasdiag`` command; returns the exit code (0, 2 for user errors, 130/143/129 when interrupted)."""
    import threading

    main_thread = threading.current_thread() is threading.main_thread()
    signals = _Signals()
    previous = signal.signal(signal.SIGTERM, signals.on_sigterm) if main_thread else None
    previous_hup = signals.catch_hangup() if main_thread else None
    previous_int = signals.catch_interrupts() if main_thread else None
    import warnings

    previous_format, warnings.formatwarning = warnings.formatwarning, _warning_line
    previous_errors, previous_stderr_errors = paths_on_stdout(), paths_on_stderr()
    previous_stderr, quiet = sys.stderr, open(os.devnull, "w") if _no_stderr() else None
    if quiet is not None:  # nothing can be said; the exit code still tells (2 for a mistake)
        sys.stderr = quiet
    args = None
    try:
        args = _parse(argv)
        if args.command is None:
            raise ConfigError("nasdiag: choose a command: search, methods, plot or report (see nasdiag --help)")
        if args.command == "search":  # what --out was as the command started: an interrupt tells an earlier run's
            args.found = None if args.resume else _identity(args.out)  # record, as it was, from one this run wrote
        if args.command != "plot":  # the commands that load torch (plot draws from a record with absolute paths)
            _refuse_deleted_folder()
        if args.command in ("search", "plot", "report"):
            _refuse_unexpanded_home(args)
            _refuse_broken_links(args)
            _refuse_special_files(args)
            _refuse_unmatched_pattern(args)
            _refuse_typographic_quotes(args)
            _refuse_surrounding_space(args)
            _refuse_slash_after_a_file(args)
        _drop_unreadable_omp_threads()
        _import_numpy()
        if args.command == "methods":  # printing is all it does
            return _printed(COMMANDS[args.command], args)
        return COMMANDS[args.command](args)
    except NasdiagError as exc:
        from nasdiag.record.errors import DamagedRecordError

        line = _damaged(exc) if isinstance(exc, DamagedRecordError) else _one_line(exc)
        _say(_with_removed_folder(_with_complete_run(_with_resume(line, exc, args, argv), exc)))
        return EXIT_USAGE
    except Warning as exc:  # a warning that PYTHONWARNINGS=error or python -W error raised: chained tracebacks, exit 1
        _say(f"nasdiag: error: {raised_warning(exc)}")
        return EXIT_USAGE
    except BrokenPipeError:  # the reader of our output went away (| head): not an error of the command
        quiet_stdout()
        return EXIT_SIGPIPE
    except OSError as exc:  # a location the checks above could not foresee (a mount gone read-only, a full disk)
        from nasdiag.record.lock import describe_os_error

        where = f" ({exc.filename})" if getattr(exc, "filename", None) else _writing(args, exc)
        _say(_with_removed_folder(_with_complete_run(_with_resume(f"nasdiag: error: {describe_os_error(exc)}{where}", exc,
                                                                   args, argv), exc)))
        return EXIT_USAGE
    except (ImportError, MemoryError, SystemError) as exc:  # torch, scipy or matplotlib loaded under `ulimit -v`
        limit = _memory_limit()
        if limit is None or (isinstance(exc, ImportError) and not any(  # a missing module stays itself
                text in str(exc).lower() for text in ("failed to map segment", "cannot allocate memory"))):
            raise
        reason = " ".join(str(exc).split())
        _say(f"nasdiag: error: out of memory under the memory limit of {limit[1] // 2 ** 20} MiB (ulimit {limit[0]} "
             f"{limit[1] // 1024}) ({type(exc).__name__}{': ' + reason if reason else ''}): torch and the libraries it "
             f"loads need more; raise the limit (ulimit {limit[0]} unlimited) and run the command again")
        return EXIT_USAGE
    except KeyboardInterrupt as exc:
        _say(_stopped(args, "interrupted", exc, argv))
        _die_on_the_next_interrupt(argv, main_thread)
        return EXIT_SIGINT
    except Exception as exc:  # a signal that a library turned into its own error (`_Signals`)
        if not signals.received or not main_thread:
            raise
        how, code = {signal.SIGINT: ("interrupted", EXIT_SIGINT), signal.SIGTERM: ("terminated (SIGTERM)", EXIT_SIGTERM)}.get(
            signals.received[-1], ("hung up (SIGHUP)", EXIT_SIGHUP))
        with contextlib.suppress(OSError):  # after a hang-up the terminal that would show the line may be gone
            _say(_stopped(args, how, exc, argv))
        _die_on_the_next_interrupt(argv, main_thread)
        return code
    except HungUp as exc:
        with contextlib.suppress(OSError):  # the terminal that would show the line may be gone
            _say(_stopped(args, "hung up (SIGHUP)", exc, argv))
        _die_on_the_next_interrupt(argv, main_thread)
        return EXIT_SIGHUP
    except Terminated as exc:
        _say(_stopped(args, "terminated (SIGTERM)", exc, argv))
        _die_on_the_next_interrupt(argv, main_thread)
        return EXIT_SIGTERM
    finally:
        warnings.formatwarning = previous_format
        if previous_errors is not None:
            sys.stdout.reconfigure(errors=previous_errors)
        if quiet is not None:
            sys.stderr = previous_stderr
            quiet.close()
        if previous_stderr_errors is not None:
            sys.stderr.reconfigure(errors=previous_stderr_errors)
        if main_thread and previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if main_thread and previous_hup is not None:
            signal.signal(signal.SIGHUP, previous_hup)
        signals.restore_interrupts(previous_int)


if __name__ == "__main__":
    sys.exit(main())
