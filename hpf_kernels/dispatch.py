"""The device dispatch behind hpf_kernels' public functions: a tensor on device type T runs
BACKENDS[T] when it has one, else the reference torch backend (see the package docstring)."""
from __future__ import annotations

import torch

from .backends import cuda, native, npu, reference
from .coefficients import CoefficientSpec, resolve_coefficients
from .flops import pick_variant
from .formats import check_block, check_format, payload_bytes

# backend name -> module; a tensor on device type T uses BACKENDS[T] when present, else "reference".
BACKENDS = {"reference": reference, "cuda": cuda, "npu": npu}


def newton_schulz(
    X: torch.Tensor,
    coefficients: CoefficientSpec = "keller",
    steps: int = 5,
    *,
    backend: str | None = None,
    compute_dtype: torch.dtype | None = None,
    eps: float = 1e-7,
    variant: str = "standard",
) -> torch.Tensor:
    """Approximate the orthogonal polar factor U Vᵀ of each matrix in X [..., m, n].

    Every leading dim is a batch dim; each matrix is normalized by its own Frobenius norm.
    coefficients: "keller", "polar_express", one (a, b, c) tuple for every step, or a list of
    `steps` tuples. compute_dtype defaults to the backend's choice (fp32 on CPU, bf16 on
    accelerators). variant: "standard" (torch.optim.Muon's iteration), "gram" (the same
    polynomials iterated on the r x r Gram matrix, fewer FLOPs on rectangular matrices, with
    its own rounding: docs/muon.md) or "auto" (the one with fewer FLOPs for X's shape,
    hpf_kernels.pick_variant). Returns a tensor of X's shape and dtype.
    """
    if not isinstance(X, torch.Tensor) or X.ndim < 2:
        shape = tuple(X.shape) if isinstance(X, torch.Tensor) else type(X).__name__
        raise ValueError(f"newton_schulz needs a tensor of shape [..., m, n], got {shape}")
    if X.numel() == 0:
        raise ValueError(f"newton_schulz got an empty tensor of shape {tuple(X.shape)}")
    per_step, norm_scale = resolve_coefficients(coefficients, steps)
    gram = pick_variant(X.shape, steps, variant) == "gram"
    return _backend(X, backend).newton_schulz(
        X, per_step, norm_scale=norm_scale, eps=eps, compute_dtype=compute_dtype, gram=gram
    )


def grouped_mm(x: torch.Tensor, w: torch.Tensor, sizes, *, backend: str | None = None) -> torch.Tensor:
    """[N, K] rows in consecutive groups of ``sizes`` (G counts summing to N, zeros allowed) times
    ``w`` [G, K, M]: group g's rows times w[g]. Differentiable in x and w. Returns [N, M]."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1] or len(sizes) != w.shape[0]:
        raise ValueError(f"grouped_mm needs x [N, K], w [G, K, M] and G sizes; got x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}, {len(sizes)} sizes")
    return _backend(x, backend).grouped_mm(x, w, sizes)


def quantize(x: torch.Tensor, fmt: str, block: int = 256, *, backend: str | None = None) -> torch.Tensor:
    """Rows of ``x`` ([n] or [rows, n], floating) -> their payloads, uint8 [rows, payload_bytes(n)]:
    codes in ``fmt`` ("bf16", "fp8", "int8", "int4") and one float32 scale per ``block`` values.
    ``block`` must divide n (bf16 has no scales and ignores it). Errors: hpf_kernels.formats."""
    f = check_format(fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() not in (1, 2):
        raise ValueError(f"quantize needs a floating tensor [n] or [rows, n], got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    x2 = x.reshape(1, -1) if x.dim() == 1 else x
    _check_rows(x2.shape[1], f, block)
    return _backend(x, backend).quantize(x2, f, block)


def dequantize(payload: torch.Tensor, fmt: str, block: int, out: torch.Tensor, *,
               backend: str | None = None) -> torch.Tensor:
    """Payloads of ``quantize`` (uint8 [rows, payload_bytes(n)]) -> ``out`` ([n] or [rows, n], any
    floating dtype), in place; returns ``out``."""
    f = check_format(fmt)
    out2 = out.view(1, -1) if out.dim() == 1 else out
    _check_rows(out2.shape[1], f, block)
    want = (out2.shape[0], payload_bytes(out2.shape[1], fmt, block))
    if payload.dtype != torch.uint8 or payload.reshape(-1).numel() != want[0] * want[1]:
        raise ValueError(f"dequantize: a payload of {want[0]} row(s) of {want[1]} bytes (uint8) fills out "
                         f"{tuple(out.shape)} in {fmt} with block {block}; got {payload.dtype} {tuple(payload.shape)}")
    _backend(out, backend).dequantize(payload.reshape(want), f, block, out2)
    return out


def threefry2x32(k0, k1, x0: torch.Tensor, x1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Threefry-2x32-20 of the counters (x0, x1) (int32 tensors of uint32 bits) under the key
    (k0, k1) (ints, or int32 tensors that broadcast): two words of 32 random bits per counter.
    One plain-torch implementation serves every device: its integer ops are exact, so the bits
    are the same everywhere, which hpf.random promises."""
    return reference.threefry2x32(k0, k1, x0, x1)


def threefry2x32_range(k0: int, k1: int, first: int, count: int, device: torch.device) -> torch.Tensor:
    """``threefry2x32`` of the 64-bit counters first .. first + count - 1 (high word, low word)
    under the key (k0, k1) (uint32 ints): int32 [count, 2], each counter's two output words. On
    a CPU one fused C loop (hpf_kernels.backends.native) where it builds, with the same bits."""
    words = native.threefry2x32_range(k0, k1, first, count, device)
    if words is not None:
        return words
    counters = torch.arange(first, first + count, device=device)
    x0, x1 = reference.threefry2x32(k0, k1, _low_word(counters >> 32), _low_word(counters))
    return torch.stack([x0, x1], dim=-1)


def _low_word(x: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of int64 values as int32 words (the same bits)."""
    return (x & 0xFFFFFFFF).to(torch.int32)


def _check_rows(n: int, f, block: int) -> None:
    check_block(block, f.name)
    if f.scaled and n % block:
        raise ValueError(f"block size {block} does not divide the {n} values of a row: use a block that divides "
                         f"{n}, or pad rows to a multiple of {block}")


def _backend(t: torch.Tensor, backend: str | None):
    """The backend module for a tensor on ``t``'s device (or the one named)."""
    name = backend or (t.device.type if t.device.type in BACKENDS else "reference")
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; use one of {sorted(BACKENDS)} or None (by device)")
    return BACKENDS[name]
