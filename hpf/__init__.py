"""hpf: JAX-style fully sharded training of pure-function models on PyTorch.

Models are pure functions over pytrees of plain tensors; sharding is written as
PartitionSpecs and resolved once into a plan. The module map, the data flow and which
module owns which decision are in docs/architecture.md; the user guide is README.md.
"""
from . import tree
from .launcher import launch
from .mesh import Mesh, MeshError
from .planning import Plan, plan
from .spec import P, SpecError, rules
from .types import MixedPrecision, TrainState
from .checks import DonatedStateError, NonFiniteError, ParamsMismatchError, UnevenBatchError
from .comm.schedule import ScheduleMismatchError
from .losses import LossScale, weighted
from .config import StepConfig
from .step import ShardStep
from .api import shard_step
from .comm.tiered import SlowLink, Topology
from .comm.collectives import all_gather, all_to_all, axis_index, psum
from .validate import check_plan
from . import optim

__all__ = ["DonatedStateError", "NonFiniteError", "ParamsMismatchError", "ScheduleMismatchError", "UnevenBatchError",
           "LossScale", "P", "Mesh", "MeshError", "MixedPrecision", "Plan", "ShardStep", "SlowLink", "SpecError",
           "StepConfig", "Topology", "TrainState", "all_gather", "all_to_all", "axis_index", "check_plan", "launch",
           "optim", "plan", "psum", "rules", "shard_step", "tree", "weighted"]
__version__ = "0.1.0"
