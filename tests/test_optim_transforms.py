"""Optimizers as composed stages (hpf.optim.transforms: init/update, chain, partition,
inject_hyperparams) and capabilities declared as data (hpf.optim.Capabilities): against plain
torch on the full model, in process; a user's chain under shard_step on 2 ranks."""
from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

import hpf
from hpf.launcher import launch
from hpf.models import gpt
from hpf.optim import as_optimizer, inject_hyperparams, partition, scale_by_muon
from hpf.optim.transforms import Hyper, add_decayed_weights, chain, clip_by_global_norm, inject, scale_by_adam

TINY = gpt.CONFIGS["tiny"]


def test_adamw_is_its_chain_of_stages_bit_for_bit_and_torchs_arithmetic():
    g = torch.Generator().manual_seed(0)
    p0, grads = [torch.randn(7, generator=g), torch.randn(3, 4, generator=g)], []
    opt = hpf.optim.adamw(lr=hpf.optim.lr_schedules.cosine(1e-2, 5, warmup=1), weight_decay=0.1)
    mine = [p.clone() for p in p0]
    state = opt.init(mine)
    by_hand = [p.clone() for p in p0]
    m, v = [torch.zeros_like(p) for p in p0], [torch.zeros_like(p) for p in p0]
    ref = [p.clone().requires_grad_() for p in p0]
    torch_opt = torch.optim.AdamW(ref, lr=1.0, weight_decay=0.1, foreach=True)
    stages = chain(add_decayed_weights(0.1), scale_by_adam((0.9, 0.999), 1e-8))
    for step in range(1, 5):
        grads = [torch.randn(p.shape, generator=g) for p in p0]
        opt.update(grads, state, mine)
        h = inject(opt.lr, step)
        stages.update(grads, {"exp_avg": m, "exp_avg_sq": v}, by_hand, h)
        for group in torch_opt.param_groups:
            group["lr"] = h.lr
        for r, gr in zip(ref, grads):
            r.grad = gr.clone()
        torch_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(mine, by_hand))
    torch.testing.assert_close(mine, [r.detach() for r in ref], rtol=1e-6, atol=1e-7)


def test_clipping_is_a_stage_whose_factor_the_step_folds_in():
    clip = clip_by_global_norm(1.0)
    assert clip.factor(0.5) == 1.0 and clip.factor(4.0) == 1.0 / (4.0 + 1e-6)


def test_capabilities_are_declared_not_probed():
    class HasMethodsOnly:  # partial_update and for_plan without declaring them: the step uses neither
        def init(self, params):
            return ()

        def update(self, grads, state, params):
            return params, state

        def partial_update(self, state, params):
            raise AssertionError

        def for_plan(self, plan, rank):
            raise AssertionError

    assert hpf.optim.capabilities(HasMethodsOnly()) == hpf.optim.Capabilities()
    with pytest.raises(TypeError, match="HasMethodsOnly has partial_update, for_plan but declares no capabilities"):
        hpf.shard_step(lambda p, b: p["w"].sum(), mesh=hpf.Mesh({"dp": 1}), optimizer=HasMethodsOnly())
    assert hpf.optim.capabilities(hpf.optim.adamw()).partial
    muon = hpf.optim.muon(qk_clip=10.0, qk_heads={})
    assert hpf.optim.capabilities(muon).for_plan and hpf.optim.capabilities(muon).aux == ("max_attn_logit",)


# -- the general transform shape: init/update, chains users compose, schedules injected ----------


def user_chain(max_norm, lr, weight_decay=0.1, betas=(0.9, 0.95)):
    """What a user writes, optax style: clip, decay, Adam, with the lr (or a schedule) injected."""
    return inject_hyperparams(chain(clip_by_global_norm(max_norm), add_decayed_weights(weight_decay),
                                    scale_by_adam(betas)), lr=lr)


def test_chain_init_and_update_are_the_stages_in_order():
    t = chain(clip_by_global_norm(1.0), add_decayed_weights(0.5), scale_by_adam())
    params = [torch.ones(3), torch.full((2, 2), 2.0)]
    state = t.init(params)
    assert list(state) == ["exp_avg", "exp_avg_sq"] and all(torch.equal(x, torch.zeros_like(p))
                                                                  for x, p in zip(state["exp_avg"], params))
    grads = [torch.tensor([3.0, 0.0, 0.0]), torch.tensor([[0.0, 4.0], [0.0, 0.0]])]  # norm 5: the clip scales by 1/5
    want = [p.clone() for p in params]
    scaled = [g / (5.0 + 1e-6) for g in grads]
    torch._foreach_mul_(want, 1.0 - 0.1 * 0.5)
    m = [0.1 * g for g in scaled]
    v = [0.001 * g * g for g in scaled]
    for w, mi, vi in zip(want, m, v):
        w.addcdiv_(mi, vi.sqrt() / math.sqrt(0.001) + 1e-8, value=-0.1 / 0.1)
    updates, state = t.update(grads, state, params, Hyper(1, 0.1))
    torch.testing.assert_close(updates, scaled)  # what the next stage would read: the clipped grads
    torch.testing.assert_close(params, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(state["exp_avg"], m)
    assert torch.equal(grads[0], torch.tensor([3.0, 0.0, 0.0])), "the clip returns new updates; the caller's grads stay"


def test_an_injected_schedule_is_what_each_step_sees():
    sched = hpf.optim.lr_schedules.cosine(1e-2, 6, warmup=2)
    seen = []

    class Record(hpf.optim.Transform):
        def update(self, grads, state, params, hyper):
            seen.append(hyper)
            return grads, state

    opt = as_optimizer(chain(Record(), inject_hyperparams(Record(), lr=lambda s: 10.0 * s)))
    opt = as_optimizer(inject_hyperparams(opt.transform, lr=sched))
    params = [torch.zeros(2)]
    state = opt.init(params)
    for _ in range(3):
        opt.update([torch.ones(2)], state, params)
    assert seen == [Hyper(1, sched(1)), Hyper(1, 10.0), Hyper(2, sched(2)), Hyper(2, 20.0), Hyper(3, sched(3)),
                    Hyper(3, 30.0)], "an inner inject_hyperparams overrides the outer one for its part"
    assert int(state.count) == 3 and state._fields == ("count",)
    with pytest.raises(ValueError, match="lr schedule .* step 4"):
        as_optimizer(inject_hyperparams(Record(), lr=lambda s: -1.0 if s == 4 else 1.0)).update(
            [torch.ones(2)], state, params)
    assert int(state.count) == 3, "a bad schedule value raises before the step changes anything"


def torch_reference(steps, sched, max_norm):
    """Plain torch on the full GPT tiny: clip_grad_norm_, AdamW (betas 0.9, 0.95, wd 0.1), LambdaLR."""
    params = gpt.init(TINY, hpf.random.key(3))
    leaves = [x.requires_grad_() for x in hpf.tree.flatten(params)[1]]
    opt = torch.optim.AdamW(leaves, lr=1.0, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    lr = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: sched(epoch + 1))
    grads = []
    for s in range(steps):
        loss = gpt.loss_for(TINY)(params, gpt.global_batch(TINY, 8, 0, s))
        opt.zero_grad()
        loss.backward()
        grads.append([x.grad.clone() for x in leaves])
        torch.nn.utils.clip_grad_norm_(leaves, max_norm)
        opt.step()
        lr.step()
    return [x.detach() for x in leaves], grads


def test_a_user_chain_matches_plain_torch_on_the_full_model():
    sched = hpf.optim.lr_schedules.cosine(1e-2, 6, warmup=2)
    want, grads = torch_reference(6, sched, max_norm=0.5)
    opt = user_chain(0.5, sched)
    params = hpf.tree.flatten(gpt.init(TINY, hpf.random.key(3)))[1]
    state = as_optimizer(opt).init(params)
    assert min(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in gs]))) for gs in grads) > 0.5, \
        "the clip must act on every step for this test to mean anything"
    for gs in grads:  # (the reference's own pre-clip grads: the optimizers alone are compared)
        as_optimizer(opt).update(gs, state, params)
    # torch takes the clip factor as an fp32 tensor, hpf as a float64 rounded once: the clipped
    # grads differ by an ulp (6e-8 relative); Adam's m / sqrt(v) passes that on at about its
    # size, so after 6 steps of lr <= 1e-2 the params differ by a few ulps of the update. Any
    # real difference (a stage missing, out of order, the wrong lr) moves them by O(lr * 1e-1).
    torch.testing.assert_close(params, want, rtol=1e-6, atol=1e-7)


def muon_by_hand(wd=0.01, awd=0.05, lr=0.02, alr=1e-3):
    """hpf.optim.muon's stages composed by a user: a partition of matrices and the rest."""
    reference = hpf.optim.muon(lr=lr, adamw_lr=alr, weight_decay=wd, adamw_weight_decay=awd)
    return reference, partition(
        {"muon": inject_hyperparams(chain(add_decayed_weights(wd), scale_by_muon()), lr=lr),
         "adamw": inject_hyperparams(chain(add_decayed_weights(awd), scale_by_adam((0.9, 0.95))), lr=alr)},
        labels=lambda path, p: "muon" if p.ndim >= 2 and not hpf.optim.muon_optimizer.default_use_adamw(path, p)
        else "adamw")


def test_muon_is_its_partition_of_stages_bit_for_bit():
    muon, by_hand = muon_by_hand()
    ours, theirs = gpt.init(TINY, hpf.random.key(4)), gpt.init(TINY, hpf.random.key(4))
    s1, opt = muon.init(ours), as_optimizer(by_hand)
    s2 = opt.init(theirs)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        grads = hpf.tree.map_with_path(lambda _, x: torch.randn(x.shape, generator=g), ours)
        muon.update(grads, s1, ours)
        opt.update(grads, s2, theirs)
    assert all(torch.equal(a, b) for a, b in zip(hpf.tree.flatten(ours)[1], hpf.tree.flatten(theirs)[1]))
    for field in ("exp_avg", "exp_avg_sq"):  # the same fields, leaf for leaf (empty: a Muon matrix's second moment)
        a, b = hpf.tree.flatten(getattr(s1, field))[1], hpf.tree.flatten(getattr(s2, field))[1]
        assert all(torch.equal(x, y) for x, y in zip(a, b)), field
    assert any(x.numel() == 0 for x in hpf.tree.flatten(s1.exp_avg_sq)[1])


def test_muon_stages_equal_the_muon_functions_they_wrap():
    """scale_by_muon is muon_direction then apply_muon_updates_, the code Muon ran before stages."""
    from hpf.optim.muon_math import apply_muon_updates_, muon_direction
    g = torch.Generator().manual_seed(6)
    mats = [torch.randn(8, 4, generator=g), torch.randn(3, 5, 6, generator=g)]
    grads = [torch.randn(m.shape, generator=g) for m in mats]
    a, b = [m.clone() for m in mats], [m.clone() for m in mats]
    bufs_a, bufs_b = [torch.zeros_like(m) for m in mats], [torch.zeros_like(m) for m in mats]
    chain(add_decayed_weights(0.1), scale_by_muon()).update(grads, {"exp_avg": bufs_a}, a, Hyper(1, 0.02))
    d = muon_direction(grads, bufs_b, momentum=0.95, nesterov=True)
    apply_muon_updates_(b, d, lr=0.02, weight_decay=0.1, scale="keller")
    assert all(torch.equal(x, y) for x, y in zip(a + bufs_a, b + bufs_b))


def test_misuse_names_the_stage_the_param_and_the_fix():
    with pytest.raises(ValueError, match="ScaleByAdam and ScaleByAdam both keep state 'exp_avg'"):
        chain(scale_by_adam(), scale_by_adam())
    with pytest.raises(ValueError, match="scale_by_adam needs a learning rate.*inject_hyperparams"):
        as_optimizer(scale_by_adam()).update([torch.ones(1)], as_optimizer(scale_by_adam()).init([torch.ones(1)]),
                                             [torch.ones(1)])
    with pytest.raises(ValueError, match="param 'b' is labelled 'x', which names no transform"):
        partition({"a": scale_by_adam()}, lambda path, p: "a" if path == "a" else "x").init(
            {"a": torch.ones(1), "b": torch.ones(1)})
    with pytest.raises(ValueError, match="more than one clip_by_global_norm"):
        chain(clip_by_global_norm(1.0), clip_by_global_norm(2.0))
    with pytest.raises(ValueError, match=r"max_grad_norm=1.0 and the optimizer's clip_by_global_norm\(0.5\)"):
        hpf.shard_step(lambda p, b: p["w"].sum(), mesh=hpf.Mesh({"dp": 1}), optimizer=user_chain(0.5, 1e-3),
                       max_grad_norm=1.0)
    with pytest.raises(TypeError, match="not a transform"):
        chain(hpf.optim.adamw())


def misplaced_rank(rank, which):
    """A stage that needs whole params, under shard_step: refused at init, with the fix."""
    opt = {"muon": inject_hyperparams(scale_by_muon(), lr=0.02),
           "partition": inject_hyperparams(partition({"m": scale_by_muon(), "a": scale_by_adam()},
                                                     lambda path, p: "m" if p.ndim == 2 else "a"), lr=0.02)}[which]
    step = hpf.shard_step(gpt.loss_for(TINY), mesh=hpf.Mesh({"dp": 2}), optimizer=opt)
    try:
        step.init(gpt.init(TINY))
    except ValueError as err:
        return str(err)
    finally:
        step.close()
    return "no error"


@pytest.mark.slow
@pytest.mark.parametrize("which, fix", [("muon", "use hpf.optim.muon"), ("partition", "'m' needs whole params")])
def test_stages_that_need_whole_params_are_refused_on_flat_shards(which, fix):
    assert all(fix in e for e in launch(misplaced_rank, 2, which))


def chain_rank(rank, which):
    """GPT tiny on 2 ranks: the user's chain (its clip's factor read by the step's decision), or
    hpf.optim.adamw with shard_step(max_grad_norm=...)."""
    adamw = hpf.optim.adamw(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    mask = hpf.optim.default_weight_decay_mask
    masked = hpf.optim.adamw(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, weight_decay_mask=mask)
    by_label = partition({"decay": chain(add_decayed_weights(0.1), scale_by_adam((0.9, 0.95))),
                          "keep": scale_by_adam((0.9, 0.95))}, lambda path, x: "decay" if mask(path, x) else "keep")
    kw = {"chain": dict(optimizer=user_chain(0.05, 1e-2)), "adamw": dict(optimizer=adamw, max_grad_norm=0.05),
          "unclipped": dict(optimizer=adamw), "masked": dict(optimizer=masked, max_grad_norm=0.05),
          "partition": dict(optimizer=inject_hyperparams(chain(clip_by_global_norm(0.05), by_label), lr=1e-2))}[which]
    step = hpf.shard_step(gpt.loss_for(TINY), mesh=hpf.Mesh({"dp": 2}), **kw)
    state = step.init(gpt.init(TINY, hpf.random.key(0)))
    losses = []
    for s in range(4):
        state, m = step(state, gpt.global_batch(TINY, 8, 0, s)[rank * 4:(rank + 1) * 4])
        losses.append(m["loss"])
    full = [p.clone() for p in hpf.tree.flatten(step.full_params(state))[1]]
    step.close()
    return losses, full


@pytest.mark.slow
def test_a_user_chain_under_shard_step_is_adamw_with_max_grad_norm_bit_for_bit():
    """The chain's clip stage folds into the step's one grad scale exactly as max_grad_norm does
    (tests/test_step.py checks that one against torch's clip_grad_norm_ and AdamW)."""
    chained, adamw, unclipped = (launch(chain_rank, 2, which)[0] for which in ("chain", "adamw", "unclipped"))
    assert chained[0] == adamw[0]
    assert all(torch.equal(a, b) for a, b in zip(chained[1], adamw[1]))
    assert chained[0][1:] != unclipped[0][1:], "the clip must act for this test to mean anything"


def test_a_stage_field_injected_as_a_schedule_is_its_value_each_step():
    wd = lambda step: 0.1 * step  # noqa: E731
    opt = as_optimizer(chain(inject_hyperparams(add_decayed_weights(0.0), weight_decay=wd), scale_by_adam()))
    opt = as_optimizer(inject_hyperparams(opt.transform, lr=0.5))
    params, by_hand = [torch.full((3,), 2.0)], [torch.full((3,), 2.0)]
    state = opt.init(params)
    m, v = [torch.zeros(3)], [torch.zeros(3)]
    for step in range(1, 4):
        g = [torch.full((3,), float(step))]
        opt.update(g, state, params)
        chain(add_decayed_weights(wd(step)), scale_by_adam()).update(g, {"exp_avg": m, "exp_avg_sq": v}, by_hand,
                                                                     Hyper(step, 0.5))
    assert torch.equal(params[0], by_hand[0])  # (with the injection ignored, weight decay 0: they differ)
    with pytest.raises(ValueError, match="Chain has no hyper-parameter 'weight_decay'; inject a stage's own field"):
        inject_hyperparams(chain(add_decayed_weights(0.1)), weight_decay=0.2)
    with pytest.raises(ValueError, match="max_norm is fixed"):
        inject_hyperparams(clip_by_global_norm(1.0), max_norm=lambda s: 2.0)
    with pytest.raises(ValueError, match="weight_decay schedule .* step 2"):
        bad = as_optimizer(inject_hyperparams(inject_hyperparams(add_decayed_weights(0.0), weight_decay=lambda s: 1.0
                                                                 if s < 2 else float("nan")), lr=0.1))
        st = bad.init([torch.ones(1)])
        for _ in range(2):
            bad.update([torch.ones(1)], st, [torch.ones(1)])


@pytest.mark.slow
def test_a_partition_runs_on_the_pieces_of_flat_shards_as_a_mask_does_bit_for_bit():
    """Under shard_step each label's transform runs on the pieces of its params (PlannedPartition),
    first units first (the step's partial update): decay for matrices, none for the rest, is
    exactly AdamW with the default decay mask."""
    by_label, masked, unmasked = (launch(chain_rank, 2, which)[0] for which in ("partition", "masked", "adamw"))
    assert by_label[0] == masked[0]
    assert all(torch.equal(a, b) for a, b in zip(by_label[1], masked[1]))
    assert not all(torch.equal(a, b) for a, b in zip(by_label[1], unmasked[1])), "the labels must matter"


def test_a_clip_inside_a_partition_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"put clip_by_global_norm before the partition"):
        partition({"a": chain(clip_by_global_norm(1.0), scale_by_adam())}, lambda path, p: "a")


def test_a_user_chain_state_checkpoints_by_its_field_names_and_resumes(tmp_path):
    def make():
        return hpf.shard_step(gpt.loss_for(TINY), mesh=hpf.Mesh({"dp": 1}), optimizer=user_chain(1.0, 1e-3))

    step = make()
    state = step.init(gpt.init(TINY, hpf.random.key(0)))
    for s in range(2):
        state, _ = step(state, gpt.global_batch(TINY, 4, 0, s))
    assert state.opt_state._fields == ("count", "exp_avg", "exp_avg_sq")
    step.save(state, tmp_path / "ck")
    other = make()
    other.init(gpt.init(TINY, device="meta"))
    restored, _ = other.restore(tmp_path / "ck")
    assert int(restored.opt_state.count) == 2
    for name in ("exp_avg", "exp_avg_sq"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(state.opt_state, name), getattr(restored.opt_state, name)))
    _, m = step(state, gpt.global_batch(TINY, 4, 0, 2))
    _, m2 = other(restored, gpt.global_batch(TINY, 4, 0, 2))
    assert m["loss"] == m2["loss"] and m["grad_norm"] == m2["grad_norm"]
    step.close()
    other.close()


# -- issue 55 items 13-15 --------------------------------------------------------------------------
def _fallback_params():
    g = torch.Generator().manual_seed(3)
    return {"embed": torch.randn(5, 4, generator=g), "w": torch.randn(4, 4, generator=g),
            "b": torch.randn(4, generator=g)}


def _fallback_loss(p, x):
    return ((x @ p["embed"].T)[:, :4] @ p["w"] + p["b"]).square().mean()


@pytest.mark.parametrize("where", ["one process", "shard_step"])
def test_muons_adamw_fallback_honours_its_weight_decay_mask(where):
    """Item 14: the params Muon leaves to AdamW decayed where weight_decay_mask says they must not.
    Reference: torch.optim.AdamW with weight decay on 'embed' only (the mask), bitwise."""
    mask = lambda path, t: path == "embed"  # noqa: E731
    opt = dataclasses.replace(hpf.optim.muon(lr=0.02), adamw=hpf.optim.adamw(1e-2, (0.9, 0.95), weight_decay=0.5,
                                                                            weight_decay_mask=mask))
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(4))
    ref = {k: v.clone().requires_grad_() for k, v in _fallback_params().items()}
    torch_opt = torch.optim.AdamW([{"params": [ref["embed"]], "weight_decay": 0.5},
                                   {"params": [ref["b"]], "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95), foreach=True)
    if where == "one process":
        params = _fallback_params()
        state = opt.init(params)
    else:
        step = hpf.shard_step(_fallback_loss, mesh=hpf.Mesh({"dp": 1}), optimizer=opt)
        state = step.init(_fallback_params())
    for _ in range(3):  # (the reference's Muon matrix follows ours: only the fallback is compared)
        with torch.no_grad():
            ref["w"].copy_(params["w"] if where == "one process" else step.full_params(state)["w"])
        if where == "one process":
            p = {k: v.detach().requires_grad_() for k, v in params.items()}
            grads = torch.autograd.grad(_fallback_loss(p, x), list(p.values()))
            opt.update(dict(zip(p, grads)), state, params)
        else:
            state, _ = step(state, x)
        _fallback_loss(ref, x).backward()
        torch_opt.step()
        torch_opt.zero_grad()
    got = params if where == "one process" else step.full_params(state)
    for k in ("embed", "b"):
        assert torch.equal(got[k], ref[k].detach()), k
    if where == "shard_step":
        step.close()


def test_a_checkpoint_records_the_chain_and_refuses_another_with_the_same_fields(tmp_path):
    """Item 14: a checkpoint named a user's chain only 'TransformOptimizer', so it restored into
    another chain with the same state fields without a word."""
    from hpf import checkpoint as ck

    decay_first = inject_hyperparams(chain(add_decayed_weights(0.1), scale_by_adam()), lr=1e-2)
    by_label = inject_hyperparams(partition({"a": chain(add_decayed_weights(0.1), scale_by_adam()), "b": scale_by_adam()},
                                            lambda path, x: "a" if x.ndim > 1 else "b"), lr=1e-2)
    relabelled = inject_hyperparams(partition({"a": chain(add_decayed_weights(0.1), scale_by_adam()),
                                               "b": scale_by_adam()}, lambda path, x: "a"), lr=1e-2)
    others = {"decay_first": inject_hyperparams(chain(scale_by_adam(), add_decayed_weights(0.1)), lr=1e-2),
              "by_label": relabelled}

    def step_with(t):
        return hpf.shard_step(_fallback_loss, mesh=hpf.Mesh({"dp": 1}), optimizer=t)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(4))
    for name, saved in (("decay_first", decay_first), ("by_label", by_label)):
        step = step_with(saved)
        state, _ = step(step.init(_fallback_params()), x)
        step.save(state, tmp_path / name)
        same = step_with(saved)  # the same chain restores
        restored, _ = same.restore(tmp_path / name, same.init(_fallback_params()))
        assert int(restored.opt_state.count) == 1
        other = step_with(others[name])
        with pytest.raises(ck.CheckpointError, match=r"saved with another optimizer chain: its stage .* this optimizer's is .*build the optimizer with the same chain"):
            other.restore(tmp_path / name, other.init(_fallback_params()))
        for s in (step, same, other):
            s.close()


def _decay_partition(mask, wd=lambda s: 0.1):
    inner = chain(scale_by_adam(), inject_hyperparams(add_decayed_weights(0.0, mask=mask), weight_decay=wd))
    return inject_hyperparams(partition({"m": inner, "v": scale_by_adam()}, lambda path, x: "m" if x.ndim > 1 else "v"),
                              lr=1e-2)


@pytest.mark.parametrize("where", ["one process", "shard_step"])
def test_an_injected_masked_decay_inside_a_partition_trains_and_a_failed_step_changes_nothing(where):
    """Item 15: inject_hyperparams(add_decayed_weights(0.0, mask=fn), weight_decay=schedule) in a
    partition failed ("needs the params' paths") after scale_by_adam had changed layers/0/w.
    The masked chain is the unmasked one where the mask picks every param of its label (bitwise)."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(4))
    grads = [{k: torch.randn(v.shape, generator=torch.Generator().manual_seed(i)) for k, v in _fallback_params().items()}
             for i in range(3)]

    def train(t, steps=3, fails=None):
        """The full params after ``steps`` steps (the last may fail with ``fails``: the params then)."""
        step = None
        if where == "one process":
            opt = as_optimizer(t)
            params = _fallback_params()
            state = opt.init(params)
        else:
            step = hpf.shard_step(_fallback_loss, mesh=hpf.Mesh({"dp": 1}), optimizer=t)
            state = step.init(_fallback_params())
        for i in range(steps):
            with pytest.raises(ValueError, match=fails) if fails and i == steps - 1 else contextlib.nullcontext():
                if step is None:
                    opt.update(grads[i], state, params)
                else:
                    state, _ = step(state, x)
        if step is None:
            return params
        full = step.full_params(state)
        step.close()
        return full
    masked, unmasked = train(_decay_partition(lambda path, t: t.ndim > 1)), train(_decay_partition(None))
    assert all(torch.equal(masked[k], unmasked[k]) for k in masked)
    assert not torch.equal(masked["w"], train(_decay_partition(lambda path, t: False))["w"]), "the decay must act"
    # a step whose injected decay is bad fails before scale_by_adam, before it, changes anything
    bad = _decay_partition(lambda path, t: t.ndim > 1, wd=lambda s: 0.1 if s < 3 else float("nan"))
    failed, two = train(bad, 3, fails=r"weight_decay schedule .* step 3"), train(bad, 2)
    assert all(torch.equal(failed[k], two[k]) for k in two)


class _TrustRatio(hpf.optim.transforms.Transform):
    """A LARS-style stage: each param's update scaled by ||p|| / ||g|| (a per-param norm: not elementwise)."""

    elementwise = False

    def update(self, grads, state, params, hyper):
        for p, g in zip(params, grads):
            p.add_(g, alpha=-hyper.rate("trust") * float(p.norm() / (g.norm() + 1e-12)))
        return grads, state


def test_a_non_elementwise_user_transform_is_refused_by_name_under_shard_step():
    """Item 13: a transform declared elementwise=False ran under shard_step on flat pieces that mix
    params (params 0.18 off after 3 steps, no error). One process, on whole params, it runs."""
    t = inject_hyperparams(chain(clip_by_global_norm(1.0), _TrustRatio()), lr=1e-2)
    params = _fallback_params()
    opt = as_optimizer(t)
    opt.update({k: torch.ones_like(v) for k, v in params.items()}, opt.init(params), params)  # whole params: fine
    for wrapped in (t, partition({"a": _TrustRatio(), "b": scale_by_adam()}, lambda path, x: "a")):
        step = hpf.shard_step(_fallback_loss, mesh=hpf.Mesh({"dp": 1}), optimizer=wrapped)
        with pytest.raises(ValueError, match=r"(_TrustRatio declares elementwise=False|'a' needs whole params)"):
            step.init(_fallback_params())
        step.close()
