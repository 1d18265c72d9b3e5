"""Functional optimizers, optax-style: ``init(params) -> state`` and
``update(grads, state, params) -> (new_params, new_state)``.

``hpf.optim.adamw(...)`` and ``hpf.optim.muon(...)`` are the factories (they shadow their
submodules as attributes; ``from hpf.optim.muon import ...`` still reaches the module).
"""
from . import schedules
from .adamw import AdamW, adamw, default_weight_decay_mask
from .dist_muon import DistMuon
from .muon import Muon, MuonState, muon

__all__ = ["AdamW", "DistMuon", "Muon", "MuonState", "adamw", "default_weight_decay_mask", "muon", "schedules"]
