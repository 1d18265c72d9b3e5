"""What a restore checks of a checkpoint before it changes anything or allocates a tensor.

- hpf.json's fields (:func:`header_fields`): each of the right type (a crafted or damaged file
  is a CheckpointError naming the file and the field, never a KeyError or a torch call).
- The optimizer's stages (:func:`check_outline`): the same paths and names as the saved ones.
- Each key a load needs (:func:`check_keys`): saved, of the same shape and dtype, and covered
  by its chunks: every element exactly once (a chunk dropped from ``.metadata`` would leave
  elements as they were, or uninitialized), each chunk's bytes stored in a file big enough for
  them, so a size is checked against the file before anything that size is allocated.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

from .checkpoint_files import HEADER
from .errors import CheckpointError

__all__ = ["Want", "header_fields", "check_keys", "check_outline", "dtype_of"]


class Want(NamedTuple):
    """A tensor a load needs, by its global shape and dtype (before it is allocated)."""

    shape: tuple
    dtype: torch.dtype


def _bad(path: Path, field: str, why: str) -> CheckpointError:
    return CheckpointError(f"{path / HEADER}: field {field!r} {why}; the file was damaged or edited after the save "
                           "(restore another checkpoint)")


def check_outline(path: Path, saved: list | None, mine) -> None:
    """CheckpointError unless the optimizer's stages (its ``capabilities.outline``: (path, name,
    hyper-parameters) each) have the saved paths and names: the state's fields may match while
    their meaning does not (decay before Adam or after, another partition of the params).
    Hyper-parameters may differ (a resumed run may change its lr). A checkpoint without the
    record (an hpf before it, or an optimizer not made of stages) is not checked here."""
    if not saved:
        return
    was, now = [(r[0], r[1]) for r in saved], [(r[0], r[1]) for r in mine]
    if was == now:
        return
    at = next((i for i, (a, b) in enumerate(zip(was, now)) if a != b), min(len(was), len(now)))
    where = lambda rs: f"{rs[at][1]} at {rs[at][0] or 'the top'!r}" if at < len(rs) else "no stage"  # noqa: E731
    raise CheckpointError(f"{path}: saved with another optimizer chain: its stage {at} is {where(was)}, this "
                          f"optimizer's is {where(now)} (saved stages: {_listed(was)}). "
                          "The state's fields may match, but their meaning does not: build the optimizer with the "
                          "same chain and partition to restore it, or start the new optimizer from fresh state")


def _listed(stages: list) -> str:
    return "; ".join(f"{p or 'top'} {n}" for p, n in stages)


def dtype_of(name: Any) -> torch.dtype | None:
    """The torch dtype a header names (``"torch.float32"``), or None when it names none."""
    if not isinstance(name, str) or not name.startswith("torch."):
        return None
    found = getattr(torch, name.removeprefix("torch."), None)
    return found if isinstance(found, torch.dtype) else None


def _tree_leaves(path: Path, node: Any, where: str, out: list) -> None:
    if isinstance(node, str):
        out.append(node)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _tree_leaves(path, v, f"{where}/{i}", out)
    elif isinstance(node, dict) and set(node) == {"__tuple__"}:
        _tree_leaves(path, node["__tuple__"], where, out) if isinstance(node["__tuple__"], list) else \
            _raise(_bad(path, where, "holds a __tuple__ that is not a list"))
    elif isinstance(node, dict):
        for k, v in node.items():
            _tree_leaves(path, v, f"{where}/{k}", out)
    else:
        raise _bad(path, where, f"is a {type(node).__name__}; a params tree holds dicts, lists and path strings")


def _raise(e: Exception):
    raise e


def header_fields(path: Path, header: dict) -> list[str]:
    """Every field of hpf.json a load reads has its type (tree, tensors, optimizer, meta, files);
    returns the tree's leaves (param paths)."""
    for name, kind in (("tree", (dict, list, str)), ("tensors", dict), ("optimizer", str), ("files", dict)):
        if not isinstance(header.get(name), kind):
            raise _bad(path, name, "is missing" if name not in header else f"is a {type(header[name]).__name__}")
    outline = header.get("optimizer_outline")
    if not (outline is None or isinstance(outline, list) and all(
            isinstance(r, list) and len(r) == 3 and isinstance(r[0], str) and isinstance(r[1], str)
            and isinstance(r[2], dict) for r in outline)):
        raise _bad(path, "optimizer_outline", "is not a list of [path, name, hyper-parameters]")
    if not isinstance(header.get("meta", {}), dict):
        raise _bad(path, "meta", f"is a {type(header['meta']).__name__}, not a dict")
    for name, entry in header["files"].items():
        if not (isinstance(entry, list) and len(entry) == 2 and _count(entry[0]) and isinstance(entry[1], dict)
                and all(isinstance(k, str) and _count(v) for k, v in entry[1].items())):
            raise _bad(path, f"files/{name}", "is not [size, {offset: crc32}]")
    for key, entry in header["tensors"].items():
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)
                and all(map(_count, entry[0]))):
            raise _bad(path, f"tensors/{key}", "is not [shape (a list of sizes >= 0), dtype]")
        if dtype_of(entry[1]) is None:
            raise _bad(path, f"tensors/{key}", f"names the dtype {entry[1]!r}, which is no torch dtype")
    leaves: list[str] = []
    try:
        _tree_leaves(path, header["tree"], "tree", leaves)
    except RecursionError:
        raise _bad(path, "tree", "is nested too deeply") from None
    return leaves


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def check_keys(path: Path, metadata, want: dict[str, Any]) -> None:
    """Every key ``want`` needs is saved with the same shape and dtype, its chunks cover each
    element once, and their bytes are on disk (each chunk's stored length holds its elements)."""
    md, storage = metadata.state_dict_metadata, metadata.storage_data or {}
    for key, obj in want.items():
        if key not in md:
            raise CheckpointError(f"{path}: key {key!r} is missing from the checkpoint (another model or "
                                  "optimizer?)")
        saved = md[key]
        if not hasattr(obj, "shape"):  # an object (extra)
            if not isinstance(saved, BytesStorageMetadata):
                raise CheckpointError(f"{path}: key {key!r} is not an object in the checkpoint")
            continue
        if not isinstance(saved, TensorStorageMetadata):
            raise CheckpointError(f"{path}: key {key!r} is not a tensor in the checkpoint")
        if tuple(saved.size) != tuple(obj.shape):
            raise CheckpointError(f"{path}: key {key!r} has shape {tuple(saved.size)} in the checkpoint, "
                                  f"but this model's is {tuple(obj.shape)}")
        if saved.properties.dtype != obj.dtype:
            raise CheckpointError(f"{path}: key {key!r} is {saved.properties.dtype} in the checkpoint, "
                                  f"but this state holds {obj.dtype}")
        _covered(path, key, saved, storage, obj.dtype.itemsize)
    _on_disk(path, storage)


def _covered(path: Path, key: str, saved, storage: dict, itemsize: int) -> None:
    """The chunks of ``key`` tile its shape: in bounds, disjoint, their volumes summing to its
    size, and each stored in at least the bytes its elements take."""
    shape = np.array(tuple(saved.size), dtype=np.int64)
    chunks = saved.chunks or []
    if not chunks:
        raise CheckpointError(f"{path}: key {key!r} has no chunks in .metadata, so none of its elements can be read")
    lo = np.array([tuple(c.offsets) for c in chunks], dtype=np.int64).reshape(len(chunks), len(shape))
    hi = lo + np.array([tuple(c.sizes) for c in chunks], dtype=np.int64).reshape(len(chunks), len(shape))
    if (lo < 0).any() or (hi < lo).any() or (hi > shape).any():
        raise CheckpointError(f"{path}: key {key!r} has a chunk outside its shape {tuple(shape)} in .metadata")
    volumes = np.prod(hi - lo, axis=1)
    for c, v in zip(chunks, volumes):
        info = storage.get(MetadataIndex(key, torch.Size(c.offsets)))
        if v and (info is None or info.length < int(v) * itemsize):
            raise CheckpointError(f"{path}: key {key!r}: the chunk at {tuple(c.offsets)} ({int(v)} elements) has "
                                  f"{'no bytes' if info is None else f'{info.length} bytes'} in .metadata's storage")
    total = int(np.prod(shape))
    lo, hi = lo[volumes > 0], hi[volumes > 0]
    overlap = any(((lo[i] < hi[i + 1:]) & (lo[i + 1:] < hi[i])).all(axis=1).any()  # pairwise: few chunks per key
                  for i in range(len(lo)))
    if overlap or int(volumes.sum()) != total:
        raise CheckpointError(f"{path}: key {key!r}: its chunks in .metadata cover {int(volumes.sum())} of its {total} "
                              f"elements{' and overlap' if overlap else ''}; a restore must cover every element once "
                              "(the checkpoint is incomplete or was edited): restore another checkpoint")


def _on_disk(path: Path, storage: dict) -> None:
    ends: dict[str, tuple[int, str]] = {}
    for index, info in storage.items():
        end = info.offset + info.length
        if end > ends.get(info.relative_path, (-1, ""))[0]:
            ends[info.relative_path] = (end, index.fqn)
    for name, (end, key) in sorted(ends.items()):
        size = (path / name).stat().st_size if (path / name).is_file() else -1
        if size < end:
            raise CheckpointError(f"{path}: file {name} is {'missing' if size < 0 else f'truncated ({size} bytes)'};"
                                  f" key {key!r} needs bytes up to {end}")
