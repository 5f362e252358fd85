"""nasdiag.hooks: hooks exist only inside the block, on every exit path, on both the fast and the public
path; the model works with torch.func afterwards; the fast path is used only on checked torch releases."""

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad

from nasdiag.hooks import Hooks, fast_path_available

from conftest import assert_no_module_hooks

PATHS = [pytest.param(True, id="fast"), pytest.param(False, id="public")]


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def planned(model, seen, fast):
    hooks = Hooks(fast=fast)
    hooks.forward_pre(model[0], lambda m, args: seen.append("pre"))
    hooks.forward(model[2], lambda m, args, out: seen.append("post"))
    # replaces the argument: doubles the input of the last layer, so the effect is visible in the output
    hooks.forward_pre(model[2], lambda m, args, kwargs: ((2 * args[0],), kwargs), with_kwargs=True)
    return hooks


@pytest.mark.parametrize("fast", PATHS)
def test_hooks_run_inside_the_block_and_are_gone_after_it(fast):
    model, seen = small_model(), []
    x = torch.randn(5, 3, dtype=torch.float64)
    hooks = planned(model, seen, fast)
    assert hooks.fast == fast
    expected = model[2](2 * model[1](model[0](x)))  # the forward with the argument-replacing pre-hook
    with hooks:
        out = model(x)
        grads = []
        hooks.tensor(out, lambda g: grads.append(g))
        out.sum().backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert seen == ["pre", "post"] and len(grads) == 1
    assert_no_module_hooks(model)
    assert not out._backward_hooks
    model(x)  # nothing runs outside the block
    assert seen == ["pre", "post"]
    with hooks:  # a plan can be entered again
        model(x)
    assert seen == ["pre", "post", "pre", "post"]
    assert_no_module_hooks(model)


@pytest.mark.parametrize("fast", PATHS)
def test_hooks_are_removed_when_the_body_raises_and_torch_func_works_after(fast):
    model, seen = small_model(), []
    x = torch.randn(5, 3, dtype=torch.float64)
    hooks = planned(model, seen, fast)
    assert hooks.fast == fast
    with pytest.raises(RuntimeError, match="boom"):
        with hooks:
            out = model(x)
            hooks.tensor(out, lambda g: g)
            raise RuntimeError("boom")
    assert_no_module_hooks(model)
    assert not out._backward_hooks
    # torch.func on the model after the block equals autograd on a plain copy
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = grad(lambda p: functional_call(model, p, (x,)).square().sum())(params)
    model.zero_grad()
    model(x).square().sum().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(g[k], p.grad, rtol=1e-12, atol=1e-14)


def test_hooks_added_while_installed_go_on_at_once_and_nesting_is_refused():
    model, seen = small_model(), []
    hooks = Hooks()
    with hooks:
        hooks.forward(model[1], lambda m, a, o: seen.append("late"))
        model(torch.randn(2, 3, dtype=torch.float64))
        with pytest.raises(RuntimeError, match="already installed"):
            hooks.install()
    assert seen == ["late"]
    assert_no_module_hooks(model)
    with pytest.raises(RuntimeError, match="inside"):
        hooks.tensor(torch.zeros(1, requires_grad=True), lambda g: g)


def test_fast_path_only_on_checked_torch_releases():
    assert fast_path_available()  # the installed torch (2.11-2.14) is a checked release
    for version in ("2.99.0", "3.0.0", "1.13.1", "nightly"):
        assert not fast_path_available(version), version
    assert fast_path_available("2.14.0+cu126")


def test_no_module_outside_nasdiag_hooks_registers_hooks():
    # One hook installer: every register_*hook call and every write into torch's private hook dicts
    # lives in nasdiag/hooks.py (reading the dicts, e.g. to detect foreign hooks, is fine).
    import ast
    import pathlib

    import nasdiag

    root = pathlib.Path(nasdiag.__file__).parent
    registering = {"register_hook", "register_forward_hook", "register_forward_pre_hook",
                   "register_full_backward_hook", "register_full_backward_pre_hook"}
    private = {"_forward_hooks", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
               "_backward_pre_hooks", "_forward_hooks_with_kwargs"}
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "hooks.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in registering:
                found.append(f"{path.relative_to(root)}:{node.lineno} calls {node.func.attr}")
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in targets:
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and t.value.attr in private:
                    found.append(f"{path.relative_to(root)}:{node.lineno} writes {t.value.attr}")
    assert found == []
