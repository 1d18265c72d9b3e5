"""Plain-torch batched Newton-Schulz: runs on any device torch runs on.

Default compute dtype: fp32 on CPU, bf16 elsewhere. Measured on this project's 2-core AMD EPYC
(no avx512_bf16/AMX), torch 2.13 CPU, 5 keller steps: bf16 was 22-28x SLOWER than fp32
(256 x 64x64: 602 ms vs 27 ms; 64 x 128x128: 1131 ms vs 41 ms) and 10^4x less accurate
(max error vs fp64 1e-2 vs 1e-6). CPU bf16 matmul has no fast path there, so fp32 wins on both
counts. Accelerators have bf16 tensor cores, where bf16 is the usual choice (Keller's Muon, torch).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..flops import gram_restarts


def default_compute_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def normalized_wide(X: torch.Tensor, norm_scale: float, eps: float, compute_dtype: torch.dtype):
    """[..., m, n] -> ([B, r, s] with r <= s, normalized per matrix, in compute dtype; transposed?).

    Tall matrices are transposed so X Xᵀ is the small (r x r) side. The Frobenius norm runs over
    the last two dims only: one norm per matrix, never across the batch (e.g. MoE experts).
    """
    m, n = X.shape[-2:]
    Y = X.reshape(-1, m, n).to(compute_dtype)
    tall = m > n
    if tall:
        Y = Y.mT
    Y = Y / (Y.norm(dim=(-2, -1), keepdim=True) * norm_scale + eps)
    return Y, tall


def restore(Y: torch.Tensor, tall: bool, like: torch.Tensor) -> torch.Tensor:
    if tall:
        Y = Y.mT
    return Y.reshape(like.shape).to(like.dtype)


def newton_schulz(
    X: torch.Tensor,
    coefficients: Sequence[tuple[float, float, float]],
    *,
    norm_scale: float,
    eps: float,
    compute_dtype: torch.dtype | None,
    gram: bool = False,
) -> torch.Tensor:
    Y, tall = normalized_wide(X, norm_scale, eps, compute_dtype or default_compute_dtype(X.device))
    if gram:
        return restore(gram_iteration(Y, coefficients), tall, X)
    for a, b, c in coefficients:
        A = torch.bmm(Y, Y.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A²
        Y = torch.baddbmm(Y, B, Y, beta=a)  # a Y + (b A + c A²) Y
    return restore(Y, tall, X)


def gram_iteration(Y: torch.Tensor, coefficients: Sequence[tuple[float, float, float]]) -> torch.Tensor:
    """Gram Newton-Schulz on wide normalized [B, r, s]: the same polynomials, iterated on r x r.

    Every step maps Y to q(R) Y with R = Y Yᵀ and q(R) = a I + b R + c R², a polynomial in R, so
    after k steps Y_k = Q_k Y_0 and R_k = q(R_{k-1}) R_{k-1} q(R_{k-1}): only Q and R are iterated,
    and the long side s is touched by Y_0 Y_0ᵀ and the final Q Y_0 alone (Dao, Zhang, Amsel, Chen,
    "Gram Newton-Schulz", dao-lab.ai/blog/2026/gram-newton-schulz, 2026). R squares Y's condition
    number, so rounding drifts R and Q; as published (their code and DeepSpeed's Muon), the
    iteration restarts at the steps of hpf_kernels.gram_restarts: Y <- Q Y, R <- Y Yᵀ afresh.
    """
    restarts = gram_restarts(len(coefficients))
    R, Q = torch.bmm(Y, Y.mT), None
    for i, (a, b, c) in enumerate(coefficients):
        if i in restarts:
            Y = torch.bmm(Q, Y)
            R, Q = torch.bmm(Y, Y.mT), None
        Z = torch.baddbmm(R, R, R, beta=b, alpha=c)  # b R + c R²; q(R) = a I + Z
        if Q is None:
            Q = Z.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            Q = torch.baddbmm(Q, Q, Z, beta=a)  # Q q(R)  (all polynomials in R commute)
        if i + 1 < len(coefficients) and i + 1 not in restarts:
            RZ = torch.baddbmm(R, R, Z, beta=a)  # R q(R)
            R = torch.baddbmm(RZ, Z, RZ, beta=a)  # q(R) R q(R)
    return torch.bmm(Q, Y)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Rows of x in consecutive groups; group g (sizes[g] rows, maybe 0) times w[g] [K, M].

    A loop of plain matmuls over the groups: on CPU this beats padding to a [G, max, K] bmm for
    uneven loads. An empty group is an empty matmul (next to free), kept so that the result is
    in autograd's graph even when every group is empty: an EP rank that receives no tokens
    must still run its half of the backward exchange (a fresh zeros tensor made it skip it)."""
    return torch.cat([xg @ w[g] for g, xg in enumerate(torch.split(x, list(sizes)))])


# -- block quantization (hpf_kernels.formats: the payload layout and the error bounds) -----------
MIN_SCALE = 2.0 ** -126  # float32's smallest normal: the least block scale (hpf_kernels.formats)


def quantize(x: torch.Tensor, fmt, block: int) -> torch.Tensor:
    """[rows, n] floats -> [rows, payload] uint8: each row's codes, then its block scales."""
    rows, n = x.shape
    if not fmt.scaled:  # bf16: the values themselves
        return x.to(torch.bfloat16).contiguous().view(torch.uint8)
    xb = x.reshape(rows, n // block, block).float()
    # nan propagates into the scale; the floor keeps the scale a normal float and qmax / amax finite
    # (a block below ~1e-36 made it inf: every nonzero code was +-qmax and fp8's zeros nan)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=fmt.qmax * MIN_SCALE)
    scale = amax / fmt.qmax
    t = xb * (fmt.qmax / amax)
    if fmt.name == "fp8":
        codes = t.clamp(-fmt.qmax, fmt.qmax).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        q = t.round().clamp(-fmt.qmax, fmt.qmax).to(torch.int8)
        if fmt.bits == 4:
            u = (q + 8).view(torch.uint8).reshape(rows, -1)
            codes = u[:, 0::2] | (u[:, 1::2] << 4)
        else:
            codes = q.view(torch.uint8)
    return torch.cat([codes.reshape(rows, -1), scale.reshape(rows, -1).view(torch.uint8)], dim=1)


def dequantize(payload: torch.Tensor, fmt, block: int, out: torch.Tensor) -> torch.Tensor:
    """[rows, payload] uint8 -> ``out`` [rows, n] (its dtype), the inverse of ``quantize``."""
    rows, n = out.shape
    if not fmt.scaled:
        return out.copy_(payload.contiguous().view(torch.bfloat16))
    cb = n * fmt.bits // 8
    codes = payload[:, :cb].contiguous()
    scale = payload[:, cb:].contiguous().view(torch.float32).view(rows, -1, 1)
    if fmt.name == "fp8":
        vals = codes.view(torch.float8_e4m3fn).float()
    elif fmt.bits == 8:
        vals = codes.view(torch.int8).float()
    else:
        vals = torch.stack([codes & 15, codes >> 4], dim=-1).float() - 8
    out.view(rows, -1, block).copy_(vals.view(rows, -1, block) * scale)
    return out


_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_THREEFRY_PARITY = 0x1BD11BDA


def threefry2x32(k0, k1, x0: torch.Tensor, x1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Threefry-2x32 with 20 rounds (Salmon et al. 2011, as jax.random): words are int32 tensors
    holding uint32 bits, since int32 adds wrap exactly as uint32 ones do and torch's int32 shifts
    are vectorized. Integer ops are exact, so every device gives the same bits. ``k0``, ``k1``:
    ints or int32 tensors that broadcast against the counters ``x0``, ``x1`` (not modified)."""
    ks = (k0, k1, k0 ^ k1 ^ _THREEFRY_PARITY)
    x0, x1 = torch.broadcast_tensors(x0 + _i32(ks[0]), x1 + _i32(ks[1]))
    x0, x1 = x0.contiguous(), x1.contiguous()  # fresh tensors (the sums), written in place below
    spill = torch.empty_like(x1)
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x0.add_(x1)
            torch.bitwise_right_shift(x1, 32 - r, out=spill).bitwise_and_((1 << r) - 1)  # a logical shift
            x1.bitwise_left_shift_(r).bitwise_or_(spill).bitwise_xor_(x0)
        x0.add_(_i32(ks[(i + 1) % 3]))
        x1.add_(_i32(ks[(i + 2) % 3])).add_(i + 1)
    return x0, x1


def _i32(v):
    """A uint32 value as the int32 with the same bits (ints), or the tensor as it is."""
    if isinstance(v, int):
        v &= 0xFFFFFFFF
        return v - (1 << 32) if v >= 1 << 31 else v
    return v
