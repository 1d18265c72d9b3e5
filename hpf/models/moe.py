"""A Mixture-of-Experts decoder (DeepSeek-V3 / Pangu style) as pure functions over a plain dict.

Blocks: RMSNorm, RoPE attention, then a dense SwiGLU FFN (the first ``n_dense_layers``) or a
routed MoE: a top-k router (softmax or sigmoid scores, gates renormalized to sum to 1), routed
SwiGLU experts stored as 3-D tensors ``w1/w3 (E, H, D)`` and ``w2 (E, D, H)``, and optional
shared experts. Every weight is ``(out, in)`` and applied with ``F.linear``.

Expert parallelism (``ep_axis``): the step hands each rank its block of experts
``(E/ep, H, D)``; tokens go to the rank owning their expert with ``hpf.all_to_all`` (per-expert
counts first, then the tokens with uneven splits), run through a grouped matmul, and come back
with the reverse exchange. Outside a step (one process, full params) the same code runs every
expert locally.

Aux-loss-free balancing: the per-expert bias is used for top-k *selection* only, never in the
gates, and is not a trained param. It lives with the training loop, next to the train state:
each batch carries it as ``{"tokens": ..., "expert_bias": [n_moe_layers, E]}``; the loss (made
with ``loss_for(config, aux=True)``) returns this rank's tokens per expert as aux, which
``hpf.shard_step`` sums over all ranks into ``metrics["aux"]["expert_counts"]``; the loop then
calls ``update_bias``. So the model stays a pure function of (params, batch).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F

import hpf_kernels

from ..comm.collectives import all_to_all, run_check
from ..losses import Weighted, token_cross_entropy
from . import recompute as recompute_
from .layers import param_makers, rms_norm, tp_sum
from .synthetic import global_batch, synthetic_batches  # the token source gpt trains on (needs only vocab_size, seq_len)
from .spec import ModelSpec

__all__ = ["MoEConfig", "CONFIGS", "num_params", "init", "loss", "loss_for", "param_specs", "update_bias",
           "imbalance", "Balancer", "synthetic_batches", "global_batch", "batch_with_bias", "BATCH_AXES",
           "dispatch_bytes",
           "unit_flops", "unit_a2a", "activations", "unit_psums"]

EXPERTS = True  # its experts split over an expert-parallel axis (hpf.models.has_experts)
NORM_EPS = 1e-6
INIT_STD = 0.02


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    n_dense_layers: int  # the first layers use a dense FFN (DeepSeek-V3: 3)
    d_ff: int  # dense FFN hidden size
    n_experts: int
    top_k: int
    d_expert: int  # hidden size of one routed (and one shared) expert
    n_shared: int = 0  # shared experts: one SwiGLU of hidden n_shared * d_expert, on every token
    score_func: str = "sigmoid"  # "sigmoid" (DeepSeek-V3) or "softmax"
    route_scale: float = 1.0
    aux_loss_coeff: float = 0.0  # sequence-wise balance loss (0: aux-loss-free only)
    bias_update_coeff: float = 1e-3
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"MoEConfig: d_model={self.d_model} must split into n_heads={self.n_heads} heads of even size")
        if not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"MoEConfig: top_k={self.top_k} must be in 1..n_experts={self.n_experts}")
        if self.score_func not in ("sigmoid", "softmax"):
            raise ValueError(f"MoEConfig.score_func={self.score_func!r}: use 'sigmoid' or 'softmax'")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"MoEConfig: n_dense_layers={self.n_dense_layers} must be in 0..n_layers")

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers


CONFIGS: dict[str, MoEConfig] = {
    # Seconds on CPU; 8 experts split evenly over ep = 1, 2, 4 or 8.
    "tiny": MoEConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=3, n_heads=4, n_dense_layers=1, d_ff=64,
                      n_experts=8, top_k=2, d_expert=16, n_shared=1, bias_update_coeff=3e-3),
    # A few M params for CPU benchmarks.
    "small": MoEConfig(vocab_size=512, seq_len=128, d_model=256, n_layers=4, n_heads=4, n_dense_layers=1,
                       d_ff=1024, n_experts=16, top_k=2, d_expert=256, n_shared=1),
    # DeepSeek-V3 671B's layout (61 layers, d 7168, 56 heads, first 3 layers dense with FFN 18432,
    # 1 shared expert, top-8, expert hidden 2048, vocab 129280) with 192 routed experts instead of
    # 256 and plain multi-head attention (4 d^2) instead of MLA: 508.6B params, 192 = 12 x 16
    # experts per rank on a 16-rank supernode tier. Planning only (meta tensors).
    "505b": MoEConfig(vocab_size=129280, seq_len=4096, d_model=7168, n_layers=61, n_heads=56, n_dense_layers=3,
                      d_ff=18432, n_experts=192, top_k=8, d_expert=2048, n_shared=1),
}


def num_params(config: MoEConfig) -> int:
    c = config
    d = c.d_model
    attn = 4 * d * d + 2 * d
    moe = d * c.n_experts + 3 * c.n_experts * c.d_expert * d + 3 * c.n_shared * c.d_expert * d
    return 2 * c.vocab_size * d + d + c.n_dense_layers * (attn + 3 * d * c.d_ff) + c.n_moe_layers * (attn + moe)


def init(config: MoEConfig, key: torch.Tensor | None = None, *, device=None,
         dtype: torch.dtype = torch.float32) -> dict:
    """Fresh params, drawn as gpt.init draws them (one hpf.random key per matrix, default
    ``hpf.random.key(0)``); ``device="meta"`` draws nothing."""
    c = config
    normal, ones = param_makers(key, device, dtype)
    d, res = c.d_model, INIT_STD / math.sqrt(2 * c.n_layers)

    def swiglu(*lead: int, hidden: int) -> dict:
        return {"w1": normal(*lead, hidden, d), "w3": normal(*lead, hidden, d), "w2": normal(*lead, d, hidden, std=res)}

    blocks = []
    for i in range(c.n_layers):
        blk = {"attn_norm": ones(d), "wq": normal(d, d), "wk": normal(d, d), "wv": normal(d, d),
               "wo": normal(d, d, std=res), "ffn_norm": ones(d)}
        if i < c.n_dense_layers:
            blk["ffn"] = swiglu(hidden=c.d_ff)
        else:
            blk["router"] = normal(c.n_experts, d)
            blk["experts"] = swiglu(c.n_experts, hidden=c.d_expert)
            if c.n_shared:
                blk["shared"] = swiglu(hidden=c.n_shared * c.d_expert)
        blocks.append(blk)
    return {"embed": normal(c.vocab_size, d), "blocks": blocks, "norm_f": ones(d), "head": normal(c.vocab_size, d)}


def param_specs(config: MoEConfig, ep_axis: str | None = None, data_axes=("dp",), tp_axis: str | None = None):
    """Rules: experts split on dim 0 over ``ep_axis`` and FSDP-sharded over the other data axes;
    everything else FSDP-sharded over all ``data_axes`` (``ep_axis`` included: no replication).
    ``tp_axis``: the attention's heads split over it too (Megatron: wq, wk, wv by rows, wo by
    columns; ``loss_for(tp_axis=...)`` sums wo's products); the FFNs and experts stay whole there.
    Use with ``shard_step(..., fsdp_axes=data_axes)``."""
    from ..spec import P, rules

    data = tuple(data_axes)
    if ep_axis is not None and ep_axis not in data:
        raise ValueError(f"ep_axis={ep_axis!r} must be one of the data axes {data}: expert parallelism "
                         "borrows a data axis (each EP rank still reads its own batch)")
    expert = P(data) if ep_axis is None else P(ep_axis, fsdp=tuple(a for a in data if a != ep_axis))
    heads = [] if tp_axis is None else [(r"blocks/\d+/(wq|wk|wv)", P(tp_axis, None, fsdp=data)),
                                        (r"blocks/\d+/wo", P(None, tp_axis, fsdp=data))]
    return rules([*heads, (r"blocks/\d+/experts/w\d", expert), (r".*", P(data))])


# -- the model --------------------------------------------------------------------------------------
def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on [B, T, H, hd]."""
    t, hd = x.shape[1], x.shape[-1]
    freqs = theta ** (-torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    ang = torch.arange(t, device=x.device, dtype=torch.float32)[:, None] * freqs
    cos, sin = ang.cos()[:, None].to(x.dtype), ang.sin()[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def _attention(x, blk, c: MoEConfig, tp_axis: str | None = None):
    """Attention on x [B, T, D] with the heads of ``wq``'s rows (a tp rank's under ``tp_axis``),
    wo's products summed over the axis."""
    b, t, d = x.shape
    q, k, v = (F.linear(x, blk[w]).view(b, t, -1, d // c.n_heads) for w in ("wq", "wk", "wv"))
    q, k = _rope(q, c.rope_theta), _rope(k, c.rope_theta)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return tp_sum(F.linear(out.transpose(1, 2).reshape(b, t, -1), blk["wo"]), tp_axis)


def _swiglu(x, w):
    return F.linear(F.silu(F.linear(x, w["w1"])) * F.linear(x, w["w3"]), w["w2"])


def route(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor | None, c: MoEConfig):
    """(scores [T, E] fp32, expert ids [T, k], gates [T, k] summing to route_scale). The bias
    only picks the experts; the gates come from the unbiased scores."""
    logits = F.linear(x.float(), router.float())
    scores = logits.softmax(-1) if c.score_func == "softmax" else logits.sigmoid()
    pick = scores if bias is None else scores + bias.to(scores)
    idx = pick.topk(c.top_k, -1).indices
    gates = scores.gather(-1, idx)
    return scores, idx, gates / gates.sum(-1, keepdim=True) * c.route_scale


def _grouped_swiglu(x, ex, sizes):
    h = F.silu(hpf_kernels.grouped_mm(x, ex["w1"].mT, sizes)) * hpf_kernels.grouped_mm(x, ex["w3"].mT, sizes)
    return hpf_kernels.grouped_mm(h, ex["w2"].mT, sizes)


def routed_experts(x, idx, gates, ex, n_experts: int, ep_axis: str | None):
    """sum_j gates[t, j] * expert_{idx[t, j]}(x[t]) for x [T, D], with this rank's block of experts.

    Token copies are sorted by expert (so by owning rank: experts are contiguous per rank),
    the per-expert counts are exchanged, the tokens follow with uneven splits, are grouped by
    local expert for the grouped matmul, and return by the reverse exchange."""
    n_local = ex["w1"].shape[0]
    n = n_experts // n_local
    if n > 1 and ep_axis is None:
        raise ValueError(f"the experts hold {n_local} of {n_experts} experts: pass loss_for(config, ep_axis=...) "
                         "naming the mesh axis they are split over")
    k = idx.shape[1]
    flat = idx.reshape(-1)
    order = dispatch_order(flat)
    tok = order // k
    checks = run_check("moe dispatch", flat[order], tok, x.shape[0], k, n_experts, ep_axis)
    counts = torch.bincount(flat, minlength=n_experts)
    xs = x[tok]
    if n == 1:
        y = _grouped_swiglu(xs, ex, counts.tolist())
    else:
        recv_counts = all_to_all(counts.view(n, n_local), ep_axis, 0, 0)  # row j: sent here by rank j
        send, recv = counts.view(n, n_local).sum(1).tolist(), recv_counts.sum(1).tolist()
        xr = all_to_all(xs, ep_axis, 0, 0, send_sizes=send, recv_sizes=recv)
        local = torch.arange(n_local, device=x.device).repeat(n).repeat_interleave(recv_counts.reshape(-1))
        perm = local.argsort(stable=True)  # sender-major -> expert-major
        if checks:
            checks.placement(send, recv, recv_counts, n_local, perm)
        y = _grouped_swiglu(xr[perm], ex, recv_counts.sum(0).tolist())
        y = all_to_all(y[perm.argsort()], ep_axis, 0, 0, send_sizes=recv, recv_sizes=send)
    y = y * gates.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add(0, tok, y), counts


def dispatch_order(flat_ids: torch.Tensor) -> torch.Tensor:
    """The send order of the token copies: sorted by expert, so each rank's experts are one
    contiguous chunk (validation mode checks that it is)."""
    return flat_ids.argsort(stable=True)


def _balance_loss(scores, idx, b: int, c: MoEConfig):
    """DeepSeek-V3's sequence-wise balance loss (per sequence, so independent of the batch split)."""
    e, k = c.n_experts, c.top_k
    s = scores.shape[0] // b
    f = torch.zeros(b, e, device=scores.device).scatter_add_(
        1, idx.view(b, s * k), torch.ones(b, s * k, device=scores.device)) * (e / (k * s))
    p = (scores / scores.sum(-1, keepdim=True)).view(b, s, e).mean(1)
    return (f * p).sum(-1).mean()


def block(blk: dict, x: torch.Tensor, bias, c: MoEConfig, ep_axis: str | None = None, experts=None,
          tp_axis: str | None = None):
    """One block on x [B, T, D] -> (x, tokens per expert or None, balance loss). ``experts(h, idx,
    gates)`` overrides the routed-expert call (default: ``routed_experts`` on ``blk["experts"]``);
    ``tp_axis``: the attention's heads split over it (``param_specs``)."""
    b, t, _ = x.shape
    x = x + _attention(rms_norm(x, blk["attn_norm"], NORM_EPS), blk, c, tp_axis)
    h = rms_norm(x, blk["ffn_norm"], NORM_EPS)
    if "router" not in blk:
        return x + _swiglu(h, blk["ffn"]), None, 0.0
    hf = h.reshape(b * t, -1)
    scores, idx, gates = route(hf, blk["router"], None if bias is None else bias.detach(), c)
    run_check("moe gates", gates, c.route_scale, ep_axis)
    if experts is None:
        out, cnt = routed_experts(hf, idx, gates, blk["experts"], c.n_experts, ep_axis)
    else:
        out, cnt = experts(hf, idx, gates)
    if "shared" in blk:
        out = out + _swiglu(hf, blk["shared"])
    balance = _balance_loss(scores, idx, b, c) if c.aux_loss_coeff else 0.0
    return x + out.view(b, t, -1), cnt, balance


def loss(params: dict, batch, *, config: MoEConfig, ep_axis: str | None = None, aux: bool = False,
         recompute: str = "none", weighted: bool = False, compile: bool = False, tp_axis: str | None = None):
    """Next-token cross-entropy (+ aux_loss_coeff * balance loss) of ``batch``: tokens
    [B, T+1], or {"tokens": ..., "expert_bias": [n_moe_layers, E]} (``BATCH_AXES``: the bias is
    not per-example). The mean, or (``weighted``) ``hpf.weighted(sum, count)``, the balance loss
    weighted by this micro-batch's count. ``aux=True`` returns
    ``(loss, {"expert_counts": [n_moe_layers, E] float})``. ``recompute``: which blocks recompute
    their forward (and their all-to-alls) in backward; ``compile``: each block runs ``torch.compile``'d
    (hpf.models.recompute); ``tp_axis``: the attention tensor parallel over it (``param_specs``;
    the tp ranks of a group route the same tokens, so ``expert_counts`` sum tp copies of each)."""
    c = config
    tokens, bias = (batch["tokens"], batch.get("expert_bias")) if isinstance(batch, dict) else (batch, None)
    x = F.embedding(tokens[:, :-1], params["embed"])
    counts, balance = [], 0.0
    for i, run in recompute_.each_block(params["blocks"], recompute, compile, cache=tp_axis is None):
        moe_bias = None if bias is None or i < c.n_dense_layers else bias[i - c.n_dense_layers]
        x, cnt, bal = run(block, x, moe_bias, c, ep_axis, None, tp_axis)
        balance = balance + bal
        if cnt is not None:
            counts.append(cnt)
    ce = head_loss(params, x, tokens[:, 1:], weighted)
    value = (Weighted(ce.sum + c.aux_loss_coeff * balance * ce.count, ce.count) if weighted
             else ce + c.aux_loss_coeff * balance)
    if not aux:
        return value
    return value, {"expert_counts": torch.stack(counts).float() if counts else torch.zeros(0)}


def head_loss(params: dict, x: torch.Tensor, targets: torch.Tensor, weighted: bool = False):
    return token_cross_entropy(F.linear(rms_norm(x, params["norm_f"], NORM_EPS), params["head"]), targets, weighted=weighted)


#: batch_axes for hpf.shard_step: tokens are per-example, the expert bias is not (accumulation
#: gives every micro-batch the whole bias, mixed precision leaves it in fp32).
BATCH_AXES = {"tokens": 0, "expert_bias": None}


def loss_for(config: MoEConfig, ep_axis: str | None = None, aux: bool = False, recompute: str = "none",
             weighted: bool = False, compile: bool = False, tp_axis: str | None = None):
    """``loss_fn(params, batch)`` for ``hpf.shard_step``; ``ep_axis``: the mesh axis experts are split
    over; ``recompute``: "none", "all" or "every_other" block recomputes its forward in backward;
    ``weighted``: return ``hpf.weighted(sum, count)``; ``compile``: each block is ``torch.compile``'d;
    ``tp_axis``: the attention's heads split over that axis (``param_specs(..., tp_axis=)``)."""
    return functools.partial(loss, config=config, ep_axis=ep_axis, aux=aux, recompute=recompute_.check(recompute),
                             weighted=weighted, compile=compile, tp_axis=tp_axis)


# -- balancing --------------------------------------------------------------------------------------
def update_bias(bias: torch.Tensor, counts: torch.Tensor, coeff: float) -> torch.Tensor:
    """Aux-loss-free update (DeepSeek-V3, torchtitan): raise under-loaded experts' bias by
    ``coeff``, lower over-loaded ones; centred so the mean bias stays put. ``counts``: global
    tokens per expert [n_moe_layers, E] (all-reduced: the same on every rank)."""
    delta = coeff * torch.sign(counts.mean(-1, keepdim=True) - counts.to(bias))
    return bias + delta - delta.mean(-1, keepdim=True)


def imbalance(counts: torch.Tensor) -> float:
    """max/mean tokens per expert, worst layer (1.0 is perfect balance)."""
    return float((counts.max(-1).values / counts.mean(-1).clamp_min(1e-9)).max()) if counts.numel() else 1.0


def batch_with_bias(tokens: torch.Tensor, bias: torch.Tensor) -> dict:
    return {"tokens": tokens, "expert_bias": bias}


class Balancer:
    """Aux-loss-free balancing in a training loop: the selection bias rides in each batch and
    moves by the step's all-reduced expert counts (the same on every rank, so no broadcast).
    Needs a step made with ``loss_for(config, ..., aux=True)``."""

    def __init__(self, config: MoEConfig, device=None):
        self.config = config
        self.bias = torch.zeros(config.n_moe_layers, config.n_experts, device=device)

    def batch(self, tokens: torch.Tensor) -> dict:
        return batch_with_bias(tokens, self.bias)

    def update(self, metrics: dict) -> float:
        """Move the bias by ``metrics["aux"]["expert_counts"]``; returns their imbalance (max/mean)."""
        counts = metrics["aux"]["expert_counts"].to(self.bias.device)
        self.bias = update_bias(self.bias, counts, self.config.bias_update_coeff)
        return imbalance(counts)


def dispatch_bytes(config: MoEConfig, ep: int, tokens_per_rank: int, dtype_bytes: int = 2) -> int:
    """Bytes one rank sends per step in MoE all-to-alls under uniform routing: per MoE layer,
    dispatch and combine, forward and backward, each sending (ep-1)/ep of its k token copies."""
    per = tokens_per_rank * config.top_k * config.d_model * dtype_bytes * (ep - 1) // ep
    return 4 * per * config.n_moe_layers


# -- hpf simulate's hooks ---------------------------------------------------------------------------
def unit_flops(config: MoEConfig, local_batch: int, tp: int = 1) -> dict[str, float]:
    """Forward FLOPs per FSDP unit for ``local_batch`` sequences (backward counts twice these):
    attention's projections (2 x tokens x 4d^2) and QK^T, AV (4 x tokens x seq_len x d); a dense
    FFN's 3 matrices; in a MoE block the router, the ``top_k`` routed experts a token visits and
    the shared experts: the active params, not all of them. Under uniform routing expert
    parallelism moves tokens, not FLOPs: each rank runs as many token-experts as it sends. ``tp``:
    a tensor-parallel rank's share, 1/tp of the attention (the FFNs run whole on each)."""
    c = config
    tokens = local_batch * c.seq_len
    d = c.d_model
    attn = (2 * tokens * 4 * d * d + 4 * tokens * c.seq_len * d) / tp
    dense = 2 * tokens * 3 * d * c.d_ff
    moe = 2 * tokens * (d * c.n_experts + (c.top_k + c.n_shared) * 3 * d * c.d_expert)
    return {"<root>": 2.0 * tokens * d * c.vocab_size,
            **{f"blocks/{i}": float(attn + (dense if i < c.n_dense_layers else moe)) for i in range(c.n_layers)}}


def unit_psums(config: MoEConfig, local_batch: int, dtype_bytes: int = 4) -> dict[str, tuple[int, ...]]:
    """The bytes of each psum a tensor-parallel block runs in one pass (layers.unit_psums): the
    attention's, the residual stream [tokens, d_model]."""
    return {f"blocks/{i}": (local_batch * config.seq_len * config.d_model * dtype_bytes,) for i in range(config.n_layers)}


def unit_a2a(config: MoEConfig, local_batch: int, mesh, ep_axis: str | None = None,
             dtype_bytes: int = 2) -> dict[str, tuple[int, tuple[str, ...]]]:
    """Per MoE unit: (bytes of one rank's token copies in one all-to-all, the mesh axes it
    spans); dispatch and combine, forward and backward, each move them (``dispatch_bytes``
    counts the same four). Nothing without expert parallelism."""
    if ep_axis is None or mesh.axis_size((ep_axis,)) == 1:
        return {}
    nbytes = local_batch * config.seq_len * config.top_k * config.d_model * dtype_bytes
    return {f"blocks/{i}": (nbytes, (ep_axis,)) for i in range(config.n_dense_layers, config.n_layers)}


def activations(config: MoEConfig, local_batch: int, dtype_bytes: int = 4, tp: int = 1) -> recompute_.Activations:
    """What ``loss`` keeps for backward on ``local_batch`` sequences (hpf.memory's hook), under
    uniform routing (each rank's experts get as many token copies as it sends). Per block: both
    norms (6d + 2), q/k/v after RoPE, the attention output and its fp32 logsumexp per head; a
    dense FFN's SwiGLU (4 d_ff); a MoE FFN's fp32 router scores (and its fp32 input in a lower
    compute dtype), top-k ids and gates, the k token copies in, out and gated (3kd), the routed
    and shared SwiGLUs (4 d_expert per copy). Its backward holds about h + d more, h the
    hidden width a token meets. ``tp``: a tensor-parallel rank's, its heads' share of the attention."""
    c, b = config, dtype_bytes
    n = local_batch * c.seq_len
    d, k, de = c.d_model, c.top_k, c.d_expert
    attn = 2 * recompute_.norm_bytes(d, b) + (4 * d * b + 4 * c.n_heads) // tp
    dense = n * (attn + 4 * c.d_ff * b)
    routed = n * (attn + (3 * k * d + 4 * (k + c.n_shared) * de) * b + 4 * (c.n_experts + 2 * k + 1)
                  + (4 * d if b != 4 else 0) + 8 * 3 * k)
    hidden = [c.d_ff if i < c.n_dense_layers else (k + c.n_shared) * de for i in range(c.n_layers)]
    return recompute_.Activations.of(n, d, c.vocab_size, b,
                                     [dense if i < c.n_dense_layers else routed for i in range(c.n_layers)],
                                     [n * (h + d) * b for h in hidden])


def _param_specs(config: MoEConfig, data_axes, *, tp_axis: str | None = None, tp: int | None = None,
                 ep_axis: str | None = None):
    return param_specs(config, ep_axis, tuple(data_axes), **({"tp_axis": tp_axis} if tp_axis else {}))


def _loss(config: MoEConfig, *, ep_axis: str | None = None, aux: bool = False, **how):
    return loss_for(config, ep_axis, aux=aux, **how)


#: What the hpf tools need of the MoE model (hpf.models.ModelSpec).
SPEC = ModelSpec(name="moe", configs=CONFIGS, init=init, loss=_loss, num_params=num_params,
                 param_specs=_param_specs, unit_flops=unit_flops, unit_psums=unit_psums, unit_a2a=unit_a2a,
                 dispatch_bytes=dispatch_bytes, activations=activations, balancer=Balancer,
                 batch_axes=BATCH_AXES, experts=EXPERTS)
