"""hpf: JAX-style fully sharded training of pure-function models on PyTorch.

Models are pure functions over pytrees of plain tensors; sharding is written as
PartitionSpecs and resolved once into a plan. The module map is in docs/architecture.md.

Every public name, and the submodules ``checkpoint``, ``data``, ``elastic``, ``errors``, ``models``, ``optim``,
``random``, ``sim`` and ``tree``, loads on first use (PEP 562): ``import hpf`` does not import torch,
so the ``hpf`` command answers ``--help`` at once.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_NAMES = {
    "Mesh": "mesh",
    "Plan": "planning", "plan": "planning",
    "P": "spec", "rules": "spec",
    "MixedPrecision": "precision", "StepStats": "train_state", "TrainState": "train_state",
    "MeshError": "errors", "SpecError": "errors", "DonatedStateError": "errors", "NonFiniteError": "errors",
    "ParamsMismatchError": "errors", "UnevenBatchError": "errors", "StaleParamError": "errors",
    "UnusedParamsError": "errors", "CapturedTensorError": "errors", "ScheduleMismatchError": "errors",
    "hvp": "func", "per_example_grads": "func",
    "LossScale": "losses", "weighted": "losses",
    "StepConfig": "config",
    "ShardStep": "step",
    "shard_step": "modes",
    "SlowLink": "topology", "Topology": "topology",
    "all_gather": "comm.collectives", "all_to_all": "comm.collectives", "axis_index": "comm.collectives",
    "psum": "comm.collectives", "psum_scatter": "comm.collectives",
    "check_plan": "validate",
    "launch": "launcher",
    "from_module": "module", "to_module": "module",
}
_SUBMODULES = ("checkpoint", "data", "elastic", "errors", "models", "optim", "random", "sim", "tree")

__all__ = sorted([*_NAMES, *_SUBMODULES])


def __getattr__(name: str):
    if name in _NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'hpf' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
