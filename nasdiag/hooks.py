"""Scoped hooks: the one place where nasdiag registers module and tensor hooks.

Modelled on Captum's ``captum/_utils/gradient.py``: hooks are registered through one helper, collected,
and removed together in ``finally`` on every exit path, so a model is untouched outside a ``with`` block
(``torch.func`` then works on it as on any plain module).

    hooks = Hooks()
    hooks.forward_pre(module, fn, with_kwargs=True)   # planned: nothing is on the model yet
    hooks.forward(module, fn)
    with hooks:                                       # installed here ...
        out = model(x)
        hooks.tensor(out, grad_fn)                    # (tensor hooks are added while installed)
        out.sum().backward()
    # ... and removed here, also when the body raised

A plan can be entered again and again: the probe builds one per model and enters it at every step.

Why a private fast path. The probe hooks ~10 modules per edge (over 1000 on the DARTS supernet) at every
step; a ``RemovableHandle`` and its weak references per hook per step allocate enough to trigger Python's
garbage collector over the model's large object graph (a measured 3-4 % of a CPU step). So, on the torch
releases whose ``nn.Module`` keeps its hooks in the dicts checked by :func:`fast_path_available`, a plan
writes its hooks straight into those dicts (the very dicts ``register_forward_hook`` fills, so
``nn.Module.__call__`` runs them the same way) under negative integer keys, which never collide with a
handle's id (torch counts those up from 0). Integers, not unique ``object()``s: ``torch.compile`` of
torch 2.11 reads a module's hook dict keys as constants and stops in an internal assertion on an ``object()``. On any other torch release it uses the public ``register_forward_hook`` /
``register_forward_pre_hook``. Tensor hooks always use the public ``Tensor.register_hook``.
"""

from __future__ import annotations

import itertools
import re
from typing import Callable, List, Optional, Tuple

import torch
from torch import nn

__all__ = ["Hooks", "fast_path_available", "has_module_hooks"]

#: torch releases (major, minor) whose ``nn.Module`` hook dicts the fast path writes (checked in tests/test_hooks.py)
FAST_PATH_TORCH = ((2, 0), (2, 14))
_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")


def _torch_release(version: str) -> Optional[Tuple[int, int]]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def fast_path_available(version: Optional[str] = None) -> bool:
    """True when torch ``version`` (default: the installed one) is a release the fast path was checked on
    and ``nn.Module`` stores its hooks in the dicts the fast path writes (a registered hook's id is a key)."""
    release = _torch_release(torch.__version__ if version is None else version)
    if release is None or not FAST_PATH_TORCH[0] <= release <= FAST_PATH_TORCH[1]:
        return False
    module = nn.Module()
    if not all(isinstance(getattr(module, name, None), dict) for name in _DICTS):
        return False
    handle = module.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True)
    try:
        return handle.id in module._forward_pre_hooks and handle.id in module._forward_pre_hooks_with_kwargs
    finally:
        handle.remove()


_FAST = fast_path_available()
_KEYS = itertools.count(-1, -1)  # fast-path hook keys: -1, -2, ...; a RemovableHandle's id is >= 0


def has_module_hooks(modules) -> bool:
    """Whether any of ``modules`` (or torch's global registry) carries forward or backward hooks: a forward that
    batches those modules' work, or a CUDA graph that would replay it without running Python, would skip them."""
    from torch.nn.modules import module as _m

    if _m._global_forward_hooks or _m._global_forward_pre_hooks or _m._global_backward_hooks \
            or getattr(_m, "_global_backward_pre_hooks", None):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks for m in modules)


class Hooks:
    """Forward and forward-pre hooks planned on modules, installed and removed together, plus tensor hooks
    added while installed. Use as a context manager (see the module docstring); :meth:`remove` runs on
    every exit path. A hook added while the plan is installed is installed at once.

    Args:
        fast: write hooks straight into the modules' hook dicts (see the module docstring). Default: where
            :func:`fast_path_available`; False always uses the public ``register_*`` APIs.
    """

    def __init__(self, fast: Optional[bool] = None):
        self.fast = _FAST if fast is None else bool(fast) and _FAST
        # Fast path: (hook dict, key, fn, kwargs-flag dict or None), keys made once at planning, so that
        # installing and removing at every step allocates nothing. Public path: (module, kind, fn, with_kwargs).
        self._planned: List[tuple] = []
        self._handles: list = []  # public path: RemovableHandles of the installed module hooks
        self._tensor_handles: list = []
        self.installed = False

    # -- planning --------------------------------------------------------------------------------
    def forward(self, module: nn.Module, fn: Callable) -> None:
        """``fn(module, args, output)`` after ``module``'s forward (a non-None return replaces the output)."""
        self._plan(module, "forward", fn, False)

    def forward_pre(self, module: nn.Module, fn: Callable, with_kwargs: bool = False, prepend: bool = False) -> None:
        """``fn(module, args)`` (``fn(module, args, kwargs)`` with ``with_kwargs``) before ``module``'s forward;
        a non-None return replaces the arguments. ``prepend``: run before the module's pre-hooks installed earlier
        (an argument substitution that hooks already in place, e.g. a probe's, must see)."""
        self._plan(module, "forward_pre", fn, bool(with_kwargs), bool(prepend))

    def tensor(self, tensor: torch.Tensor, fn: Callable) -> None:
        """``fn(grad)`` when the gradient of ``tensor`` is computed; only while installed, removed with the plan."""
        if not self.installed:
            raise RuntimeError("Hooks.tensor() adds a hook for the current block only; call it inside `with hooks:`")
        self._tensor_handles.append(tensor.register_hook(fn))

    def node(self, node, fn: Callable) -> None:
        """``fn(grad_inputs, grad_outputs)`` after the autograd node ``node`` runs (``Node.register_hook``); only
        while installed, removed with the plan."""
        if not self.installed:
            raise RuntimeError("Hooks.node() adds a hook for the current block only; call it inside `with hooks:`")
        self._tensor_handles.append(node.register_hook(fn))

    def _plan(self, module: nn.Module, kind: str, fn: Callable, with_kwargs: bool, prepend: bool = False) -> None:
        if self.fast:
            hooks = module._forward_hooks if kind == "forward" else module._forward_pre_hooks
            flags = module._forward_pre_hooks_with_kwargs if with_kwargs else None
            entry = (hooks, next(_KEYS), fn, flags, prepend)  # < 0: never a RemovableHandle id
        else:
            entry = (module, kind, fn, with_kwargs, prepend)
        self._planned.append(entry)
        if self.installed:
            self._install((entry,))

    # -- installing --------------------------------------------------------------------------------
    def install(self) -> None:
        """Put every planned hook on its module. On failure, whatever was placed is removed again."""
        if self.installed:
            raise RuntimeError("these hooks are already installed (nested use of one Hooks plan)")
        self.installed = True
        try:
            self._install(self._planned)
        except BaseException:
            self.remove()
            raise

    def _install(self, entries) -> None:
        if self.fast:
            for hooks, key, fn, flags, prepend in entries:
                hooks[key] = fn
                if prepend:
                    hooks.move_to_end(key, last=False)
                if flags is not None:
                    flags[key] = True
            return
        for module, kind, fn, with_kwargs, prepend in entries:
            if kind == "forward":
                self._handles.append(module.register_forward_hook(fn))
            else:
                self._handles.append(module.register_forward_pre_hook(fn, with_kwargs=with_kwargs, prepend=prepend))

    def remove(self) -> None:
        """Take every module and tensor hook of this plan off again (the plan itself is kept)."""
        if self.fast:
            for hooks, key, _, flags, _ in reversed(self._planned):
                hooks.pop(key, None)
                if flags is not None:
                    flags.pop(key, None)
        for handle in self._handles + self._tensor_handles:
            handle.remove()
        self._handles.clear()
        self._tensor_handles.clear()
        self.installed = False

    def __enter__(self) -> "Hooks":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __len__(self) -> int:
        """Number of planned module hooks."""
        return len(self._planned)
