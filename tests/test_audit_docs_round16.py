"""Round-16 docs audit: a new user runs README.md and docs/*.md top to bottom, every block literally, in one folder.

Round 8 (tests/test_audit_docs_round8.py) runs every ```python block of each file in its own session; it does not
see what a user sees who runs the files *in order in one folder*, the shell blocks included, and it does not
check what the commands print or write against the text. Here:

* README.md's quickstart (`nasdiag search ... --out runs/darts.h5`, 8 epochs) is followed by "the same search
  from Python", which wrote to the same `runs/darts.h5`: `run()` refused it ("a record already exists at
  runs/darts.h5; pass --resume to continue it or --force to replace it"), so the README's second block failed for
  everyone who ran the first. It now writes a record of its own (test_the_readme_python_search_after_the_quickstart
  _writes_a_record_of_its_own).
* docs/figures.md's third command drew `--at init,final,120` from `runs/*.h5`; the README's main job (8 epochs of
  11 steps) ends at step 87, and a step after a record's last is refused (exit 2, "give steps up to 87"). It now
  names a step of the main job (test_the_figures_doc_plot_commands_run_on_the_readme_main_jobs_record, which also
  checks the `_init`/`_final`/`_step<N>` file names and the format the text promises).
* docs/hessian.md's `alpha_diag_hessian(net, ...)  # {"alphas_normal": (E, K), ...}` is of the file's own
  `Network(..., layers=2)`, whose two cells are both reduction cells: the call returns `alphas_reduce` alone.
  The comment (and docs/spectrum.md's "joint over alphas_normal and alphas_reduce", of the same net) now say so
  (test_the_hessian_doc_names_the_alpha_keys_its_own_net_has).
* docs/methods.md: the toy method "once the module that defines it is imported" ran as `nasdiag search --method toy`;
  no shell can import a module into that process, which says "unknown method 'toy'". The doc now gives a command
  that imports it first (test_the_methods_doc_command_line_for_a_method_of_ones_own_works_from_a_shell).
* docs/figures.md wrote `write_figures(record, out)` / `write_report(record, ...)` beside `write_comparison({label:
  load(path)}, out)`: both read a record file, and a loaded record stopped in pathlib's TypeError traceback. The doc
  says `record_path`; nasdiag/plot/registry.py and report.py refuse a loaded record in one PlotError line (also a
  TypeError), nothing written (test_a_loaded_record_given_to_a_function_that_reads_a_record_file_is_one_line);
  paths given to write_comparison, which takes loaded records, were "string indices must be integers": one line
  too (test_record_paths_given_to_write_comparison_which_takes_loaded_records_are_one_line); write_figures's
  `figures="cost,hessian"` was read letter by letter ("unknown figure(s) c, o, s, t, ...") after making the folder
  (test_write_figures_takes_figure_names_as_the_command_line_does_and_an_unknown_one_makes_no_folder); their
  dpi=0 was matplotlib's ValueError traceback after the folder was made
  (test_a_dpi_that_is_not_a_positive_number_is_one_plot_error_line_before_any_folder).
* docs/figures.md's "add a figure" module (re-registering the shipped `attention`, "a second registration of a name
  is refused") imported before anything read the figure registry was accepted, and every later read (`registered()`,
  `write_figures`, `nasdiag plot` in that process) stopped in the built-in attention.py's ValueError. The registry
  (nasdiag/plot/registry.py) now loads the built-ins before a user's registration, as the search registry does
  (test_the_figures_doc_module_registering_a_built_in_name_first_is_refused_and_the_built_ins_still_load).

Checked and right (no change): the README's curvature, regret and records blocks and docs/probe.md's loop print
the shapes their comments give (the round-3 test checks them; rerun here by hand); every equation number cited
in the public docstrings of nasdiag/cost (wiring supplement §2, §2.1, §2.2, §4-§6, Thm. 1/2, Cor. 1.2, eq. 12,
eq. 16, §8.1-8.2), nasdiag/regret (XNAS eq 1-6, 18-21, 23-32, 35, 37, 54-55, Lemma 1/2, Theorem 1, Algorithm 1
lines 2/8/9-12, §3.2.1-2, §8.2-8.5, §10) and nasdiag/hessian (bayesnas-appendix C.1.2-C.1.5, C.2.1-C.2.5,
C.3.1-C.3.2, A.1.6b, A.3.2) names what the paper's text copy says there; docs/sparsenas.md's and docs/darts2.md's
sparse-supernet eq 1-13 and DARTS eq 7-8, docs/bayesnas.md's B.0.2-B.0.5; every dotted `nasdiag.*` name, repository
path, script option, figure file name, record path and method hyperparameter default the docs cite exists as cited;
docs/figures.md's "add a figure" module, saved as a module under another name, draws both of its figures.

Left alone: the BayesNAS mixing-weight formula H = E(Σ B_i² H_j) is cited as C.3.1 throughout (docs, docstrings, the
vocabulary); in the text copy it is the unnumbered line just before (C.3.1), whose number sits on the recursion
H_i = Σ_o w² H_j of the same step (one display in the PDF, it seems), and the papers' README maps §C.3 to C.3.1-C.3.2.
Slow blocks are not defects: README's hessian_eigenvalues (28 Lanczos HVPs) took 50-80 s, docs/spectrum.md's blocks
over 10 min, on this shared 2-core box.
"""
import glob
import math
import os
import pathlib
import re
import shlex

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FIGURES_DOC = ROOT / "docs" / "figures.md"


def fenced(path, lang):
    """The ```<lang> blocks of a markdown file, in order."""
    return re.findall(rf"^```{lang}[^\n]*\n(.*?)^```", path.read_text(), re.S | re.M)


def quickstart_argv():
    """The README's quickstart search, as argv after ``nasdiag`` (the first shell block that runs a search)."""
    line = next(l for b in fenced(README, "bash") for l in b.splitlines() if "nasdiag search" in l)
    argv = shlex.split(line.split("nasdiag", 1)[1])
    assert argv[0] == "search"
    return argv


def option(argv, name):
    return argv[argv.index(name) + 1]


def test_the_readme_python_search_after_the_quickstart_writes_a_record_of_its_own(tmp_path, monkeypatch):
    """The quickstart leaves a record at its --out; the README's Python search block, run next in the same folder,
    must not be refused for it. Runs the block as written with `run` replaced by the run's own path check (the
    search itself is a minute of CPU), after putting a record where the quickstart puts one."""
    import nasdiag.search
    from nasdiag.record import Recorder
    from nasdiag.search.runner import check_paths

    monkeypatch.chdir(tmp_path)
    out = option(quickstart_argv(), "--out")
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    with Recorder(out, meta={"method": "darts"}) as rec:  # what the quickstart leaves (its rows do not matter here)
        rec.log(0, {"scalars/train_loss": 1.0})
    pathlib.Path(out).with_name(pathlib.Path(out).stem + "-figs").mkdir()  # and its default figure folder

    seen = []

    class Result:
        genotype = evaluation = record = figures = None

    def run(config):
        config = config.validate()
        check_paths(config)  # what run() refuses before any work: an existing record, a folder it may not draw in
        seen.append(config)
        return Result()

    monkeypatch.setattr(nasdiag.search, "run", run)
    block = next(b for b in fenced(README, "python") if "run(SearchConfig(" in b)
    exec(compile(block, "README.md", "exec"), {"__name__": "__main__"})
    assert len(seen) == 1 and seen[0].record is not None
    assert pathlib.Path(seen[0].record).resolve() != pathlib.Path(out).resolve()


def test_the_figures_doc_plot_commands_run_on_the_readme_main_jobs_record(tmp_path, monkeypatch):
    """docs/figures.md's `nasdiag plot ... --at` commands, run literally (globs expanded as a shell does) after the
    README's main job: a record of that job's steps (its --epochs, digits' search split at the default batch size)
    with cost and Hessian rows at each epoch's last step. Each must exit 0 and write the files the text names:
    `<figure>_init`, `_final`, `_step<N>` in the --format given."""
    monkeypatch.setenv("MPLBACKEND", "Agg")
    from nasdiag import cli
    from nasdiag.data import digits
    from nasdiag.record import Recorder
    from nasdiag.search.config import SearchConfig
    from nasdiag.search.runner import steps_per_epoch

    argv = quickstart_argv()
    out = option(argv, "--out")
    splits = digits()
    per_epoch = steps_per_epoch(len(splits.train), len(splits.val), SearchConfig.batch_size)
    steps = int(option(argv, "--epochs")) * per_epoch

    monkeypatch.chdir(tmp_path)
    pathlib.Path(out).parent.mkdir(parents=True)
    ops, edges = ["none", "skip_connect", "sep_conv_3x3"], ["0->2", "1->2"]  # small: the figures' sizes do not matter
    rng = np.random.default_rng(0)
    meta = {"method": "darts", "op_names": ops, "edge_names": {"normal": edges}, "cell_types": ["normal"]}
    with Recorder(out, meta=meta) as rec:
        for step in range(steps):
            row = {"scalars/train_loss": float(rng.random())}
            if step % per_epoch == per_epoch - 1:
                row.update({"cost/normal/mean": rng.standard_normal((2, 3)), "cost/normal/var": rng.random((2, 3)),
                            "cost/normal/count": np.full((2, 3), per_epoch, dtype=np.int64),
                            "hessian/normal/diag": rng.random((2, 3)).astype(np.float32)})
            rec.log(step, row)

    lines = [l.split("#")[0] for b in fenced(FIGURES_DOC, "bash") for l in b.splitlines() if "nasdiag plot" in l]
    with_at = [shlex.split(l.split("nasdiag", 1)[1]) for l in lines if "--at" in l]
    assert with_at, "docs/figures.md shows no `nasdiag plot --at` command any more"
    for doc_argv in with_at:
        expanded = [p for a in doc_argv for p in (sorted(glob.glob(a)) if "*" in a else [a])]
        assert cli.main(expanded) == 0, f"`nasdiag {' '.join(doc_argv)}` fails on the README main job's record " \
                                        f"(steps 0-{steps - 1})"
        fmt, folder = option(doc_argv, "--format"), pathlib.Path(option(doc_argv, "--out"))
        for at in option(doc_argv, "--at").split(","):
            suffix = at if at in ("init", "final") else f"step{int(at)}"
            for figure in option(doc_argv, "--figures").split(","):
                assert (folder / f"{figure}_normal_heatmap_{suffix}.{fmt}").is_file(), (figure, at, sorted(folder.iterdir()))


def test_the_readme_regret_block_plays_one_round_of_algorithm_1_as_its_comments_say():
    """README.md's XNAS block as written, against this file's own transcription of XNAS Algorithm 1 (lines 2, 8-12)
    and eq 2-4 for one round from the uniform start: v_1 = exp(η R) (η = η* of eq 4 for T, L, N = 8), nobody below
    θ_1 = max v_1 · exp(-2ηL(T - 1)), the linearized regret ℓ'(p_1) - min_i L'_{1,i} = max_i R_i - mean_i R_i
    (eq 18-19, 31, p_1 the uniform mixture), and eq 3 at t = 1 with γ = 1: η L²/2 + ln N / η."""
    import torch

    block = next(b for b in fenced(README, "python") if "Forecaster(" in b)
    ns = {"torch": torch}
    exec(compile(block, "README.md", "exec"), ns)
    fc, T, L, E, N = ns["fc"], ns["T"], ns["L"], ns["E"], 8
    R = -ns["costs"].double()  # xnas_reward: R = -C (Algorithm 1 line 8 with the cost as ∇_p ℓ · f)
    assert R.shape == (E, N)
    eta = math.sqrt(2 * math.log(N) / (T * L * L))
    log_v = eta * R
    alive = log_v >= log_v.max(-1, keepdim=True).values - 2 * eta * L * (T - 1)
    assert alive.all() and torch.equal(fc.alive, alive)
    torch.testing.assert_close(fc.weights, torch.softmax(log_v, -1), rtol=1e-12, atol=0)
    torch.testing.assert_close(fc.regret, R.max(-1).values - R.mean(-1), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(fc.bound(), torch.full((E,), eta * L * L / 2 + math.log(N) / eta, dtype=torch.float64),
                               rtol=1e-12, atol=0)
    assert torch.equal(fc.gamma, torch.ones(E, dtype=torch.float64))


def test_the_hessian_doc_names_the_alpha_keys_its_own_net_has():
    """docs/hessian.md's shared-α line said `alpha_diag_hessian(net, ...)  # {"alphas_normal": (E, K), ...}` of the
    file's own net, `Network(..., layers=2)`, whose two cells are both reduction cells (DARTS: reductions at
    layers//3 and 2·layers//3): the call returns {"alphas_reduce": (14, 8)} only (measured: 30 s here, so not rerun).
    The keys a comment names must be the α of the cell types that net has, read off its cells."""
    import torch

    blocks = fenced(ROOT / "docs" / "hessian.md", "python")
    setup = blocks[0].split("h_w = ")[0]  # the imports, the net and the batch of the file's first block
    ns = {}
    exec(compile(setup, "docs/hessian.md", "exec"), ns)
    net = ns["net"]
    types = {"reduce" if cell.reduction else "normal" for cell in net.cells}
    have = {f"alphas_{t}" for t in types}
    assert have == {name for name, p in net.named_parameters() if name.startswith("alphas_")}
    claims = [(line, set(re.findall(r'"(alphas_\w+)"', line.split("#", 1)[1])))
              for b in blocks for line in b.splitlines() if "alpha_diag_hessian(" in line and "#" in line]
    claims = [(line, named) for line, named in claims if named]
    assert claims, "docs/hessian.md no longer says which keys alpha_diag_hessian returns"
    for line, named in claims:
        assert named <= have, f"{line.strip()!r} names {sorted(named - have)}; the net has {sorted(have)}"


def test_the_methods_doc_command_line_for_a_method_of_ones_own_works_from_a_shell(tmp_path):
    """docs/methods.md said the toy method runs as `nasdiag search --method toy --hp eta=1.5` "once the module that
    defines it is imported"; no shell user can import a module into the `nasdiag` process, which answers
    "unknown method 'toy'" (exit 2). The doc now gives a command that imports it first: run here with the doc's
    first block saved as toy_method.py and `methods toy` in place of `search ...`, as the text says, in a fresh
    process (the method must be registered by that import alone)."""
    import subprocess
    import sys

    doc = ROOT / "docs" / "methods.md"
    (tmp_path / "toy_method.py").write_text(fenced(doc, "python")[0])
    line = next(l for b in fenced(doc, "bash") for l in b.splitlines() if "toy_method" in l)
    argv = shlex.split(line)
    assert argv[0] == "python" and argv[1] == "-c" and argv[3] == "search" and option(argv, "--method") == "toy"
    done = subprocess.run([sys.executable, "-c", argv[2], "methods", "toy"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "MPLBACKEND": "Agg"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("toy:") and "eta: float = 0.5" in done.stdout, done.stdout


@pytest.mark.parametrize("function", ["write_figures", "write_report"])
def test_a_loaded_record_given_to_a_function_that_reads_a_record_file_is_one_line(tmp_path, monkeypatch, function):
    """docs/figures.md wrote `write_figures(record, out, ...)` and `write_report(record, "report.html")` beside
    `write_comparison({label: nasdiag.record.load(path)}, out)`; both read a record *file*, and the record a user had
    loaded stopped in pathlib's `TypeError: expected str, bytes or os.PathLike object, not dict` traceback. Now the
    doc names `record_path`, and a loaded record is one PlotError line (also a TypeError) that says what to pass;
    nothing is written."""
    import nasdiag.plot
    from nasdiag.plot import PlotError
    from nasdiag.record import Recorder, load

    monkeypatch.chdir(tmp_path)
    with Recorder("run.h5", meta={"method": "darts"}) as rec:
        rec.log(0, {"scalars/train_loss": 1.0})
    record = load("run.h5")
    out = "figs" if function == "write_figures" else "report.html"
    with pytest.raises(PlotError) as info:
        getattr(nasdiag.plot, function)(record, out)
    assert isinstance(info.value, TypeError)
    message = str(info.value)
    assert "\n" not in message and function in message and "path" in message and "write_comparison" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5"]
    assert f"{function}(record_path" in FIGURES_DOC.read_text()


def test_the_figures_doc_module_registering_a_built_in_name_first_is_refused_and_the_built_ins_still_load(monkeypatch):
    """docs/figures.md's "add a figure" module re-registers the shipped `attention` name and says a second registration
    is refused. Run before anything read the figure registry (a fresh process: a user's module imported first), it was
    taken instead, and every later read of the registry (`registered()`, `nasdiag plot`, `write_figures`) stopped in
    the built-in attention.py's own registration: `ValueError: a different figure is already registered as
    'attention': __main__.attention`. Now the user's registration is the one refused, and the built-ins load.
    The fresh process is imitated by an empty registry and the built-in figure modules unimported."""
    import sys

    from nasdiag.plot import registry

    monkeypatch.setattr(registry, "_FIGURES", {})
    monkeypatch.setattr(registry, "_BUILTINS_LOADED", False)
    import nasdiag.plot

    for name in [m for m in sys.modules if m.startswith("nasdiag.plot.") and m != "nasdiag.plot.registry"]:
        monkeypatch.delitem(sys.modules, name)  # restored after the test, and the package's attribute with it
        parent, _, child = name.rpartition(".")
        if parent == "nasdiag.plot" and hasattr(nasdiag.plot, child):
            monkeypatch.setattr(nasdiag.plot, child, getattr(nasdiag.plot, child))
    block = fenced(FIGURES_DOC, "python")[0]
    assert 'name="attention"' in block
    with pytest.raises(ValueError, match="already registered as 'attention': nasdiag.plot.attention"):
        exec(compile(block, "docs/figures.md", "exec"), {"__name__": "__main__"})
    figures = registry.registered()
    assert figures["attention"].draw.__module__ == "nasdiag.plot.attention"
    assert {"arch", "cost", "hessian", "scalars", "attention_counts"} <= set(figures)


def test_record_paths_given_to_write_comparison_which_takes_loaded_records_are_one_line(tmp_path, monkeypatch):
    """The other way round: docs/figures.md's `write_comparison({label: nasdiag.record.load(path)}, out)` given
    `{label: path}` (as write_figures takes) stopped in `TypeError: string indices must be integers, not 'str'`
    inside check_at_steps. Now one PlotError line (also a TypeError) naming the label and what to pass; nothing
    is written."""
    from nasdiag.plot import PlotError, write_comparison
    from nasdiag.record import Recorder

    monkeypatch.chdir(tmp_path)
    with Recorder("run.h5", meta={"method": "darts"}) as rec:
        rec.log(0, {"scalars/train_loss": 1.0})
    with pytest.raises(PlotError) as info:
        write_comparison({"first": "run.h5", "second": pathlib.Path("run.h5")}, "compare")
    assert isinstance(info.value, TypeError)
    message = str(info.value)
    assert "\n" not in message and "'first'" in message and "load(path)" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5"]


def test_write_figures_takes_figure_names_as_the_command_line_does_and_an_unknown_one_makes_no_folder(tmp_path,
                                                                                                     monkeypatch):
    """docs/figures.md: `write_figures(record_path, out, fmt="png", figures=None, at=None)` beside `--figures cost,hessian`
    and `at="init,final,120"`. `figures="cost,hessian"` (a string, as `at` takes one) was read letter by letter:
    "unknown figure(s) c, o, s, t, ..." and the folder `out` was made before the refusal. Now a comma-separated string
    selects as --figures does, and an unknown name is refused before anything is made."""
    monkeypatch.setenv("MPLBACKEND", "Agg")
    from nasdiag.plot import PlotError, write_figures
    from nasdiag.record import Recorder

    monkeypatch.chdir(tmp_path)
    meta = {"method": "darts", "op_names": ["a", "b"], "edge_names": {"normal": ["0->2"]}, "cell_types": ["normal"]}
    with Recorder("run.h5", meta=meta) as rec:
        rec.log(0, {"scalars/train_loss": 1.0, "cost/normal/mean": np.array([[0.5, -0.5]]),
                    "cost/normal/var": np.zeros((1, 2)), "cost/normal/count": np.ones((1, 2), dtype=np.int64)})
    with pytest.raises(PlotError, match="unknown figure.*costt") as info:
        write_figures("run.h5", "refused", figures="costt")
    assert "c, o" not in str(info.value) and not (tmp_path / "refused").exists()
    written = write_figures("run.h5", "figs", figures="cost,scalars")
    assert sorted(p.name for p in written) == ["cost_normal_heatmap.png", "scalars.png"]


@pytest.mark.parametrize("dpi", [0, -3, float("nan"), "150"])
def test_a_dpi_that_is_not_a_positive_number_is_one_plot_error_line_before_any_folder(tmp_path, monkeypatch, dpi):
    """write_figures / write_comparison (docs/figures.md) with dpi=0 stopped in matplotlib's `ValueError: dpi must be
    positive` traceback after making the folder (nasdiag plot --dpi and write_report check it; these did not)."""
    from nasdiag.plot import PlotError, write_comparison, write_figures
    from nasdiag.record import Recorder, load

    monkeypatch.chdir(tmp_path)
    with Recorder("run.h5", meta={"method": "darts"}) as rec:
        rec.log(0, {"scalars/train_loss": 1.0})
    with pytest.raises(PlotError, match="dpi must be a positive number"):
        write_figures("run.h5", "figs", dpi=dpi)
    with pytest.raises(PlotError, match="dpi must be a positive number"):
        write_comparison({"a": load("run.h5")}, "compare", dpi=dpi)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5"]
