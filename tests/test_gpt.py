"""The pure-function GPT against an independently written nn.Module GPT, plus its data source."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hpf
from hpf.models import gpt, synthetic
from references import adamw_training

TINY = gpt.CONFIGS["tiny"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors gain nothing from intra-op threads; when the 2 cores are shared with other
    processes, OpenMP's spinning threads made these tests ~60x slower (measured: 0.3 s -> 20 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + self.eps))


class Block(nn.Module):
    def __init__(self, d_model, n_heads, d_ff):
        super().__init__()
        self.n_heads = n_heads
        self.norm1, self.norm2 = RMSNorm(d_model), RMSNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def attention(self, x):
        # Explicit masked softmax, not SDPA, so the reference does not share the kernel under test.
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, self.n_heads, 3, d // self.n_heads).unbind(3)  # head-major columns
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.n_heads)
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        out = scores.masked_fill(future, float("-inf")).softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, d))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class ReferenceGPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.tok = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = nn.Embedding(c.seq_len, c.d_model)
        self.blocks = nn.ModuleList(Block(c.d_model, c.n_heads, c.d_ff) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)

    def forward(self, batch):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        x = self.tok(inputs) + self.pos(torch.arange(inputs.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def params_and_grads(self):
        """(param, grad) pairs laid out like the pure model's dict; nn.Linear stores [out, in]."""
        pair = lambda p, transpose=False: (p.T, p.grad.T) if transpose else (p, p.grad)  # noqa: E731
        return {
            "embed": pair(self.tok.weight), "pos": pair(self.pos.weight),
            "blocks": [
                {"norm1": pair(b.norm1.weight), "w_qkv": pair(b.qkv.weight, True), "w_o": pair(b.proj.weight, True),
                 "norm2": pair(b.norm2.weight), "w_up": pair(b.up.weight, True), "w_down": pair(b.down.weight, True)}
                for b in self.blocks
            ],
            "norm_f": pair(self.norm.weight), "head": pair(self.lm_head.weight, True),
        }


def reference_from(params, c):
    model = ReferenceGPT(c)
    with torch.no_grad():
        model.tok.weight.copy_(params["embed"])
        model.pos.weight.copy_(params["pos"])
        for b, p in zip(model.blocks, params["blocks"]):
            b.norm1.weight.copy_(p["norm1"]); b.norm2.weight.copy_(p["norm2"])  # noqa: E702
            b.qkv.weight.copy_(p["w_qkv"].T); b.proj.weight.copy_(p["w_o"].T)  # noqa: E702
            b.up.weight.copy_(p["w_up"].T); b.down.weight.copy_(p["w_down"].T)  # noqa: E702
        model.norm.weight.copy_(params["norm_f"])
        model.lm_head.weight.copy_(params["head"].T)
    return model


def flat(tree):
    return torch.utils._pytree.tree_leaves(tree)


@pytest.mark.tolerance
def test_loss_and_grads_match_reference_module():
    # At init std 0.02 GELU is nearly linear and attention nearly uniform, which would hide
    # mistakes there (e.g. exact instead of tanh GELU); scale the matrices feeding them so the
    # attention scores and GELU inputs are O(1), and move the norm weights off ones.
    gen = torch.Generator().manual_seed(1)
    params = gpt.init(TINY, hpf.random.key(1))
    for blk in params["blocks"]:
        blk["w_qkv"], blk["w_up"] = 5 * blk["w_qkv"], 20 * blk["w_up"]
        blk["norm1"] = 1 + 0.3 * torch.randn(TINY.d_model, generator=gen)
        blk["norm2"] = 1 + 0.3 * torch.randn(TINY.d_model, generator=gen)
    params["norm_f"] = 1 + 0.3 * torch.randn(TINY.d_model, generator=gen)
    model = reference_from(params, TINY)
    batch = gpt.global_batch(TINY, 4, seed=3, step=0)

    leaves = flat(params)
    for leaf in leaves:
        leaf.requires_grad_(True)
    pure_loss = gpt.loss(params, batch, n_heads=TINY.n_heads)
    pure_grads = torch.autograd.grad(pure_loss, leaves)
    ref_loss = model(batch)
    ref_loss.backward()

    ref = model.params_and_grads()
    is_pair = lambda x: isinstance(x, tuple)  # noqa: E731
    ref_params = [p for p, _ in torch.utils._pytree.tree_leaves(ref, is_leaf=is_pair)]
    ref_grads = [g for _, g in torch.utils._pytree.tree_leaves(ref, is_leaf=is_pair)]
    assert len(ref_params) == len(leaves) == 3 * 1 + 1 + 6 * TINY.n_layers
    for mine, theirs in zip(leaves, ref_params):  # the copy lined up every leaf
        torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=0, atol=0)
    # fp32 with a different op order (SDPA vs explicit softmax, rsqrt vs sqrt-divide, einops vs
    # view): differences are a few ulps through a 3-layer net. Measured worst error is <10% of
    # rtol 1e-5/atol 1e-6, while the exact-GELU mistake above overshoots it ~170x.
    torch.testing.assert_close(pure_loss, ref_loss, rtol=1e-5, atol=1e-6)
    for g, rg in zip(pure_grads, ref_grads):
        assert g.abs().max() > 0
        torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-6)


def test_bf16_params_compute_in_bf16_with_fp32_loss():
    params = torch.utils._pytree.tree_map(lambda x: x.bfloat16(), gpt.init(TINY))
    batch = gpt.global_batch(TINY, 2, seed=0, step=0)
    assert gpt.forward(params, batch[:, :-1], n_heads=TINY.n_heads).dtype == torch.bfloat16
    value = gpt.loss_for(TINY)(params, batch)
    assert value.dtype == torch.float32
    ref = reference_from(gpt.init(TINY), TINY)(batch)
    torch.testing.assert_close(value, ref, rtol=2e-2, atol=0)  # bf16 has ~3 significant digits


def test_init_is_deterministic_and_scaled():
    a, b = gpt.init(TINY, hpf.random.key(7)), gpt.init(TINY, hpf.random.key(7))
    c = gpt.init(TINY, hpf.random.key(8))
    assert all(torch.equal(x, y) for x, y in zip(flat(a), flat(b)))
    assert not torch.equal(a["embed"], c["embed"])
    big = gpt.init(gpt.CONFIGS["small"])  # enough samples for the std to be within a few %
    assert big["blocks"][0]["w_up"].std().item() == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / math.sqrt(2 * gpt.CONFIGS["small"].n_layers)
    assert big["blocks"][0]["w_down"].std().item() == pytest.approx(residual, rel=0.05)
    assert torch.equal(big["norm_f"], torch.ones(256))


@pytest.mark.parametrize("name", list(gpt.CONFIGS))
def test_meta_init_shapes_and_param_count(name):
    c = gpt.CONFIGS[name]
    params = gpt.init(c, device="meta", dtype=torch.bfloat16)
    assert all(x.is_meta and x.dtype == torch.bfloat16 for x in flat(params))
    assert sum(x.numel() for x in flat(params)) == gpt.num_params(c)
    assert params["blocks"][0]["w_qkv"].shape == (c.d_model, 3 * c.d_model)
    assert params["head"].shape == (c.d_model, c.vocab_size)
    if name == "1b":
        assert 0.9e9 < gpt.num_params(c) < 1.2e9


def test_tiny_sizes_are_awkward_for_sharding():
    sizes = [x.numel() for x in flat(gpt.init(TINY, device="meta"))]
    block = sum(x.numel() for x in flat(gpt.init(TINY, device="meta")["blocks"][0]))
    assert block % 4 and block % 3 and (gpt.num_params(TINY) - TINY.n_layers * block) % 2
    assert any(s % 2 for s in sizes)


def test_loss_without_n_heads_says_how_to_bind_it():
    with pytest.raises(TypeError, match="loss_for"):
        gpt.loss(gpt.init(TINY), gpt.global_batch(TINY, 2, seed=0, step=0))


def test_config_rejects_heads_that_do_not_divide():
    with pytest.raises(ValueError, match="n_heads"):
        gpt.GPTConfig(vocab_size=10, seq_len=4, d_model=10, n_layers=1, n_heads=3)


@pytest.mark.parametrize("recompute", ["none", "all"])
def test_blocks_are_only_iterated_once_in_order(recompute):
    """A model takes any iterable of blocks (a generator too): it iterates it once, in order."""
    class IterOnly:
        def __init__(self, items):
            self.items, self.iterations = items, 0

        def __iter__(self):
            self.iterations += 1
            return iter(self.items)

    params = gpt.init(TINY)
    lazy = dict(params, blocks=IterOnly(params["blocks"]))
    batch = gpt.global_batch(TINY, 2, seed=0, step=0)
    loss = gpt.loss_for(TINY, recompute=recompute)
    torch.testing.assert_close(loss(lazy, batch), loss(params, batch), rtol=0, atol=0)
    assert lazy["blocks"].iterations == 1


def test_synthetic_data_is_deterministic_and_rank_slices_reassemble():
    first = gpt.global_batch(TINY, 8, seed=5, step=2)
    assert first.shape == (8, TINY.seq_len + 1) and first.dtype == torch.int64
    assert torch.equal(first, gpt.global_batch(TINY, 8, seed=5, step=2))
    assert not torch.equal(first, gpt.global_batch(TINY, 8, seed=5, step=3))
    assert not torch.equal(first, gpt.global_batch(TINY, 8, seed=6, step=2))
    assert 0 <= first.min() and first.max() < TINY.vocab_size
    for world in (1, 2, 4):
        streams = [gpt.synthetic_batches(TINY, 8, seed=5, rank=r, world_size=world) for r in range(world)]
        for step in range(3):
            local = [next(s) for s in streams]
            assert all(x.shape == (8 // world, TINY.seq_len + 1) for x in local)
            assert torch.equal(torch.cat(local), gpt.global_batch(TINY, 8, seed=5, step=step))


def test_synthetic_data_is_a_sparse_markov_chain():
    """Learnable: each token is followed by at most a few distinct successors, fixed by the seed."""
    data = torch.cat([gpt.global_batch(TINY, 64, seed=0, step=s) for s in range(4)])
    pairs = torch.stack([data[:, :-1].flatten(), data[:, 1:].flatten()], 1).unique(dim=0)
    successors = torch.bincount(pairs[:, 0], minlength=TINY.vocab_size)
    assert successors.max() <= synthetic.SUCCESSORS_PER_TOKEN
    assert (successors >= 2).float().mean() > 0.5  # random, not a fixed cycle
    assert pairs.shape[0] < TINY.vocab_size * synthetic.SUCCESSORS_PER_TOKEN + 1


def test_synthetic_batches_rejects_indivisible_batch():
    with pytest.raises(ValueError, match="batch_size=6.*world_size=4"):
        next(gpt.synthetic_batches(TINY, 6, seed=0, rank=0, world_size=4))


def test_adamw_makes_the_loss_fall():
    data = gpt.synthetic_batches(TINY, 16, seed=0)
    losses, _, _ = adamw_training(gpt.loss_for(TINY), gpt.init(TINY), lambda _: next(data), 40, lr=1e-2)
    assert losses[0] == pytest.approx(math.log(TINY.vocab_size), abs=0.2)  # small init: near uniform
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
