"""Collectives in flight: the handles hpf waits on, and the async reductions that return them.

A handle is one of hpf's (``wait(timeout)``, ``done()``) or a torch.distributed Work (which says
``is_completed()``): `is_done` and `wait_for` read both, `DONE` stands for a collective that
needed no communication, and `StreamWork` puts an accelerator's compute stream after its
collective. `reduce_scatter_async` and `exchange_async` run an all-to-all and finish its result
on arrival (`hpf.comm.transport`'s `ProcessGroupTransport` and the comms call them).
"""
from __future__ import annotations

import datetime
import threading
import time
from typing import Protocol, Union

import torch
import torch.distributed as dist

__all__ = ["Handle", "DONE", "is_done", "work_done", "StreamWork", "on_device", "PointToPoint", "wait_for",
           "reduce_scatter_async", "exchange_async"]


class _Pollable(Protocol):
    """A collective in flight (hpf's own handles)."""

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (None) or at most ``timeout`` s; True if done (its error re-raised)."""
        ...

    def done(self) -> bool: ...


# What a UnitComm's collectives return: one of hpf's handles, or a torch.distributed Work
# (which says is_completed() instead of done()); `is_done` reads both.
Handle = Union[_Pollable, dist.Work]


class _Done:
    """A finished collective: lets single-rank groups skip communication with one code path."""

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def done(self) -> bool:
        return True


DONE = _Done()


def is_done(handle: Handle) -> bool:
    """Whether a collective handle (ours, or a torch.distributed Work) has finished; never blocks."""
    return handle.done() if hasattr(handle, "done") else work_done(handle)


def work_done(work: dist.Work) -> bool:
    """Whether a torch.distributed Work has finished; never blocks. It reads the Work's future,
    not ``is_completed()``: under torch's profiler, gloo finishes a Work by running a callback
    that needs the GIL while holding the lock that ``is_completed()`` takes with the GIL held,
    a deadlock whenever the collective was issued inside saved-tensor hooks (the engine's are)."""
    try:
        return work.get_future().done()
    except RuntimeError:  # a Work without a future (gloo's point-to-point)
        return work.is_completed()


class StreamWork:
    """A collective on an accelerator (NCCL, HCCL) on its comm stream. ``wait`` puts the compute
    stream after it, as FSDP2 does, so compute waits only for the unit it needs and the CPU runs
    on; ``settled(works)`` is a handle that blocks the CPU until they finished on the device (the
    step's end, where a hang must surface as a named error, not inside a later device sync)."""

    __slots__ = ("work",)

    def __init__(self, work: dist.Work):
        self.work = work

    def wait(self, timeout: float | None = None) -> bool:
        self.work.wait()
        return True

    def done(self) -> bool:
        return work_done(self.work)

    @staticmethod
    def settled(works: list["StreamWork"]) -> "_Polled":
        return _Polled([w.work for w in works])


class _Polled:
    """Works whose ``wait(timeout)`` polls their completion on the CPU."""

    def __init__(self, works: list[dist.Work]):
        self.works = works

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(work_done(w) for w in self.works):
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(1e-4)
        for w in self.works:
            w.wait()  # re-raises a failure
        return True

    def done(self) -> bool:
        return all(work_done(w) for w in self.works)


def on_device(work: dist.Work, device: torch.device) -> Handle:
    """``work`` as the engine waits on it: a StreamWork on an accelerator, itself on the CPU."""
    return work if device.type == "cpu" else StreamWork(work)


class PointToPoint:
    """Point-to-point requests (``world.exchange``'s) as one handle that a timed wait leaves valid.
    gloo's send and receive complete only inside ``wait``, and a timed wait that times out
    completes them with its error: polled directly, a transfer slower than the poll is lost (seen
    under load). The first timed wait hands the blocking waits to a thread; timed waits poll it."""

    def __init__(self, works: list):
        self.works, self._done, self._error = works, None, None

    def wait(self, timeout: float | None = None) -> bool:
        if self._done is None:
            if timeout is None:
                for w in self.works:
                    w.wait()
                return True
            self._done = threading.Event()
            threading.Thread(target=self._wait_all, name="hpf-p2p-wait", daemon=True).start()
        if not self._done.wait(timeout):
            return False
        if self._error is not None:
            raise self._error
        return True

    def _wait_all(self) -> None:
        try:
            for w in self.works:
                w.wait()
        except BaseException as e:  # noqa: BLE001 -- raised by the wait that sees it
            self._error = e
        finally:
            self._done.set()


def wait_for(handle: Handle, timeout: float | None = None) -> bool:
    """Wait for any handle, at most ``timeout`` s (None: until done); True if it is done, and
    then its error, if it failed, is raised. A torch.distributed collective still running after
    a timed wait stays valid (waiting again picks it up); point-to-point requests only inside a
    ``PointToPoint``."""
    if not isinstance(handle, dist.Work):
        return handle.wait(timeout)
    if timeout is None:
        handle.wait()
        return True
    try:
        handle.wait(datetime.timedelta(seconds=timeout))
        return True
    except RuntimeError:  # c10d's "Operation timed out!", or the work's own error
        if not work_done(handle):
            return False
        handle.wait()  # (done since: a timeout that lost the race to completion is no error; a failure re-raises)
        return True


class _OnArrival:
    """An all-to-all in flight: once it has landed, ``finish(recv)`` runs once (on the thread
    that first sees it done) and the receive buffer is dropped."""

    def __init__(self, work: dist.Work, recv: torch.Tensor, finish):
        self.work, self.recv, self.finish = work, recv, finish

    def wait(self, timeout: float | None = None) -> bool:
        if not wait_for(self.work, timeout):
            return False
        if self.recv is not None:
            recv, self.recv = self.recv, None
            self.finish(recv)
        return True

    def done(self) -> bool:
        if self.recv is None:
            return True
        if not work_done(self.work):
            return False
        return self.wait()


def _sum_in_rank_order(out: torch.Tensor, recv: torch.Tensor) -> None:
    """By elementwise adds (torch.sum over dim 0: 3-5x slower)."""
    slices = recv.view(-1, out.numel())
    if len(slices) == 1:
        out.copy_(slices[0])
    else:
        torch.add(slices[0], slices[1], out=out)
    for s in slices[2:]:
        out.add_(s)


def reduce_scatter_async(out: torch.Tensor, full: torch.Tensor, group=None) -> Handle:
    """out <- this rank's slice of the sum over ``group`` of every rank's ``full``, async.

    On gloo, reduce_scatter is an all-reduce of a copy made on the calling thread (2x the
    bytes of a ring); an all-to-all of the slices plus a local sum of the p that arrive sends
    (p-1)/p of them and measured 2-2.6x faster on 2 and 4 CPU ranks (1-16 MiB). Other
    backends have a native reduce-scatter. The sum runs in rank order: the same on every run."""
    if dist.get_backend(group) != "gloo":
        return dist.reduce_scatter_single(out, full, group=group, async_op=True)
    # freed once summed (a pool of these would keep the peak of in-flight reductions for good)
    recv = torch.empty_like(full, memory_format=torch.contiguous_format)
    work = dist.all_to_all_single(recv, full, group=group, async_op=True)
    return _OnArrival(work, recv, lambda arrived: _sum_in_rank_order(out.view(-1), arrived))


def exchange_async(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group, finish) -> Handle:
    """An all-to-all of uneven parts (``send_splits[j]`` elements of ``send`` to group rank j,
    ``recv_splits[i]`` from group rank i); ``finish(recv)`` runs on arrival (the invariant mode's
    reductions sum what arrives in their own order: hpf.comm.ordered)."""
    recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
    work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=True)
    return _OnArrival(work, recv, finish)
