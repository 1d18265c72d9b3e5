"""hpf_kernels.newton_schulz against an independent SVD model of what Newton-Schulz computes.

Each NS step applies the odd polynomial p(x) = a x + b x^3 + c x^5 to every singular value and
keeps the singular vectors, so for X = U S Vᵀ the exact result is U p_k(...p_1(S / (s ||X||_F))) Vᵀ,
with s the schedule's norm safety factor. The tests build that from torch.linalg.svd in fp64.
"""
import os
import subprocess
import sys

import pytest
import torch

import hpf_kernels
from hpf_kernels import newton_schulz
from hpf_kernels.backends import cuda

KELLER = (3.4445, -4.7750, 2.0315)
# The Polar Express paper (arXiv 2505.16932, Algorithm 1), typed in here from the paper, not the code.
PAPER_PE = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
]
PAPER_PE = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in PAPER_PE[:-1]] + [PAPER_PE[-1]]


def svd_model(X, schedule, norm_scale=1.0, eps=1e-7):
    """U p(S / (s ||X||_F + eps)) Vᵀ per matrix, in fp64, from the SVD of X."""
    X = X.double()
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    x = S / (torch.linalg.matrix_norm(X, keepdim=True)[..., 0] * norm_scale + eps)
    for a, b, c in schedule:
        x = a * x + b * x**3 + c * x**5
    return U @ torch.diag_embed(x) @ Vh


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32), (3, 2, 16, 24)])
def test_matches_svd_model_fp64(shape):
    # fp64 compute: the only differences are fp64 rounding over 5 steps, far below 1e-10.
    X = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = newton_schulz(X, compute_dtype=torch.float64)
    torch.testing.assert_close(got, svd_model(X, [KELLER] * 5), rtol=0, atol=1e-10)


def test_polar_express_matches_paper_polynomials_and_safety_scaling():
    X = torch.randn(4, 20, 36, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = newton_schulz(X, "polar_express", 10, compute_dtype=torch.float64)
    # steps past the paper's 8 polynomials reuse the last one
    want = svd_model(X, PAPER_PE + [PAPER_PE[-1]] * 2, norm_scale=1.01)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_fp32_close_to_polar_factor():
    """Loose check of the Muon direction in the default (fp32 on CPU) precision.

    Keller's quintic does not converge to 1: 5 steps leave singular values in about [0.68, 1.13]
    for inputs whose sigma_min / ||X||_F is above ~0.05, so ||NS(X) - U Vᵀ||_2 <= 0.35. Polar Express
    (8 steps) converges: 2e-3 allows fp32 rounding of the 24 matmuls with margin.
    """
    X = torch.randn(8, 64, 16, generator=torch.Generator().manual_seed(3))  # tall, well conditioned
    U, _, Vh = torch.linalg.svd(X.double(), full_matrices=False)
    polar = U @ Vh
    keller = newton_schulz(X)
    assert keller.dtype == torch.float32 and keller.shape == X.shape
    sv = torch.linalg.svdvals(keller.double())
    assert sv.min() > 0.6 and sv.max() < 1.2
    assert torch.linalg.matrix_norm(keller.double() - polar, ord=2).max() < 0.35
    pe = newton_schulz(X, "polar_express", 8)
    assert torch.linalg.matrix_norm(pe.double() - polar, ord=2).max() < 2e-3


def test_batched_equals_loop_and_norm_is_per_matrix():
    # Experts of wildly different scales: a norm taken across the batch would shrink the small ones.
    scales = torch.tensor([1e-3, 1.0, 1e3]).view(3, 1, 1, 1)
    X = torch.randn(3, 5, 12, 20, generator=torch.Generator().manual_seed(4)) * scales
    batched = newton_schulz(X)
    looped = torch.stack([torch.stack([newton_schulz(m) for m in expert]) for expert in X])
    # Same fp32 ops per matrix; only BLAS blocking could differ, so fp32 rounding is the bound.
    torch.testing.assert_close(batched, looped, rtol=1e-6, atol=1e-6)


def test_tall_is_transpose_of_wide():
    X = torch.randn(6, 48, 16, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(newton_schulz(X), newton_schulz(X.mT).mT, rtol=0, atol=0)


def test_coefficient_forms_agree():
    X = torch.randn(2, 16, 24, generator=torch.Generator().manual_seed(6))
    by_name = newton_schulz(X, "keller", 5)
    torch.testing.assert_close(newton_schulz(X, KELLER, 5), by_name, rtol=0, atol=0)
    torch.testing.assert_close(newton_schulz(X, [KELLER] * 5, 5), by_name, rtol=0, atol=0)
    # a per-step list really is applied step by step (checked against the SVD model)
    steps = [(2.0, -1.5, 0.5), (1.875, -1.25, 0.375), (3.0, -3.2, 1.2)]
    got = newton_schulz(X.double(), steps, 3, compute_dtype=torch.float64)
    torch.testing.assert_close(got, svd_model(X, steps), rtol=0, atol=1e-10)


def test_dtype_and_compute_dtype():
    X = torch.randn(16, 24, generator=torch.Generator().manual_seed(7))
    out = newton_schulz(X.bfloat16())
    assert out.dtype == torch.bfloat16 and out.shape == X.shape
    bf16 = newton_schulz(X, compute_dtype=torch.bfloat16)
    assert bf16.dtype == torch.float32
    # bf16 keeps ~3 significant digits; 5 steps of it stay within 0.05 of the fp32 result
    assert (bf16 - newton_schulz(X)).abs().max() < 0.05


@pytest.mark.parametrize(
    "coefficients, steps, match",
    [
        ((1.0, 2.0), 5, "three finite numbers"),
        ([KELLER] * 4, 5, "4 per-step tuples but steps=5"),
        ("nope", 5, "unknown coefficients"),
        ((1.0, float("nan"), 1.0), 5, "finite"),
        ([KELLER, (1.0, 2.0)], 2, r"coefficients\[1\]"),
        ("keller", 0, "steps must be a positive int"),
    ],
)
def test_bad_coefficients(coefficients, steps, match):
    with pytest.raises(ValueError, match=match):
        newton_schulz(torch.randn(4, 4), coefficients, steps)


def test_bad_input_shape():
    with pytest.raises(ValueError, match=r"\[\.\.\., m, n\]"):
        newton_schulz(torch.randn(5))


def test_npu_backend_without_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` raise ImportError
    with pytest.raises(RuntimeError, match=r"pip install hpf\[npu\]"):
        newton_schulz(torch.randn(4, 4), backend="npu")


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        newton_schulz(torch.randn(4, 4), backend="tpu")


def test_dispatch_by_device_type():
    assert hpf_kernels.BACKENDS["cuda"] is cuda
    X = torch.randn(8, 12, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(newton_schulz(X), newton_schulz(X, backend="reference"), rtol=0, atol=0)


def test_cuda_backend_without_triton_uses_torch(monkeypatch):
    monkeypatch.setattr(cuda, "symmetric_kernel", lambda: None)
    X = torch.randn(2, 8, 12, generator=torch.Generator().manual_seed(9))
    want = newton_schulz(X, compute_dtype=torch.bfloat16, backend="reference")
    torch.testing.assert_close(newton_schulz(X, backend="cuda"), want, rtol=0, atol=0)


def test_triton_symmetric_kernel_in_interpreter():
    """The Triton kernel's tiling and mirroring, run by Triton's CPU interpreter (needs triton).

    In a fresh process: TRITON_INTERPRET must be set before triton is first imported.
    """
    pytest.importorskip("triton", reason="optional dependency; the cuda backend falls back to torch")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def triton_interpreted_checks():
    """fp16, as the interpreter's tl.dot mishandles bf16; tolerances are fp16 rounding (2^-11
    relative) times a few for the fp32-accumulated sums."""
    g = torch.Generator().manual_seed(10)
    P = torch.randn(2, 70, 33, generator=g).half()  # 70 rows: two tiles with a ragged edge
    C = torch.randn(2, 70, 70, generator=g)
    C = (C + C.mT).half()
    A = cuda.symmetric_product(P)
    want = P.float() @ P.float().mT
    torch.testing.assert_close(A.float(), want, rtol=2e-3, atol=2e-3 * want.abs().max().item())
    B = cuda.symmetric_product(A, C, alpha=0.5, beta=-2.0)
    want = 0.5 * A.float() @ A.float() - 2.0 * C.float()
    torch.testing.assert_close(B.float(), want, rtol=2e-3, atol=2e-3 * want.abs().max().item())
    X = torch.randn(2, 40, 70, generator=g)
    got = newton_schulz(X, backend="cuda", compute_dtype=torch.float16)
    ref = newton_schulz(X, backend="reference", compute_dtype=torch.float16)
    assert (got - ref).abs().max() < 5e-3  # two fp16 routes through 5 steps


if __name__ == "__main__":
    triton_interpreted_checks()
