"""Restores: a checkpoint read into a step's state on any mesh, or as full params in one process.

A checkpoint is data, never code, and every file is checked against the CRC-32 in hpf.json
before its bytes are used (hpf.checkpoint_files). A restore covers every element of every
tensor or changes nothing: hpf.checkpoint_check proves each key's chunks tile it (and that the
files hold their bytes) before anything is allocated, and the read goes into new host buffers,
copied into the state only once every rank has read and checked all of its part.
``rng_state``/``set_rng_state`` carry the RNGs in ``extra``, for an exact resume.
"""
from __future__ import annotations

import json
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..checkpoint_check import Want, check_keys, check_outline, dtype_of, header_fields
from ..checkpoint_files import HEADER, TMP_SUFFIX, CheckpointError, Reader, read_failed, seal
from ..comm import world
from ..optim.base import capabilities
from .agreement import agree, start
from .chunks import FEEDBACK, VERSION, Chunks, Layout, LoadPlanner, key_of, optimizer_name, quiet, state_dict

__all__ = ["restore", "load_params", "meta", "rng_state", "set_rng_state"]


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


def _unskeleton(node: Any, leaves: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, str):
        return leaves[node]
    if isinstance(node, list):
        return [_unskeleton(v, leaves) for v in node]
    if set(node) == {"__tuple__"}:
        return tuple(_unskeleton(v, leaves) for v in node["__tuple__"])
    return {k: _unskeleton(v, leaves) for k, v in node.items()}


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
    start("step.restore", path)
    sd = state_dict(layout, state)
    sd["extra"] = None
    error, dropped = None, []
    try:
        header, metadata = _read_header(path)
        if header["optimizer"] != optimizer_name(layout.optimizer):
            raise CheckpointError(f"{path}: saved with optimizer {header['optimizer']}, restoring into "
                                  f"{optimizer_name(layout.optimizer)}; use the same optimizer")
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
    agree(error)
    scratch = _scratch(sd)  # read into new buffers; the state changes only once every byte is checked
    try:
        with quiet():
            dcp.load(scratch, storage_reader=Reader(path, header["files"]), planner=LoadPlanner(),
                     no_dist=not world.is_distributed())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 -- DCP's: the same on every rank
        raise read_failed(path, e) from e
    agree(None)  # every rank read its part: only now does any rank write
    into, read = [], []
    for key, obj in sd.items():
        if isinstance(obj, Chunks):
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
    return {k: Chunks(v.shape, v.dtype, {o: fresh(t) for o, t in v.views.items()}) if isinstance(v, Chunks)
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
        with quiet():
            dcp.load(tensors, storage_reader=Reader(path, header["files"]), planner=LoadPlanner(),
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
