"""Arguments of the batch scripts, refused as ``nasdiag`` refuses its own: one line on stderr and exit code 2
(through `nasdiag.errors.run_script`), before any run starts.

argparse printed its usage and the error on two lines, and took any integer: ``--batch-size 0`` ended in a
ZeroDivisionError traceback, ``--seeds 0`` in a ValueError from ``max()``, ``--epochs -1`` drew the figures of
a run that never trained and exited 0, ``--dpi 5`` in FreeType's "invalid ppem value" traceback.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Callable

from nasdiag.errors import NasdiagError


class UsageError(NasdiagError):
    """A batch script's argument is invalid."""


class Parser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose errors are one `UsageError` line naming the script's ``--help``.

    ``plot_options``: the options (dests) that still act with ``--plot-only``; any other one given with it is refused
    (`refuse_with_plot_only`). None: not checked."""

    def __init__(self, *args, plot_options=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.plot_options = plot_options

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        refuse_bad_paths(self, parsed)
        refuse_unexpanded_home(self, parsed)
        if self.plot_options is not None:
            refuse_with_plot_only(self, args, parsed, self.plot_options)
        return parsed


#: the options of the batch scripts that name a file or folder, and of those the folders they write or read
PATH_OPTIONS = ("out", "runs", "dir", "folder", "data_dir", "json")
FOLDER_OPTIONS, FILE_OPTIONS = ("out", "runs", "dir", "folder"), ("json",)


def refuse_bad_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a path option (`PATH_OPTIONS`) given empty or blank, as an unset shell variable gives it (``--out
    "$OUT"``): ``--out ''`` wrote the records and figures into the current folder and ``--data-dir ''`` was taken as
    not given, without a word (``nasdiag`` refuses its own empty paths); a folder option (`FOLDER_OPTIONS`) that names
    a file or leads through a symbolic link to nothing; a file option (`FILE_OPTIONS`) that names a folder or lies in
    none."""
    import os
    from pathlib import Path

    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if action.dest not in PATH_OPTIONS or not action.option_strings or not isinstance(value, str) or value.strip() \
                or value == action.default:
            continue
        option = max(action.option_strings, key=len)
        default = f" for its default ({action.default})" if action.default not in (None, "") else ""
        leave = "" if action.required else f", or leave {option} out{default}"
        raise UsageError(f"{option} is empty ({value!r}: often a quoted shell variable that is not set); give a path"
                         f"{leave}")
    for action in parser._actions:  # "File exists: out.h5" or "Not a directory: out.h5/dsnas" named no option nor fix
        value = getattr(args, action.dest, None)
        if action.dest in FOLDER_OPTIONS and action.option_strings and isinstance(value, str) and value.strip():
            # a link that leads nowhere, as the folder or one above it: "File exists: L", naming neither
            broken = next((p for p in (value, *map(str, Path(value).parents)) if os.path.islink(p)
                           and not os.path.exists(p)), None)
            if broken is not None:
                option = max(action.option_strings, key=len)
                raise UsageError(f"{option} {value}: {broken} is a symbolic link to {os.readlink(broken)}, which does not "
                                 f"exist, so no folder can be made there; create what it names, remove the link, or give "
                                 f"another {option}")
        if action.dest in FOLDER_OPTIONS and action.option_strings and isinstance(value, str) and value.strip() \
                and os.path.exists(value) and not os.path.isdir(value):
            option = max(action.option_strings, key=len)
            raise UsageError(f"{option} {value} is not a folder but a file: {option} names the folder the script writes "
                             f"(or reads) its files in; give another {option}, or move the file away")
        if action.dest in FOLDER_OPTIONS and action.option_strings and isinstance(value, str) and value.strip():
            # a folder inside a file was "Not a directory" from os.makedirs, after another option's folder was made
            above = next((p for p in map(str, Path(value).absolute().parents) if os.path.exists(p)), None)
            if above is not None and not os.path.isdir(above):
                option = max(action.option_strings, key=len)
                raise UsageError(f"{option} {value} lies inside {above}, which is a file, not a folder, so no folder can "
                                 f"be made there; give another {option}")
        suffix = Path(value).suffix.lower() if action.dest == "out" and isinstance(value, str) else ""
        if suffix and not os.path.isdir(value):  # --out figs.pdf made a folder so named of png files and a record
            from nasdiag.plot.commands import OTHER_FORMATS, RECORD_SUFFIXES

            if suffix in OTHER_FORMATS + RECORD_SUFFIXES:  # a folder run.h5/ is read as a record by plot runs/*.h5
                option = max(action.option_strings, key=len)
                raise UsageError(f"{option} {value} names a {suffix} file, but the script writes its files (records, "
                                 f"figures, tables) into the folder {option} names; give a folder, e.g. {option} "
                                 f"{Path(value).with_suffix('')}")
        if action.dest in FILE_OPTIONS and action.option_strings and isinstance(value, str) and value.strip():
            option, folder = max(action.option_strings, key=len), os.path.dirname(os.path.abspath(value))
            where = (f"is a folder; give the file to write, such as {os.path.join(value, 'rows.json')}"
                     if os.path.isdir(value) else None if os.path.isdir(folder) else
                     f"is in {folder}, which is a file, not a folder; give another {option}" if os.path.exists(folder)
                     else f"is in {folder}, which does not exist; create it, or give another {option}")
            if where is not None:  # "Is a directory" or "No such file" once the minutes of timing were done
                raise UsageError(f"{option} {value} {where}")


def refuse_unexpanded_home(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a path that begins with a ``~`` the shell left as is (it expands it in a word of its own, not after
    ``--out=`` nor in quotes): ``--out=~/figs`` wrote into a folder named ``~`` in the current one. A folder really
    named so there is taken as meant."""
    import os

    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or not isinstance(value, str) or not value.startswith("~"):
            continue
        first, expanded = value.split(os.sep, 1)[0], os.path.expanduser(value)
        if os.path.lexists(first) or expanded == value:  # a folder named so, or no such user: the path as given
            continue
        option = max(action.option_strings, key=len)
        raise UsageError(f"{option}={value} begins with {first}, which the shell expands only in a word of its own, not "
                         f"after = nor in quotes, so it would name a folder {first} here; write {option} {value} (a "
                         f"space, not =), or the full path {expanded}")


def given_options(parser: argparse.ArgumentParser, argv) -> list:
    """The actions of ``parser`` given on the command line ``argv`` (also as a unique prefix, as argparse reads it):
    ``argv`` parsed again with every default suppressed."""
    defaults, parser_defaults = [(a, a.default) for a in parser._actions], dict(parser._defaults)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    parser._defaults.clear()
    try:
        given = vars(argparse.ArgumentParser.parse_args(parser, argv))
    finally:
        for action, default in defaults:
            action.default = default
        parser._defaults.update(parser_defaults)
    return [a for a in parser._actions if a.dest in given and a.option_strings]


def refuse_with_plot_only(parser: argparse.ArgumentParser, argv, args: argparse.Namespace, acting) -> None:
    """``--plot-only`` redraws from the records of an earlier run: an option that only shapes a run (``--epochs``,
    ``--lr``, ``--threads``) was accepted and silently ignored, the figures drawn as that run left them. Refuse each
    given with it, other than ``acting`` (the dests that still act: ``out``, ``format``, a selection of records)."""
    if not getattr(args, "plot_only", False):
        return
    ignored = [a for a in given_options(parser, argv) if a.dest not in {*acting, "plot_only"}]
    if ignored:
        names = ", ".join(max(a.option_strings, key=len) for a in ignored)
        one = len(ignored) == 1
        raise UsageError(f"{names} {'does' if one else 'do'} nothing with --plot-only, which redraws from the records of "
                         f"an earlier run; drop {'it' if one else 'them'}, or run without --plot-only")


def at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number >= ``low`` (counts of epochs, seeds, batches, samples)."""

    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes a whole number, not {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        return value

    whole_number.__name__ = f"whole number >= {low}"
    return whole_number


def seed(high: int = None) -> Callable[[str], int]:
    """An argparse ``type``: a seed, a whole number from 0 to ``high`` (default: `nasdiag.search.config.MAX_SEED`, as
    ``nasdiag search --seed``; sklearn's ``random_state`` takes at most 2**32 - 1). ``at_least(0)`` took any: past
    2**63 it was torch's "Overflow when unpacking long long" traceback (sklearn's InvalidParameterError past 2**32)
    after the output folder was made."""
    if high is None:
        from nasdiag.search.config import MAX_SEED

        high = MAX_SEED

    def whole_number(text: str) -> int:
        value = at_least(0)(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"{value} is too large: give a seed from 0 to at most {high}")
        return value

    whole_number.__name__ = f"seed from 0 to {high}"
    return whole_number


def threads(low: int = 1) -> Callable[[str], int]:
    """An argparse ``type``: torch threads, a whole number from ``low`` (0: leave torch's as is) to this machine's
    CPUs, as ``nasdiag search --threads``. ``at_least(1)`` took any: ``--threads 100000`` made libgomp allocate the
    stacks of 100000 threads at the first parallel op ("libgomp: Out of memory", exit code 1, the output folder left)
    and a few more than the cores stalled the run."""
    import os

    cpus = os.cpu_count() or 1

    def whole_number(text: str) -> int:
        value = at_least(low)(text)
        if value > cpus:
            raise argparse.ArgumentTypeError(f"{value} is more than the {cpus} CPUs of this machine (more threads than "
                                             f"cores stall a run); give at most {cpus}, or leave --threads out")
        return value

    whole_number.__name__ = f"threads from {low} to {cpus}"
    return whole_number


def supernet(build, device="cpu", dtype=None):
    """``build()``, a supernet sized by the script's ``--C`` and ``--layers``, refused in one line when its parameters
    and buffers alone outgrow ``device``'s memory, counted on the meta device first as ``nasdiag search`` counts it
    (which draws nothing from the random generators): ``--C 1000000`` was torch's "DefaultCPUAllocator: can't
    allocate memory" traceback, or with memory overcommitted the OOM killer."""
    import torch

    from nasdiag.search.runner import _check_tensors_fit

    _check_tensors_fit(build, "the supernet of --C and --layers", torch.device(device), dtype or torch.float32,
                       "use a smaller --C or --layers")
    return build()


def channels(text: str) -> int:
    """An argparse ``type``: the supernet's ``--C``, an even whole number >= 2 (``--C 3`` was the supernet's ValueError
    traceback, after the output folder was made)."""
    value = at_least(2)(text)
    if value % 2:
        raise argparse.ArgumentTypeError(f"must be even (FactorizedReduce halves it), not {value}")
    return value


def number(low: float = 0.0, high: float = float("inf"), low_open: bool = True, high_open: bool = True) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in the interval from ``low`` to ``high`` (open ends by default: rates,
    penalties, ratios). ``float`` took nan and inf (``--lam nan`` ran the whole compression and exited 0) and any
    sign (``--lr -1`` was torch's ValueError traceback)."""
    import math

    shown = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def finite_number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes a number, not {text!r}") from None
        inside = (low < value if low_open else low <= value) and (value < high if high_open else value <= high)
        if not math.isfinite(value) or not inside:
            raise argparse.ArgumentTypeError(f"must be a finite number in {shown}, not {text}")
        return value

    finite_number.__name__ = f"number in {shown}"
    return finite_number


def numbers(each: Callable[[str], float], empty: bool = False) -> Callable[[str], str]:
    """An argparse ``type``: comma-separated values, each checked by ``each`` (`number`, `at_least`); the text is
    kept as given. Empty (no value) only with ``empty``. A bad value was a traceback from the run (``abc``), an error
    naming another quantity than the option (``-1``), or an empty sweep that ran and exited 0."""

    def comma_separated(text: str) -> str:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items and not empty:
            raise argparse.ArgumentTypeError(f"names no value; give comma-separated values, not {text!r}")
        for item in items:
            try:
                each(item)
            except argparse.ArgumentTypeError as exc:
                raise argparse.ArgumentTypeError(f"{exc}{f' (in {text!r})' if len(items) > 1 else ''}") from None
        return text

    comma_separated.__name__ = "comma-separated list"
    return comma_separated


def dpi(text: str) -> int:
    """An argparse ``type``: a resolution the figures' smallest text renders at (``nasdiag plot --dpi``'s range)."""
    from nasdiag.plot.commands import positive_dpi

    return positive_dpi(text)


def names(allowed, what: str = "name") -> Callable[[str], str]:
    """An argparse ``type``: comma-separated names, each one of ``allowed`` (a benchmark's ``--sections``); the text is
    kept as given. An unknown name was skipped (``--sections bogus`` timed nothing and exited 0), an empty list ran
    nothing."""

    def comma_separated_names(text: str) -> str:
        given = [t.strip() for t in text.split(",") if t.strip()]
        unknown = [t for t in given if t not in allowed]
        if unknown or not given:
            raise argparse.ArgumentTypeError(f"{'unknown ' + what + ' ' + ', '.join(map(repr, unknown)) if unknown else 'names no ' + what}"
                                             f"; choose from {', '.join(allowed)}")
        return text

    comma_separated_names.__name__ = f"comma-separated {what}s"
    return comma_separated_names


def device(text: str) -> str:
    """An argparse ``type``: a torch device name (``cpu``, ``cuda``, ``cuda:1``) this machine has; a bad one was torch's
    traceback, and one it lacks (cuda:7, mps, cuda on a CPU machine) a traceback of torch's after the script's setup,
    meta one line after it."""
    import torch

    from nasdiag.search.runner import available_devices

    try:
        kind = torch.device(text).type
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"is not a device, such as cpu, cuda or cuda:1: {text!r}") from None
    available = [name for name in available_devices() if name != "auto"]
    if kind != "cpu" and text not in available:
        raise argparse.ArgumentTypeError(f"{text!r} is not available on this machine; use one of {', '.join(available)}")
    return text


def refuse_other_records(paths, method: str, option: str = "--out", plot_only: bool = False,
                         experiment: str = None) -> None:
    """Refuse in one line, before any work, a record path of the script that holds anything but a record the script
    wrote (``meta['method']`` is ``method``): the scripts write their records replacing what is there (``overwrite``,
    ``force``), which deleted a search's ``record.h5`` (every segment of it) or any file of that name without a word;
    with ``plot_only``, a redraw of another script's record (the folder of xnas_statistical given to xnas_toys) was a
    KeyError traceback. A nasdiag record that cannot be read (damaged) is refused with the reader's reason. With
    ``experiment``, a record of ``method`` is the script's own unless its ``meta['config']['experiment']`` names another
    one: the wiring scripts share their method, and wiring_output_cost --plot-only of wiring_variants' record said it
    "holds no evaluated epoch yet (a run stopped before its first evaluation...)", a run replaced it without a word."""
    import os

    from nasdiag.record import load_meta

    for path in paths:
        if not os.path.lexists(path):
            continue
        try:
            meta, why = load_meta(path), None
            found = meta.get("method")
        except (NasdiagError, OSError) as err:
            meta, found, why = {}, None, err
        if why is not None and _nasdiag_segment(path):  # a damaged record was "no nasdiag record", its damage unsaid
            why = " ".join(str(why).split())
            if plot_only:
                raise UsageError(f"{path} holds a nasdiag record that cannot be read, so --plot-only has nothing of it "
                                 f"to redraw: {why}")
            raise UsageError(f"{path} holds a nasdiag record that cannot be read, of a run the script cannot tell, and "
                             f"the run would replace it; give another {option}, or move it away ({why})")
        config = meta.get("config") if isinstance(meta.get("config"), dict) else {}
        if experiment is not None and found == method and config.get("experiment") not in (None, experiment):
            found = f"{config['experiment']!r} (method {method})"  # a record naming no experiment is taken as mine
        if found != method:
            what = f"a record of {found}" if found else "no nasdiag record"
            mine = f", experiment {experiment!r}" if experiment else ""
            if plot_only:
                raise UsageError(f"{path} holds {what}, not a record of this script (method {method}{mine}), so "
                                 f"--plot-only has nothing of it to redraw; give the {option} of a run of this script")
            raise UsageError(f"{path} holds {what}, not a record of this script (method {method}{mine}), and the run "
                             f"would replace it; give another {option}, or move it away")


def _nasdiag_segment(path) -> bool:
    """Whether ``path`` is an HDF5 file a nasdiag `Recorder` wrote (its root has ``schema_version``), readable or not."""
    try:
        import h5py

        with h5py.File(path, "r") as f:
            return "schema_version" in f.attrs
    except (OSError, ValueError):
        return False


def refuse_other_figures(folder: str, names, fmt: str, option: str = "--out") -> None:
    """Refuse in one line, before any work, an output folder holding a file of one of the script's figure ``names``
    (``fig3``, ...; None: the figures of nasdiag's registry) that nasdiag did not draw: the script replaced the user's
    own ``fig3.png`` without a word (``nasdiag plot`` and ``search`` refuse it since round 12)."""
    import os

    from nasdiag.plot.commands import foreign_figures
    from nasdiag.plot.registry import is_nasdiag_figure

    if names is None:
        foreign = [str(p) for p in foreign_figures(folder, fmt)]
    else:
        foreign = [p for p in (os.path.join(folder, f"{name}.{fmt}") for name in names)
                   if os.path.lexists(p) and not is_nasdiag_figure(p)]
    if foreign:
        shown = ", ".join(os.path.basename(p) for p in foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UsageError(f"{option} {folder} holds {shown}, named as a figure of this script but not drawn by nasdiag, which "
                         f"drawing would replace; move {'it' if len(foreign) == 1 else 'them'} away or give another {option}")


def refuse_other_tables(paths, written_here, option: str = "--out") -> None:
    """Refuse in one line, before any work, a file at one of the script's table paths (``fits.json``,
    ``curvature_accuracy.md``) that ``written_here(text)`` does not recognise as one the script wrote: the script
    replaced a user's own file of that name without a word, as it did their figures and records before round 14."""
    import os

    for path in paths:
        if not os.path.lexists(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                mine = written_here(f.read())
        except (OSError, ValueError):  # a folder, a link to nothing, bytes that are not text
            mine = False
        if not mine:
            raise UsageError(f"{option} {os.path.dirname(path) or '.'} holds {os.path.basename(path)}, named as a table "
                             f"this script writes but not written by it, which the run would replace; move it away or "
                             f"give another {option}")


#: the largest η L T (a learning rate, the reward bound, the steps) the batch scripts play: ln v of an EG forecaster
#: sums T steps of η R, which past float64's 1.8e308 was the forecaster's RegretError ("rewards this large are not losses
#: of a bounded scale L") after the output folder (and part of the record) was written
EG_LIMIT = 1e300


def refuse_overflowing_lr(option: str, given, lr: float, loss_bound: float, steps: int) -> None:
    """One line, before any work, where ``steps`` EG steps of ``lr`` times rewards of ``loss_bound`` could pass
    float64's range (`EG_LIMIT`): ``option`` ``given`` is named, with what to give instead."""
    if not lr * loss_bound * steps <= EG_LIMIT:
        raise UsageError(f"{option} {given} gives the forecasters a learning rate of {lr:.3g}, whose {steps} EG steps "
                         f"of rewards up to {loss_bound:.3g} (η L T = {lr * loss_bound * steps:.3g}) pass float64's range; "
                         f"give a smaller {option}")


def refuse_repeats(items, option: str) -> None:
    """One line for a comma-separated option naming something twice (``--configs minimal1,minimal1``): the run was
    made twice into the same folder, the second replacing the first, minutes spent for nothing without a word."""
    repeated = list(dict.fromkeys(item for item in items if list(items).count(item) > 1))
    if repeated:
        raise UsageError(f"{option} names {', '.join(repeated)} more than once; give each once")


def write_table(path, text: str, option: str = "--out") -> None:
    """Write ``text`` (a table: JSON, Markdown; UTF-8) to ``path`` as nasdiag writes its figures
    (`nasdiag.plot.registry.save`), through `write_file`: under a fresh hidden name next to it, flushed to disk and
    renamed over it, so no reader nor later run ever sees half a table; a ``path`` that is a symbolic link is written
    through (the file it names is replaced, the link stays). ``open(path, "w")`` emptied the table before writing it:
    Ctrl-C, a kill or a full disk while it was written left a truncated fits.json or summary.json (which
    ``--plot-only`` then refused), the earlier run's table lost, and a reader that had it open read the new one mixed
    in."""
    write_file(path, text.encode("utf-8"), "table", option)  # encoded first: a text that cannot be leaves the old one


def write_file(path, data: bytes, what: str = "file", option: str = "--out") -> None:
    """Write ``data`` to ``path`` under a fresh hidden name next to the file it replaces (``.<pid>.<random>.<name>.tmp``,
    created exclusively), flushed to disk (``os.fsync``) and renamed over it, as `nasdiag.plot.registry.save` writes a
    figure; a ``path`` that is a symbolic link is written through (the file it names is replaced, the link stays). The
    temporary lies next to the file replaced, so the rename never crosses file systems (``os.replace`` of a file made
    in another folder was "Invalid cross-device link" where the two are on different ones). A folder where no file
    can be written, or a full disk, is one `UsageError` line naming the ``what`` (``"table"``, ``"figure"``) and
    ``option``; the earlier file is kept and nothing of the new one is left behind."""
    import contextlib
    import os
    import secrets
    from pathlib import Path

    from nasdiag.record.lock import describe_os_error

    path = Path(path)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    stem = target.name if len(os.fsencode(target.name)) <= 200 else what
    tmp = target.with_name(f".{os.getpid()}.{secrets.token_hex(4)}.{stem}.tmp")
    try:
        fh = open(tmp, "xb")  # "x": never an existing file, nor one a link of that name points to
    except OSError as exc:
        through = f" (the file {path} links to)" if target != path else ""
        raise UsageError(f"cannot write the {what} {target}{through}: {describe_os_error(exc)} in {target.parent}; give "
                         f"another {option}, a folder where files can be written") from None
    try:
        with fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):  # a full disk: the earlier file is kept, the reason said in one line
            raise UsageError(f"cannot write the {what} {target}: {describe_os_error(exc)}; the earlier {target.name} is "
                             f"kept") from None
        raise
    _remove_stale_files(target.parent, stem)


def _remove_stale_files(folder, stem: str) -> None:
    """Remove the temporaries of `write_file` for the file ``stem`` in ``folder`` that a process killed mid-write left
    (``.<pid>.<random>.<stem>.tmp`` of a process no longer running); one of a run still writing is kept."""
    import contextlib
    import os
    import re

    pattern = re.compile(rf"\.([0-9]+)\.[0-9a-f]{{8}}\.{re.escape(stem)}\.tmp")
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        match = pattern.fullmatch(name)
        if match is None or int(match.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(match.group(1)), 0)
            continue  # running: its file is being written
        except ProcessLookupError:
            pass
        except (OSError, OverflowError):
            continue  # another user's process, or no such pid: not ours to judge
        with contextlib.suppress(OSError):
            if not os.path.islink(os.path.join(folder, name)) and os.path.isfile(os.path.join(folder, name)):
                os.unlink(os.path.join(folder, name))


def refuse_past_memory(need: int, what: str, fix: str, device: str = "cpu") -> None:
    """One line, before any work, where ``what`` takes ``need`` bytes, more than ``device``'s memory in all (physical
    memory for the CPU, as ``nasdiag search`` counts it for a supernet): a size the script allocates from its
    arguments was torch's "DefaultCPUAllocator: can't allocate memory" traceback (exit 1) once the run had begun, its
    record replaced by one of the points before, or where memory is overcommitted the OOM killer. Not refused where
    the memory cannot be told."""
    import torch

    from nasdiag.search.runner import _device_memory

    total = _device_memory(torch.device(device))
    if total is not None and need > total:
        raise UsageError(f"{what} takes at least {need / 2**30:,.1f} GiB, more than the {total / 2**30:,.1f} GiB of memory "
                         f"of this machine; {fix}")


@contextlib.contextmanager
def torch_threads(n):
    """torch's intra-op threads set to ``n`` for the block (None or 0: left as they are), then back to what they were,
    as ``nasdiag search --threads`` (`nasdiag.search.run`) does: a script's main() called in a session (a notebook, a
    test) left torch at the script's ``--threads`` for the rest of it (bayes_compression's default 1 always)."""
    import torch

    previous = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
