"""Pure-function models: params are plain pytrees, ``loss(params, batch)`` is a pure function.

Each model module provides ``CONFIGS``, ``init(config, key, device=, dtype=)``,
``loss_for(config)`` and ``num_params(config)``; ``MODELS`` names them for the ``hpf`` command.
A model with experts (``moe``) also provides ``param_specs(config, ep_axis, data_axes)``,
``dispatch_bytes`` (its all-to-all bytes, for ``hpf plan``) and ``Balancer`` (loop state that
rides in each batch and moves by ``metrics["aux"]``); its ``loss_for`` takes ``ep_axis, aux``.
Synthetic token batches (``gpt.synthetic_batches``) fit any config with ``vocab_size`` and
``seq_len``."""
import dataclasses

from hpf.models import gpt, llama, moe

__all__ = ["gpt", "llama", "moe", "MODELS", "model_config", "has_experts", "specs_for", "TP_AXIS", "data_axes"]

#: The models by name: what `hpf train --model` picks.
MODELS = {"gpt": gpt, "llama": llama, "moe": moe}


def model_config(model: str, config: str, vocab_size: int | None = None):
    """(model module, config) for a model name and a config name, or a ValueError saying which
    exist. ``vocab_size`` replaces the config's (a token folder's vocab, ``hpf train --data``)."""
    if model not in MODELS:
        raise ValueError(f"model {model!r} is not one of {', '.join(MODELS)}")
    module = MODELS[model]
    if config not in module.CONFIGS:
        raise ValueError(f"config {config!r} is not a {model} config; pick one of {', '.join(module.CONFIGS)}")
    found = module.CONFIGS[config]
    return module, (dataclasses.replace(found, vocab_size=vocab_size) if vocab_size else found)


TP_AXIS = "tp"  # a mesh axis of this name runs the models tensor parallel (hpf train --mesh dp=2,tp=2)


def has_experts(module) -> bool:
    """Whether a model module places experts on an expert-parallel axis (its ``EXPERTS``)."""
    return getattr(module, "EXPERTS", False)


def data_axes(axis_names) -> tuple[str, ...]:
    """The axes that split the data: every axis but the tensor-parallel one."""
    return tuple(a for a in axis_names if a != TP_AXIS)


def specs_for(module, config, ep_axis: str | None, data_axes, tp_axis: str | None = None) -> object:
    """shard_step's ``param_specs`` for a model: its experts on ``ep_axis``, its blocks tensor
    parallel over ``tp_axis``, or None (every param sharded over the FSDP axes ``data_axes``).

    Raises:
        ValueError: ``ep_axis`` for a model that has no experts, ``tp_axis`` for one that has."""
    if tp_axis is not None:
        name = getattr(module, "__name__", str(module)).rpartition(".")[2]
        if has_experts(module):
            raise ValueError(f"tensor parallelism over {tp_axis!r}: model {name} runs expert parallelism instead "
                             "(--ep-axis); use gpt or llama for tensor parallelism")
        return module.param_specs(config, tp_axis, tuple(data_axes))
    if not has_experts(module):
        if ep_axis is not None:
            name = getattr(module, "__name__", str(module)).rpartition(".")[2]
            raise ValueError(f"ep_axis={ep_axis!r}: model {name} has no experts; use the moe model")
        return None
    return module.param_specs(config, ep_axis, tuple(data_axes))
