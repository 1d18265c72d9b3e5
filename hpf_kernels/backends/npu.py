"""Ascend NPU backend: torch_npu registers the device; the math is the reference batched NS in bf16.

torch_npu is imported only when this backend runs, so machines without it import hpf freely.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import reference


def require_torch_npu():
    try:
        import torch_npu  # noqa: F401  (import registers the "npu" device with torch)
    except ImportError as err:
        raise RuntimeError(
            "backend='npu' needs torch_npu, which is not installed: `pip install hpf[npu]` "
            "(on an Ascend machine with CANN), or use backend='reference'"
        ) from err
    return torch_npu


def newton_schulz(
    X: torch.Tensor,
    coefficients: Sequence[tuple[float, float, float]],
    *,
    norm_scale: float,
    eps: float,
    compute_dtype: torch.dtype | None,
) -> torch.Tensor:
    require_torch_npu()
    if X.device.type != "npu":
        raise ValueError(
            f"backend='npu' got a tensor on {X.device}; move it to the NPU first "
            f"(X.to('npu')) or use backend='reference'"
        )
    return reference.newton_schulz(
        X, coefficients, norm_scale=norm_scale, eps=eps, compute_dtype=compute_dtype or torch.bfloat16
    )


def grouped_mm(x: torch.Tensor, w: torch.Tensor, sizes) -> torch.Tensor:
    """The reference loop (torch_npu's npu_grouped_matmul is the next step here)."""
    return reference.grouped_mm(x, w, sizes)
