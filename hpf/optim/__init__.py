"""Functional optimizers, optax-style: ``init(params) -> state`` and
``update(grads, state, params) -> (new_params, new_state)``."""
from .adamw import AdamW, adamw

__all__ = ["AdamW", "adamw"]
from .dist_muon import DistMuon
from .muon import Muon, MuonState

__all__ += ["DistMuon", "Muon", "MuonState"]
