"""What every rank of a save or a restore agrees on: the call and the path first, then each rank's errors.

Every save and restore starts with a recorded rendezvous (hpf.comm.schedule) and a check that
all ranks passed the same path, so a rank that skips the call, or a path that differs by rank,
is a named error on every rank before any file is touched. A rank that fails its checks, or its
part of a write, fails the call on every rank, each naming the first failing rank's cause.
"""
from __future__ import annotations

from pathlib import Path

from ..checkpoint_files import CheckpointError, PeerSaveError, describe
from ..comm import schedule, world

__all__ = ["start", "agree", "first_error"]


def start(call: str, path: Path) -> None:
    """Every rank meets at the start of ``call`` and agrees on ``path``, before any file is touched.

    A rank that skips the call (rank 0 alone saving, the torch.save habit) leaves the others
    at the rendezvous, which names the mismatch on every rank within seconds
    (ScheduleMismatchError). Different paths (a timestamp that ticked between ranks) would
    publish one rank's part as a whole checkpoint, or load each rank's shards from another one."""
    schedule.rendezvous("checkpoint", call)
    paths = world.all_gather_object(str(path))
    if len(set(paths)) > 1:
        said = "; ".join(f"rank {r}: {p!r}" for r, p in enumerate(paths[:8])) + ("; ..." if len(paths) > 8 else "")
        raise CheckpointError(f"{call}: the ranks passed different paths ({said}); every rank must pass the same "
                              "path (derive it from the step number, not from a clock or the rank)")


def agree(error: CheckpointError | None) -> None:
    """Raise on every rank if any rank failed its checks (so none enters DCP's collectives)."""
    for r, m in enumerate(world.all_gather_object(str(error) if error else None)):
        if m is not None:
            raise CheckpointError(m if r == world.rank() else f"rank {r}: {m}")


def first_error(error: BaseException | None, group) -> BaseException | None:
    """Once every rank of the save's group got this far (a rank that failed must not leave the others
    in a barrier): this rank's error, else the first failing rank's, so every rank names the cause."""
    if not world.is_distributed():
        return error
    said = world.all_gather_object(None if error is None else describe(error), group)
    first = next(((r, s) for r, s in enumerate(said) if s is not None), None)
    return error if error is not None or first is None else PeerSaveError(f"rank {first[0]}: {first[1]}")
