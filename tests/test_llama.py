"""hpf.models.llama against transformers' LlamaForCausalLM (built in-process from a LlamaConfig,
random init, nothing downloaded), the HF checkpoint round trip, and a sharded hpf run against
plain torch autograd + torch.optim.AdamW on the full model."""
import dataclasses
import math
import sys

import numpy as np
import pytest
import torch
import transformers  # the test extra; the library itself never imports it
from einops import rearrange

import hpf
from hpf.launcher import launch
from hpf.models import gpt, llama

# Odd sizes: d_model 30, 5 query heads on 1 kv head (GQA 5:1), head_dim 6, d_ff 37, vocab 67.
ODD = llama.LlamaConfig(vocab_size=67, seq_len=16, d_model=30, n_layers=2, n_heads=5, n_kv_heads=1, d_ff=37,
                        rope_theta=500.0, norm_eps=1e-5)
# fp32 tolerance against transformers: the same math in another op order (their eager softmax
# attention with repeat_kv vs SDPA with enable_gqa, rearrange vs view/transpose), so results
# differ by a few ulps through 2 layers. Measured: the losses agree bitwise and the worst grad
# element uses 7% of rtol 1e-5 / atol 1e-6 (max error 9e-7 of the largest grad), while a real
# mistake (RoPE interleaved instead of rotate_half, another rope_theta) moves the loss by
# >100x the tolerance (see test_rope_layout_mistake_is_caught).
TOL = dict(rtol=1e-5, atol=1e-6)


def hf_config(c: llama.LlamaConfig):
    return transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
        max_position_embeddings=c.seq_len, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_embeddings, attn_implementation="eager")


def hf_model(c: llama.LlamaConfig, seed: int = 0):
    """A random LlamaForCausalLM whose attention is sharp and norms are not ones: at HF's
    std-0.02 init attention is nearly uniform and SiLU nearly linear, which would hide mistakes."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_config(c)).float()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif "q_proj" in name or "k_proj" in name or "gate_proj" in name:
                p.mul_(15)
            elif "embed" in name or "lm_head" in name:
                p.mul_(10)
    return model


def batch_of(c, n=3, seed=0):
    return torch.randint(0, c.vocab_size, (n, c.seq_len + 1), generator=torch.Generator().manual_seed(seed))


def unique_leaves(params):
    """Leaves once each (a tied head is the embedding: one tensor, one grad)."""
    seen, out = set(), []
    for leaf in hpf.tree.flatten(params)[1]:
        if id(leaf) not in seen:
            seen.add(id(leaf))
            out.append(leaf)
    return out


def hf_named(params, c):
    """Our leaves by the HF parameter name they correspond to (unique tensors only)."""
    names = {id(params["embed"]): "model.embed_tokens.weight", id(params["norm"]): "model.norm.weight"}
    for i, blk in enumerate(params["blocks"]):
        for k, hf in llama._HF_BLOCK.items():
            names[id(blk[k])] = f"model.layers.{i}.{hf}.weight"
    names.setdefault(id(params["head"]), "lm_head.weight")
    return [(names[id(leaf)], leaf) for leaf in unique_leaves(params)]


@pytest.mark.tolerance
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_loss_and_every_grad_match_transformers(tmp_path, tied):
    c = dataclasses.replace(ODD, tie_embeddings=tied)
    model = hf_model(c)
    model.save_pretrained(tmp_path)
    config, params = llama.from_hf(tmp_path)
    assert config == c
    assert (params["head"] is params["embed"]) == tied
    batch = batch_of(c)

    named = hf_named(params, c)
    hf_params = dict(model.named_parameters())
    assert sorted(n for n, _ in named) == sorted(hf_params)  # every HF param has exactly one of ours
    for name, leaf in named:
        torch.testing.assert_close(leaf, hf_params[name].detach(), rtol=0, atol=0)
        leaf.requires_grad_(True)
    mine = llama.loss_for(config)(params, batch)
    grads = torch.autograd.grad(mine, [leaf for _, leaf in named])
    ref = model(input_ids=batch, labels=batch).loss
    ref.backward()

    assert 2.0 < ref.item() < 10.0  # sharp attention: far from uniform ln(67)=4.2 in either direction is fine
    torch.testing.assert_close(mine, ref, **TOL)
    for (name, _), g in zip(named, grads):
        want = hf_params[name].grad
        assert want.abs().max() > 0, name
        torch.testing.assert_close(g, want, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_rope_layout_mistake_is_caught(tmp_path):
    """The tolerance above sees the classic conversion bug: q/k rows in the interleaved (Meta)
    RoPE layout instead of HF's rotate_half layout. Another rope_theta is caught too."""
    model = hf_model(ODD)
    model.save_pretrained(tmp_path)
    config, params = llama.from_hf(tmp_path)
    batch = batch_of(ODD)
    ref = model(input_ids=batch, labels=batch).loss.item()
    bound = 100 * (TOL["atol"] + TOL["rtol"] * ref)  # 100x what the comparison allows

    def interleaved(w, heads):  # transformers' convert_llama_weights_to_hf permute, undone
        return rearrange(w, "(h two half) d -> (h half two) d", h=heads, two=2)
    for blk in params["blocks"]:
        blk["wq"], blk["wk"] = interleaved(blk["wq"], ODD.n_heads), interleaved(blk["wk"], ODD.n_kv_heads)
    assert abs(llama.loss_for(config)(params, batch).item() - ref) > bound
    _, params = llama.from_hf(tmp_path)
    other_theta = llama.loss_for(dataclasses.replace(config, rope_theta=10000.0))(params, batch)
    assert abs(other_theta.item() - ref) > bound


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_to_hf_from_pretrained_from_hf_round_trip(tmp_path, tied):
    c = dataclasses.replace(ODD, tie_embeddings=tied)
    params = llama.init(c, hpf.random.key(3))
    llama.to_hf(c, params, tmp_path / "ours")
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours")
    for name, leaf in hf_named(params, c):  # transformers loaded every weight we wrote, unchanged
        torch.testing.assert_close(dict(model.named_parameters())[name].detach(), leaf, rtol=0, atol=0)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    batch = batch_of(c, seed=4)
    torch.testing.assert_close(llama.loss_for(c)(params, batch), model(input_ids=batch, labels=batch).loss, **TOL)

    model.save_pretrained(tmp_path / "theirs")
    config, back = llama.from_hf(tmp_path / "theirs")
    assert config == c
    assert hpf.tree.structure(back) == hpf.tree.structure(params)
    for a, b in zip(hpf.tree.flatten(back)[1], hpf.tree.flatten(params)[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (back["head"] is back["embed"]) == tied


def test_from_hf_reads_sharded_checkpoints(tmp_path):
    model = hf_model(ODD)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    config, params = llama.from_hf(tmp_path)
    batch = batch_of(ODD, seed=5)
    torch.testing.assert_close(llama.loss_for(config)(params, batch), model(input_ids=batch, labels=batch).loss, **TOL)


def test_from_hf_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        llama.from_hf(tmp_path)
    llama.to_hf(ODD, llama.init(ODD), tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        llama.from_hf(tmp_path)
    tied = dataclasses.replace(ODD, tie_embeddings=True)
    with pytest.raises(ValueError, match="tie"):
        llama.to_hf(tied, llama.init(ODD), tmp_path / "x")


def test_init_meta_shapes_tied_and_param_count():
    for name, c in llama.CONFIGS.items():
        params = llama.init(c, device="meta")
        assert sum(x.numel() for x in unique_leaves(params)) == llama.num_params(c), name
        assert (params["head"] is params["embed"]) == c.tie_embeddings
    assert 1.1e9 < llama.num_params(llama.CONFIGS["1b"]) < 1.3e9  # Llama-3.2-1B: 1.24B


def test_config_rejects_bad_head_counts():
    with pytest.raises(ValueError, match="n_kv_heads"):
        llama.LlamaConfig(vocab_size=8, seq_len=4, d_model=12, n_layers=1, n_heads=6, n_kv_heads=4, d_ff=8)
    with pytest.raises(ValueError, match="even"):
        llama.LlamaConfig(vocab_size=8, seq_len=4, d_model=15, n_layers=1, n_heads=5, n_kv_heads=1, d_ff=8)


def test_tiny_trains_on_cpu():
    c = llama.CONFIGS["tiny"]
    params = llama.init(c)
    leaves = [p.requires_grad_() for p in unique_leaves(params)]
    opt = torch.optim.AdamW(leaves, lr=1e-2)
    data = gpt.synthetic_batches(c, 16, seed=0)
    losses = []
    for _ in range(40):
        value = llama.loss_for(c)(params, next(data))
        opt.zero_grad()
        value.backward()
        opt.step()
        losses.append(value.item())
    assert losses[0] == pytest.approx(math.log(c.vocab_size), abs=0.2)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


# ------------------------------------------------------------------ sharded hpf vs plain torch

STEPS, BATCH, SEED = 4, 8, 0
ADAMW = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
LR = 1e-2
SCHEDULE = hpf.optim.lr_schedules.cosine(LR, total_steps=STEPS, warmup=2, min_lr=1e-3)
SHARDED = llama.CONFIGS["tiny"]  # untied: tied weights in shard_step are another change's subject


def reference_run(masked):
    """Plain autograd + torch.optim.AdamW on the full model; ``masked``: a no-decay param group
    for norms and embeddings and the cosine schedule through LambdaLR."""
    params = llama.init(SHARDED, hpf.random.key(SEED))
    paths, leaves, _ = hpf.tree.flatten(params)
    for x in leaves:
        x.requires_grad_(True)
    decay = [hpf.optim.default_weight_decay_mask(p, x) or not masked for p, x in zip(paths, leaves)]
    opt = torch.optim.AdamW([{"params": [x for x, d in zip(leaves, decay) if d]},
                             {"params": [x for x, d in zip(leaves, decay) if not d], "weight_decay": 0.0}],
                            lr=LR, **ADAMW)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: SCHEDULE(e + 1) / LR if masked else 1.0)
    losses = []
    for s in range(STEPS):
        loss = llama.loss_for(SHARDED)(params, gpt.global_batch(SHARDED, BATCH, SEED, s))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, [p.detach().numpy() for p in leaves]


def sharded_runs(rank):
    mesh = hpf.Mesh({"dp": 2})
    out = {}
    for masked in (False, True):
        optimizer = (hpf.optim.adamw(lr=SCHEDULE, weight_decay_mask=hpf.optim.default_weight_decay_mask, **ADAMW)
                     if masked else hpf.optim.adamw(lr=LR, **ADAMW))
        step = hpf.shard_step(llama.loss_for(SHARDED), mesh=mesh, optimizer=optimizer)
        state = step.init(llama.init(SHARDED, hpf.random.key(SEED)))
        batches = gpt.synthetic_batches(SHARDED, BATCH, SEED, rank=rank, world_size=mesh.size)
        losses = []
        for _ in range(STEPS):
            state, metrics = step(state, next(batches))  # the state is donated: keep the returned one
            losses.append(metrics["loss"])
        out[masked] = losses, [p.numpy() for p in hpf.tree.flatten(step.full_params(state))[1]]
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return launch(sharded_runs, 2, timeout=240)[0]


@pytest.mark.tolerance
@pytest.mark.slow
@pytest.mark.parametrize("masked", [False, True], ids=["plain_adamw", "decay_mask_and_cosine"])
def test_two_rank_hpf_llama_matches_torch_adamw(two_ranks, masked):
    losses, params = two_ranks[masked]
    ref_losses, ref_params = reference_run(masked)
    # Tolerances as in tests/test_step.py: per-rank means then a reduce-scatter sum the same
    # numbers in another order (a few ulps); AdamW amplifies ulp noise in near-cancelling grad
    # elements to ~1e-6 absolute on updates of size lr=1e-2, so params get atol lr/500. A norm
    # that decays when it should not moves by lr*wd*|p| = 1e-3 per step: 50x that.
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert ref_losses[-1] < ref_losses[0] - 0.1  # it trained: the comparison is not of 4 idle steps
    for got, want in zip(params, ref_params):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)


def test_missing_safetensors_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ModuleNotFoundError, match="pip install safetensors"):
        llama.to_hf(ODD, llama.init(ODD), tmp_path)
