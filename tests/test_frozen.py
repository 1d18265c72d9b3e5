"""Frozen params (issue 28, item 3): a param with ``requires_grad=False`` (once some param
requires grad, as in torch), or one named by ``frozen=``, gets no grad, no update, no optimizer
state and no reduction traffic. Checked against plain torch, which leaves such a param alone.
"""
import pytest
import torch

import hpf
from hpf.launcher import launch
from hpf.models import gpt
from hpf.report import PlanReport
from references import adamw_training
from toy_models import lm_batch, lm_loss, lm_params

STEPS = 3
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
FROZEN = ("embed", "blocks/1/b")
batch_of, loss_fn = lm_batch, lm_loss


def init(freeze_by_flag=True):
    params = lm_params(n_blocks=3)
    if freeze_by_flag:  # torch's habit: trainable leaves require grad, the frozen embedding does not
        for x in hpf.tree.flatten(params)[1]:
            x.requires_grad_()
        params["embed"].requires_grad_(False)
        params["blocks"][1]["b"].requires_grad_(False)  # a frozen leaf inside a block unit too
    return params


def torch_reference():
    losses, _, params = adamw_training(loss_fn, init(freeze_by_flag=False), batch_of, STEPS,
                                       trainable=lambda path: path not in FROZEN, **ADAMW)
    return losses, params


def _train(rank, how, optimizer="adamw"):
    params = init(freeze_by_flag=how == "flag")
    opt = hpf.optim.adamw(**ADAMW) if optimizer == "adamw" else hpf.optim.muon(lr=0.02)
    extra = {"frozen": "|".join(FROZEN)} if how == "option" else {}
    step = hpf.shard_step(loss_fn, mesh=hpf.Mesh({"dp": 2}), optimizer=opt, **extra)
    state = step.init(params)
    losses = []
    for s in range(STEPS):
        state, m = step(state, batch_of(s, rank, 2))
        losses.append(m["loss"])
    state_numels = [t.numel() for b, t in zip(step.plan.buckets, state.opt_state.exp_avg) if b.frozen]
    paths, leaves, _ = hpf.tree.flatten(step.full_params(state))
    return losses, dict(zip(paths, leaves)), state_numels


@pytest.mark.slow
def test_frozen_params_stay_fixed_and_the_rest_train_like_plain_torch():
    ref_losses, ref_params = torch_reference()
    start = init()
    for how in ("flag", "option"):
        losses, params, state_numels = launch(_train, 2, how, timeout=120)[0]
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
        for path, want in ref_params.items():
            torch.testing.assert_close(params[path], want, rtol=0, atol=1e-5, msg=lambda m: f"{how} {path}: {m}")
        assert torch.equal(params["embed"], start["embed"]) and torch.equal(params["blocks/1/b"], start["blocks"][1]["b"])
        assert state_numels and all(n == 0 for n in state_numels), "frozen buckets keep no optimizer state"
    losses, params, state_numels = launch(_train, 2, "flag", "muon", timeout=120)[0]
    assert torch.equal(params["embed"], start["embed"]) and all(n == 0 for n in state_numels)
    assert not torch.equal(params["head"], start["head"]), "Muon's AdamW part still trains the head"


def test_a_tree_of_plain_tensors_trains_every_leaf():
    plan = hpf.shard_step(loss_fn, mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw())
    plan.init(init(freeze_by_flag=False))
    assert not any(b.frozen for b in plan.plan.buckets)


def test_frozen_buckets_send_no_reduction_bytes_in_the_plan_report():
    config = gpt.CONFIGS["small"]
    params = gpt.init(config, device="meta")
    mesh = hpf.Mesh({"node": 2, "local": 2})
    none = PlanReport.of(hpf.plan(params, mesh))
    frozen = PlanReport.of(hpf.plan(params, mesh, frozen={"embed"}))
    embed_bytes = config.vocab_size * config.d_model * 4
    assert none.comm["all_gather"] == frozen.comm["all_gather"]  # still gathered for compute
    saved = sum(none.comm["reduce_scatter"].values()) - sum(frozen.comm["reduce_scatter"].values())
    assert saved == pytest.approx(embed_bytes * 3 / 4, rel=1e-3)  # (n-1)/n of it, per rank
    assert none.optimizer_bytes - frozen.optimizer_bytes == pytest.approx(embed_bytes * 2 / 4, rel=1e-2)


def test_frozen_option_is_checked():
    with pytest.raises(TypeError, match="frozen=3"):
        step = hpf.shard_step(loss_fn, mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw(), frozen=3)
        step.init(init(freeze_by_flag=False))


def test_a_frozen_pattern_naming_only_the_alias_of_a_tie_freezes_the_tie():
    """``head`` is the same tensor as ``embed`` (tied): freezing it by its alias path freezes
    the one tensor (it used to train, without a word)."""
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(6, 4, generator=g)
    params = {"embed": embed, "w": torch.randn(4, 4, generator=g), "head": embed}

    def loss(p, b):
        return ((b @ p["embed"] @ p["w"] @ p["head"].T) ** 2).mean()
    step = hpf.shard_step(loss, mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw(lr=0.1), frozen="head")
    state = step.init(params)
    state, _ = step(state, torch.randn(3, 6, generator=g))
    full = step.full_params(state)
    assert torch.equal(full["embed"], embed) and torch.equal(full["head"], embed)
    assert not torch.equal(full["w"], params["w"])
