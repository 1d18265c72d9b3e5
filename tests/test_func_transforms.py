"""hpf.hvp and hpf.per_example_grads of a sharded step against plain torch autograd on the full
model: double backward for the Hessian-vector product, one backward per example.

Tolerances: the sharded HVP sums two ranks' products of half batches where the reference takes
one product of the whole batch (the same terms, another order), measured <= 2e-6 relative;
rtol 1e-4 as the issue sets. Per-example grads run the same ops on the same example: rtol 1e-5.
"""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import hpf
from hpf.launcher import launch
from hpf.models import gpt

CONFIG = gpt.CONFIGS["tiny"]
BATCH, SEED = 8, 0

def direction(params):
    g = torch.Generator().manual_seed(1)
    return hpf.tree.unflatten(hpf.tree.flatten(params)[2],
                              [torch.randn(p.shape, generator=g) for p in hpf.tree.flatten(params)[1]])

def rank_run(rank, weighted):
    step = hpf.shard_step(gpt.loss_for(CONFIG, weighted=weighted), mesh=hpf.Mesh({"dp": 2}),
                          optimizer=hpf.optim.adamw(lr=1e-2))
    params = gpt.init(CONFIG, hpf.random.key(SEED))
    state = step.init(params)
    batch = gpt.global_batch(CONFIG, BATCH, SEED, 0)
    local = batch[rank * BATCH // 2:(rank + 1) * BATCH // 2]
    hv = hpf.hvp(step, state, local, direction(params))
    per = hpf.per_example_grads(step, state, local)
    return {"hvp": hpf.tree.flatten(hv)[1], "per_example": hpf.tree.flatten(per)[1]}

@pytest.fixture(scope="module")
def runs():
    return {w: launch(rank_run, 2, w, timeout=280) for w in (False, True)}

def reference_hvp(weighted):
    params = gpt.init(CONFIG, hpf.random.key(SEED))
    leaves = [p.requires_grad_() for p in hpf.tree.flatten(params)[1]]
    with sdpa_kernel([SDPBackend.MATH]):  # (the fused CPU attention has no double backward)
        out = gpt.loss_for(CONFIG, weighted=weighted)(params, gpt.global_batch(CONFIG, BATCH, SEED, 0))
        loss = out.sum / out.count if weighted else out
        grads = torch.autograd.grad(loss, leaves, create_graph=True)
        v = hpf.tree.flatten(direction(params))[1]
        return torch.autograd.grad(sum((g * d).sum() for g, d in zip(grads, v)), leaves)

@pytest.mark.slow
@pytest.mark.parametrize("weighted", [False, True])
def test_hvp_of_the_sharded_step_matches_double_backward(runs, weighted):
    want = reference_hvp(weighted)
    for rank in range(2):
        got = runs[weighted][rank]["hvp"]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)

def check_per_example(per_rank):
    """``per_rank[r]``: rank r's per-example grads of its BATCH // len(per_rank) examples."""
    params = gpt.init(CONFIG, hpf.random.key(SEED))
    leaves = [p.requires_grad_() for p in hpf.tree.flatten(params)[1]]
    batch = gpt.global_batch(CONFIG, BATCH, SEED, 0)
    n = BATCH // len(per_rank)
    for i in range(BATCH):
        want = torch.autograd.grad(gpt.loss_for(CONFIG)(params, batch[i:i + 1]), leaves)
        for g, w in zip(per_rank[i // n], want):
            torch.testing.assert_close(g[i % n], w, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_per_example_grads_match_one_backward_per_example(runs):
    check_per_example([runs[False][r]["per_example"] for r in range(2)])


def test_one_process_transforms_match_plain_torch():
    """The same transforms without a process group (a notebook's first try): the whole batch on one rank."""
    step = hpf.shard_step(gpt.loss_for(CONFIG), mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw(lr=1e-2))
    params = gpt.init(CONFIG, hpf.random.key(SEED))
    state = step.init(params)
    batch = gpt.global_batch(CONFIG, BATCH, SEED, 0)
    for g, w in zip(hpf.tree.flatten(hpf.hvp(step, state, batch, direction(params)))[1], reference_hvp(False)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    check_per_example([hpf.tree.flatten(hpf.per_example_grads(step, state, batch))[1]])

def test_transforms_refuse_a_step_before_init():
    step = hpf.shard_step(gpt.loss_for(CONFIG), mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw(lr=1e-2))
    with pytest.raises(RuntimeError, match="step.init"):
        hpf.hvp(step, None, None, None)


# -- issue 45 items 7 and 11: the step's batch_axes, blocks run by apply, and named failures ------------
D = 4


class Blocks(list):
    """The reference's list of blocks: ``apply`` is a plain call."""

    def apply(self, i, fn, *args):
        return fn(self[i], *args)


def small_params():
    g = torch.Generator().manual_seed(2)
    return {"w": torch.randn(D, D, generator=g) * 0.5, "layers": [{"v": torch.randn(D, D, generator=g) * 0.5}
                                                                  for _ in range(2)]}


def by_apply(p, b):
    """A loss whose blocks run through params[...].apply, with a leaf that is not per-example
    (``scale``: [D, 1], as long as the batch: sliced per example it still broadcasts)."""
    x = b["x"]
    for i in range(2):
        x = p["layers"].apply(i, lambda blk, h: torch.tanh(h @ blk["v"]), x)
    return ((x @ p["w"]) * b["scale"].T).pow(2).mean()


def by_loop(p, b):
    """``by_apply`` with a plain loop over the blocks."""
    x = b["x"]
    for blk in p["layers"]:
        x = torch.tanh(x @ blk["v"])
    return ((x @ p["w"]) * b["scale"].T).pow(2).mean()


def small_batch(n=D):
    g = torch.Generator().manual_seed(3)
    return {"x": torch.randn(n, D, generator=g), "scale": torch.randn(D, 1, generator=g)}


def small_step(loss_fn=by_apply):
    step = hpf.shard_step(loss_fn, mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw(lr=1e-2),
                          batch_axes=lambda path: None if path == "scale" else 0)
    return step, step.init(small_params())


def reference_grads(p, batch, loss_fn):
    leaves = [x.requires_grad_() for x in hpf.tree.flatten(p)[1]]
    loss = loss_fn({"w": p["w"], "layers": Blocks(p["layers"])}, batch)
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("loss_fn", [by_loop, by_apply])
@pytest.mark.parametrize("n", [D, 1])
def test_per_example_grads_follow_the_step_s_batch_axes_and_run_blocks_by_apply(loss_fn, n):
    """Item 7: every leaf was sliced on dim 0, so ``scale`` (not per-example, the batch's length) was split
    (relative error 2.37); item 11: ``apply`` on the full params' plain list was an AttributeError, and
    a batch of one example a raw vmap error."""
    step, state = small_step(loss_fn)
    batch = small_batch(n)
    got = hpf.tree.flatten(hpf.per_example_grads(step, state, batch))[1]
    for i in range(n):
        want = reference_grads(small_params(), {"x": batch["x"][i:i + 1], "scale": batch["scale"]}, loss_fn)
        for g, w in zip(got, want):
            torch.testing.assert_close(g[i], w, rtol=1e-5, atol=1e-7)


def test_per_example_grads_refuse_leaves_of_different_example_counts():
    step, state = small_step()
    with pytest.raises(ValueError, match=r"per-example leaves hold \{'x': 4, 'y': 3\} examples.*batch_axes"):
        hpf.per_example_grads(step, state, {**small_batch(), "y": torch.zeros(3, 2)})


def test_hvp_runs_blocks_by_apply():
    step, state = small_step()
    p, batch = small_params(), small_batch()
    v = hpf.tree.unflatten(hpf.tree.flatten(p)[2], [torch.ones_like(x) for x in hpf.tree.flatten(p)[1]])
    got = hpf.tree.flatten(hpf.hvp(step, state, batch, v))[1]
    leaves = [x.requires_grad_() for x in hpf.tree.flatten(p)[1]]
    grads = torch.autograd.grad(by_apply({"w": p["w"], "layers": Blocks(p["layers"])}, batch), leaves,
                                create_graph=True)
    want = torch.autograd.grad(sum(g.sum() for g in grads), leaves)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


F = torch.nn.functional
TORCH_LOSSES = {  # losses whose backward torch's forward mode cannot differentiate (mse) and two that it can
    "mse_loss": lambda p, b: F.mse_loss(torch.tanh(b @ p["w"]) @ p["v"], b[:, :3]),
    "smooth_l1_loss": lambda p, b: F.smooth_l1_loss(torch.tanh(b @ p["w"]) @ p["v"], b[:, :3], beta=0.5),
    "cross_entropy": lambda p, b: F.cross_entropy(torch.tanh(b @ p["w"]) @ p["v"], b[:, 0].gt(0).long()),
}


@pytest.mark.parametrize("name", list(TORCH_LOSSES))
def test_hvp_of_torch_losses_equals_plain_double_backward(name):
    loss_fn = TORCH_LOSSES[name]
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(D, D, generator=g), "v": torch.randn(D, 3, generator=g)}
    batch, v = torch.randn(6, D, generator=g), {"w": torch.randn(D, D, generator=g), "v": torch.randn(D, 3, generator=g)}
    with hpf.shard_step(loss_fn, mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw(lr=1e-2)) as step:
        got = hpf.hvp(step, step.init(params), batch, v)
    leaves = {k: x.clone().requires_grad_() for k, x in params.items()}
    grads = torch.autograd.grad(loss_fn(leaves, batch), list(leaves.values()), create_graph=True)
    want = torch.autograd.grad(sum((gr * v[k]).sum() for gr, k in zip(grads, leaves)), list(leaves.values()))
    for k, w in zip(leaves, want):  # forward-over-reverse and double backward differ by rounding only
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-6)

