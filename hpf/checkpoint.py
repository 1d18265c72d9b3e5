"""Sharded checkpoints on torch.distributed.checkpoint (DCP), with resharding and exact resume.

Format: a DCP directory (``.metadata`` plus ``__<rank>_<i>.distcp`` files) and a small
``hpf.json`` (params tree, shapes, dtypes, optimizer). Every logical tensor has its full,
global shape:

- a parameter at hpf path ``blocks/0/w_qkv`` is the key ``blocks.0.w_qkv`` (the dotted path,
  as an ``nn.Module`` state dict names it, so an FSDP2 module with those names loads it);
- an optimizer moment is ``optimizer.state.<dotted path>.<field>`` (``exp_avg``,
  ``exp_avg_sq``; Muon's momentum is its ``exp_avg``), a scalar is ``optimizer.<field>``
  (the step ``count``);
- ``extra`` is rank 0's object (data position, RNG state, ...): tensors, numpy arrays, numbers,
  strings, lists, tuples and dicts, read back with ``torch.load(weights_only=True)``;
- error-feedback residuals of a low-bit slow tier are ``error_feedback.bucket<b>``, one row
  per rank (they belong to the mesh that made them: restored on the same mesh and plan, and
  left at zero, with a warning, where the checkpoint has none that fit).

A rank's flat shard covers an interval of its bucket's flat buffer, i.e. intervals of the
flattened local blocks of several params. Each interval is cut into N-D boxes (``boxes``:
a partial row, whole rows, a partial row, recursively) and each box is one DCP chunk whose
offsets add the rank's non-FSDP block offset. Padding is never written. Identical chunks
(HSDP replicas, replicated params) are written once, by the lowest rank. DCP reads any
chunk layout into any other by overlap, so a checkpoint restores on any mesh.

Saves go to ``<name>.tmp`` next to the target and are published by a rename once every rank
has written; an older checkpoint of the same series is removed only after that (``keep_last``).
Every save and restore starts with a recorded rendezvous (hpf.comm.schedule) and a check that
all ranks passed the same path, so a rank that skips the call, or a path that differs by rank,
is a named error on every rank before any file is touched. Async saves still running when the
program ends are finished by ``hpf.launch.shutdown()``, or reported at exit (status 1). A save
that fails (a full disk: DCP's CheckpointException) is a CheckpointError, never a path.

A checkpoint is data, never code, and every file is checked against the CRC-32 in hpf.json
before its bytes are used (hpf.checkpoint_files). A restore covers every element of every
tensor or changes nothing: hpf.checkpoint_check proves each key's chunks tile it (and that the
files hold their bytes) before anything is allocated, and the read goes into new host buffers,
copied into the state only once every rank has read and checked all of its part. A zero-size
tensor is one empty chunk.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import io
import json
import os
import random
import re
import shutil
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import optree
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .checkpoint_check import Want, check_keys, check_outline, dtype_of, header_fields
from .checkpoint_files import (HEADER, TMP_SUFFIX, CheckpointError, Reader, load_data, not_data, read_failed,
                               save_failed, seal, sums, describe, PeerSaveError)
from .comm import schedule, world
from .launcher import at_reform, at_shutdown
from .optim.base import capabilities


__all__ = ["CheckpointError", "Layout", "state_dict", "save", "restore", "load_params", "meta", "wait_pending", "boxes", "latest", "rng_state",
           "set_rng_state", "VERSION"]

VERSION = 1
FEEDBACK = "error_feedback.bucket"  # + bucket index: a low-bit slow tier's residuals


# -- boxes: a flat interval of a row-major tensor as N-D chunks ---------------------------------
def boxes(shape: tuple[int, ...], start: int, stop: int, _base: int = 0) -> list[tuple[int, tuple, tuple]]:
    """Cut elements ``[start, stop)`` of a row-major ``shape`` into boxes ``(flat start, offsets,
    sizes)``, each contiguous in flat order: at most two per dim."""
    if start >= stop:
        return []
    if not shape:
        return [(_base, (), ())]
    inner = 1
    for n in shape[1:]:
        inner *= n
    r0, r1 = start // inner, stop // inner
    if start % inner == 0 and stop % inner == 0:
        return [(_base + start, (r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:]))]

    def row(r, a, b):  # a partial row r: a box of the trailing dims, prefixed with [r, r+1)
        return [(f, (r,) + o, (1,) + s) for f, o, s in boxes(tuple(shape[1:]), a, b, _base + r * inner)]
    if r0 == r1:
        return row(r0, start % inner, stop % inner)
    out = []
    if start % inner:
        out += row(r0, start % inner, inner)
        r0 += 1
    out += boxes(shape, r0 * inner, r1 * inner, _base) if r1 > r0 else []
    return out + row(r1, 0, stop % inner)


# -- one logical tensor as this rank's chunks (views into flat shards) --------------------------
@dataclass
class _Chunks:
    shape: torch.Size  # the global shape
    dtype: torch.dtype
    views: dict[tuple, torch.Tensor]  # global offsets -> view of that box in a flat shard

    def size(self) -> torch.Size:  # DCP's load plan compares it with the saved size
        return self.shape

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size(o), v.shape),
                                                      TensorProperties(dtype=self.dtype), self.shape))
                for o, v in self.views.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(o), v.shape) for o, v in self.views.items()]


def _lookup(state_dict: dict, index: MetadataIndex):
    obj = state_dict[index.fqn]
    return obj.views[tuple(index.offset)] if isinstance(obj, _Chunks) else None


class _SavePlanner(DefaultSavePlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, dedup_save_to_lowest_rank=True)

    def lookup_object(self, index):
        return _exact(_lookup(self.state_dict, index)) if isinstance(self.state_dict.get(index.fqn), _Chunks) \
            else super().lookup_object(index)


def _exact(view: torch.Tensor) -> torch.Tensor:
    """``view`` (a box of a flat shard) as a tensor whose storage is exactly its bytes, without a
    copy: DCP's file writer clones any tensor with a larger storage, which was a copy of the
    whole state per save (measured: medium GPT on 4 ranks, save 1.23x FSDP2's time with it).
    Only CPU memory can be aliased this way; DCP moves other devices to the CPU itself."""
    if view.device.type != "cpu" or view.untyped_storage().nbytes() == view.nbytes:
        return view
    raw = view.reshape(-1).view(torch.uint8).numpy()  # a box is contiguous in its flat shard
    return torch.from_numpy(raw).view(view.dtype).view(view.shape)


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        chunks = {k: v for k, v in state_dict.items() if isinstance(v, _Chunks)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(chunks)  # DCP's meta-tensor pass maps objects it does not know to None

    def lookup_tensor(self, index):
        return _lookup(self.state_dict, index) if isinstance(self.state_dict.get(index.fqn), _Chunks) \
            else super().lookup_tensor(index)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        """``extra``, as data: DCP's own planner loads it with ``weights_only=False``, which runs
        whatever a crafted checkpoint holds."""
        name = self.metadata.storage_data[read_item.storage_index].relative_path
        try:
            self.state_dict[read_item.dest_index.fqn] = load_data(value)
        except Exception as e:  # noqa: BLE001 -- an unpickling error: never runs, always named
            raise CheckpointError(f"{name}: key {read_item.dest_index.fqn!r} is not plain data ({e}); a checkpoint "
                                  "is data, never code: hpf loads extra with torch.load(weights_only=True)") from e


# -- the state dict of a ShardStep's state -----------------------------------------------------
def key_of(path: str) -> str:
    """The DCP key (and nn.Module name) of an hpf param path: ``blocks/0/w`` -> ``blocks.0.w``."""
    if "." in path:
        raise CheckpointError(f"parameter {path!r}: a '.' in a path would make its checkpoint key "
                              "ambiguous; rename the dict key")
    return path.replace("/", ".")


def _add_chunks(sd: dict, plan, bucket, rank: int, flat: torch.Tensor, key: str, only: frozenset | None) -> None:
    """Add the chunks of every param ``flat`` (this rank's state tensor of ``bucket``) holds.
    ``only=None``: flat is laid out as the param shard; else it packs just the params in
    ``only``, back to back (hpf.optim.Capabilities.state_layout; DistMuon's AdamW second moment)."""
    position = plan.shard_index(bucket, rank)
    at = 0
    for s in bucket.slots:
        if only is not None and s.path not in only:
            continue
        entry = sd.setdefault(key.format(key_of(s.path)), _Chunks(torch.Size(s.global_shape), flat.dtype, {}))
        piece = bucket.local_piece(s, position)
        if not piece.numel:
            continue
        first = piece.held.start if only is None else at
        block = plan.block_offsets(s.path, rank)
        for f, off, size in boxes(s.local_shape, piece.param.start, piece.param.stop):
            n = int(np.prod(size, dtype=np.int64))
            at_box = first + f - piece.param.start
            if (real := plan.unpadded(s.path, rank, off, size)) is not None:  # (None: all padding, uneven split)
                entry.views[tuple(a + b for a, b in zip(off, block))] = flat[at_box:at_box + n].view(size)[real]
        at += piece.numel


class Layout(NamedTuple):
    """What a checkpoint reads of a step: its plan, this rank, and the optimizer on the plan
    (``ShardStep.layout()``)."""

    plan: Any  # hpf.Plan
    rank: int
    optimizer: Any


def state_dict(layout: Layout, state) -> dict[str, Any]:
    """key -> this rank's chunks of ``state`` (views, global offsets) or a scalar: what a save writes, a restore reads into."""
    plan, rank = layout.plan, layout.rank
    sd: dict[str, Any] = {}
    for b, shard in zip(plan.buckets, state.params):
        _add_chunks(sd, plan, b, rank, shard, "{}", None)
    opt_state, optimizer = state.opt_state, layout.optimizer
    if not hasattr(opt_state, "_asdict"):
        raise CheckpointError(f"optimizer state {type(opt_state).__name__} is not a NamedTuple of fields; "
                              "hpf.checkpoint saves AdamWState and MuonState")
    layouts = capabilities(optimizer).state_layout  # packed fields' params
    for name, value in opt_state._asdict().items():
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            sd[f"optimizer.{name}"] = value
        elif isinstance(value, (list, tuple)) and len(value) == len(plan.buckets):
            for b, t in zip(plan.buckets, value):
                if b.frozen:  # not trained: no optimizer state
                    continue
                only = layouts.get(name)
                if only is None and t.shape != (b.shard_numel,):
                    raise CheckpointError(f"optimizer state {name}[{b.index}] has shape {tuple(t.shape)}, not the "
                                          f"flat shard ({b.shard_numel},); hpf.checkpoint cannot place it")
                _add_chunks(sd, plan, b, rank, t, "optimizer.state.{}." + name, only)
        else:
            raise CheckpointError(f"optimizer state field {name!r} ({type(value).__name__}) is neither a scalar "
                                  "tensor nor one tensor per plan bucket; hpf.checkpoint cannot place it")
    if state.loss_scale is not None:  # fp16's loss scale (hpf.LossScale): the same on every rank
        sd.update({f"loss_scale.{k}": v for k, v in state.loss_scale._asdict().items()})
    for v in sd.values():  # a zero-size tensor is one empty chunk (DCP records no key without chunks)
        if isinstance(v, _Chunks) and not v.views and not v.shape.numel():
            v.views[(0,) * len(v.shape)] = torch.empty(v.shape, dtype=v.dtype)
    for b, r in zip(plan.buckets, state.error_feedback or ()):
        if r.numel():  # this rank's row of a (world, n) tensor
            sd[f"{FEEDBACK}{b.index}"] = _Chunks(torch.Size((plan.mesh.size, r.numel())), r.dtype,
                                                  {(rank, 0): r.view(1, -1)})
    return sd


def _fitting_feedback(path: Path, metadata, sd: dict) -> None:
    """Drop from ``sd`` the residuals the checkpoint has none of, or none of this shape (another
    mesh or plan): they stay zero, which a warning says once."""
    md = metadata.state_dict_metadata
    misfits = [k for k, v in sd.items() if k.startswith(FEEDBACK) and (k not in md or tuple(md[k].size) != v.shape)]
    for k in misfits:
        del sd[k]
    if misfits and world.rank() == 0:
        warnings.warn(f"{path}: the checkpoint holds no error-feedback residuals for this mesh and plan (saved "
                      "without them or on another mesh): they start at zero", stacklevel=4)


def _skeleton(plan) -> Any:
    """The params tree as JSON (dicts, lists, tuples), each leaf the path of the param it holds:
    a tied leaf names the param it shares (``head`` -> ``"embed"``), which alone is saved."""
    def walk(x, path):
        if isinstance(x, dict):
            return {str(k): walk(v, f"{path}/{k}" if path else str(k)) for k, v in x.items()}
        if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
            items = [walk(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(x)]
            return items if isinstance(x, list) else {"__tuple__": items}
        if isinstance(x, str):
            return x
        raise CheckpointError(f"params at {path!r}: a {type(x).__name__} container; hpf checkpoints "
                              "keep dict/list/tuple trees")
    return walk(plan.tree({p: p for p in plan.slots}), "")


def _unskeleton(node: Any, leaves: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, str):
        return leaves[node]
    if isinstance(node, list):
        return [_unskeleton(v, leaves) for v in node]
    if set(node) == {"__tuple__"}:
        return tuple(_unskeleton(v, leaves) for v in node["__tuple__"])
    return {k: _unskeleton(v, leaves) for k, v in node.items()}


def _optimizer_name(optimizer) -> str:
    return type(optimizer).__name__


def _header(layout: Layout, sd: dict) -> dict:
    plan = layout.plan
    return {"format": "hpf-dcp", "version": VERSION, "optimizer": _optimizer_name(layout.optimizer),
            "optimizer_outline": [list(r) for r in capabilities(layout.optimizer).outline] or None,
            "tree": _skeleton(plan),
            "tensors": {k: [list(v.shape if isinstance(v, _Chunks) else v.shape), str(v.dtype)]
                        for k, v in sd.items() if isinstance(v, (_Chunks, torch.Tensor))}}


@contextlib.contextmanager
def _quiet():
    """DCP warns that one process means no process group: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# -- save --------------------------------------------------------------------------------------
_GROUP: dict[str, Any] = {}
at_reform(_GROUP.clear)


def _group():
    """A gloo group of its own, so an async save's collectives never interleave with the step's."""
    if "g" not in _GROUP:
        _GROUP["g"] = world.new_group(backend="gloo", timeout_s=600)
    return _GROUP["g"]


def _start(call: str, path: Path) -> None:
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
    _start("step.save", path)
    _agree(not_data(extra))
    group = _group() if world.is_distributed() else None
    if async_save:
        state = optree.tree_map(lambda t: t.detach().to("cpu", copy=True), state)
    sd = state_dict(layout, state)
    header = {**_header(layout, sd), "meta": json.loads(json.dumps(meta or {}))}  # (JSON now: a bad value fails here)
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
        with _quiet():
            metadata = dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp), planner=_SavePlanner(),
                                process_group=group, no_dist=group is None)
        mine = sorted(p.name for p in tmp.glob(f"__{rank}_*.distcp"))
        (tmp / f"__{rank}{_SUMS}").write_text(json.dumps(sums(tmp, mine, metadata)))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 -- DCP's is a BaseException (a full disk)
        error = e
    if (error := _first_error(error, group)) is None and rank == 0:
        try:
            _publish(tmp, path, header, keep_last)
        except Exception as e:  # noqa: BLE001 -- reported below, on every rank
            error = e
    if (error := _first_error(error, group)) is not None:
        box["error"] = save_failed(path, error)
        if rank == 0:  # free the space a full disk needs back; the last complete checkpoint stays
            shutil.rmtree(tmp, ignore_errors=True)


_SUMS = ".crc.json"  # each rank's {file: [size, {offset: crc32}]}, merged into the manifest by rank 0


def _first_error(error: BaseException | None, group) -> BaseException | None:
    """Once every rank of the save's group got this far (a rank that failed must not leave the others
    in a barrier): this rank's error, else the first failing rank's, so every rank names the cause."""
    if not world.is_distributed():
        return error
    said = world.all_gather_object(None if error is None else describe(error), group)
    first = next(((r, s) for r, s in enumerate(said) if s is not None), None)
    return error if error is not None or first is None else PeerSaveError(f"rank {first[0]}: {first[1]}")


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


# -- restore -----------------------------------------------------------------------------------
def _read_header(path: Path) -> tuple[dict, Any]:
    """hpf.json and DCP's metadata of ``path``, or a CheckpointError saying what is wrong."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if path.name.endswith(TMP_SUFFIX):
        raise CheckpointError(f"{path}: an incomplete save (a {TMP_SUFFIX} directory); restore the last "
                              f"complete checkpoint, e.g. hpf.checkpoint.latest({str(path.parent)!r})")
    if not (path / ".metadata").is_file() or not (path / HEADER).is_file():
        raise CheckpointError(f"{path}: not an hpf checkpoint (needs .metadata and {HEADER}); "
                              "it is incomplete or another kind of directory")
    try:
        header = json.loads((path / HEADER).read_text())
    except Exception as e:  # noqa: BLE001 -- any unreadable header means a corrupt checkpoint
        raise CheckpointError(f"{path / HEADER}: corrupt checkpoint header ({type(e).__name__}: {e})") from e
    if not isinstance(header, dict) or header.get("format") != "hpf-dcp" or header.get("version") != VERSION:
        said = (header.get("format"), header.get("version")) if isinstance(header, dict) else (None, None)
        raise CheckpointError(f"{path / HEADER}: format {said[0]!r} version {said[1]!r}; this hpf reads hpf-dcp "
                              f"version {VERSION}")
    if "crc32" in header and seal(header) != header:
        raise CheckpointError(f"{path / HEADER}: its CRC-32 does not match its contents: the file is corrupt (a "
                              "flipped byte); restore another checkpoint")
    if not isinstance(header.get("files"), dict):
        raise CheckpointError(f"{path / HEADER}: lists no files with their checksums (an older hpf saved it, or it was "
                              "edited), so none of its files can be checked; restore a checkpoint this hpf saved")
    header_fields(path, header)
    return header, Reader(path, header["files"]).read_metadata()


def _agree(error: CheckpointError | None) -> None:
    """Raise on every rank if any rank failed its checks (so none enters DCP's collectives)."""
    for r, m in enumerate(world.all_gather_object(str(error) if error else None)):
        if m is not None:
            raise CheckpointError(m if r == world.rank() else f"rank {r}: {m}")


def _some(keys: list[str], n: int = 8) -> str:
    return ", ".join(map(repr, keys[:n])) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def restore(layout: Layout, path, state, *, strict: bool = True) -> tuple[Any, Any]:
    """Load this rank's shards of params and optimizer state from ``path`` into ``state`` (in
    place), whatever mesh saved them; returns ``(state, extra)``. Every rank calls it, with the
    same path (checked).

    ``strict`` (as ``load_state_dict``'s): a checkpoint key this model and optimizer lack (a
    deeper model's layer) is a CheckpointError; ``strict=False`` drops such keys and warns,
    listing them. A key this model needs and the checkpoint lacks is always an error: the
    state would keep zeros or stale values."""
    path = Path(path)
    _start("step.restore", path)
    sd = state_dict(layout, state)
    sd["extra"] = None
    error, dropped = None, []
    try:
        header, metadata = _read_header(path)
        if header["optimizer"] != _optimizer_name(layout.optimizer):
            raise CheckpointError(f"{path}: saved with optimizer {header['optimizer']}, restoring into "
                                  f"{_optimizer_name(layout.optimizer)}; use the same optimizer")
        check_outline(path, header.get("optimizer_outline"), capabilities(layout.optimizer).outline)
        _fitting_feedback(path, metadata, sd)
        check_keys(path, metadata, sd)
        dropped = sorted(k for k in set(metadata.state_dict_metadata) - set(sd) if not k.startswith(FEEDBACK))
        if dropped and strict:
            raise CheckpointError(f"{path}: the checkpoint holds {len(dropped)} key(s) this model and optimizer do "
                                  f"not have: {_some(dropped)} (another model?); restore(path, strict=False) "
                                  "loads the rest and drops them")
    except CheckpointError as e:
        error = e
    _agree(error)
    scratch = _scratch(sd)  # read into new buffers; the state changes only once every byte is checked
    try:
        with _quiet():
            dcp.load(scratch, storage_reader=Reader(path, header["files"]), planner=_LoadPlanner(),
                     no_dist=not world.is_distributed())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 -- DCP's: the same on every rank
        raise read_failed(path, e) from e
    _agree(None)  # every rank read its part: only now does any rank write
    into, read = [], []
    for key, obj in sd.items():
        if isinstance(obj, _Chunks):
            into += obj.views.values()
            read += scratch[key].views.values()
        elif isinstance(obj, torch.Tensor):
            into.append(obj)
            read.append(scratch[key])
    if into:
        torch._foreach_copy_(into, read)
    if dropped and world.rank() == 0:
        warnings.warn(f"{path}: restore(strict=False) dropped {len(dropped)} checkpoint key(s) this model and "
                      f"optimizer do not have: {_some(dropped, 50)}", stacklevel=3)
    return state, scratch["extra"]


def _scratch(sd: dict) -> dict:
    """``sd`` with every tensor and chunk view replaced by a new CPU buffer of its shape: what a
    restore reads into, so that a read that fails half-way changes nothing (costs the state's
    size in host memory for the restore's duration)."""
    def fresh(t):
        return torch.empty(t.shape, dtype=t.dtype)
    return {k: _Chunks(v.shape, v.dtype, {o: fresh(t) for o, t in v.views.items()}) if isinstance(v, _Chunks)
            else fresh(v) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def meta(path) -> dict:
    """The ``meta`` dict a checkpoint was saved with (``{}`` if none), in this process alone.

    Raises:
        CheckpointError: ``path`` is not an hpf checkpoint."""
    return _read_header(Path(path))[0].get("meta", {})


def load_params(path) -> Any:
    """The full params pytree of a checkpoint, in this process alone (no process group needed).
    Tied params come back as one tensor at each of their paths, as they were trained."""
    path = Path(path)
    header, metadata = _read_header(path)
    paths = header_fields(path, header)
    want = {}
    for p in dict.fromkeys(paths):  # a tied param appears once per place it is used, and is loaded once
        if key_of(p) not in header["tensors"]:
            raise CheckpointError(f"{path}/{HEADER}: param {p!r} has no tensor in the checkpoint (a tied param "
                                  "saved by an older hpf?); step.restore(path) then step.full_params(state) reads it")
        shape, dtype = header["tensors"][key_of(p)]
        want[key_of(p)] = Want(tuple(shape), dtype_of(dtype))
    check_keys(path, metadata, want)  # before any allocation
    untreed = sorted(k for k in metadata.state_dict_metadata if k not in want and k != "extra"
                     and not k.startswith(("optimizer.", "loss_scale.", FEEDBACK)))
    if untreed:
        raise CheckpointError(f"{path / HEADER}: field 'tree' lacks the param(s) {_some(untreed)} that .metadata "
                              "holds; the file was damaged or edited after the save (restore another checkpoint)")
    tensors = {k: torch.empty(w.shape, dtype=w.dtype) for k, w in want.items()}
    try:
        with _quiet():
            dcp.load(tensors, storage_reader=Reader(path, header["files"]), planner=_LoadPlanner(),
                     no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 -- DCP's is a BaseException
        raise read_failed(path, e) from e
    return _unskeleton(header["tree"], {p: tensors[key_of(p)] for p in paths})


# -- exact resume helpers ----------------------------------------------------------------------
def rng_state() -> dict:
    """Python, numpy, torch CPU (and accelerator) RNG states, for ``extra``."""
    out = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.accelerator.is_available():
        out["accelerator"] = torch.get_device_module(torch.accelerator.current_accelerator()).get_rng_state()
    return out


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "accelerator" in state and torch.accelerator.is_available():
        torch.get_device_module(torch.accelerator.current_accelerator()).set_rng_state(state["accelerator"])
