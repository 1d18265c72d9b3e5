"""Llama as pure functions over a plain dict pytree: RMSNorm, RoPE, grouped-query attention,
SwiGLU, tied or untied embeddings; the same math and weight layout as transformers'
``LlamaForCausalLM``, so ``from_hf``/``to_hf`` move weights without any permutation.

Params (each ``blocks`` element is one FSDP unit; matrices are [out, in] as in ``nn.Linear``)::

    {"embed": [V, D],
     "blocks": [{"attn_norm": [D], "wq": [H*hd, D], "wk": [KV*hd, D], "wv": [KV*hd, D],
                 "wo": [D, H*hd], "mlp_norm": [D], "w_gate": [F, D], "w_up": [F, D],
                 "w_down": [D, F]}, ...],
     "norm": [D], "head": [V, D]}   # tied: params["head"] is params["embed"] (one tensor)

RoPE is the "rotate_half" form (the two halves of each head are the pair), as transformers
computes it; HF checkpoints store q_proj/k_proj already permuted for that form, so weights
load unchanged (tests/test_llama.py checks it against transformers). As in gpt.py, the
forward only iterates ``params["blocks"]`` once, in order.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from einops import rearrange

from ..comm.collectives import axis_index, current
from ..losses import token_cross_entropy
from ..spec import shares
from . import recompute as recompute_
from .layers import (INIT_STD, tp_sum, unit_psums, block_dropout, check_dropout, check_sequence_parallel, dropout,
                     embedding_dropout, max_attention_logit, param_makers, rms_norm, seq_gather, seq_split,
                     tensor_parallel_specs, tokens_and_keys, tp_heads)
from .synthetic import synthetic_batches
from .spec import ModelSpec, dense_loss, dense_param_specs

__all__ = [
    "LlamaConfig", "CONFIGS", "num_params", "init", "forward", "loss", "loss_for",
    "from_hf", "to_hf", "synthetic_batches", "activations", "block", "qk_heads", "param_specs", "unit_psums",
    "attention",
]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    seq_len: int  # training window; RoPE itself has no length limit
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    head_dim: int | None = None  # None -> d_model // n_heads
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dropout: float = 0.0  # on the embeddings and each residual branch, as gpt's (keys in the batch)

    def __post_init__(self):
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(f"LlamaConfig.d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                                 "pick n_heads that divides d_model or give head_dim")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "head_dim"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value > 0):
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig.n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}; "
                             "each key/value head serves a whole group of query heads")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        check_dropout(self.dropout, "LlamaConfig")


CONFIGS: dict[str, LlamaConfig] = {
    # Odd sizes (GQA 6 heads on 2 kv heads, head_dim 4, d_ff 37): shards over 2-4 ranks need padding.
    "tiny": LlamaConfig(vocab_size=67, seq_len=16, d_model=24, n_layers=3, n_heads=6, n_kv_heads=2, d_ff=37),
    # ~1.3M params: learns byte-level text on CPU in a few minutes (`hpf train --model llama --data`).
    "small": LlamaConfig(vocab_size=256, seq_len=128, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=344),
    # Llama-3.2-1B's shapes: for planning on meta tensors.
    "1b": LlamaConfig(vocab_size=128256, seq_len=2048, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                      d_ff=8192, rope_theta=500000.0, tie_embeddings=True),
}


def num_params(config: LlamaConfig) -> int:
    """Parameter count from the config alone (a tied head counts once)."""
    c = config
    attn = c.d_model * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)
    block = 2 * c.d_model + attn + 3 * c.d_model * c.d_ff
    return c.vocab_size * c.d_model * (1 if c.tie_embeddings else 2) + c.n_layers * block + c.d_model


def init(config: LlamaConfig, key: torch.Tensor | None = None, *,
         device=None, dtype: torch.dtype = torch.float32) -> dict:
    """Fresh params, drawn as gpt.init draws them (one hpf.random key per matrix, default
    ``hpf.random.key(0)``), so every rank and mesh gets bit-identical params; ``device="meta"``
    draws nothing. wo and w_down are scaled by
    1/sqrt(2*n_layers) as in GPT-2. Tied: ``params["head"] is params["embed"]``."""
    c = config
    normal, ones = param_makers(key, device, dtype)
    d, f, q, kv = c.d_model, c.d_ff, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    residual_std = INIT_STD / math.sqrt(2 * c.n_layers)
    embed = normal(c.vocab_size, d)
    blocks = [{"attn_norm": ones(d), "wq": normal(q, d), "wk": normal(kv, d), "wv": normal(kv, d),
               "wo": normal(d, q, std=residual_std), "mlp_norm": ones(d), "w_gate": normal(f, d),
               "w_up": normal(f, d), "w_down": normal(d, f, std=residual_std)} for _ in range(c.n_layers)]
    return {"embed": embed, "blocks": blocks, "norm": ones(d),
            "head": embed if c.tie_embeddings else normal(c.vocab_size, d)}


def rope_cos_sin(config: LlamaConfig, t: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [t, head_dim] for positions 0..t-1, computed in fp32 as transformers does."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))
    freqs = torch.arange(t, device=device).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def block(blk: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, c: LlamaConfig, max_logits: bool = False,
          p: float = 0.0, keys: torch.Tensor | None = None, tp_axis: str | None = None, seq: bool = False):
    """One block on the residual stream x [B, T, D]: RoPE grouped-query attention, then SwiGLU;
    with ``max_logits``, (x, its heads' max attention logits [H]); ``p``, ``keys``: dropout on
    both residual branches (layers.dropout). Head counts come from the weights' shapes, so under
    tensor parallelism (``tp_axis``, ``param_specs``) each rank runs its own heads and MLP columns,
    and the row-parallel outputs are summed over the axis (Megatron); ``seq``: sequence parallel (gpt.block)."""
    h = seq_gather(rms_norm(x, blk["attn_norm"], c.norm_eps), tp_axis, seq)
    a, q, k = attention(blk, h, cos, sin, c, tp_axis)
    x = x + dropout(tp_sum(a, tp_axis, seq), p, keys, 0)
    h = seq_gather(rms_norm(x, blk["mlp_norm"], c.norm_eps), tp_axis, seq)
    up = F.silu(F.linear(h, blk["w_gate"])) * F.linear(h, blk["w_up"])
    x = x + dropout(tp_sum(F.linear(up, blk["w_down"]), tp_axis, seq), p, keys, 1)
    return (x, tp_heads(max_attention_logit(q, k), tp_axis, c.n_heads)) if max_logits else x


def attention(blk: dict, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, c: LlamaConfig,
              tp_axis: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(this rank's part of the attention's row-parallel product [B, T, D], q, k): its query heads
    are its rows of wq (``param_specs``). Its key heads are its rows of wk and wv where those are
    split, or, where they are replicated over tp (a tp size that does not divide n_kv_heads), the
    ones its query heads use, read from the whole wk and wv (Megatron replicates kv heads so)."""
    hd, nq = c.head_dim, blk["wq"].shape[0] // c.head_dim
    wk, wv, index = blk["wk"], blk["wv"], None
    if wk.shape[0] == c.n_kv_heads * hd and nq < c.n_heads:  # replicated key heads: read the ones used
        first = sum(shares(c.n_heads, _ranks(tp_axis))[:int(axis_index(tp_axis))])
        group = c.n_heads // c.n_kv_heads
        lo, hi = first // group, (first + nq - 1) // group + 1
        wk, wv = wk[lo * hd:hi * hd], wv[lo * hd:hi * hd]
        index = torch.arange(first, first + nq, device=h.device) // group - lo  # each query head's key head
    elif wk.shape[0] % hd or nq % (wk.shape[0] // hd or 1):
        raise ValueError(f"tensor parallelism splits a key head: n_kv_heads={c.n_kv_heads} over a tp axis that does "
                         "not divide it; use llama.param_specs(config, tp_axis, data_axes, tp=<the tp size>), which "
                         "replicates the key heads then")
    q = rearrange(F.linear(h, blk["wq"]), "b t (h e) -> b h t e", e=hd)
    k = rearrange(F.linear(h, wk), "b t (h e) -> b h t e", e=hd)
    v = rearrange(F.linear(h, wv), "b t (h e) -> b h t e", e=hd)
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    if index is not None:
        k, v = k.index_select(1, index), v.index_select(1, index)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return F.linear(rearrange(attn, "b h t e -> b t (h e)"), blk["wo"]), q, k


def _ranks(tp_axis: str) -> int:
    ctx = current()
    return ctx.mesh.axis_size(ctx.axes(tp_axis, "axis_index")) if ctx is not None else 1


def param_specs(config: LlamaConfig, tp_axis: str | None = None, data_axes=("dp",), tp: int | None = None):
    """Megatron tensor parallelism over ``tp_axis`` (layers.tensor_parallel_specs, as gpt.param_specs):
    wq, wk, wv, w_gate and w_up split their output rows, wo and w_down their input columns, in whole heads, unevenly where
    the tp size does not divide the heads. ``tp``: the axis's size; where it does not divide
    n_kv_heads, wk and wv are replicated over it and each rank reads the key heads its query heads
    use (``attention``); without it they split, which needs a tp size that divides n_kv_heads."""
    hd = config.head_dim
    kv = () if tp is not None and config.n_kv_heads % tp else ((r"blocks/\d+/(wk|wv)", hd),)
    return tensor_parallel_specs(config, tp_axis, data_axes, tp=tp,
                                 column=((r"blocks/\d+/wq", hd), *kv, (r"blocks/\d+/(w_gate|w_up)", 1)),
                                 row=((r"blocks/\d+/wo", hd), (r"blocks/\d+/w_down", 1)), transposed=True)


def qk_heads(config: LlamaConfig) -> dict:
    """QK-Clip's map (as gpt.qk_heads): the rows of head h of block l in ``wq`` [H*hd, D] and
    ``wk`` carry head l * H + h. With n_kv_heads == n_heads both are scaled by sqrt(gamma); a key
    head that grouped-query attention shares is left alone and the query takes all of gamma,
    Kimi K2's rule for MLA's shared rotary key."""
    c = config
    rows = torch.arange(c.n_heads).repeat_interleave(c.head_dim)
    out = {}
    for i in range(c.n_layers):
        if c.n_kv_heads == c.n_heads:
            out[f"blocks/{i}/wq"] = out[f"blocks/{i}/wk"] = (0, rows + i * c.n_heads, 0.5)
        else:
            out[f"blocks/{i}/wq"] = (0, rows + i * c.n_heads, 1.0)
    return out


def forward(params: dict, tokens: torch.Tensor, *, config: LlamaConfig | None = None,
            recompute: str = "none", compile: bool = False, max_logits: bool = False,
            keys: torch.Tensor | None = None, tp_axis: str | None = None, sequence_parallel: bool = False):
    """Logits [B, T, V] for int64 tokens [B, T]; computes in the params' dtype. ``recompute``:
    which blocks recompute their forward in backward; ``compile``: each block runs
    ``torch.compile``'d (hpf.models.recompute); ``max_logits``: (logits, every head's max
    attention logit [n_layers, n_heads]); ``keys``: the examples' keys for ``config.dropout``
    (drawn as gpt.forward draws them); ``tp_axis``, ``sequence_parallel``: as gpt.forward's."""
    if config is None:
        raise TypeError("llama.forward/llama.loss need config= (head counts are not all visible in the shapes); "
                        "use llama.loss_for(config) as the loss_fn")
    if tokens.dim() != 2 or tokens.dtype != torch.int64:
        raise ValueError(f"tokens must be an int64 tensor [batch, time], got {tokens.dtype} {list(tokens.shape)}")
    c = config
    check_sequence_parallel(sequence_parallel, tp_axis, c.dropout)
    x = embedding_dropout(F.embedding(tokens, params["embed"]), c.dropout, keys)
    cos, sin = rope_cos_sin(c, tokens.shape[1], x.device, x.dtype)
    x = seq_split(x, tp_axis, sequence_parallel)
    logits = []
    for i, run in recompute_.each_block(params["blocks"], recompute, compile, cache=tp_axis is None):
        drop = block_dropout(c.dropout, keys, i)
        if max_logits:
            x, s = run(block, x, cos, sin, c, True, *drop, tp_axis, sequence_parallel)
            logits.append(s)
        else:
            x = run(block, x, cos, sin, c, False, *drop, tp_axis, sequence_parallel)
    out = F.linear(rms_norm(seq_gather(x, tp_axis, sequence_parallel), params["norm"], c.norm_eps), params["head"])
    return (out, torch.stack(logits)) if max_logits else out


def loss(params: dict, batch, *, config: LlamaConfig | None = None, recompute: str = "none",
         weighted: bool = False, compile: bool = False, max_logits: bool = False, tp_axis: str | None = None,
         sequence_parallel: bool = False):
    """Next-token cross-entropy of ``batch`` [B, T+1] over ``batch[:, 1:]`` (transformers'
    ``labels=batch``; -100 is padding); the softmax runs in fp32 for any param dtype. The mean,
    or (``weighted``) ``hpf.weighted(sum, count)`` for the step to divide by the global count.
    With ``config.dropout`` the batch is ``{"tokens": ..., "keys": ...}`` (layers.tokens_and_keys)."""
    batch, keys = tokens_and_keys(batch, config.dropout if config is not None else 0.0)
    if batch.dim() != 2 or batch.shape[1] < 2:
        raise ValueError(f"batch must be [batch, time+1] token ids with time+1 >= 2, got shape {list(batch.shape)}")
    out = forward(params, batch[:, :-1], config=config, recompute=recompute, compile=compile, max_logits=max_logits,
                  keys=keys, tp_axis=tp_axis, sequence_parallel=sequence_parallel)
    if max_logits:  # the aux of gpt.loss(max_logits=True)
        return token_cross_entropy(out[0], batch[:, 1:], weighted=weighted), {"max_attn_logit": out[1]}
    return token_cross_entropy(out, batch[:, 1:], weighted=weighted)


def loss_for(config: LlamaConfig, recompute: str = "none", weighted: bool = False, compile: bool = False,
             max_logits: bool = False, tp_axis: str | None = None, sequence_parallel: bool = False):
    """``loss_fn(params, batch)`` for ``config``: what ``hpf.shard_step`` takes. ``recompute``:
    "none", "all" or "every_other" block recomputes its forward in backward (less memory);
    ``weighted``: return ``hpf.weighted(sum, count)``; ``compile``: each block is ``torch.compile``'d;
    ``max_logits``: also return the heads' max attention logits as an aux (for QK-Clip); ``tp_axis``,
    ``sequence_parallel``: as gpt.loss_for's."""
    check_sequence_parallel(sequence_parallel, tp_axis, config.dropout)
    return functools.partial(loss, config=config, recompute=recompute_.check(recompute), weighted=weighted,
                             compile=compile, max_logits=max_logits, tp_axis=tp_axis,
                             sequence_parallel=sequence_parallel)


def activations(config: LlamaConfig, local_batch: int, dtype_bytes: int = 4, tp: int = 1) -> recompute_.Activations:
    """What ``loss`` keeps for backward on ``local_batch`` sequences (hpf.memory's hook): per block,
    both norms' fp32 input and rsqrt and their output before and after the weight, q and k after
    RoPE and v, the attention output and its fp32 logsumexp per head, SwiGLU's gate, up, SiLU and
    product (4f); its backward holds about f + d more at once. ``tp``: a tensor-parallel rank's
    (``param_specs``): 1/tp of the heads and MLP columns, the norms whole."""
    c, b = config, dtype_bytes
    n = local_batch * c.seq_len
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    norm = recompute_.norm_bytes(c.d_model, b)
    saved = n * (2 * norm + (2 * q + 2 * kv + 4 * c.d_ff) * b // tp + 4 * c.n_heads // tp)
    return recompute_.Activations.of(n, c.d_model, c.vocab_size, b, [saved] * c.n_layers,
                                     [n * (c.d_ff // tp + c.d_model) * b] * c.n_layers)


# ---------------------------------------------------------------- transformers checkpoints

#: What the hpf tools need of Llama (hpf.models.ModelSpec); no unit_flops: the tools count 2 x params x tokens.
SPEC = ModelSpec(name="llama", configs=CONFIGS, init=init, loss=dense_loss(loss_for), num_params=num_params,
                 param_specs=dense_param_specs(param_specs), unit_psums=unit_psums, activations=activations,
                 forward=forward, qk_heads=qk_heads)


_HF_BLOCK = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
             "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def _safetensors():
    try:
        import safetensors.torch
    except ModuleNotFoundError:
        raise ModuleNotFoundError("llama.from_hf/to_hf need the safetensors package: pip install safetensors "
                                  "(the hf extra: pip install -e '.[hf]')") from None
    return safetensors.torch


def _config_from_hf(hf: dict, path: Path) -> LlamaConfig:
    if hf.get("model_type", "llama") != "llama":
        raise ValueError(f"{path}/config.json has model_type={hf.get('model_type')!r}; llama.from_hf reads Llama only")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"{path}/config.json asks for RoPE scaling {rope!r}; only plain RoPE is implemented")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"{path}/config.json sets {flag}=true; hpf's Llama has no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}/config.json has hidden_act={hf['hidden_act']!r}; only silu (SwiGLU) is implemented")
    heads = hf["num_attention_heads"]
    return LlamaConfig(
        vocab_size=hf["vocab_size"], seq_len=hf.get("max_position_embeddings", 2048), d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"], n_heads=heads, n_kv_heads=hf.get("num_key_value_heads") or heads,
        d_ff=hf["intermediate_size"], head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def from_hf(path: str | Path, dtype: torch.dtype | None = None) -> tuple[LlamaConfig, dict]:
    """(config, params) from a local transformers Llama folder: config.json plus model.safetensors
    or shards listed in model.safetensors.index.json. Nothing downloads. ``dtype``: cast to it
    (default: as stored). ``config.seq_len`` is max_position_embeddings."""
    st, path = _safetensors(), Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; give the folder save_pretrained wrote")
    config = _config_from_hf(json.loads((path / "config.json").read_text()), path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(st.load_file(str(path / name)))

    def take(key: str) -> torch.Tensor:
        if key not in tensors:
            raise KeyError(f"{path}: weight {key!r} is missing (files: {', '.join(files)})")
        t = tensors.pop(key)
        return t if dtype is None else t.to(dtype)

    embed = take("model.embed_tokens.weight")
    params = {"embed": embed,
              "blocks": [{k: take(f"model.layers.{i}.{hf}.weight") for k, hf in _HF_BLOCK.items()}
                         for i in range(config.n_layers)],
              "norm": take("model.norm.weight")}
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # some writers store the tied copy anyway
        params["head"] = embed
    else:
        params["head"] = take("lm_head.weight")
    leftover = sorted(k for k in tensors if "rotary_emb" not in k)
    if leftover:
        raise ValueError(f"{path}: weights hpf's Llama does not know: {leftover[:5]}{' ...' if len(leftover) > 5 else ''}")
    return config, params


def to_hf(config: LlamaConfig, params: dict, path: str | Path) -> None:
    """Write config.json + model.safetensors that ``LlamaForCausalLM.from_pretrained(path)`` loads.
    Tied: the head is not stored (as transformers saves it)."""
    st, path = _safetensors(), Path(path)
    c = config
    if c.tie_embeddings and params["head"] is not params["embed"]:
        raise ValueError("config.tie_embeddings is set but params['head'] is not params['embed']; "
                         "tie them (params['head'] = params['embed']) or use a config with tie_embeddings=False")
    tensors = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["norm"]}
    for i, blk in enumerate(params["blocks"]):
        tensors.update({f"model.layers.{i}.{hf}.weight": blk[k] for k, hf in _HF_BLOCK.items()})
    if not c.tie_embeddings:
        tensors["lm_head.weight"] = params["head"]
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    dtype = str(params["embed"].dtype).removeprefix("torch.")
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
          "hidden_size": c.d_model, "intermediate_size": c.d_ff, "num_hidden_layers": c.n_layers,
          "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
          "max_position_embeddings": c.seq_len, "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta,
          "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
          "tie_word_embeddings": c.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
          "mlp_bias": False, "torch_dtype": dtype, "dtype": dtype}
    path.mkdir(parents=True, exist_ok=True)
    st.save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
