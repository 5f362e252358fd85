"""Round 23 (second pass, cli23b): a new user's misuse of the CLI.

Found and fixed: a string hyperparameter copied back from ``nasdiag methods`` as printed (its default is shown as a
Python repr, ``optimizer: str = 'adamhapg'``) kept its quotes under ``--hp "optimizer='adamhapg'"`` and was refused
as "not one of ['hapg', 'adamhapg']; did you mean 'adamhapg'?", the very text typed; a tuple default copied as printed
(``(0.5, 0.999)``) and ``None`` were accepted. A hyperparameter the shell split (``--hp w_lr =0.1``, ``--hp w_lr= 0.1``,
``--hp alpha_betas=0.5, 0.999``) or several after one ``--hp`` (``--hp w_lr=0.1 w_momentum=0.5``) was "unrecognized
arguments: =0.1 (see nasdiag search --help)", no word of --hp: the line now ends with the --hp to write.
"""

from __future__ import annotations

import dataclasses
import json
import re

import h5py
import pytest

from nasdiag.cli import main
from nasdiag.search.registry import available_methods

TINY = ["--epochs", "1", "--C", "4", "--layers", "3", "--steps", "2", "--batch-size", "240", "--diagnostics", "none",
        "--device", "cpu", "--no-progress", "--no-figs", "--threads", "1"]


def _printed_defaults(capsys) -> dict:
    """``{method: {key: default text}}`` as ``nasdiag methods`` prints them."""
    assert main(["methods"]) == 0
    out, _ = capsys.readouterr()
    printed, method = {}, None
    for line in out.splitlines():
        head = re.match(r"^(\S+): ", line)  # a method registered by a test may be named reinforce-r19
        if head:
            method = head.group(1)
            printed[method] = {}
            continue
        field = re.match(r"^    (\w+): .*? = (.*?)  ", line)
        if field and method:
            printed[method][field.group(1)] = field.group(2)
    return printed


def test_every_default_nasdiag_methods_prints_is_taken_back_by_hp_as_that_default(capsys):
    printed = _printed_defaults(capsys)
    assert set(printed) == set(available_methods())
    # nasdiag's own methods (other tests of the session register methods of their own in this process)
    methods = {n: c for n, c in available_methods().items() if c.__module__.startswith("nasdiag.search.methods.")}
    assert len(methods) == 9
    quoted = 0
    for name, cls in methods.items():
        assert set(printed[name]) == set(cls.Hyperparameters.keys()), name
        parsed = cls.Hyperparameters.parse([f"{k}={v}" for k, v in printed[name].items()], name)
        # the reference: the dataclass defaults themselves
        assert parsed == cls.Hyperparameters(), (name, printed[name])
        for f in dataclasses.fields(cls.Hyperparameters):
            if isinstance(f.default, str):  # also in double quotes, as a shell user may type it
                quoted += 1
                again = cls.Hyperparameters.parse([f'{f.name}="{f.default}"'], name)
                assert getattr(again, f.name) == f.default
    assert quoted >= 2  # sparsenas's optimizer, bayesnas's hessian_mode


def test_a_string_hyperparameter_copied_with_its_quotes_runs_the_search_with_that_value(tmp_path, capsys):
    out = tmp_path / "run.h5"
    code = main(["search", *TINY, "--method", "sparsenas", "--hp", "optimizer='hapg'", "--out", str(out)])
    _, err = capsys.readouterr()
    assert code == 0, err
    with h5py.File(out, "r") as record:
        assert json.loads(record["meta"].attrs["hp"])["optimizer"] == "hapg"


def _one_line_refusal(argv, folder, capsys) -> str:
    before = sorted(p.name for p in folder.iterdir())
    code = main(argv)
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in folder.iterdir()) == before
    return lines[0]


@pytest.mark.parametrize("split,fix", [
    (["w_lr", "=0.1"], "write it as one word, --hp w_lr=0.1"),
    (["w_lr", "=", "0.1"], "write it as one word, --hp w_lr=0.1"),
    (["w_lr=", "0.1"], "write it as one word, --hp w_lr=0.1"),
    (["alpha_betas=0.5,", "0.999"], "write it as one word, --hp alpha_betas=0.5,0.999"),
    (["w_lr=0.1", "w_momentum=0.5"], "--hp takes one KEY=VALUE, repeated for each: --hp w_lr=0.1 --hp w_momentum=0.5"),
])
def test_a_hyperparameter_the_shell_split_names_the_hp_to_write(split, fix, tmp_path, capsys):
    """``--hp w_lr =0.1`` (a space before '=') was "unrecognized arguments: =0.1 (see nasdiag search --help)": no word
    of --hp nor of the space; ``--hp w_lr=0.1 w_momentum=0.5`` no word that --hp is repeated."""
    line = _one_line_refusal(["search", *TINY, "--out", str(tmp_path / "run.h5"), "--hp", *split], tmp_path, capsys)
    assert line.endswith(fix), line
