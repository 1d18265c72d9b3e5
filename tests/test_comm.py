"""Both engine comms satisfy the UnitComm protocol the engine is typed against."""
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
