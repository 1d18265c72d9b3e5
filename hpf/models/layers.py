"""The pieces gpt, llama and moe are built from: param draws, dropout, RMSNorm, tensor-parallel sums.

Each is a pure function of tensors (and the mesh context hpf.comm.collectives gives under
``shard_step``): the params' draws from ``hpf.random`` keys, dropout drawn from per-example keys,
the fp32 RMSNorm, the tensor- and sequence-parallel sums and gathers of a block's row- and
column-parallel products and their param specs, and the heads' max attention logit (QK-Clip).
"""
from __future__ import annotations

import math

import torch

from .. import random as hpf_random
from ..comm.collectives import all_gather, axis_index, current, psum, psum_scatter
from ..spec import shares

__all__ = ["NORM_EPS", "INIT_STD", "check_dropout", "param_makers", "tokens_and_keys", "dropout", "embedding_dropout",
           "block_dropout", "rms_norm", "tp_sum", "seq_gather", "seq_split", "check_sequence_parallel", "tp_heads",
           "tensor_parallel_specs", "check_heads", "max_attention_logit", "unit_psums"]

NORM_EPS = 1e-5
INIT_STD = 0.02


def check_dropout(p, where: str) -> None:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"{where}.dropout must be a float in [0, 1), got {p!r}")


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


def embedding_dropout(x: torch.Tensor, p: float, keys: torch.Tensor | None) -> torch.Tensor:
    return dropout(x, p, hpf_random.fold_in(keys, 0) if p and keys is not None else None, 0)


def block_dropout(p: float, keys: torch.Tensor | None, i: int) -> tuple:
    """The dropout arguments of block ``i``: (0, None) without dropout, else (p, its keys
    ``fold_in(keys, i + 1)``), computed outside the block so a recomputed block takes them as
    inputs."""
    if not p or keys is None:
        return 0.0, None
    return p, hpf_random.fold_in(keys, i + 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = NORM_EPS) -> torch.Tensor:
    """RMSNorm as transformers' LlamaRMSNorm: normalize in fp32, cast back, then scale. In fp16
    the rsqrt's backward (its cube) overflows to inf for any input of rms below 0.025, so a
    norm computed in fp16 makes every step's grads non-finite at init (std 0.02)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


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


def tensor_parallel_specs(config, tp_axis: str | None, data_axes, column, row, transposed: bool = False,
                          tp: int | None = None):
    """Megatron tensor parallelism over ``tp_axis`` as shard_step's ``param_specs``: the paths
    matching ``column`` split their output features over it, those matching ``row`` their input
    features (dims 1 and 0 of an ``x @ w`` weight; 0 and 1 where ``transposed``, ``F.linear``'s
    [out, in]); each is stored FSDP-sharded over ``data_axes``, as is every other param. ``column``
    and ``row`` are (regex, granule) pairs: a split keeps blocks of ``granule`` whole (a head's
    features) and may be uneven (``P(granule=)``: 5 heads over 2 ranks are 3 and 2). None without
    ``tp_axis`` (every param FSDP-sharded). ``tp``: the axis's size, to refuse one larger than the
    heads here, in the config's words (its ``n_heads``). Use with ``shard_step(..., fsdp_axes=data_axes)``
    and the model's ``loss_for(config, tp_axis=...)``."""
    from ..spec import P, rules

    if tp_axis is None:
        return None
    data = tuple(data_axes)
    if tp_axis in data:
        raise ValueError(f"tp_axis={tp_axis!r} is one of the data axes {data}: tensor parallelism splits the "
                         "model over an axis of its own; pass the other axes as the data axes")
    check_heads(config, tp)

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


def max_attention_logit(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per head, the largest pre-softmax logit q_i·k_j / sqrt(e) (j <= i, causal) over the batch:
    QK-Clip's S_max (hpf.optim.muon(qk_clip=...)), in fp32, with no grad. q [B, H, T, e] and
    k [B, H or fewer, T, e] (grouped heads are repeated). Costs one more QKᵀ per block."""
    with torch.no_grad():
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = (q.float() @ k.float().mT) * q.shape[-1] ** -0.5
        causal = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        return s.masked_fill(~causal, -math.inf).amax(dim=(0, 2, 3))


def unit_psums(config, local_batch: int, dtype_bytes: int = 4) -> dict[str, tuple[int, ...]]:
    """The bytes of each psum a tensor-parallel block runs in one pass on ``local_batch`` sequences
    (hpf simulate's and hpf plan's hook): the attention's and the MLP's row-parallel sums, each the
    residual stream [tokens, d_model]; backward runs as many on their cotangents. Any config with
    ``seq_len``, ``d_model`` and ``n_layers`` (llama's too)."""
    n = local_batch * config.seq_len * config.d_model * dtype_bytes
    return {f"blocks/{i}": (n, n) for i in range(config.n_layers)}
