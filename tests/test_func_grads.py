"""grad="torch.func": the same training as grad="autograd" and as plain single-process torch,
at FSDP memory (blocks rematerialized through ``UnitList.apply``), on every model in hpf.models.

One launched 2-rank run; the tests compare what it returned. The two grad modes run the same
ops in the same order (a rematerialized block recomputes its forward bit for bit), so they
agree to the last bit on the CPU; the reference tolerances are test_step's.
"""
import dataclasses

import numpy as np
import pytest
import torch

import hpf
from hpf.launcher import launch
from hpf.models import gpt, llama, moe
from references import adamw_training

STEPS, BATCH, SEED = 3, 8, 0
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MODELS = {"gpt": (gpt, dataclasses.replace(gpt.CONFIGS["tiny"], n_layers=5)),  # 5 blocks: "at most 2" means something
          "llama": (llama, llama.CONFIGS["tiny"]), "moe": (moe, moe.CONFIGS["tiny"])}

pytestmark = pytest.mark.slow


def train(rank, model, grad, **kwargs):
    module, config = MODELS[model]
    compile = kwargs.pop("compile", False)
    mesh, loss_fn = hpf.Mesh({"dp": 2}), module.loss_for(config, compile=compile)
    if kwargs.pop("ep", False):  # experts split over the ranks: all-to-alls inside the blocks
        mesh, loss_fn = hpf.Mesh({"dp": 1, "ep": 2}), module.loss_for(config, "ep")
        kwargs["param_specs"] = module.param_specs(config, "ep", ("dp", "ep"))
    step = hpf.shard_step(loss_fn, mesh=mesh, grad=grad, optimizer=hpf.optim.adamw(**ADAMW), **kwargs)
    state = step.init(module.init(config, hpf.random.key(SEED)))
    batches = module.synthetic_batches(config, BATCH, SEED, rank=rank, world_size=2)
    losses = []
    for _ in range(STEPS):
        state, m = step(state, next(batches))
        losses.append(m["loss"])
    return {"losses": losses, "params": [p.numpy() for p in hpf.tree.flatten(step.full_params(state))[1]],
            "peak_blocks": step.stats().peak_blocks}


def rank_checks(rank):
    out = {f"{m}/{g}": train(rank, m, g) for m in MODELS for g in ("autograd", "torch.func")}
    out["gpt/torch.func/bf16"] = train(rank, "gpt", "torch.func", mixed_precision="bf16")
    out["gpt/autograd/bf16"] = train(rank, "gpt", "autograd", mixed_precision="bf16")
    out["gpt/torch.func/compiled"] = train(rank, "gpt", "torch.func", compile=True)
    out["gpt/torch.func/accumulate"] = train(rank, "gpt", "torch.func", accumulate=2)
    out["gpt/autograd/accumulate"] = train(rank, "gpt", "autograd", accumulate=2)
    out["moe/torch.func/ep"] = train(rank, "moe", "torch.func", ep=True)
    out["moe/autograd/ep"] = train(rank, "moe", "autograd", ep=True)
    return out


@pytest.fixture(scope="module")
def runs():
    return launch(rank_checks, 2, timeout=280)[0]


def assert_same(a, b, **tol):
    np.testing.assert_allclose(a["losses"], b["losses"], **tol)
    for x, y in zip(a["params"], b["params"]):
        np.testing.assert_allclose(x, y, **tol)


def test_torch_func_trains_gpt_like_plain_torch(runs):
    module, config = MODELS["gpt"]
    losses, _, params = adamw_training(module.loss_for(config), module.init(config, hpf.random.key(SEED)),
                                       lambda s: module.global_batch(config, BATCH, SEED, s), STEPS, **ADAMW)
    assert_same(runs["gpt/torch.func"], {"losses": losses, "params": [p.numpy() for p in params.values()]},
                rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("model", list(MODELS))
def test_torch_func_equals_autograd(runs, model):
    assert_same(runs[f"{model}/torch.func"], runs[f"{model}/autograd"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", ["gpt/bf16", "gpt/accumulate", "moe/ep"])
def test_torch_func_equals_autograd_with(runs, case):
    model, variant = case.split("/")
    assert_same(runs[f"{model}/torch.func/{variant}"], runs[f"{model}/autograd/{variant}"], rtol=1e-6, atol=1e-7)


def test_torch_func_with_compiled_blocks_equals_eager(runs):
    assert_same(runs["gpt/torch.func/compiled"], runs["gpt/torch.func"], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("model", list(MODELS))
def test_torch_func_keeps_at_most_two_units_gathered(runs, model):
    """FSDP memory: a rematerialized block keeps nothing of its unit for backward."""
    assert runs[f"{model}/torch.func"]["peak_blocks"] <= 2
