"""Typed, documented hyperparameters of a search method.

Each method declares ``class Hyperparameters(nasdiag.search.Hyperparameters)`` as a dataclass whose
defaults are the paper's values and whose fields carry a docstring-like ``help`` in their metadata::

    @dataclass
    class Hyperparameters(Hyperparameters):
        alpha_lr: float = hp(3e-4, "Adam learning rate of α (DARTS §3, CIFAR-10 setting).", low=0)

The CLI's ``--hp key=value`` strings are parsed against the field types; an unknown key or a bad value
raises a one-line `ConfigError` that lists the valid keys. Every check runs when the hyperparameters are
built, before a search writes anything: a float must be finite, a tuple has the length of its default and
each of its elements lies in the field's range, and a floor ``<name>_min`` may not exceed its start value
``<name>`` or ``<name>0`` (``w_lr_min <= w_lr``, ``tau_min <= tau0``): a schedule would rise instead of decay.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

from nasdiag.errors import ConfigError


def hp(default: Any, help: str, *, low: Optional[float] = None, high: Optional[float] = None,
       low_open: bool = False, high_open: bool = False, choices: Optional[Tuple] = None, steps: bool = False,
       float64: bool = False):
    """A hyperparameter field: its default (the paper's), one sentence of help saying where the
    default comes from, and an optional range (``low``/``high`` inclusive unless ``low_open``/``high_open``;
    for a tuple, the range of each element, and the tuple keeps the default's length) or ``choices``.
    ``steps=True`` marks a number of steps: more than the run has would never act (`check_steps`).
    ``float64=True`` marks a number the method holds in float64 whatever the run's dtype (XNAS's forecasters): a search
    does not refuse a positive value that the run's float32 would round to 0 (it refuses one of any other field)."""
    meta = {"help": help, "low": low, "high": high, "low_open": low_open, "high_open": high_open, "choices": choices,
            "length": len(default) if isinstance(default, tuple) else None, "steps": steps, "float64": float64}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Hyperparameters:
    """Base of every method's hyperparameters (no fields of its own)."""

    def __post_init__(self):
        self._ints_as_floats()
        self.validate()

    def _ints_as_floats(self) -> None:
        """A Python int given for a float field (or a tuple element of one) becomes that float: ``alpha_betas=(0,
        0.999)`` was kept as given and stopped the method's build in torch.optim.Adam's "betas must be either both
        floats or both Tensors" ValueError. Ints past the float range are left for `validate` to refuse."""
        hints = typing.get_type_hints(type(self))
        for f in self.fields():
            value, tp = getattr(self, f.name), hints[f.name]
            if typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp):
                tp = next(a for a in typing.get_args(tp) if a is not type(None))
            if tp is float and _plain_int(value):
                setattr(self, f.name, float(value))
            elif typing.get_origin(tp) in (tuple, typing.Tuple) and set(typing.get_args(tp)) <= {float, Ellipsis} \
                    and isinstance(value, tuple) and any(_plain_int(e) for e in value):
                setattr(self, f.name, tuple(float(e) if _plain_int(e) else e for e in value))

    # -- introspection ---------------------------------------------------------------------------
    @classmethod
    def fields(cls) -> Tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)

    @classmethod
    def keys(cls) -> Tuple[str, ...]:
        return tuple(f.name for f in cls.fields())

    @classmethod
    def describe(cls) -> str:
        """One line per field: ``name: type = default  help`` and, where declared, its range (``[0, 1)``,
        ``at most the run's steps``), so a refused value can be looked up."""
        hints = typing.get_type_hints(cls)
        lines = []
        for f in cls.fields():
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"{f.name}: {_type_name(hints[f.name])} = {default!r}  {f.metadata.get('help', '')}"
                         f"{_range_text(f.metadata)}")
        return "\n".join(lines)

    def to_dict(self) -> Dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in self.fields()}

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: Mapping[str, Any], method: str = "") -> "Hyperparameters":
        """Build from a mapping of (possibly string) values; unknown keys and bad values raise `ConfigError`."""
        hints = typing.get_type_hints(cls)
        known = cls.keys()
        kwargs = {}
        for key, value in values.items():
            if key not in known:
                from nasdiag.search.config import did_you_mean

                raise ConfigError(
                    f"unknown hyperparameter {key!r}{' for method ' + repr(method) if method else ''};"
                    f"{did_you_mean(key, known) or _of_other_methods(key, method)} valid keys: {', '.join(known) or '(none)'}"
                )
            kwargs[key] = _coerce(key, value, hints[key], method)
        return cls(**kwargs)

    @classmethod
    def parse(cls, items: Iterable[str], method: str = "") -> "Hyperparameters":
        """Parse ``["key=value", ...]`` (the CLI's ``--hp``)."""
        values = {}
        for item in items:
            key, sep, value = str(item).partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"--hp expects key=value, got {item!r}; valid keys: {', '.join(cls.keys()) or '(none)'}")
            values[key.strip()] = value.strip()
        return cls.from_dict(values, method)

    def replace(self, **changes) -> "Hyperparameters":
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        """Check every field against its declared range/choices/length, and every floor against its start
        value (see the module docstring); raises `ConfigError`."""
        hints = typing.get_type_hints(type(self))
        for f in self.fields():
            value = getattr(self, f.name)
            m = f.metadata
            _check_type(f.name, value, hints[f.name])
            if m.get("choices") is not None and value not in m["choices"]:
                placeholders = [re.sub(r"<[^>]+>", "4", str(c)) for c in m["choices"] if "<" in str(c)]
                hint = f" (a choice with <...> takes a number there, e.g. {placeholders[0]!r})" if placeholders else ""
                from nasdiag.search.config import near_miss

                meant = near_miss(value, m["choices"])
                hint += f"; did you mean {meant!r}?" if meant is not None and "<" not in str(meant) else ""
                raise ConfigError(f"hyperparameter {f.name}={value!r} is not one of {list(m['choices'])}{hint}")
            if isinstance(value, tuple):
                length = m.get("length")
                if length is not None and len(value) != length:
                    default = ",".join(map(str, f.default))
                    raise ConfigError(f"hyperparameter {f.name}={_plain_text(value)} has {len(value)} value(s), it needs "
                                      f"{length}: give them comma-separated, e.g. {f.name}={default}")
                for element in value:
                    _check_number(f.name, element, m, shown=_plain_text(value))
            else:
                _check_number(f.name, value, m)
        self._check_floors()

    def check_steps(self, total: int, how: str = "") -> None:
        """Refuse a field declared ``hp(..., steps=True)`` (a number of steps between actions) above the run's
        ``total`` steps: the action would never happen. ``how`` says how ``total`` comes about."""
        for f in self.fields():
            value = getattr(self, f.name)
            if f.metadata.get("steps") and _is_number(value) and value > total:
                raise ConfigError(f"hyperparameter {f.name}={value!r} is more than the run's {total} steps{how}, so it would "
                                  f"never act; give {f.name} <= {total} (see nasdiag methods)")

    def _check_floors(self) -> None:
        """A floor ``<name>_min`` above its start value ``<name>`` (or ``<name>0``) would make a schedule rise."""
        values = {f.name: getattr(self, f.name) for f in self.fields()}
        for name, floor in values.items():
            if not name.endswith("_min") or not _is_number(floor):
                continue
            stem = name[: -len("_min")]
            start_key = next((k for k in (stem, stem + "0") if _is_number(values.get(k))), None)
            if start_key is not None and floor > values[start_key]:
                raise ConfigError(f"hyperparameter {name}={floor!r} is above {start_key}={values[start_key]!r}: the "
                                  f"schedule would rise instead of decay; give {name} <= {start_key}")


def _of_other_methods(key: str, method: str) -> str:
    """`` it is a hyperparameter of xnas (--method xnas), not of darts;`` for a ``key`` that other registered methods
    take (``--hp reward_bound=1`` without ``--method xnas``: the line listed darts's keys, not the method forgotten), or
    ''. Only for a named ``method`` (a search's)."""
    if not method:
        return ""
    from nasdiag.search.registry import available_methods

    others = [name for name, cls in available_methods().items() if name != method and key in cls.Hyperparameters.keys()]
    if not others:
        return ""
    choose = f"--method {others[0]}" if len(others) == 1 else "choose one with --method"
    return f" it is a hyperparameter of {', '.join(others)} ({choose}), not of {method};"


def _range_text(meta: Mapping) -> str:
    """`` (range [0, 1))``, `` (range > 0)``, `` (at most the run's steps)`` of a field, or ''."""
    low, high = meta.get("low"), meta.get("high")
    parts = []
    if low is not None and high is not None:
        parts.append(f"range {'(' if meta.get('low_open') else '['}{low:g}, {high:g}{')' if meta.get('high_open') else ']'}")
    elif low is not None:
        parts.append(f"range {'>' if meta.get('low_open') else '>='} {low:g}")
    elif high is not None:
        parts.append(f"range {'<' if meta.get('high_open') else '<='} {high:g}")
    if meta.get("steps"):
        parts.append("at most the run's steps")
    return f" ({'; '.join(parts)})" if parts else ""


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _plain_text(value: tuple) -> str:
    return ",".join(map(str, value))


def _check_number(name: str, value, meta: Mapping, shown: Optional[str] = None) -> None:
    """``value`` (a field, or one element of a tuple field shown as ``shown``) against the field's range."""
    if not _is_number(value):
        return
    if isinstance(value, int) and _beyond_float(value):  # a Python int past 1.8e308: accepted, then an OverflowError
        raise ConfigError(f"hyperparameter {name} is {_huge(value)}, beyond what a float holds (1.8e308); give a finite "
                          "value nearer its default (nasdiag methods lists them)")
    what = f"{name}={shown if shown is not None else repr(value)}"
    element = "" if shown is None else f" (element {value!r})"
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"hyperparameter {what} is not a finite number{element}; give a finite value")
    low, high = meta.get("low"), meta.get("high")
    if low is not None and (value < low or (meta.get("low_open") and value == low)):
        op = ">" if meta.get("low_open") else ">="
        raise ConfigError(f"hyperparameter {what} is out of range{element}; {'each value' if element else 'it'} must be {op} {low}")
    if high is not None and (value > high or (meta.get("high_open") and value == high)):
        op = "<" if meta.get("high_open") else "<="
        raise ConfigError(f"hyperparameter {what} is out of range{element}; {'each value' if element else 'it'} must be {op} {high}")


def _plain_int(value) -> bool:
    """An int (not a bool) that a float holds."""
    return isinstance(value, int) and not isinstance(value, bool) and not _beyond_float(value)


def _beyond_float(value: int) -> bool:
    try:
        float(value)
    except OverflowError:
        return True
    return False


def _huge(value: int) -> str:
    """An int too large for a float, in a few characters (its repr runs to hundreds of digits, and past 4300 digits
    str() itself refuses it)."""
    exponent = int(math.log10(abs(value)))
    mantissa = abs(value) / 10 ** exponent  # int / int is correctly rounded, whatever their size
    if round(mantissa, 2) >= 10:  # log10 rounded up past a power of ten, or 9.999 shown as 10.00
        exponent, mantissa = exponent + 1, mantissa / 10
    return f"{'-' if value < 0 else ''}{mantissa:.2f}e{exponent} (an integer)"


def _check_type(name: str, value, tp) -> None:
    """The declared type, strictly (a Python caller's ``"false"`` for a bool is not False; ``from_dict`` converts
    strings first): bool is bool, int an int, float an int or float, a tuple a tuple of its element type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union and type(None) in args:
        if value is None:
            return
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (tuple, typing.Tuple):
        ok = isinstance(value, tuple)
        if ok:
            inner = args[0] if args else float
            for element in value:
                _check_type(name, element, inner)
            return
    elif tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif isinstance(tp, type):
        ok = isinstance(value, tp)
    else:
        return
    if not ok:
        wanted = {bool: "True or False", int: "an int", float: "a number", str: "a string"}.get(tp, "a tuple" if origin else _type_name(tp))
        raise ConfigError(f"hyperparameter {name} must be {wanted}, got {value!r} ({type(value).__name__})")


def _type_name(tp) -> str:
    """The type as ``nasdiag methods`` shows it: ``float``, ``float or None`` (an Optional), ``(float, float)`` (a tuple,
    given comma-separated). typing's ``__name__`` of these was a bare ``Optional`` or ``Tuple``: no element type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        return " or ".join("None" if a is type(None) else _type_name(a) for a in args)
    if origin in (tuple, typing.Tuple) and args:
        return f"({', '.join('...' if a is Ellipsis else _type_name(a) for a in args)})"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _plain(value):
    if isinstance(value, tuple):
        return list(value)
    return value


def _unquoted(text: str) -> str:
    """``text`` without one pair of matching ASCII quotes around it: ``nasdiag methods`` prints a string default as its
    repr (``optimizer: str = 'adamhapg'``), and ``--hp "optimizer='adamhapg'"`` copied from it kept the quotes, so the
    value was refused as "not one of ['hapg', 'adamhapg']; did you mean 'adamhapg'?", the very text typed (a tuple
    default copied as printed, ``(0.5, 0.999)``, and ``None`` were accepted)."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _coerce(key: str, value: Any, tp, method: str):
    where = f" of method {method!r}" if method else ""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union and type(None) in args:  # Optional[X]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            if not isinstance(value, str):
                return int(value)
            try:  # decimal first: int('010', 0) is a ValueError, so a zero-padded 010 was "must be of type int"
                return int(value)
            except ValueError:
                return int(value, 0)  # 0x10, 0o7, 0b11
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, int) and _beyond_float(value):  # float() raised OverflowError, a traceback
                raise ConfigError(f"hyperparameter {key}{where} is {_huge(value)}, beyond what a float holds (1.8e308); "
                                  "give a finite value nearer its default (nasdiag methods lists them)")
            return float(value)
        if tp is str:
            return _unquoted(str(value))
        if origin in (tuple, typing.Tuple):
            parts = value if isinstance(value, (list, tuple)) else [p for p in str(value).strip("()[] ").split(",") if p.strip()]
            inner = args[0] if args else float
            try:
                return tuple(_coerce(key, p, inner, method) for p in parts)
            except ConfigError:  # "alpha_betas ... must be of type float, got '0.5 0.999'": a tuple is no float
                if not isinstance(value, str):
                    raise
                from nasdiag.search.config import typographic_dash, typographic_quotes

                raise ConfigError(f"hyperparameter {key}{where} must be of type {_type_name(tp)}, got {value!r}; "
                                  f"{typographic_quotes(value) or typographic_dash(value) or 'give its values separated by commas, as nasdiag methods shows its default'}") from None
    except ConfigError:  # a ValueError too: said as it is
        raise
    except (TypeError, ValueError):
        from nasdiag.search.config import typographic_dash, typographic_quotes

        # 3e−4 (a minus sign), “0.1” (quotes a shell keeps): "must be of type float, got '3e−4'", a float to the eye
        dash = typographic_quotes(value) or typographic_dash(value)
        raise ConfigError(f"hyperparameter {key}{where} must be of type {_type_name(tp)}, got {value!r}"
                          f"{'; ' + dash if dash else ''}") from None
    return value
