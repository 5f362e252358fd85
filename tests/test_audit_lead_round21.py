"""Lead's round-21 finding: a record named without an extension deleted a user's file.

The recorder builds each segment under ``<segment>.tmp`` and, on opening, removes such files as leftovers of a writer
killed while building one. A record named ``run`` (no extension) builds in ``run.tmp``: a user's own ``run.tmp`` (notes,
another program's output) was deleted, both by ``Recorder("run")`` and by ``nasdiag search --out run``. A file the
recorder leaves there is empty or begins with the HDF5 signature (a segment is written as one image from its first byte,
see record/writer.py ``_write_image``), so anything else is refused in one line and left as it was; a real leftover
(the HDF5 image of a killed writer, whole or torn) is still cleared.
"""
from __future__ import annotations

import numpy as np
import pytest

from nasdiag.record import Recorder, RecordError
from test_cli_errors import TINY, snapshot

USER_TEXT = b"my notes of the run, not an HDF5 file\n"


def test_a_recorder_named_without_an_extension_keeps_a_users_tmp_file(tmp_path):
    (tmp_path / "run.tmp").write_bytes(USER_TEXT)
    before = snapshot(tmp_path)
    with pytest.raises(RecordError, match=r"run\.tmp is not a segment this recorder was building.*move it away"):
        Recorder(str(tmp_path / "run"))
    assert snapshot(tmp_path) == before  # no record, no lock, the user's file untouched


@pytest.mark.parametrize("leftover", [b"", b"\x89HDF\r", b"\x89HDF\r\n\x1a\n" + bytes(100)], ids=["empty", "torn", "image"])
def test_a_killed_writers_leftover_is_still_cleared(leftover, tmp_path):
    (tmp_path / "run.h5.tmp").write_bytes(leftover)
    with Recorder(str(tmp_path / "run.h5")) as rec:
        rec.log(0, {"loss": np.float64(1.0)})
    assert not (tmp_path / "run.h5.tmp").exists()
    assert (tmp_path / "run.h5").exists()


def test_search_out_without_an_extension_keeps_a_users_tmp_file(tmp_path, capsys):
    from nasdiag.cli import main

    (tmp_path / "run.tmp").write_bytes(USER_TEXT)
    before = snapshot(tmp_path)
    code = main(["search", *TINY, "--method", "darts", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert "run.tmp is in the way" in err[0] and "ending in .h5" in err[0], err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("per_node", [1, 2, 3])
def test_a_darts_genotype_of_any_number_of_inputs_per_node_is_drawn_on_its_own_nodes(per_node):
    """``genes_from_pairs`` (the genotype figure and the cell drawings) took every DARTS (op, input) list for two per
    node: the single-input genotype of ``derive_cell(edges_per_node=1)`` was drawn with edges 2 -> 2 and 4 -> 3 (reported
    by the supernet auditor). The pairs name per_node inputs per node, nodes in order (DARTS's ``_parse``): the
    reference below assigns them by hand."""
    from nasdiag.plot.cells import genes_from_pairs

    steps = 3
    pairs, expected = [], []
    for j in range(2, 2 + steps):
        for slot in range(per_node):
            i = j - 1 - slot  # node 2 has two inputs (0, 1): a third is no node
            pairs.append((f"op{j}{slot}", i))
            expected.append((f"op{j}{slot}", i, j))
    if per_node > 2:  # node 2 has two inputs only: this list is not a genotype
        from nasdiag.plot.registry import NothingToDraw

        with pytest.raises(NothingToDraw, match="not an earlier node|same number"):
            genes_from_pairs(pairs, steps)
        return
    assert genes_from_pairs(pairs, steps) == expected
    for j in range(2, 2 + steps):  # every gene feeds an intermediate node from an earlier one
        assert all(i < j for _, i, node in genes_from_pairs(pairs, steps) if node == j)


def test_a_darts_genotype_of_an_uneven_pair_count_is_refused_not_drawn_on_a_guessed_node():
    from nasdiag.plot.cells import genes_from_pairs
    from nasdiag.plot.registry import NothingToDraw

    with pytest.raises(NothingToDraw, match="5 .op, input. pairs does not list the same number for each of the 2 nodes"):
        genes_from_pairs([("a", 0), ("b", 1), ("c", 0), ("d", 1), ("e", 2)], 2)


def test_a_supernet_of_primitives_none_is_dartss_space_as_a_methods_primitives_of_none_means():
    """A method's ``primitives`` of None stands for DARTS's space (reported by the methods auditor); ``Network(...,
    primitives=method.primitives)`` was list(None)'s bare TypeError. The reference is the DARTS paper's eight ops."""
    from nasdiag.supernet import Network

    darts_ops = ["none", "max_pool_3x3", "avg_pool_3x3", "skip_connect", "sep_conv_3x3", "sep_conv_5x5", "dil_conv_3x3",
                 "dil_conv_5x5"]
    net = Network(4, 10, 3, primitives=None)
    assert sorted(net.primitives) == sorted(darts_ops)  # nasdiag's order of them is its own
    assert net.primitives == Network(4, 10, 3).primitives
    assert net.alphas_normal.shape == (14, 8)
