"""Round-19 docs audit: a new user follows README.md and docs/*.md literally, after rounds 17-19 changed them.

Found and fixed:

* docs/schema.md gave RecorderCallback's hooks as `on_epoch_end(epoch, stats=None, step=None)` and
  `on_exception(exc, stats=None, step=None)`: their parameter is `statistics` (and `step` keyword-only), so a loop
  written from the doc, `callback.on_epoch_end(epoch, stats=row)`, stopped in TypeError. The doc now gives the
  signatures the code has (test_every_keyword_the_docs_give_a_nasdiag_callable_is_one_of_its_parameters, which
  checks every `name(..., key=...)` of the docs' inline code against the signature of the nasdiag callable it names).
"""
import importlib
import inspect
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

# where the docs' unqualified names live (a class's methods are reached as Class.method or, when no other public
# callable of these modules has that name, as method alone)
MODULES = ["nasdiag", "nasdiag.probe", "nasdiag.cost", "nasdiag.hessian", "nasdiag.hessian.graphed", "nasdiag.regret",
           "nasdiag.record", "nasdiag.plot", "nasdiag.plot.style", "nasdiag.plot.registry", "nasdiag.search",
           "nasdiag.search.supernet", "nasdiag.supernet", "nasdiag.sparse", "nasdiag.bayes", "nasdiag.distributed"]


def documented_callables():
    """{name as the docs write it: [callables]}; a name with several callables is ambiguous and not checked."""
    found = {}

    def add(name, obj):
        if all(o is not obj for o in found.setdefault(name, [])):
            found[name].append(obj)

    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in dir(module):
            obj = getattr(module, name)
            if name.startswith("_") or not callable(obj) or not getattr(obj, "__module__", "").startswith("nasdiag"):
                continue
            add(name, obj)
            add(f"{module_name}.{name}", obj)
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if not attr.startswith("_") and inspect.isfunction(member):
                        add(attr, member)
                        add(f"{name}.{attr}", member)
    return found


def test_every_keyword_the_docs_give_a_nasdiag_callable_is_one_of_its_parameters():
    """`f(..., key=value)` in a doc's inline code, f a nasdiag function or method: key is one of f's parameters
    (or f takes **kwargs), so the call as written does not stop in TypeError. A user's own callable of the same
    name (`forward(x, weights, tau=1.0)` of a user's mixed op) resolves to nothing unique and is not checked."""
    callables = documented_callables()
    wrong, checked = [], 0
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"`([A-Za-z_][\w.]*)\(([^`]*)\)`", text):
            name, args = m.group(1), m.group(2)
            candidates = callables.get(name) or callables.get(name.lstrip("."), [])
            if len(candidates) != 1:
                continue
            try:
                params = inspect.signature(candidates[0]).parameters
            except (TypeError, ValueError):
                continue
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                continue
            for key in re.findall(r"(?:^|[,(]\s*)(\w+)\s*=(?!=)", args):
                checked += 1
                if key not in params:
                    line = text.count("\n", 0, m.start()) + 1
                    wrong.append(f"{doc.name}:{line}: `{name}(..., {key}=...)` but {name}{inspect.signature(candidates[0])}")
    assert checked > 20, "the docs' inline calls were not found: the pattern above no longer matches them"
    assert not wrong, "\n".join(wrong)
