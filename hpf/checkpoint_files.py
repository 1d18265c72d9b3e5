"""A checkpoint's files read as data and checked: what hpf.checkpoint trusts nothing else for.

- ``.metadata`` (DCP's pickle) goes through an unpickler that builds DCP's metadata classes,
  torch dtypes and sizes, and paths only; any other global in it is refused, never called.
- ``extra`` is saved only if it loads back with ``torch.load(weights_only=True)`` (numpy arrays
  of plain dtypes allowed), and loaded so; every numpy dtype is checked again after loading.
- hpf.json lists every file with its size and a CRC-32 per item DCP stored in it (and seals
  itself with its own CRC-32); bytes that do not match are a CheckpointError naming the file,
  before they are used. A load verifies exactly the bytes it reads, as it reads them, and reads
  only files of its own folder that the list names (a seal anyone can recompute proves no origin).
  CRC-32 (zlib, ~4 GB/s) catches every flipped bit and burst and costs little beside the disk.
"""
from __future__ import annotations

import contextlib
import errno
import io
import json
import mmap
import pickle
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from .errors import CheckpointError

__all__ = ["CheckpointError", "Reader", "sums", "seal", "load_data", "not_data", "save_failed", "describe",
           "PeerSaveError", "read_failed", "HEADER", "TMP_SUFFIX"]

HEADER = "hpf.json"
TMP_SUFFIX = ".tmp"


_METADATA_CLASSES = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
                     ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` pickle, building only DCP's metadata classes, torch dtypes and
    sizes, and paths: a crafted file's other globals (``os.system``...) are refused, not called."""

    def find_class(self, module: str, name: str):
        ok = (module, name) in _METADATA_CLASSES or module == dcp_metadata.__name__ and name in (
            *dcp_metadata.__all__, "_MEM_FORMAT_ENCODING") or module == "torch" and isinstance(
            getattr(torch, name, None), torch.dtype)
        if not ok:
            raise pickle.UnpicklingError(f"global {module}.{name} is not one of DCP's metadata classes")
        return super().find_class(module, name)


def sums(root: Path, names, metadata=None) -> dict[str, list]:
    """What the manifest records of files in ``root``: ``{name: [size, {offset: crc32}]}``, a
    CRC-32 per item DCP stored (``metadata``: the Metadata dcp.save returned), or of the whole
    file (offset 0) for a file without items (``.metadata``)."""
    items: dict[str, list] = {n: [] for n in names}
    for info in (metadata.storage_data.values() if metadata is not None else ()):
        if info.relative_path in items:
            items[info.relative_path].append((info.offset, info.length))
    out = {}
    for n in names:
        size = (root / n).stat().st_size
        with open(root / n, "rb") as f, (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else
                                        contextlib.nullcontext(b"")) as view:  # no copy of what was just written
            out[n] = [size, {str(o): zlib.crc32(memoryview(view)[o:o + n_]) for o, n_ in sorted(set(items[n])) or
                             [(0, size)]}]
    return out


class Reader(dcp.FileSystemReader):
    """DCP's file reader that reads ``.metadata`` through :class:`_MetadataUnpickler` and checks
    what it reads against the manifest: each file's size, and each item's bytes against their
    CRC-32 just before DCP reads them (through a map of the file: no copy, no second pass)."""

    def __init__(self, path: Path, files: dict):
        super().__init__(path)
        self.root, self.files, self.maps = Path(path), files, {}

    def _listed(self, name: str) -> None:
        """``name`` is a file of this folder (no other folder, no link out of it) and in the manifest."""
        file = self.root / name
        if Path(name).name != name or name in ("", ".", "..") or file.resolve().parent != self.root.resolve():
            raise CheckpointError(f"{self.root}: .metadata names the file {name!r}, which is not in the checkpoint's "
                                  "folder; a checkpoint reads only its own files (it was changed after it was saved)")
        if name not in self.files:
            raise CheckpointError(f"{file}: not in the checkpoint's manifest ({HEADER}); the "
                                  "checkpoint was changed after it was saved")

    def _verify(self, name: str, offset: int, length: int) -> None:
        """Bytes ``[offset, offset+length)`` of file ``name`` are the ones saved."""
        self._listed(name)
        size, crcs = self.files[name]
        if name not in self.maps:
            have = (self.root / name).stat().st_size
            if have != size:
                raise CheckpointError(f"{self.root / name}: {have} bytes, but {size} bytes were saved (truncated or "
                                      "replaced); restore another checkpoint")
            with open(self.root / name, "rb") as f:
                self.maps[name] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        with memoryview(self.maps[name]) as view:
            ok = offset + length <= size and zlib.crc32(view[offset:offset + length]) == crcs.get(str(offset))
        if not ok:
            raise CheckpointError(f"{self.root / name}: bytes {offset}-{offset + length} do not match the CRC-32 "
                                  f"saved in {HEADER}: the file is corrupt (a flipped byte); restore another "
                                  "checkpoint")

    def read_metadata(self, *args, **kwargs):
        md = self.root / ".metadata"
        try:
            self._verify(".metadata", 0, self.files.get(".metadata", [0])[0])
            metadata = _MetadataUnpickler(io.BytesIO(md.read_bytes())).load()
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 -- refused or corrupt: the file is named either way
            raise CheckpointError(f"{md}: not DCP metadata ({type(e).__name__}: {e}); a checkpoint is data, "
                                  "never code") from e
        finally:
            self._close()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise CheckpointError(f"{md}: holds a {type(metadata).__name__}, not DCP metadata")
        for info in metadata.storage_data.values():  # before DCP opens any of them
            self._listed(str(info.relative_path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _slice_file(self, file, sinfo):
        self._verify(sinfo.relative_path, sinfo.offset, sinfo.length)
        return super()._slice_file(file, sinfo)

    def read_data(self, plan, planner):
        try:
            return super().read_data(plan, planner)
        finally:
            self._close()

    def _close(self) -> None:
        for m in self.maps.values():
            if isinstance(m, mmap.mmap):
                m.close()
        self.maps.clear()


_NP_CORE = getattr(np, "_core", None) or np.core
_NUMPY = [np.ndarray, np.dtype, _NP_CORE.multiarray._reconstruct, _NP_CORE.multiarray.scalar,
          *(getattr(np.dtypes, n) for n in getattr(np.dtypes, "__all__", ()) if n not in ("ObjectDType", "VoidDType"))]
_PLAIN_KINDS = frozenset("biufcmMSU")  # numpy dtype kinds whose bytes are values: not object (O), void/structured (V)


def load_data(buffer) -> Any:
    """``extra`` read back as data: ``torch.load(weights_only=True)`` with numpy arrays and scalars
    allowed too (hpf.checkpoint.rng_state holds numpy's RNG state), of plain dtypes only
    (:func:`_refuse_pointers`). Raises ValueError saying which object is not data."""
    try:
        with torch.serialization.safe_globals(_NUMPY):
            data = torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as e:  # torch's message: the refused global, amid advice to trust the file
        said = str(e).split("WeightsUnpickler error:")[-1].split("Check the documentation")[0].strip()
        raise ValueError((said.splitlines()[-1] if said else str(e)).split(" Please use")[0]) from None
    _refuse_pointers(data)
    return data


def _refuse_pointers(tree: Any) -> None:
    """Raise ValueError naming the first numpy array, scalar or dtype in ``tree`` whose dtype is
    object, void or structured. numpy trusts the flags a pickled dtype carries: a void dtype with
    an object field, flagged as holding none, loads raw bytes that ``repr`` or
    ``np.random.set_state`` then follow as pointers (a SIGSEGV, or worse). Reads no element."""
    todo = [("extra", tree)]
    while todo:
        where, x = todo.pop()
        if isinstance(x, dict):
            todo += [(f"{where}[{k!r}]", v) for k, v in x.items()]
        elif isinstance(x, (list, tuple)):
            todo += [(f"{where}[{i}]", v) for i, v in enumerate(x)]
        elif isinstance(x, (np.dtype, np.ndarray, np.generic)):
            dt = x if isinstance(x, np.dtype) else x.dtype
            if dt.kind not in _PLAIN_KINDS or dt.fields is not None or dt.subdtype is not None:
                raise ValueError(f"{where} is a numpy {type(x).__name__} of dtype {dt.str!r} (object, void or "
                                 "structured: its bytes may be pointers); store numbers, strings or arrays of "
                                 "plain dtypes (bool, int, float, complex, datetime, str)")


def not_data(extra: Any) -> CheckpointError | None:
    """Why ``extra`` would not load back as data (:func:`load_data`), or None: found at the
    save, not at the restore that needs it."""
    buffer = io.BytesIO()
    try:
        torch.save(extra, buffer)
        buffer.seek(0)
        load_data(buffer)
    except Exception as e:  # noqa: BLE001 -- which object, in torch's words
        return CheckpointError(f"extra: {e}. extra holds tensors, numpy "
                               "arrays, numbers, strings, lists, tuples and dicts (a checkpoint is data, never code: "
                               "it loads with torch.load(weights_only=True)); convert other objects to those")
    return None


def _causes(error: BaseException) -> list[BaseException]:
    """The exceptions behind DCP's CheckpointException (one per failed rank, each with its
    frames), or ``[error]``."""
    if not isinstance(error, CheckpointException):
        return [error]
    return [f[0] if isinstance(f, tuple) else f for f in error.failures.values()] or [error]


class PeerSaveError(RuntimeError):
    """Another rank's failure to write its part of a save, as that rank described it."""


def describe(error: BaseException) -> str:
    """An error behind a save in one line: its type and its first line (DCP's: the first failed rank's)."""
    cause = _causes(error)[0]
    return str(cause) if isinstance(cause, PeerSaveError) else \
        f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"


def save_failed(path: Path, error: BaseException) -> CheckpointError:
    """The CheckpointError of a save that was not published (``error``: this rank's, or a peer's)."""
    if isinstance(error, CheckpointError):
        return error
    cause = _causes(error)[0]
    return CheckpointError(f"saving {path}: {describe(error)}{_full_disk(path, cause)}; nothing was published")


# How a full disk reaches a save: an OSError (ENOSPC), or torch's zip writer's own words when the
# short write happens inside it (``enforce fail at inline_container.cc ... unexpected pos``).
_FULL_DISK_WORDS = ("unexpected pos", "file write failed", "No space left", "ENOSPC")


def _full_disk(path: Path, cause: BaseException | None) -> str:
    """``": the disk is full ..."`` when ``cause`` is a full disk however torch reports it, else ``""``."""
    if cause is None or not (isinstance(cause, OSError) and cause.errno == errno.ENOSPC
                             or any(w in str(cause) for w in _FULL_DISK_WORDS)):
        return ""
    folder = next((p for p in (path.parent, *path.parents) if p.exists()), None)
    free = f", {shutil.disk_usage(folder).free} bytes free on {folder}" if folder is not None else ""
    return f": the disk is full (no space left{free}); free space or save elsewhere"


def seal(header: dict) -> dict:
    """``header`` with its own CRC-32 (of its canonical JSON), so a flipped byte in it is caught too."""
    body = {k: v for k, v in header.items() if k != "crc32"}
    return {**body, "crc32": zlib.crc32(json.dumps(body, sort_keys=True).encode())}


def read_failed(path: Path, error: BaseException) -> CheckpointError:
    """A failed DCP read as a CheckpointError: hpf's own (a file that fails its checksum, named)
    when a rank raised one, else DCP's error."""
    causes = _causes(error)
    ours = [c for c in causes if isinstance(c, CheckpointError)]
    if ours:
        return CheckpointError(str(ours[0]))
    return CheckpointError(f"{path}: reading failed ({type(causes[0]).__name__}: {causes[0]})")
