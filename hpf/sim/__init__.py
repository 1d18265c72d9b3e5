"""``hpf simulate``: predict step time, exposed communication and tokens/s of any mesh from the
plan alone (meta tensors, no processes), for hpf and for the FSDP2 and Megatron DDP baselines.

    from hpf import sim
    r = sim.simulate("1b", {"node": 48, "local": 16}, "cloudmatrix384", local_batch=4, mixed_precision="bf16")
    r.step_s, r.exposed_share, r.tokens_per_s

Models: a module with ``init(config, device="meta")`` and ``CONFIGS``; ``unit_flops(config,
local_batch) -> {unit: forward FLOPs}`` if it has one (else 2 x tokens x matrix params),
``param_specs(config, ep_axis, data_axes)`` if its params are not all FSDP-sharded alike (MoE
experts split over ``ep_axis``), and ``unit_a2a(config, local_batch, mesh, ep_axis, dtype_bytes)
-> {unit: (bytes, axes)}`` for MoE all-to-alls.

The entry points live in predict.py, the event simulation in model.py (on timeline.py's rank, with
costs.py's costs), the machines in hardware.py (calibrate.py measures this one); this file only re-exports."""
from .hardware import PROFILES, Hardware, Link, hardware, load_calibration
from .costs import Options, allreduce_time, ring_time, two_tier_time
from .model import SimResult
from .predict import (STRATEGIES, calibrated_compute, compare, compute_floor, extrapolation, muon_tax, plan_for,
                      uncalibrated_shape,
                      schedule, simulate, sweep, sweep_mesh)

__all__ = ["simulate", "compare", "sweep", "sweep_mesh", "Hardware", "Link", "Options", "SimResult", "PROFILES",
           "hardware", "load_calibration", "ring_time", "allreduce_time", "two_tier_time", "STRATEGIES",
           "extrapolation", "uncalibrated_shape", "calibrated_compute", "plan_for", "compute_floor", "muon_tax", "schedule"]
