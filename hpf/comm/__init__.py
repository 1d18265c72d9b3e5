"""All of hpf's communication. Modules:

- transport.py: the `Transport` protocol (one tier's collectives over flat shards) and its
  torch.distributed version; the engine's `UnitComm` protocol; shm.py: shared memory;
  handles.py: collectives in flight, and how they are waited for.
- flat.py (`BucketComm`) and tiered.py (`TieredComm`, which carries out an `hpf.topology.Topology`):
  the UnitComms.
- collectives.py: ``hpf.psum`` and the other explicit collectives of a loss function.
- cost.py: the byte model; world.py: process-group facts and one-off collectives.

Only the transport layer is imported here: flat.py and tiered.py read the plan, which
imports cost.py through its report, so importing them from this file would be a cycle.
"""
from .shm import ShmGroup, ShmTimeout, remove_leftovers
from .transport import ProcessGroupTransport, Transport, UnitComm

__all__ = ["ProcessGroupTransport", "ShmGroup", "ShmTimeout", "Transport", "UnitComm", "remove_leftovers"]
