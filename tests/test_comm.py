"""Both engine comms satisfy the UnitComm protocol the engine is typed against."""
import pytest
import torch
import torch.distributed as dist

import hpf
from hpf.comm import UnitComm
from hpf.comm.flat import BucketComm
from hpf.comm.tiered import TieredComm


def test_bucket_comm_and_tiered_comm_are_unit_comms(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        plan = hpf.plan({"w": torch.ones(4, 2), "blocks": [{"v": torch.ones(3)}]}, hpf.Mesh({"node": 1, "local": 1}))
        dtypes = [b.dtype for b in plan.buckets]
        flat = BucketComm(plan, torch.device("cpu"), dtypes, dtypes)
        tiered = TieredComm(plan, hpf.Topology(fast_transport="pg"), torch.device("cpu"), dtypes, dtypes)
        try:
            assert isinstance(flat, UnitComm) and isinstance(tiered, UnitComm)
            assert not isinstance(object(), UnitComm)
        finally:
            tiered.close()
    finally:
        dist.destroy_process_group()


def test_a_timed_wait_that_loses_the_race_to_completion_is_no_error():
    """c10d's timed wait raises "Operation timed out!" when its time is up; a work that completes just
    after (seen under load) succeeded, and waiting on it must say so, not raise its timeout."""
    from hpf.comm.handles import wait_for

    class LateWork(dist.Work):
        def __init__(self, fails: bool):
            super().__init__()
            self.fails, self.waits, self.future = fails, 0, torch.futures.Future()

        def wait(self, timeout=None):
            self.waits += 1
            if self.waits == 1:  # the time is up, and the work completes right then
                self.future.set_result(None)
                raise RuntimeError("Operation timed out!")
            if self.fails:
                raise RuntimeError("the peer's connection closed")
            return True

        def get_future(self):
            return self.future

    assert wait_for(LateWork(fails=False), 0.01) is True
    with pytest.raises(RuntimeError, match="connection closed"):
        wait_for(LateWork(fails=True), 0.01)
