"""A dense decoder-only transformer written as pure functions over a plain dict pytree.

The model is data, not a Module: ``init`` returns a dict of tensors and ``loss``/``forward``
read it. That is what lets the sharding engine hand in gathered (or lazily gathered) params
without any wrapping. ``params["blocks"]`` is a Python list, so each block becomes one FSDP
unit, and the functions only *iterate* it in order (never ``len()``, never random access),
because the engine passes a lazy list whose iteration gathers units on demand.

The number of heads is not visible in the tensor shapes, so ``forward``/``loss`` take it as a
keyword; ``loss_for(config)`` binds it and gives the ``loss_fn(params, batch)`` that
``hpf.shard_step`` expects.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from einops import rearrange

from .. import random as hpf_random
from ..comm.collectives import all_gather, axis_index, current, psum, psum_scatter
from ..losses import token_cross_entropy
from ..spec import shares
from . import recompute as recompute_

__all__ = [
    "GPTConfig", "CONFIGS", "num_params", "init", "forward", "loss", "loss_for",
    "global_batch", "synthetic_batches", "unit_flops", "activations", "block", "max_attention_logit", "qk_heads",
    "param_specs", "unit_psums", "attention", "mlp",
]

NORM_EPS = 1e-5
INIT_STD = 0.02
SUCCESSORS_PER_TOKEN = 4  # each token of the synthetic Markov source has this many likely successors


def check_dropout(p, where: str) -> None:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"{where}.dropout must be a float in [0, 1), got {p!r}")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int | None = None  # None -> 4 * d_model
    dropout: float = 0.0  # on the embeddings and each residual branch; needs keys in the batch (see ``loss``)

    def __post_init__(self):
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) > 0):
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        check_dropout(self.dropout, "GPTConfig")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                f"pick n_heads that divides d_model"
            )


CONFIGS: dict[str, GPTConfig] = {
    # Awkward on purpose: leaf, block-unit and root-unit sizes are odd or 2 mod 4 and not
    # multiples of 3, so sharding over 2, 3 or 4 ranks always needs padding.
    "tiny": GPTConfig(vocab_size=67, seq_len=16, d_model=25, n_layers=3, n_heads=5, d_ff=38),
    # A few M params: CPU benchmarks and multi-process tests that must learn something.
    "small": GPTConfig(vocab_size=512, seq_len=128, d_model=256, n_layers=4, n_heads=4),
    # GPT-2-small-like shapes with a 32k vocab.
    "medium": GPTConfig(vocab_size=32000, seq_len=1024, d_model=768, n_layers=12, n_heads=12),
    # About 1B params: only for planning on meta tensors.
    "1b": GPTConfig(vocab_size=32000, seq_len=2048, d_model=2048, n_layers=18, n_heads=16),
}


def num_params(config: GPTConfig) -> int:
    """Parameter count from the config alone (no tensors), e.g. for plans and reports."""
    d, f, v = config.d_model, config.d_ff, config.vocab_size
    block = 2 * d + 3 * d * d + d * d + 2 * d * f
    return v * d + config.seq_len * d + config.n_layers * block + d + d * v


def param_makers(key, device, dtype: torch.dtype):
    """(normal(*shape, std=INIT_STD), ones(n)) for an ``init``: the i-th normal draw is
    ``hpf.random.normal(fold_in(key, i), shape)`` (key None: ``hpf.random.key(0)``), in fp32 and
    then cast and moved, so every device and every sharding gets the same bits
    (``step.init(init_fn, key=...)`` draws each rank's shards alone); on the meta device they draw
    nothing."""
    on_meta = device is not None and torch.device(device).type == "meta"
    if isinstance(key, torch.Generator):
        raise TypeError("the models draw from hpf.random keys: pass hpf.random.key(seed) (a torch.Generator "
                        "draws one param after another, so no rank could draw its shard alone)")
    if key is None and not on_meta:
        key = hpf_random.key(0)
    drawn = iter(range(1 << 62))

    def normal(*shape: int, std: float = INIT_STD) -> torch.Tensor:
        if on_meta:
            return torch.empty(shape, device="meta", dtype=dtype)
        return (hpf_random.normal(hpf_random.fold_in(key, next(drawn)), shape) * std).to(device=device, dtype=dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)
    return normal, ones


def init(config: GPTConfig, key: torch.Tensor | None = None, *,
         device=None, dtype: torch.dtype = torch.float32) -> dict:
    """Fresh params as a plain dict pytree.

    Each matrix is a draw of ``hpf.random`` under its own key, ``fold_in(key, i)`` (default
    key: ``hpf.random.key(0)``), so every rank, device and mesh gets bit-identical params, and
    ``step.init(functools.partial(gpt.init, config), key=key)`` builds each rank's shards alone;
    ``device="meta"`` draws nothing. Residual projections (w_o, w_down) are scaled by
    1/sqrt(2*n_layers) as in GPT-2.
    """
    c = config
    normal, ones = param_makers(key, device, dtype)
    residual_std = INIT_STD / math.sqrt(2 * c.n_layers)
    d, f = c.d_model, c.d_ff
    return {
        "embed": normal(c.vocab_size, d),
        "pos": normal(c.seq_len, d),
        "blocks": [
            {
                "norm1": ones(d),
                "w_qkv": normal(d, 3 * d),
                "w_o": normal(d, d, std=residual_std),
                "norm2": ones(d),
                "w_up": normal(d, f),
                "w_down": normal(f, d, std=residual_std),
            }
            for _ in range(c.n_layers)
        ],
        "norm_f": ones(d),
        "head": normal(d, c.vocab_size),
    }


def tokens_and_keys(batch, dropout: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A batch is token ids, or ``{"tokens": ids, "keys": keys}`` with one hpf.random key per
    example (``hpf.random.example_keys``): dropout's masks are drawn from those keys alone, so
    they do not depend on how examples are split over ranks and micro-batches, and a recomputed
    block draws the same masks again."""
    if isinstance(batch, dict):
        if set(batch) != {"tokens", "keys"}:
            raise ValueError(f"a dict batch has the keys 'tokens' and 'keys', got {sorted(batch)}")
        tokens, keys = batch["tokens"], batch["keys"]
        if not (isinstance(keys, torch.Tensor) and keys.dtype == torch.int64 and keys.shape == (tokens.shape[0], 2)):
            raise ValueError(f"batch['keys'] must be one hpf.random key per example, int64 [{tokens.shape[0]}, 2]; "
                             f"got {getattr(keys, 'dtype', type(keys).__name__)} {list(getattr(keys, 'shape', []))}")
        return tokens, keys
    if dropout > 0:
        raise ValueError(f"dropout={dropout} draws its masks from per-example keys: pass the batch as "
                         "{'tokens': tokens, 'keys': hpf.random.example_keys(step_key, first_example, n)} "
                         "(hpf train does this for --dropout)")
    return batch, None


def dropout(x: torch.Tensor, p: float, keys: torch.Tensor | None, site: int) -> torch.Tensor:
    """Inverted dropout of x [B, ...] with example b's mask drawn from ``fold_in(keys[b], site)``."""
    if not p or keys is None:
        return x
    keep = hpf_random.bernoulli(hpf_random.fold_in(keys, site), 1.0 - p, x.shape[1:])
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = NORM_EPS) -> torch.Tensor:
    """RMSNorm as transformers' LlamaRMSNorm: normalize in fp32, cast back, then scale. In fp16
    the rsqrt's backward (its cube) overflows to inf for any input of rms below 0.025, so a
    norm computed in fp16 makes every step's grads non-finite at init (std 0.02)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def block(blk: dict, x: torch.Tensor, n_heads: int, max_logits: bool = False, p: float = 0.0,
          keys: torch.Tensor | None = None, tp_axis: str | None = None, seq: bool = False):
    """One pre-norm transformer block on the residual stream x [B, T, D]; with ``max_logits``,
    (x, its heads' max attention logits [H]); ``p``, ``keys``: dropout on both residual branches.
    ``w_qkv``'s columns are head-major, ``(h three e)``, so a contiguous block of them holds whole
    heads: under tensor parallelism (``tp_axis``, param_specs) each rank computes its heads and its
    columns of the MLP, and the two row-parallel products are summed over the axis (Megatron).
    ``seq``: sequence parallel, x is this rank's block of T/tp positions (``seq_split``): the norms
    run on it, gathered along T before each column-parallel product, and each row-parallel sum is
    reduce-scattered back along T (``tp_sum``)."""
    h = seq_gather(rms_norm(x, blk["norm1"]), tp_axis, seq)
    a, q, k = attention(blk, h, n_heads)
    x = x + dropout(tp_sum(a, tp_axis, seq), p, keys, 0)
    h = seq_gather(rms_norm(x, blk["norm2"]), tp_axis, seq)
    x = x + dropout(tp_sum(mlp(blk, h), tp_axis, seq), p, keys, 1)
    return (x, tp_heads(max_attention_logit(q, k), tp_axis, n_heads)) if max_logits else x


def attention(blk: dict, h: torch.Tensor, n_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(this rank's part of the attention's row-parallel product [B, T, D], q, k) of the normed
    stream h: its heads are its columns of ``w_qkv`` (whole heads, ``param_specs``)."""
    e = h.shape[-1] // n_heads
    if blk["w_qkv"].shape[1] % (3 * e):
        raise ValueError(f"tensor parallelism splits the {n_heads} heads of w_qkv mid-head (a rank's block has "
                         f"{blk['w_qkv'].shape[1]} columns, not whole heads of 3 x {e}): use a tp size that divides "
                         "n_heads, or gpt.param_specs, which splits in whole heads")
    q, k, v = rearrange(h @ blk["w_qkv"], "b t (h three e) -> three b h t e", three=3, e=e)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return rearrange(attn, "b h t e -> b t (h e)") @ blk["w_o"], q, k


def mlp(blk: dict, h: torch.Tensor) -> torch.Tensor:
    """This rank's part of the MLP's row-parallel product: its columns of w_up, rows of w_down."""
    return F.gelu(h @ blk["w_up"], approximate="tanh") @ blk["w_down"]


def tp_sum(x: torch.Tensor, tp_axis: str | None, seq: bool = False) -> torch.Tensor:
    """A row-parallel product's partial sums [B, T, D], summed over the tensor-parallel axis; with
    ``seq`` (sequence parallel) each rank keeps its block of T/tp positions of the sum."""
    if tp_axis is None:
        return x
    return psum_scatter(x, tp_axis, dim=1) if seq else psum(x, tp_axis)


def seq_gather(x: torch.Tensor, tp_axis: str | None, seq: bool) -> torch.Tensor:
    """Sequence parallel: every rank's block of positions [B, T/tp, D], gathered along T."""
    return all_gather(x, tp_axis, dim=1) if seq and tp_axis is not None else x


def seq_split(x: torch.Tensor, tp_axis: str | None, seq: bool) -> torch.Tensor:
    """Sequence parallel: this rank's block of T/tp positions of a replicated x [B, T, D]."""
    if not seq or tp_axis is None:
        return x
    ctx = current()
    ranks = ctx.mesh.axis_size(ctx.axes(tp_axis, "sequence parallelism")) if ctx is not None else 1
    if x.shape[1] % ranks:
        raise ValueError(f"sequence parallelism splits the {x.shape[1]} positions over {tp_axis!r} ({ranks} ranks): "
                         f"use a sequence length divisible by {ranks}")
    n = x.shape[1] // ranks
    return x.narrow(1, axis_index(tp_axis) * n, n)


def check_sequence_parallel(seq: bool, tp_axis: str | None, dropout_p: float) -> None:
    if seq and tp_axis is None:
        raise ValueError("sequence_parallel=True splits the norms' positions over the tensor-parallel axis: give "
                         "tp_axis too")
    if seq and dropout_p:
        raise ValueError(f"sequence_parallel=True with dropout={dropout_p}: the masks would be drawn per block of "
                         "positions, not as the whole sequence's; train with dropout 0 or without sequence parallelism")


def tp_heads(per_head: torch.Tensor, tp_axis: str | None, n_heads: int | None = None) -> torch.Tensor:
    """A per-head value [H_local] of every rank's heads, in head order [H]. Ranks may hold unequal
    numbers of heads (``shares`` of ``n_heads``): each pads to the most, and the padding is dropped."""
    if tp_axis is None:
        return per_head
    ctx = current()
    ranks = ctx.mesh.axis_size(ctx.axes(tp_axis, "all_gather")) if ctx is not None else 1
    sizes = shares(n_heads, ranks) if n_heads is not None else [per_head.shape[0]] * ranks
    most = max(sizes)
    if per_head.shape[0] < most:
        per_head = torch.cat([per_head, per_head.new_full((most - per_head.shape[0],), -math.inf)])
    out = all_gather(per_head, tp_axis)
    return out if most * ranks == sum(sizes) else torch.cat([b[:k] for b, k in zip(out.split(most), sizes)])


def param_specs(config, tp_axis: str | None = None, data_axes=("dp",), column=(), row=(), transposed=False,
                tp: int | None = None):
    """Megatron tensor parallelism over ``tp_axis`` as shard_step's ``param_specs``: the paths
    matching ``column`` split their output features over it, those matching ``row`` their input
    features (dims 1 and 0 of an ``x @ w`` weight; 0 and 1 where ``transposed``, ``F.linear``'s
    [out, in]); each is stored FSDP-sharded over ``data_axes``, as is every other param. ``column``
    and ``row`` are (regex, granule) pairs: a split keeps blocks of ``granule`` whole (a head's
    features) and may be uneven (``P(granule=)``: 5 heads over 2 ranks are 3 and 2). None without
    ``tp_axis`` (every param FSDP-sharded). ``tp``: the axis's size, to refuse one larger than the
    heads here, in the config's words. Use with ``shard_step(..., fsdp_axes=data_axes)`` and
    ``loss_for(config, tp_axis=...)``."""
    from ..spec import P, rules

    if tp_axis is None:
        return None
    data = tuple(data_axes)
    if tp_axis in data:
        raise ValueError(f"tp_axis={tp_axis!r} is one of the data axes {data}: tensor parallelism splits the "
                         "model over an axis of its own; pass the other axes as the data axes")
    check_heads(config, tp)
    e = config.d_model // config.n_heads
    column = column or ((r"blocks/\d+/w_qkv", 3 * e), (r"blocks/\d+/w_up", 1))
    row = row or ((r"blocks/\d+/w_o", e), (r"blocks/\d+/w_down", 1))

    def split(dim, granule):  # dim 0 or 1 of a matrix over tp, in whole blocks of granule
        entries = (tp_axis, None) if dim == 0 else (None, tp_axis)
        return P(*entries, fsdp=data, granule=(granule, 1) if dim == 0 else (1, granule))
    out_dim, in_dim = (0, 1) if transposed else (1, 0)
    return rules([*((c, split(out_dim, g)) for c, g in column), *((r, split(in_dim, g)) for r, g in row),
                  (r".*", P(data))])


def check_heads(config, tp: int | None) -> None:
    """Refuse a tensor-parallel size larger than the attention heads: each rank computes whole heads."""
    if tp is not None and tp > config.n_heads:
        fits = max(k for k in range(1, config.n_heads + 1) if tp % k == 0)  # the same ranks: the rest data parallel
        raise ValueError(f"tensor parallelism over tp={tp} ranks gives each rank whole attention heads, but the "
                         f"config has n_heads={config.n_heads}: use tp={config.n_heads} or less (e.g. --mesh "
                         f"dp={tp // fits},tp={fits} on {tp} ranks), or a config with at least {tp} heads")


def embedding_dropout(x: torch.Tensor, p: float, keys: torch.Tensor | None) -> torch.Tensor:
    return dropout(x, p, hpf_random.fold_in(keys, 0) if p and keys is not None else None, 0)


def block_dropout(p: float, keys: torch.Tensor | None, i: int) -> tuple:
    """The dropout arguments of block ``i``: (0, None) without dropout, else (p, its keys
    ``fold_in(keys, i + 1)``), computed outside the block so a recomputed block takes them as
    inputs."""
    if not p or keys is None:
        return 0.0, None
    return p, hpf_random.fold_in(keys, i + 1)


def max_attention_logit(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per head, the largest pre-softmax logit q_i·k_j / sqrt(e) (j <= i, causal) over the batch:
    QK-Clip's S_max (hpf.optim.muon(qk_clip=...)), in fp32, with no grad. q [B, H, T, e] and
    k [B, H or fewer, T, e] (grouped heads are repeated). Costs one more QKᵀ per block."""
    with torch.no_grad():
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = (q.float() @ k.float().mT) * q.shape[-1] ** -0.5
        causal = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        return s.masked_fill(~causal, -math.inf).amax(dim=(0, 2, 3))


def qk_heads(config: GPTConfig) -> dict:
    """QK-Clip's map: path -> (dim, head of each index along dim (-1: none), power). In
    ``w_qkv`` [D, 3D] (columns ``(h three e)``) the q and k columns of head h of block l carry head l * H + h, each scaled
    by sqrt(gamma) (power 0.5), as Kimi K2 does for multi-head attention; v's columns are -1."""
    c = config
    e = c.d_model // c.n_heads
    qkv = torch.arange(3).repeat_interleave(e).repeat(c.n_heads)  # head-major columns: (h three e)
    heads = torch.where(qkv < 2, torch.arange(c.n_heads).repeat_interleave(3 * e), -1)
    return {f"blocks/{i}/w_qkv": (1, torch.where(heads >= 0, heads + i * c.n_heads, -1), 0.5)
            for i in range(c.n_layers)}


def forward(params: dict, tokens: torch.Tensor, *, n_heads: int | None = None, recompute: str = "none",
            compile: bool = False, max_logits: bool = False, dropout_p: float = 0.0,
            keys: torch.Tensor | None = None, tp_axis: str | None = None, sequence_parallel: bool = False):
    """Logits [B, T, V] for int64 tokens [B, T]; computes in the params' dtype. ``recompute``:
    which blocks recompute their forward in backward; ``compile``: each block runs
    ``torch.compile``'d (hpf.models.recompute); ``max_logits``: (logits, every head's max
    attention logit [n_layers, n_heads]); ``dropout_p`` with ``keys`` [B, 2] (one per example,
    ``tokens_and_keys``): dropout on the embeddings (site 0 of ``fold_in(keys, 0)``) and on block
    i's residual branches (sites 0 and 1 of ``fold_in(keys, i + 1)``); ``tp_axis``: the blocks
    run tensor parallel over it (``param_specs``); ``sequence_parallel``: the residual stream and
    the norms between the blocks' products split along T over it too (``block``'s ``seq``)."""
    if n_heads is None:
        raise TypeError(
            "gpt.forward/gpt.loss need n_heads= (the head count is not visible in the param shapes); "
            "use gpt.loss_for(config) as the loss_fn, or functools.partial(gpt.loss, n_heads=config.n_heads)"
        )
    if tokens.dim() != 2 or tokens.dtype != torch.int64:
        raise ValueError(f"tokens must be an int64 tensor [batch, time], got {tokens.dtype} {list(tokens.shape)}")
    t = tokens.shape[1]
    max_t = params["pos"].shape[0]
    if t > max_t:
        raise ValueError(f"sequence length {t} exceeds params['pos'] length {max_t} (config.seq_len)")
    check_sequence_parallel(sequence_parallel, tp_axis, dropout_p)
    x = embedding_dropout(F.embedding(tokens, params["embed"]) + params["pos"][:t], dropout_p, keys)
    x = seq_split(x, tp_axis, sequence_parallel)
    logits = []
    for i, run in recompute_.each_block(params["blocks"], recompute, compile, cache=tp_axis is None):
        drop = block_dropout(dropout_p, keys, i)
        if max_logits:
            x, s = run(block, x, n_heads, True, *drop, tp_axis, sequence_parallel)
            logits.append(s)
        else:
            x = run(block, x, n_heads, False, *drop, tp_axis, sequence_parallel)
    out = rms_norm(seq_gather(x, tp_axis, sequence_parallel), params["norm_f"]) @ params["head"]
    return (out, torch.stack(logits)) if max_logits else out


def loss(params: dict, batch, *, n_heads: int | None = None, recompute: str = "none",
         weighted: bool = False, compile: bool = False, max_logits: bool = False, dropout: float = 0.0,
         tp_axis: str | None = None, sequence_parallel: bool = False):
    """Next-token cross-entropy of ``batch`` [B, T+1] (targets of -100 are padding); the softmax
    runs in fp32 for any param dtype. The mean, or (``weighted``) ``hpf.weighted(sum, count)``:
    the step then divides by the global count of real targets (hpf.losses). ``max_logits``: with
    the aux {"max_attn_logit": [n_layers, n_heads]}, which the step reduces by max (QK-Clip's input).
    ``dropout`` > 0 takes the batch as ``{"tokens": ..., "keys": ...}`` (``tokens_and_keys``)."""
    batch, keys = tokens_and_keys(batch, dropout)
    if batch.dim() != 2 or batch.shape[1] < 2:
        raise ValueError(f"batch must be [batch, time+1] token ids with time+1 >= 2, got shape {list(batch.shape)}")
    out = forward(params, batch[:, :-1], n_heads=n_heads, recompute=recompute, compile=compile, max_logits=max_logits,
                  dropout_p=dropout, keys=keys, tp_axis=tp_axis, sequence_parallel=sequence_parallel)
    if max_logits:
        return token_cross_entropy(out[0], batch[:, 1:], weighted=weighted), {"max_attn_logit": out[1]}
    return token_cross_entropy(out, batch[:, 1:], weighted=weighted)


def loss_for(config: GPTConfig, recompute: str = "none", weighted: bool = False, compile: bool = False,
             max_logits: bool = False, tp_axis: str | None = None, sequence_parallel: bool = False):
    """``loss_fn(params, batch)`` for ``config``: what ``hpf.shard_step`` takes. ``recompute``:
    "none", "all" or "every_other" block recomputes its forward in backward (less memory);
    ``weighted``: return ``hpf.weighted(sum, count)``; ``compile``: each block is ``torch.compile``'d;
    ``max_logits``: also return the heads' max attention logits as an aux (for QK-Clip);
    ``tp_axis``: tensor parallel over that mesh axis, with ``param_specs(config, tp_axis, ...)``;
    ``sequence_parallel``: the norms and residual stream split along the sequence over it too
    (all-gather and reduce-scatter along T instead of each psum; no dropout)."""
    check_sequence_parallel(sequence_parallel, tp_axis, config.dropout)
    return functools.partial(loss, n_heads=config.n_heads, recompute=recompute_.check(recompute), weighted=weighted,
                             compile=compile, max_logits=max_logits, dropout=config.dropout, tp_axis=tp_axis,
                             sequence_parallel=sequence_parallel)


# ---------------------------------------------------------------- synthetic data

@functools.lru_cache(maxsize=8)
def _markov_source(vocab_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(successors [V, K], cumulative probs [V, K]): a sparse random transition matrix.

    Stored as K successors per token instead of a dense [V, V] matrix, which for a 32k
    vocab would take 4 GB.
    """
    rng = np.random.default_rng([seed, 0])
    successors = rng.integers(vocab_size, size=(vocab_size, SUCCESSORS_PER_TOKEN))
    probs = rng.dirichlet(np.ones(SUCCESSORS_PER_TOKEN), size=vocab_size)
    cdf = np.cumsum(probs, axis=1)
    cdf[:, -1] = 1.0  # guard against rounding leaving the last bucket just below 1
    return successors, cdf


def global_batch(config: GPTConfig, batch_size: int, seed: int, step: int) -> torch.Tensor:
    """The whole batch [batch_size, seq_len+1] of ``step``: a pure function of (seed, step)."""
    for name, value, least in (("batch_size", batch_size, 1), ("seed", seed, 0), ("step", step, 0)):
        if not isinstance(value, (int, np.integer)) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    successors, cdf = _markov_source(config.vocab_size, int(seed))
    rng = np.random.default_rng([int(seed), 1, int(step)])
    tokens = np.empty((batch_size, config.seq_len + 1), dtype=np.int64)
    tokens[:, 0] = rng.integers(config.vocab_size, size=batch_size)
    uniforms = rng.random((batch_size, config.seq_len))
    for t in range(config.seq_len):
        current = tokens[:, t]
        choice = (uniforms[:, t, None] >= cdf[current]).sum(axis=1)
        tokens[:, t + 1] = successors[current, choice]
    return torch.from_numpy(tokens)


def synthetic_batches(config: GPTConfig, batch_size: int, seed: int, *, rank: int = 0,
                      world_size: int = 1, device=None, start: int = 0) -> Iterator[torch.Tensor]:
    """Endless local batches: rank r gets rows [r*B/W, (r+1)*B/W) of each step's global batch,
    from the batch of step ``start`` on (0-based: a resumed run passes its step count).

    ``batch_size`` is the GLOBAL batch size, so the data seen by the whole job does not depend
    on ``world_size`` and a single-process reference can replay it with ``global_batch``.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if batch_size % world_size:
        raise ValueError(
            f"batch_size={batch_size} (the global batch size) is not divisible by world_size={world_size}; "
            f"use a multiple of {world_size}"
        )
    local = batch_size // world_size
    step = start
    while True:
        yield global_batch(config, batch_size, seed, step)[rank * local:(rank + 1) * local].to(device)
        step += 1


def unit_flops(config: GPTConfig, local_batch: int, tp: int = 1) -> dict[str, float]:
    """Forward FLOPs per FSDP unit for ``local_batch`` sequences (the hook ``hpf simulate`` reads;
    backward counts twice these). A block: its matmuls, 2 x tokens x params, and attention's
    QK^T and AV, 4 x tokens x seq_len x d_model; the root: the head (the embedding is a lookup).
    ``tp``: a tensor-parallel rank's share (its heads and MLP columns: 1/tp of a block's)."""
    c = config
    tokens = local_batch * c.seq_len
    d, f = c.d_model, c.d_ff
    block = 2 * tokens * (4 * d * d + 2 * d * f) + 4 * tokens * c.seq_len * d
    return {"<root>": 2.0 * tokens * d * c.vocab_size, **{f"blocks/{i}": block / tp for i in range(c.n_layers)}}


def unit_psums(config, local_batch: int, dtype_bytes: int = 4) -> dict[str, tuple[int, ...]]:
    """The bytes of each psum a tensor-parallel block runs in one pass on ``local_batch`` sequences
    (hpf simulate's and hpf plan's hook): the attention's and the MLP's row-parallel sums, each the
    residual stream [tokens, d_model]; backward runs as many on their cotangents. Any config with
    ``seq_len``, ``d_model`` and ``n_layers`` (llama's too)."""
    n = local_batch * config.seq_len * config.d_model * dtype_bytes
    return {f"blocks/{i}": (n, n) for i in range(config.n_layers)}


def activations(config: GPTConfig, local_batch: int, dtype_bytes: int = 4, tp: int = 1) -> recompute_.Activations:
    """What ``loss`` keeps for backward on ``local_batch`` sequences (hpf.memory's hook), counted
    op by op: per block, both norms' fp32 input and rsqrt and their output before and after the weight, q/k/v (3d), the
    attention output (d) and its fp32 logsumexp per head (flash attention: no T x T scores),
    the MLP's GELU input and output (2f); its backward holds about f + d more at once. ``tp``: a
    tensor-parallel rank's (``param_specs``): its heads and MLP columns, 1/tp of those; the norms
    and the residual stream whole."""
    c = config
    n = local_batch * c.seq_len
    norm = recompute_.norm_bytes(c.d_model, dtype_bytes)
    saved = n * (2 * norm + (4 * c.d_model + 2 * c.d_ff) * dtype_bytes // tp + 4 * c.n_heads // tp)
    return recompute_.Activations.of(n, c.d_model, c.vocab_size, dtype_bytes, [saved] * c.n_layers,
                                     [n * (c.d_ff // tp + c.d_model) * dtype_bytes] * c.n_layers)
