"""Functional optimizers, optax-style: ``init(params) -> state`` and
``update(grads, state, params) -> (new_params, new_state)``; what else the step may do with
one it declares as data, ``capabilities`` (base.py).

``hpf.optim.adamw(...)`` and ``hpf.optim.muon(...)`` are the factories; their modules are
adamw_optimizer.py and muon_optimizer.py, so no function shadows a module.
"""
from . import lr_schedules, transforms
from .adamw_optimizer import AdamW, AdamWState, adamw, default_weight_decay_mask
from .base import Capabilities, EarlyUpdate, ForPlan, Optimizer, PartialUpdate, capabilities
from .dist_muon import DistMuon
from .muon_math import MuonState
from .muon_optimizer import Muon, muon

__all__ = ["AdamW", "AdamWState", "Capabilities", "DistMuon", "EarlyUpdate", "ForPlan", "Muon", "MuonState", "Optimizer",
           "PartialUpdate", "adamw", "capabilities", "default_weight_decay_mask", "muon", "lr_schedules", "transforms"]
