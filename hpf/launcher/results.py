"""What the ranks of a launch report: their results in rank order, or the one rank to blame.

A rank sends one pickled message through its pipe: its result, or its traceback with the time it
failed, the ranks a timed-out wait found absent, and its exception where that pickles. The first
failure anywhere (an error, a silent death, a hang, whichever is the root cause) ends every rank
and is raised as `RankError` with that rank's traceback.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import time
from typing import Any, Callable

from ..comm import schedule
from ..errors import RankError

__all__ = ["collect", "missing_ranks", "pickled_error", "stop"]

_TERMINATE_GRACE_S = 2.0  # SIGTERM first, SIGKILL after this
_DEATH_ECHO_S = 1.0  # after a rank's error, how long to watch for a peer's death that caused it

_TYPED: dict[type, type] = {}  # the rank's exception class -> RankError and it, made once


def _rank_error(message: str, rank_: int, tb: str, cause: BaseException | None) -> RankError:
    """The RankError of a rank that raised ``cause``: of its class too, where one can be made
    (not for a class whose instances are laid out otherwise, e.g. OSError, or whose __init__
    takes other arguments). Its text is the message with the rank's traceback, whatever the class's
    own ``__str__`` does (KeyError's would show it as one escaped line)."""
    if isinstance(cause, Exception) and not isinstance(cause, RankError):
        try:
            cls = _TYPED.get(type(cause)) or _TYPED.setdefault(
                type(cause), type(type(cause).__name__, (RankError, type(cause)), {"__module__": type(cause).__module__,
                                                                                   "__qualname__": f"RankError[{type(cause).__qualname__}]",
                                                                                   "__str__": BaseException.__str__}))
            return cls(message, rank_, tb, cause)
        except TypeError:
            pass
    return RankError(message, rank_, tb, cause)


def missing_ranks(error: BaseException) -> tuple[int, ...]:
    """The ranks a timed-out wait found absent (hpf.comm.schedule.PeerTimeoutError, maybe as the
    cause of another error): the parent blames them, not the rank that waited."""
    return next((tuple(e.missing) for e in schedule.causes(error) if hasattr(e, "missing")), ())


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def stop(procs: list) -> None:
    """End every child still running (SIGTERM, then SIGKILL) and reap all of them."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()


def collect(procs: list, conns: list, timeout: float | None, workdir: str, lost: Callable[[int], None] | None = None) -> list[Any]:
    """Every rank's result, in rank order. ``lost`` (an elastic launch): a rank that dies silently is
    told to it, and its result is None; ``procs`` and ``conns`` may grow by the replacements it starts."""
    missing = object()
    results = [missing] * len(procs)
    deadline = time.monotonic() + (math.inf if timeout is None else timeout)
    while any(v is missing for v in results):
        pending = [r for r, v in enumerate(results) if v is missing]
        remaining = None if timeout is None else max(0.0, deadline - time.monotonic())
        ready = set(mp.connection.wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending],
                                       timeout=remaining))
        if not ready:
            raise RankError(f"hpf.launch: timed out after {timeout:g} s; ranks {pending} had not "
                            f"finished and were ended. Where they were:\n{_stacks(procs, pending, workdir)}")
        errors, deaths = [], []
        for r in pending:
            if conns[r] not in ready and procs[r].sentinel not in ready:
                continue
            message = _message(conns[r], r)
            if message is None:
                procs[r].join(_TERMINATE_GRACE_S)  # pipe closed: the process is exiting
                deaths.append(r)
            elif message[0] == "error":
                errors.append(_error_of(message, r))
            else:
                results[r] = message[1]
        if errors and not deaths:  # a peer's error may be the echo of a death not yet seen: look once more
            others = [r for r in pending if results[r] is missing and r not in {e[1] for e in errors}]
            for sentinel in mp.connection.wait([procs[r].sentinel for r in others], timeout=_DEATH_ECHO_S):
                r = next(r for r in others if procs[r].sentinel == sentinel)
                message = _message(conns[r], r)
                if message is None:  # gone without a word: the root cause
                    procs[r].join(_TERMINATE_GRACE_S)
                    deaths.append(r)
                elif message[0] == "error":
                    errors.append(_error_of(message, r))
                else:
                    results[r] = message[1]
        if deaths and lost is not None and not errors:  # elastic: the others go on without it
            for r in deaths:
                results[r] = None
                lost(r)
            results += [missing] * (len(procs) - len(results))
            continue
        if deaths:  # a silent death is a root cause; peers' errors are its consequences
            r = deaths[0]
            raise RankError(f"hpf.launch: rank {r} {_exit_description(procs[r].exitcode)} without "
                            "reporting a result or an exception; the other ranks were ended", rank=r)
        if errors:
            _, r, tb, _, pickled = min(errors, key=lambda e: e[:2])
            hung = sorted(set.intersection(*(set(e[3]) for e in errors)) - {e[1] for e in errors})
            if hung:  # every error is a wait that timed out for these ranks, alive and silent
                raise RankError(f"hpf.launch: rank {hung[0]} hung (it neither finished nor raised); rank {r} timed out "
                                f"waiting for it (the other ranks were ended):\n{tb}", rank=hung[0], child_traceback=tb)
            raise _rank_error(f"hpf.launch: rank {r} raised (the other ranks were ended):\n{tb}", r, tb,
                              _unpickled(pickled))
    for p in procs:  # ranks are past fn; give them a moment to tear the process group down
        p.join(min(10.0, max(0.0, deadline - time.monotonic())))
    return results


def _message(conn, r: int):
    """Rank ``r``'s message, or None when its pipe closed without one (it died). A closed pipe
    also polls as readable, so only a read tells the two apart."""
    try:
        return pickle.loads(conn.recv_bytes()) if conn.poll() else None
    except EOFError:
        return None
    except Exception as e:  # noqa: BLE001 -- e.g. a class the parent cannot import
        raise RankError(f"hpf.launch: could not unpickle the result of rank {r}: {e!r}", rank=r) from e


def _error_of(message: tuple, r: int) -> tuple:
    """(time, rank, traceback, ranks it waited for, the pickled exception) of an error message."""
    return message[2], r, message[1], message[3] if len(message) > 3 else (), message[4] if len(message) > 4 else None


def _stacks(procs: list, ranks: list[int], workdir: str, lines: int = 80) -> str:
    """Each rank's threads' stacks (at most ``lines``), asked for by SIGUSR1: a hang names itself."""
    for r in ranks:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except (OSError, TypeError):
            pass
    time.sleep(_TERMINATE_GRACE_S / 4)
    said = []
    for r in ranks:
        try:
            with open(os.path.join(workdir, f"rank{r}")) as f:
                text = f.read().strip().splitlines()
        except OSError:
            text = []
        said.append(f"rank {r}:\n" + "\n".join(text[:lines] or ["(no stacks: the rank did not answer)"]))
    return "\n".join(said)


def pickled_error(error: BaseException) -> bytes | None:
    """A rank's exception for the parent, where it pickles (the parent raises its type)."""
    try:
        return pickle.dumps(error)
    except Exception:  # noqa: BLE001 -- e.g. an attribute that does not pickle
        return None


def _unpickled(payload: bytes | None) -> BaseException | None:
    """A rank's exception, if it travelled and its class imports here."""
    try:
        return None if payload is None else pickle.loads(payload)
    except Exception:  # noqa: BLE001 -- e.g. a class defined in the rank only
        return None
