"""Test-wide settings."""
import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on 2 shared cores run far faster single-threaded (oversubscription made some
    steps ~60x slower when another process held a core); launched ranks set their own."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
