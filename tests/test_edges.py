"""One edge-spec type: Network.edge_specs(), the probe's discovery and the curvature engines agree on it,
and the one resolver refuses bad descriptions with one clear line."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nasdiag
from nasdiag.edges import EdgeSpec, EdgeSpecError, resolve_edges
from nasdiag.errors import NasdiagError
from nasdiag.hessian import arch_diag_hessian

from conftest import float64_batch, tiny_network


def small_net():
    return tiny_network(primitives=["skip_connect", "avg_pool_3x3", "sep_conv_3x3"])


def test_network_specs_equal_what_the_probe_discovers_from_module_structure():
    net = small_net()
    specs = net.edge_specs()
    discovered = nasdiag.attach(net).edges
    assert list(discovered) == specs  # same type, same fields, same module objects
    modules = dict(net.named_modules())
    for s in specs:
        assert modules[s.name] is s.module and s.ops == tuple(s.module.ops)
        assert net.edge_nodes[s.edge_index] == (s.src, s.dst)
        assert net.cells[s.cell_index].cell_type == s.cell_type


def test_every_accepted_form_resolves_to_the_same_specs():
    net = small_net()
    specs = net.edge_specs()[:4]
    as_pairs = {s.name: (s.module, list(s.ops)) for s in specs}
    for form in (specs, {s.name: s for s in specs}, as_pairs):
        got = resolve_edges(net, form)
        assert [(g.name, g.module, g.ops) for g in got] == [(s.name, s.module, s.ops) for s in specs]
    renamed = resolve_edges(net, {f"net.{s.name}": s for s in specs})
    assert [g.name for g in renamed] == [f"net.{s.name}" for s in specs]
    assert renamed[0].cell_type == specs[0].cell_type  # what the spec knew is kept


def test_the_curvature_engine_takes_a_list_of_specs_as_a_mapping():
    net = small_net()
    x, y = float64_batch(3, hw=6)
    from_list = arch_diag_hessian(net, F.cross_entropy, x, y, net.edge_specs(), mode="approx")
    from_map = arch_diag_hessian(net, F.cross_entropy, x, y, {s.name: (s.module, list(s.ops)) for s in net.edge_specs()},
                                 mode="approx")
    assert list(from_list) == list(from_map)
    for name in from_map:
        torch.testing.assert_close(from_list[name], from_map[name], rtol=0, atol=0)


def test_bad_descriptions_are_one_line_errors():
    net = small_net()
    s = net.edge_specs()[0]
    stranger = small_net().cells[0].edges[0]
    cases = [
        ([], "edges must be"),
        ({"e": stranger}, "not a submodule"),  # a bare module without a candidates rule
        ({"e": (stranger, list(stranger.ops))}, "not a submodule"),
        ({"e": (s.module, [nn.Identity()])}, "candidate op 0 .*not a submodule"),
        ({"e": (s.module, [])}, "non-empty"),
        ({"e": s, "f": (s.module, list(s.ops))}, "same module"),
        ({"e": 3}, "expected an EdgeSpec"),
        ({1: s}, "strings"),
    ]
    for edges, message in cases:
        with pytest.raises(EdgeSpecError, match=message) as err:
            resolve_edges(net, edges, candidates=lambda m: getattr(m, "ops", None) if m is stranger else None)
        assert "\n" not in str(err.value)
    assert issubclass(EdgeSpecError, ValueError) and issubclass(EdgeSpecError, NasdiagError)
    with pytest.raises(EdgeSpecError, match="cannot tell the candidate ops"):
        resolve_edges(net, {"e": s.module})
    assert isinstance(s, EdgeSpec) and s.label == f"{s.src}->{s.dst}"
