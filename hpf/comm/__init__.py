"""Collectives behind one `Transport` protocol: torch.distributed groups, and shared memory
for the CPU ranks of one host (see transport.py for the byte-counter convention)."""
from .shm import ShmGroup, ShmTimeout, remove_leftovers
from .transport import ProcessGroupTransport, Transport

__all__ = ["ProcessGroupTransport", "ShmGroup", "ShmTimeout", "Transport", "remove_leftovers"]
