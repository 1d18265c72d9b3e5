"""``ModelSpec``: what every hpf tool needs of a model, declared once (as torchtitan's TrainSpec).

Each built-in model module declares its ``SPEC``; a model of your own declares one too and joins
``hpf.models.MODELS`` (a module with a ``SPEC``, or the spec itself). The tools read these fields and
never probe a module: an optional field is None where the model lacks it, and a tool that needs it
says so by name (``ModelSpec.need``)."""
import dataclasses
from typing import Any, Callable

__all__ = ["ModelSpec", "spec_of", "dense_loss", "dense_param_specs"]


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: hashed by identity (the simulator caches by model)
class ModelSpec:
    """A model as the tools see it.

    Required: ``name``; ``configs`` (name -> config); ``init(config, key=None, *, device=, dtype=)``;
    ``loss(config, *, ep_axis=None, aux=False, **how)`` -> ``loss(params, batch)`` (``how``: recompute,
    weighted, compile, tp_axis, ...); ``num_params(config)``.
    Optional (None where the model lacks it): ``param_specs(config, data_axes, *, tp_axis=None, tp=None,
    ep_axis=None)`` (tensor or expert parallel layouts); ``unit_flops(config, local_batch, tp=1)``,
    ``unit_psums``, ``unit_a2a``, ``dispatch_bytes`` and ``activations`` (the planner's and simulator's
    costs; without ``unit_flops`` they count 2 x params x tokens); ``balancer`` (loop state class riding
    in each batch); ``forward(params, tokens, ...)`` (hpf generate); ``qk_heads`` (--qk-clip);
    ``batch_axes`` (shard_step's); ``experts``: its experts split over an expert-parallel axis."""
    name: str
    configs: dict[str, Any]
    init: Callable
    loss: Callable
    num_params: Callable
    param_specs: Callable | None = None
    unit_flops: Callable | None = None
    unit_psums: Callable | None = None
    unit_a2a: Callable | None = None
    dispatch_bytes: Callable | None = None
    activations: Callable | None = None
    balancer: type | None = None
    forward: Callable | None = None
    qk_heads: Callable | None = None
    batch_axes: Any = None
    experts: bool = False

    def need(self, field: str, why: str) -> Callable:
        """The optional ``field``, or a ValueError saying this model lacks it and what needs it."""
        found = getattr(self, field)
        if found is None:
            raise ValueError(f"model {self.name} has no {field} in its ModelSpec, which {why}; declare "
                             f"{field}= in its SPEC or use a model that has it")
        return found


def spec_of(model) -> ModelSpec:
    """The ModelSpec of ``model``: a ModelSpec itself, or a model module declaring ``SPEC``."""
    if isinstance(model, ModelSpec):
        return model
    found = getattr(model, "SPEC", None)
    if not isinstance(found, ModelSpec):
        raise TypeError(f"{model!r} is not a model: give a hpf.models.ModelSpec or a module declaring SPEC = "
                        "ModelSpec(...) (see hpf.models)")
    return found


def dense_loss(loss_for: Callable) -> Callable:
    """The spec's ``loss`` of a model with no experts from its ``loss_for(config, **how)``."""
    def loss(config, *, ep_axis: str | None = None, aux: bool = False, **how):
        if ep_axis is not None or aux:
            raise ValueError(f"ep_axis={ep_axis!r}, aux={aux}: this model has no experts; use the moe model")
        return loss_for(config, **how)
    return loss


def dense_param_specs(param_specs: Callable) -> Callable:
    """The spec's ``param_specs`` of a tensor-parallel model from its ``param_specs(config, tp_axis,
    data_axes, tp=)``."""
    def specs(config, data_axes, *, tp_axis: str | None = None, tp: int | None = None, ep_axis: str | None = None):
        return param_specs(config, tp_axis, tuple(data_axes), tp=tp)
    return specs
