"""hpf.models.ModelSpec: the tools read a model's spec, and say by name what a model lacks."""
import dataclasses
import types

import pytest
import torch

from hpf.cli.job import step_flops
from hpf.models import MODELS, SPECS, ModelSpec, gpt, layout, spec_of, tp_sizes
from hpf.mesh import Mesh
from hpf.models.synthetic import global_batch


def test_each_built_in_module_declares_the_spec_the_registry_names():
    assert {name: spec_of(module) for name, module in MODELS.items()} == SPECS
    assert all(spec.name == name and isinstance(spec, ModelSpec) for name, spec in SPECS.items())
    assert [n for n, s in SPECS.items() if s.experts] == ["moe"] and SPECS["moe"].balancer is MODELS["moe"].Balancer


@pytest.mark.parametrize("name", ["gpt", "llama", "moe"])
def test_the_one_loss_signature_gives_each_models_own_loss_bitwise(name):
    module, spec = MODELS[name], SPECS[name]
    config = spec.configs["tiny"]
    params = spec.init(config)
    tokens = global_batch(config, 2, 0, 0)
    batch = module.batch_with_bias(tokens, torch.zeros(config.n_experts)) if name == "moe" else tokens
    assert torch.equal(spec.loss(config, recompute="none")(params, batch), module.loss_for(config)(params, batch))


def test_a_dense_model_refuses_an_expert_axis_by_name():
    with pytest.raises(ValueError, match="no experts"):
        SPECS["gpt"].loss(gpt.CONFIGS["tiny"], ep_axis="dp")


def test_a_model_without_param_specs_runs_unsplit_and_says_it_cannot_run_tensor_parallel():
    mine = dataclasses.replace(SPECS["gpt"], name="mine", param_specs=None)
    config = mine.configs["tiny"]
    assert tp_sizes(mine, config, Mesh({"dp": 4})) == [1] and tp_sizes(gpt, config, Mesh({"dp": 4})) != [1]
    assert layout(mine, config, ("dp",)) == (None, None)
    with pytest.raises(ValueError, match="model mine has no param_specs .*tensor parallel"):
        layout(mine, config, ("dp", "tp"), tp=2)


def test_a_model_without_unit_flops_counts_two_flops_per_param_per_token():
    mine = dataclasses.replace(SPECS["gpt"], name="mine", unit_flops=None)
    config = mine.configs["tiny"]
    assert step_flops(mine, config, 4) == 6.0 * mine.num_params(config) * 4 * config.seq_len
    assert step_flops(gpt, config, 4) == 3.0 * sum(gpt.unit_flops(config, 4).values())


def test_a_module_without_a_spec_is_refused_with_what_to_declare():
    with pytest.raises(TypeError, match="SPEC = ModelSpec"):
        spec_of(types.ModuleType("mine"))


def test_hpf_plan_reads_a_users_spec_and_names_the_field_it_lacks(monkeypatch, capsys):
    from hpf import cli
    mine = dataclasses.replace(SPECS["gpt"], name="mine", unit_psums=None)
    monkeypatch.setitem(MODELS, "gpt", mine)  # (the parsers' --model choices are fixed at import)
    assert cli.main(["plan", "--model", "gpt", "--config", "tiny", "--world-size", "2"]) == 0
    assert "gpt 'tiny'" in capsys.readouterr().out
    assert cli.main(["plan", "--model", "gpt", "--config", "tiny", "--mesh", "dp=1,tp=2"]) != 0
    assert "model mine has no unit_psums in its ModelSpec" in capsys.readouterr().err
