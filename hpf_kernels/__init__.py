"""Device kernels for hpf behind one dispatch by device type.

newton_schulz orthogonalizes a batch of matrices (Muon's direction); grouped_mm runs MoE experts
over their token groups (torch._grouped_mm on CUDA sm90+ bf16, a loop of matmuls elsewhere). Backends: "reference" (plain
torch, any device), "cuda" (optional Triton kernel for the symmetric products), "npu" (torch_npu,
imported only when used).
"""
from __future__ import annotations

import torch

from .backends import cuda, npu, reference
from .coefficients import NAMED_COEFFICIENTS, CoefficientSpec, resolve_coefficients

__all__ = ["newton_schulz", "grouped_mm", "resolve_coefficients", "NAMED_COEFFICIENTS", "BACKENDS"]

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
) -> torch.Tensor:
    """Approximate the orthogonal polar factor U Vᵀ of each matrix in X [..., m, n].

    Every leading dim is a batch dim; each matrix is normalized by its own Frobenius norm.
    coefficients: "keller", "polar_express", one (a, b, c) tuple for every step, or a list of
    `steps` tuples. compute_dtype defaults to the backend's choice (fp32 on CPU, bf16 on
    accelerators). Returns a tensor of X's shape and dtype.
    """
    if not isinstance(X, torch.Tensor) or X.ndim < 2:
        shape = tuple(X.shape) if isinstance(X, torch.Tensor) else type(X).__name__
        raise ValueError(f"newton_schulz needs a tensor of shape [..., m, n], got {shape}")
    if X.numel() == 0:
        raise ValueError(f"newton_schulz got an empty tensor of shape {tuple(X.shape)}")
    per_step, norm_scale = resolve_coefficients(coefficients, steps)
    name = backend or (X.device.type if X.device.type in BACKENDS else "reference")
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; use one of {sorted(BACKENDS)} or None (by device)")
    return BACKENDS[name].newton_schulz(
        X, per_step, norm_scale=norm_scale, eps=eps, compute_dtype=compute_dtype
    )


def grouped_mm(x: torch.Tensor, w: torch.Tensor, sizes, *, backend: str | None = None) -> torch.Tensor:
    """[N, K] rows in consecutive groups of ``sizes`` (G counts summing to N, zeros allowed) times
    ``w`` [G, K, M]: group g's rows times w[g]. Differentiable in x and w. Returns [N, M]."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1] or len(sizes) != w.shape[0]:
        raise ValueError(f"grouped_mm needs x [N, K], w [G, K, M] and G sizes; got x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}, {len(sizes)} sizes")
    name = backend or (x.device.type if x.device.type in BACKENDS else "reference")
    return BACKENDS[name].grouped_mm(x, w, sizes)
