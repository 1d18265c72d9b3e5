"""The production step: :class:`ShardStep`, what :func:`hpf.shard_step` makes for ``mode="production"``. Modules:

- production.py: ``ShardStep``, one sharded training step of a pure loss function in phases,
  and its boundary (``close()``, ``with``, ``stats()``);
- build.py: what its ``init`` builds from the config: the plan, this rank's first shards, the
  comm and the engine;
- update.py: the update after the decision, and the optimizer's work begun in backward;
- donation.py: the state a step was given is spent (``DonatedStateError`` on reuse).
"""
from ..planning import step_plan
from ..train_state import TrainState
from .build import INVARIANT_ALIGN
from .donation import Donation
from .production import ShardStep
from .update import Attempt, EarlyWork

__all__ = ["ShardStep", "step_plan"]
