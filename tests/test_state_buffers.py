"""The train state's zero buffers (hpf.train_state.zeros): torch.zeros' values, with no page
written at init; the step's first call faults in its grads and optimizer state (populate)."""
from __future__ import annotations

import platform
import sys

import pytest
import torch

import hpf
from hpf import random as R
from hpf.train_state import FRESH_PAGES_BYTES, populate, zeros, zeros_like

LINUX_POPULATE = sys.platform.startswith("linux") and tuple(map(int, platform.release().split(".")[:2])) >= (5, 14)
needs_populate = pytest.mark.skipif(not LINUX_POPULATE, reason="MADV_POPULATE_WRITE is Linux >= 5.14's")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
@pytest.mark.parametrize("shape", [(), (3,), (FRESH_PAGES_BYTES, 2), (513, 1025)])
def test_zeros_are_torch_zeros_and_writable(dtype, shape):
    x, ref = zeros(shape, dtype), torch.zeros(shape, dtype=dtype)
    assert x.shape == ref.shape and x.dtype == dtype and x.is_contiguous() and torch.equal(x, ref)
    x.fill_(1)
    assert torch.equal(x, torch.ones(shape, dtype=dtype))


def test_zeros_like_keeps_dtype_device_and_strides():
    x = torch.ones(1024, 1024)
    assert torch.equal(zeros_like(x), torch.zeros(1024, 1024))
    assert zeros_like(x, torch.bfloat16).dtype == torch.bfloat16
    assert zeros_like(x.t()).stride() == torch.zeros_like(x.t()).stride()  # (not contiguous: torch's own)
    assert zeros_like(torch.empty(1 << 20, device="meta")).is_meta


@needs_populate
def test_a_large_zeros_is_resident_only_once_populated():
    nbytes = 64 << 20
    before = _rss()
    x = zeros((nbytes // 4,), torch.float32)
    assert _rss() - before < nbytes // 8, "a fresh buffer's pages were written at creation"
    populate([x, torch.zeros(3), "not a tensor"])
    assert _rss() - before > nbytes * 7 // 8, "populate left the pages unmapped"
    assert torch.equal(x, torch.zeros_like(x))


@needs_populate
def test_born_init_makes_the_params_resident_and_the_first_step_the_rest():
    """One param of 32 MiB: init writes its pages alone; the first step faults in its grads and
    AdamW's two moments (3 x 32 MiB more) before it runs."""
    n = 8 << 20

    def loss_fn(params, batch):
        return (params["w"].view(-1, 1024)[:8] @ batch).square().mean()
    step = hpf.shard_step(loss_fn, mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw(lr=1e-3))
    with step:
        before = _rss()
        state = step.init(lambda key: {"w": R.normal(key, (n,)) * 0.02}, key=R.key(0))
        grown = _rss() - before
        assert 4 * n * 7 // 8 < grown < 4 * n * 3 // 2, f"init grew RSS by {grown / 2**20:.0f} MiB, not the params' 32"
        state, _ = step(state, torch.ones(1024, 2))
        assert _rss() - before > 4 * 4 * n * 7 // 8, "the first step did not fault in the grads and moments"
        assert all(bool(m.any()) for m in (state.opt_state.exp_avg[0], state.opt_state.exp_avg_sq[0]))
