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
    gram: bool = False,
) -> torch.Tensor:
    require_torch_npu()
    if X.device.type != "npu":
        raise ValueError(
            f"backend='npu' got a tensor on {X.device}; move it to the NPU first "
            f"(X.to('npu')) or use backend='reference'"
        )
    return reference.newton_schulz(
        X, coefficients, norm_scale=norm_scale, eps=eps, compute_dtype=compute_dtype or torch.bfloat16,
        gram=gram,
    )


def grouped_mm(x: torch.Tensor, w: torch.Tensor, sizes) -> torch.Tensor:
    """The reference loop (torch_npu's npu_grouped_matmul is the next step here)."""
    return reference.grouped_mm(x, w, sizes)


NPU_QUANT_ROW = 11264  # npu_dynamic_quant's longest row on Atlas A2


def quantize(x: torch.Tensor, fmt, block: int) -> torch.Tensor:
    """int8 of fp16/bf16 rows on torch_npu's fused ``npu_dynamic_quant`` (per-row symmetric: each
    [block] row of x gets scale = amax / 127, the reference's formula); the reference otherwise."""
    npu = require_torch_npu()
    if (fmt.name != "int8" or x.dtype not in (torch.float16, torch.bfloat16) or block > NPU_QUANT_ROW
            or not hasattr(npu, "npu_dynamic_quant")):
        return reference.quantize(x, fmt, block)
    rows, n = x.shape
    codes, scale = npu.npu_dynamic_quant(x.reshape(-1, block))
    return torch.cat([codes.view(torch.uint8).reshape(rows, n),
                      scale.float().reshape(rows, -1).contiguous().view(torch.uint8)], dim=1)


def dequantize(payload: torch.Tensor, fmt, block: int, out: torch.Tensor) -> torch.Tensor:
    """The reference's torch ops (a multiply per block), which run on the NPU as they are."""
    require_torch_npu()
    return reference.dequantize(payload, fmt, block, out)
