"""The cross-rank schedule: what collectives a rank issued, and the check that ranks agree.

hpf's invariant is that every collective a rank issues follows from the sequence of reads the
loss function makes and from the step's fixed phases; that sequence is the same on every rank
because the loss function is SPMD. Local facts (references, gc, timing) never decide a
collective. This module turns a broken invariant (a rank-dependent read, a save that one rank
skips) into :class:`ScheduleMismatchError` on every rank, instead of a hang or a silent mix-up:

- ``LOG.record(kind, subject, n)`` notes each collective in issue order, cheaply (a tuple and
  a cached hash), with what it means (``kind``: "all-gather", ...; ``subject``: a unit path).
- ``LOG.digest()`` hashes what was recorded since its last call. The step sends it in its one
  per-step all-reduce, so ranks whose collectives paired up but meant different things (two
  equal-size units) find out before any update (:func:`check_digests`).
- ``wait(handle)`` waits for a collective. Past ``SUSPECT_S`` it publishes this rank's recent
  log in the process group's store; once every rank waits, each compares all the logs and
  raises ScheduleMismatchError naming the first collective they disagree on. Logs that agree
  (a slow link, a slow peer) just go on waiting, up to the timeout.
"""
from __future__ import annotations

import json
import re
import time
import zlib
from collections import deque
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from . import liveness, world
from .handles import wait_for
from ..errors import PeerTimeoutError, ScheduleMismatchError, StoreValueError

__all__ = ["ScheduleMismatchError", "PeerTimeoutError", "StoreValueError", "LOG", "ScheduleLog", "wait", "check_digests",
           "digest_parts", "rendezvous", "causes", "SUSPECT_S", "DIGEST_MASK", "DIGEST_LEN"]

#: Seconds a wait lasts before this rank asks whether the ranks disagree.
SUSPECT_S = 5.0
_POLL_S = 0.2
_KEEP = 2048  # events kept for the report (the digest covers all of them)
DIGEST_MASK = (1 << 51) - 1  # a digest's bits: 3 x 17, see digest_parts
_SHIFTS = (0, 17, 34)
DIGEST_LEN = 2 * len(_SHIFTS)  # floats in digest_parts: (part, part^2) per 17 bits
_PREFIX = "hpf/schedule/"


class ScheduleLog:
    """The collectives this process issued, in order (see the module doc)."""

    def __init__(self):
        self.seq = 0
        self.step = 0  # which step's schedule this is (advanced by each digest)
        self.events: deque = deque(maxlen=_KEEP)  # (seq, step, kind, subject, n)
        self.broken: str | None = None  # why the ranks' collectives stopped pairing (then none may follow)
        self.failed: str | None = None  # the error this rank's last step raised (a waiting peer names it)
        self.mismatches = 0  # how many ScheduleMismatchErrors this rank raised (``linger`` before exit)
        self._hash = 0
        self._codes: dict[tuple, int] = {}

    def record(self, kind: str, subject: str, n: int = 0) -> None:
        """One event: a collective this rank issues now, or a read of a unit by the loss function
        (which decides the collectives); (kind, subject, n) must mean the same on every rank."""
        key = (kind, subject, n)
        code = self._codes.get(key)
        if code is None:
            code = self._codes[key] = zlib.crc32(repr(key).encode())
        self.seq += 1
        self._hash = ((self._hash ^ code) * 0x100000001B3 + self.seq) & DIGEST_MASK
        self.events.append((self.seq, self.step, kind, subject, n))

    def digest(self) -> int:
        """A hash of what was recorded since the last digest (then starts the next step's)."""
        h, self._hash = self._hash, 0
        self.step += 1
        return h

    def snapshot(self) -> dict:
        return {"rank": world.rank(), "events": list(self.events), "failed": self.failed}


#: The process's one log: every engine, save and gather records here, so ranks compare one sequence.
LOG = ScheduleLog()


def describe(event: tuple | None) -> str:
    """One logged event in words (the same words on every rank for the same event)."""
    if event is None:
        return "nothing (it had not got there)"
    seq, step, kind, subject, n = event
    what = {"read": f"read {subject} (read {n} of the step)",
            "all-gather": f"all-gather {subject}" + (" (backward)" if n else ""),
            "reduce-scatter": f"reduce-scatter {subject} (bucket {n})"}.get(kind, f"{kind} {subject}".strip())
    return f"{what} [event {seq}, step {step + 1}]"


# -- the per-step digest check ---------------------------------------------------------------------------
def digest_parts(h: int) -> list[float]:
    """A 51-bit digest as (part, part^2) x 3 in float64, for a SUM all-reduce: the parts sum
    exactly (17 bits, up to 2^19 ranks), and n * sum(x^2) == sum(x)^2 iff every rank sent the
    same x (Cauchy-Schwarz), so one all-reduce checks agreement beside the step's sums."""
    parts = [(h >> s) & 0x1FFFF for s in _SHIFTS]
    return [float(v) for p in parts for v in (p, p * p)]


def parts_agree(sums: list[float], n: int) -> bool:
    """Whether summed ``digest_parts`` came from ``n`` equal digests."""
    return all(n * int(sums[i + 1]) == int(sums[i]) ** 2 for i in range(0, len(sums), 2))


def check_digests(agreed: bool, what: str = "collectives", group=None) -> None:
    """After an all-reduce of ``digest_parts`` over ``group``: raise ScheduleMismatchError on every
    rank if the digests differed, naming the first collective the ranks' logs disagree on. Every
    rank of the group calls it (``agreed`` is the same everywhere), so the log exchange is safe."""
    if agreed:
        return
    logs = world.all_gather_object(LOG.snapshot(), group)
    raise _broken(ScheduleMismatchError(_report(logs) or f"the ranks' {what} this step differ (their digests "
                                        "disagree), but the recent logs hold no difference; the loss function must "
                                        "read the same units in the same order on every rank"))


def _broken(error: Exception) -> Exception:
    """Note that collectives no longer pair up (``LOG.broken``: teardown then skips its own), and
    return ``error`` to raise. A mismatch is counted in the store, for :func:`linger`."""
    LOG.broken = str(error)
    store = world.store()
    if isinstance(error, ScheduleMismatchError) and store is not None:
        LOG.mismatches += 1
        try:
            store.add(_PREFIX + "raised", 1)
        except RuntimeError:  # (the store went with a peer)
            pass
    return error


def linger(timeout_s: float = 5.0) -> None:
    """After a mismatch, before this process exits: wait (at most ``timeout_s``) until every rank
    has raised it. The store may live in this process (torchrun's, or ``master_port``'s TCPStore
    on rank 0): leaving first would take the report with it, and a slower peer would see gloo's
    'connection closed' instead of the named error (seen in 3 of 30 runs). The store counts every
    rank's raises over the process's life: a program that caught an earlier mismatch and went on
    waits for this one's count too."""
    store, n = world.store(), world.world_size()
    if not LOG.mismatches:
        return
    deadline = time.monotonic() + timeout_s
    try:
        while store is not None and store.add(_PREFIX + "raised", 0) < n * LOG.mismatches \
                and time.monotonic() < deadline:
            time.sleep(0.02)
    except RuntimeError:  # the store is gone: nobody is left to wait for
        pass


# -- waiting, with a diagnosis when a wait lasts --------------------------------------------------------------
def wait(handle: Any, what: Callable[[], str] | str = "a collective", timeout_s: float | None = None) -> None:
    """Wait for one collective; a long wait is checked against the other ranks (module doc).

    ``timeout_s`` (None: the process group's timeout) ends the wait with TimeoutError naming
    ``what`` and the ranks that never waited alongside (dead, hung or busy elsewhere)."""
    if _waited(handle, SUSPECT_S):
        return
    store = world.store()
    n = world.world_size()
    if timeout_s is None:
        timeout_s = world.timeout_s()
    deadline = time.monotonic() + max(timeout_s - SUSPECT_S, 0.0)
    published = False
    compared = None
    here = f"{_PREFIX}here/{world.rank()}"
    try:
        if store is not None and n > 1:
            store.set(f"{_PREFIX}{world.rank()}", json.dumps(LOG.snapshot()).encode())
            store.set(here, b"1")  # (a timeout names the ranks without one)
            store.add(_PREFIX + "waiting", 1)
            published = True
        while True:
            try:
                if _waited(handle, _POLL_S):
                    return
            except RuntimeError as err:
                if published and "timed out" in str(err).lower():  # the backend's own timeout came first
                    raise _timed_out(what, timeout_s, _absent(store, n)) from err
                raise
            if published:
                waiting = store.add(_PREFIX + "waiting", 0)
                if waiting >= n and waiting != compared:
                    compared = waiting
                    logs = _read_logs(store.multi_get([f"{_PREFIX}{r}" for r in range(n)]))
                    report = _report(logs)
                    if report:
                        published = False  # (leave the count: the peers are raising too)
                        raise _broken(ScheduleMismatchError(report))
            if time.monotonic() > deadline:
                raise _timed_out(what, timeout_s, _absent(store, n) if published else [])
    except PeerTimeoutError:
        here = None  # a rank that timed out was here: its key stays, so its slower peers never blame it
        raise
    finally:
        if published:
            store.add(_PREFIX + "waiting", -1)
            if here:
                store.delete_key(here)


def _waited(handle: Any, seconds: float) -> bool:
    """``wait_for(handle, seconds)``; in an elastic job the peers' heartbeats are checked meanwhile, so a
    lost rank raises PeerLostError within seconds (hpf.comm.liveness)."""
    heartbeat = liveness.WATCH
    if heartbeat is None:
        return wait_for(handle, seconds)
    end = time.monotonic() + seconds
    while not wait_for(handle, min(_POLL_S, max(end - time.monotonic(), 0.0))):
        heartbeat.check()
        if time.monotonic() >= end:
            return False
    return True


def causes(error: BaseException | None, implicit: bool = True) -> Iterator[BaseException]:
    """``error``, then what it was raised from (``inner_exception``, ``__cause__``, and with
    ``implicit`` ``__context__``), each once: a chain may loop (``raise e from e``)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = getattr(error, "inner_exception", None) or error.__cause__ or (error.__context__ if implicit else None)


def _timed_out(what: Callable[[], str] | str, timeout_s: float, missing: list[int]) -> PeerTimeoutError:
    label = what() if callable(what) else what
    who = (f"rank{'s' if len(missing) > 1 else ''} {_ranks(missing)} never waited alongside (dead, hung, or stuck "
           "outside hpf's collectives)" if missing else "a peer rank died, hangs, or is stuck outside hpf's collectives")
    return _broken(PeerTimeoutError(f"hpf: {label} did not finish within {timeout_s:g} s: {who}. The ranks that "
                                    "waited agree on every collective so far", missing))


def _absent(store, n: int) -> list[int]:
    """The ranks not waiting in ``wait`` now (each waiting rank holds its ``here`` key)."""
    try:
        return [r for r in range(n) if not store.check([f"{_PREFIX}here/{r}"])]
    except RuntimeError:  # (the store went with a peer)
        return []


_MAX_VALUE_BYTES = 4 << 20  # a log of _KEEP events with long unit paths is well under 1 MiB
_MAX_DEPTH = 8  # a log nests 3 deep: {"events": [[...]]}
_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_NOT_SYNTAX = bytes(c for c in range(256) if c not in b'"[]{}')


def _bounded_json(value: bytes) -> Any:
    """``value`` parsed as JSON after checking its size and nesting (json's recursion would
    otherwise end the rank with RecursionError on ``'[' * 100000``); raises ValueError."""
    if len(value) > _MAX_VALUE_BYTES:
        raise ValueError(f"{len(value)} bytes, more than {_MAX_VALUE_BYTES}")
    depth = deepest = 0
    quoted = False
    for c in _ESCAPE.sub(b"", value).translate(None, _NOT_SYNTAX):  # quotes and brackets, escapes dropped
        if c == 34:  # '"'
            quoted = not quoted
        elif not quoted:
            depth += 1 if c in b"[{" else -1
            deepest = max(deepest, depth)
    if deepest > _MAX_DEPTH:
        raise ValueError(f"nested {deepest} deep, more than {_MAX_DEPTH}")
    return json.loads(value)


def _read_logs(values: list[bytes]) -> list[dict]:
    """The ranks' published logs (rank r's under ``hpf/schedule/r``), read as bounded JSON data;
    a value that is not a well-formed log is a StoreValueError naming its key and rank."""
    logs = []
    for r, value in enumerate(values):
        try:
            log = _bounded_json(value)
            events = [tuple(e) for e in log["events"]]
            if not (log["rank"] == r and (log["failed"] is None or isinstance(log["failed"], str))
                    and all(len(e) == 5 and all(map(isinstance, e, (int, int, str, str, int))) for e in events)):
                raise ValueError("not a schedule log")
        except (ValueError, TypeError, KeyError) as e:
            raise _broken(StoreValueError(
                f"hpf: the store's key {_PREFIX}{r!s} (rank {r}'s schedule log) holds a value hpf rank {r} did not "
                f"write ({type(e).__name__}: {str(e)[:200]}); something else writes to this job's store: run the "
                "job on a private store (hpf.launch's default file store, or a TCP store on a trusted network)")) from None
        logs.append({"rank": r, "events": events, "failed": log["failed"]})
    return logs


def rendezvous(kind: str, subject: str = "", group=None) -> None:
    """Every rank meets here, recorded, before a collective call does its own traffic.

    The meeting is an all-reduce of this call's digest, not a plain barrier: two different
    calls (rank 0 in ``step.save``, rank 1 at the end of the program) would pair up as two
    barriers do, so the ranks check that they meet in the same call and raise
    ScheduleMismatchError naming both at once. A call that one rank skips while the others
    go on to other collectives leaves a wait that names the mismatch (``wait``) within seconds."""
    LOG.record(kind, subject)
    n = world.world_size() if group is None else dist.get_world_size(group)
    if n > 1:
        code = zlib.crc32(repr((LOG.seq, kind, subject)).encode())
        parts = torch.tensor(digest_parts(code), dtype=torch.float64, device=world.default_device())  # nccl needs its device
        wait(dist.all_reduce(parts, group=group, async_op=True), f"{kind} {subject}".strip())
        check_digests(parts_agree(parts.tolist(), n), "calls", group)


def _report(logs: list[dict]) -> str | None:
    """The first collective on which two ranks' logs differ, in words; None if they agree
    wherever they overlap (a rank that is only behind is not a mismatch)."""
    by_rank = {log["rank"]: {e[0]: e for e in log["events"]} for log in logs}
    failed = "".join(f"rank {log['rank']} raised {log['failed']} in its step, so it no longer issues the "
                     "collectives the others wait for. " for log in logs if log.get("failed"))
    common = set.intersection(*(set(ev) for ev in by_rank.values())) if by_rank else set()
    for seq in sorted(common):
        events = {r: ev[seq][1:] for r, ev in by_rank.items()}
        if len(set(events.values())) > 1:
            return failed + _mismatch(seq, {r: ev[seq] for r, ev in by_rank.items()})
    return failed or None


def _mismatch(seq: int, events: dict[int, tuple | None]) -> str:
    groups: dict[str, list[int]] = {}
    for r, e in sorted(events.items()):
        groups.setdefault(describe(e), []).append(r)
    said = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}: {d}" for d, rs in groups.items())
    return (f"ranks disagree at event {seq} of their schedules: {said}. Every rank must issue the same collectives "
            "in the same order: the loss function must read the same units in the same order on every rank (a "
            "rank-dependent read or branch breaks that), and collective calls (step, step.save, step.full_params, "
            "step.restore) must be made by every rank")


def _ranks(rs: list[int]) -> str:
    return ", ".join(map(str, rs)) if len(rs) <= 8 else f"{rs[0]}-{rs[-1]} ({len(rs)} ranks)"
