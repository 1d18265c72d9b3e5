"""The calibration's terms beyond links and compute: FSDP2's collectives, issue costs, gloo's overlap.

Each is also what ``hpf calibrate --update`` adds to a file that lacks it: FSDP2's own gather and
reduce-scatter through ``fully_shard``, the compute thread's seconds per collective issued through
hpf's comm, and how far gloo runs two collectives at once."""
from __future__ import annotations

import datetime
import statistics
import time

import torch

from ..comm import world
from ..models import gpt
from .measure import SIZES_MIB, fit_alpha_beta, median_of_launches, median_slowest_each, timed

__all__ = ["quiet", "add_fsdp2_comm", "add_issue_costs", "add_sync_terms"]


def quiet(what: str) -> None:
    """The default ``stage`` callback: calibrate says nothing (``hpf calibrate`` prints each stage)."""


class _Flat(torch.nn.Module):
    """One flat parameter whose forward reads it (so backward makes its full-size grad) and
    costs nothing else: a unit reduced to FSDP2's own work."""

    def __init__(self, numel: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(numel))

    def forward(self, x):
        return x + self.w[:1].sum()


def _fsdp2_comm_rank(rank, sizes, reps) -> dict:
    """FSDP2's own gather and reduction of a ``fully_shard``-ed flat param of each size (bytes), as
    its hooks run them in a step, synchronously on CPU ranks: a chain of such modules, forward (each
    gathered: copy-in, a fresh output, all_gather, copy-out; then resharded) and backward (each
    re-gathered, then its grad reduce-scattered: copy-in, FSDP2's op, the sharded grad's views).
    Per module: gather = forward / k, reduction = backward / k - gather. (Explicit ``unshard()``
    calls cost about half of a gather inside a forward at 16 KiB, so timing them would under-charge
    FSDP2.) The slowest rank's median, per op."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    w = world.world_size()
    mesh = init_device_mesh("cpu", (w,))
    out = {"all_gather": [], "reduce_scatter": []}
    x = torch.zeros(())
    for nbytes in sizes:
        k = 4 if nbytes <= 16 << 20 else 2  # fewer of the big ones: a 256 MiB module is 1 s a pass
        chain = torch.nn.Sequential(*[_Flat(nbytes // 4 // w * w) for _ in range(k)])
        for m in chain:
            fully_shard(m, mesh=mesh)
        fully_shard(chain, mesh=mesh)
        box = []
        (fwd, bwd), _ = median_slowest_each([lambda: box.append(chain(x)), lambda: box.pop().backward()], reps)
        out["all_gather"].append(fwd / k)
        out["reduce_scatter"].append(max(bwd - fwd, 0.0) / k)
    return out


def add_fsdp2_comm(calib: dict, reps: int = 7, sizes_mib=SIZES_MIB, launches: int = 3, stage=quiet) -> dict:
    """FSDP2's gather and reduce-scatter figures per gloo world, as ``ops`` of the gloo links (alpha,
    beta fitted as the others): what the simulator charges FSDP2 on CPU ranks, in place. Less the
    smallest size's seconds on one rank (hooks and Python: in ``fsdp2_unit_overhead_s`` already);
    the median of ``launches`` launches per size (the cores are shared)."""
    sizes = [int(m * 2 ** 20) for m in sizes_mib]

    stage("FSDP2's own collectives on 1 rank (its per-call floor)")
    one = median_of_launches(_fsdp2_comm_rank, 1, sizes[:1], reps, launches=launches)
    for w, link in calib["links"]["gloo"].items():
        stage(f"FSDP2's all-gather and reduce-scatter through fully_shard on {w} ranks")
        meas = median_of_launches(_fsdp2_comm_rank, int(w), sizes, reps, launches=launches)
        link.setdefault("ops", {}).update({
            f"fsdp2_{op}": fit_alpha_beta(int(w), sizes, [max(t - one[op][0], 1e-6) for t in ts])
            for op, ts in meas.items()})
    calib["fsdp2_comm_when"] = datetime.datetime.now().isoformat(timespec="seconds")
    return calib


def _issue_rank(rank, two_tier: bool, reps: int) -> float:
    """Seconds of the compute thread per collective through hpf's own comm (TieredComm on shared
    memory, or BucketComm on gloo), the tiny GPT's buckets, every rank computing small Python-heavy
    ops between issue and wait as a small model's step does: the issue and wait calls, and what the
    comm threads take from compute (GIL, cores). Comm vs no comm, interleaved; the slowest rank's median."""
    import hpf

    w = world.world_size()
    cfg = gpt.CONFIGS["tiny"]
    mesh = hpf.Mesh({"dp": w} if w <= 2 else {"node": w // 2, "local": 2})
    step = hpf.shard_step(gpt.loss_for(cfg), mesh=mesh, optimizer=hpf.optim.adamw(lr=1e-3),
                          topology=hpf.Topology() if two_tier else None)
    step.init(gpt.init(cfg))
    comm = step.comm
    bufs = [(b.index, comm.full_buffer(b.index, torch.float32), torch.randn(b.padded_numel // b.shard_size),
             comm.grad_buffer(b.index, torch.float32), torch.empty(b.padded_numel // b.shard_size))
            for b in step.plan.buckets]
    a = torch.randn(cfg.d_model, cfg.d_model)

    def compute():
        x = a
        for _ in range(50):
            x = torch.tanh(x @ a)

    def loop(with_comm: bool) -> float:  # compute-thread seconds outside waits, per collective
        busy = 0.0
        for b, full, shard, flat, grad in bufs:
            for issue in (lambda: comm.all_gather(b, full, shard), lambda: comm.reduce(b, grad, flat)):
                t = time.perf_counter()
                handle = issue() if with_comm else None
                compute()
                busy += time.perf_counter() - t
                if handle is not None:
                    handle.wait()
        return busy / (2 * len(bufs))

    costs = []
    for i in range(3 * reps + 2):  # noisy on shared cores: more reps than the long benchmarks
        world.barrier()
        with_comm = loop(True)
        world.barrier()
        if i >= 2:
            costs.append(with_comm - loop(False))
    step.close()
    per_rank = world.all_gather_object(statistics.median(costs))
    return max(0.0, max(per_rank))


def add_issue_costs(calib: dict, reps: int = 7, launches: int = 3, stage=quiet) -> dict:
    """Measure ``issue_s`` for every (transport, world) of a calibration, in place (also what
    ``--update`` adds to a calibration file that lacks it)."""
    for transport, per in calib["links"].items():
        for w, link in per.items():
            stage(f"compute-thread cost per collective, {transport}, {w} ranks")
            link["issue_s"] = median_of_launches(_issue_rank, int(w), transport == "shm", reps, launches=launches)
    calib["issue_when"] = datetime.datetime.now().isoformat(timespec="seconds")
    return calib


def _concurrency_rank(rank, nbytes: int, reps: int) -> float:
    """How far gloo's ProcessGroup runs two collectives at once (its worker threads, 2 by default),
    as hpf's flat comm overlaps them: an all-gather of ``nbytes`` issued with an all-to-all of 4x that
    (a gather beside a reduction), each alone and both together, interleaved. ``overlap`` =
    (together - longer) / shorter: 0 when they run side by side, 1 when they take the sum. Median of reps."""
    w = world.world_size()
    numel = nbytes // 4 // w * w
    full, shard, big, recv = torch.randn(numel), torch.randn(numel // w), torch.randn(4 * numel), torch.empty(4 * numel)
    ag = lambda: world.all_gather_into(full, shard, async_op=True)  # noqa: E731
    a2a = lambda: world.all_to_all_into(recv, big, async_op=True)  # noqa: E731
    ratios = []
    for i in range(reps + 1):
        ts = []
        for fn in (lambda: ag().wait(), lambda: a2a().wait(), lambda: [h.wait() for h in (a2a(), ag())]):
            world.barrier()
            ts.append(timed(fn))
        if i:
            ratios.append((ts[2] - max(ts[:2])) / min(ts[:2]))
    every = world.all_gather_object(ratios)
    return min(max(statistics.median(statistics.mean(r) for r in zip(*every)), 0.0), 1.0)


def add_sync_terms(calib: dict, reps: int = 7, nbytes: int = 256 << 10, launches: int = 3, stage=quiet) -> dict:
    """Per gloo world: ``overlap`` of two collectives at once (``_concurrency_rank``; ``nbytes``: a tiny
    GPT bucket's), in place."""
    for w, link in calib["links"]["gloo"].items():
        stage(f"two gloo collectives at once, {w} ranks")
        link["overlap"] = median_of_launches(_concurrency_rank, int(w), nbytes, 2 * reps, launches=launches)
    calib["sync_when"] = datetime.datetime.now().isoformat(timespec="seconds")
    return calib
