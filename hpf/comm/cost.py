"""The byte model of hpf's collectives: the bytes one rank sends, per op and per tier.

The comms' byte counters, the plan report (hpf/report.py) and any simulator read this one
model. Tiers: "fast" (peers that differ only in the mesh's fast axes: a host, a supernode)
and "slow" (the links between them). A peer is across the slow tier when it differs from
the rank in a slow mesh axis.

Model: a collective over a group of n ranks in which each rank contributes c bytes makes
every rank send c bytes to each of its n - 1 peers (a direct exchange; a ring sends the same
total). Hierarchical collectives exchange along the slow axes only the 1/n_fast part of the
data that the fast tier has already gathered or reduced. An all-reduce is a reduce-scatter
plus an all-gather: twice the bytes.

A low-bit slow tier (``hpf.precision.SlowPrecision``, the plan's ``slow_precision``) sends the slow
stage's data as payloads (hpf_kernels.formats: codes and block scales): ``hpf.planning.low_bit`` says which
collectives of a bucket do, ``codec_bytes`` what their quantize and dequantize passes move
through memory. An HSDP replica all-reduce across the slow tier, low-bit, is an all-gather of
the payloads (each replica then sums the same rows: the replicas stay bitwise equal).
"""
from __future__ import annotations

from typing import Protocol

import torch

from hpf_kernels.formats import payload_bytes

from ..mesh import Mesh
from ..planning import OPS, low_bit  # (a layout fact: which of a bucket's collectives cross the slow tier low-bit)
from ..precision import SlowPrecision

__all__ = ["TIERS", "BucketLayout", "bucket_comm_bytes", "codec_bytes", "collective_bytes", "count_bytes",
           "dtype_bytes", "feedback_numel", "ring_bytes"]

TIERS = ("fast", "slow")


class BucketLayout(Protocol):
    """What the model reads of a bucket (``hpf.planning.Bucket`` has it)."""

    shard_axes: tuple[str, ...]  # the FSDP axes it is split over
    replicate_axes: tuple[str, ...]  # the FSDP axes it is replicated over
    frozen: bool  # not trained: nothing to reduce

    @property
    def shard_numel(self) -> int: ...  # elements of one rank's shard


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def ring_bytes(full_bytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-gather or reduce-scatter of a ``full_bytes`` buffer
    (the transports' counters; ``collective_bytes`` splits the same total by tier)."""
    return full_bytes * (world_size - 1) // world_size


def collective_bytes(mesh: Mesh, axes: tuple[str, ...], contribution: int,
                     hierarchical: bool = False) -> dict[str, int]:
    """Bytes one rank sends per tier for an all-gather or reduce-scatter over ``axes``.

    ``contribution`` is one rank's shard, in bytes. Returns {"fast": b, "slow": b}.
    """
    n = mesh.axis_size(axes)
    n_fast = mesh.axis_size(tuple(a for a in axes if a in mesh.fast_axes))
    n_slow = n // n_fast
    if hierarchical and n_fast > 1 and n_slow > 1:
        return {"fast": contribution * n_slow * (n_fast - 1), "slow": contribution * (n_slow - 1)}
    return {"fast": contribution * (n_fast - 1), "slow": contribution * (n - n_fast)}


def bucket_comm_bytes(mesh: Mesh, bucket: BucketLayout, compute_dtype: torch.dtype, reduce_dtype: torch.dtype,
                      hierarchical: bool = False, slow: SlowPrecision | None = None) -> dict[str, dict[str, int]]:
    """Bytes one rank sends per op and tier for one call of each of ``bucket``'s collectives:
    {op: {tier: bytes}} for the ops in OPS. Params travel in ``compute_dtype``, grads in
    ``reduce_dtype``, the slow stage in ``slow``'s formats (``low_bit``); ``hierarchical``:
    two-stage (fast tier first) collectives."""
    out = {op: dict.fromkeys(TIERS, 0) for op in OPS}
    fmt = low_bit(mesh, bucket, slow)
    n = bucket.shard_numel
    if bucket.shard_axes:
        for op, dtype in (("all_gather", compute_dtype), ("reduce_scatter", reduce_dtype)):
            if op == "all_gather" or not bucket.frozen:
                out[op] = collective_bytes(mesh, bucket.shard_axes, n * dtype_bytes(dtype), hierarchical)
                if fmt[op]:
                    out[op]["slow"] = collective_bytes(mesh, bucket.shard_axes, payload_bytes(n, fmt[op], slow.block),
                                                       hierarchical)["slow"]
    m = mesh.axis_size(bucket.replicate_axes)
    if fmt["all_reduce"]:  # an all-gather of every replica's payload
        out["all_reduce"] = {"fast": 0, "slow": (m - 1) * payload_bytes(n, fmt["all_reduce"], slow.block)}
    elif m > 1 and not bucket.frozen:
        part = -(-n // m) * dtype_bytes(reduce_dtype)
        out["all_reduce"] = {t: 2 * k for t, k in
                             collective_bytes(mesh, bucket.replicate_axes, part, hierarchical).items()}
    return out


def codec_bytes(mesh: Mesh, bucket: BucketLayout, compute_dtype: torch.dtype, reduce_dtype: torch.dtype,
                slow: SlowPrecision | None) -> dict[str, int]:
    """Memory bytes the low-bit collectives of ``bucket`` read and write per call, by op (an
    estimate of the quantize cost: every pass streams its input and output once). A gather
    quantizes this rank's shard and dequantizes every peer's; a reduction quantizes each row it
    sends (error feedback adds a pass to measure the error), dequantizes every row it receives
    and sums them in fp32."""
    fmt, out = low_bit(mesh, bucket, slow), dict.fromkeys(OPS, 0)
    n, c, r = bucket.shard_numel, dtype_bytes(compute_dtype), dtype_bytes(reduce_dtype)

    def codec(f, values):  # one quantize or dequantize of one row of n values
        return n * values + payload_bytes(n, f, slow.block)
    if fmt["all_gather"]:
        rows = mesh.axis_size(mesh.slow_axes_of(bucket.shard_axes))
        out["all_gather"] = codec(fmt["all_gather"], c) * (1 + rows)
    for op, axes in (("reduce_scatter", bucket.shard_axes), ("all_reduce", bucket.replicate_axes)):
        if fmt[op]:
            rows = mesh.axis_size(mesh.slow_axes_of(axes))
            sent = rows if op == "reduce_scatter" else 1
            feedback = sent * (codec(fmt[op], r) + 3 * n * r) if slow.error_feedback else 0
            out[op] = sent * codec(fmt[op], r) + rows * (codec(fmt[op], r) + n * r) + feedback
    return out


def feedback_numel(mesh: Mesh, bucket: BucketLayout, slow: SlowPrecision | None) -> int:
    """Values of this rank's error-feedback residual for ``bucket``: each value it sends low-bit
    across the slow tier in a grad reduction (the reduce-scatter's rows bound for its slow peers,
    its own row staying exact; then the HSDP shard)."""
    if slow is None or not slow.error_feedback:
        return 0
    fmt, n = low_bit(mesh, bucket, slow), bucket.shard_numel
    peers = mesh.axis_size(mesh.slow_axes_of(bucket.shard_axes)) - 1
    return (peers * n if fmt["reduce_scatter"] else 0) + (n if fmt["all_reduce"] else 0)


def count_bytes(counter, op: str, tiers: dict[str, int]) -> None:
    """Add one collective's bytes per tier to ``counter[op, tier]`` (the comms' byte counters)."""
    for tier, n in tiers.items():
        counter[op, tier] += n
