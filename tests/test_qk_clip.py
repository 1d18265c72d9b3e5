"""QK-Clip (hpf.optim.muon(qk_clip=tau), Kimi K2's MuonClip, arXiv 2507.20534) against a
plain-torch reference of the rule, and sharded against single-process.

The rule: after the update, a head h whose max attention logit S_h this step exceeded tau has its
query and key weights scaled by sqrt(tau / S_h) (a key head shared by grouped-query attention: the
query takes all of tau / S_h). The references here index the weights by hand (column or row
slices), independently of the models' qk_heads maps.
"""
import math

import optree
import pytest
import torch
from einops import rearrange

import hpf
from hpf.launcher import launch
from hpf.models import gpt, llama
from hpf.optim.muon_optimizer import muon

TINY = gpt.CONFIGS["tiny"]
MUON = dict(lr=0.02, weight_decay=0.1, adamw_lr=1e-2)


def brute_max_logits(q, k):
    """max over b, i, j <= i of q[b, h, i] . k[b, h, j] / sqrt(e), per head, by loops over i."""
    e = q.shape[-1]
    best = torch.full((q.shape[1],), -math.inf, dtype=torch.float64)
    for i in range(q.shape[2]):
        s = torch.einsum("bhe,bhje->bhj", q[:, :, i].double(), k[:, :, :i + 1].double()) / math.sqrt(e)
        best = torch.maximum(best, s.amax(dim=(0, 2)))
    return best


def test_max_attention_logit_is_the_causal_max_over_the_batch():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 7, 4, generator=g), torch.randn(2, 3, 7, 4, generator=g)
    torch.testing.assert_close(gpt.max_attention_logit(q, k).double(), brute_max_logits(q, k), rtol=1e-6, atol=1e-6)
    k1 = torch.randn(2, 1, 7, 4, generator=g)  # one key head shared by 3 query heads
    torch.testing.assert_close(gpt.max_attention_logit(q, k1).double(), brute_max_logits(q, k1.expand(2, 3, 7, 4)),
                               rtol=1e-6, atol=1e-6)


def gpt_reference_logits(params, tokens):
    """Each block's q, k by hand (w_qkv's column slices, head-major: (h three e)), through gpt.block
    for the residual stream."""
    x = torch.nn.functional.embedding(tokens, params["embed"]) + params["pos"][:tokens.shape[1]]
    d, h = TINY.d_model, TINY.n_heads
    out = []
    for blk in params["blocks"]:
        z = gpt.rms_norm(x, blk["norm1"])
        cols = blk["w_qkv"].view(d, h, 3, d // h)
        q = rearrange(z @ cols[:, :, 0].reshape(d, d), "b t (h e) -> b h t e", h=h)
        k = rearrange(z @ cols[:, :, 1].reshape(d, d), "b t (h e) -> b h t e", h=h)
        out.append(brute_max_logits(q, k))
        x = gpt.block(blk, x, h)
    return torch.stack(out)


def test_gpt_reports_every_heads_max_logit_as_an_aux():
    params = gpt.init(TINY, hpf.random.key(1))
    batch = gpt.global_batch(TINY, 4, 0, 0)
    value, aux = gpt.loss_for(TINY, max_logits=True)(params, batch)
    torch.testing.assert_close(value, gpt.loss_for(TINY)(params, batch))
    torch.testing.assert_close(aux["max_attn_logit"].double(), gpt_reference_logits(params, batch[:, :-1]),
                               rtol=1e-5, atol=1e-7)
    assert aux["max_attn_logit"].shape == (TINY.n_layers, TINY.n_heads)


def reference_clip_gpt(params, S, tau):
    """Plain torch: scale head h's q and k columns of w_qkv (head-major: h's are [3eh, 3eh + 2e)) by
    sqrt(tau / S) where S > tau."""
    e = TINY.d_model // TINY.n_heads
    for layer, blk in enumerate(params["blocks"]):
        for h in range(TINY.n_heads):
            if S[layer, h] > tau:
                f = torch.tensor(math.sqrt(tau / float(S[layer, h])), dtype=torch.float64).float()
                blk["w_qkv"][:, 3 * e * h:3 * e * h + 2 * e] *= f
    return params


def one_update(params, grads, S, tau, **kwargs):
    params = optree.tree_map(torch.clone, params)
    opt = muon(**{**MUON, **kwargs}, qk_clip=tau, qk_heads=gpt.qk_heads(TINY)) if tau else muon(**{**MUON, **kwargs})
    state = opt.init(params)
    return opt.update(grads, state, params, aux={"max_attn_logit": S})[0]


def test_gpt_clip_equals_the_plain_torch_rule_after_the_update():
    g = torch.Generator().manual_seed(2)
    params = gpt.init(TINY, hpf.random.key(2))
    grads = optree.tree_map(lambda p: torch.randn(p.shape, generator=g), params)
    S = torch.rand(TINY.n_layers, TINY.n_heads, generator=g) * 20
    tau = float(S.median())  # about half the heads are clipped
    got = one_update(params, grads, S, tau)
    want = reference_clip_gpt(one_update(params, grads, S, None), S, tau)
    paths, leaves, _ = hpf.tree.flatten(got)
    for path, a, b in zip(paths, leaves, hpf.tree.flatten(want)[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{path}: {m}")
    unclipped = one_update(params, grads, S, None)["blocks"][0]["w_qkv"]
    assert not torch.equal(got["blocks"][0]["w_qkv"], unclipped)


def test_clipped_heads_logits_shrink_to_tau_and_the_others_stay():
    """With nothing else moving (lr 0), one clip brings each offending head's max logit to tau: in
    the first block, whose input the clip does not change (later blocks see a changed residual)."""
    params = gpt.init(TINY, hpf.random.key(3))
    for blk in params["blocks"]:
        blk["w_qkv"] *= 40  # logits of order 1..10
    batch = gpt.global_batch(TINY, 4, 0, 0)
    loss_fn = gpt.loss_for(TINY, max_logits=True)
    S = loss_fn(params, batch)[1]["max_attn_logit"]
    tau = float(S.median())
    zero = optree.tree_map(torch.zeros_like, params)
    clipped = one_update(params, zero, S, tau, lr=0.0, weight_decay=0.0, adamw_lr=0.0)
    after = loss_fn(clipped, batch)[1]["max_attn_logit"]
    torch.testing.assert_close(after[0], torch.where(S[0] > tau, torch.full_like(S[0], tau), S[0]), rtol=1e-5, atol=0)
    assert (S[0] > tau).any() and (S[0] <= tau).any()


@pytest.mark.parametrize("n_kv", [2, 6])
def test_llama_clip_equals_the_plain_torch_rule(n_kv):
    c = llama.LlamaConfig(vocab_size=31, seq_len=8, d_model=24, n_layers=2, n_heads=6, n_kv_heads=n_kv, d_ff=20)
    g = torch.Generator().manual_seed(4)
    params = llama.init(c, hpf.random.key(4))
    grads = optree.tree_map(lambda p: torch.randn(p.shape, generator=g), params)
    S = torch.rand(c.n_layers, c.n_heads, generator=g) * 20
    tau = float(S.median())
    opts = [muon(**MUON, qk_clip=tau, qk_heads=llama.qk_heads(c)), muon(**MUON)]
    got, want = (o.update(grads, o.init(p), p, aux={"max_attn_logit": S})[0]
                 for o, p in zip(opts, (optree.tree_map(torch.clone, params) for _ in opts)))
    hd = c.head_dim
    for layer, blk in enumerate(want["blocks"]):
        for h in range(c.n_heads):
            if S[layer, h] > tau:
                gamma = tau / float(S[layer, h])
                power = 0.5 if n_kv == c.n_heads else 1.0  # a shared key head is left alone
                blk["wq"][h * hd:(h + 1) * hd] *= torch.tensor(gamma ** power, dtype=torch.float64).float()
                if n_kv == c.n_heads:
                    blk["wk"][h * hd:(h + 1) * hd] *= torch.tensor(gamma ** 0.5, dtype=torch.float64).float()
    for a, b in zip(hpf.tree.flatten(got)[1], hpf.tree.flatten(want)[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_qk_clip_arguments_name_what_to_do():
    with pytest.raises(ValueError, match="qk_clip and qk_heads go together"):
        muon(qk_clip=10.0)
    with pytest.raises(ValueError, match="positive finite threshold"):
        muon(qk_clip=-1.0, qk_heads={})
    params = gpt.init(TINY, hpf.random.key(5))
    opt = muon(qk_clip=1.0, qk_heads=gpt.qk_heads(TINY))
    state = opt.init(params)
    zero = optree.tree_map(torch.zeros_like, params)
    with pytest.raises(ValueError, match=r"max_logits=True"):
        opt.update(zero, state, params)
    assert int(state.count) == 0  # refused before anything changed
    wrong = muon(qk_clip=1.0, qk_heads={"blocks/0/w_qkv": (1, torch.zeros(7, dtype=torch.long), 0.5)})
    with pytest.raises(ValueError, match=r"qk_heads\['blocks/0/w_qkv'\] gives 7 heads along dim 1"):
        wrong.update(zero, wrong.init(params), params, aux={"max_attn_logit": torch.ones(3, 5)})


# -- sharded: hpf.shard_step at 2 ranks, 2 micro-batches each, against one process --------------
STEPS, TAU_SCALE = 4, 0.5


def tau_for(params):
    """Half the initial median logit: a mix of clipped and unclipped heads from the first step."""
    return TAU_SCALE * float(gpt.loss_for(TINY, max_logits=True)(params, gpt.global_batch(TINY, 8, 0, 0))[1]
                             ["max_attn_logit"].median())


def scaled_params():
    params = gpt.init(TINY, hpf.random.key(0))
    for blk in params["blocks"]:
        blk["w_qkv"] *= 20
    return params


def sharded(rank):
    params = scaled_params()
    opt = muon(**MUON, qk_clip=tau_for(params), qk_heads=gpt.qk_heads(TINY))
    step = hpf.shard_step(gpt.loss_for(TINY, max_logits=True), mesh=hpf.Mesh({"dp": 2}), optimizer=opt, accumulate=2)
    state = step.init(params)
    out = []
    for s in range(STEPS):
        state, metrics = step(state, gpt.global_batch(TINY, 8, 0, s)[rank * 4:(rank + 1) * 4])
        out.append((metrics["loss"], metrics["aux"]["max_attn_logit"].clone()))
    return {"steps": out, "params": [p.clone() for p in hpf.tree.flatten(step.full_params(state))[1]]}


@pytest.mark.slow
def test_sharded_qk_clip_equals_single_process():
    runs = launch(sharded, 2, timeout=240)
    params = scaled_params()
    tau = tau_for(params)
    opt = muon(**MUON, qk_clip=tau, qk_heads=gpt.qk_heads(TINY))
    state = opt.init(params)
    treedef = hpf.tree.structure(params)
    clipped_some = False
    for s in range(STEPS):
        leaves = [p.detach().requires_grad_() for p in hpf.tree.flatten(params)[1]]
        loss, aux = gpt.loss_for(TINY, max_logits=True)(hpf.tree.unflatten(treedef, leaves),
                                                        gpt.global_batch(TINY, 8, 0, s))
        grads = torch.autograd.grad(loss, leaves)
        for run in runs:  # the step's max over 2 ranks x 2 micro-batches is the whole batch's max
            assert run["steps"][s][0] == pytest.approx(loss.item(), rel=1e-5)
            torch.testing.assert_close(run["steps"][s][1], aux["max_attn_logit"], rtol=1e-5, atol=1e-6)
        clipped_some |= bool((aux["max_attn_logit"] > tau).any())
        with torch.no_grad():
            params, state = opt.update(hpf.tree.unflatten(treedef, list(grads)), state,
                                       hpf.tree.unflatten(treedef, [p.detach() for p in leaves]), aux=aux)
    assert clipped_some
    for run in runs:  # tolerance as test_dist_muon's TRAIN_TOL: the sharded grads sum in another order
        for got, want in zip(run["params"], hpf.tree.flatten(params)[1], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
