"""Elastic training: a lost rank is survived in memory, and a new rank joins at a step boundary.

``hpf.elastic.train(make_step, init, batches, steps)`` runs the training loop of one rank. At each
step boundary (every ``every`` steps) each rank sends its shard state (params, optimizer state,
step counters, the loss scale) to its buddy, the rank ``shift`` places on along the ring of members
(another machine of a two-tier mesh), which keeps it. A boundary is protected once every rank has
its partner's copy: each says so in the job's store, the one thing that outlives every rank. Then
the boundary before is dropped, and each rank packs its own copy (a step updates its state in
place, and a fault in the next step goes back to it). Under HSDP the replicas are the copies.

When a rank dies (SIGKILL, a lost machine), the others find out within seconds: a gloo error on
the ranks that talked to it, or its heartbeat going silent (hpf.comm.liveness) on the rest, which
every wait of hpf's collectives checks. The first survivor opens a roll call in the store; the
others see it from their waits and join. Once every member has answered or gone silent, the
members left are agreed on (the store's compare-and-set), and they form the next generation of
the process group under a new prefix (``hpf.launch.reform``). Each rebuilds the step on the
smaller world (``make_step(world_size)``), and the state of the last boundary they can rebuild
(each member's own copy, and each lost rank's copy at its buddy: a boundary still being copied may
already be whole for the ranks lost) is resharded onto it in memory: every chunk
(``hpf.checkpoint.state_dict``: the checkpoint's own layout, global offsets per param) goes from
the rank that holds it (its owner, or the owner's buddy for a lost rank) to the ranks that need it. Then the steps since that boundary are redone,
on the same global batches (``batches(step, rank, world_size)`` is the caller's pure function).
In the invariant mode (``invariant=True``) the continued run's bits equal a run that never failed.

A new rank (an elastic ``hpf.launch``'s replacement, or a worker torchrun restarted) registers in
the store; at the next boundary the members admit it, form the next generation with it, and
reshard onto it the same way. Under torchrun each member runs under a torchrun of its own, whose
agent restarts only it, around ``hpf store`` (``hpf.launcher.elastic_member``, docs/elastic.md).

What cannot be survived is raised as UnrecoverableLossError, naming the ranks: a rank lost with
its buddy, or all but none. A mesh that splits params over non-FSDP axes (tensor or expert
parallel) cannot shrink, and is refused when the job starts.
"""
from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import optree
import torch

from . import checkpoint, launcher
from .comm import liveness, schedule, world
from .comm.shm import ShmGroup
from .comm.transport import PointToPoint
from .errors import PeerLostError, PeerTimeoutError, UnrecoverableLossError
from .optim.base import capabilities

__all__ = ["train", "Run", "ROLL_CALL_S"]

ROLL_CALL_S = 60.0  # a roll call that has not settled by then raises
_KEY = "hpf/elastic/"


@dataclass
class Run:
    """What ``train`` returns on each rank that finished: the step of the last generation, its state,
    every step's metrics (``losses``), and the losses and joins survived (``events``: the step the
    job went back to, the seconds from the fault to the state rebuilt, the bytes this rank received,
    and ``time``, the wall clock once rebuilt)."""

    step: Any
    state: Any
    losses: list[float] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    copy_bytes: int = 0  # the most the copies held on this rank (three shard states at most: ``_Job.protect``)


class _Copy:
    """A shard state packed into one byte buffer, with what it takes to unpack it."""

    def __init__(self, buf: torch.Tensor, header: list):
        self.buf, self.header = buf, header

    @staticmethod
    def layout(state) -> tuple[list, int]:
        """(header, bytes) of ``state`` packed: each leaf's dtype, shape and offset, 8-byte aligned (so
        each views back as its dtype)."""
        header, at = [], 0
        for x in optree.tree_leaves(state):
            header.append([str(x.dtype).removeprefix("torch."), list(x.shape), at])
            at += _aligned(x)
        return header, at

    @classmethod
    def of(cls, state, spare: list[torch.Tensor] | None = None) -> "_Copy":
        """``state`` packed, into a buffer of ``spare`` of the right size where there is one (a boundary's
        buffer reused, not 10s of MB allocated and faulted in at every boundary)."""
        header, nbytes = cls.layout(state)
        copy = cls(_take(spare, nbytes), header)
        for x, into in zip(optree.tree_leaves(state), copy.parts()):
            into.copy_(_raw(x))
        return copy

    def parts(self) -> list[torch.Tensor]:
        """Each leaf's bytes in the buffer (unpadded)."""
        return [self.buf[at:at + _nbytes(dtype, shape)] for dtype, shape, at in self.header]

    def unpack(self, like) -> Any:
        """The state, as views of the buffer, in the structure of ``like`` (a state of this job)."""
        leaves, treedef = optree.tree_flatten(like)
        if len(leaves) != len(self.header):
            raise UnrecoverableLossError(f"hpf.elastic: a copy holds {len(self.header)} tensors where the state has "
                                         f"{len(leaves)}; the ranks run different optimizers or models")
        out = [part.view(getattr(torch, dtype)).view(shape) for part, (dtype, shape, _) in zip(self.parts(), self.header)]
        return optree.tree_unflatten(treedef, out)


def _nbytes(dtype: str, shape: list) -> int:
    return int(torch.Size(shape).numel()) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def _raw(x: torch.Tensor) -> torch.Tensor:
    """A leaf's bytes (a view where it is contiguous)."""
    return x.detach().reshape(-1).contiguous().view(torch.uint8)


def _take(spare: list[torch.Tensor] | None, nbytes: int) -> torch.Tensor:
    """A byte buffer of ``nbytes``: one of ``spare`` (removed from it) if one fits, else a new one."""
    for i, buf in enumerate(spare or []):
        if buf.numel() == nbytes:
            return spare.pop(i)
    return torch.empty(nbytes, dtype=torch.uint8)


def _planned_optimizer(step, rank: int):
    """The step's optimizer as rank ``rank`` holds it on the plan (what a checkpoint reads of that rank)."""
    return step.optimizer.for_plan(step.plan, rank) if capabilities(step.optimizer).for_plan else step.optimizer


def check_elastic(step) -> None:
    """Refuse what cannot shrink or be rebuilt, when the job starts (named, with what to do)."""
    split = step.plan.split_axes
    if split:
        raise ValueError(f"hpf.elastic: the mesh {step.mesh} splits params over {split} (tensor or expert parallel), "
                         "which cannot shrink onto fewer ranks; run elastic jobs on data (FSDP/HSDP) axes only")
    if step.plan.slow_precision:
        raise ValueError("hpf.elastic: a low-bit slow tier keeps error-feedback residuals that belong to the mesh; "
                         "drop slow_weights/slow_grads for an elastic job")


def replicated(step) -> bool:
    """Whether every shard of the state lives on more than one rank (HSDP over every bucket): then a
    rank's replica peers hold its state already, as their own copies, and no copy is sent."""
    return all(any(step.mesh.axis_size(a) > 1 for a in b.replicate_axes) for b in step.plan.buckets)


def _is_fault(error: BaseException) -> bool:
    """Whether ``error`` may be a lost peer's doing (a collective that failed or waited): the roll call
    decides; any other error is the program's and is raised as it is."""
    return any(isinstance(e, (PeerLostError, PeerTimeoutError)) or type(e) is RuntimeError or
               type(e).__name__ in ("DistBackendError", "DistNetworkError", "ScheduleMismatchError")
               for e in schedule.causes(error))


class _Job:
    """One rank's part of an elastic job: its generation, its members, its copies, and the store."""

    def __init__(self, make_step: Callable, init: Any, key, every: int, shift: int | None, first: Callable | None):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"hpf.elastic.train: every={every!r}; pass a positive int (steps between protected boundaries)")
        self.make_step, self.init, self.key, self.every, self.shift, self.first = make_step, init, key, every, shift, first
        self.store = launcher.base_store()
        self.me = launcher.elastic_member()[0]
        self.generation, self.members = 0, []
        self.copies: dict[int, tuple[_Copy, dict[int, _Copy]]] = {}  # boundary -> (own copy, partners' copies)
        self.spare: list[torch.Tensor] = []  # the buffers of the boundary dropped last, for the next
        self.heartbeat: liveness.Heartbeat | None = None
        self.meta = None  # the params' shapes (meta tensors): what a rebuilt step is initialized from
        self.link: _Link | None = None  # this generation's way to the buddy and from the partner
        self.copy_bytes = 0  # the most the copies have held on this rank

    # -- the store's keys of this generation -------------------------------------------------------------------
    def _key(self, name: str, generation: int | None = None) -> str:
        return f"{_KEY}gen{self.generation if generation is None else generation}/{name}"

    def start(self):
        """A member from the start: the first step, state and step count, and the heartbeat."""
        self.members = list(range(world.world_size()))
        step = self.make_step(len(self.members))
        if self.first is not None:
            state, t = self.first(step)
        else:
            state, t = step.init(self.init, key=self.key) if self.key is not None else step.init(self.init), 0
        check_elastic(step)
        self.meta = _meta_of(self.init, self.key)
        self._beat()
        world.barrier()  # every member's counter exists before any rank reads them
        return step, state, t

    def _beat(self) -> None:
        if self.heartbeat is None:
            # a connection of its own (Store.clone): a rendezvous blocked in get on the shared one would stall the beats
            self.heartbeat = liveness.Heartbeat(self.store.clone(), self.me, self.members)
            liveness.watch(self.heartbeat)
        self.heartbeat.ids = list(self.members)
        self.heartbeat.open_key = self._key("open")

    def buddy_shift(self, step) -> int:
        """How far along the members a rank's copy goes: a machine's ranks away where the mesh has machines."""
        n = len(self.members)
        s = self.shift or (step.mesh.axis_sizes[-1] if len(step.mesh.axis_names) > 1 else 1)
        return s % n or 1

    # -- protecting a boundary ---------------------------------------------------------------------------------
    def protect(self, step, state, t: int) -> None:
        """Boundary ``t``: this rank's state goes to its buddy and its partner's comes here; once every
        member holds its partner's copy, the boundary before goes and this rank packs its own copy of
        ``t`` into that one's buffer. Until then its own copy of ``t`` is the live state, which no step
        has touched yet: so a rank holds three shard states (its own and its partner's of the boundary
        before and its partner's of this one; between boundaries two, and the buffer the next partner's
        copy lands in)."""
        n = len(self.members)
        if replicated(step) or n == 1:  # (HSDP) a replica's own copy is this rank's buddy copy: nothing to send
            for old in [b for b in self.copies if b < t - 1]:  # (a peer may still be finishing step t - 1)
                self.spare = [self.copies.pop(old)[0].buf]
            self.copies[t] = (_Copy.of(state, self.spare), {})
        else:
            self.copies[t] = (None, {})  # (None: the live state)
            partner = _swap(self, step, state, t)
            if partner is not None:
                self.copies[t][1][self.link.frm] = partner
            _copied(self, t)
            partner = partner or self.link.landed(t)
            for old in [b for b in self.copies if b < t]:
                own, partners = self.copies.pop(old)
                self.spare = [own.buf, *(c.buf for c in partners.values() if self.link.rows is None)]
            self.copies[t] = (_Copy.of(state, self.spare), {self.link.frm: partner})
        held = sum(b.numel() for b in self.spare) + sum((o.buf.numel() if o else 0) + sum(
            c.buf.numel() for c in p.values() if not (self.link and self.link.rows)) for o, p in self.copies.values())
        self.copy_bytes = max(self.copy_bytes, held + (self.link.row_bytes if self.link else 0))

    # -- a fault: the roll call, the next generation, the state rebuilt ----------------------------------------------
    def recover(self, error: BaseException, step, state, t_failed: int):
        """After ``error``: the members left agree, re-form, and rebuild the last protected boundary's state.
        Returns (step, state, the boundary, the event); raises ``error`` where nobody was lost."""
        t0 = time.monotonic()
        self.store.compare_set(self._key("open"), "", f"rank {self.me}: {type(error).__name__}: {str(error)[:300]}")
        for t, (own, partners) in self.copies.items():  # a boundary being copied: its partner's copy may be whole
            if own is None and not partners and self.link is not None and self.link.rows and self.link.landed(t):
                partners[self.link.frm] = self.link.landed(t)
        left = self._roll_call()
        lost = [m for m in self.members if m not in left]
        if not lost:
            raise error
        if self.me not in left:
            raise PeerLostError(f"hpf.elastic: rank {self.me} was counted lost by its peers; it stops", [self.me]) from error
        try:
            boundary = self._usable_boundary(step, lost, left)
            held = self._held(step, state, boundary, lost, left)
            _close(step)
            step, state, received = self._next_generation(left, held)
        except BaseException as second:  # noqa: BLE001 -- a fault now is named; anything else is raised as it is
            if not _is_fault(second):
                raise
            raise _lost_in_rebuild(lost, second) from second
        event = {"event": "lost", "ranks": lost, "at_step": t_failed, "back_to": boundary,
                 "world_size": len(left), "seconds": time.monotonic() - t0, "bytes_received": received, "time": time.time()}
        return step, state, boundary, event

    def _roll_call(self) -> list[int]:
        """The members that answer; decided once every member has answered or gone silent (the first
        proposal written wins, so every rank agrees)."""
        self.store.set(self._key(f"here/{self.me}"), "1")
        deadline = time.monotonic() + ROLL_CALL_S
        while True:
            here = [m for m in self.members if self.store.check([self._key(f"here/{m}")])]
            silent = set(self.heartbeat.silent(self.members))
            if set(here) | silent >= set(self.members) or self.store.check([self._key("members")]):
                agreed = self.store.compare_set(self._key("members"), "", json.dumps(here))
                return json.loads(agreed)
            if time.monotonic() > deadline:
                waiting = sorted(set(self.members) - set(here) - silent)
                raise PeerTimeoutError(f"hpf.elastic: the roll call after a fault did not settle within {ROLL_CALL_S:g} s: "
                                       f"rank(s) {waiting} neither answered nor went silent", waiting)
            time.sleep(0.05)

    def _holder(self, step, rank: int) -> int | None:
        """The member that holds ``rank``'s copies (its buddy); None where its replicas' own copies do."""
        if replicated(step):
            return None
        return self.members[(self.members.index(rank) + self.buddy_shift(step)) % len(self.members)]

    def _usable_boundary(self, step, lost: list[int], left: list[int]) -> int:
        """The last boundary the members left can rebuild: each has its own copy of it, and each lost
        rank's buddy that rank's copy (a boundary still being copied can be whole for these losses).
        The members say which boundaries they can serve in the store, and take the last one all can."""
        mine = [t for t, (_, partners) in self.copies.items()
                if all(d in partners for d in lost if self._holder(step, d) == self.me)]
        self.store.set(self._key(f"usable/{self.me}"), json.dumps(mine))
        keys = [self._key(f"usable/{m}") for m in left]
        deadline = time.monotonic() + ROLL_CALL_S
        while not self.store.check(keys):
            silent = self.heartbeat.silent(left)
            if silent:
                raise PeerLostError(f"hpf.elastic: rank(s) {silent} went silent during the rebuild", silent)
            if time.monotonic() > deadline:
                raise PeerTimeoutError(f"hpf.elastic: the members {left} did not all say which state they hold "
                                       f"within {ROLL_CALL_S:g} s", left)
            time.sleep(0.005)
        common = set.intersection(*(set(json.loads(v)) for v in self.store.multi_get(keys)))
        if not common:
            raise UnrecoverableLossError("hpf.elastic: a rank was lost before the first boundary was protected")
        return max(common)

    def _held(self, step, state, boundary: int, lost: list[int], left: list[int]) -> dict:
        """old rank -> (its checkpoint layout, its state at ``boundary``), for what this rank holds."""
        own, partners = self.copies[boundary]
        held = {self.me: own}  # (own None: the live state, which no step has touched since the boundary)
        for d in lost:
            holder = self._holder(step, d)
            if holder is None:  # (its shards are its replicas': the reshard finds them, or names what is gone)
                continue
            if holder not in left:
                raise UnrecoverableLossError(f"hpf.elastic: rank {d} was lost with rank {holder}, which held its copy; "
                                             f"its shards are gone. Resume from the last checkpoint (hpf train --resume)")
            if holder == self.me:
                held[d] = partners[d]
        return {self.members.index(r): (checkpoint.Layout(step.plan, self.members.index(r),
                                                          _planned_optimizer(step, self.members.index(r))), c.unpack(state) if c else state)
                for r, c in held.items()}

    def _next_generation(self, members: list[int], held: dict):
        """Form the next generation of ``members``, build its step, and fill its state from ``held``."""
        self.generation += 1
        self.members = list(members)
        launcher.reform(self.generation, self.members.index(self.me), len(self.members))
        self._beat()
        step = self.make_step(len(self.members))
        step.init(self.meta)
        check_elastic(step)
        source = _InMemory(held)
        state, _ = step.restore(source)
        self.copies, self.link, self.spare = {}, None, []
        return step, state, source.received


    def finish(self, t: int) -> None:
        """The job is done: a rank still waiting to join ends (and so does hpf store), and the heartbeat stops."""
        if world.rank() == 0:
            self.store.set(launcher.JOB_DONE_KEY, str(t))
        self.heartbeat.stop()
        liveness.watch(None)

    # -- a new rank ----------------------------------------------------------------------------------------------
    def admit(self, step, state, t: int):
        """At protected boundary ``t``: the members agree on the ranks waiting to join (the first proposal
        wins), form the next generation with them, and reshard onto it. Returns (step, state, event) or None."""
        waiting = [j for j in range(int(self.store.add(_KEY + "joiners", 0)))
                   if not self.store.check([f"{_KEY}joiner/{j}/admitted"])]
        slots = json.loads(self.store.compare_set(self._key(f"admit/{t}"), "", json.dumps(waiting)))
        if not slots:
            return None
        t0 = time.monotonic()
        _all_here(self, f"admitting/{t}")  # every member is alive before a joiner is told (else its group waits on one)
        members = self.members + [int(self.store.get(f"{_KEY}joiner/{j}")) for j in slots]
        record = json.dumps({"generation": self.generation + 1, "members": members, "step": t})
        for j in slots:
            self.store.set(f"{_KEY}joiner/{j}/admitted", record)
        held = {self.members.index(self.me): (checkpoint.Layout(step.plan, self.members.index(self.me),
                                                                step.plan_optimizer), state)}  # (no step since t)
        _close(step)
        step, state, received = self._next_generation(members, held)
        return step, state, {"event": "joined", "ranks": members[len(members) - len(slots):], "at_step": t,
                             "world_size": len(members), "seconds": time.monotonic() - t0, "bytes_received": received,
                             "time": time.time()}

    def join(self):
        """A replacement rank: register, wait to be admitted at a boundary, then receive its shards."""
        slot = int(self.store.add(_KEY + "joiners", 1)) - 1
        self.store.set(f"{_KEY}joiner/{slot}", str(self.me))
        key = f"{_KEY}joiner/{slot}/admitted"
        deadline = time.monotonic() + launcher.COLLECTIVE_TIMEOUT_S
        while not self.store.check([key]):
            if self.store.check([launcher.JOB_DONE_KEY]):  # the job ended before a boundary admitted it
                return None
            if time.monotonic() > deadline:
                raise PeerTimeoutError(f"hpf.elastic: rank {self.me} waited {launcher.COLLECTIVE_TIMEOUT_S:g} s to join "
                                       "and no boundary admitted it", [])
            time.sleep(0.05)
        record = json.loads(self.store.get(key))
        self.generation = record["generation"] - 1
        self.members = [m for m in record["members"] if m != self.me]  # (the members it joins)
        t0 = time.monotonic()
        self.meta = _meta_of(self.init, self.key)
        step, state, received = self._next_generation(record["members"], {})
        return step, state, record["step"], {"event": "joined", "ranks": [self.me], "at_step": record["step"],
                                             "world_size": len(record["members"]), "seconds": time.monotonic() - t0,
                                             "bytes_received": received, "time": time.time()}


def train(make_step: Callable[[int], Any], init: Any, batches: Callable[[int, int, int], Any], steps: int, *,
          key: torch.Tensor | None = None, every: int = 1, shift: int | None = None,
          on_step: Callable[[int, dict], None] | None = None,
          at_boundary: Callable[[Any, Any, int], None] | None = None,
          first: Callable[[Any], tuple[Any, int]] | None = None) -> Run:
    """Run ``steps`` steps of an elastic job on this rank (see the module doc); every rank calls it.

    Args:
        make_step: ``world_size -> hpf.shard_step(...)``, not yet initialized: the step on a mesh of that size
            (it is called again each time the world shrinks or grows).
        init: the params (the same on every rank), or an init function (with ``key``: born sharded).
        batches: ``(step, rank, world_size) -> local batch`` of step ``step`` (0-based), a pure function:
            redone steps read the same global batch.
        steps: how many steps the job runs.
        every: protect every this many steps (1: a fault redoes only the step in flight).
        shift: how many members along a rank's buddy is (default: a machine's ranks on a multi-axis mesh, else 1).
        on_step: called with (step, metrics) after each step that finished (redone steps again); the metrics
            add ``copy_s``, the seconds the boundary before the step took to protect.
        at_boundary: called with (step, state, t) on every member at each protected boundary (redone ones
            again): a checkpoint there (``step.save``, not async) is survived like a step.
        first: ``step -> (state, steps done)``, where the members start (a checkpoint restored: ``--resume``);
            by default ``step.init(init, key=key)`` at 0.

    Returns:
        Run: the last generation's step (close it) and state, the losses, the faults and joins survived
        (``step`` None on a rank that was to join a job that ended first).

    Raises:
        UnrecoverableLossError: a rank lost with its buddy; ValueError: a mesh that cannot shrink."""
    job = _Job(make_step, init, key, every, shift, first)
    run = Run(None, None)
    begun = _begin(job, run.events)
    if begun is None:
        return run
    step, state, t = begun
    losses: dict[int, float] = {}
    due = True  # the boundary at t is to be protected (and joiners admitted) before the next step
    copy_s = 0.0  # the last boundary's protection: what the redundancy costs a step
    while t < steps:
        try:
            if due:
                step, state, due, copy_s = _at_boundary(job, step, state, t, run.events, at_boundary)
                continue
            state, metrics = step(state, batches(t, world.rank(), world.world_size()))
            losses[t] = metrics["loss"]
            t += 1
            if on_step is not None:
                on_step(t, {**metrics, "copy_s": copy_s})
            due = t % every == 0
        except BaseException as error:  # noqa: BLE001 -- a fault is survived; anything else is raised as it is
            if not _is_fault(error):
                raise
            step, state, t, event = job.recover(error, step, state, t)
            run.events.append(event)
            due = True
    job.finish(t)
    run.step, run.state, run.losses, run.copy_bytes = step, state, [losses[i] for i in sorted(losses)], job.copy_bytes
    return run


def _all_here(job: _Job, name: str) -> None:
    """A barrier of the members, counted in the store under ``name``: a member gone silent (or a roll
    call opened) raises PeerLostError instead of a wait for it."""
    done = job.store.add(job._key(name), 1)
    while done < len(job.members):
        job.heartbeat.check()
        time.sleep(0.002)
        done = job.store.add(job._key(name), 0)


def _copied(job: _Job, t: int) -> None:
    """Wait until every member holds its partner's copy of boundary ``t``: the shared segment's barrier
    (microseconds; it watches the heartbeats too) where the copies went there, else a count in the store."""
    if job.link.rows is not None:
        job.link.group.barrier()
    else:
        _all_here(job, f"saved/{t}")


def _lost_in_rebuild(lost: list[int], second: BaseException) -> UnrecoverableLossError:
    return UnrecoverableLossError(f"hpf.elastic: while rebuilding after losing rank(s) {lost}: {type(second).__name__}: "
                                  f"{str(second)[:300]}. A loss during the rebuild is not survived; resume from the "
                                  "last checkpoint (hpf train --resume)")


def _begin(job: _Job, events: list):
    """Start as a member, or join a running job as a new rank: (step, state, the step it starts at),
    or None for a new rank the job ended without."""
    if not launcher.elastic_member()[2]:
        return job.start()
    joined = job.join()
    if joined is None:
        return None
    step, state, t, event = joined
    events.append(event)
    return step, state, t


def _at_boundary(job: _Job, step, state, t: int, events: list, then: Callable | None) -> tuple[Any, Any, bool, float]:
    """Protect boundary ``t``, admit the ranks waiting to join, and call ``then`` where none joined:
    (step, state, whether the boundary is due again (a join changed the world), the seconds the
    protection took)."""
    started = time.perf_counter()
    job.protect(step, state, t)
    copy_s = time.perf_counter() - started
    joined = job.admit(step, state, t)
    if joined is None:
        if then is not None:
            then(step, state, t)
        return step, state, False, copy_s
    step, state, event = joined
    events.append(event)
    return step, state, True, copy_s


def _swap(job: _Job, step, state, t: int) -> _Copy | None:
    """This rank's live state to its buddy, leaf by leaf (no packed copy of it is made for the send),
    and its partner's here: its copy, or None where it lands in shared memory (``job.link.landed``)."""
    n, i = len(job.members), job.members.index(job.me)
    s = job.buddy_shift(step)
    header, nbytes = _Copy.layout(state)
    if job.link is None:  # the partner's layout: the same at every boundary of a generation
        job.link = _Link(header, nbytes, (i + s) % n, (i - s) % n, job.members)
    elif header != job.link.mine:
        raise UnrecoverableLossError("hpf.elastic: this rank's state changed its layout between boundaries "
                                     "(a new optimizer state?); its buddy's copy would not fit")
    return job.link.send(t, optree.tree_leaves(state), job.spare)


SHARED_MEMORY = True  # buddies on one host write each other's copies into shared memory (False: the process group)
_ROW_HEAD = 64  # a shared row's first word says which boundary its copy is of; the copy starts a cache line on


class _Link:
    """A generation's way from a rank to its buddy (``to``) and from its partner (``frm``): the partner's
    layout, and, where the members share a host, two rows each in one shared-memory segment
    (hpf.comm.shm) that a rank's partner writes its copy into, one memcpy and no socket. The rows
    alternate boundaries; a row's first word is the boundary written + 1, set after its bytes, so the
    copy is whole once the word says so, even if its writer died just after."""

    def __init__(self, header: list, nbytes: int, to: int, frm: int, members: list[int]):
        self.mine, self.to, self.frm_rank, self.frm = header, to, frm, members[frm]  # (frm: the partner's member id)
        self.rows, self.row_bytes, self.sent = None, 0, 0
        self.theirs = _partner_layout(header, nbytes, to, frm)
        said = world.all_gather_object((socket.gethostname(), nbytes))
        if SHARED_MEMORY and len({host for host, _ in said}) == 1:
            row = _ROW_HEAD + -(-max(b for _, b in said) // _ROW_HEAD) * _ROW_HEAD
            self.group = ShmGroup(None, 2 * len(said) * row, name_prefix="hpf_elastic")
            self.rows = [self.group.rows(self.group.buffer(k, row, torch.uint8, per_rank=True)) for k in ("even", "odd")]
            self.row_bytes = 2 * row  # (this rank's two rows)

    def send(self, t: int, leaves: list, spare: list[torch.Tensor]) -> _Copy | None:
        self.sent += 1
        if self.rows is not None:
            row = self.rows[self.sent % 2][self.to]
            for x, part in zip(leaves, _Copy(row[_ROW_HEAD:], self.mine).parts()):
                part.copy_(_raw(x))
            row[:8].view(torch.int64)[0] = t + 1
            return None
        partner = _Copy(_take(spare, self.theirs[1]), self.theirs[0])
        sends = [(self.to, _raw(x), 16 + k) for k, x in enumerate(leaves) if x.numel()]
        recvs = [(self.frm_rank, part, 16 + k) for k, part in enumerate(partner.parts()) if part.numel()]
        schedule.wait(PointToPoint(world.exchange(sends, recvs)), "the elastic copies of a boundary")
        return partner

    def landed(self, t: int) -> _Copy | None:
        """The partner's copy of boundary ``t`` in this rank's shared row, if it is whole."""
        row = self.rows[self.sent % 2][world.rank()]
        if int(row[:8].view(torch.int64)[0]) != t + 1:
            return None
        return _Copy(row[_ROW_HEAD:_ROW_HEAD + self.theirs[1]], self.theirs[0])


def _partner_layout(header: list, nbytes: int, to: int, frm: int) -> tuple[list, int]:
    """Tell rank ``to`` this rank's copy layout (``header``, ``nbytes``) and hear rank ``frm``'s."""
    head = torch.tensor(list(json.dumps(header).encode()), dtype=torch.uint8)
    sizes, theirs = torch.tensor([head.numel(), nbytes]), torch.zeros(2, dtype=torch.int64)
    schedule.wait(PointToPoint(world.exchange([(to, sizes, 1)], [(frm, theirs, 1)])), "an elastic copy's sizes")
    their_head = torch.empty(int(theirs[0]), dtype=torch.uint8)
    schedule.wait(PointToPoint(world.exchange([(to, head, 2)], [(frm, their_head, 2)])), "an elastic copy's layout")
    return json.loads(bytes(their_head.tolist()).decode()), int(theirs[1])


def _close(step) -> None:
    """Close a lost generation's step: what it waits on raises at once (a member is silent), and is dropped."""
    try:
        step.close()
    except Exception:  # noqa: BLE001 -- its collectives died with the generation
        pass


def _meta_of(init: Any, key) -> Any:
    """The params tree as meta tensors (tied leaves stay one): a rebuilt step is initialized from it,
    and its state filled by the reshard."""
    if key is not None:
        from .sharded_init import trace_init

        return trace_init(init, key).meta_params
    return optree.tree_map(lambda x: torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x, init)


def _boxes(layout, state) -> dict[str, dict[tuple, torch.Tensor]]:
    """key -> {global offsets: view} of ``state`` under ``layout`` (a scalar is one box at ``()``)."""
    out = {}
    for k, v in checkpoint.state_dict(layout, state).items():
        if isinstance(v, torch.Tensor):
            out[k] = {(): v}
        elif hasattr(v, "views"):
            out[k] = {o: t for o, t in v.views.items() if t.numel()}
    return out


def _overlap(a: tuple, a_shape, b: tuple, b_shape):
    """(lo, hi) of two boxes' overlap, or None."""
    lo = tuple(max(x, y) for x, y in zip(a, b))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a, a_shape, b, b_shape))
    return None if any(h <= l for l, h in zip(lo, hi)) else (lo, hi)


def _part(view: torch.Tensor, offset: tuple, lo: tuple, hi: tuple) -> torch.Tensor:
    return view[tuple(slice(l - o, h - o) for o, l, h in zip(offset, lo, hi))]


class _InMemory:
    """A restore's source (``step.restore(source)``): the state the members hold, resharded onto the step's plan."""

    def __init__(self, held: dict):
        self.held, self.received = held, 0

    def fill(self, layout, state):
        self.received = _reshard(self.held, layout, state)
        return state


def _reshard(held: dict, layout, state) -> int:
    """Fill ``state`` (this rank's, under ``layout``: the new plan) from the boxes every member holds
    (``held``: old rank -> (layout, state)); each element comes from one holder. Returns the bytes received."""
    me = world.rank()
    offers: dict[str, dict[tuple, torch.Tensor]] = {}
    for _, (old, st) in sorted(held.items()):
        for k, boxes in _boxes(old, st).items():
            for o, v in boxes.items():
                offers.setdefault(k, {}).setdefault(o, v)
    wants = _boxes(layout, state)
    said = world.all_gather_object(({k: [[list(o), list(v.shape)] for o, v in b.items()] for k, b in offers.items()},
                                    {k: [[list(o), list(v.shape)] for o, v in b.items()] for k, b in wants.items()}))
    moves = _moves(said)
    sends, recvs, local = {}, {}, []
    for (src, dst), items in moves.items():
        if src == me:
            parts = [_part(offers[k][so], so, lo, hi) for k, so, _, lo, hi in items]
            if dst == me:
                local = [(p, _part(wants[k][do], do, lo, hi)) for p, (k, _, do, lo, hi) in zip(parts, items)]
            else:
                sends[dst] = torch.cat([_padded_bytes(p) for p in parts]) if parts else None
        elif dst == me:
            into = [_part(wants[k][do], do, lo, hi) for k, _, do, lo, hi in items]
            recvs[src] = (into, torch.empty(sum(_aligned(t) for t in into), dtype=torch.uint8))
    schedule.wait(PointToPoint(world.exchange([(d, b, 4) for d, b in sends.items() if b is not None and b.numel()],
                                              [(s, buf, 4) for s, (_, buf) in recvs.items() if buf.numel()])),
                  "the elastic reshard")
    for into, buf in recvs.values():
        at = 0
        for t in into:
            t.copy_(buf[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
            at += _aligned(t)
    for src_part, t in local:
        t.copy_(src_part)
    return sum(buf.numel() for _, buf in recvs.values())


def _aligned(t: torch.Tensor) -> int:
    """A part's bytes on the wire: padded to 8, so every part views back as its dtype."""
    return -(-t.numel() * t.element_size() // 8) * 8


def _padded_bytes(t: torch.Tensor) -> torch.Tensor:
    raw = _raw(t)
    return torch.cat([raw, raw.new_zeros(_aligned(t) - raw.numel())])


def _moves(said: list) -> dict[tuple[int, int], list]:
    """(src, dst) -> [(key, src box offset, dst box offset, lo, hi)], the same on every rank: each wanted
    box is cut from the lowest rank offering each of its elements; a wanted element nobody offers raises."""
    first: dict[str, dict[tuple, tuple]] = {}  # key -> offset -> (src, shape): each offered box once, lowest src
    for src, (offers, _) in enumerate(said):
        for k, boxes in offers.items():
            for o, shape in boxes:
                first.setdefault(k, {}).setdefault(tuple(o), (src, tuple(shape)))
    moves: dict[tuple[int, int], list] = {}
    for dst, (_, wants) in enumerate(said):
        for k, boxes in wants.items():
            for o, shape in boxes:
                o, shape, got = tuple(o), tuple(shape), 0
                for so, (src, s_shape) in first.get(k, {}).items():
                    cut = _overlap(o, shape, so, s_shape)
                    if cut is not None:
                        moves.setdefault((src, dst), []).append((k, so, o, *cut))
                        got += int(torch.Size([h - l for l, h in zip(*cut)]).numel())
                if got != int(torch.Size(shape).numel()):
                    raise UnrecoverableLossError(f"hpf.elastic: {got} of the {torch.Size(shape).numel()} elements of "
                                                 f"{k!r} at {list(o)} are held by a member (a rank was lost with every rank holding a "
                                                 "copy of its shards); resume from the last checkpoint")
    return moves
