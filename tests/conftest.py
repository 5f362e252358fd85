import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    # On a small shared CPU box two intra-op threads oversubscribe the cores: tiny float64 tests then
    # stall for seconds at a time. One thread keeps the suite fast and its timings stable.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
