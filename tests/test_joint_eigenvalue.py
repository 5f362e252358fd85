"""The search's joint α-Hessian eigenvalue (``hessian/top_eigenvalue``, RobustDARTS's dominant eigenvalue of
∇²_α L_valid over the α of every cell type) against a dense float64 eigendecomposition of the reverse-over-reverse
autograd Hessian, through train-mode BatchNorm, with the per-type eigenvalues beside it."""

import math

import pytest
import torch
import torch.nn.functional as F

from nasdiag.search import get_method
from nasdiag.search.base import Schedule
from nasdiag.supernet import Network

DT = torch.float64


def _net_with_two_cell_types():
    torch.manual_seed(5)
    net = Network.minimal(4, 3, 3, in_channels=2).to(DT)  # normal, reduce, reduce
    with torch.no_grad():
        for a in net.alphas().values():
            a.normal_(0, 0.7)
    return net, torch.randn(6, 2, 8, 8, dtype=DT), torch.randint(0, 3, (6,))


def _dense_joint_hessian(net, x, y):
    alphas = {name: p.detach().clone() for name, p in net.named_parameters() if name.startswith("alphas_")}
    names = list(alphas)

    def loss(*values):
        return F.cross_entropy(torch.func.functional_call(net, dict(zip(names, values)), (x,)), y)

    blocks = torch.autograd.functional.hessian(loss, tuple(alphas.values()))  # double backward: right through BN
    sizes = [a.numel() for a in alphas.values()]
    return torch.cat([torch.cat([blocks[i][j].reshape(sizes[i], sizes[j]) for j in range(len(names))], 1)
                      for i in range(len(names))], 0), sizes


def test_the_joint_top_eigenvalue_is_the_dense_one_and_not_a_per_type_one():
    net, x, y = _net_with_two_cell_types()
    assert set(net.alphas()) == {"normal", "reduce"}
    method = get_method("darts")(net, schedule=Schedule(epochs=1, steps_per_epoch=1))
    buffers = [b.clone() for b in net.buffers()]
    stats = method.curvature(x, y, top_eigenvalue=True)
    assert all(torch.equal(a, b) for a, b in zip(buffers, net.buffers()))  # running statistics untouched
    dense, (n_normal, _) = _dense_joint_hessian(net, x, y)
    scale = float(dense.abs().max())
    joint = float(torch.linalg.eigvalsh(dense).max())
    assert abs(float(stats["hessian/top_eigenvalue"]) - joint) < 1e-8 * scale
    for cell, block in (("normal", dense[:n_normal, :n_normal]), ("reduce", dense[n_normal:, n_normal:])):
        assert abs(float(stats[f"hessian/{cell}/top_eigenvalue"]) - float(torch.linalg.eigvalsh(block).max())) < 1e-8 * scale
    # the cross-type block is not negligible, so the joint eigenvalue is its own number
    per_type = max(float(stats["hessian/normal/top_eigenvalue"]), float(stats["hessian/reduce/top_eigenvalue"]))
    assert joint - per_type > 1e-3 * scale
    x_bad = x.clone()
    x_bad[0, 0, 0, 0] = math.nan
    stats = method.curvature(x_bad, y, top_eigenvalue=True)
    assert math.isnan(float(stats["hessian/top_eigenvalue"]))
    assert bool(stats["hessian/normal/nonfinite"]) and bool(stats["hessian/reduce/nonfinite"])


def test_the_eigenvalue_figure_draws_the_joint_curve_beside_the_cell_types(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from plot_records import write_record

    from nasdiag import vocabulary as V
    from nasdiag.plot.hessian import top_eigenvalue
    from nasdiag.record import load

    extra = {s: {V.HESSIAN_TOP_EIGENVALUE.path(cell="normal"): 0.1 * s, V.HESSIAN_JOINT_TOP_EIGENVALUE.path(): 0.2 * s}
             for s in (2, 4, 6, 8)}
    extra[6][V.HESSIAN_JOINT_TOP_EIGENVALUE.path()] = math.nan  # kept and marked, not dropped
    record = load(str(write_record(tmp_path / "r.h5", epochs=2, extra=extra)))
    fig = top_eigenvalue(record, "normal")
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "α of the normal cells" in labels and "all α jointly" in labels and "NaN" in labels, labels
    joint = [line for line in fig.axes[0].lines if line.get_label() == "all α jointly"][0]
    assert list(joint.get_xdata()) == [2, 4, 6, 8] and math.isnan(joint.get_ydata()[2])


def test_a_cell_type_nan_in_every_row_does_not_hide_the_joint_curve(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from plot_records import write_record

    from nasdiag import vocabulary as V
    from nasdiag.plot.hessian import top_eigenvalue
    from nasdiag.plot.registry import NothingToDraw
    from nasdiag.record import load

    extra = {s: {V.HESSIAN_TOP_EIGENVALUE.path(cell="normal"): math.nan, V.HESSIAN_JOINT_TOP_EIGENVALUE.path(): 0.2 * s}
             for s in (2, 4)}
    record = load(str(write_record(tmp_path / "r.h5", epochs=1, extra=extra)))
    labels = top_eigenvalue(record, "normal").axes[0].get_legend_handles_labels()[1]
    assert "all α jointly" in labels and "NaN" in labels, labels  # the per-type NaNs are marked, not dropped
    extra = {s: {V.HESSIAN_TOP_EIGENVALUE.path(cell="normal"): math.nan, V.HESSIAN_JOINT_TOP_EIGENVALUE.path(): math.nan}
             for s in (2, 4)}
    record = load(str(write_record(tmp_path / "n.h5", epochs=1, extra=extra)))
    with pytest.raises(NothingToDraw, match="hessian/normal/top_eigenvalue and hessian/top_eigenvalue are NaN in every row"):
        top_eigenvalue(record, "normal")
