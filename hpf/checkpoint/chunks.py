"""What a checkpoint holds of a step's state: DCP's state dict of it, and the header that describes it.

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
chunk layout into any other by overlap, so a checkpoint restores on any mesh. A zero-size
tensor is one empty chunk.
"""
from __future__ import annotations

import contextlib
import io
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..checkpoint_files import CheckpointError, load_data
from ..optim.base import capabilities

__all__ = ["Layout", "state_dict", "boxes", "key_of", "Chunks", "SavePlanner", "LoadPlanner", "header_of", "optimizer_name",
           "quiet", "VERSION", "FEEDBACK"]


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
class Chunks:
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
    return obj.views[tuple(index.offset)] if isinstance(obj, Chunks) else None


class SavePlanner(DefaultSavePlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, dedup_save_to_lowest_rank=True)

    def lookup_object(self, index):
        return _exact(_lookup(self.state_dict, index)) if isinstance(self.state_dict.get(index.fqn), Chunks) \
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


class LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        chunks = {k: v for k, v in state_dict.items() if isinstance(v, Chunks)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(chunks)  # DCP's meta-tensor pass maps objects it does not know to None

    def lookup_tensor(self, index):
        return _lookup(self.state_dict, index) if isinstance(self.state_dict.get(index.fqn), Chunks) \
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
        entry = sd.setdefault(key.format(key_of(s.path)), Chunks(torch.Size(s.global_shape), flat.dtype, {}))
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
        if isinstance(v, Chunks) and not v.views and not v.shape.numel():
            v.views[(0,) * len(v.shape)] = torch.empty(v.shape, dtype=v.dtype)
    for b, r in zip(plan.buckets, state.error_feedback or ()):
        if r.numel():  # this rank's row of a (world, n) tensor
            sd[f"{FEEDBACK}{b.index}"] = Chunks(torch.Size((plan.mesh.size, r.numel())), r.dtype,
                                                  {(rank, 0): r.view(1, -1)})
    return sd


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


def optimizer_name(optimizer) -> str:
    return type(optimizer).__name__


def header_of(layout: Layout, sd: dict) -> dict:
    plan = layout.plan
    return {"format": "hpf-dcp", "version": VERSION, "optimizer": optimizer_name(layout.optimizer),
            "optimizer_outline": [list(r) for r in capabilities(layout.optimizer).outline] or None,
            "tree": _skeleton(plan),
            "tensors": {k: [list(v.shape if isinstance(v, Chunks) else v.shape), str(v.dtype)]
                        for k, v in sd.items() if isinstance(v, (Chunks, torch.Tensor))}}


@contextlib.contextmanager
def quiet():
    """DCP warns that one process means no process group: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
