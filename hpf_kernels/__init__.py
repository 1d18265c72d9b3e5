"""Device kernels for hpf behind one dispatch by device type.

newton_schulz orthogonalizes a batch of matrices (Muon's direction; standard or Gram iteration,
newton_schulz_flops says what each costs); grouped_mm runs MoE experts
over their token groups (torch._grouped_mm on CUDA sm90+ bf16, a loop of matmuls elsewhere);
quantize/dequantize pack rows into the slow tier's block-scaled wire formats (hpf_kernels.formats);
threefry2x32 (and threefry2x32_range, over a run of counters) is the counter-based generator under
hpf.random.
Backends: "reference" (plain torch, any device), "cuda" (optional Triton kernels), "npu"
(torch_npu, imported only when used).

The dispatch lives in hpf_kernels.dispatch; this file only re-exports."""
from .coefficients import NAMED_COEFFICIENTS, resolve_coefficients
from .dispatch import BACKENDS, dequantize, grouped_mm, newton_schulz, quantize, threefry2x32, threefry2x32_range
from .flops import VARIANTS, gram_restarts, newton_schulz_flops, pick_variant
from .formats import FORMATS, payload_bytes

__all__ = ["newton_schulz", "grouped_mm", "threefry2x32", "threefry2x32_range", "quantize", "dequantize", "payload_bytes", "FORMATS",
           "resolve_coefficients",
           "NAMED_COEFFICIENTS", "BACKENDS", "VARIANTS", "gram_restarts", "newton_schulz_flops", "pick_variant"]
