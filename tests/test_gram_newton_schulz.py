"""Gram Newton-Schulz (hpf_kernels.newton_schulz(variant="gram"/"auto")) against the standard
iteration, the fp64 SVD model of test_kernels, and its own FLOP model.

Both iterations apply the same polynomials to the singular values, so in fp64 both equal the SVD
model to rounding. In fp32 the Gram form squares the condition number (R = Y Yᵀ), so its rounding
is larger than the standard's: the bounds below are measured with about 3x margin, and the
restart (hpf_kernels.gram_restarts) is what keeps them there on ill-conditioned input.
"""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hpf.optim.muon_optimizer import muon
from hpf_kernels import gram_restarts, newton_schulz, newton_schulz_flops, pick_variant
from test_kernels import KELLER, PAPER_PE, svd_model


@pytest.mark.parametrize("shape", [(24, 72), (72, 24), (3, 2, 16, 40), (32, 32)])
@pytest.mark.parametrize("schedule", ["keller", "polar_express"])
def test_gram_equals_svd_model_in_fp64(shape, schedule):
    X = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    if schedule == "keller":
        got, want = newton_schulz(X, compute_dtype=torch.float64, variant="gram"), svd_model(X, [KELLER] * 5)
    else:
        got = newton_schulz(X, "polar_express", 8, compute_dtype=torch.float64, variant="gram")
        want = svd_model(X, PAPER_PE, norm_scale=1.01)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def ill_conditioned(m, n, seed):
    """Singular values from 1 down to 1e-6, log-spaced: a momentum of low stable rank."""
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, m, generator=g, dtype=torch.float64))
    return (U * torch.logspace(0, -6, m, dtype=torch.float64)) @ V.mT


@pytest.mark.parametrize("kind, atol", [("gaussian", 3e-6), ("ill-conditioned", 2e-5)])
def test_gram_fp32_is_close_to_standard_fp32(kind, atol):
    """Measured max |gram - standard| on 128x512 (entries ~0.04): 7e-7 Gaussian, 5e-6
    ill-conditioned (without the restart, 3e-5). The standard iteration's own fp32 error is ~1e-6."""
    X = (torch.randn(128, 512, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
         if kind == "gaussian" else ill_conditioned(128, 512, 3)).float()
    standard = newton_schulz(X, variant="standard")
    torch.testing.assert_close(newton_schulz(X, variant="gram"), standard, rtol=0, atol=atol)
    torch.testing.assert_close(newton_schulz(X.mT, variant="gram"), standard.mT, rtol=0, atol=atol)


def counted_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("shape, steps", [((2, 24, 72), 5), ((40, 16), 8), ((16, 40), 2), ((20, 20), 1)])
@pytest.mark.parametrize("variant", ["standard", "gram"])
def test_flop_model_counts_the_matmuls_that_run(shape, steps, variant):
    X = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    got = counted_flops(lambda: newton_schulz(X, "polar_express", steps, variant=variant))
    assert got == newton_schulz_flops(shape, steps, variant)


def test_auto_picks_the_variant_with_fewer_flops():
    assert gram_restarts(5) == (2,) and gram_restarts(2) == ()
    for shape in [(64, 64), (64, 96), (64, 100), (256, 1024), (4096, 1024), (3, 32, 128)]:
        cheaper = min(("standard", "gram"), key=lambda v: newton_schulz_flops(shape, 5, v))
        assert pick_variant(shape, 5, "auto") == cheaper
        X = torch.randn(shape, generator=torch.Generator().manual_seed(5))
        torch.testing.assert_close(newton_schulz(X, variant="auto"), newton_schulz(X, variant=cheaper),
                                   rtol=0, atol=0)
    assert pick_variant((64, 64), 5, "auto") == "standard" and pick_variant((256, 1024), 5, "auto") == "gram"
    # an aspect ratio of 4 costs two thirds of the standard FLOPs with one restart
    assert newton_schulz_flops((256, 1024), 5, "gram") * 3 == newton_schulz_flops((256, 1024), 5, "standard") * 2


def test_unknown_variant_is_an_error():
    with pytest.raises(ValueError, match="unknown Newton-Schulz variant 'fast'"):
        newton_schulz(torch.randn(4, 8), variant="fast")
    with pytest.raises(ValueError, match="unknown Newton-Schulz variant"):
        muon(ns_variant="Gram")


def test_muon_with_gram_stays_within_fp32_rounding_of_standard_over_20_steps():
    """hpf.optim.muon(ns_variant="auto") on rectangular matrices: Gram runs, and 20 steps move the
    params to within 1e-5 of the standard iteration's (while each moves by up to ~0.08)."""
    g = torch.Generator().manual_seed(6)
    start = {"w_in": torch.randn(32, 96, generator=g), "w_out": torch.randn(96, 32, generator=g)}
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in start.items()} for _ in range(20)]
    assert {pick_variant(v.shape, 5, "auto") for v in start.values()} == {"gram"}
    out = {}
    for variant in ("standard", "auto"):
        opt = muon(lr=0.02, ns_variant=variant)
        params = {k: v.clone() for k, v in start.items()}
        state = opt.init(params)
        for grad in grads:
            params, state = opt.update(grad, state, params)
        out[variant] = params
    for k in start:
        torch.testing.assert_close(out["auto"][k], out["standard"][k], rtol=1e-5, atol=1e-5)
        assert (out["auto"][k] - start[k]).abs().max() > 0.05  # the steps were taken
