"""Pure-function models: params are plain pytrees, ``loss(params, batch)`` is a pure function.

Each model module declares ``SPEC``, a ``ModelSpec``: what every hpf tool needs of it, in one place
(name, ``configs``, ``init``, ``loss(config, *, ep_axis=None, aux=False, **how)``, ``num_params``,
and where the model has them ``param_specs(config, data_axes, *, tp_axis=, tp=, ep_axis=)``, its
costs for the planner (``unit_flops``, ``activations``, ``unit_a2a``, ``dispatch_bytes``), a loop
``balancer``, ``forward``, ``batch_axes``, ``experts``; None where it lacks one, and a tool that needs
it says so by name). ``MODELS`` names the modules for the ``hpf`` command, ``SPECS`` their specs.
A model of your own: declare ``SPEC = ModelSpec(name="mine", configs=..., init=..., loss=...,
num_params=...)`` in its module (``spec.dense_loss`` wraps a dense model's ``loss_for``), and add
the module, or the spec itself, to ``MODELS``; the tools read it through ``spec_of``.
Synthetic token batches (``synthetic.synthetic_batches``, also ``gpt.synthetic_batches``) fit any config with ``vocab_size`` and
``seq_len``.

The registry of models and their layouts is registry.py; this file only re-exports."""
from hpf.models import gpt, llama, moe
from hpf.models.registry import (MODELS, SPECS, TP_AXIS, carve_tp, data_axes, has_experts, layout, mesh_for, model_config,
                                 specs_for, tp_size, tp_sizes)
from hpf.models.spec import ModelSpec, spec_of

__all__ = ["gpt", "llama", "moe", "MODELS", "SPECS", "ModelSpec", "spec_of", "model_config", "has_experts", "specs_for", "TP_AXIS", "data_axes",
           "layout", "mesh_for", "carve_tp", "tp_sizes", "tp_size"]
