"""A dense decoder-only transformer written as pure functions over a plain dict pytree.

The model is data, not a Module: ``init`` returns a dict of tensors and ``loss``/``forward``
read it. That is what lets the sharding engine hand in gathered (or lazily gathered) params
without any wrapping. ``params["blocks"]`` is a Python list, so each block becomes one FSDP
unit, and the functions only *iterate* it in order (never ``len()``, never random access),
because the engine passes a lazy list whose iteration gathers units on demand.

The number of heads is not visible in the tensor shapes, so ``forward``/``loss`` take it as a
keyword; ``loss_for(config)`` binds it and gives the ``loss_fn(params, batch)`` that
``hpf.shard_step`` expects. The pieces it shares with llama and moe (param draws, dropout, RMSNorm,
the tensor-parallel sums) are hpf.models.layers'; its synthetic batches are hpf.models.synthetic's.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from einops import rearrange

from ..losses import token_cross_entropy
from . import recompute as recompute_
from .layers import (INIT_STD, block_dropout, check_dropout, check_sequence_parallel, dropout, embedding_dropout,
                     max_attention_logit, param_makers, rms_norm, seq_gather, seq_split, tensor_parallel_specs,
                     tokens_and_keys, tp_heads, tp_sum, unit_psums)
from .synthetic import global_batch, synthetic_batches
from .spec import ModelSpec, dense_loss, dense_param_specs

__all__ = [
    "GPTConfig", "CONFIGS", "num_params", "init", "forward", "loss", "loss_for",
    "global_batch", "synthetic_batches", "unit_flops", "activations", "block", "max_attention_logit", "qk_heads",
    "param_specs", "unit_psums", "attention", "mlp",
]


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


def param_specs(config, tp_axis: str | None = None, data_axes=("dp",), column=(), row=(), transposed=False,
                tp: int | None = None):
    """GPT's Megatron tensor parallelism over ``tp_axis`` as shard_step's ``param_specs``
    (``layers.tensor_parallel_specs``): ``w_qkv`` and ``w_up`` split their output features in whole
    heads, ``w_o`` and ``w_down`` their input features, unless ``column`` and ``row`` say otherwise;
    None without ``tp_axis``. Use with ``shard_step(..., fsdp_axes=data_axes)`` and
    ``loss_for(config, tp_axis=...)``."""
    e = config.d_model // config.n_heads
    return tensor_parallel_specs(config, tp_axis, data_axes, column or ((r"blocks/\d+/w_qkv", 3 * e), (r"blocks/\d+/w_up", 1)),
                                 row or ((r"blocks/\d+/w_o", e), (r"blocks/\d+/w_down", 1)), transposed, tp)


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


#: What the hpf tools need of GPT (hpf.models.ModelSpec).
SPEC = ModelSpec(name="gpt", configs=CONFIGS, init=init, loss=dense_loss(loss_for), num_params=num_params,
                 param_specs=dense_param_specs(param_specs), unit_flops=unit_flops, unit_psums=unit_psums,
                 activations=activations, forward=forward, qk_heads=qk_heads)
