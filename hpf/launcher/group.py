"""The default process group: set up from torchrun's environment (or an elastic job's store), and ended.

Code written for `hpf.launch` runs unchanged under torchrun: call `init_distributed()` (a no-op
when the group already exists) at the top of the script, and `shutdown()` at its end (`launch`
calls it when `fn` returns). An elastic job's group comes in generations over one base store
(`reform`, `base_store`: hpf.elastic).
"""
from __future__ import annotations

import datetime
import gc
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..comm import schedule
from ..comm.world import COLLECTIVE_TIMEOUT_S

__all__ = ["init_distributed", "shutdown", "at_shutdown", "is_launched", "rank", "world_size", "reform", "at_reform",
           "base_store", "generation_prefix", "elastic_member", "serve_store", "JOB_DONE_KEY"]


def is_launched() -> bool:
    """True inside `launch` or torchrun (the rendezvous environment is set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def rank() -> int:
    """This process's global rank (0 outside any launch)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    """Number of ranks (1 outside any launch)."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def _as_timedelta(timeout: float | datetime.timedelta) -> datetime.timedelta:
    return timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)


def init_distributed(timeout: float | datetime.timedelta = COLLECTIVE_TIMEOUT_S, backend: str | None = None) -> None:
    """Initialize the default process group from torchrun-style env vars; no-op if it exists.

    backend=None picks by device: gloo on CPU; with an accelerator, gloo for CPU tensors plus
    the device's own backend (nccl, hccl, ...) for device tensors, and the device is set
    from LOCAL_RANK. ``timeout`` bounds each collective's wait for its peers, so a lost peer
    raises instead of hanging forever.
    """
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_distributed: environment variables {missing} are not set; start the script "
            "with torchrun, or run the function through hpf.launch(fn, world_size)")
    backend = backend or _device_backend()
    _ELASTIC["backend"] = backend
    if os.environ.get("HPF_ELASTIC_STORE"):  # an elastic job: generation 0 under the job's store
        me, size, joining = elastic_member()
        if not joining:  # (a replacement's group starts when the job admits it)
            dist.init_process_group(backend=backend, timeout=_as_timedelta(timeout), rank=me, world_size=size,
                                    store=dist.PrefixStore(generation_prefix(0), base_store()))
        return
    rendezvous = os.environ.get("HPF_RENDEZVOUS_FILE")  # set by launch: no port to race for
    init = {"init_method": f"file://{rendezvous}", "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])} if rendezvous else {}
    dist.init_process_group(backend=backend, timeout=_as_timedelta(timeout), **init)


# -- elastic jobs: generations of the process group over one base store (hpf.elastic) ------------------------
_ELASTIC: dict[str, Any] = {"base": None, "retired": [], "backend": None, "timeout": None}
_AT_REFORM: list[Callable[[], None]] = []


def generation_prefix(generation: int) -> str:
    """Where generation ``generation`` of an elastic job's process group keeps its keys in the base store."""
    return f"hpf/elastic/gen{generation}"


def base_store() -> dist.Store:
    """The store that outlives every generation of an elastic job's process group, at
    ``HPF_ELASTIC_STORE`` (host:port): an elastic ``hpf.launch``'s, or ``hpf store``'s under torchrun."""
    if _ELASTIC["base"] is None:
        address = os.environ.get("HPF_ELASTIC_STORE")
        if not address:
            raise RuntimeError("hpf.elastic: no elastic job's store; start the job with hpf.launch(fn, n, elastic=True), "
                               "or under torchrun with HPF_ELASTIC_STORE=host:port of `hpf store` (docs/elastic.md)")
        host, _, port = address.rpartition(":")
        _ELASTIC["base"] = dist.TCPStore(host or "127.0.0.1", int(port), is_master=False,
                                         timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return _ELASTIC["base"]


def elastic_member() -> tuple[int, int, bool]:
    """This process's place in an elastic job: (its rank id, the job's first world size, whether it
    joins a running job). Under hpf.launch: RANK and WORLD_SIZE, and HPF_ELASTIC_JOIN on a replacement.
    Under torchrun, which runs one member each (docs/elastic.md): HPF_ELASTIC_MEMBER ``r`` of
    HPF_ELASTIC_WORLD_SIZE ``n``; a worker torchrun restarted (TORCHELASTIC_RESTART_COUNT ``c`` > 0)
    joins as id ``r + n * c``, which no earlier worker had."""
    member = os.environ.get("HPF_ELASTIC_MEMBER")
    if member is None:
        return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                bool(os.environ.get("HPF_ELASTIC_JOIN")))
    size = os.environ.get("HPF_ELASTIC_WORLD_SIZE", "")
    if not (member.isdigit() and size.isdigit() and int(member) < int(size)):
        raise ValueError(f"hpf.elastic: HPF_ELASTIC_MEMBER={member!r} of HPF_ELASTIC_WORLD_SIZE={size!r}; set them to "
                         "the member's number 0..n-1 and the job's first world size n")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    return int(member) + int(size) * restart, int(size), restart > 0


def serve_store(host: str, port: int, on_ready: Callable[[int], None], until: Callable[[dist.Store], bool]) -> None:
    """Host an elastic job's store (a TCP store server) until ``until(store)``; ``on_ready(port)`` once it listens."""
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False)
    on_ready(store.port)
    while not until(store):
        time.sleep(0.2)


JOB_DONE_KEY = "hpf/elastic/done"  # set once the last generation has finished


def at_reform(fn: Callable[[], None]) -> Callable[[], None]:
    """Have :func:`reform` call ``fn()`` once the new group runs (a module forgets the groups it made)."""
    if fn not in _AT_REFORM:
        _AT_REFORM.append(fn)
    return fn


def reform(generation: int, rank_: int, world_size_: int, backend: str | None = None) -> None:
    """Replace the default process group by generation ``generation``: ``world_size_`` ranks, this one
    ``rank_``, meeting under the generation's prefix of the base store. The groups of the generation
    before are kept, never destroyed: one of their gloo threads may still wait on a lost peer, and a
    destructor would join it; they end at their timeout, and their keys never meet the new ones."""
    base = base_store()
    if dist.is_initialized():
        _ELASTIC["retired"] += list(dist.distributed_c10d._world.pg_map)
        dist.destroy_process_group()
    dist.init_process_group(backend=backend or _ELASTIC["backend"] or _device_backend(), store=dist.PrefixStore(generation_prefix(generation), base),
                            rank=rank_, world_size=world_size_, timeout=_as_timedelta(COLLECTIVE_TIMEOUT_S))
    schedule.LOG.__init__()  # a new world: a fresh log (the broken one was the lost generation's)
    for fn in _AT_REFORM:
        fn()


def _device_backend() -> str:
    """gloo on CPU; with an accelerator, gloo for CPU tensors plus the device's own backend (the
    device set from LOCAL_RANK)."""
    if not torch.accelerator.is_available():
        return "gloo"
    device = torch.accelerator.current_accelerator()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    count = torch.accelerator.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f"init_distributed: LOCAL_RANK={local_rank} but only {count} {device.type} "
            "device(s); start at most one rank per device, or pass backend='gloo'")
    torch.accelerator.set_device_index(local_rank)
    return f"cpu:gloo,{device.type}:{dist.get_default_backend_for_device(device)}"


_AT_SHUTDOWN: list[Callable[[], None]] = []


def at_shutdown(fn: Callable[[], None]) -> Callable[[], None]:
    """Have :func:`shutdown` call ``fn()`` while the process group still runs (hpf.checkpoint
    registers finishing its async saves); returns ``fn``."""
    if fn not in _AT_SHUTDOWN:
        _AT_SHUTDOWN.append(fn)
    return fn


def shutdown() -> None:
    """End this rank's part of the job: finish what needs the process group (async checkpoint
    saves), meet the other ranks, then destroy the group. A no-op without one.

    ``launch`` calls it when ``fn`` returns. Under torchrun, end the script with it instead of
    ``torch.distributed.destroy_process_group()``, which cuts an async save short. The meeting
    is a recorded rendezvous, so a peer still inside a collective call this rank skipped (rank
    0 alone in ``step.save``) ends in ScheduleMismatchError on both, within seconds. After
    such an error it does nothing: collectives no longer pair up, and the exit frees all."""
    if not dist.is_initialized():
        return
    if schedule.LOG.broken is not None:  # collectives no longer pair up: only let the peers read the report
        schedule.linger()
        return
    for fn in _AT_SHUTDOWN:
        fn()
    schedule.rendezvous("hpf.launch.shutdown", "at the end of the program")
    # Free garbage cycles that hold collectives' objects now: freed at interpreter exit instead,
    # a gloo thread may need the GIL then and abort the process (seen: 1 torchrun exit in 8).
    gc.collect()
    dist.destroy_process_group()
