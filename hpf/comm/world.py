"""The process-group facts and the one-off collectives outside the per-bucket comms.

hpf talks to torch.distributed only under hpf/comm/, in hpf/launcher/ (which starts the
process group) and in hpf/mesh.py (which makes the groups, and lies below hpf/comm/): the
step, validation and distributed Muon call these helpers.
Ranks are global ranks; ``group=None`` is the whole world. The collectives inherit the
process group's timeout (hpf.launch sets one), so a dead peer ends in an error, not a hang.
"""
from __future__ import annotations

import datetime
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..topology import COLLECTIVE_TIMEOUT_S  # how long a collective waits for a peer (its home: hpf.topology)

__all__ = ["COLLECTIVE_TIMEOUT_S", "default_device", "is_distributed", "rank", "world_size", "backend", "store", "timeout_s", "all_reduce", "barrier", "all_reduce_async", "all_gather_list",
           "all_gather_object", "exchange", "wait_all", "new_group", "all_gather_into", "reduce_scatter_into",
           "all_to_all_into"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}



def is_distributed() -> bool:
    """Whether a torch.distributed process group is running."""
    return dist.is_available() and dist.is_initialized()


def default_device() -> torch.device:
    """The device this rank computes on (the step, the CLI, user scripts): the accelerator the
    process group drives, else the CPU (gloo)."""
    if backend() not in (None, "gloo") and torch.accelerator.is_available():
        return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """The number of ranks (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def backend() -> str | None:
    """The default group's backend ("gloo", "nccl", ...), or None without a process group."""
    return dist.get_backend() if is_distributed() else None


def store() -> dist.Store | None:
    """The default group's key-value store (rendezvous), or None without a process group."""
    if not is_distributed():
        return None
    return dist.distributed_c10d._get_default_store()


def timeout_s() -> float:
    """The default group's collective timeout in seconds (30 minutes, torch's default, if unknown)."""
    if is_distributed():
        pg = dist.distributed_c10d._get_default_group()
        for device in ("cpu", "cuda", "npu"):
            try:
                return pg._get_backend(torch.device(device)).options._timeout.total_seconds()
            except (RuntimeError, AttributeError):
                continue
    return 1800.0


def all_reduce(tensor: torch.Tensor, group=None, op: str = "sum") -> None:
    """tensor <- the sum (op="sum") or maximum (op="max") of every rank's tensor, in place
    (nothing to do without a process group)."""
    if op not in _OPS:
        raise ValueError(f"all_reduce: op={op!r}; use one of {sorted(_OPS)}")
    if is_distributed():
        dist.all_reduce(tensor, op=_OPS[op], group=group)


def barrier(group=None) -> None:
    """Every rank of ``group`` reaches this point (nothing to do without a process group)."""
    if is_distributed():
        dist.barrier(group=group)


def all_reduce_async(tensor: torch.Tensor, group=None, op: str = "sum") -> dist.Work:
    """Start tensor <- the sum (or maximum) of every rank's tensor, in place; wait on the returned work."""
    return dist.all_reduce(tensor, op=_OPS[op], group=group, async_op=True)


def all_gather_list(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every group rank's ``tensor`` (same shape everywhere), by group rank (one-off gathers)."""
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def all_gather_object(obj: Any, group=None) -> list:
    """Every rank's picklable ``obj``, by group rank (for checks and set-up, not hot paths);
    ``[obj]`` without a process group (a 1-process run is a world of one)."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def exchange(sends: Sequence[tuple[int, torch.Tensor, int]], recvs: Sequence[tuple[int, torch.Tensor, int]]) -> list:
    """Post point-to-point sends and receives, each (peer global rank, tensor, tag), as one
    batch; returns the requests to ``wait_all`` on. Every send needs the peer's matching
    receive (same tag, same size)."""
    ops = [dist.P2POp(dist.isend, t, peer, tag=tag) for peer, t, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, tag=tag) for peer, t, tag in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


def new_group(backend: str | None = None, timeout_s: float | None = None):
    """A new process group over every rank (collective: every rank makes it, in the same order)."""
    kwargs = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    return dist.new_group(backend=backend, **kwargs)


# -- the raw torch.distributed collectives, for measuring them (hpf.sim.calibrate) -----------------------
def all_gather_into(full: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False):
    """full <- every rank's shard, in rank order: torch's own all-gather, nothing around it."""
    return dist.all_gather_single(full, shard, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, full: torch.Tensor, group=None, async_op: bool = False):
    """out <- this rank's slice of the sum of every rank's full: torch's own reduce-scatter (on gloo
    an all-reduce; hpf's comms use hpf.comm.handles.reduce_scatter_async)."""
    return dist.reduce_scatter_single(out, full, group=group, async_op=async_op)


def all_to_all_into(out: torch.Tensor, rows: torch.Tensor, group=None, async_op: bool = False):
    """out[j] <- rank j's rows[this rank]: torch's own all-to-all."""
    return dist.all_to_all_single(out, rows, group=group, async_op=async_op)


def wait_all(requests: list) -> None:
    for r in requests:
        r.wait()
