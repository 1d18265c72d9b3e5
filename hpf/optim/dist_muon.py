"""Layout-driven distributed Muon on flat FSDP shards (the paper's third idea).

Inside ``hpf.shard_step`` every rank holds one flat shard per plan bucket. The plan already
says which ranks hold which elements of every matrix, so:

- AdamW params and Muon's momentum are elementwise: each rank updates its own pieces, no
  communication.
- Newton-Schulz needs whole matrices. A matrix wholly inside one shard (or in a replicated
  bucket) is orthogonalized where it lies, with no communication. A matrix split across
  ranks gets one owner among its holders, picked once from the plan by longest-processing-
  time greedy on NS FLOPs (every rank computes the same assignment); the holders send the
  owner their pieces point-to-point, the owner runs NS once, and sends each holder its piece
  of the result. Ranks in other shard groups (HSDP or non-FSDP replicas) never take part. A
  matrix that tensor parallelism splits along its matrix dims spans the tp group: the owner is
  one of its ranks, the pieces are every place's shards, and it orthogonalizes the blocks put
  together (the padding of an uneven split left out), once.
- An owner's same-shape matrices (MoE experts included) go into one batched NS call.

The math is the stages of ``Muon.partition`` (hpf.optim.transforms): ``scale_by_muon``'s
momentum, Newton-Schulz and scaled step on the Muon pieces, the AdamW chain on the rest, so a
sharded run matches the single-device optimizer on the full params. This is that partition's
plan form: the layout decides who holds, owns and sends what. Pieces
travel point-to-point through hpf.comm.world.exchange, in ``comm_dtype``; with a low-bit slow
tier (the plan's ``slow_precision``) a piece bound for a rank across the slow tier travels
block-quantized like the FSDP collectives: momentum pieces to the owner in the grads' format,
the owner's direction back in the weights' format (the state itself is never quantized).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import torch

from hpf_kernels import dequantize, payload_bytes, quantize

from ..comm import world
from ..planning import Bucket, ParamSlot, Plan
from ..train_state import zeros, zeros_like
from ..tree import flatten as tree_flatten
from .base import Capabilities
from .early_muon import EarlyMuon
from .muon_math import MuonState, check_qk_heads, update_scale
from .muon_owners import assign_owners, check_whole_matrices, muon_paths, node_of, ns_shape, split_axes, stacked
from .stage import meta_params

__all__ = ["DistMuon"]


@dataclass(frozen=True)
class _Matrix:
    """A Muon matrix as this rank sees it."""

    bucket: int
    shape: tuple[int, ...]
    scale: float  # update_scale of the matrix
    mine: slice  # this rank's piece, in its shard (empty when it holds none)
    in_matrix: slice  # the same elements in the matrix's flat
    owner: int = -1  # global rank that orthogonalizes it (-1: wholly here)
    tag: int = 0  # the same on every rank: pairs sends with receives
    others: tuple[tuple[int, slice], ...] = ()  # (holder rank, its piece of the matrix flat), owner excluded
    # split by tp: the matrix flat is its stored blocks end to end, each (its stored shape, its place, its shape)
    blocks: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...] = ()

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s, _, _ in self.blocks) if self.blocks else math.prod(self.shape)

    def whole(self, flat: torch.Tensor) -> torch.Tensor:
        """The matrix of its flat (a tp-split one: each block without its padding, at its place)."""
        if not self.blocks:
            return flat.view(self.shape)
        out, at = flat.new_zeros(self.shape), 0
        for stored, offsets, shape in self.blocks:
            out[_box(offsets, shape)] = flat[at:at + math.prod(stored)].view(stored)[_box((0,) * len(shape), shape)]
            at += math.prod(stored)
        return out

    def flat(self, whole: torch.Tensor) -> torch.Tensor:
        """The inverse of ``whole``: the matrix's flat, the padding zeros."""
        if not self.blocks:
            return whole.reshape(-1)
        parts = []
        for stored, offsets, shape in self.blocks:
            block = whole.new_zeros(stored)
            block[_box((0,) * len(shape), shape)] = whole[_box(offsets, shape)]
            parts.append(block.reshape(-1))
        return torch.cat(parts)


def _matrix_of(plan: Plan, b: Bucket, slot: ParamSlot, piece, ranks: tuple[int, ...], rank: int, scale: str):
    """(``_Matrix`` fields but its owner's, the matrix's ranks, its pieces) of ``rank``'s ``piece``
    of ``slot`` (its shard group ``ranks``); a tp-split one spans the tp group (``stacked``)."""
    shape, axes = ns_shape(plan, slot), split_axes(plan, slot)
    common = dict(bucket=b.index, shape=shape, scale=update_scale(shape[-2], shape[-1], scale), mine=piece.held,
                  in_matrix=piece.param)
    if not axes:
        return common, ranks, [(ranks[i], b.local_piece(slot, i).param) for i in b.holders(slot)]
    members, pieces = stacked(plan, b, slot, tuple(plan.mesh.group_ranks(axes, r)[0] for r in ranks), axes)
    at = plan.mesh.group_index(axes, rank) * slot.numel
    common.update(in_matrix=slice(at + piece.param.start, at + piece.param.stop),
                  blocks=_blocks(plan, slot, members, len(ranks)))
    return common, members, pieces


def _box(offsets, shape) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, shape))


def _blocks(plan: Plan, slot: ParamSlot, members: tuple[int, ...], per_place: int) -> tuple:
    """``_Matrix.blocks`` of a tp-split matrix of ``members`` (``per_place`` ranks at each place)."""
    return tuple((tuple(slot.local_shape), plan.block_offsets(slot.path, r), plan.block_shape(slot.path, r))
                 for r in members[::per_place])



def _qk_pieces(muon, plan: Plan, rank: int) -> list[tuple[int, slice, tuple, int, tuple]]:
    """QK-Clip's pieces of this rank's shards: (bucket, in the shard, the param's shape, its
    first element in the piece, its heads)."""
    check_qk_heads(muon.qk_heads, {path: s.global_shape for path, s in plan.slots.items()})
    out = []
    for b in plan.buckets:
        for slot in b.slots:
            if slot.path not in muon.qk_heads:
                continue
            if tuple(slot.local_shape) != tuple(slot.global_shape):
                raise ValueError(f"muon(qk_clip=...): {slot.path!r} is split over the non-FSDP axes "
                                 f"{tuple(plan.compute_axes)}; QK-Clip needs whole q/k weights per shard group")
            piece = b.local_piece(slot, plan.shard_index(b, rank))
            if piece.numel:
                out.append((b.index, piece.held, tuple(slot.global_shape), piece.param.start, muon.qk_heads[slot.path]))
    return out


class DistMuon:
    """Muon on the flat shards of a plan; made by ``hpf.optim.muon(...).for_plan(plan, rank)``.

    ``init(shards)`` and ``update(grad_shards, state, shards)`` take one flat tensor per plan
    bucket, as ``hpf.shard_step`` passes them; grads are already the data-parallel mean.
    ``comm_dtype`` (e.g. torch.bfloat16) is the dtype pieces travel in; None: the grads' dtype.
    The state is MuonState(count, exp_avg: one buffer shaped like each shard (momentum or
    AdamW's first moment), exp_avg_sq: per bucket, AdamW's second moment of this rank's AdamW
    elements only), created eagerly, with the same structure on every rank.

    Args:
        muon: the hpf.optim.Muon whose hyper-parameters and AdamW fallback to run.
        plan: the step's plan (hpf.Plan): which rank holds which piece of each matrix.
        rank: this process's global rank.
        comm_dtype: the dtype matrix pieces travel in (None: the grads').

    Raises:
        ValueError: at construction, a Muon param split by non-FSDP axes along both a batch dim and
            its matrix dims; in ``init``/``update``, shards that are not one flat shard per plan bucket.
    """

    def __init__(self, muon, plan: Plan, rank: int, comm_dtype: torch.dtype | None = None):
        self.muon, self.plan, self.rank, self.comm_dtype = muon, plan, rank, comm_dtype
        # the stages it runs on pieces: the partition's Muon part (decay, scale_by_muon at Muon's lr) and the rest
        parts = muon.partition.transforms
        self.matrices = parts["muon"]
        self.stage = self.matrices.inner.stages[-1]
        on_muon = muon_paths(muon, plan)
        self.adamw_paths = frozenset(plan.slots) - on_muon
        for path in sorted(on_muon):
            check_whole_matrices(plan, plan.slots[path])
        self.owners, self.ns_load = assign_owners(plan, on_muon, muon.ns_steps, muon.ns_variant)
        self.adamw: list[tuple[int, slice, slice]] = []  # (bucket, in shard, in exp_avg_sq)
        adamw_paths: list[str] = []  # the param of each of them
        self.local: list[_Matrix] = []  # wholly in this rank's shard
        self.owned: list[_Matrix] = []  # split; this rank orthogonalizes them
        self.held: list[_Matrix] = []  # split; this rank holds a piece, another owns them
        self.adamw_numel: list[int] = []
        self.bytes_sent = 0  # point-to-point payload this rank sent, over all updates
        self.slow_bytes_sent = 0  # the part of it sent across the slow tier
        self.slow = plan.slow_precision
        tag = 0
        for b in plan.buckets:
            if b.frozen:  # not trained: no state, no update
                self.adamw_numel.append(0)
                continue
            position = plan.shard_index(b, rank)
            ranks = tuple(plan.shard_ranks(b, rank))
            n_adamw = 0
            for slot in b.slots:
                piece = b.local_piece(slot, position)
                mine, held = piece.held, piece.numel > 0
                if slot.path not in on_muon:
                    if held:
                        self.adamw.append((b.index, mine, slice(n_adamw, n_adamw + piece.numel)))
                        adamw_paths.append(slot.path)
                        n_adamw += piece.numel
                    continue
                if slot.numel == 0:
                    continue
                common, members, pieces = _matrix_of(plan, b, slot, piece, ranks, rank, muon.scale)
                tag += 1
                key = (b.index, members, slot.path)
                if key not in self.owners:
                    if held:
                        self.local.append(_Matrix(**common))
                    continue
                owner = self.owners[key]
                others = tuple((r, part) for r, part in pieces if r != owner)
                m = _Matrix(**common, owner=owner, tag=tag, others=others)
                if owner == rank:
                    self.owned.append(m)
                elif held:
                    self.held.append(m)
            self.adamw_numel.append(n_adamw)
        self._n_tags = tag
        self._index(parts["adamw"], adamw_paths)

    def _index(self, adamw, paths: list[str]) -> None:
        """What ``__init__`` derives from its pieces: AdamW's part on them, each piece resolved as
        its param (``paths``: the fallback's weight_decay_mask), the matrices' order, QK-Clip's pieces,
        the stages a checkpoint records."""
        meta = meta_params(self.plan)
        at = {p: i for i, p in enumerate(tree_flatten(meta)[0])}
        self.rest = adamw.for_params(meta).take([at[path] for path in paths])
        self._momentum_order = self.local + self.owned + self.held
        self._by_bucket: dict[int, list[int]] = defaultdict(list)  # bucket -> its matrices' places in _momentum_order
        for i, x in enumerate(self._momentum_order):
            self._by_bucket[x.bucket].append(i)
        self.qk = _qk_pieces(self.muon, self.plan, self.rank) if self.muon.qk_clip is not None else []
        stages = self.muon.transform.for_params(meta)  # Muon's stages, its labels resolved
        self._capabilities = Capabilities(early=self.muon.overlap and self.slow is None, aux=stages.aux,
                                          state_layout={"exp_avg_sq": self.adamw_paths}, outline=stages.outline())

    # -- optax-style interface ----------------------------------------------------------------
    def init(self, shards: Sequence[torch.Tensor]) -> MuonState:
        self._check(shards, "shards")
        return MuonState(torch.zeros((), dtype=torch.int64),
                         [s.new_zeros(0) if b.frozen else zeros_like(s) for b, s in zip(self.plan.buckets, shards)],
                         [zeros((n,), s.dtype, s.device) for s, n in zip(shards, self.adamw_numel)])

    @property
    def capabilities(self) -> Capabilities:
        """Work begun in backward (``overlap``, off under a low-bit slow tier); the step's aux
        under QK-Clip; ``exp_avg_sq`` holds AdamW's second moment of the AdamW params only; Muon's
        stages (made once: the step reads them each step)."""
        return self._capabilities

    def update(self, grads: Sequence[torch.Tensor], state: MuonState, params: Sequence[torch.Tensor],
               aux: dict | None = None) -> tuple[list[torch.Tensor], MuonState]:
        """One step, in place on ``params`` and ``state`` (donated); returns them. ``aux``: the
        step's aux, which hpf.shard_step passes (read only under QK-Clip)."""
        self._check(params, "params")
        self._check(grads, "grads", trained=True)
        self._check(state.exp_avg, "state.exp_avg", trained=True)
        self.muon.check_rates(int(state.count) + 1)
        self.muon.qk_gamma(aux)  # (raises before anything is sent)
        work = EarlyMuon(self, grads, state, scale=1.0, epoch=0, in_place=True)
        work.grads_final(range(len(self.plan.buckets)))
        work.apply(grads, params, aux)
        return params, state

    def early(self, grads: Sequence[torch.Tensor], state: MuonState, scale: float, attempt: int
              ) -> "EarlyMuon | None":
        """The step's Muon work, to start while backward runs (hpf.optim.EarlyUpdate): ``landed``
        as each unit's grads land, ``apply`` after the step's decision. ``scale``: what the step
        will multiply the summed grads by, if it does not clip; ``attempt``: the step attempts so
        far, the same on every rank (it keeps an abandoned attempt's pieces from pairing with
        this one's). None when ``muon(overlap=False)`` or under a low-bit slow tier."""
        if not self.muon.overlap or self.slow is not None:
            return None
        return EarlyMuon(self, grads, state, scale, epoch=1 + attempt % 64, in_place=False)

    # -- helpers -------------------------------------------------------------------------------
    def _assemble(self, x: _Matrix, own_piece: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The owner's flat buffer for a whole matrix, its own piece copied in (the rest is received)."""
        buf = torch.empty(x.numel, dtype=dtype, device=own_piece.device)
        buf[x.in_matrix] = own_piece
        return buf

    def _format(self, peer: int, side: str) -> str | None:
        """The low-bit format of a piece to or from ``peer`` (None: across the fast tier, or no low-bit tier)."""
        fmt = getattr(self.slow, side) if self.slow is not None else None
        mesh = self.plan.mesh
        return fmt if fmt and node_of(mesh, peer) != node_of(mesh, self.rank) else None

    def _wire(self, peer: int, side: str, piece: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``piece`` as it travels to ``peer``: in ``dtype``, or as a payload padded to whole blocks."""
        fmt = self._format(peer, side)
        if fmt is None:
            return piece.to(dtype)
        return quantize(torch.nn.functional.pad(piece.float(), (0, -piece.numel() % self.slow.block)), fmt,
                        self.slow.block).view(-1)

    def _arrival(self, peer: int, side: str, dest: torch.Tensor, arrivals: list) -> torch.Tensor:
        """The receive buffer for a piece from ``peer`` that lands in ``dest`` (a low-bit payload
        is noted in ``arrivals``, to unpack once it arrives)."""
        fmt = self._format(peer, side)
        if fmt is None:
            return dest
        k = self.slow.block
        buf = torch.empty(payload_bytes(dest.numel() + (-dest.numel() % k), fmt, k), dtype=torch.uint8,
                          device=dest.device)
        arrivals.append((buf, fmt, dest))
        return buf

    def _unpack(self, pending: list, arrivals: list) -> None:
        """Wait for an exchange; unpack its low-bit pieces (``arrivals``) into their destinations."""
        world.wait_all(pending)
        for buf, fmt, dest in arrivals:
            n, k = dest.numel(), self.slow.block
            dest.copy_(dequantize(buf, fmt, k, torch.empty(n + (-n % k), dtype=torch.float32, device=dest.device))[:n])

    def _exchange(self, sends, recvs) -> list:
        """Post point-to-point sends and receives, each (peer global rank, tensor, tag), as one batch."""
        self.bytes_sent += sum(t.numel() * t.element_size() for _, t, _ in sends)
        here = node_of(self.plan.mesh, self.rank)
        self.slow_bytes_sent += sum(t.numel() * t.element_size() for peer, t, _ in sends
                                    if node_of(self.plan.mesh, peer) != here)
        return world.exchange(sends, recvs)

    def _apply(self, params, matrices: list[_Matrix], directions: list[torch.Tensor], lr: float,
               weight_decay: float) -> None:
        """apply_muon_updates_ on flat pieces (as [1, k] views): the scale of each piece's whole
        matrix is passed as a number, so the piece's own shape plays no part."""
        by_scale: dict[float, tuple[list, list]] = defaultdict(lambda: ([], []))
        for x, d in zip(matrices, directions):
            p = params[x.bucket][x.mine]
            by_scale[x.scale][0].append(p.view(1, -1))
            by_scale[x.scale][1].append(d.to(p.dtype).view(1, -1))
        for scale, (ps, ds) in by_scale.items():
            self.stage.apply_(ps, ds, lr, weight_decay, scale)

    def _check(self, shards: Sequence[torch.Tensor], what: str, trained: bool = False) -> None:
        """One flat shard per bucket (``trained``: empty for frozen buckets, which have no grads or state)."""
        buckets = self.plan.buckets
        if len(shards) != len(buckets):
            raise ValueError(f"distributed Muon: {what} has {len(shards)} entries but the plan has "
                             f"{len(buckets)} buckets; pass one flat shard per bucket, as hpf.shard_step does")
        for b, s in zip(buckets, shards):
            if not isinstance(s, torch.Tensor) or s.shape != ((0,) if trained and b.frozen else (b.shard_numel,)):
                got = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
                raise ValueError(f"distributed Muon: {what}[{b.index}] (unit {b.unit!r}) has shape {got}, "
                                 f"expected the flat shard ({b.shard_numel},)")
