"""Sharded checkpoints on torch.distributed.checkpoint (DCP), with resharding and exact resume. Modules:

- chunks.py: what a checkpoint holds of a step's state (the format: each tensor at its global
  shape, this rank's chunks as views at their global offsets; the header, hpf.json);
- agreement.py: what every rank of a save or restore agrees on before any file is touched;
- saving.py: ``save`` (sync or async), published whole by a rename, ``keep_last``, ``latest``;
- restoring.py: ``restore`` on any mesh, ``load_params`` and ``meta`` in one process, checked
  before anything changes; ``rng_state``/``set_rng_state`` for ``extra``.

Its files are read as data and checked by hpf.checkpoint_files and hpf.checkpoint_check.
"""
from ..checkpoint_files import CheckpointError, seal, sums
from .chunks import FEEDBACK, VERSION, Layout, boxes, key_of, state_dict
from .restoring import load_params, meta, restore, rng_state, set_rng_state
from .saving import SaveHandle, finish_saves_at_exit, latest, save, wait_pending

__all__ = ["CheckpointError", "Layout", "state_dict", "save", "restore", "load_params", "meta", "wait_pending", "boxes", "latest", "rng_state",
           "set_rng_state", "VERSION"]
