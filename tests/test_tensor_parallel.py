"""Megatron tensor parallelism in the built-in models, composed with FSDP: heads and MLP columns
split over a ``tp`` axis, the row-parallel products summed over it, each weight stored
FSDP-sharded over the data axes. Every run is checked against plain torch autograd on the whole
model in one process; checkpoints move between tp sizes by each param's place."""
import functools

import pytest
import torch

import hpf
from hpf import random as R
from hpf.launcher import RankError, launch
from hpf.models import gpt, llama, moe, specs_for
from hpf.step import step_plan
from references import adamw_training

# head counts and widths the tp axis divides
MODELS = {"gpt": (gpt, gpt.GPTConfig(67, 16, 24, 3, 4, 38)),
          "llama": (llama, llama.LlamaConfig(vocab_size=67, seq_len=16, d_model=24, n_layers=3, n_heads=4,
                                             n_kv_heads=2, d_ff=38))}
BATCH, STEPS, LR = 8, 20, 1e-2


def _step(name, mesh, two_tier=False):
    module, config = MODELS[name]
    data = tuple(a for a in mesh.axis_names if a != "tp")
    return hpf.shard_step(module.loss_for(config, tp_axis="tp"), mesh=mesh, optimizer=hpf.optim.adamw(lr=LR),
                          param_specs=module.param_specs(config, "tp", data), fsdp_axes=data,
                          topology=hpf.Topology() if two_tier else None)


def _train(rank, axes, two_tier, root):
    """Both models for STEPS steps on this mesh; the last tp=2 x dp=2 run saves its state."""
    mesh, out = hpf.Mesh(axes), {}
    data = tuple(a for a in mesh.axis_names if a != "tp")
    index, readers = mesh.group_index(data, rank), mesh.axis_size(data)
    rows = BATCH // readers
    for name, (module, config) in MODELS.items():
        with _step(name, mesh, two_tier) as step:
            state = step.init(functools.partial(module.init, config), key=R.key(0))
            losses = []
            for s in range(STEPS):
                state, m = step(state, gpt.global_batch(config, BATCH, 0, s)[index * rows:(index + 1) * rows])
                losses.append(m["loss"])
            if root is not None:
                step.save(state, f"{root}/{name}")
            out[name] = (losses, step.full_params(state))
    return out


@functools.lru_cache(maxsize=None)
def _reference(name):
    module, config = MODELS[name]
    return adamw_training(module.loss_for(config), module.init(config, R.key(0)),
                          lambda s: gpt.global_batch(config, BATCH, 0, s), STEPS, lr=LR)


@pytest.mark.slow
@pytest.mark.parametrize("axes, two_tier", [({"tp": 2}, False), ({"dp": 2, "tp": 2}, False),
                                            ({"node": 2, "tp": 2}, True)], ids=["tp2", "dp2xtp2", "two-tier"])
def test_tensor_parallel_training_equals_one_process(axes, two_tier, tmp_path):
    root = str(tmp_path) if "dp" in axes else None
    world = 1
    for n in axes.values():
        world *= n
    runs = launch(_train, world, axes, two_tier, root, timeout=280)
    for name in MODELS:
        want_losses, _, want_params = _reference(name)
        for got in runs:  # every rank reports the global loss
            # the same fp32 math, its sums split over ranks: a few ulps a step (1e-5 relative after 20)
            torch.testing.assert_close(torch.tensor(got[name][0]), torch.tensor(want_losses), rtol=1e-5, atol=0)
        for path, x in zip(*hpf.tree.flatten(runs[0][name][1])[:2]):
            torch.testing.assert_close(x, want_params[path], rtol=0, atol=LR * 5e-3, msg=path)  # (test_topology's bound)
    if root is None:
        return
    for name, (module, config) in MODELS.items():  # the tp=2 checkpoint onto tp=1 and onto dp=4: every element
        saved = runs[0][name][1]
        assert _same(hpf.checkpoint.load_params(f"{root}/{name}"), saved)
        assert launch(_restore_on_dp4, 4, name, f"{root}/{name}", timeout=200) == [True] * 4


def _restore_on_dp4(rank, name, path):
    module, config = MODELS[name]
    step = hpf.shard_step(module.loss_for(config), mesh=hpf.Mesh({"dp": 4}), optimizer=hpf.optim.adamw(lr=LR))
    with step:
        step.init(module.init(config, device="meta"))
        state, _ = step.restore(path)
        return _same(step.full_params(state), hpf.checkpoint.load_params(path))


def _same(a, b) -> bool:
    la, lb = hpf.tree.flatten(a)[1], hpf.tree.flatten(b)[1]
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


def test_the_plan_splits_heads_and_mlp_columns_and_stores_them_fsdp_sharded():
    module, config = MODELS["llama"]
    mesh = hpf.Mesh({"dp": 2, "tp": 2})
    plan = step_plan(module.init(config, device="meta"), mesh, module.param_specs(config, "tp", ("dp",)),
                     fsdp_axes=("dp",))
    d, hd = config.d_model, config.head_dim
    shapes = {p: s.local_shape for p, s in plan.slots.items()}
    assert shapes["blocks/0/wq"] == (config.n_heads * hd // 2, d) and shapes["blocks/0/wk"] == (hd, d)
    assert shapes["blocks/0/wo"] == (d, config.n_heads * hd // 2) and shapes["blocks/0/w_down"] == (d, 19)
    assert shapes["embed"] == (config.vocab_size, d)  # replicated over tp
    assert {b.shard_axes for b in plan.buckets} == {("dp",)}
    assert {b.split_axes for b in plan.buckets} == {(), ("tp",)}


def test_tensor_parallelism_is_refused_where_it_cannot_act():
    with pytest.raises(ValueError, match="expert parallelism instead"):
        specs_for(moe, moe.CONFIGS["tiny"], None, ("dp",), "tp")
    with pytest.raises(ValueError, match="one of the data axes"):
        gpt.param_specs(MODELS["gpt"][1], "dp", ("dp",))


def _odd_heads(rank):
    config = gpt.GPTConfig(67, 16, 30, 2, 5, 36)  # 5 heads of 6: every dim splits over 2, the heads do not
    mesh = hpf.Mesh({"tp": 2})
    step = hpf.shard_step(gpt.loss_for(config, tp_axis="tp"), mesh=mesh, optimizer=hpf.optim.adamw(lr=LR),
                          param_specs=gpt.param_specs(config, "tp", ()), fsdp_axes=())
    with step:
        state = step.init(functools.partial(gpt.init, config), key=R.key(0))
        step(state, gpt.global_batch(config, 2, 0, 0))


@pytest.mark.slow
def test_a_tp_size_that_splits_a_head_is_a_named_error():
    with pytest.raises(RankError, match="splits the 5 heads of w_qkv mid-head"):
        launch(_odd_heads, 2, timeout=120)
