"""The registry of search methods: ``@register("name")`` on a `SearchMethod` subclass.

Built-in methods live one per file in ``nasdiag/search/methods/`` and are imported the first time the
registry is read, so adding a method is adding a file. A method defined anywhere else (a script, a
notebook, a test) registers itself the same way when its module is imported.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, Dict, Type

from nasdiag.errors import ConfigError

_METHODS: Dict[str, type] = {}
_BUILTINS_LOADED = False


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make a `SearchMethod` subclass available as ``name`` to `run` and the CLI."""
    from nasdiag.search.base import SearchMethod
    from nasdiag.search.hyperparameters import Hyperparameters

    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"method name {name!r} must be letters, digits, '_' or '-'")

    def decorate(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, SearchMethod)):
            raise TypeError(f"@register({name!r}) decorates SearchMethod subclasses, got {cls!r}")
        hp_cls = getattr(cls, "Hyperparameters", None)
        if not (isinstance(hp_cls, type) and issubclass(hp_cls, Hyperparameters)):
            raise TypeError(f"method {name!r} needs a nested dataclass `Hyperparameters(nasdiag.search.Hyperparameters)`")
        if not cls.__module__.startswith("nasdiag.search.methods."):
            # the built-ins first: a method of the user's registered under a built-in's name before they were loaded
            # was taken, and the next get_method() stopped in the built-in's own registration (its ValueError), with
            # the built-ins after it in the folder never loaded ("unknown method 'darts'")
            _load_builtins()
        previous = _METHODS.get(name)
        # the same class defined again (a notebook cell run twice, a module imported under another name) replaces
        # itself; a built-in only by its own module: a user's class that happens to be named DARTS took 'darts' silently
        builtin = previous is not None and previous.__module__.startswith("nasdiag.search.methods.")
        if previous is not None and (previous.__qualname__ != cls.__qualname__
                                     or (builtin and previous.__module__ != cls.__module__)):
            raise ValueError(f"a different method is already registered as {name!r}: {previous.__module__}.{previous.__qualname__}")
        cls.name = name
        _METHODS[name] = cls
        return cls

    return decorate


def _load_builtins() -> None:
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    import nasdiag.search.methods as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{pkg.__name__}.{info.name}")


def available_methods() -> Dict[str, Type]:
    """``{name: method class}`` of every registered method, built-ins first."""
    _load_builtins()
    return dict(_METHODS)


def get_method(name: str) -> Type:
    """The method class registered as ``name``; an unknown name raises `ConfigError` listing the known ones."""
    available = available_methods()
    if name not in available:
        raise ConfigError(f"unknown method {name!r}; available: {', '.join(sorted(available))}")
    return available[name]
