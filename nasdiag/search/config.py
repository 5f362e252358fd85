"""`SearchConfig`: everything that defines a search, validated with one-line `ConfigError`s.

The CLI maps its arguments onto this dataclass and calls `nasdiag.search.run`; scripts and notebooks
build it directly. Importing this module imports neither torch nor h5py, so ``nasdiag --help`` stays
fast.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

from nasdiag.errors import ConfigError

DATASETS = ("digits", "cifar10", "synthetic")
DTYPES = ("float32", "float64")
#: op stacking orders and normalizations of `nasdiag.supernet.Network` (a test checks they agree)
ORDERS = ("relu-conv-bn", "conv-bn-relu", "conv-relu-bn")
NORMS = ("batch", "layer", "instance")
DIAGNOSTICS = ("cost", "hessian")
ENGINES = ("auto", "fast", "eager")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?|mps)$")

#: the fields whose values define the run: a resume must match them (plus the DDP world size)
RUN_DEFINING = ("method", "hp", "dataset", "data_dir", "C", "layers", "steps", "multiplier", "order", "norm", "seed",
                "batch_size", "dtype")

#: the fields that decide what is recorded (which families, in which curvature mode, how often): a resume
#: must keep them too, or the record's rows would mix them; they are compared with the stored config
RECORD_DEFINING = ("diagnostics", "hessian_mode", "spectrum_every")


#: the most Hessian-vector products per edge of ``hutchinson:<k>``: from k = K (ops per edge) on, ``exact`` is
#: cheaper and exact; docs/hessian.md tabulates k up to 16, and a k past this only exhausts time or memory
MAX_HUTCHINSON_PROBES = 1024


#: the largest seed: the batch order seeds torch with ``(seed + 1) * 100_003 + epoch``, which must fit 64 bits
MAX_SEED = 10 ** 14 - 1
#: the largest supernet shape: a cell of ``steps`` nodes has steps·(steps+3)/2 edges of K ops each (DARTS searches
#: with 4 steps and 8 layers); past these, building it takes gigabytes of small modules and minutes, and
#: ``--steps 1000`` or ``--layers 100000`` filled the machine's memory instead of failing
MAX_STEPS, MAX_LAYERS = 32, 512


def check_probe_count(mode, what: str) -> None:
    """Refuse ``hutchinson:<k>`` with k above `MAX_HUTCHINSON_PROBES` (``what`` names the option)."""
    if not isinstance(mode, str) or not mode.startswith("hutchinson:"):
        return
    from nasdiag.hessian.modes import split_mode

    _, k = split_mode(mode)
    if k is not None and k > MAX_HUTCHINSON_PROBES:
        raise ConfigError(f"{what} {mode!r} asks for {k} Hessian-vector products per edge; give at most "
                          f"hutchinson:{MAX_HUTCHINSON_PROBES}, or exact (exact and cheaper from k = the ops per edge on)")


def default_threads() -> int:
    """Torch intra-op threads when ``threads`` is not given: the CPUs this process may use, at most 4,
    divided among the processes of a torchrun launch on this host (``LOCAL_WORLD_SIZE``). More threads
    than cores, or several searches each taking every core, stall on a small shared machine."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - macOS
        cpus = os.cpu_count() or 1
    text = os.environ.get("LOCAL_WORLD_SIZE", "1") or "1"
    try:
        local = max(1, int(text))
    except ValueError:  # a traceback before
        raise ConfigError(f"environment variable LOCAL_WORLD_SIZE={text!r} is not an integer (torchrun sets it to the "
                          "processes on this host); unset it, or pass --threads N") from None
    return max(1, min(cpus // local, 4))


@dataclass
class SearchConfig:
    """A whole search.

    Attributes:
        method: a registered method name (``nasdiag methods`` lists them).
        hp: hyperparameter overrides ``{key: value}`` (values may be strings), parsed by the method's
            ``Hyperparameters.from_dict``. With ``dataset="digits"`` a method's ``digits_preset`` fills
            the keys not given here.
        dataset, data_dir: ``digits`` (embedded), ``cifar10`` (``data_dir`` = folder of the python
            batches) or ``synthetic``.
        C, layers, steps, multiplier, order, norm: the supernet (`nasdiag.supernet.Network`);
            ``multiplier`` None means ``steps``.
        epochs, batch_size, seed: ``batch_size`` is per DDP rank; ``seed`` from 0 to `MAX_SEED`.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: ``float32`` or ``float64``.
        diagnostics: recorded once per epoch: ``cost`` (cost statistics), ``hessian`` (mixing-weight
            Hessian diagonal in ``hessian_mode``, default ``diag``: C.3.1, which tells the ops of an edge apart,
            where ``approx``'s C.3.2 gives every op that ends in an affine-free BatchNorm one value); empty = none.
        spectrum_every: every k steps record ``hessian/<cell>/top_eigenvalue`` and the joint
            ``hessian/top_eigenvalue`` over every cell type's α (0 = never).
        record: the HDF5 record path (None: no record, no checkpoint).
        resume: continue the run recorded at ``record`` (same run-defining fields; ``epochs`` may grow).
        force: replace an existing record (refused while another process writes it).
        figures: folder for figures drawn at the end (None: none).
        engine: ``auto``, ``fast`` or ``eager`` supernet execution (``Network.set_engine``).
        threads: torch intra-op threads (None: `default_threads`).
        progress: a progress bar on rank 0.
    """

    method: str = "darts"
    hp: Dict[str, Any] = field(default_factory=dict)
    dataset: str = "digits"
    data_dir: Optional[str] = None
    C: int = 8
    layers: int = 3
    steps: int = 4
    multiplier: Optional[int] = None
    order: str = "relu-conv-bn"
    norm: str = "batch"
    epochs: int = 8
    batch_size: int = 64
    seed: int = 0
    device: str = "auto"
    dtype: str = "float32"
    diagnostics: Tuple[str, ...] = DIAGNOSTICS
    hessian_mode: str = "diag"
    spectrum_every: int = 0
    record: Optional[str] = None
    resume: bool = False
    force: bool = False
    figures: Optional[str] = None
    engine: str = "auto"
    threads: Optional[int] = None
    progress: bool = True

    def __post_init__(self):
        if isinstance(self.diagnostics, str):
            self.diagnostics = tuple(d.strip() for d in self.diagnostics.split(",") if d.strip() and d.strip() != "none")
        if isinstance(self.diagnostics, (list, tuple, set, frozenset)):  # anything else is refused by validate()
            # once each: "cost,cost" records what "cost" does, and a resume given "cost" was refused as another setting
            self.diagnostics = tuple(dict.fromkeys(self.diagnostics)) if all(
                isinstance(d, str) for d in self.diagnostics) else tuple(self.diagnostics)
        if isinstance(self.hp, Mapping):  # a string or None is refused by validate(), not dict()'s traceback
            self.hp = dict(self.hp)

    # -- derived -----------------------------------------------------------------------------------------
    @property
    def cell_multiplier(self) -> int:
        return self.steps if self.multiplier is None else self.multiplier

    @property
    def checkpoint(self) -> Optional[str]:
        """The checkpoint next to the record (``<record>.ckpt``; a record named through a symbolic link: next to the
        file it points to, with its segments and lock, so that every name of the record finds it)."""
        if self.record is None:
            return None
        record = os.fspath(self.record)
        return (os.path.realpath(record) if os.path.islink(record) else record) + ".ckpt"

    # -- validation ------------------------------------------------------------------------------------
    def validate(self) -> "SearchConfig":
        """Check every field that needs no data or device; raises a one-line `ConfigError`."""
        _choice("dataset", self.dataset, DATASETS)
        _choice("dtype", self.dtype, DTYPES)
        _choice("order", self.order, ORDERS, what="op stacking order")
        _choice("norm", self.norm, NORMS)
        _choice("engine", self.engine, ENGINES)
        if not isinstance(self.hp, Mapping):
            raise ConfigError(f"hp must be a mapping of hyperparameter overrides such as {{'w_lr': 0.1}}, got "
                              f"{type(self.hp).__name__} {self.hp!r}")
        if not isinstance(self.diagnostics, tuple):
            raise ConfigError(f"diagnostics must be a sequence of {', '.join(DIAGNOSTICS)} (or a comma-separated string), "
                              f"got {self.diagnostics!r}")
        for name in ("resume", "force", "progress"):  # force="no" is truthy: it would replace a record
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("record", "figures", "data_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ConfigError(f"{name} must be a path (str or os.PathLike) or None, got {type(value).__name__} {value!r}")
        from nasdiag.hessian.modes import ARCH_MODES, CurvatureError, check_mode  # spelled once, by the curvature engine

        try:
            check_mode(self.hessian_mode, ARCH_MODES, what="hessian_mode")
        except CurvatureError as e:  # one message, also for a counted mode without its count ("hutchinson")
            raise ConfigError(str(e)) from None
        check_probe_count(self.hessian_mode, "hessian_mode")
        for d in self.diagnostics:
            _choice("diagnostics", d, DIAGNOSTICS)
        if self.hessian_mode != SearchConfig.hessian_mode and "hessian" not in self.diagnostics:
            raise ConfigError(no_hessian_recorded(self.hessian_mode, self.diagnostics))
        for name, low in (("epochs", 1), ("batch_size", 1), ("seed", 0), ("C", 2), ("steps", 1), ("spectrum_every", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.seed > MAX_SEED:  # run() stopped in torch's "Overflow when unpacking long long" ValueError traceback
            raise ConfigError(f"seed {self.seed} is too large: give a seed from 0 to at most {MAX_SEED}")
        if self.C % 2:
            raise ConfigError(f"C must be even (FactorizedReduce halves it), got {self.C}")
        if self.steps > MAX_STEPS:
            raise ConfigError(f"steps {self.steps} is too large: a cell of {self.steps} nodes has "
                              f"{self.steps * (self.steps + 3) // 2} edges of every op; give at most {MAX_STEPS} "
                              "(DARTS: 4)")
        if isinstance(self.layers, int) and not isinstance(self.layers, bool) and self.layers > MAX_LAYERS:
            raise ConfigError(f"layers {self.layers} is too large: give at most {MAX_LAYERS} cells (DARTS searches with 8)")
        if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 3:
            raise ConfigError(f"layers must be >= 3, got {self.layers!r}: with fewer, every cell is a reduction cell "
                              "(reductions sit at layers//3 and 2*layers//3) and the normal cell would be empty")
        m = self.cell_multiplier
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= self.steps:
            raise ConfigError(f"multiplier must be an integer in [1, steps={self.steps}], got {m!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1):
            raise ConfigError(f"threads must be an integer >= 1, got {self.threads!r}")
        if self.threads is not None and self.threads > (os.cpu_count() or 1):  # 100000 exhausted memory in thread stacks
            raise ConfigError(f"threads {self.threads} is more than the {os.cpu_count() or 1} CPUs of this machine (more threads "
                              f"than cores stall a search); give at most {os.cpu_count() or 1}, or leave --threads out")
        if not isinstance(self.device, str) or not _DEVICE.match(self.device):
            folded = self.device.strip().lower() if isinstance(self.device, str) else ""
            hint = f" did you mean {folded!r}?" if _DEVICE.match(folded) else ""
            raise ConfigError(f"unknown device {self.device!r};{hint} use auto, cpu, cuda or cuda:N")
        if self.dataset == "cifar10" and not self.data_dir:
            raise ConfigError("dataset cifar10 needs data_dir (--data-dir) pointing at the folder of the CIFAR-10 python batches")
        if self.dataset != "cifar10" and self.data_dir:
            raise ConfigError(f"data_dir (--data-dir) is only used with dataset cifar10, not {self.dataset!r}")
        if self.resume and self.force:
            raise ConfigError("resume and force contradict each other; pass only one")
        if (self.resume or self.force) and self.record is None:
            raise ConfigError("resume and force need a record path (--out)")
        return self

    # -- serialisation ---------------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """Plain JSON-serialisable dict of every field (tuples as lists)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else (dict(value) if isinstance(value, dict) else value)
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "SearchConfig":
        """Inverse of `to_dict`; unknown keys raise `ConfigError`."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown SearchConfig field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**dict(values))

    def run_defining(self, hp: Optional[Mapping[str, Any]] = None, world_size: int = 1) -> Dict[str, Any]:
        """The values that define the run: a resumed run must have the same. ``hp``: the effective
        hyperparameters (default: the overrides as given). ``data_dir`` is the folder's resolved path
        (`os.path.realpath`), so that the same folder named from elsewhere is the same run, and another
        folder under the same relative name is not."""
        values = {k: getattr(self, k) for k in RUN_DEFINING}
        values["hp"] = dict(self.hp if hp is None else hp)
        values["multiplier"] = self.cell_multiplier
        if self.data_dir:  # the folder itself: as typed, a resume from another folder was refused for the same data
            values["data_dir"] = os.path.realpath(os.fspath(self.data_dir))  # and ran on other data under its name
        values["world_size"] = int(world_size)
        return json.loads(json.dumps(values, sort_keys=True, default=str))

    def record_defining(self) -> Dict[str, Any]:
        """The `RECORD_DEFINING` values, as stored in a record's config (diagnostics sorted: their order means nothing)."""
        return {k: sorted(getattr(self, k)) if k == "diagnostics" else getattr(self, k) for k in RECORD_DEFINING}

    def config_hash(self, hp: Optional[Mapping[str, Any]] = None, world_size: int = 1) -> str:
        """sha256 (hex, 16 digits) of `run_defining`."""
        text = json.dumps(self.run_defining(hp, world_size), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def differing_fields(given: Mapping[str, Any], stored: Mapping[str, Any]) -> Dict[str, Tuple[Any, Any]]:
    """``{field: (given, stored)}`` for the run-defining fields that differ (hp compared key by key)."""
    out: Dict[str, Tuple[Any, Any]] = {}
    for key in sorted(set(given) | set(stored)):
        a, b = given.get(key), stored.get(key)
        if key == "data_dir" and isinstance(a, str) and isinstance(b, str) and os.path.realpath(b) == a:
            continue  # a record written before data_dir was stored resolved: the folder as typed, here, is the same
        if key == "hp" and isinstance(a, Mapping) and isinstance(b, Mapping):
            for k in sorted(set(a) | set(b)):
                if a.get(k) != b.get(k):
                    out[f"hp.{k}"] = (a.get(k), b.get(k))
        elif a != b:
            out[key] = (a, b)
    return out


def no_hessian_recorded(mode: str, diagnostics) -> str:
    """The message for a curvature mode that would do nothing: the diagnostics do not record the Hessian."""
    shown = ",".join(diagnostics) or "none"
    return (f"hessian_mode {mode!r} has no effect: diagnostics {shown!r} do not record the Hessian; add hessian to the "
            "diagnostics (--diagnostics cost,hessian) or drop the mode")


def near_miss(value, choices) -> Optional[str]:
    """The choice that ``value`` most likely meant: the same name in another case or with ``-`` for ``_``
    (``DARTS``, ``w-lr``), else the closest spelling (difflib, ``dart`` -> ``darts``); None if nothing is close."""
    if not isinstance(value, str) or not value.strip():
        return None
    fold = {str(c).lower().replace("-", "_"): c for c in choices}
    text = value.strip().lower().replace("-", "_")
    if text in fold:
        return fold[text]
    import difflib

    close = difflib.get_close_matches(text, list(fold), n=1, cutoff=0.75)  # not 'png' for 'jpg'
    return fold[close[0]] if close else None


def did_you_mean(value, choices) -> str:
    """`` did you mean 'x'?`` for the near miss of ``value`` among ``choices`` (a leading space), or ''."""
    meant = near_miss(value, choices)
    return "" if meant is None else f" did you mean {meant!r}?"


#: dashes and minus signs that a document or word processor writes for the ASCII hyphen-minus (``—epochs`` for
#: ``--epochs``, ``3e−4`` for ``3e-4``): each looks like it, and no option or number reads it
TYPOGRAPHIC_DASHES = "\u2010\u2011\u2012\u2013\u2014\u2015\u2212\ufe58\ufe63\uff0d"


def typographic_dash(text) -> str:
    """``'—epochs' holds '—' (EM DASH), ...; type --epochs`` for a ``text`` holding a dash that is not the ASCII
    hyphen-minus (copied from a rendered page or a word processor), else ''."""
    found = next((c for c in text if c in TYPOGRAPHIC_DASHES), None) if isinstance(text, str) else None
    if found is None:
        return ""
    import unicodedata

    rest = text.lstrip(TYPOGRAPHIC_DASHES)
    fixed = (f"--{rest}" if text[0] in TYPOGRAPHIC_DASHES and rest[:1].isalpha() else
             "".join("-" if c in TYPOGRAPHIC_DASHES else c for c in text))
    return (f"{text!r} holds {found!r} ({unicodedata.name(found, 'a dash').lower()}), which a document or word processor "
            f"writes for the hyphen-minus - of a keyboard; type {fixed}")


#: quotation marks that a rendered page or word processor writes for ASCII quotes; a shell keeps them in the word
TYPOGRAPHIC_QUOTES = "\u201c\u201d\u201e\u2018\u2019\u201a\u00ab\u00bb\u2039\u203a"


def typographic_quotes(text) -> str:
    """``'“run.h5”' is in typographic quotes, ...; type run.h5`` for a ``text`` that begins or ends with one (copied
    from a rendered page: the shell removes only ASCII quotes, so they became part of a file name), else ''."""
    if not isinstance(text, str) or not text or (text[0] not in TYPOGRAPHIC_QUOTES and text[-1] not in TYPOGRAPHIC_QUOTES):
        return ""
    return (f"{text!r} is in typographic quotes ({text[0] if text[0] in TYPOGRAPHIC_QUOTES else text[-1]}), which a "
            f"document or word processor writes and a shell keeps as part of the word (it removes only ASCII ' and \"); "
            f"type {text.strip(TYPOGRAPHIC_QUOTES) or 'the value'} without them, or in ASCII quotes")


def _choice(name: str, value, allowed, what: Optional[str] = None) -> None:
    if value not in allowed:
        hint = did_you_mean(value, allowed)
        raise ConfigError(f"unknown {what or name} {value!r};{hint or ''} choose one of {', '.join(allowed)}")
