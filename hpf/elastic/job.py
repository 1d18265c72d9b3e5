"""An elastic job's rank: its boundaries protected, the roll call after a fault, and the next generation."""
from __future__ import annotations

import json
import time
from typing import Any, Callable

import optree
import torch

from .. import checkpoint, launcher
from ..comm import liveness, schedule, world
from ..errors import PeerLostError, PeerTimeoutError, UnrecoverableLossError
from ..optim.base import capabilities
from .copies import Copy, Link
from .reshard import InMemory, meta_of

ROLL_CALL_S = 60.0  # a roll call that has not settled by then raises
_KEY = "hpf/elastic/"

def planned_optimizer(step, rank: int):
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


def is_fault(error: BaseException) -> bool:
    """Whether ``error`` may be a lost peer's doing (a collective that failed or waited): the roll call
    decides; any other error is the program's and is raised as it is."""
    return any(isinstance(e, (PeerLostError, PeerTimeoutError)) or type(e) is RuntimeError or
               type(e).__name__ in ("DistBackendError", "DistNetworkError", "ScheduleMismatchError")
               for e in schedule.causes(error))


class Job:
    """One rank's part of an elastic job: its generation, its members, its copies, and the store."""

    def __init__(self, make_step: Callable, init: Any, key, every: int, shift: int | None, first: Callable | None,
                 rejoin_wait: float = 0.0):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"hpf.elastic.train: every={every!r}; pass a positive int (steps between protected boundaries)")
        if not rejoin_wait >= 0:
            raise ValueError(f"hpf.elastic.train: rejoin_wait={rejoin_wait!r}; pass seconds >= 0 (0: go on at once)")
        self.rejoin_wait, self.rejoin_by = rejoin_wait, None  # (rejoin_by: till when this boundary waits for a new rank)
        self.make_step, self.init, self.key, self.every, self.shift, self.first = make_step, init, key, every, shift, first
        self.store = launcher.base_store()
        self.me = launcher.elastic_member()[0]
        self.generation, self.members = 0, []
        self.copies: dict[int, tuple[Copy, dict[int, Copy]]] = {}  # boundary -> (own copy, partners' copies)
        self.spare: list[torch.Tensor] = []  # the buffers of the boundary dropped last, for the next
        self.heartbeat: liveness.Heartbeat | None = None
        self.meta = None  # the params' shapes (meta tensors): what a rebuilt step is initialized from
        self.link: Link | None = None  # this generation's way to the buddy and from the partner
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
        self.meta = meta_of(self.init, self.key)
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
        copy lands in). In shared memory it holds two: its rows, which its partner writes, and its own
        copy is what it wrote into its buddy's row (``Link.written``)."""
        n = len(self.members)
        if replicated(step) or n == 1:  # (HSDP) a replica's own copy is this rank's buddy copy: nothing to send
            for old in [b for b in self.copies if b < t - 1]:  # (a peer may still be finishing step t - 1)
                self.spare = [self.copies.pop(old)[0].buf]
            self.copies[t] = (Copy.of(state, self.spare), {})
        else:
            self.copies[t] = (None, {})  # (None: the live state)
            partner = swap(self, step, state, t)
            if partner is not None:
                self.copies[t][1][self.link.frm] = partner
            copied(self, t)
            partner = partner or self.link.landed(t)
            for old in [b for b in self.copies if b < t]:
                own, partners = self.copies.pop(old)
                self.spare = [] if self.link.shared else [own.buf, *(c.buf for c in partners.values())]
            own = self.link.written() if self.link.shared else Copy.of(state, self.spare)
            self.copies[t] = (own, {self.link.frm: partner})
        self.copy_bytes = max(self.copy_bytes, held_bytes(self))

    # -- a fault: the roll call, the next generation, the state rebuilt ----------------------------------------------
    def recover(self, error: BaseException, step, state, t_failed: int):
        """After ``error``: the members left agree, re-form, and rebuild the last protected boundary's state.
        Returns (step, state, the boundary, the event); raises ``error`` where nobody was lost."""
        t0 = time.monotonic()
        self.store.compare_set(self._key("open"), "", f"rank {self.me}: {type(error).__name__}: {str(error)[:300]}")
        for t, (own, partners) in self.copies.items():  # a boundary being copied: its partner's copy may be whole
            landed = self.link.landed(t) if own is None and not partners and self.link and self.link.shared else None
            if landed is not None:
                partners[self.link.frm] = landed
        left = self._roll_call()
        lost = [m for m in self.members if m not in left]
        if not lost:
            raise error
        if self.me not in left:
            raise PeerLostError(f"hpf.elastic: rank {self.me} was counted lost by its peers; it stops", [self.me]) from error
        try:
            boundary = self._usable_boundary(step, lost, left)
            held = self._held(step, state, boundary, lost, left)
            close_step(step)
            step, state, received = self._next_generation(left, held)
        except BaseException as second:  # noqa: BLE001 -- a fault now is named; anything else is raised as it is
            if not is_fault(second):
                raise
            raise _lost_in_rebuild(lost, second) from second
        self.rejoin_by = time.monotonic() + self.rejoin_wait if self.rejoin_wait else None
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
                                                          planned_optimizer(step, self.members.index(r))), c.unpack(state) if c else state)
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
        source = InMemory(held)
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
        while self.rejoin_by is not None and time.monotonic() < self.rejoin_by and not self._waiting():
            self.heartbeat.check()  # (after a loss, with rejoin_wait: a new rank is on its way, e.g. torchrun's restart)
            time.sleep(0.05)
        self.rejoin_by, waiting = None, self._waiting()
        slots = json.loads(self.store.compare_set(self._key(f"admit/{t}"), "", json.dumps(waiting)))
        if not slots:
            return None
        t0 = time.monotonic()
        all_here(self, f"admitting/{t}")  # every member is alive before a joiner is told (else its group waits on one)
        members = self.members + [int(self.store.get(f"{_KEY}joiner/{j}")) for j in slots]
        record = json.dumps({"generation": self.generation + 1, "members": members, "step": t})
        for j in slots:
            self.store.set(f"{_KEY}joiner/{j}/admitted", record)
        held = {self.members.index(self.me): (checkpoint.Layout(step.plan, self.members.index(self.me),
                                                                step.plan_optimizer), state)}  # (no step since t)
        close_step(step)
        step, state, received = self._next_generation(members, held)
        return step, state, {"event": "joined", "ranks": members[len(members) - len(slots):], "at_step": t,
                             "world_size": len(members), "seconds": time.monotonic() - t0, "bytes_received": received,
                             "time": time.time()}

    def _waiting(self) -> list[int]:
        """The slots of the ranks registered to join and not yet admitted."""
        return [j for j in range(int(self.store.add(_KEY + "joiners", 0)))
                if not self.store.check([f"{_KEY}joiner/{j}/admitted"])]

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
        self.meta = meta_of(self.init, self.key)
        step, state, received = self._next_generation(record["members"], {})
        return step, state, record["step"], {"event": "joined", "ranks": [self.me], "at_step": record["step"],
                                             "world_size": len(record["members"]), "seconds": time.monotonic() - t0,
                                             "bytes_received": received, "time": time.time()}

def held_bytes(job: Job) -> int:
    """The bytes a rank's copies take now: its buffers, and its shared rows (a partner's copy in them is no more)."""
    shared = job.link is not None and job.link.shared
    packed = [] if shared else [c.buf for own, partners in job.copies.values() for c in (own, *partners.values()) if c is not None]
    return sum(b.numel() for b in [*job.spare, *packed]) + (job.link.row_bytes if job.link else 0)


def all_here(job: Job, name: str) -> None:
    """A barrier of the members, counted in the store under ``name``: a member gone silent (or a roll
    call opened) raises PeerLostError instead of a wait for it."""
    done = job.store.add(job._key(name), 1)
    while done < len(job.members):
        job.heartbeat.check()
        time.sleep(0.002)
        done = job.store.add(job._key(name), 0)


def copied(job: Job, t: int) -> None:
    """Wait until every member holds its partner's copy of boundary ``t``: the shared segment's barrier
    (microseconds; it watches the heartbeats too) where the copies went there, else a count in the store."""
    if job.link.shared:
        job.link.group.barrier()
    else:
        all_here(job, f"saved/{t}")


def _lost_in_rebuild(lost: list[int], second: BaseException) -> UnrecoverableLossError:
    return UnrecoverableLossError(f"hpf.elastic: while rebuilding after losing rank(s) {lost}: {type(second).__name__}: "
                                  f"{str(second)[:300]}. A loss during the rebuild is not survived; resume from the "
                                  "last checkpoint (hpf train --resume)")


def swap(job: Job, step, state, t: int) -> Copy | None:
    """This rank's live state to its buddy, leaf by leaf (no packed copy of it is made for the send),
    and its partner's here: its copy, or None where it lands in shared memory (``job.link.landed``)."""
    n, i = len(job.members), job.members.index(job.me)
    s = job.buddy_shift(step)
    header, nbytes = Copy.layout(state)
    if job.link is None:  # the partner's layout: the same at every boundary of a generation
        job.link = Link(header, nbytes, (i + s) % n, (i - s) % n, job.members)
    elif header != job.link.mine:
        raise UnrecoverableLossError("hpf.elastic: this rank's state changed its layout between boundaries "
                                     "(a new optimizer state?); its buddy's copy would not fit")
    return job.link.send(t, optree.tree_leaves(state), job.spare)

def close_step(step) -> None:
    """Close a lost generation's step: what it waits on raises at once (a member is silent), and is dropped."""
    try:
        step.close()
    except Exception:  # noqa: BLE001 -- its collectives died with the generation
        pass
