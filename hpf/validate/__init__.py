"""Validation mode: the production plan, with every tensor's layout checked through every op.

One concern per module:

* :mod:`~hpf.validate.errors`            the error classes, one per check (``CHECKS``);
* :mod:`~hpf.validate.layout`            what a layout is, and how errors describe it;
* :mod:`~hpf.validate.rules`             the op rules, each registered where it is written (``rule_for``);
* :mod:`~hpf.validate.op_rule`           how an op rule is written and registered;
* :mod:`~hpf.validate.shape_rules`       the rules of elementwise ops, reductions, views and indexing;
* :mod:`~hpf.validate.contraction_rules` those of products, einsum, norms, losses and attention;
* :mod:`~hpf.validate.tracker`           the ``TorchFunctionMode`` that carries layouts through ``loss_fn``;
* :mod:`~hpf.validate.step`              ``ValidateStep``: the production step with every check on;
* :mod:`~hpf.validate.plan_check`        ``check_plan``: one rank's view of any mesh, on meta tensors;
* :mod:`~hpf.validate.grads`             ``check_grads``: sharded grads vs a single-process reference;
* :mod:`~hpf.validate.dispatch`          MoE dispatch invariants (tokens, expert placement, gates).
"""
from .errors import (CHECKS, BatchMismatchError, CollectiveError, DispatchError, ExpertPlacementError, GateSumError,
                     GradientMismatchError, IndivisibleLayoutError, IndivisibleSpecError, LayoutError, LossNotReplicatedError,
                     NonFiniteError, NonFiniteLayoutError, ParamsTreeError, PartialSumError, PrecisionError, QuantizationError,
                     ShardedContractionError, ShardingMismatchError, TokenLostError)
from . import dispatch  # noqa: F401  (registers the MoE checks models run by name: hpf.comm.collectives.run_check)
from .grads import GradReport, check_grads
from .layout import PARTIAL, VARYING, Info, describe, make_info
from .plan_check import PlanCheck, check_plan
from .step import ValidateStep
from .tracker import Tracker

__all__ = [
    "LayoutError", "PartialSumError", "ShardingMismatchError", "ShardedContractionError",
    "LossNotReplicatedError", "BatchMismatchError", "ParamsTreeError", "PrecisionError",
    "NonFiniteLayoutError", "IndivisibleLayoutError", "NonFiniteError", "IndivisibleSpecError", "QuantizationError", "CollectiveError", "GradientMismatchError", "CHECKS",
    "DispatchError", "TokenLostError", "ExpertPlacementError", "GateSumError",
    "ValidateStep", "check_plan", "check_grads", "PlanCheck", "GradReport", "Tracker",
    "PARTIAL", "VARYING", "Info", "describe", "make_info",
]
