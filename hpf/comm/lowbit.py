"""The low-bit slow tier of `hpf.comm.tiered.TieredComm`: what its slow stages send when the
plan's ``slow_precision`` asks for low-bit bytes, and the grads' error-feedback residuals.

- A gather sends this rank's shard as a block-quantized payload (hpf_kernels.quantize; the
  scales ride inside, so no other collective is needed) and dequantizes every peer's into the
  gathered buffer. Master shards are never quantized.
- A reduce-scatter quantizes each row bound for a slow peer (plus its residual), exchanges them
  all-to-all, and sums what arrives in fp32, this rank's own row exact. An HSDP replica
  all-reduce gathers every replica's payload and each sums the same rows.
- Error feedback is LoCo's (arXiv 2407.04480) moving-average compensation: each sent value
  carries the residual, and the residual moves a fraction ``1 - FEEDBACK_BETA`` of the way to
  what this step's payload dropped. Plain error feedback (the residual *is* what was dropped)
  re-sends a coordinate's whole backlog in one step whenever it crosses a quantization step;
  Adam turns such bursts on coordinates with a small second moment into updates of several
  times the lr. The average keeps the compensation smooth and still unbiased over time:
  the residual grows by ``(1 - beta) * (grad - sent)`` a step, so a bounded residual means
  the values sent sum to the grads.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hpf_kernels import dequantize, quantize

from ..planning import Bucket, Plan, low_bit
from .cost import feedback_numel
from .transport import Transport

__all__ = ["FEEDBACK_BETA", "LowBitTier"]

FEEDBACK_BETA = 0.95  # LoCo's default: the residual keeps 95% of itself and takes 5% of the new loss


def sum_rows(rows: torch.Tensor, out: torch.Tensor) -> None:
    """out <- rows[0] + rows[1] + ..., in fp32 and in rank order (the same sum on every run)."""
    acc = rows[0].clone() if len(rows) == 1 else torch.add(rows[0], rows[1])
    for r in rows[2:]:
        acc.add_(r)
    out.copy_(acc)


class LowBitTier:
    """Bucket b's low-bit slow-tier collectives (run on TieredComm's worker threads), and the
    error-feedback residuals of the step in flight."""

    def __init__(self, plan: Plan, stages: list[tuple[tuple, tuple]], rank: int):
        mesh = plan.mesh
        self.plan, self.slow, self._rank = plan, plan.slow_precision, rank
        self.formats = [low_bit(mesh, b, self.slow) for b in plan.buckets]  # op -> slow-tier format or None
        # this rank's row in each bucket's slow group and its block in the fast one
        self._slow_index = [mesh.group_index(slow, rank) if slow else 0 for _, slow in stages]
        self._fast_index = [mesh.group_index(fast, rank) if fast else 0 for fast, _ in stages]
        self.feedback_numel = [feedback_numel(mesh, b, self.slow) for b in plan.buckets]
        self._feedback: list[torch.Tensor] | None = None  # this step's residuals (TrainState.error_feedback)
        self._feedback_scale = 1.0
        self._pending: dict[int, list] = {}  # bucket -> [(residual slice, what its payload dropped)]
        #: validation mode sets a dict: (kind, bucket) -> [(flat offset, exact, dequantized)] of this rank's data
        self.capture: dict | None = None

    def gather(self, b: int, block: torch.Tensor, shard: torch.Tensor, transport: Transport) -> None:
        """block <- every slow peer's shard, each sent as a payload and dequantized here."""
        fmt, k = self.formats[b]["all_gather"], self.slow.block
        rows = block.view(-1, shard.numel())
        payload = quantize(shard, fmt, k)
        recv = torch.empty(len(rows), payload.shape[1], dtype=torch.uint8, device=shard.device)
        transport.all_gather_into(recv.view(-1), payload.view(-1))
        dequantize(recv, fmt, k, rows)
        if self.capture is not None:  # this rank's shard as every peer now holds it
            self.capture["weights", b] = [(self._own_start(b), shard.float().clone(),
                                           rows[self._slow_index[b]].float().clone())]

    def reduce_scatter(self, b: int, shard: torch.Tensor, block: torch.Tensor, transport: Transport) -> None:
        """shard <- the fp32 sum of row i of every slow peer's block: each row bound for a peer
        is sent as a payload (with this rank's residual added); its own row stays exact."""
        fmt = self.formats[b]["reduce_scatter"]
        rows = block.view(-1, shard.numel())
        own = self._slow_index[b]
        sent, payload = self._send_rows(b, rows, 0, fmt, own, self._row_offsets(b, len(rows)))
        recv = torch.empty_like(payload)
        transport.all_to_all(recv, payload)
        vals = dequantize(recv, fmt, self.slow.block, torch.empty(sent.shape, dtype=torch.float32, device=sent.device))
        vals[own] = sent[own]
        sum_rows(vals, shard)

    def all_reduce(self, b: int, shard: torch.Tensor, group) -> None:
        """shard <- the fp32 sum of every replica's shard, each dequantized from its payload, its
        own too: every replica sums the same rows in the same order, so all stay equal."""
        fmt, m = self.formats[b]["all_reduce"], dist.get_world_size(group)
        _, payload = self._send_rows(b, shard.view(1, -1), self.feedback_numel[b] - shard.numel(), fmt, None,
                                     [self._own_start(b)])
        recv = torch.empty(m, payload.shape[1], dtype=torch.uint8, device=shard.device)
        dist.all_gather_into_tensor(recv.view(-1), payload.view(-1), group=group)
        sum_rows(dequantize(recv, fmt, self.slow.block,
                            torch.empty(m, shard.numel(), dtype=torch.float32, device=shard.device)), shard)

    def _row_offsets(self, b: int, n_rows: int) -> list[int]:
        """Where each row of bucket b's slow-stage block lies in the full buffer: one block of
        shards where they are numbered fast axes first, shard (n, this rank's l) of each node n
        where node-major (Plan.stage_blocks)."""
        bucket = self.plan.buckets[b]
        f = self._fast_index[b]
        if self.plan.stage_blocks(bucket) == 1:
            return [bucket.shard_range(f * n_rows + r)[0] for r in range(n_rows)]
        fast = bucket.shard_size // n_rows
        return [bucket.shard_range(r * fast + f)[0] for r in range(n_rows)]

    def _own_start(self, b: int) -> int:
        """Where this rank's shard of bucket b starts in the full buffer."""
        bucket = self.plan.buckets[b]
        return bucket.shard_range(self.plan.shard_index(bucket, self._rank))[0]

    def _send_rows(self, b: int, rows: torch.Tensor, at: int, fmt: str, own: int | None, offsets: list[int]):
        """(rows + this rank's residual of them, in fp32; their payloads). Row ``own`` never leaves
        the rank: it stays exact and keeps no residual. What the others' payloads drop (the residual
        at ``at`` in the bucket's, unscaled: fp16's loss scale changes between steps) is kept aside
        until ``commit_feedback``. Validation mode's capture gets the rows as sent and as the peers
        receive them."""
        k, s = self.slow.block, self._feedback_scale
        sent, resid = rows.float(), None
        away = [j for j in range(len(rows)) if j != own]
        if self._feedback is not None and self.feedback_numel[b]:
            resid = self._feedback[b][at:at + len(away) * rows.shape[1]].view(len(away), -1)
            sent = sent.clone()
            sent[away] += resid if s == 1.0 else resid * s
        payload = quantize(sent, fmt, k)
        if resid is not None or self.capture is not None:
            got = dequantize(payload, fmt, k, torch.empty_like(sent))
            if own is not None:
                got[own] = sent[own]
            if resid is not None:
                lost = (sent - got)[away]
                self._pending.setdefault(b, []).append((resid, lost if s == 1.0 else lost / s))
            if self.capture is not None:
                self.capture["grads", b] = [(o, sent[r].clone(), got[r]) for r, o in enumerate(offsets)]
        return sent, payload

    def captured(self) -> list[tuple[str, Bucket, list]]:
        """Validation mode's capture, one entry per bucket and kind that crosses the slow tier
        low-bit ("weights": its gathers, "grads": its reductions), the same entries in the same
        order on every rank: ``(kind, bucket, [(flat offset, exact, as received)])`` (an empty list
        where this rank kept nothing). ``[]`` when nothing is captured."""
        def low(kind: str, fmt: dict) -> bool:
            return bool(fmt["all_gather"] if kind == "weights" else fmt["reduce_scatter"] or fmt["all_reduce"])

        if self.capture is None:
            return []
        return [(kind, b, self.capture.get((kind, b.index), [])) for kind in ("weights", "grads")
                for b in self.plan.buckets if low(kind, self.formats[b.index])]

    def use_feedback(self, residuals: list[torch.Tensor] | None, scale: float = 1.0) -> None:
        """This step's error-feedback residuals (``TrainState.error_feedback``, None: off), and the
        loss scale its grads carry. New residuals are kept aside until ``commit_feedback``."""
        self._feedback, self._feedback_scale = residuals, scale
        self._pending = {}

    def commit_feedback(self) -> None:
        """The step updates: each residual moves toward what its payloads dropped (a skipped step
        keeps the old ones)."""
        for parts in self._pending.values():
            for resid, lost in parts:
                resid.lerp_(lost, 1.0 - FEEDBACK_BETA)
        self._pending = {}
