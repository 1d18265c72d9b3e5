"""Optimizers as optax does them (issue 59): a chain is one object, an ``init``/``update`` pair on
any pytree in one process and the same object under ``hpf.shard_step``; each against a plain-torch
reference. The clip is a stage whose factor the decision reads; a checkpoint records the chain
(its stages' paths, names and hyper-parameters) and refuses another, naming the stage that differs.

Under shard_step the loss is test_optim_fuzz's linear one with dyadic coefficients, so the grads
are exact on every rank and the optimizers alone are compared: bit for bit."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hpf
from hpf import checkpoint as ck
from hpf.checkpoint import saving
from hpf.optim import as_optimizer, inject_hyperparams
from hpf.optim.transforms import add_decayed_weights, chain, clip_by_global_norm, scale_by_adam
from test_dist_muon import MUON, moe_init, reference_muon, reference_torch, synthetic_grads
from test_optim_fuzz import _grads, coefficients, loss, params

STEPS = 3


def pytree(seed: int):
    """A plain pytree of dicts, lists and a tuple (no plan, no mesh)."""
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(5, 3, generator=g), "gain": (torch.randn(7, generator=g),),
            "layers": [{"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)} for _ in range(2)]}


def leaves(tree) -> list[torch.Tensor]:
    return [x.detach() for x in hpf.tree.flatten(tree)[1]]


def adamw_chain(lr, wd, betas, eps):
    """AdamW written by a user, optax style, as one optimizer object."""
    return as_optimizer(inject_hyperparams(chain(add_decayed_weights(wd), scale_by_adam(betas, eps)), lr=lr))


@pytest.mark.parametrize("which", ["hpf.optim.adamw", "a user's chain"])
def test_a_chain_on_a_plain_pytree_is_torch_adamw_bit_for_bit(which):
    lr, wd, betas, eps = 3e-3, 0.1, (0.8, 0.99), 1e-7
    opt = hpf.optim.adamw(lr, betas, eps, wd) if which == "hpf.optim.adamw" else adamw_chain(lr, wd, betas, eps)
    tree = pytree(0)
    state = opt.init(tree)
    ref = [p.clone().requires_grad_() for p in leaves(tree)]
    torch_opt = torch.optim.AdamW(ref, lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=True)
    for s in range(STEPS):
        grads = pytree(10 + s)
        tree, state = opt.update(grads, state, tree)
        for r, g in zip(ref, leaves(grads)):
            r.grad = g.clone()
        torch_opt.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(leaves(tree), ref))
    assert not torch.equal(leaves(tree)[0], leaves(pytree(0))[0]), "the params must move for this to mean anything"


def test_muons_chain_on_a_plain_pytree_is_the_muon_reference():
    """Muon's chain (``Muon.transform``, run as any chain is) on the MoE pytree: bit for bit hpf's
    Muon (tests/test_dist_muon.py's reference_muon), and torch.optim.Muon with torch.optim.AdamW
    within test_dist_muon's bound for a bf16 Newton-Schulz (torch's own NS dtype)."""
    for ns_dtype, want, tol in ((None, reference_muon(moe_init()), dict(rtol=0, atol=0)),
                                (torch.bfloat16, reference_torch(moe_init()), dict(rtol=0, atol=1e-4))):
        opt = as_optimizer(hpf.optim.muon(**MUON, ns_compute_dtype=ns_dtype).transform)
        tree = moe_init()
        state = opt.init(tree)
        for grads in synthetic_grads(tree):
            tree, state = opt.update(grads, state, tree)
        torch.testing.assert_close(leaves(tree), leaves(want), **tol)


def _build(kind: str, lr: float, wd: float, b1: float):
    if kind == "adamw":
        return hpf.optim.adamw(lr, (b1, 0.99), 1e-8, wd, hpf.optim.default_weight_decay_mask)
    if kind == "chain":
        return adamw_chain(lr, wd, (b1, 0.99), 1e-8)
    return hpf.optim.muon(lr=lr, weight_decay=wd, momentum=b1, adamw_lr=lr / 4, adamw_weight_decay=wd)


def _one_process(opt) -> list[torch.Tensor]:
    tree = params()
    state = opt.init(tree)
    for i in range(STEPS):
        tree, state = opt.update(_grads(tree, coefficients(i)), state, tree)
    return leaves(tree)


def _under_shard_step(opt) -> list[torch.Tensor]:
    with hpf.shard_step(loss, mesh=hpf.Mesh({"dp": 1}), optimizer=opt) as step:
        state = step.init(params())
        for i in range(STEPS):
            state, _ = step(state, coefficients(i))
        return leaves(step.full_params(state))


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(kind=st.sampled_from(["adamw", "chain", "muon"]), lr=st.sampled_from([1e-3, 1e-2, 0.05]),
       wd=st.sampled_from([0.0, 0.1]), b1=st.sampled_from([0.8, 0.9, 0.95]))
def test_the_same_chain_object_in_one_process_and_under_shard_step_agree_bit_for_bit(kind, lr, wd, b1):
    """One object: its own update on the pytree, then hpf.shard_step with it as the optimizer
    (its plan form on the flat shards: a mask's element ranges, DistMuon's local matrices)."""
    opt = _build(kind, lr, wd, b1)
    alone = _one_process(opt)
    assert not torch.equal(alone[0], leaves(params())[0])
    assert all(torch.equal(a, b) for a, b in zip(alone, _under_shard_step(opt))), (kind, lr, wd, b1)


def test_the_clip_is_a_stage_whose_factor_the_decision_reads():
    """Under shard_step the chain's clip stage acts through the decision: the step's update is
    its grads times the stage's factor of the step's grad norm (one multiply: ``grad_scale``),
    then the rest of the chain, exactly; without the clip stage it is not."""
    clip = clip_by_global_norm(0.5)
    assert clip.factor(0.25) == 1.0 and clip.factor(4.0) == 0.5 / (4.0 + 1e-6)
    assert clip.grad_scale(8.0, clip.factor(4.0)) == clip.factor(4.0) / 8.0  # one rounding, not two
    rest = inject_hyperparams(chain(add_decayed_weights(0.1), scale_by_adam()), lr=1e-2)
    with hpf.shard_step(loss, mesh=hpf.Mesh({"dp": 1}), optimizer=inject_hyperparams(
            chain(clip, add_decayed_weights(0.1), scale_by_adam()), lr=1e-2)) as step:
        state = step.init(params())
        d = step.decider.decide([hpf.losses.LossOut(torch.tensor(1.0), None, None)],
                                [torch.full_like(g, 3.0) for g in step.grad_shards], coefficients(0))
        assert d.clip == clip.factor(d.grad_norm) < 1.0 and d.grad_scale == clip.grad_scale(1.0, d.clip)
        state, m = step(state, coefficients(0))
        got = leaves(step.full_params(state))
    factor = clip.factor(m["grad_norm"])
    assert factor < 1.0, "the clip must act for this test to mean anything"
    ref, tree = as_optimizer(rest), params()
    state = ref.init(tree)
    grads = _grads(tree, coefficients(0))
    ref.update(hpf.tree.map_with_path(lambda _, g: g * clip.grad_scale(1.0, factor), grads), state, tree)
    assert all(torch.equal(a, b) for a, b in zip(got, leaves(tree)))
    unclipped, state = params(), ref.init(params())
    ref.update(_grads(unclipped, coefficients(0)), state, unclipped)
    assert not all(torch.equal(a, b) for a, b in zip(got, leaves(unclipped)))


# -- a checkpoint records the chain -----------------------------------------------------------------
def _save(opt, folder):
    with hpf.shard_step(loss, mesh=hpf.Mesh({"dp": 1}), optimizer=opt) as step:
        state, _ = step(step.init(params()), coefficients(0))
        step.save(state, folder)
        return leaves(step.full_params(state))


def _restore(opt, folder):
    with hpf.shard_step(loss, mesh=hpf.Mesh({"dp": 1}), optimizer=opt) as step:
        state, _ = step.restore(folder, step.init(params()))
        return leaves(step.full_params(state)), state


def test_a_checkpoint_records_the_stages_and_their_hyper_parameters(tmp_path):
    saved = _save(hpf.optim.adamw(3e-3, weight_decay=0.1), tmp_path / "a")
    outline = json.loads((tmp_path / "a" / "hpf.json").read_text())["optimizer_outline"]
    assert [(p, n) for p, n, _ in outline] == [("", "inject_hyperparams"), ("", "chain"), ("0", "add_decayed_weights"),
                                               ("1", "scale_by_adam")]
    assert outline[0][2]["lr"] == 3e-3 and outline[2][2]["weight_decay"] == 0.1 and outline[3][2]["betas"] == [0.9, 0.999]
    got, _ = _restore(hpf.optim.adamw(1e-4, weight_decay=0.1), tmp_path / "a")  # a new lr on resume: allowed
    assert all(torch.equal(a, b) for a, b in zip(got, saved))


@pytest.mark.parametrize("case", ["muon, another use_adamw", "a chain, decay after adam"])
def test_restoring_into_another_chain_names_the_stage_and_the_fix(tmp_path, case):
    """Before, AdamW and Muon recorded no chain: a Muon that routes other params to its AdamW
    fallback failed on a missing state key, naming neither the partition nor the fix; a user's
    chain was refused with both chains' whole strings. Now both name the first stage that differs."""
    if case.startswith("muon"):
        saved, other = hpf.optim.muon(), hpf.optim.muon(use_adamw=lambda path, x: path.startswith("layers/0"))
        want = r"stage 1 is partition\(labels .*\) at '0', this optimizer's is partition\(labels"
    else:
        saved = adamw_chain(1e-2, 0.1, (0.9, 0.999), 1e-8)
        other = as_optimizer(inject_hyperparams(chain(scale_by_adam(), add_decayed_weights(0.1)), lr=1e-2))
        want = r"stage 2 is add_decayed_weights at '0', this optimizer's is scale_by_adam at '0'"
    _save(saved, tmp_path / "c")
    with pytest.raises(ck.CheckpointError, match=want + r".*build the optimizer with the same chain and partition"):
        _restore(other, tmp_path / "c")
    _restore(saved, tmp_path / "c")  # the same chain restores


def test_a_checkpoint_without_the_record_still_loads(tmp_path, monkeypatch):
    """A checkpoint an hpf before the record wrote (no ``optimizer_outline``) loads unchecked by
    it: the optimizer's type name, keys and shapes are what a restore checks then."""
    header = saving.header_of
    monkeypatch.setattr(saving, "header_of", lambda layout, sd: {k: v for k, v in header(layout, sd).items()
                                                           if k != "optimizer_outline"})
    saved = _save(hpf.optim.muon(), tmp_path / "old")
    monkeypatch.undo()
    assert "optimizer_outline" not in json.loads((tmp_path / "old" / "hpf.json").read_text())
    got, state = _restore(hpf.optim.muon(), tmp_path / "old")
    assert int(state.opt_state.count) == 1 and all(torch.equal(a, b) for a, b in zip(got, saved))
