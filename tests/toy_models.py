"""Small pure-function models the tests share (the GPT lives in hpf.models.gpt).

Two tensor-parallel models, named apart: ``megatron_*`` is a small transformer (attention
heads and the MLP split over "tp"); ``tp_mlp_*`` is an embedding feeding Megatron MLP blocks.
Their losses take the collective as ``psum=`` so a test can swap in
:func:`psum_with_identity_backward`, a psum whose backward is wrong, through public API only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

import hpf
from hpf import P


class _IdentityBackwardPsum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        return hpf.psum(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def psum_with_identity_backward(x: torch.Tensor, axis: str) -> torch.Tensor:
    """The right sum forward, an identity backward (shard_map's transpose without its implicit
    pvary casts): replicated values feeding sharded blocks miss the other ranks' grads."""
    return _IdentityBackwardPsum.apply(x, axis)


# -- a small Megatron transformer: heads and the MLP split over "tp" -----------------------------------
V, D, HEAD_DIM, FF, T = 17, 16, 2, 24, 6  # D, FF and D // HEAD_DIM heads divide by tp = 2 and tp = 8
MEGATRON_SPECS = hpf.rules([(r"blocks/\d+/w_(q|k|v|up)", P(None, "tp")), (r"blocks/\d+/w_(o|down)", P("tp", None)),
                            (r".*", P())])


def megatron_params(seed=0, layers=2):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.3  # noqa: E731
    return {"embed": r(V, D),
            "blocks": [{"norm": 1 + r(D) * 0.1, "w_q": r(D, D), "w_k": r(D, D), "w_v": r(D, D), "w_o": r(D, D),
                        "w_up": r(D, FF), "w_down": r(FF, D)} for _ in range(layers)],
            "head": r(D, V)}


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def attention(a, blk):
    q, k, v = (rearrange(a @ blk[n], "b t (h e) -> b h t e", e=HEAD_DIM) for n in ("w_q", "w_k", "w_v"))
    return rearrange(F.scaled_dot_product_attention(q, k, v, is_causal=True), "b h t e -> b t (h e)")


def megatron_mlp(a, blk, psum=hpf.psum):
    return psum(F.gelu(a @ blk["w_up"]) @ blk["w_down"], "tp")


def megatron_loss(params, batch, mlp=None, psum=hpf.psum):
    h = params["embed"][batch[:, :-1]]
    for blk in params["blocks"]:
        a = rms(h, blk["norm"])
        h = h + psum(attention(a, blk) @ blk["w_o"], "tp")
        h = h + (mlp(a, blk) if mlp else megatron_mlp(a, blk, psum))
    return F.cross_entropy((h @ params["head"]).flatten(0, 1), batch[:, 1:].flatten())


def megatron_tokens(n, seed=1):
    return torch.randint(0, V, (n, T + 1), generator=torch.Generator().manual_seed(seed))


# -- an embedding feeding Megatron MLPs: its grad needs every rank's MLP branch --------------------------
MLP_V, MLP_D, MLP_FF = 7, 6, 8
TP_MLP_SPECS = hpf.rules([(r"blocks/\d+/w_up", P(None, "tp")), (r"blocks/\d+/w_down", P("tp", None)), (r".*", P())])


def tp_mlp_params():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.5  # noqa: E731
    return {"embed": r(MLP_V, MLP_D), "blocks": [{"w_up": r(MLP_D, MLP_FF), "w_down": r(MLP_FF, MLP_D)}
                                                 for _ in range(2)], "head": r(MLP_D, MLP_V)}


def tp_mlp_loss(params, batch, psum=hpf.psum):
    """A replicated embedding feeds Megatron MLPs: its grad needs every rank's MLP branch."""
    h = params["embed"][batch[:, :-1]]
    for blk in params["blocks"]:
        h = h + psum(torch.tanh(h @ blk["w_up"]) @ blk["w_down"], "tp")
    return F.cross_entropy((h @ params["head"]).flatten(0, 1), batch[:, 1:].flatten())


def tp_mlp_batch():
    return torch.randint(0, MLP_V, (3, 5), generator=torch.Generator().manual_seed(1))


# -- a tiny language model of blocks: the contract, SPMD, non-finite and frozen tests ------------------------
LM_V, LM_D, LM_ROWS, LM_T = 11, 6, 8, 5


def lm_params(n_blocks: int = 4, seed: int = 0) -> dict:
    """An embedding, a head and ``n_blocks`` blocks {"w", "b"} (each list element one FSDP unit)."""
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(LM_V, LM_D, generator=g) * 0.5, "head": torch.randn(LM_V, LM_D, generator=g) * 0.5,
            "blocks": [{"w": torch.randn(LM_D, LM_D, generator=g) / LM_D ** 0.5,
                        "b": torch.randn(LM_D, generator=g) * 0.1} for _ in range(n_blocks)]}


def lm_batch(step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
    """This rank's rows of global batch ``step`` ([LM_ROWS, LM_T + 1] token ids)."""
    full = torch.randint(0, LM_V, (LM_ROWS, LM_T + 1), generator=torch.Generator().manual_seed(100 + step))
    n = LM_ROWS // world
    return full[rank * n:(rank + 1) * n]


def lm_block(x: torch.Tensor, blk: dict, c: float = 1.0) -> torch.Tensor:
    return x + c * torch.tanh(x @ blk["w"] + blk["b"])


def lm_head_loss(params: dict, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((x @ params["head"].T).reshape(-1, LM_V), tokens[:, 1:].reshape(-1))


def lm_loss(params: dict, tokens: torch.Tensor) -> torch.Tensor:
    """The loop-style loss: embed, every block in order, the head."""
    x = params["embed"][tokens[:, :-1]]
    for blk in params["blocks"]:
        x = lm_block(x, blk)
    return lm_head_loss(params, x, tokens)
