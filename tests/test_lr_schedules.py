"""LR schedules and AdamW's weight-decay mask against torch.optim.AdamW with a no-decay param
group and torch.optim.lr_scheduler.LambdaLR."""
import math

import pytest
import torch

import hpf
from hpf.models import gpt, llama
from hpf.optim.lr_schedules import Schedule, constant, cosine, linear

LR, WD = 1e-2, 0.1
TINY = llama.CONFIGS["tiny"]


def test_schedule_values_by_hand():
    s = cosine(1.0, total_steps=12, warmup=2, min_lr=0.1)
    assert [s(1), s(2)] == [0.5, 1.0]  # linear warmup from lr/warmup
    assert s(7) == pytest.approx(0.55)  # halfway through the decay: (lr + min_lr) / 2
    assert s(12) == pytest.approx(0.1) and s(50) == pytest.approx(0.1)
    lin = linear(2.0, total_steps=5)
    assert [lin(k) for k in range(1, 7)] == pytest.approx([1.6, 1.2, 0.8, 0.4, 0.0, 0.0])
    assert [constant(3.0, warmup=3)(k) for k in (1, 3, 100)] == pytest.approx([1.0, 3.0, 3.0])
    with pytest.raises(ValueError, match="total_steps"):
        cosine(1.0, total_steps=5, warmup=5)
    with pytest.raises(ValueError, match="one of"):
        Schedule("exp", 1.0, 10)
    with pytest.raises(ValueError, match="from 1"):
        s(0)


def test_default_mask_decays_matrices_not_norms_or_embeddings():
    params = llama.init(TINY)
    paths, leaves, _ = hpf.tree.flatten(params)
    decayed = {p for p, x in zip(paths, leaves) if hpf.optim.default_weight_decay_mask(p, x)}
    assert decayed == {p for p in paths if p == "head" or p.split("/")[-1].startswith("w")}
    assert not hpf.optim.default_weight_decay_mask("embed", params["embed"])
    assert not hpf.optim.default_weight_decay_mask("pos", gpt.init(gpt.CONFIGS["tiny"])["pos"])


def run_both(kind, mask, steps=8):
    """hpf AdamW (schedule + mask) and torch AdamW (two groups + LambdaLR) on the same grads."""
    sched = Schedule(kind, LR, total_steps=steps, warmup=3, min_lr=1e-3)
    ours = llama.init(TINY, hpf.random.key(1))
    theirs = llama.init(TINY, hpf.random.key(1))
    paths, leaves, _ = hpf.tree.flatten(theirs)
    for x in leaves:
        x.requires_grad_(True)
    decay = {p for p, x in zip(paths, leaves) if hpf.optim.default_weight_decay_mask(p, x)}
    groups = [{"params": [x for p, x in zip(paths, leaves) if p in decay]},
              {"params": [x for p, x in zip(paths, leaves) if p not in decay], "weight_decay": 0.0}]
    torch_opt = torch.optim.AdamW(groups, lr=LR, weight_decay=WD, betas=(0.9, 0.95))
    torch_sched = torch.optim.lr_scheduler.LambdaLR(torch_opt, lambda epoch: sched(epoch + 1) / LR)
    opt = hpf.optim.adamw(lr=sched, weight_decay=WD, betas=(0.9, 0.95), weight_decay_mask=mask)
    state = opt.init(ours)
    data = gpt.synthetic_batches(TINY, 8, seed=2)
    for _ in range(steps):
        batch = next(data)
        loss = llama.loss_for(TINY)(theirs, batch)
        torch_opt.zero_grad()
        loss.backward()
        grads = hpf.tree.unflatten(hpf.tree.structure(theirs), [x.grad.clone() for x in leaves])
        torch_opt.step()
        torch_sched.step()
        ours, state = opt.update(grads, state, ours)
    return ours, theirs


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_schedule_and_mask_match_torch_param_groups_and_lambda_lr(kind):
    ours, theirs = run_both(kind, hpf.optim.default_weight_decay_mask)
    for path, a, b in zip(hpf.tree.paths(ours), hpf.tree.flatten(ours)[1], hpf.tree.flatten(theirs)[1]):
        # torch scales lr by the lambda (lr * (s/lr)): 1-ulp differences in lr, nothing more
        torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-7, msg=lambda m, p=path: f"{p}: {m}")


def test_pytree_mask_equals_callable_mask_and_none_decays_all():
    params = llama.init(TINY)
    as_tree = hpf.tree.map_with_path(hpf.optim.default_weight_decay_mask, params)
    by_tree, _ = run_both("cosine", as_tree, steps=4)
    by_fn, _ = run_both("cosine", hpf.optim.default_weight_decay_mask, steps=4)
    assert all(torch.equal(a, b) for a, b in zip(hpf.tree.flatten(by_tree)[1], hpf.tree.flatten(by_fn)[1]))
    decay_all, _ = run_both("cosine", None, steps=4)  # norms decay too: they move off the masked run
    assert not torch.equal(decay_all["norm"], by_fn["norm"])
    assert not torch.equal(decay_all["embed"], by_fn["embed"])
    with pytest.raises(ValueError, match="pytree of bools"):
        run_both("cosine", {"embed": True}, steps=4)


def test_cosine_ends_at_min_lr():
    s = cosine(LR, total_steps=10, warmup=2, min_lr=0.0)
    assert s(10) == 0.0 and max(s(k) for k in range(1, 11)) == LR
    assert all(s(k) >= s(k + 1) for k in range(2, 10))
    assert math.isclose(s(6), LR / 2)
