"""Round 22, schema: the record as a researcher reads it with h5py, against docs/schema.md and the vocabulary.

Defect fixed: the schema table's `attention/<cell>/count` (ASM-NAS) said "per-sample argmax counts over the whole
validation set" and left out that the counts of the cells of a type are summed, which docs/asmnas.md and the method
do. A reader dividing a reduce edge's counts by the validation size got frequencies adding up to 2 (two reduce cells
in a 3-layer supernet: 1438 for 719 samples in a digits run).
"""

import torch

from nasdiag import vocabulary as V
from nasdiag.record.families_doc import families_markdown
from nasdiag.search import Schedule, get_method
from nasdiag.supernet import Network


def test_attention_count_is_documented_as_summed_over_the_cells_of_a_type():
    torch.manual_seed(0)
    net = Network(4, 5, 3, steps=2, multiplier=2, in_channels=1).double()  # 1 normal cell, 2 reduce cells
    method = get_method("asmnas")(net, schedule=Schedule(epochs=1, steps_per_epoch=1))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(7, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (7,), generator=g)
    method.evaluate([(x[:4], y[:4]), (x[4:], y[4:])])
    stats = method.epoch_statistics()
    for t in net.cell_types:
        cells = sum(c.cell_type == t for c in net.cells)
        counts = stats[V.ATTENTION_COUNT.path(cell=t)]
        # what the record holds: each edge's counts add up to samples × cells of the type (7 × 2 for reduce)
        assert torch.equal(counts.sum(-1), torch.full((net.num_edges,), 7 * cells)), t
    meaning = V.ATTENTION_COUNT.meaning
    assert "summed over the cells of the type" in meaning, meaning
    assert "summed over the cells of the type" in families_markdown().split("`attention/<cell>/count`")[1].split("\n")[0]
