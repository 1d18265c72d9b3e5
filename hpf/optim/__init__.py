"""Functional optimizers, optax-style: ``init(params) -> state`` and
``update(grads, state, params) -> (new_params, new_state)``; what else the step may do with
one it declares as data, ``capabilities`` (base.py). Both are built from composable stages
(transforms.py: ``chain``, ``partition``, ``inject_hyperparams``), which users compose too.

``hpf.optim.adamw(...)`` and ``hpf.optim.muon(...)`` are the factories; their modules are
adamw_optimizer.py and muon_optimizer.py, so no function shadows a module.
"""
from . import lr_schedules, transforms
from .adamw_optimizer import AdamW, AdamWState, adamw, default_weight_decay_mask
from .base import Capabilities, EarlyUpdate, ForPlan, Optimizer, PartialUpdate, capabilities
from .dist_muon import DistMuon
from .muon_math import MuonState, scale_by_muon
from .muon_optimizer import Muon, muon
from .transforms import (Transform, TransformOptimizer, add_decayed_weights, as_optimizer, chain, clip_by_global_norm,
                         inject_hyperparams, partition, scale_by_adam)

__all__ = ["AdamW", "AdamWState", "Capabilities", "DistMuon", "EarlyUpdate", "ForPlan", "Muon", "MuonState", "Optimizer",
           "PartialUpdate", "Transform", "TransformOptimizer", "adamw", "add_decayed_weights", "as_optimizer",
           "capabilities", "chain", "clip_by_global_norm", "default_weight_decay_mask", "inject_hyperparams", "muon",
           "lr_schedules", "partition", "scale_by_adam", "scale_by_muon", "transforms"]
