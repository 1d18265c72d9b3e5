"""CUDA backend: the reference batched NS, with the two symmetric products on a Triton kernel.

A = Y Yᵀ and A² = A Aᵀ are symmetric, so the kernel computes only the tiles on and below the
diagonal and mirrors each one: about half the FLOPs of those two products. Triton is imported
lazily; without it (or for fp32 compute, where cuBLAS keeps full fp32 precision) the plain torch
path runs. If the kernel fails to compile on first use, a warning says so and torch takes over.
Checked on CPU under TRITON_INTERPRET=1 in fp16 (the interpreter's tl.dot mishandles bf16).
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Sequence

import torch

from . import reference

_BLOCK = 64
_BLOCK_K = 32


@functools.lru_cache(maxsize=1)
def symmetric_kernel():
    """Build the Triton kernel, or return None when Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _sym_product(P, C, OUT, M, K, alpha, beta,
                     s_pb, s_pm, s_pk, s_cb, s_cm, s_cn, s_ob, s_om, s_on,
                     HAS_C: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
        # OUT[b] = alpha * P[b] @ P[b]ᵀ + beta * C[b]  (C symmetric), lower tiles computed, mirrored.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        b = tl.program_id(2)
        if pid_n <= pid_m:
            rm = pid_m * BLOCK + tl.arange(0, BLOCK)
            rn = pid_n * BLOCK + tl.arange(0, BLOCK)
            rk = tl.arange(0, BLOCK_K)
            acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk
                lhs = tl.load(P + b * s_pb + rm[:, None] * s_pm + kk[None, :] * s_pk,
                              mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
                rhs = tl.load(P + b * s_pb + rn[None, :] * s_pm + kk[:, None] * s_pk,
                              mask=(rn[None, :] < M) & (kk[:, None] < K), other=0.0)
                acc += tl.dot(lhs, rhs)
            acc = acc * alpha
            if HAS_C:
                c = tl.load(C + b * s_cb + rm[:, None] * s_cm + rn[None, :] * s_cn,
                            mask=(rm[:, None] < M) & (rn[None, :] < M), other=0.0)
                acc += beta * c.to(tl.float32)
            out = acc.to(OUT.dtype.element_ty)
            tl.store(OUT + b * s_ob + rm[:, None] * s_om + rn[None, :] * s_on, out,
                     mask=(rm[:, None] < M) & (rn[None, :] < M))
            if pid_n < pid_m:
                tl.store(OUT + b * s_ob + rn[:, None] * s_om + rm[None, :] * s_on, tl.trans(out),
                         mask=(rn[:, None] < M) & (rm[None, :] < M))

    return _sym_product


def symmetric_product(P: torch.Tensor, C: torch.Tensor | None = None, alpha: float = 1.0,
                      beta: float = 0.0) -> torch.Tensor:
    """alpha * P Pᵀ + beta * C for a batch P [B, M, K] (C symmetric [B, M, M]) on the Triton kernel."""
    kernel = symmetric_kernel()
    batch, M, K = P.shape
    out = torch.empty(batch, M, M, device=P.device, dtype=P.dtype)
    c = out if C is None else C
    tiles = (M + _BLOCK - 1) // _BLOCK
    kernel[(tiles, tiles, batch)](
        P, c, out, M, K, alpha, beta, *P.stride(), *c.stride(), *out.stride(),
        HAS_C=C is not None, BLOCK=_BLOCK, BLOCK_K=_BLOCK_K,
    )
    return out


_triton_broken = False


def newton_schulz(
    X: torch.Tensor,
    coefficients: Sequence[tuple[float, float, float]],
    *,
    norm_scale: float,
    eps: float,
    compute_dtype: torch.dtype | None,
    gram: bool = False,
) -> torch.Tensor:
    global _triton_broken
    compute_dtype = compute_dtype or torch.bfloat16
    on_triton_device = X.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    use_triton = (not gram and on_triton_device and not _triton_broken
                  and compute_dtype in (torch.bfloat16, torch.float16) and symmetric_kernel() is not None)
    if use_triton:
        try:
            return triton_newton_schulz(X, coefficients, norm_scale, eps, compute_dtype)
        except Exception as err:  # a compile failure must not stop training: warn once, use torch
            _triton_broken = True
            warnings.warn(f"hpf_kernels: Triton Newton-Schulz failed ({err!r}); using torch matmuls")
    return reference.newton_schulz(  # Gram: plain torch matmuls (its products are not all Y Yᵀ)
        X, coefficients, norm_scale=norm_scale, eps=eps, compute_dtype=compute_dtype, gram=gram
    )


def triton_newton_schulz(X, coefficients, norm_scale, eps, compute_dtype):
    Y, tall = reference.normalized_wide(X, norm_scale, eps, compute_dtype)
    Y = Y.contiguous()
    for a, b, c in coefficients:
        A = symmetric_product(Y)
        B = symmetric_product(A, A, alpha=c, beta=b)  # c A Aᵀ + b A = c A² + b A, as A is symmetric
        Y = torch.baddbmm(Y, B, Y, beta=a)
    return reference.restore(Y, tall, X)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, sizes) -> torch.Tensor:
    """torch._grouped_mm (one kernel for all groups) for bf16 on sm90+, with 16-byte aligned
    rows; the reference loop otherwise."""
    k, m = w.shape[-2:]
    fast = (hasattr(torch, "_grouped_mm") and x.dtype == w.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0) and k % 8 == 0 and m % 8 == 0)
    if not fast:
        return reference.grouped_mm(x, w, sizes)
    sizes = torch.as_tensor(list(sizes) if not isinstance(sizes, torch.Tensor) else sizes, device=x.device)
    return torch._grouped_mm(x, w, offs=sizes.cumsum(0).to(torch.int32))


# -- block quantization: one program per (row, block) ---------------------------------------------
@functools.lru_cache(maxsize=1)
def quant_kernels():
    """Build the Triton quantize/dequantize kernels, or return None when Triton is not installed.

    Same math as the reference (hpf_kernels.formats); rounding ties may go the other way (one
    code apart, inside the stated bound). Scales are moved byte by byte: payload rows need not
    be 4-byte aligned."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    # Each program holds its block as [HALF, 2] value pairs (2i, 2i+1): int4 packs a pair per byte.
    @triton.jit
    def _quantize(X, OUT, n, payload, block, qmax, FP8: tl.constexpr, INT4: tl.constexpr, HALF: tl.constexpr):
        row, b = tl.program_id(0), tl.program_id(1)
        i = tl.arange(0, HALF)
        j = 2 * i[:, None] + tl.arange(0, 2)[None, :]
        m = j < block
        x = tl.load(X + row * n + b * block + j, mask=m, other=0.0).to(tl.float32)
        # + nan when the block holds inf or nan (tl.max drops nan; the scale must carry it)
        # (floored as the reference's: a normal scale, a finite qmax / amax)
        amax = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), qmax * 1.1754943508222875e-38) + \
            tl.sum(tl.sum(x * 0.0, axis=1), axis=0)
        scale = amax / qmax
        t = x * (qmax / amax)
        if FP8:
            c = tl.minimum(tl.maximum(t, -qmax), qmax).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            q = tl.where(t >= 0, tl.floor(t + 0.5), tl.ceil(t - 0.5))
            c = tl.minimum(tl.maximum(q, -qmax), qmax).to(tl.int8).to(tl.uint8, bitcast=True)
        out = OUT + row * payload
        if INT4:
            lo, hi = tl.split((c + 8) & 15)
            tl.store(out + b * (block // 2) + i, lo | (hi << 4), mask=2 * i < block)
            codes_bytes = n // 2
        else:
            tl.store(out + b * block + j, c, mask=m)
            codes_bytes = n
        k = tl.arange(0, 4)
        bits = scale.to(tl.int32, bitcast=True)
        tl.store(out + codes_bytes + 4 * b + k, ((bits >> (8 * k)) & 255).to(tl.uint8))

    @triton.jit
    def _dequantize(P, OUT, n, payload, block, FP8: tl.constexpr, INT4: tl.constexpr, HALF: tl.constexpr):
        row, b = tl.program_id(0), tl.program_id(1)
        i = tl.arange(0, HALF)
        j = 2 * i[:, None] + tl.arange(0, 2)[None, :]
        m = j < block
        src = P + row * payload
        codes_bytes = n // 2 if INT4 else n
        k = tl.arange(0, 4)
        scale = tl.sum(tl.load(src + codes_bytes + 4 * b + k).to(tl.int32) << (8 * k), axis=0).to(tl.float32,
                                                                                                    bitcast=True)
        if INT4:
            byte = tl.load(src + b * (block // 2) + i, mask=2 * i < block, other=0).to(tl.int32)
            v = tl.join((byte & 15) - 8, (byte >> 4) - 8).to(tl.float32)
        elif FP8:
            v = tl.load(src + b * block + j, mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            v = tl.load(src + b * block + j, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        tl.store(OUT + row * n + b * block + j, (v * scale).to(OUT.dtype.element_ty), mask=m)

    return _quantize, _dequantize


_quant_broken = False


def _triton_quant_ok(t: torch.Tensor, fmt, block: int) -> bool:
    """Scaled formats with even blocks (the kernels work on value pairs) on a Triton device."""
    on_device = t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return (on_device and not _quant_broken and fmt.scaled and block % 2 == 0 and t.is_contiguous()
            and quant_kernels() is not None)


def _launch(which: int, rows: int, n: int, block: int, fmt, *args) -> bool:
    """Run kernel ``which`` (0 quantize, 1 dequantize); False (and a warning, once) if it fails to compile."""
    global _quant_broken
    try:
        quant_kernels()[which][(rows, n // block)](*args, FP8=fmt.name == "fp8", INT4=fmt.bits == 4,
                                                  HALF=1 << max(0, (block // 2 - 1).bit_length()))
        return True
    except Exception as err:  # e.g. no fp8 conversion on this GPU: warn once, use torch
        _quant_broken = True
        warnings.warn(f"hpf_kernels: Triton quantization failed ({err!r}); using torch")
        return False


def quantize(x: torch.Tensor, fmt, block: int) -> torch.Tensor:
    if _triton_quant_ok(x, fmt, block):
        from ..formats import payload_bytes

        rows, n = x.shape
        out = torch.empty(rows, payload_bytes(n, fmt.name, block), dtype=torch.uint8, device=x.device)
        if _launch(0, rows, n, block, fmt, x, out, n, out.shape[1], block, fmt.qmax):
            return out
    return reference.quantize(x, fmt, block)


def dequantize(payload: torch.Tensor, fmt, block: int, out: torch.Tensor) -> torch.Tensor:
    rows, n = out.shape
    if _triton_quant_ok(out, fmt, block) and _launch(1, rows, n, block, fmt, payload.contiguous(), out, n,
                                                     payload.shape[1], block):
        return out
    return reference.dequantize(payload, fmt, block, out)
