"""A checkpoint's files read as data and checked: what hpf.checkpoint trusts nothing else for.

- ``.metadata`` (DCP's pickle) goes through an unpickler that builds DCP's metadata classes,
  torch dtypes and sizes, and paths only; any other global in it is refused, never called.
- ``extra`` is saved only if it loads back with ``torch.load(weights_only=True)`` (numpy arrays
  allowed), and loaded so.
- hpf.json lists every file with its size and CRC-32 (and seals itself with its own CRC-32);
  a file that does not match is a CheckpointError naming it, before its bytes are used.
  CRC-32 (zlib, ~4 GB/s) catches every flipped bit and burst and costs little beside the disk.
"""
from __future__ import annotations

import io
import json
import pickle
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException

__all__ = ["CheckpointError", "Reader", "sums", "seal", "load_data", "not_data", "save_failed", "read_failed", "HEADER",
           "TMP_SUFFIX"]

HEADER = "hpf.json"
TMP_SUFFIX = ".tmp"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or restored; the message names the path and the key."""


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


def _crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def sums(root: Path, names) -> dict[str, list[int]]:
    """``{name: [size, crc32]}`` of files in ``root``: what the manifest records."""
    return {n: [(root / n).stat().st_size, _crc(root / n)] for n in names}


def _verify(path: Path, name: str, files: dict | None) -> None:
    """The file ``name`` of checkpoint ``path`` is the one its manifest lists (size and CRC-32)."""
    if files is None:  # a checkpoint of an hpf without checksums: read_header warned
        return
    if name not in files:
        raise CheckpointError(f"{path / name}: not in the checkpoint's manifest ({HEADER}); the checkpoint was "
                              "changed after it was saved")
    size, crc = files[name]
    f = path / name
    have = f.stat().st_size if f.is_file() else -1
    if have != size:
        raise CheckpointError(f"{f}: {'missing' if have < 0 else f'{have} bytes'}, but {size} bytes were saved "
                              "(truncated or replaced); restore another checkpoint")
    if _crc(f) != crc:
        raise CheckpointError(f"{f}: its CRC-32 does not match the one saved in {HEADER}: the file is corrupt "
                              "(a flipped byte); restore another checkpoint")


class Reader(dcp.FileSystemReader):
    """DCP's file reader that reads ``.metadata`` through :class:`_MetadataUnpickler` and checks
    every file against the manifest before reading from it."""

    def __init__(self, path: Path, files: dict | None):
        super().__init__(path)
        self.root, self.files = Path(path), files

    def read_metadata(self, *args, **kwargs):
        _verify(self.root, ".metadata", self.files)
        try:
            with open(self.root / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except Exception as e:  # noqa: BLE001 -- refused or corrupt: the file is named either way
            raise CheckpointError(f"{self.root / '.metadata'}: not DCP metadata ({type(e).__name__}: {e}); "
                                  "a checkpoint is data, never code") from e
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise CheckpointError(f"{self.root / '.metadata'}: holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
            _verify(self.root, name, self.files)
        return super().read_data(plan, planner)


_NUMPY = (np.ndarray, np.dtype, getattr(np, "_core", getattr(np, "core", None)).multiarray._reconstruct,
          getattr(np, "_core", getattr(np, "core", None)).multiarray.scalar)


def load_data(buffer) -> Any:
    """``extra`` read back as data: ``torch.load(weights_only=True)`` with numpy arrays and scalars
    allowed too (older hpf train checkpoints hold numpy's RNG state)."""
    with torch.serialization.safe_globals(list(_NUMPY)):
        return torch.load(buffer, weights_only=True)


def not_data(extra: Any) -> CheckpointError | None:
    """Why ``extra`` would not load back as data (:func:`load_data`), or None: found at the
    save, not at the restore that needs it."""
    buffer = io.BytesIO()
    try:
        torch.save(extra, buffer)
        buffer.seek(0)
        load_data(buffer)
    except Exception as e:  # noqa: BLE001 -- which object, in torch's words
        return CheckpointError(f"extra: {type(e).__name__}: {str(e).splitlines()[0]}. extra holds tensors, numpy "
                               "arrays, numbers, strings, lists, tuples and dicts (a checkpoint is data, never code: "
                               "it loads with torch.load(weights_only=True)); convert other objects to those")
    return None



def _causes(error: BaseException) -> list[BaseException]:
    """The exceptions behind DCP's CheckpointException (one per failed rank, each with its
    frames), or ``[error]``."""
    if not isinstance(error, CheckpointException):
        return [error]
    return [f[0] if isinstance(f, tuple) else f for f in error.failures.values()] or [error]


def save_failed(path: Path, error: BaseException | None) -> CheckpointError:
    """The CheckpointError of a save that was not published (``error``: this rank's, if any)."""
    if isinstance(error, CheckpointError):
        return error
    cause = _causes(error)[0] if error is not None else None
    why = f"{type(cause).__name__}: {cause}" if cause is not None else "another rank failed to write its part"
    return CheckpointError(f"saving {path}: {why}; nothing was published")


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
