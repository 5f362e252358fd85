"""Round-19 docs audit: a new user follows README.md and docs/*.md literally, after rounds 17-19 changed them.

Found and fixed:

* docs/schema.md gave RecorderCallback's hooks as `on_epoch_end(epoch, stats=None, step=None)` and
  `on_exception(exc, stats=None, step=None)`: their parameter is `statistics` (and `step` keyword-only), so a loop
  written from the doc, `callback.on_epoch_end(epoch, stats=row)`, stopped in TypeError. The doc now gives the
  signatures the code has (test_every_keyword_the_docs_give_a_nasdiag_callable_is_one_of_its_parameters, which
  checks every `name(..., key=...)` of the docs' inline code against the signature of the nasdiag callable it names).
* docs/bayesnas.md said `python scripts/bayes_compression.py --out DIR` (seed 0, defaults) prunes 8-16-256-32 to
  8-13-61-24 at 0.958 test accuracy (λ = 1e-3: 7-10-45-23 at 0.905), as did the script's docstring. Run as written
  (torch 2.13, CPU, one thread, deterministic run to run) it gives 8-13-58-5 at 0.176: after 5 iterations 8-15-74-21
  at 0.914, then the 6th prunes fc2 to 5 neurons (λ = 1e-3: 7-9-44-15 at 0.791; λ = 1e-4 is as stated,
  8-16-109-31 at 0.967). The commit that wrote those numbers (9094bae) gives 8-13-58-3 at 0.100 here, so they came
  from another build: the last iterations' pruning turns on the last bits. The doc states what the script gives and
  that the final row is fragile (test_the_bayes_compression_result_the_doc_states_is_what_the_script_prints).
* docs/figures.md said `--dpi` must be positive; `nasdiag plot --dpi 10` is refused (15 to 1200, as --help says),
  while write_figures takes any positive dpi. The doc states both
  (test_the_dpi_range_docs_figures_states_is_the_one_nasdiag_plot_takes).

Checked and right (run literally in a fresh folder, torch 2.13 CPU): README's quickstart (8 epochs: prints the
genotype, writes runs/darts.h5 with steps 1-88, 88 rows of losses/accuracies/arch, 8 of cost and hessian, 15 figures
in runs/darts-figs; meta's threads present and not in config, and every meta key docs/schema.md lists), its costs,
regret and records blocks (shapes as commented; per-sample costs sum to the batch costs exactly), docs/figures.md's
four commands on that record (the _init/_final/_step40 pdfs; runs/*.h5 with README's runs/mine.h5: one folder each
and compare/), docs/schema.md's and docs/probe.md's blocks, docs/methods.md's toy module and its `methods toy`
command line, docs/hessian.md's first block; `nasdiag search --help`/`plot --help`/`report --help` against every
flag the docs give, every script flag the docs give against the script's parser, every repository path, dotted
nasdiag name, test name, record path (against the vocabulary) and quoted section title the docs cite; the
docs' `--figures` groups; EigenvalueEarlyStop against an own transcription of DARTS-ES (rollback epoch, windows
fed every 2 epochs, negative means, NaN refused); diag_hessian exact against autograd's dense Hessian (1e-17) and
GraphedDiagHessian equal to diag_hessian on the CPU, as docs/hessian.md says; MAX_METHOD_SEED = 2^64 - 7920.

Left alone: a fresh quickstart run writes runs/darts.seg0001.h5 beside runs/darts.h5 (its cost paths first come
after the first flush, as docs/schema.md says); README's "after a resume a record is several files" does not say a
first run can be too (judgement, wording). docs/figures.md's `nasdiag plot runs/*.h5` also matches that segment,
which the command reads as part of its record in one line. README's curvature block (hessian_eigenvalues) and
docs/hessian.md's alpha_diag_hessian blocks took minutes on this loaded box: slow, not wrong (round 16 noted it).
The long paper scripts (sparsenas_digits, asmnas_stability, xnas_statistical, curvature_accuracy) were not run.
"""
import importlib
import inspect
import pathlib
import re

import pytest

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


@pytest.mark.slow
def test_the_bayes_compression_result_the_doc_states_is_what_the_script_prints(tmp_path, capsys):
    """docs/bayesnas.md states what `python scripts/bayes_compression.py --out DIR` gives at its defaults (seed 0):
    the pruned architecture and its test accuracy. Runs the script as written (6 s of one CPU thread) and compares
    what it prints with the doc's numbers. Before round 19 the doc (and the script's docstring) said 8-13-61-24 at
    0.958; the script gives 8-13-58-5 at 0.176 here, at every commit tried since the one that wrote those numbers.
    That default λ (3e-4) pruned fc2 below 10 neurons; it is 1e-4 since (8-16-109-31 at 0.967). Skipped off torch 2.13
    CPU, the build the doc names (torch 2.11 on the GPU host gave 8-10-16-27 at 3e-4)."""
    import importlib.util

    import torch

    if not (torch.__version__.startswith("2.13.") and torch.version.cuda is None):
        pytest.skip(f"the doc states the result on torch 2.13 CPU; its last pruning steps depend on the last bits of the "
                    f"training, which differ on torch {torch.__version__}")
    text = (ROOT / "docs" / "bayesnas.md").read_text()
    stated = re.search(r"`python scripts/bayes_compression\.py --out DIR`.*?Seed 0.*?8-16-256-32 → \*\*([\d-]+)\*\*"
                       r".*? at ([\d.]+) test accuracy", text, re.S)
    assert stated, "docs/bayesnas.md no longer states the script's result in the form this test reads"
    path = ROOT / "scripts" / "bayes_compression.py"
    spec = importlib.util.spec_from_file_location("bayes_compression_docs19", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--out", str(tmp_path)]) == 0
    printed = re.search(r"8-16-256-32 -> ([\d-]+), test accuracy ([\d.]+)", capsys.readouterr().out)
    assert printed.group(1) == stated.group(1)
    assert abs(float(printed.group(2)) - float(stated.group(2))) <= 0.0005 + 1e-12  # the doc rounds to 3 decimals


def test_the_dpi_range_docs_figures_states_is_the_one_nasdiag_plot_takes():
    """docs/figures.md said `--dpi` must be positive; `nasdiag plot --dpi 10` is refused (below 15 the smallest text
    is under a pixel), as `--help` says ("15 to 1200"). The doc states the range; checked at both ends, through the
    command's own parser (nothing drawn)."""
    from nasdiag.cli import _parse
    from nasdiag.errors import NasdiagError

    stated = re.search(r"`--dpi` must be (\d+) to (\d+)", (ROOT / "docs" / "figures.md").read_text())
    assert stated, "docs/figures.md does not state the range of --dpi"
    low, high = int(stated.group(1)), int(stated.group(2))

    def takes(dpi):
        try:
            return _parse(["plot", "run.h5", "--out", "figs", "--dpi", str(dpi)]).dpi == dpi
        except (SystemExit, NasdiagError):
            return False

    assert takes(low) and takes(high) and not takes(low - 1) and not takes(high + 1)
