"""The built-in models by name and how a mesh lays each out: ``MODELS`` and ``model_config``
(what ``hpf train --model/--config`` pick), the specs of expert and tensor parallelism
(``specs_for``, ``layout``, ``TP_AXIS``), and the meshes the plan search tries (``mesh_for``,
``carve_tp``, ``tp_sizes``). hpf.models re-exports them."""
import dataclasses

from hpf.mesh import Mesh
from hpf.models import gpt, llama, moe
from hpf.models.spec import ModelSpec, spec_of

__all__ = ["gpt", "llama", "moe", "MODELS", "model_config", "has_experts", "specs_for", "TP_AXIS", "data_axes",
           "layout", "mesh_for", "carve_tp", "check_tp", "tp_sizes", "tp_size", "ModelSpec", "spec_of", "SPECS"]

#: The models by name: what `hpf train --model` picks.
MODELS = {"gpt": gpt, "llama": llama, "moe": moe}
#: Their ModelSpecs by name: what every tool reads of a model (``spec_of(MODELS[name])``).
SPECS = {name: spec_of(module) for name, module in MODELS.items()}


def model_config(model: str, config: str, vocab_size: int | None = None):
    """(model module, config) for a model name and a config name, or a ValueError saying which
    exist. ``vocab_size`` replaces the config's (a token folder's vocab, ``hpf train --data``)."""
    if model not in MODELS:
        raise ValueError(f"model {model!r} is not one of {', '.join(MODELS)}")
    module, configs = MODELS[model], spec_of(MODELS[model]).configs
    if config not in configs:
        raise ValueError(f"config {config!r} is not a {model} config; pick one of {', '.join(configs)}")
    found = configs[config]
    return module, (dataclasses.replace(found, vocab_size=vocab_size) if vocab_size else found)


TP_AXIS = "tp"  # a mesh axis of this name runs the models tensor parallel (hpf train --mesh dp=2,tp=2)


def tp_size(mesh: Mesh) -> int | None:
    """The size of ``mesh``'s ``TP_AXIS``, or None where it has none."""
    return mesh.axis_size(TP_AXIS) if TP_AXIS in mesh.axis_names else None


def has_experts(module) -> bool:
    """Whether a model places experts on an expert-parallel axis (its spec's ``experts``)."""
    return spec_of(module).experts


def data_axes(axis_names) -> tuple[str, ...]:
    """The axes that split the data: every axis but the tensor-parallel one."""
    return tuple(a for a in axis_names if a != TP_AXIS)


def specs_for(module, config, ep_axis: str | None, data_axes, tp_axis: str | None = None,
              tp: int | None = None) -> object:
    """shard_step's ``param_specs`` for a model: its experts on ``ep_axis``, its blocks tensor
    parallel over ``tp_axis`` of ``tp`` ranks (a model with experts: its attention), or None
    (every param sharded over the FSDP axes ``data_axes``).

    Raises:
        ValueError: ``ep_axis`` for a model that has no experts; a ``tp`` larger than the heads."""
    spec = spec_of(module)
    if not spec.experts and ep_axis is not None:
        raise ValueError(f"ep_axis={ep_axis!r}: model {spec.name} has no experts; use the moe model")
    if tp_axis is None and not spec.experts:
        return None
    what = "lays out its params tensor parallel" if tp_axis is not None else "places its experts"
    return spec.need("param_specs", what)(config, tuple(data_axes), tp_axis=tp_axis, tp=tp, ep_axis=ep_axis)


def layout(module, config, axis_names, fsdp_axes=None, ep_axis: str | None = None,
           tp: int | None = None) -> tuple[object, tuple | None]:
    """(param_specs, fsdp_axes) of shard_step for a built-in model on a mesh of ``axis_names``: an
    axis named ``TP_AXIS`` (of ``tp`` ranks) runs it tensor parallel, FSDP over the others
    (``fsdp_axes`` default: the data axes); with ``ep_axis`` too for a model with experts. Raises
    as ``specs_for``."""
    if TP_AXIS in axis_names:
        data = tuple(fsdp_axes or data_axes(axis_names))
        return specs_for(module, config, ep_axis, data, TP_AXIS, tp), data
    return specs_for(module, config, ep_axis, fsdp_axes or axis_names), fsdp_axes


def mesh_for(axes: dict[str, int]) -> Mesh:
    """The Mesh of ``axes`` (outer to inner) as hpf train and the plan search build it: the fast tier
    is the last axis, and a last axis ``TP_AXIS`` below two others shares it with the axis before
    (node=2,local=2,tp=2: local and tp in the fast tier, tensor parallelism inside a host)."""
    names = list(axes)
    fast = names[-2:] if len(names) >= 3 and names[-1] == TP_AXIS else names[-1:]
    return Mesh(dict(axes), fast_axes=fast)


def check_tp(tp) -> None:
    """Refuse what is not a tensor-parallel size (0 divided by zero; True, 2.0 and "2" passed for one)."""
    if type(tp) is not int or tp < 1:
        raise ValueError(f"tp={tp!r} is not a tensor-parallel size: give a positive int that divides the last axis")


def carve_tp(mesh: Mesh, tp: int) -> Mesh:
    """``mesh`` with a ``TP_AXIS`` of ``tp`` ranks split off its last axis (``mesh_for``'s tiers);
    itself for ``tp`` 1."""
    check_tp(tp)
    if tp == 1:
        return mesh
    *outer, (last, n) = zip(mesh.axis_names, mesh.shape)
    if n % tp:
        raise ValueError(f"tp={tp} does not divide the last axis {last}={n} of {mesh}")
    return mesh_for({**dict(outer), **({last: n // tp} if n > tp or not outer else {}), TP_AXIS: tp})


def tp_sizes(module, config, mesh: Mesh) -> list[int]:
    """The tensor-parallel sizes a plan search may carve off ``mesh``'s last axis for this model: 1,
    and the divisors of that axis up to the heads (a split may be uneven, in whole heads), for a
    model with ``param_specs`` and no experts, on a mesh with no ``TP_AXIS`` yet."""
    if TP_AXIS in mesh.axis_names or has_experts(module) or spec_of(module).param_specs is None:
        return [1]
    n = mesh.shape[-1]
    return [k for k in range(1, n + 1) if not n % k and k <= config.n_heads]
