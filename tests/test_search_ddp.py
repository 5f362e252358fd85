"""Data-parallel search over 2 gloo ranks on CPU: one DARTS step equals the single-process step on the
concatenated batch, and `nasdiag search` under torchrun writes one record with statistics of both ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from conftest import free_port, launch_ranks
from test_audit_ddp_round6 import TEARDOWN_ABORT
from nasdiag.record import load, load_meta

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

B = 6  # per rank


def _setup():
    # LayerNorm normalizes each sample on its own, so the mean loss of the concatenated batch is the mean of
    # the ranks' mean losses and data parallelism must reproduce the single-process step exactly.
    from nasdiag.supernet import Network

    torch.manual_seed(0)
    net = Network(4, 5, 3, steps=2, multiplier=2, in_channels=1, norm="layer", affine=True).double()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2 * B, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (2 * B,), generator=g))
            for _ in range(2)]
    return net, data


WORKER = textwrap.dedent(
    """
    import datetime, sys
    import torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[3])
    from test_search_ddp import B, _setup
    from test_search_darts import darts

    rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    net, ((xt, yt), (xv, yv)) = _setup()
    method = darts(net, epochs=2)
    method.distribute()
    part = slice(rank * B, (rank + 1) * B)
    method.step((xt[part], yt[part]), (xv[part], yv[part]))
    if rank == 0:
        torch.save({n: p.detach() for n, p in net.named_parameters()}, out)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def test_ddp_step_equals_single_process_step_on_the_whole_batch(tmp_path):
    from test_search_darts import darts

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "params.pt"
    init = f"tcp://127.0.0.1:{free_port()}"
    launch_ranks(script, lambda r: [r, init, os.path.dirname(os.path.abspath(__file__)), out])

    net, (train, val) = _setup()
    darts(net, epochs=2).step(train, val)
    distributed = torch.load(out)
    for name, p in net.named_parameters():
        torch.testing.assert_close(distributed[name], p.detach(), rtol=1e-9, atol=1e-12, msg=name)
    # the step moved both α and w, so the comparison is not vacuous
    assert not torch.equal(distributed["alphas_normal"], _setup()[0].alphas_normal.detach())


def _torchrun_search(out, device: str, **env) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "nasdiag", "search", "--epochs", "1", "--out", str(out),
           "--C", "4", "--layers", "3", "--steps", "2", "--batch-size", "64", "--device", device,
           "--no-progress", "--no-figs"]
    root = os.path.dirname(os.path.dirname(__file__))
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode != 0 and TEARDOWN_ABORT in proc.stderr:
        # gloo's teardown abort after a complete run (about 1 launch in 30 on the 2-core box, a known issue of torch's:
        # tests/test_audit_ddp_round6.py): launched once more from scratch; any other failure, or a second abort, fails
        for path in out.parent.iterdir():
            if path.name.startswith(out.name) and path.is_file():
                path.unlink()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_search_under_torchrun_records_both_ranks(tmp_path):
    out = tmp_path / "ddp.h5"
    proc = _torchrun_search(out, "cpu", OMP_NUM_THREADS="1")
    assert proc.stdout.count("genotype:") == 1  # only rank 0 reports
    rec = load(out)
    S = 719 // 2 // 64  # steps per epoch: each rank takes half of the search split
    assert rec["step"].tolist() == list(range(1, S + 1))
    last = rec["valid/cost/normal/count"]
    # pooled over ranks: every α step of both ranks, for each cell of the type (1 normal, 2 reduce cells)
    assert (rec["cost/normal/count"][last] == 2 * S * 1).all()
    assert (rec["cost/reduce/count"][last] == 2 * S * 2).all()
    assert np.isfinite(rec["scalars/train_loss"]).all()
    assert load_meta(out)["world_size"] == 2 and load_meta(out)["run"]["world_size"] == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_search_under_torchrun_on_two_gpus(tmp_path):
    out = tmp_path / "nccl.h5"
    _torchrun_search(out, "cuda", NCCL_NVLS_ENABLE="0")
    rec = load(out)
    S = 719 // 2 // 64
    assert rec["step"].tolist() == list(range(1, S + 1))
    assert (rec["cost/reduce/count"][rec["valid/cost/reduce/count"]] == 2 * S * 2).all()
    assert load_meta(out)["config"]["device"].startswith("cuda")
