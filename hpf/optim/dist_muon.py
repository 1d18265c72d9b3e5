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

The math is the stages of ``Muon.transform`` (hpf.optim.transforms): ``scale_by_muon``'s
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
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Sequence

import torch

from hpf_kernels import dequantize, newton_schulz_flops, payload_bytes, quantize

from ..comm import world
from ..planning import Bucket, ParamSlot, Plan
from .base import Capabilities
from .muon_math import MuonState, check_qk_heads, qk_clip_, update_scale
from ..tree import flatten as tree_flatten
from .transforms import Hyper, meta_params, run

__all__ = ["DistMuon", "assign_owners", "ns_flops", "muon_paths", "muon_plan_state", "muon_sends", "muon_traffic"]


def ns_flops(shape: Sequence[int], steps: int, variant: str = "standard") -> int:
    """Newton-Schulz FLOPs of a [..., m, n] batch with ``variant`` (hpf_kernels.newton_schulz_flops)."""
    return newton_schulz_flops(shape, steps, variant)


def muon_paths(muon, plan: Plan) -> set[str]:
    """Paths of the params ``muon`` (an hpf.optim.Muon) orthogonalizes: those its partition labels
    "muon" (``Muon.label``); the rest take its AdamW fallback."""
    return {path for path, s in plan.slots.items() if muon.label(path, _meta(s)) == "muon"}


def muon_plan_state(muon, plan: Plan) -> tuple[int, Counter, int]:
    """(optimizer-state elements of the rank that holds most, NS FLOPs per rank, Muon matrices)
    of DistMuon on ``plan``, without building it: for hpf plan on meta tensors at any size.

    As DistMuon.init allocates: one buffer per shard element (Muon's momentum, or AdamW's first
    moment) plus AdamW's second moment of the shard's AdamW elements, which differ by rank.
    """
    paths = muon_paths(muon, plan)
    adamw: dict[tuple[int, int], int] = {}  # (bucket, shard position) -> AdamW elements there
    most = 0
    for r in range(plan.mesh.size):
        n = 0
        for b in plan.buckets:
            key = (b.index, plan.shard_index(b, r))
            if key not in adamw:
                adamw[key] = sum(b.local_piece(s, key[1]).numel for s in b.slots if s.path not in paths)
            n += b.shard_numel + adamw[key]
        most = max(most, n)
    return most, assign_owners(plan, paths, muon.ns_steps, muon.ns_variant)[1], len(paths)


def muon_sends(muon, plan: Plan, owners: dict | None = None) -> dict[int, Counter]:
    """Bytes each rank sends per step in DistMuon's point-to-point exchange (fp32), by tier
    ("fast", "slow"): each split matrix's non-owner pieces go to its owner and come back.
    ``owners``: assign_owners' answer for ``muon`` on ``plan``, if already at hand."""
    if owners is None:
        owners, _ = assign_owners(plan, muon_paths(muon, plan), muon.ns_steps, muon.ns_variant)
    sends: dict[int, Counter] = defaultdict(Counter)
    nodes = {r: _node(plan.mesh, r) for r in range(plan.mesh.size)}
    for b in plan.buckets:
        for slot, members, pieces in _matrices(plan, b):
            owner = owners.get((b.index, members, slot.path))
            for holder, part in pieces if owner is not None else ():
                if holder != owner:
                    tier = "slow" if nodes[holder] != nodes[owner] else "fast"
                    sends[holder][tier] += 4 * (part.stop - part.start)
                    sends[owner][tier] += 4 * (part.stop - part.start)
    return sends


def muon_traffic(muon, plan: Plan) -> tuple[int, int]:
    """(bytes, of which over the slow tier) that DistMuon's pieces move per step, all ranks together."""
    sends = muon_sends(muon, plan).values()
    return sum(c["fast"] + c["slow"] for c in sends), sum(c["slow"] for c in sends)


def _shard_groups(plan: Plan, bucket: Bucket) -> list[tuple[int, ...]]:
    """Every shard group of ``bucket`` (global ranks by shard position), in a fixed order."""
    groups, seen = [], set()
    for r in range(plan.mesh.size):  # one group_ranks call per group, not per rank: 768 ranks in ms
        if r not in seen:
            groups.append(tuple(plan.shard_ranks(bucket, r)))
            seen.update(groups[-1])
    return groups


def _node(mesh, rank: int) -> tuple[int, ...]:
    """``rank``'s coordinates on the slow axes: ranks with the same ones talk over the fast tier."""
    return tuple(c for a, c in zip(mesh.axis_names, mesh.coords(rank)) if a in mesh.slow_axes)


def _near_ranks(pieces: list[tuple[int, slice]], members: tuple[int, ...], nodes: dict[int, tuple]) -> list[int]:
    """The ranks of a matrix's ``members`` that may own it (``pieces``: (holder, its part)): those on
    the fast-tier groups (nodes: rank -> its node) that hold most of its elements (one node, or several that
    tie). Only the other nodes' pieces cross the slow tier, the least any owner allows. When its
    holders span nodes, a rank there that holds no piece may own it too (its node's pieces reach
    it over the fast tier), which keeps the balance; on one node owners stay among holders."""
    held: Counter = Counter()
    for r, part in pieces:
        held[nodes[r]] += part.stop - part.start
    most = max(held.values())
    return sorted(r for r in (members if len(held) > 1 else [r for r, _ in pieces]) if held.get(nodes[r], -1) == most)


def _split_axes(plan: Plan, slot: ParamSlot) -> tuple[str, ...]:
    """The non-FSDP axes that split ``slot``'s matrix dims (its last two: tensor parallelism)."""
    ndim = len(slot.global_shape)
    axes = {a for dim in range(max(0, ndim - 2), ndim) for a in plan.split_dim_axes(slot, dim)}
    return tuple(a for a in plan.mesh.axis_names if a in axes)


def _ns_shape(plan: Plan, slot: ParamSlot) -> tuple[int, ...]:
    """The matrices Newton-Schulz sees: the whole matrix where tp splits it, else a rank's block."""
    return tuple(slot.global_shape) if _split_axes(plan, slot) else tuple(slot.local_shape)


def _matrices(plan: Plan, b: Bucket):
    """Each matrix (batch) of bucket ``b`` once: (slot, its ranks, its pieces [(holder, part)]). A
    matrix split along its matrix dims over non-FSDP axes spans their group: its ranks are the
    shard groups of each place along them, and a part is a slice of its blocks laid end to end
    (``_stacked``), each a rank's stored block."""
    for ranks in _shard_groups(plan, b):
        for slot in b.slots:
            axes = _split_axes(plan, slot)
            if not axes:
                yield slot, ranks, [(ranks[i], b.local_piece(slot, i).param) for i in b.holders(slot)]
            elif plan.mesh.group_index(axes, ranks[0]) == 0:  # (the group's first shard group stands for it)
                yield (slot, *_stacked(plan, b, slot, ranks, axes))


def _stacked(plan: Plan, b: Bucket, slot: ParamSlot, ranks: tuple[int, ...], axes) -> tuple[tuple, list]:
    """(the ranks, the pieces) of a tp-split matrix whose first shard group is ``ranks``: place t's
    shard group holds elements [t n, (t + 1) n) of its blocks laid end to end (n: a stored block)."""
    along = [plan.mesh.group_ranks(axes, r) for r in ranks]  # along[i][t]: shard position i at place t
    n, places = slot.numel, len(along[0])
    members = tuple(along[i][t] for t in range(places) for i in range(len(ranks)))
    pieces = [(along[i][t], slice(t * n + p.start, t * n + p.stop))
              for t in range(places) for i, p in ((i, b.local_piece(slot, i).param) for i in b.holders(slot))]
    return members, pieces


def assign_owners(plan: Plan, muon_paths: set[str], steps: int, variant: str = "standard"
                  ) -> tuple[dict[tuple[int, tuple[int, ...], str], int], Counter]:
    """Owner of every matrix split across ranks, and NS FLOPs per global rank.

    Keys are (bucket index, shard group ranks, path); one entry per shard group, so HSDP and
    non-FSDP replicas each orthogonalize their own copy. An owner is a rank of the node (the
    ranks that share the fast tier) holding most of the matrix (_near_ranks), so most pieces
    stay off the slow tier; on a one-tier mesh that is any rank of the shard group. Matrices
    wholly on one rank load it first; split ones then go, largest first, to their least-loaded
    candidate (ties: lowest rank). Plain LPT can strand work when owners are restricted (GPT
    "small" at 4 ranks, owners among holders: busiest rank 1.25x the mean), so a matrix then
    moves to a less-loaded candidate while that lowers the pair's maximum. A pure function of
    the plan: every rank computes the same answer with no communication.
    """
    load: Counter = Counter()
    split = []
    nodes = {r: _node(plan.mesh, r) for r in range(plan.mesh.size)}
    for b in plan.buckets:
        for slot, members, pieces in _matrices(plan, b):
            if slot.path not in muon_paths or slot.numel == 0:
                continue
            cost = ns_flops(_ns_shape(plan, slot), steps, variant)
            if len(pieces) == 1:
                load[pieces[0][0]] += cost
            else:
                split.append((cost, (b.index, members, slot.path), _near_ranks(pieces, members, nodes)))
    split.sort(key=lambda s: -s[0])  # stable: plan order among equals
    owners = {}
    for cost, key, holders in split:
        owners[key] = min(holders, key=lambda r: (load[r], r))
        load[owners[key]] += cost
    moved = True
    while moved:  # each move lowers the sum of squared loads, so this ends
        moved = False
        for cost, key, holders in split:
            src, dst = owners[key], min(holders, key=lambda r: (load[r], r))
            if load[dst] + cost < load[src]:
                load[src], load[dst], owners[key], moved = load[src] - cost, load[dst] + cost, dst, True
    return owners, load


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
    of ``slot`` (its shard group ``ranks``); a tp-split one spans the tp group (``_stacked``)."""
    shape, axes = _ns_shape(plan, slot), _split_axes(plan, slot)
    common = dict(bucket=b.index, shape=shape, scale=update_scale(shape[-2], shape[-1], scale), mine=piece.held,
                  in_matrix=piece.param)
    if not axes:
        return common, ranks, [(ranks[i], b.local_piece(slot, i).param) for i in b.holders(slot)]
    members, pieces = _stacked(plan, b, slot, tuple(plan.mesh.group_ranks(axes, r)[0] for r in ranks), axes)
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
        parts = muon.transform.transforms
        self.matrices = parts["muon"]
        self.stage = self.matrices.inner.stages[-1]
        on_muon = muon_paths(muon, plan)
        self.adamw_paths = frozenset(plan.slots) - on_muon
        for path in sorted(on_muon):
            _check_whole_matrices(plan, plan.slots[path])
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
        its param (``paths``: the fallback's weight_decay_mask), the matrices' order, QK-Clip's pieces."""
        meta = meta_params(self.plan)
        at = {p: i for i, p in enumerate(tree_flatten(meta)[0])}
        self.rest = adamw.for_params(meta).take([at[path] for path in paths])
        self._momentum_order = self.local + self.owned + self.held
        self._by_bucket: dict[int, list[int]] = defaultdict(list)  # bucket -> its matrices' places in _momentum_order
        for i, x in enumerate(self._momentum_order):
            self._by_bucket[x.bucket].append(i)
        self.qk = _qk_pieces(self.muon, self.plan, self.rank) if self.muon.qk_clip is not None else []

    # -- optax-style interface ----------------------------------------------------------------
    def init(self, shards: Sequence[torch.Tensor]) -> MuonState:
        self._check(shards, "shards")
        return MuonState(torch.zeros((), dtype=torch.int64),
                         [s.new_zeros(0) if b.frozen else torch.zeros_like(s) for b, s in zip(self.plan.buckets, shards)],
                         [s.new_zeros(n) for s, n in zip(shards, self.adamw_numel)])

    @property
    def capabilities(self) -> Capabilities:
        """Work begun in backward (``overlap``, off under a low-bit slow tier); the step's aux
        under QK-Clip; ``exp_avg_sq`` holds AdamW's second moment of the AdamW params only."""
        return Capabilities(early=self.muon.overlap and self.slow is None, aux=self.muon.aux_names(),
                            state_layout={"exp_avg_sq": self.adamw_paths})

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
        return fmt if fmt and _node(mesh, peer) != _node(mesh, self.rank) else None

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
        here = _node(self.plan.mesh, self.rank)
        self.slow_bytes_sent += sum(t.numel() * t.element_size() for peer, t, _ in sends
                                    if _node(self.plan.mesh, peer) != here)
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


def _meta(slot: ParamSlot) -> torch.Tensor:
    """A shape-only stand-in for the full param, for use_adamw(path, tensor)."""
    return torch.empty(slot.global_shape, dtype=slot.dtype, device="meta")




def _check_whole_matrices(plan: Plan, slot: ParamSlot) -> None:
    """Non-FSDP axes may split a param's leading batch dims (experts: each rank its own matrices) or
    its matrix dims (tp: the owner gathers the blocks), not both."""
    ndim = len(slot.global_shape)
    lead = [a for dim in range(ndim - 2) for a in plan.split_dim_axes(slot, dim)]
    if lead and _split_axes(plan, slot):
        raise ValueError(
            f"distributed Muon: parameter {slot.path!r} (shape {slot.global_shape}, spec {slot.spec!r}) "
            f"is split along a batch dim over {tuple(lead)} and along its matrix dims over "
            f"{_split_axes(plan, slot)}; Newton-Schulz gathers a tp-split matrix only when its batch dims are "
            f"whole. Split one of them, shard the other over FSDP axes, or route the param to AdamW with use_adamw")


class EarlyMuon:
    """One step's Muon work on the plan's flat shards, begun bucket by bucket as grads land.

    ``landed(buckets)``: the momentum of every Muon matrix in those buckets (into copies of the
    state unless ``in_place``), Newton-Schulz of those wholly on this rank, and the pieces of
    split ones posted to their owners; an owner orthogonalizes a split matrix once its pieces
    have arrived (polled, never waited for, so backward never blocks on a peer) and posts the
    results back. ``finish`` waits for the rest; ``apply`` writes params and state. Until
    ``apply`` nothing the caller owns changes, so a step that is skipped drops it (``finish``
    only). Tags are offset by ``epoch``: pieces of an attempt dropped after an error never pair
    with a later attempt's. Every rank lands the buckets in the plan's reduction order, so each
    posts the same pieces; p2p pairing is by peer and tag, so timing differences do not matter.
    """

    def __init__(self, dm: DistMuon, grads, state: MuonState, scale: float, epoch: int, in_place: bool):
        self.dm, self.grads, self.state, self.scale, self.in_place = dm, grads, state, scale, in_place
        self.tag0 = epoch * (2 * dm._n_tags + 2)
        self.bufs: dict[int, torch.Tensor] = {}  # matrix -> its new momentum piece
        self.dirs: dict[int, torch.Tensor] = {}  # matrix -> its direction (flat; a held piece for held ones)
        self.waiting: list[tuple[int, torch.Tensor, list, list]] = []  # owned: (matrix, whole, receives, arrivals)
        self.posted: list = []  # sends, and the held pieces' results
        self.arrivals: list = []  # the held pieces' low-bit results (dm._arrival)
        self.todo: list[tuple[int, torch.Tensor]] = []  # matrices wholly here, not yet orthogonalized
        self.finished = False

    def grads_final(self, buckets) -> None:
        """The grads of ``buckets`` are final (summed and reduced): start their matrices."""
        dm = self.dm
        idx = [i for b in buckets for i in dm._by_bucket.get(b, ())]
        order = dm._momentum_order
        xs = [order[i] for i in idx]
        if xs:
            gs = [self.grads[x.bucket][x.mine] for x in xs]
            if self.scale != 1.0:
                gs = list(torch._foreach_mul(gs, self.scale))  # (the step scales the grads alike, in place)
            bufs = [self.state.exp_avg[x.bucket][x.mine] for x in xs]
            if not self.in_place:
                bufs = [b.clone() for b in bufs]
            ups = dm.stage.momentum_(gs, bufs)
            self.bufs.update(zip(idx, bufs))
            dtype = dm.comm_dtype or ups[0].dtype
            self.todo += [(i, u) for i, x, u in zip(idx, xs, ups) if x.owner == -1]
            sends, recvs = [], []
            for i, x, u in zip(idx, xs, ups):
                if x.owner == dm.rank:
                    whole, arrivals = dm._assemble(x, u, dtype), []
                    self.waiting.append((i, whole, dm._exchange([], [
                        (r, dm._arrival(r, "grads", whole[part], arrivals), self.tag0 + 2 * x.tag)
                        for r, part in x.others]), arrivals))
                elif x.owner != -1:
                    self.dirs[i] = torch.empty(x.mine.stop - x.mine.start, dtype=dtype, device=u.device)
                    sends.append((x.owner, dm._wire(x.owner, "grads", u, dtype), self.tag0 + 2 * x.tag))
                    recvs.append((x.owner, dm._arrival(x.owner, "weights", self.dirs[i], self.arrivals),
                                  self.tag0 + 2 * x.tag + 1))
            self.posted += dm._exchange(sends, recvs)
        if not self.in_place:  # (in place, after the decision: one batched NS in finish, as many as can)
            self._owners(wait=False)

    def finish(self) -> None:
        """Wait for every piece: owners orthogonalize what is left, every rank's results land."""
        if not self.finished:
            self._owners(wait=True)
            self.dm._unpack(self.posted, self.arrivals)
            self.posted, self.arrivals, self.finished = [], [], True

    def apply(self, grads, params, aux: dict | None = None) -> bool:
        """Write the step (after the decision: ``grads`` already scaled by the step); False,
        with nothing changed, when some matrix never landed (the caller updates instead)."""
        dm, m, state = self.dm, self.dm.muon, self.state
        order = dm._momentum_order
        if len(self.bufs) != len(order):
            self.finish()
            return False
        m.check_rates(int(state.count) + 1)
        gamma = m.qk_gamma(aux)
        state.count.add_(1)
        step = int(state.count)
        run(dm.rest, [grads[b][s] for b, s, _ in dm.adamw], {"exp_avg": [state.exp_avg[b][s] for b, s, _ in dm.adamw],
            "exp_avg_sq": [state.exp_avg_sq[b][c] for b, _, c in dm.adamw]}, [params[b][s] for b, s, _ in dm.adamw],
            Hyper(step))  # (AdamW's part, while pieces travel)
        self.finish()
        if not self.in_place and order:
            torch._foreach_copy_([state.exp_avg[x.bucket][x.mine] for x in order], [self.bufs[i] for i in range(len(order))])
        part, h = dm.matrices.at(Hyper(step))  # (its lr this step, and its decay stage's weight decay)
        lr, wd = h.lr, part.stages[0].weight_decay
        n_here = len(dm.local) + len(dm.owned)
        dm._apply(params, order[:n_here], [self.dirs[i][x.in_matrix] for i, x in enumerate(order[:n_here])], lr, wd)
        dm._apply(params, order[n_here:], [self.dirs[i] for i in range(n_here, len(order))], lr, wd)
        if gamma is not None:  # each rank its own pieces: no communication
            qk_clip_([(params[b][mine], shape, first, heads) for b, mine, shape, first, heads in dm.qk], gamma)
        return True

    def _owners(self, wait: bool) -> None:
        """Orthogonalize the matrices wholly here and the owned ones whose pieces have all
        arrived (``wait``: all of them), in one batched call, and post each holder its piece."""
        dm = self.dm
        ready = [w for w in self.waiting if wait or all(r.is_completed() for r in w[2])]
        if not ready and not self.todo:
            return
        self.waiting = [w for w in self.waiting if not any(w is r for r in ready)]
        for _, _, reqs, arrivals in ready:
            dm._unpack(reqs, arrivals)
        order = dm._momentum_order
        mats = self.todo + [(i, order[i].whole(whole).to(self.bufs[i].dtype)) for i, whole, _, _ in ready]
        self.todo = []
        sends = []
        for (i, _), d in zip(mats, self._orthogonalize([(order[i], u) for i, u in mats])):
            x = order[i]
            self.dirs[i] = d = x.flat(d.view(x.shape))
            sends += [(r, dm._wire(r, "weights", d[part], dm.comm_dtype or self.bufs[i].dtype), self.tag0 + 2 * x.tag + 1)
                      for r, part in x.others]
        if sends:
            self.posted += dm._exchange(sends, [])

    def _orthogonalize(self, mats: list) -> list[torch.Tensor]:
        """Newton-Schulz of (matrix, values) pairs, same shapes batched; flat directions."""
        return [d.reshape(-1) for d in self.dm.stage.orthogonalize([u.view(x.shape) for x, u in mats])]
