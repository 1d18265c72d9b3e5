"""Optimizer math as composed stages (hpf.optim.transforms) and capabilities declared as data
(hpf.optim.Capabilities). In process, no ranks."""
from __future__ import annotations

import pytest
import torch

import hpf
from hpf.optim.transforms import add_decayed_weights, chain, clip_by_global_norm, inject, scale_by_adam


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
        stages.apply(h, by_hand, grads, {"exp_avg": m, "exp_avg_sq": v}, by_hand)
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
