"""Who orthogonalizes which Muon matrix, read from the plan alone: each split matrix's owner (on
the node holding most of it, balanced by Newton-Schulz FLOPs), and the bytes its pieces move.

Every rank computes the same answer with no communication, and so do hpf plan and the
simulator at any size (on meta tensors): distributed Muon (dist_muon.py) runs on it.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from typing import Sequence

import torch

from hpf_kernels import newton_schulz_flops

from ..planning import Bucket, ParamSlot, Plan

__all__ = ["assign_owners", "ns_flops", "muon_paths", "muon_plan_state", "muon_sends", "muon_traffic"]


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
    nodes = {r: node_of(plan.mesh, r) for r in range(plan.mesh.size)}
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


def node_of(mesh, rank: int) -> tuple[int, ...]:
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


def split_axes(plan: Plan, slot: ParamSlot) -> tuple[str, ...]:
    """The non-FSDP axes that split ``slot``'s matrix dims (its last two: tensor parallelism)."""
    ndim = len(slot.global_shape)
    axes = {a for dim in range(max(0, ndim - 2), ndim) for a in plan.split_dim_axes(slot, dim)}
    return tuple(a for a in plan.mesh.axis_names if a in axes)


def ns_shape(plan: Plan, slot: ParamSlot) -> tuple[int, ...]:
    """The matrices Newton-Schulz sees: the whole matrix where tp splits it, else a rank's block."""
    return tuple(slot.global_shape) if split_axes(plan, slot) else tuple(slot.local_shape)


def _matrices(plan: Plan, b: Bucket):
    """Each matrix (batch) of bucket ``b`` once: (slot, its ranks, its pieces [(holder, part)]). A
    matrix split along its matrix dims over non-FSDP axes spans their group: its ranks are the
    shard groups of each place along them, and a part is a slice of its blocks laid end to end
    (``stacked``), each a rank's stored block."""
    for ranks in _shard_groups(plan, b):
        for slot in b.slots:
            axes = split_axes(plan, slot)
            if not axes:
                yield slot, ranks, [(ranks[i], b.local_piece(slot, i).param) for i in b.holders(slot)]
            elif plan.mesh.group_index(axes, ranks[0]) == 0:  # (the group's first shard group stands for it)
                yield (slot, *stacked(plan, b, slot, ranks, axes))


def stacked(plan: Plan, b: Bucket, slot: ParamSlot, ranks: tuple[int, ...], axes) -> tuple[tuple, list]:
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
    nodes = {r: node_of(plan.mesh, r) for r in range(plan.mesh.size)}
    for b in plan.buckets:
        for slot, members, pieces in _matrices(plan, b):
            if slot.path not in muon_paths or slot.numel == 0:
                continue
            cost = ns_flops(ns_shape(plan, slot), steps, variant)
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


def _meta(slot: ParamSlot) -> torch.Tensor:
    """A shape-only stand-in for the full param, for use_adamw(path, tensor)."""
    return torch.empty(slot.global_shape, dtype=slot.dtype, device="meta")




def check_whole_matrices(plan: Plan, slot: ParamSlot) -> None:
    """Non-FSDP axes may split a param's leading batch dims (experts: each rank its own matrices) or
    its matrix dims (tp: the owner gathers the blocks), not both."""
    ndim = len(slot.global_shape)
    lead = [a for dim in range(ndim - 2) for a in plan.split_dim_axes(slot, dim)]
    if lead and split_axes(plan, slot):
        raise ValueError(
            f"distributed Muon: parameter {slot.path!r} (shape {slot.global_shape}, spec {slot.spec!r}) "
            f"is split along a batch dim over {tuple(lead)} and along its matrix dims over "
            f"{split_axes(plan, slot)}; Newton-Schulz gathers a tp-split matrix only when its batch dims are "
            f"whole. Split one of them, shard the other over FSDP axes, or route the param to AdamW with use_adamw")
