"""Optimizers as composable transforms, as optax composes its ``GradientTransformation`` objects.

Every stage and every combinator has one shape (:class:`Transform`): ``init(params) -> state``
and ``update(grads, state, params, hyper) -> (updates, state)``. ``params`` and ``grads`` are
lists of tensors (a pytree's leaves, or the step's flat shards); ``state`` maps each field the
transform declares (``fields``: "exp_avg", ...) to one tensor per leaf, so a chain's state is
its stages' fields side by side and a checkpoint names them as before. hpf donates its buffers,
so a stage updates its state and, where optax would return an update to add, writes the params
in place (the same fused foreach ops as ``torch.optim.AdamW``, hence bit for bit its result);
``updates`` are what the next stage reads as its grads (a clip scales them).

- ``hyper`` (:class:`Hyper`) is one step's hyper-parameters: the step and the learning rate.
  ``inject_hyperparams(t, lr=schedule)`` sets the lr ``t`` sees from the step (optax's
  ``inject_hyperparams``); an inner one overrides an outer one for its part. A stage's own
  fields are injected the same way (``weight_decay=schedule`` into ``add_decayed_weights``).
- ``chain(*stages)`` applies stages in order; ``partition(transforms, labels)`` gives each
  param to the transform its label names (optax's ``multi_transform``): Muon's matrices to
  ``scale_by_muon``, the rest to AdamW's chain. On a plan's flat shards a partition of
  elementwise transforms runs each on the pieces of its params (``PlannedPartition``).
- :class:`TransformOptimizer` (``as_optimizer``) is a transform as an hpf optimizer: it keeps the
  step count, evaluates the schedules, and declares its capabilities as data. ``hpf.shard_step``
  wraps a transform passed as ``optimizer=`` in it.
- Clipping by the global grad norm (``clip_by_global_norm``) is a stage, but under a plan the
  norm is the step's (one all-reduce, hpf.decision): the stage declares ``max_grad_norm``, the
  decision reads its factor of that norm (``Decision.clip``) and the one multiplier of the summed
  grads the stage gives for it (``grad_scale``: one rounding, not two), and the stage's plan form
  passes the grads it is then given through.
- What needs the plan's layout, a stage resolves in ``for_plan(plan, rank)`` (a decay mask
  becomes element ranges per shard); what needs the params' paths, in ``for_params(params)``.
  An ``elementwise`` transform's ``take(indices)`` runs a subset of the leaves alone (the
  step's partial update).
"""
from __future__ import annotations

from .combinators import (Chain, InjectHyperparams, Partition, PlannedPartition, chain, inject_hyperparams,
                          partition)
from .stage import Hyper, Transform, inject, meta_params, run
from .stages import (AddDecayedWeights, ClipByGlobalNorm, ScaleByAdam, add_decayed_weights, clip_by_global_norm,
                     scale_by_adam)
from .transform_optimizer import TransformOptimizer, as_optimizer, state_type

__all__ = ["Hyper", "inject", "Transform", "chain", "partition", "inject_hyperparams", "as_optimizer",
           "add_decayed_weights", "scale_by_adam", "clip_by_global_norm", "Chain", "Partition",
           "InjectHyperparams", "PlannedPartition", "TransformOptimizer", "AddDecayedWeights", "ScaleByAdam", "ClipByGlobalNorm",
           "meta_params", "run", "state_type"]
