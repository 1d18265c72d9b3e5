"""Elastic training: a lost rank is survived in memory, and a new rank joins at a step boundary.

``hpf.elastic.train(make_step, init, batches, steps)`` runs the training loop of one rank. At each
step boundary (every ``every`` steps) each rank sends its shard state (params, optimizer state,
step counters, the loss scale) to its buddy, the rank ``shift`` places on along the ring of members
(another machine of a two-tier mesh), which keeps it. A boundary is protected once every rank has
its partner's copy: each says so in the job's store, the one thing that outlives every rank. Then
the boundary before is dropped, and each rank packs its own copy (a step updates its state in
place, and a fault in the next step goes back to it). Under HSDP the replicas are the copies.

When a rank dies (SIGKILL, a lost machine), the others find out within seconds: a gloo error on
the ranks that talked to it, or its heartbeat going silent (hpf.comm.liveness) on the rest, which
every wait of hpf's collectives checks. The first survivor opens a roll call in the store; the
others see it from their waits and join. Once every member has answered or gone silent, the
members left are agreed on (the store's compare-and-set), and they form the next generation of
the process group under a new prefix (``hpf.launch.reform``). Each rebuilds the step on the
smaller world (``make_step(world_size)``), and the state of the last boundary they can rebuild
(each member's own copy, and each lost rank's copy at its buddy: a boundary still being copied may
already be whole for the ranks lost) is resharded onto it in memory: every chunk
(``hpf.checkpoint.state_dict``: the checkpoint's own layout, global offsets per param) goes from
the rank that holds it (its owner, or the owner's buddy for a lost rank) to the ranks that need it. Then the steps since that boundary are redone,
on the same global batches (``batches(step, rank, world_size)`` is the caller's pure function).
In the invariant mode (``invariant=True``) the continued run's bits equal a run that never failed.

A new rank (an elastic ``hpf.launch``'s replacement, or a worker torchrun restarted) registers in
the store; at the next boundary the members admit it, form the next generation with it, and
reshard onto it the same way. Under torchrun each member runs under a torchrun of its own, whose
agent restarts only it, around ``hpf store`` (``hpf.launcher.elastic_member``, docs/elastic.md).

What cannot be survived is raised as UnrecoverableLossError, naming the ranks: a rank lost with
its buddy, or all but none. A mesh that splits params over non-FSDP axes (tensor or expert
parallel) cannot shrink, and is refused when the job starts.
"""
from .job import ROLL_CALL_S
from .loop import Run, train

__all__ = ["train", "Run", "ROLL_CALL_S"]
