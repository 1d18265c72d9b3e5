"""The validating step: the production step (hpf.step) with every check of validation mode on."""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable

import torch

from .. import losses
from ..comm import world
from .. import tree as tree_util
from ..config import StepConfig
from ..engine.compiled import eager_stance
from ..step import ShardStep
from ..train_state import TrainState
from .errors import (BatchMismatchError, LossNotReplicatedError, NonFiniteLayoutError, ParamsTreeError,
                     QuantizationError, as_layout_errors)
from .grads import GradReport, check_grads
from .tracker import Tracker

__all__ = ["ValidateStep"]


class ValidateStep(ShardStep):
    """``hpf.shard_step(..., mode="validate")``: the production step with every check on.

    Per step, beyond production: the state must match the plan (ParamsTreeError); the local
    batch must have the same shapes and dtypes on every rank and the same content across
    non-FSDP ranks (BatchMismatchError); every op's layouts must agree (PartialSumError,
    ShardedContractionError, PrecisionError and more); the loss must be complete and
    replicated (PartialSumError, LossNotReplicatedError); no loss or grad may be non-finite
    (NonFiniteLayoutError); with a low-bit slow tier, each param's quantization error (weights
    against the unquantized gather, grads against what was sent) is reported in
    ``metrics["quantization"]`` and bounded by ``quantization_tolerance`` (QuantizationError).
    Losses and grads are bit-identical to production's: the same ops run on the same plain
    tensors. The optimizer always updates after backward (overlap off), since
    grads are checked before anything is updated.

    Args:
        loss_fn, mesh, optimizer, ...: as for :func:`hpf.shard_step`.

    Raises:
        ValueError, TypeError: as :class:`hpf.ShardStep`; then, per call, the
        :class:`~hpf.validate.errors.LayoutError` of the first failed check.
    """

    mode = "validate"

    def __init__(self, loss_fn: Callable, config: StepConfig):
        super().__init__(loss_fn, dataclasses.replace(config, overlap_optimizer=False))
        self.ops_checked = 0
        self._tracker: Tracker | None = None

    def init(self, params: Any, *, key=None) -> TrainState:
        with as_layout_errors("shard_step(mode='validate').init"):
            state = super().init(params, key=key)
        self._state_sig = [(tuple(s.shape), s.dtype) for s in state.params]
        self._spmd = dataclasses.replace(self._spmd, validate=True)  # models' own checks (MoE dispatch) on
        self.quantization: dict[str, dict[str, float]] = {}
        self.comm.capture_low_bit()  # a low-bit slow tier keeps what it sent and what arrived
        return state

    def __call__(self, state: TrainState, batch: Any):
        state, metrics = super().__call__(state, batch)
        if self.quantization:
            metrics["quantization"] = self.quantization
        return state, metrics

    def forward_backward(self, state: TrainState, batch: Any, hold: bool = False, scale: float = 1.0) -> losses.LossOut:
        """The production hook, with the micro-batch checked first."""
        self._check_batch(batch)
        return super().forward_backward(state, batch, hold, scale)

    def check_state(self, state: Any) -> None:
        """The production hook, naming the bucket and params that do not fit the plan."""
        self._check_state(state)

    def after_reductions(self) -> None:
        """The production hook: no grad may be non-finite (the message names the params), and no
        param may lose more than ``quantization_tolerance`` to a low-bit slow tier."""
        self._check_grads_finite()
        self._check_quantization()

    def call_loss(self, params: Any, batch: Any) -> Any:
        """The production hook, with params and batch tracked and the loss checked."""
        tracker = self._tracker = Tracker(self.mesh, self.plan.fsdp_axes, self.mp.compute_dtype if self.mp else None)
        params = tracker.track_params(params, self.plan)
        batch = tracker.track_batch(batch)
        with tracker, eager_stance():  # (compiled parts run eagerly, so every op is tracked)
            out = self.loss_fn(params, batch)
        loss = losses.parse(out).value
        tracker.check_loss(loss)
        self.ops_checked = tracker.ops
        self._check_loss_values(loss, tracker)
        return out

    def on_extra_gather(self, unit: str, phase: str) -> None:
        """Warn, naming the unit and the op, at each gather beyond loop-style use."""
        tracker = self._tracker
        op = f", at op {getattr(tracker, 'last_op', '(none yet)')}" if tracker is not None and phase == "forward" else ""
        warnings.warn(f"hpf: unit {unit!r} is gathered again in {phase}{op}: loss_fn read it after the residency "
                      "bound had evicted it (it reads units out of loop order). Correct, but it costs one more "
                      "all-gather per step; read each unit's params in one stretch, or raise resident_units",
                      stacklevel=2)

    def check_grads(self, state: TrainState, batch: Any, *, rtol: float = 1e-3, atol: float = 1e-6) -> "GradReport":
        """Sharded grads vs a single-process reference, without updating ``state``; see :func:`check_grads`."""
        return check_grads(self, state, batch, rtol=rtol, atol=atol)

    # -- checks -------------------------------------------------------------------------------------
    def _check_state(self, state: Any) -> None:
        shards = getattr(state, "params", None)
        sig = None if not isinstance(shards, (list, tuple)) else [
            (tuple(s.shape), s.dtype) if isinstance(s, torch.Tensor) else None for s in shards]
        if sig == self._state_sig:
            return
        where = "it is not a TrainState" if sig is None else next(
            (f"bucket {i} (params {[s.path for s in self.plan.buckets[i].slots][:3]}) is {got}, the plan "
             f"expects {want}" for i, (got, want) in enumerate(zip(sig, self._state_sig)) if got != want),
            f"it has {len(sig)} shards, the plan has {len(self._state_sig)} buckets")
        raise ParamsTreeError(f"step(state, batch): the state does not match this step's plan: {where}. "
                              "Pass the state returned by this step's init (or by its previous call)")

    def _check_batch(self, batch: Any) -> None:
        paths, leaves, _ = tree_util.flatten(batch)
        sig = [(p, tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else (p, type(x).__name__, None)
               for p, x in zip(paths, leaves)]
        sums = [_checksum(x) for x in leaves if isinstance(x, torch.Tensor)]
        if world.world_size() == 1:
            return
        everyone = world.all_gather_object((sig, sums))
        for r, (theirs, _) in enumerate(everyone):
            if theirs != sig:
                diff = next(((a, b) for a, b in zip(sig, theirs) if a != b),
                            (sig[len(theirs)] if len(sig) > len(theirs) else None,
                             theirs[len(sig)] if len(theirs) > len(sig) else None))
                raise BatchMismatchError(
                    f"step(state, batch): the local batch of rank {r} differs from rank {self.rank}'s: "
                    f"{_fmt_leaf(diff[1])} vs {_fmt_leaf(diff[0])} (leaf, shape, dtype). Every rank must pass a "
                    "local batch of the same shapes and dtypes (split the global batch evenly)")
        group = self.mesh.group_ranks(self.plan.compute_axes, self.rank) if self.plan.compute_axes else [self.rank]
        for r in group:
            if everyone[r][1] != sums:
                leaf = next(p for p, a, b in zip([p for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor)],
                                                  sums, everyone[r][1]) if a != b)
                raise BatchMismatchError(
                    f"step(state, batch): {_fmt_leaf((leaf, '', ''))} holds different values on ranks {self.rank} "
                    f"and {r}, "
                    f"which differ only along the non-FSDP axes {self.plan.compute_axes}; those ranks compute one "
                    "model replica together and must get the same local batch. Pick the batch by the "
                    f"data-parallel position (mesh.group_index({self.plan.fsdp_axes!r}, rank)), not the global rank")

    def _check_loss_values(self, loss: torch.Tensor, tracker: Tracker) -> None:
        """The same loss across non-FSDP ranks (LossNotReplicatedError) and a finite loss
        (NonFiniteLayoutError), decided together by all ranks."""
        value = loss.detach().float().reshape(1)
        values = torch.cat(world.all_gather_list(value)) if world.world_size() > 1 else value
        values = values.cpu()
        bad = [r for r, v in enumerate(values.tolist()) if not math.isfinite(v)]
        if bad:
            origin = tracker.first_nonfinite() if self.rank in bad else None
            origins = world.all_gather_object(origin)
            r = bad[0]
            raise NonFiniteLayoutError(
                f"the loss is non-finite on rank(s) {bad}; on rank {r} the first non-finite value in the "
                f"forward appeared at {origins[r if len(origins) > 1 else 0] or 'an op with no recorded output'}"
                ". Check that op's inputs (log/sqrt of non-positive values, division by zero, overflow in low "
                "precision)")
        for group in self.mesh.all_groups(self.plan.compute_axes) if self.plan.compute_axes else []:
            vals = values[group]
            if not torch.allclose(vals, vals[:1].expand_as(vals), rtol=1e-5, atol=0.0):
                raise LossNotReplicatedError(
                    f"the loss differs across ranks {group}, which differ only along the non-FSDP axes "
                    f"{self.plan.compute_axes}: {vals.tolist()}. Those ranks must compute the same loss: check "
                    "for random ops (dropout) with per-rank seeds, or a per-rank input that layouts cannot see")

    def _check_grads_finite(self) -> None:
        """NonFiniteLayoutError naming the parameters whose grads are non-finite, decided together by all ranks."""
        plan, flags, paths = self.plan, [], []
        for bucket, shard in zip(plan.buckets, self.grad_shards):
            position = plan.shard_index(bucket, self.rank)
            bad = ~torch.isfinite(shard)
            for slot in bucket.slots:
                piece = bucket.local_piece(slot, position)
                flags.append(bad[piece.held].any() if piece.numel else bad.new_zeros(()))
                paths.append(slot.path)
        if not flags:
            return
        flags = torch.stack(flags).float()
        world.all_reduce(flags, op="max")
        bad_paths = [p for p, f in zip(paths, flags.tolist()) if f]
        if bad_paths:
            raise NonFiniteLayoutError(
                f"the loss is finite but the grads of {bad_paths[:8]} are not (first in parameter order: "
                f"{bad_paths[0]!r}). The backward of an op on that parameter's path produced inf/nan, e.g. sqrt or "
                "pow at 0, or log near 0; clamp its input away from the singular point")


    def _check_quantization(self) -> None:
        """Per param path, the max abs error of the slow tier's weights (this rank's shard as
        every peer dequantized it, against the shard) and grads (each row as its peer received
        it, against what was sent), and that over the param's max abs value; the max over
        ranks, in one all-reduce. QuantizationError past the tolerance, before any update."""
        rows = []  # (kind, path): [max abs error, max abs value], the same entries on every rank
        for kind, b, runs in self.comm.low_bit_captures():  # runs: (offset, exact, as received) per contiguous run
            for slot in b.slots:
                stat = torch.zeros(2)
                for at, exact, got in runs:
                    held = slot.piece(at, at + exact.numel()).held
                    if held.stop > held.start:
                        stat = torch.maximum(stat, torch.stack([(exact[held] - got[held]).abs().amax(),
                                                                exact[held].abs().amax()]).cpu())
                rows.append(((kind, slot.path), stat))
        if not rows:
            return
        stats = torch.stack([r for _, r in rows])
        if world.world_size() > 1:
            world.all_reduce(stats, op="max")
        report: dict[str, dict[str, float]] = {}
        for ((kind, path), _), (err, top) in zip(rows, stats.tolist()):
            report.setdefault(path, {}).update({f"{kind}_max_abs": err, f"{kind}_rel": err / top if top else 0.0})
        self.quantization = report
        tol = self.config.quantization_tolerance
        worst = max(((v[f"{k}_rel"], k, p) for p, v in report.items() for k in ("weights", "grads") if f"{k}_rel" in v),
                    default=None)
        if tol is not None and worst is not None and worst[0] > tol:
            rel, kind, path = worst
            raise QuantizationError(
                f"the low-bit slow tier ({self.plan.slow_precision.describe()}) loses {rel:.3g} of {path!r}'s "
                f"{kind} (max abs error over max abs value), past quantization_tolerance={tol:g}; use a smaller "
                "slow_block, a wider format (int8 for int4, bf16 for fp8), or raise the tolerance")


def _checksum(x: torch.Tensor) -> str:
    """A position-weighted sum: equal batches give equal sums, swapped rows almost surely do not."""
    flat = x.detach().reshape(-1).double()
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64).remainder_(1009).add_(1)
    return float((flat * weights).sum()).hex()  # hex: NaN compares equal to NaN


def _fmt_leaf(leaf) -> str:
    if leaf is None:
        return "nothing"
    return f"{f'batch leaf {leaf[0]!r}' if leaf[0] else 'the batch'} {leaf[1]} {leaf[2] or ''}".strip()
