"""The CPU's C draws (hpf_kernels.backends.native) against their spec, the torch reference: the
same bits for every input the normal can see, and Threefry's over runs of counters."""
import os
import shutil

import pytest
import torch

import hpf_kernels
from hpf import random as R
from hpf_kernels.backends import native, reference

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")


def test_the_c_kernels_build_where_there_is_a_compiler():
    assert native._load() is not None  # (else every draw silently takes the slower reference)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


@pytest.mark.parametrize("interval", [None, (-2.0, 2.0), (-6.0, -3.0)])
def test_the_c_normal_has_the_references_bits_on_every_24_bit_input(interval):
    """A normal draw is a function of 24 of its word's bits: all 2^24 of them (and the inputs two
    truncated normals make of them, tails included) give the reference's bits."""
    w = (torch.arange(1 << 24, dtype=torch.int64) << 8).to(torch.int32)
    p = R._open_unit(w)
    if interval is not None:
        lo, hi = R._tail_cdfs(*interval)
        p = p * (hi - lo) + lo
    fast = native.ppnd7(p, R._PPND7_CONSTANTS)
    want = R._ppnd7_reference(p)
    assert int(((p - 0.5).abs() > 0.425).sum()) > 1000  # (the tail's own pass is exercised)
    assert torch.equal(_bits(fast), _bits(want)), int((_bits(fast) != _bits(want)).sum())


@pytest.mark.parametrize("k0, k1, first, count", [
    (0, 0, 0, 1), (0x13198A2E, 0x03707344, 0, 1000), (0xFFFFFFFF, 0xFFFFFFFF, (1 << 32) - 300, 1000),
    (7, 0xDEADBEEF, (1 << 64) - 5, 5)])
def test_threefry_over_a_run_of_counters_has_the_references_bits(k0, k1, first, count):
    words = native.threefry2x32_range(k0, k1, first, count, CPU)
    c = [first + i for i in range(count)]
    i32 = lambda v: torch.tensor([x - (1 << 32) if x >= 1 << 31 else x for x in v], dtype=torch.int32)  # noqa: E731
    x0, x1 = reference.threefry2x32(k0, k1, i32([x >> 32 for x in c]), i32([x & 0xFFFFFFFF for x in c]))
    assert torch.equal(words, torch.stack([x0, x1], dim=-1))


def test_random123s_known_answer_through_the_run_of_counters():
    (x0, x1), = hpf_kernels.threefry2x32_range(0xFFFFFFFF, 0xFFFFFFFF, (1 << 64) - 1, 1, CPU).tolist()
    assert (x0 & 0xFFFFFFFF, x1 & 0xFFFFFFFF) == (0x1CB996FC, 0xBB002BE7)


def test_without_the_c_kernels_draws_have_the_same_bits(monkeypatch):
    k = R.key(3)
    fast = [R.normal(k, (70001,)), R.truncated_normal(k, -2.0, 2.0, (999,)), R.bits(k, (4097,))]
    monkeypatch.setattr(native, "_lib", False)
    assert native.ppnd7(torch.zeros(1), R._PPND7_CONSTANTS) is None
    slow = [R.normal(k, (70001,)), R.truncated_normal(k, -2.0, 2.0, (999,)), R.bits(k, (4097,))]
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))


def test_the_c_normal_matches_the_reference_off_its_grid():
    """Inputs no normal draw makes (zero, subnormals, the smallest normal, 1, beyond (0, 1), inf, nan:
    the C log reads frexp off the bits for normal floats alone) give the reference's bits too."""
    p = torch.tensor([0.0, -0.0, 1e-45, 3e-42, 1e-40, -1e-40, 1.1754942e-38, 1.1754944e-38, 2.0 ** -25, 0.074,
                      0.926, 1 - 2.0 ** -24, 1.0, 1.5, -2.0, float("inf"), float("-inf"), float("nan")])
    assert torch.equal(_bits(native.ppnd7(p, R._PPND7_CONSTANTS)), _bits(R._ppnd7_reference(p)))


@pytest.mark.parametrize("k0, k1, first, skip, n", [
    (0, 0, 0, 0, 1), (0x13198A2E, 0x03707344, 0, 1, 2047), (5, 6, 1000, 0, 2048), (5, 6, 1000, 1, 2049),
    (0xFFFFFFFF, 0xFFFFFFFF, (1 << 32) - 700, 1, 5000), (7, 0xDEADBEEF, (1 << 64) - 3000, 0, 6000),
    (11, 12, 123456, 1, 1 << 17)])
def test_the_fused_c_normal_is_threefry_then_the_reference_normal(k0, k1, first, skip, n):
    """normal_range (Threefry, the open unit and PPND7 in one pass, a block of counters at a time)
    against each step's torch reference, across its blocks, from either word of a counter."""
    out = torch.full((n,), float("nan"))
    assert native.normal_range(k0, k1, first, skip, R._PPND7_CONSTANTS, out)
    c = torch.arange((skip + n + 1) // 2, dtype=torch.int64) + first  # (wraps past 2^64 as uint64 counters do)
    low = lambda v: (v & 0xFFFFFFFF).to(torch.int32)  # noqa: E731
    x0, x1 = reference.threefry2x32(k0, k1, low(c >> 32), low(c))
    words = torch.stack([x0, x1], dim=-1).reshape(-1)[skip:skip + n]
    assert torch.equal(_bits(out), _bits(R._ppnd7_reference(R._open_unit(words))))


def test_normal_draws_in_any_dtype_and_across_a_batch_of_keys_are_the_whole_draws_slices():
    """values_at's fused path (one key over the range; float32, or cast) and its fallback (a range
    across keys) give the whole draw's elements."""
    keys = R.split(R.key(4), 3)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        whole = R.normal(keys, (5, 40_001), dtype).reshape(-1)
        for lo, hi in [(0, 200_005), (1, 77_777), (199_999, 400_010), (400_003, 600_015)]:
            part = R.values_at(keys, (5, 40_001), "normal", 0.0, 0.0, dtype, lo, hi)
            assert torch.equal(part, whole[lo:hi]), (dtype, lo, hi)
