"""What a loss function may return, and fp16's loss scaling.

A loss function returns one of:

- **a scalar tensor, read as a mean.** The step's loss is the mean of these over its
  micro-batches and data-parallel ranks, ``(1 / (R * K)) * sum_r sum_k loss_fn(params,
  micro_batch[r][k])``, and the grads are that mean's. It is the whole global batch's mean only
  when every micro-batch averages over the same number of terms (not, e.g., for a padded
  language-model loss whose micro-batches hold different numbers of real targets).
- **``hpf.weighted(sum, count)``** (or a ``(sum, count)`` pair of tensors): a sum of per-term
  losses and the number of terms. The step divides the total sum by the total count over every
  micro-batch and rank: exactly the whole global batch's mean, whatever the masks, as fixed
  gradient accumulation for causal language models does.
- either one with a dict of aux tensors, ``(loss, {"name": tensor})``: ``metrics["aux"]`` holds
  each summed over micro-batches and ranks, or, for a name that starts with ``max_`` (e.g. the
  models' ``max_attn_logit``), its elementwise maximum over them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from .errors import NonFiniteError

__all__ = ["NonFiniteError", "Weighted", "weighted", "token_cross_entropy", "LossOut", "parse", "LossScale", "LossScaleState",
           "terms_divisor"]

IGNORE = -100  # a target that is padding (torch's ignore_index)
MAX_AUX = "max_"  # an aux whose name starts so is reduced by maximum, not sum


class Weighted(NamedTuple):
    """A sum of per-term losses and how many terms it sums (see :func:`weighted`)."""

    sum: torch.Tensor
    count: torch.Tensor | int | float


def weighted(sum: torch.Tensor, count: torch.Tensor | int | float) -> Weighted:  # noqa: A002 - the natural name
    """A loss to be divided by the global ``count`` (over micro-batches and ranks), e.g.
    ``hpf.weighted(F.cross_entropy(logits, y, ignore_index=-100, reduction="sum"), (y != -100).sum())``.

    Args:
        sum: a scalar tensor, the sum of this micro-batch's per-term losses.
        count: the number of terms in it (a tensor, int or float; 0 is allowed on some ranks).

    Raises:
        TypeError: ``sum`` is not a one-element floating tensor.
    """
    _check_value(sum, "hpf.weighted(sum, count): sum")
    return Weighted(sum, count)


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, weighted: bool = False):
    """Next-token cross-entropy of ``logits`` [N, V] against ``targets`` [N], padding (-100)
    ignored, in fp32: the mean over real targets, or (``weighted``) ``hpf.weighted(sum, count)``,
    which the step divides by the global count of real targets. The models' losses use it."""
    logits, targets = logits.float().flatten(0, -2), targets.flatten()
    if not weighted:
        return F.cross_entropy(logits, targets, ignore_index=IGNORE)
    return Weighted(F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum"), (targets != IGNORE).sum())


@dataclass
class LossOut:
    """One micro-batch's loss, parsed: ``value`` to differentiate, ``count`` (None: a mean), aux."""

    value: torch.Tensor
    count: torch.Tensor | None
    aux: dict[str, torch.Tensor] | None


def parse(out: Any) -> LossOut:
    """``loss_fn``'s return value as a :class:`LossOut` (the forms in the module doc).

    Raises:
        TypeError: any other form, or a loss that is not a one-element floating tensor.
        ValueError: a loss that does not depend on the params.
    """
    aux = None
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        out, aux = out
    count = None
    if isinstance(out, Weighted) or (isinstance(out, tuple) and len(out) == 2):
        out, count = out
        if not isinstance(count, (torch.Tensor, int, float)) or isinstance(count, bool) or (
                isinstance(count, torch.Tensor) and count.numel() != 1):
            raise TypeError(f"loss_fn returned a pair whose second item is {type(count).__name__}; a pair means "
                            "(sum, count), with count a number or one-element tensor, and (loss, aux) needs a dict "
                            "of aux tensors")
        count = torch.as_tensor(count, dtype=torch.float64).detach().reshape(())
    _check_value(out, "loss_fn's loss" if count is None else "the sum of hpf.weighted(sum, count)")
    if not out.requires_grad:
        raise ValueError("the loss does not depend on the params (it has no grad_fn): make loss_fn compute with "
                         "the params it receives")
    aux = None if aux is None else {k: v.detach() for k, v in aux.items()}
    return LossOut(out.reshape(()), count, aux)


def _check_value(x: Any, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.numel() != 1:
        got = f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{what} must be a scalar tensor (one element); got {got}. Return a mean (e.g. .mean()), "
                        "hpf.weighted(sum, count), or either with a dict of aux tensors")
    if not x.is_floating_point():
        raise TypeError(f"{what} is a {x.dtype} tensor, which has no gradient: return a real floating-point tensor "
                        "(an integer cast such as .long() or a comparison cuts the loss off from the params)")


# -- fp16 loss scaling ---------------------------------------------------------------------------------------------

class LossScaleState(NamedTuple):
    """The running loss scale (float64) and the steps in a row since it last changed (int64):
    clean ones counted up, overflowed (skipped) ones counted down from 0."""

    scale: torch.Tensor
    good_steps: torch.Tensor


@dataclass(frozen=True)
class LossScale:
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s semantics, for fp16 compute.

    Backward runs on ``loss * scale``; the grads are divided back before anything reads them.
    For ``hpf.weighted(sum, count)`` the scale is per term: the seed is divided by the terms of
    a micro-batch (:func:`terms_divisor`), so a sum of thousands of token losses starts no nearer
    to overflow than a mean does. A step whose grads overflow is skipped (no update, ``metrics["skipped"]``) and the scale
    shrinks by ``backoff_factor``; after ``growth_interval`` clean steps in a row it grows by
    ``growth_factor``. The scale never backs off below ``min_scale`` (GradScaler's reaches 0 after
    about 1,090 overflows in a row, and then the step divides by it); ``max_skipped`` overflowed
    steps in a row (by default 50: from 2^16 the floor is 16 halvings away) mean the run diverged,
    and the step raises NonFiniteError saying what to change. The state rides in
    ``TrainState.loss_scale`` (and in checkpoints).

    Args:
        init_scale, growth_factor, backoff_factor, growth_interval: as GradScaler's.
        min_scale: the floor of the scale (DeepSpeed's ``min_loss_scale`` is also 1).
        max_skipped: overflowed steps in a row before NonFiniteError.

    Raises:
        ValueError: a scale or factor that is not finite and > 0, a growth factor <= 1, a
            backoff factor outside (0, 1), an interval < 1, a floor above the initial scale, or
            ``max_skipped`` < 1.
    """

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    max_skipped: int = 50

    def __post_init__(self):
        ok = (0 < self.min_scale <= self.init_scale < float("inf") and self.growth_factor > 1
              and 0 < self.backoff_factor < 1 and all(isinstance(n, int) and n >= 1 for n in
                                                      (self.growth_interval, self.max_skipped)))
        if not ok:
            raise ValueError(f"{self}: need 0 < min_scale <= init_scale < inf, growth_factor > 1, 0 < backoff_factor "
                             "< 1 and ints growth_interval, max_skipped >= 1")

    def init(self) -> LossScaleState:
        return LossScaleState(torch.tensor(float(self.init_scale), dtype=torch.float64),
                              torch.zeros((), dtype=torch.int64))

    def update(self, state: LossScaleState, finite: bool) -> None:
        """After a step: back off on overflow (to the floor at most), grow after enough clean
        steps (in place). Raises NonFiniteError at the ``max_skipped``-th overflow in a row."""
        if not finite:
            state.scale.mul_(self.backoff_factor).clamp_(min=self.min_scale)
            state.good_steps.clamp_(max=0).sub_(1)
            if -int(state.good_steps) >= self.max_skipped:
                raise NonFiniteError(
                    f"fp16: {self.max_skipped} steps in a row had non-finite grads and were skipped (loss scale "
                    f"{float(state.scale):g}, its floor {self.min_scale:g}): the run diverged. Lower the lr, or train "
                    "in bf16 (--mixed-precision bf16); hpf.LossScale(max_skipped=...) sets how many skips in a row "
                    "stop a run")
            return
        state.good_steps.clamp_(min=0).add_(1)
        if int(state.good_steps) >= self.growth_interval:
            state.scale.mul_(self.growth_factor)
            state.good_steps.zero_()


def terms_divisor(terms: float) -> float:
    """The power of two nearest a weighted loss's terms per micro-batch: what fp16's seed is
    divided by. A power of two scales exactly, so the grads do not depend on which one."""
    return 2.0 ** round(math.log2(max(terms, 1.0)))
