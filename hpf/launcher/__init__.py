"""Local multi-process launch, and process-group setup that also works under torchrun. Modules:

- fork.py: `launch(fn, world_size, *args)`, ranks forked with torchrun's environment;
- results.py: what the ranks report, and the one rank to blame when one fails (`RankError`);
- group.py: the default process group (`init_distributed`, `shutdown`) and an elastic job's
  generations of it (`reform`, `base_store`, `elastic_member`).

Code written for `launch` runs unchanged under torchrun: call `init_distributed()` (a no-op when
the group already exists) at the top of the script, and `shutdown()` at its end (`launch` calls
it when `fn` returns).
"""
from ..comm.world import COLLECTIVE_TIMEOUT_S
from ..errors import RankError, Terminated
from .fork import launch
from .group import (JOB_DONE_KEY, at_reform, at_shutdown, base_store, elastic_member, generation_prefix,
                    init_distributed, is_launched, rank, reform, serve_store, shutdown, world_size)

__all__ = ["RankError", "Terminated", "launch", "init_distributed", "shutdown", "at_shutdown", "is_launched", "rank", "world_size",
           "COLLECTIVE_TIMEOUT_S", "reform", "at_reform", "base_store", "generation_prefix", "elastic_member",
           "serve_store"]
