"""The errors validation mode raises: one class per check, defined here and nowhere else.

The fail-fast checks, in the order the docs and tests name them (:data:`CHECKS`):

* :class:`PartialSumError`         a pending partial sum used as a complete value (a missing ``hpf.psum``);
* :class:`ShardedContractionError` a contraction or reduction over a sharded dim that no reduction completes;
* :class:`LossNotReplicatedError`  a loss that differs across the ranks of a non-FSDP axis;
* :class:`BatchMismatchError`      local batches that differ where they must agree;
* :class:`ParamsTreeError`         a params tree, spec tree or train state of another structure;
* :class:`PrecisionError`          an op that silently leaves the mixed-precision compute dtype;
* :class:`NonFiniteLayoutError`    a non-finite loss or grad, named where it first appeared;
* :class:`IndivisibleLayoutError`  a non-FSDP axis that does not divide the dim it splits;
* :class:`QuantizationError`       a low-bit slow tier's error on a param past ``quantization_tolerance``;
* :class:`TokenLostError`, :class:`ExpertPlacementError`, :class:`GateSumError`: MoE dispatch
  (:class:`DispatchError`): a token copy lost, an expert's tokens on the wrong rank, gates
  that do not sum to 1.

Besides these, :class:`ShardingMismatchError`, :class:`CollectiveError` and
:class:`GradientMismatchError` (from ``check_grads``) are :class:`LayoutError`\\ s too.

Each name is one class: the two checks that production mode also makes are subclasses of its
errors under their own names (``except hpf.NonFiniteError`` catches ``NonFiniteLayoutError``,
``except hpf.spec.IndivisibleSpecError`` catches ``IndivisibleLayoutError``), and
``NonFiniteError`` / ``IndivisibleSpecError`` here are those base classes, re-exported.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from .. import errors, spec

__all__ = [
    "LayoutError", "PartialSumError", "ShardingMismatchError", "ShardedContractionError",
    "LossNotReplicatedError", "BatchMismatchError", "ParamsTreeError", "PrecisionError",
    "NonFiniteLayoutError", "IndivisibleLayoutError", "NonFiniteError", "IndivisibleSpecError", "QuantizationError", "CollectiveError", "GradientMismatchError", "CHECKS",
    "DispatchError", "TokenLostError", "ExpertPlacementError", "GateSumError", "as_layout_errors",
]


class LayoutError(ValueError):
    """Validation found a tensor whose layout, dtype or value contradicts the plan."""


class PartialSumError(LayoutError):
    """A pending partial sum is used as a complete value: a ``hpf.psum`` is missing."""


class ShardingMismatchError(LayoutError):
    """Operands of one op are split differently over a non-FSDP axis."""


class ShardedContractionError(ShardingMismatchError):
    """A contraction or reduction runs over a dim sharded on a non-FSDP axis in a way no
    reduction can complete: the other operand is not sharded alike, or the op (mean, max,
    softmax, a norm, cross-entropy, attention) needs the whole dim."""


class LossNotReplicatedError(LayoutError):
    """The loss differs (by layout or by value) across the ranks of a non-FSDP axis."""


class BatchMismatchError(LayoutError):
    """Local batches differ in shape or dtype across ranks, or in content across the ranks
    of a non-FSDP axis (which must see the same batch)."""


class ParamsTreeError(LayoutError, spec.SpecTreeError):
    """A params tree, spec tree or train state does not have the plan's structure."""


class PrecisionError(LayoutError):
    """An op silently leaves the mixed-precision compute dtype."""


NonFiniteError = errors.NonFiniteError  # (re-exported: the one class of that name)
IndivisibleSpecError = spec.IndivisibleSpecError


class NonFiniteLayoutError(LayoutError, NonFiniteError):
    """A non-finite loss or grad; the message names where it first appeared (production
    mode's :class:`hpf.NonFiniteError`, with the origin named)."""


class IndivisibleLayoutError(LayoutError, IndivisibleSpecError):
    """A non-FSDP axis does not divide the dim it splits (only FSDP axes are padded): the
    planner's :class:`hpf.spec.IndivisibleSpecError`, with the op that made the plan named."""


class QuantizationError(LayoutError):
    """A param's weights or grads lose more than ``quantization_tolerance`` (relative to the
    param's largest value) crossing a low-bit slow tier (``hpf.Topology(slow_weights=...)``)."""


class CollectiveError(LayoutError):
    """An hpf collective applied to a layout it cannot mean (e.g. psum of a replicated value)."""


class DispatchError(LayoutError):
    """MoE token dispatch broke an invariant of the router or the all-to-all (checked in
    validation mode by :mod:`hpf.validate.dispatch`)."""


class TokenLostError(DispatchError):
    """A token is not sent to each of its top-k experts exactly once, or does not come back
    to its place after the experts (a dropped, duplicated or misplaced copy)."""


class ExpertPlacementError(DispatchError):
    """A token copy reached a rank that does not own its expert (or a count disagrees with
    the ids that arrived): the dispatch order is not expert-major over ranks."""


class GateSumError(DispatchError):
    """A token's routing gates do not sum to the config's route_scale (1: normalized), or
    are negative or non-finite."""


class GradientMismatchError(LayoutError):
    """Sharded grads differ from the single-process reference beyond the tolerance."""


#: The fail-fast checks of validation mode, in their documented order.
CHECKS: tuple[type[LayoutError], ...] = (
    PartialSumError, ShardedContractionError, LossNotReplicatedError, BatchMismatchError,
    ParamsTreeError, PrecisionError, NonFiniteLayoutError, IndivisibleLayoutError, QuantizationError,
    TokenLostError, ExpertPlacementError, GateSumError,
)


@contextlib.contextmanager
def as_layout_errors(op: str) -> Iterator[None]:
    """Re-raise the planner's spec-tree and divisibility errors (hpf.spec, checked once there)
    as this module's :class:`ParamsTreeError` / :class:`IndivisibleLayoutError`, prefixed by ``op``."""
    try:
        yield
    except LayoutError:
        raise
    except spec.SpecTreeError as err:
        raise ParamsTreeError(f"{op}: {err}") from None
    except spec.IndivisibleSpecError as err:
        raise IndivisibleLayoutError(f"{op}: {err}") from None
