"""Import hygiene: the layers of CONTRIBUTING.md ("Layers") hold for every import statement, and importing a
layer loads nothing above it. Each runtime check runs in a fresh interpreter (a subprocess), since this
test process has imported everything already.

The layer rule checker reads every ``nasdiag/**/*.py`` (AST, no import) and checks each import statement
against the table below: module-level imports against ``FORBIDDEN`` and ``NOT_AT_IMPORT_TIME``, imports
inside functions (lazy) against ``FORBIDDEN`` only (a lazy import is fine where the direction is allowed)."""

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "nasdiag"

# Shared foundations every layer may import; they import only each other.
BASE = {"nasdiag", "errors", "vocabulary", "edges", "hooks", "arrays", "rules", "distributed", "cuda_graphs"}
PRIMITIVES = {"cost", "hessian", "regret", "sparse"}
ABOVE_PRIMITIVES = {"probe", "search", "record", "plot", "cli", "__main__"}

# layer -> layers (and third-party packages) it must not import, at any level (CONTRIBUTING.md, "Layers")
FORBIDDEN = {
    "supernet": ABOVE_PRIMITIVES,
    "data": ABOVE_PRIMITIVES,
    # primitives are maths on bare tensors; the supernet registers its own per-op rules
    **{p: ABOVE_PRIMITIVES | {"supernet", "data"} for p in PRIMITIVES},
    "probe": {"search", "record", "plot", "cli", "__main__"},
    "search": {"cli", "__main__", "h5py"},
    "record": {"supernet", "probe", "search", "cost", "hessian", "regret", "sparse", "plot", "cli", "__main__"},
    "plot": {"probe", "search", "cost", "hessian", "regret", "sparse", "cli", "__main__"},
    **{b: (ABOVE_PRIMITIVES | PRIMITIVES | {"supernet", "data"}) for b in BASE},
}
# layer -> what it may import lazily (inside a function) but not when it is imported itself
NOT_AT_IMPORT_TIME = {"search": {"record", "plot", "matplotlib", "seaborn"}}
# Documented exceptions, (importing layer, imported module): why the direction is fine.
ALLOWED = {
    ("plot", "nasdiag.supernet"): "edge order and genotype rule (pure functions of record arrays), imported lazily",
}


def _layer(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root).parts
    return parts[0][:-3] if len(parts) == 1 else parts[0]


def _targets(node, path: pathlib.Path, root: pathlib.Path):
    """Qualified module names an import statement loads (``from nasdiag import x`` -> ``nasdiag.x``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:  # relative: resolve against the file's package
        base = list(path.relative_to(root.parent).with_suffix("").parts)[: -node.level]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    if module == "nasdiag":
        return [f"nasdiag.{a.name}" for a in node.names]
    return [module]


def _imports(path: pathlib.Path, root: pathlib.Path):
    """(qualified module, line, lazy) for every import statement; lazy = inside a function."""
    found = []

    def visit(node, lazy):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((t, child.lineno, lazy) for t in _targets(child, path, root))
            visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def _target_layer(module: str):
    parts = module.split(".")
    if parts[0] != "nasdiag":
        return parts[0]  # a third-party package
    return parts[1] if len(parts) > 1 else "nasdiag"


def layer_violations(root: pathlib.Path = PACKAGE):
    out = []
    for path in sorted(root.rglob("*.py")):
        layer = _layer(path, root)
        for module, line, lazy in _imports(path, root):
            target = _target_layer(module)
            if target == layer or (layer, ".".join(module.split(".")[:2])) in ALLOWED:
                continue
            banned = FORBIDDEN.get(layer, set()) | (set() if lazy else NOT_AT_IMPORT_TIME.get(layer, set()))
            if target in banned:
                where = "inside a function" if lazy else "at import time"
                out.append(f"{path.relative_to(root.parent)}:{line}: {layer} imports {module} {where}")
    return out


def test_every_import_statement_follows_the_layer_table():
    assert layer_violations() == []


def test_the_checker_catches_a_wrong_direction(tmp_path):
    # an independent check of the checker: a fake tree with one allowed and three forbidden imports
    pkg = tmp_path / "nasdiag"
    (pkg / "cost").mkdir(parents=True)
    (pkg / "search").mkdir()
    (pkg / "cost" / "bad.py").write_text("import nasdiag.probe\nfrom nasdiag import errors\n")
    (pkg / "search" / "lazy.py").write_text(
        "def f():\n    from nasdiag.record import load\n    import nasdiag.cli\nfrom ..record import writer\n")
    got = layer_violations(pkg)
    assert got == [
        "nasdiag/cost/bad.py:1: cost imports nasdiag.probe at import time",
        "nasdiag/search/lazy.py:3: search imports nasdiag.cli inside a function",
        "nasdiag/search/lazy.py:4: search imports nasdiag.record at import time",
    ]


def loaded_after(statement: str, importtime: bool = False):
    """Modules in ``sys.modules`` after ``statement`` in a fresh interpreter (or, with ``importtime``, the
    modules ``python -X importtime`` reports)."""
    code = f"{statement}\nimport sys\nprint('\\n'.join(sys.modules))"
    args = [sys.executable] + (["-X", "importtime"] if importtime else []) + ["-c", code]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=PACKAGE.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if importtime:
        return {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return set(proc.stdout.split())


def _tops(modules):
    return {m.split(".")[0] for m in modules} | {".".join(m.split(".")[:2]) for m in modules if m.startswith("nasdiag.")}


def test_importing_nasdiag_search_loads_no_h5py_nor_matplotlib():
    loaded = _tops(loaded_after("import nasdiag.search", importtime=True))
    assert not loaded & {"h5py", "matplotlib", "seaborn"}
    # nor does importing every module of the search layer (the methods, the run) at once
    every = ("import importlib, pkgutil, nasdiag.search as s\n"
             "for m in pkgutil.walk_packages(s.__path__, 'nasdiag.search.'): importlib.import_module(m.name)")
    loaded = _tops(loaded_after(every))
    assert not loaded & {"h5py", "matplotlib", "seaborn", "nasdiag.record", "nasdiag.plot", "nasdiag.cli"}


@pytest.mark.parametrize("layer", ["cost", "hessian", "regret"])
def test_a_primitive_loads_no_layer_above_it_nor_the_supernet(layer):
    loaded = _tops(loaded_after(f"import nasdiag.{layer}"))
    above = {f"nasdiag.{m}" for m in ("probe", "search", "record", "plot", "cli", "supernet", "data")}
    assert not loaded & above, sorted(loaded & above)


def test_importing_nasdiag_stays_cheap():
    loaded = _tops(loaded_after("import nasdiag"))
    assert not loaded & {"torch", "numpy", "h5py", "matplotlib"}


# --- record layer and DDP reduction -----------------------------------------------------------------


def test_distributed_reduction_loads_neither_h5py_nor_the_record_layer():
    for statement in ("import nasdiag.distributed", "import nasdiag.arrays"):
        loaded = _tops(loaded_after(statement, importtime=True))
        assert not loaded & {"h5py", "torch", "nasdiag.record"}, (statement, sorted(loaded & {"h5py", "torch", "nasdiag.record"}))


def test_only_layers_above_the_record_import_it():
    importers = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = _layer(path, PACKAGE)
        if layer != "record" and any(_target_layer(m) == "record" for m, _, _ in _imports(path, PACKAGE)):
            importers.add(layer)
    assert importers <= {"search", "plot", "cli", "__main__"}, sorted(importers)
    # and the record layer imports the reduction only lazily (no import cycle at load time)
    for path in sorted((PACKAGE / "record").glob("*.py")):
        eager = [m for m, _, lazy in _imports(path, PACKAGE) if not lazy and _target_layer(m) == "distributed"]
        assert eager == [], (path.name, eager)


def test_record_layer_uses_no_private_attribute_of_another_object():
    """Couplings go through public APIs (Recorder.add_flush_listener, Recorder.writing, ...)."""
    files = sorted((PACKAGE / "record").glob("*.py")) + [PACKAGE / "distributed.py", PACKAGE / "arrays.py"]
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_fault_injection_harness_is_not_in_the_package():
    assert not list(PACKAGE.rglob("crashtest*.py"))
    assert (PACKAGE.parent / "scripts" / "record_kill_trials.py").exists()
