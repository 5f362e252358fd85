"""The Lightning adapter in a real ``lightning.pytorch.Trainer``: a LightningModule training nasdiag's
supernet records the cost C = ∂L/∂Z of every cell (from per-cell Z leaves) to HDF5 through
`nasdiag.record.lightning_callback`. The record is checked against a replay of the same training in a
plain loop, where C comes from ``torch.func.grad`` of the loss as a function of the Z of each cell."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F



def _import_lightning():
    """``lightning.pytorch``, or a skip if the lightning extra is not installed.

    torchmetrics (a Lightning dependency) imports torchvision whenever its metadata says it is
    installed, and a torchvision built for another torch fails at import with a RuntimeError.
    nasdiag never uses torchvision, so it is hidden from that probe while Lightning is imported.
    """
    try:
        import lightning_utilities.core.imports as probe
    except ImportError:
        pytest.skip("the lightning extra is not installed (pip install nasdiag[lightning])")
    import importlib.metadata
    import sys

    def version(name, _original=probe._version):
        if name == "torchvision":
            raise importlib.metadata.PackageNotFoundError(name)
        return _original(name)

    hidden = "torchvision" not in sys.modules
    original = probe._version
    probe._version = version
    if hidden:
        sys.modules["torchvision"] = None  # an import attempt fails cleanly instead of half-loading
    try:
        return pytest.importorskip("lightning.pytorch", reason="the lightning extra is not installed")
    finally:
        probe._version = original
        if hidden:
            del sys.modules["torchvision"]


pl = _import_lightning()

from nasdiag.record import lightning_callback, load, load_meta  # noqa: E402
from nasdiag.supernet import Network  # noqa: E402

STEPS, BATCH, LR = 6, 8, 0.05


def _network() -> Network:
    torch.manual_seed(0)
    return Network(C=4, num_classes=3, layers=3, steps=2, multiplier=2, in_channels=1)


def _data():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * BATCH, 1, 8, 8, generator=gen)
    y = torch.randint(0, 3, (STEPS * BATCH,), generator=gen)
    return x, y


def _cell_weights(net: Network):
    """One (E, K) Z leaf per cell: softmax(α) of its type, detached, so that ∂L/∂Z lands in .grad."""
    z = net.softmax_weights()
    return [z[cell.cell_type].detach().clone().requires_grad_(True) for cell in net.cells]


def _cost_statistics(net: Network, costs) -> dict:
    """cost/<cell type>/{mean,var,count}: moments of C over the cells of each type (one step)."""
    out = {}
    for cell_type in net.cell_types:
        c = torch.stack([g for cell, g in zip(net.cells, costs) if cell.cell_type == cell_type])
        out[f"cost/{cell_type}/mean"] = c.mean(0)
        out[f"cost/{cell_type}/var"] = c.var(0, unbiased=False)
        out[f"cost/{cell_type}/count"] = torch.full(c.shape[1:], c.shape[0], dtype=torch.int64)
    return out


class SupernetModule(pl.LightningModule):
    """Trains the supernet's weights at fixed α; hands the step's per-cell costs to the recorder."""

    def __init__(self, net: Network):
        super().__init__()
        self.net = net
        self.z = None
        self.loss = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.z = _cell_weights(self.net)
        self.loss = F.cross_entropy(self.net(x, self.z), y)
        return self.loss

    def nasdiag_statistics(self):  # called by the adapter at batch end, after backward
        stats = _cost_statistics(self.net, [z.grad for z in self.z])
        stats["scalars/train_loss"] = self.loss.detach()
        return stats

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.weight_parameters(), lr=LR)


def _replay(net: Network, x, y):
    """The same training in a plain loop; C per step from torch.func.grad w.r.t. the cells' Z."""
    opt = torch.optim.SGD(net.weight_parameters(), lr=LR)
    rows = []
    for step in range(STEPS):
        xb, yb = x[step * BATCH : (step + 1) * BATCH], y[step * BATCH : (step + 1) * BATCH]
        params = {k: v.detach() for k, v in net.named_parameters()}
        buffers = {k: v.detach().clone() for k, v in net.named_buffers()}  # BN in train mode updates copies

        def loss_of(zs, buffers):  # BN in train mode mutates its buffers: they must be inputs
            logits = torch.func.functional_call(net, (params, buffers), (xb,), {"weights": list(zs)})
            return F.cross_entropy(logits, yb)

        z = [w.detach() for w in _cell_weights(net)]
        costs = torch.func.grad(loss_of)(tuple(z), buffers)
        row = {k: v.numpy() for k, v in _cost_statistics(net, costs).items()}
        loss = F.cross_entropy(net(xb, z), yb)  # the real step (updates BN running stats once)
        row["scalars/train_loss"] = loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
        rows.append(row)
    return rows


def test_lightning_trainer_records_costs_of_nasdiag_supernet(tmp_path):
    net = _network()
    replay_net = copy.deepcopy(net)
    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    meta = {"method": "lightning-test", "seed": 0, "op_names": net.primitives, "cell_types": net.cell_types,
            "edge_names": {t: net.edge_labels() for t in net.cell_types}}
    path = tmp_path / "run.h5"
    recorder = lightning_callback(path, meta=meta, flush_every=4, flush_seconds=None)
    trainer = pl.Trainer(max_steps=STEPS, max_epochs=1, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path, callbacks=[recorder])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers|GPU available).*")
        trainer.fit(SupernetModule(net), loader)

    assert recorder.callback.recorder.closed  # teardown closed the record
    out = load(path)
    np.testing.assert_array_equal(out["step"], np.arange(1, STEPS + 1))  # trainer.global_step after each step
    assert load_meta(path)["op_names"] == net.primitives
    np.testing.assert_array_equal(out["scalars/epoch"], [np.nan] * (STEPS - 1) + [0.0])  # epoch end: last row
    E, K = net.num_edges, len(net.primitives)
    expected = _replay(replay_net, x, y)
    for cell_type in net.cell_types:
        n_cells = sum(cell.cell_type == cell_type for cell in net.cells)
        assert out[f"cost/{cell_type}/mean"].shape == (STEPS, E, K)
        np.testing.assert_array_equal(out[f"cost/{cell_type}/count"], np.full((STEPS, E, K), n_cells))
        for i, row in enumerate(expected):
            for name in ("mean", "var"):
                np.testing.assert_allclose(out[f"cost/{cell_type}/{name}"][i], row[f"cost/{cell_type}/{name}"],
                                           rtol=1e-4, atol=1e-7, err_msg=f"cost/{cell_type}/{name} at step {i + 1}")
        assert np.abs(out[f"cost/{cell_type}/mean"]).max() > 0  # costs are not all zero
    np.testing.assert_allclose(out["scalars/train_loss"], [row["scalars/train_loss"] for row in expected], rtol=1e-5)
