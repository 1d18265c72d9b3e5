"""hpf.comm.world: process-group facts and one-off collectives, against values computed here."""
import pytest
import torch

from hpf.comm import world
from hpf.launcher import launch


def test_without_a_process_group_it_is_one_rank():
    assert (world.is_distributed(), world.rank(), world.world_size(), world.backend()) == (False, 0, 1, None)


def _run(rank):
    x = torch.tensor([rank + 1.0, 10.0 * rank])
    summed, largest = x.clone(), x.clone()
    world.all_reduce(summed)
    world.all_reduce(largest, op="max")
    with pytest.raises(ValueError, match="op='min'"):
        world.all_reduce(x.clone(), op="min")
    peer = 1 - rank
    got = torch.empty(3)
    world.wait_all(world.exchange(sends=[(peer, torch.full((3,), float(rank)), 7)], recvs=[(peer, got, 7)]))
    return (world.is_distributed(), world.rank(), world.world_size(), summed.tolist(), largest.tolist(),
            world.all_gather_object(f"r{rank}"), got.tolist())


@pytest.mark.slow
def test_two_ranks():
    out = launch(_run, 2, timeout=120)
    for rank, (dist_on, r, n, summed, largest, names, got) in enumerate(out):
        assert (dist_on, r, n) == (True, rank, 2)
        assert summed == [1.0 + 2.0, 0.0 + 10.0]
        assert largest == [2.0, 10.0]
        assert names == ["r0", "r1"]
        assert got == [float(1 - rank)] * 3
