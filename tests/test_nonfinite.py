"""A non-finite step is decided once, for every rank, before any update (issue 28, item 2),
and fp16 gets dynamic loss scaling with torch.amp.GradScaler's semantics.

The case from the issue: a finite loss whose grads hold one non-finite element, which only the
rank owning that element's shard sees. Every rank must raise, no rank may have updated
anything (AdamW's step count included), and the job goes on as if the step never happened.
"""
import math

import pytest
import torch

import hpf
from hpf.launcher import launch
from references import adamw_training
from toy_models import LM_ROWS, LM_T, lm_batch, lm_loss, lm_params

ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
ROWS, T = LM_ROWS, LM_T


def init():
    return lm_params(n_blocks=3)


batch_of, loss_fn = lm_batch, lm_loss


def one_bad_element(params, tokens):
    """A finite loss; the last block's last bias element gets an inf grad (d sqrt(x)/dx at 0),
    which after the reduce-scatter only the rank holding that element's shard sees."""
    return loss_fn(params, tokens) + torch.sqrt(params["blocks"][-1]["b"][-1] * 0)


def _bad_step_then_go_on(rank):
    step = hpf.shard_step(lambda p, b: one_bad_element(p, b) if bad[0] else loss_fn(p, b), mesh=hpf.Mesh({"dp": 2}),
                          optimizer=hpf.optim.adamw(**ADAMW))
    bad = [False]
    state = step.init(init())
    state, _ = step(state, batch_of(0, rank, 2))
    before = [t.clone() for t in state.params] + [t.clone() for t in hpf.tree.flatten(state.opt_state)[1]]
    bad[0] = True
    try:
        step(state, batch_of(1, rank, 2))
        raised = None
    except hpf.NonFiniteError as e:
        raised = str(e)
    after = [t.clone() for t in state.params] + [t.clone() for t in hpf.tree.flatten(state.opt_state)[1]]
    unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
    bad[0] = False
    losses = []
    for s in (1, 2, 3):
        state, m = step(state, batch_of(s, rank, 2))
        losses.append(m["loss"])
    return raised, unchanged, int(state.opt_state.count), losses, hpf.tree.flatten(step.full_params(state))[1]


@pytest.mark.slow
def test_a_non_finite_grad_seen_by_one_rank_raises_on_every_rank_and_updates_nothing():
    runs = launch(_bad_step_then_go_on, 2, timeout=120)
    for raised, unchanged, count, _, _ in runs:
        assert raised is not None and "nothing was updated" in raised
        assert unchanged, "a rank moved its params or optimizer state on a step that raised"
        assert count == 4  # steps 0, 1, 2, 3 (the bad one never counted): the same on every rank
    # as if the bad step never happened: plain torch on batches 0, 1, 2, 3
    losses, _, params = adamw_training(loss_fn, init(), batch_of, 4, **ADAMW)
    torch.testing.assert_close(runs[0][3], losses[1:], rtol=1e-5, atol=0)
    for got, want in zip(runs[0][4], params.values()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# -- fp16: dynamic loss scaling ---------------------------------------------------------------------------------
def test_fp16_scales_the_loss_skips_overflowing_steps_and_backs_off_then_grows():
    scale = hpf.LossScale(init_scale=2.0 ** 200, growth_interval=3, max_skipped=250)  # overflows fp16 at once
    step = hpf.shard_step(loss_fn, mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw(**ADAMW),
                          mixed_precision="fp16", loss_scale=scale)
    state = step.init(init())
    scales, skipped = [], []
    for s in range(200):
        state, m = step(state, batch_of(s % 4))
        scales.append(m["loss_scale"])
        skipped.append(m["skipped"])
        if s > 10 and not any(skipped[-4:]) and scales[-1] > scales[-4]:
            break
    first_clean = skipped.index(False)
    assert first_clean > 0 and all(skipped[:first_clean]), "the scale must first overflow, then back off"
    # each skipped step halves the scale; the first clean step runs at that scale
    assert scales[first_clean - 1] == 2.0 ** 200 * 0.5 ** first_clean
    assert math.isfinite(float(state.params[0].sum()))
    # after growth_interval clean steps in a row the scale doubles
    assert scales[-1] > scales[first_clean], scales


def test_fp16_defaults_to_loss_scaling_and_other_precisions_do_not():
    mk = lambda mp: hpf.shard_step(loss_fn, mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw(),  # noqa: E731
                                   mixed_precision=mp)
    assert isinstance(mk("fp16").config.loss_scale, hpf.LossScale)
    assert mk("bf16").config.loss_scale is None and mk(None).config.loss_scale is None
    with pytest.raises(ValueError, match="growth_factor > 1"):
        hpf.LossScale(growth_factor=0.5)


def test_a_skipped_step_still_reports_aux():
    def with_aux(params, tokens):
        return loss_fn(params, tokens) * float("nan"), {"tokens": torch.tensor([float(tokens.numel())])}
    step = hpf.shard_step(with_aux, mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw(), on_nonfinite="skip")
    _, m = step(step.init(init()), batch_of(0))
    assert m["skipped"] and m["aux"]["tokens"].tolist() == [float(ROWS * (T + 1))]
