"""Saves: every rank writes its chunks, and the checkpoint is published whole or not at all.

Saves go to ``<name>.tmp`` next to the target and are published by a rename once every rank
has written; an older checkpoint of the same series is removed only after that (``keep_last``),
and ``latest`` finds the newest complete one. Async saves still running when the program ends
are finished by ``hpf.launch.shutdown()``, or reported at exit (status 1). A save that fails (a
full disk: DCP's CheckpointException) is a CheckpointError, never a path.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import optree
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..checkpoint_files import HEADER, TMP_SUFFIX, CheckpointError, not_data, save_failed, seal, sums
from ..comm import schedule, world
from ..launcher import at_reform, at_shutdown
from .agreement import agree, first_error, start
from .chunks import Layout, SavePlanner, header_of, quiet, state_dict

__all__ = ["save", "SaveHandle", "wait_pending", "finish_saves_at_exit", "latest"]


_GROUP: dict[str, Any] = {}
at_reform(_GROUP.clear)


def _group():
    """A gloo group of its own, so an async save's collectives never interleave with the step's."""
    if "g" not in _GROUP:
        _GROUP["g"] = world.new_group(backend="gloo", timeout_s=600)
    return _GROUP["g"]


_PENDING: set[SaveHandle] = set()  # this process's async saves not yet waited for


class SaveHandle:
    """An async save in flight; ``wait()`` blocks until it is published and re-raises its error."""

    def __init__(self, thread: threading.Thread | None, box: dict):
        self.thread, self.box = thread, box

    def wait(self) -> Path:
        if self.thread is not None:
            self.thread.join()
        _PENDING.discard(self)
        if "error" in self.box:
            raise self.box["error"]
        return self.box["path"]


@at_shutdown
def wait_pending() -> None:
    """Finish every async save of this process; re-raises the first error. Needs the process
    group, so it runs before teardown: ``hpf.launch.shutdown()`` calls it (and hpf.launch
    calls that when ``fn`` returns)."""
    for handle in list(_PENDING):
        handle.wait()


def finish_saves_at_exit() -> None:
    """At exit: finish the async saves still running, or, once the process group is gone
    (``destroy_process_group()`` with a save in flight), say which were lost and exit 1, so a
    lost checkpoint never ends a job that looks successful."""
    if not _PENDING:
        return
    paths = ", ".join(sorted(str(h.box["path"]) for h in _PENDING))
    try:
        if (not world.is_distributed() or schedule.LOG.broken) and any(h.thread.is_alive() for h in _PENDING):
            raise CheckpointError("it was still running when the process group was destroyed (or broken), so it "
                                  "may be incomplete")
        wait_pending()
        return
    except Exception as e:  # noqa: BLE001 -- reported, then the exit status says it
        sys.stdout.flush()
        sys.stderr.write(f"hpf.checkpoint: the async save to {paths} failed: {e}. End the program with "
                         "hpf.launch.shutdown() (or call step.wait_save()) before "
                         "torch.distributed.destroy_process_group()\n")
        sys.stderr.flush()
        os._exit(1)


atexit.register(finish_saves_at_exit)


def save(layout: Layout, state, path, extra: Any = None, *, keep_last: int | None = None, async_save: bool = False,
         meta: dict | None = None) -> SaveHandle:
    """Write ``state`` (and ``extra``, rank 0's) to the directory ``path``; every rank calls it,
    with the same path (checked: a CheckpointError on every rank otherwise).

    ``meta``: a JSON-able dict kept in the checkpoint's header, readable without torch's
    loader (:func:`meta`): ``hpf train`` stores the model and its config there.

    ``async_save``: copy the state to the CPU now (the only exposed time) and write in a
    background thread while training goes on; ``step.wait_save()`` (or the next save or
    restore, or ``hpf.launch.shutdown()``) waits for it. ``keep_last=k`` then removes all but
    the newest k checkpoints of ``path``'s series: hpf checkpoints next to it whose names
    differ from its name only in the number that ends it (``step_100``: ``step_<n>``), so
    other folders (``best``) are never touched. ``path`` is the newest (it is where the run
    is); ones numbered above it are of an abandoned branch, and go first.
    """
    path = Path(path)
    if keep_last is not None:
        _series(path, keep_last)  # checks keep_last and the name before any collective
    start("step.save", path)
    agree(not_data(extra))
    group = _group() if world.is_distributed() else None
    if async_save:
        state = optree.tree_map(lambda t: t.detach().to("cpu", copy=True), state)
    sd = state_dict(layout, state)
    header = {**header_of(layout, sd), "meta": json.loads(json.dumps(meta or {}))}  # (JSON now: a bad value fails here)
    sd["extra"] = extra
    tmp = path.with_name(path.name + TMP_SUFFIX)
    if world.rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that died here before
        tmp.mkdir(parents=True)
    schedule.rendezvous("checkpoint", "step.save: the .tmp directory is ready", group)
    box: dict[str, Any] = {"path": path}
    write = functools.partial(_write, sd, tmp, path, header, keep_last, group, box)
    if not async_save:
        write()
        handle = SaveHandle(None, box)
        handle.wait()
        return handle
    # A daemon thread: at exit, finish_saves_at_exit decides (finish it, or report it lost) instead
    # of the interpreter joining a thread whose process group may be gone (a hang).
    thread = threading.Thread(target=write, name=f"hpf-save-{path.name}", daemon=True)
    handle = SaveHandle(thread, box)
    _PENDING.add(handle)
    thread.start()
    return handle


def _write(sd: dict, tmp: Path, path: Path, header: dict, keep_last: int | None, group, box: dict) -> None:
    """Every rank writes its part of ``sd`` into ``tmp`` (and its checksums); if every rank
    succeeded, rank 0 publishes ``tmp`` as ``path``. An error, on any rank, goes into ``box`` on
    every rank. No schedule records here: a background thread's would interleave with the step's."""
    error: BaseException | None = None
    rank = world.rank()
    try:
        with quiet():
            metadata = dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp), planner=SavePlanner(),
                                process_group=group, no_dist=group is None)
        mine = sorted(p.name for p in tmp.glob(f"__{rank}_*.distcp"))
        (tmp / f"__{rank}{_SUMS}").write_text(json.dumps(sums(tmp, mine, metadata)))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 -- DCP's is a BaseException (a full disk)
        error = e
    if (error := first_error(error, group)) is None and rank == 0:
        try:
            _publish(tmp, path, header, keep_last)
        except Exception as e:  # noqa: BLE001 -- reported below, on every rank
            error = e
    if (error := first_error(error, group)) is not None:
        box["error"] = save_failed(path, error)
        if rank == 0:  # free the space a full disk needs back; the last complete checkpoint stays
            shutil.rmtree(tmp, ignore_errors=True)


_SUMS = ".crc.json"  # each rank's {file: [size, {offset: crc32}]}, merged into the manifest by rank 0


def _publish(tmp: Path, path: Path, header: dict, keep_last: int | None) -> None:
    files = {}
    for part in sorted(tmp.glob(f"__*{_SUMS}")):
        files.update(json.loads(part.read_text()))
        part.unlink()
    files.update(sums(tmp, [".metadata"]))
    (tmp / HEADER).write_text(json.dumps(seal({**header, "files": files})))
    if path.exists():  # same name again: the old one stays until the new one is in place
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old)
    else:
        os.rename(tmp, path)
    for stale in _stale(path, keep_last) if keep_last else ():
        shutil.rmtree(stale, ignore_errors=True)


def _stale(path: Path, keep_last: int) -> list[Path]:
    """The checkpoints of ``path``'s series that ``keep_last`` removes once ``path`` is saved: the
    series runs in the order of the step the run is at, so ``path`` is its newest, never removed;
    older ones (lower numbers) are kept up to ``keep_last`` in all, and those numbered above
    ``path`` are of an abandoned branch (the run resumed from an earlier step): removed, so that
    ``latest()`` never resumes them."""
    series, at = _series(path, keep_last), _number(path)
    others = [p for p in _checkpoints(path.parent) if series.fullmatch(p.name) and p.name != path.name]
    behind = [p for p in others if _number(p) <= at]
    return [p for p in others if _number(p) > at] + behind[:max(0, len(behind) - keep_last + 1)]


def _number(p: Path) -> int:
    m = re.search(r"(\d+)$", p.name)
    return int(m.group(1)) if m else -1


def _series(path: Path, keep_last: int) -> re.Pattern:
    """The names of ``path``'s series (its name with any number in place of the one ending it):
    the only folders ``keep_last`` may remove."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last={keep_last!r}: keep at least 1 checkpoint, or None to keep all")
    m = re.fullmatch(r"(.*?)\d+", path.name)
    if m is None:
        raise ValueError(f"keep_last={keep_last} with path {str(path)!r}: keep_last removes the older checkpoints of "
                         "a series named by a number at the end (e.g. step_100); put the step number at the end of "
                         "the name, or pass keep_last=None")
    return re.compile(re.escape(m.group(1)) + r"\d+")


def _checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints in ``root``, oldest first (by the number ending the name)."""
    return sorted((p for p in root.iterdir() if (p / HEADER).is_file() and (p / ".metadata").is_file()
                   and not p.name.endswith((TMP_SUFFIX, ".old"))), key=lambda p: (_number(p), p.name))


def latest(root) -> Path | None:
    """The newest complete checkpoint in ``root`` (incomplete ``.tmp`` saves are skipped), or None."""
    root = Path(root)
    found = _checkpoints(root) if root.is_dir() else []
    return found[-1] if found else None
