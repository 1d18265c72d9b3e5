"""Pure-function models: params are plain pytrees, ``loss(params, batch)`` is a pure function.

Each model module provides ``CONFIGS``, ``init(config, key, device=, dtype=)``,
``loss_for(config)`` and ``num_params(config)``; ``MODELS`` names them for the ``hpf`` command.
A model with experts (``moe``) also provides ``param_specs(config, ep_axis, data_axes)``,
``dispatch_bytes`` (its all-to-all bytes, for ``hpf plan``) and ``Balancer`` (loop state that
rides in each batch and moves by ``metrics["aux"]``); its ``loss_for`` takes ``ep_axis, aux``.
Synthetic token batches (``synthetic.synthetic_batches``, also ``gpt.synthetic_batches``) fit any config with ``vocab_size`` and
``seq_len``.

The registry of models and their layouts is registry.py; this file only re-exports."""
from hpf.models import gpt, llama, moe
from hpf.models.registry import (MODELS, SPECS, TP_AXIS, carve_tp, data_axes, has_experts, layout, mesh_for, model_config,
                                 specs_for, tp_size, tp_sizes)
from hpf.models.spec import ModelSpec, spec_of

__all__ = ["gpt", "llama", "moe", "MODELS", "SPECS", "ModelSpec", "spec_of", "model_config", "has_experts", "specs_for", "TP_AXIS", "data_axes",
           "layout", "mesh_for", "carve_tp", "tp_sizes", "tp_size"]
