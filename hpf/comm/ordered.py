"""The invariant mode's grad reduction: all-to-alls of tree nodes, summed in the canonical order.

A rank's grad sums are nodes of the canonical tree over the atoms (hpf.comm.canonical). Each
stage is one all-to-all: a rank sends every peer the pieces of its nodes that the peer needs,
and sums what arrives in the tree. On one tier (one stage) the peers are every FSDP rank of the
bucket and each gets the piece of the shard it stores, replicas alike (HSDP, an unsharded
param); the result is the root. With a fast and a slow tier (``two_tier``, when a machine's ranks
hold one block of atoms), the fast stage sums a machine's ranks into the nodes of the machine's
block, each rank keeping the pieces of the shards its slow-tier peers store, and the slow stage
sums the machines' nodes into the root: the slow tier carries a 1/fast-size share of the bytes,
as the default two-tier reduction does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .canonical import Node, aligned_blocks, tree_sum
from .handles import DONE, Handle, exchange_async, is_done, on_device, wait_for
from .world import rank as this_rank

__all__ = ["Stage", "route", "reduce_in_tree", "OrderedReduction"]


@dataclass(frozen=True)
class Stage:
    """One all-to-all over ``group`` (None: this rank alone; ``me``: its position there): group
    rank j gets pieces ``wants[j]`` of each node (viewed as ``pieces`` equal pieces), holds atom
    block ``blocks[j]`` (in units of ``span`` ranks' atoms), and is reached over ``tiers[j]``."""

    group: object
    me: int
    pieces: int
    wants: tuple[tuple[int, ...], ...]
    blocks: tuple[int, ...]
    span: int
    tiers: tuple[str, ...]


def route(plan, b: int, rank: int, owned, two_tier: bool) -> list[Stage]:
    """Bucket ``b``'s stages on ``rank`` (``owned``: makes the comm's own process groups)."""
    bucket, mesh = plan.buckets[b], plan.mesh
    axes = tuple(a for a in mesh.axis_names if a in bucket.shard_axes + bucket.replicate_axes)
    fast = tuple(a for a in axes if a in mesh.fast_axes and mesh.axis_size(a) > 1)
    slow = tuple(a for a in axes if a not in fast and mesh.axis_size(a) > 1)
    me = mesh.coords(rank)

    def tier(r):
        return "slow" if any(mesh.coords(r)[mesh.axis_names.index(a)] != me[mesh.axis_names.index(a)]
                             for a in mesh.slow_axes) else "fast"

    def stage(group_axes, name, pieces, wants, span):
        ranks = mesh.group_ranks(group_axes, rank) if group_axes else [rank]
        return Stage(owned(group_axes, f"ordered/{b}/{name}") if len(ranks) > 1 else None, ranks.index(rank), pieces,
                     tuple(wants(r) for r in ranks), tuple(mesh.group_index(axes, r) // span for r in ranks), span,
                     tuple(tier(r) for r in ranks))
    shard = lambda r: plan.shard_index(bucket, r)  # noqa: E731
    if not (two_tier and fast and slow and axes[len(axes) - len(fast):] == fast):
        return [stage(axes, "all", bucket.shard_size, lambda r: (shard(r),), 1)]
    peers = lambda r: mesh.group_ranks(slow, r)  # noqa: E731  (a rank's slow-tier peers, itself among them)
    return [stage(fast, "fast", bucket.shard_size, lambda r: tuple(shard(p) for p in peers(r)), 1),
            stage(slow, "slow", len(peers(rank)), lambda r: (peers(r).index(r),), mesh.axis_size(fast))]


def reduce_in_tree(stages: list[Stage], out: torch.Tensor, nodes: list[tuple[Node, torch.Tensor]], per_rank: int,
                   n_atoms: int, count) -> Handle:
    """``out`` <- this rank's piece of the canonical sum of every rank's ``nodes`` (its sums of
    ``per_rank`` atoms each), through ``stages`` (``route``'s). ``count(tier, elements)`` counts
    what is sent."""
    def root(parts):
        out.copy_(tree_sum(parts, n_atoms))
    if len(stages) == 1:
        return _stage(stages[0], nodes, per_rank, root, count)
    fast, slow = stages
    box = {}

    def machine(parts):  # the machine's block of atoms as nodes of the tree
        size = slow.span * per_rank
        box["nodes"] = [(node, _subtree(parts, node)) for node in aligned_blocks(slow.blocks[slow.me] * size, size)]
    first = _stage(fast, nodes, per_rank, machine, count)
    return _Then(first, lambda: _stage(slow, box.pop("nodes"), per_rank, root, count))


def _stage(stage: Stage, nodes, per_rank: int, finish, count) -> Handle:
    """Send each peer its pieces of ``nodes``; on arrival, ``finish(parts)`` with every peer's nodes."""
    if stage.group is None:
        finish(dict(nodes))
        return DONE
    size = stage.span * per_rank
    blocks = [aligned_blocks(first * size, size) for first in stage.blocks]
    unit = nodes[0][1].numel() // stage.pieces
    if len(nodes) == 1 and stage.wants == tuple((j,) for j in range(stage.pieces)):
        sends = list(nodes[0][1].view(stage.pieces, unit))  # (a reduce-scatter's layout: no copy)
        send = nodes[0][1].view(-1)
    else:
        sends = [torch.cat([t.view(-1, unit)[list(want)].reshape(-1) for _, t in nodes]) for want in stage.wants]
        send = torch.cat(sends)
    for j, s in enumerate(sends):
        if j != stage.me:
            count(stage.tiers[j], s.numel())
    mine = len(stage.wants[stage.me]) * unit

    def arrived(recv):
        at, parts = 0, {}
        for node in (n for nodes_of in blocks for n in nodes_of):
            parts[node] = recv[at:at + mine]
            at += mine
        finish(parts)
    return exchange_async(send, [s.numel() for s in sends], [len(b) * mine for b in blocks], stage.group, arrived)


def _subtree(parts: dict, node: Node) -> torch.Tensor:
    """The canonical sum of ``node``'s atoms, from nodes that tile them."""
    start, size = node
    return tree_sum({(s - start, n): t for (s, n), t in parts.items() if start <= s < start + size}, size)


class OrderedReduction:
    """A comm's ``reduce_ordered(b, shard, nodes, per_rank)``: ``shard`` <- this rank's piece of
    the canonical sum of every rank's ``nodes`` (its sums of ``per_rank`` atoms; the rank at index
    i over the bucket's FSDP axes, in mesh order, holds atoms ``[i * per_rank, (i + 1) * per_rank)``),
    replicas alike. Its stages per bucket are made on first use, on the comm's own groups."""

    def __init__(self, plan, owned, two_tier: bool, bytes_sent, device):
        self.plan, self.owned, self.two_tier, self.bytes, self.device = plan, owned, two_tier, bytes_sent, device
        self.routes: dict[int, list[Stage]] = {}

    def __call__(self, b: int, shard: torch.Tensor, nodes: list[tuple[Node, torch.Tensor]], per_rank: int) -> Handle:
        if b not in self.routes:
            self.routes[b] = route(self.plan, b, this_rank(), self.owned, self.two_tier)
        bucket = self.plan.buckets[b]
        n_atoms = per_rank * self.plan.mesh.axis_size(bucket.shard_axes + bucket.replicate_axes)

        def count(tier, elements):
            self.bytes["reduce_scatter", tier] += elements * shard.element_size()
        return on_device(reduce_in_tree(self.routes[b], shard, nodes, per_rank, n_atoms, count), self.device)


class _Then:
    """A handle that starts ``then()`` once ``first`` has landed, and is done when that is."""

    def __init__(self, first: Handle, then):
        self.first, self.then, self.second = first, then, None

    def _start(self) -> None:
        if self.second is None:
            wait_for(self.first)
            self.second = self.then()

    def wait(self, timeout: float | None = None) -> bool:
        if self.second is None and not wait_for(self.first, timeout):
            return False
        self._start()
        return wait_for(self.second, timeout)

    def done(self) -> bool:
        if self.second is None and not is_done(self.first):
            return False
        self._start()
        return is_done(self.second)
