"""ShmGroup collectives against gloo and against sums computed here, plus failure and cleanup."""
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from hpf.comm import ProcessGroupTransport, ShmGroup, ShmTimeout, Transport
from hpf.comm.shm import SHM_DIR
from hpf.launcher import RankError, launch

SHARD_NUMELS = (1, 37, 4099)  # odd sizes: shard starts fall off every alignment
DTYPES = (torch.float32, torch.bfloat16)


def _data(seed: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _assert_sum_close(result: torch.Tensor, terms: list) -> None:
    """result ~ sum(terms). Summing n terms in the result's dtype rounds up to n times, each
    by at most eps * (running |sum|) <= eps * sum|terms|: that bounds gloo (bf16 sums in
    bf16) as well as fp32 accumulation rounded once."""
    exact = sum(t.double() for t in terms)
    bound = len(terms) * torch.finfo(result.dtype).eps * sum(t.double().abs() for t in terms)
    error = (result.double() - exact).abs()
    assert torch.all(error <= bound), f"max error {(error - bound).max().item()} above the bound"


def _segments() -> set:
    return {name for name in os.listdir(SHM_DIR) if name.startswith("hpf_")}


def _check_against_gloo_and_reference(rank, transport_kind):
    n = dist.get_world_size()
    transport = ShmGroup(None, nbytes=4 << 20) if transport_kind == "shm" else ProcessGroupTransport()
    assert isinstance(transport, Transport)
    for dtype in DTYPES:
        for k in SHARD_NUMELS:
            key = (dtype, k)
            # all-gather: reference = the shards concatenated here
            shard = _data(rank, k, dtype)
            full = transport.buffer(("ag",) + key, n * k, dtype)
            transport.all_gather_into(full, shard)
            assert torch.equal(full, torch.cat([_data(r, k, dtype) for r in range(n)]))
            via_gloo = torch.empty(n * k, dtype=dtype)
            dist.all_gather_single(via_gloo, shard)
            assert torch.equal(full, via_gloo)

            # reduce-scatter: reference = fp64 sum over ranks
            grad = transport.buffer(("rs",) + key, n * k, dtype, per_rank=True)
            grad.copy_(_data(100 + rank, n * k, dtype))
            out = torch.empty(k, dtype=dtype)
            transport.reduce_scatter(out, grad, op="sum")
            via_gloo = torch.empty(k, dtype=dtype)
            dist.reduce_scatter_single(via_gloo, _data(100 + rank, n * k, dtype))
            for result in (out, via_gloo):
                _assert_sum_close(result, [_data(100 + r, n * k, dtype)[rank * k:(rank + 1) * k] for r in range(n)])
            if n == 2 and dtype == torch.float32:
                assert torch.equal(out, via_gloo)  # a + b is rounded once, in any order
            assert torch.equal(grad, _data(100 + rank, n * k, dtype))  # input left as it was

            # mean, and all-reduce (any numel; in place)
            transport.reduce_scatter(out, grad, op="mean")
            _assert_sum_close(out, [_data(100 + r, n * k, dtype)[rank * k:(rank + 1) * k] / n for r in range(n)])
            vec = transport.buffer(("ar",) + key, n * k + 1, dtype, per_rank=True)
            vec.copy_(_data(200 + rank, n * k + 1, dtype))
            transport.all_reduce(vec)
            _assert_sum_close(vec, [_data(200 + r, n * k + 1, dtype) for r in range(n)])

            # blocks (a node-major two-tier stage): rank r's part is piece r of each of 3 blocks
            shard = _data(300 + rank, 3 * k, dtype)
            full = transport.buffer(("agb",) + key, 3 * n * k, dtype)
            transport.all_gather_into(full, shard, blocks=3)
            want = torch.stack([_data(300 + r, 3 * k, dtype).view(3, k) for r in range(n)], dim=1).reshape(-1)
            assert torch.equal(full, want)
            grad = transport.buffer(("rsb",) + key, 3 * n * k, dtype, per_rank=True)
            grad.copy_(_data(400 + rank, 3 * n * k, dtype))
            out = torch.empty(3 * k, dtype=dtype)
            transport.reduce_scatter(out, grad, blocks=3)
            _assert_sum_close(out, [_data(400 + r, 3 * n * k, dtype).view(3, n, k)[:, rank].reshape(-1)
                                    for r in range(n)])
    return True


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("transport_kind", ["shm", "pg"])
def test_collectives_match_gloo_and_reference(world_size, transport_kind):
    assert launch(_check_against_gloo_and_reference, world_size, transport_kind) == [True] * world_size


def _sum_accumulates_in_fp32(rank):
    g = ShmGroup(None, nbytes=1 << 16)
    grad = g.buffer("g", 4, torch.bfloat16, per_rank=True)
    grad.fill_(256.0 if rank == 0 else 1.0)  # bf16 steps are 2 above 256: 256+1+1+1 needs fp32
    out = torch.empty(1, dtype=torch.bfloat16)
    g.reduce_scatter(out, grad)
    return out.item()


@pytest.mark.slow
def test_bf16_reduce_scatter_accumulates_in_fp32():
    exact = torch.tensor(256.0 + 3.0, dtype=torch.float64).to(torch.bfloat16).item()  # round once
    assert launch(_sum_accumulates_in_fp32, 4) == [exact] * 4


class _RecordCalls(TorchFunctionMode):
    """Names of the torch functions and Tensor methods called inside the block."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _zero_copy_steps(rank):
    """Params live in the shared buffer; each rank updates its own slice in place."""
    n, k = dist.get_world_size(), 5
    g = ShmGroup(None, nbytes=1 << 16)
    params = g.buffer("params", n * k, torch.float32)
    mine = params[rank * k:(rank + 1) * k]
    mine.copy_(torch.arange(k, dtype=torch.float32))
    seen = []
    for step in range(3):
        mine.add_(rank + 1)  # "optimizer step" on the own slice
        g.all_gather_into(params, mine)
        seen.append(params.clone())
        g.barrier()  # reuse rule: nobody writes params again while a peer still reads them
    with _RecordCalls() as zero_copy:
        g.all_gather_into(params, mine)
    with _RecordCalls() as copy:
        g.all_gather_into(params, mine.clone())
    return seen, "copy_" in zero_copy.names, "copy_" in copy.names, dict(g.bytes_sent)


@pytest.mark.slow
def test_zero_copy_all_gather_costs_only_the_barrier():
    n, k = 2, 5
    for seen, copied_in_place, copied_otherwise, bytes_sent in launch(_zero_copy_steps, n):
        for step, full in enumerate(seen):
            expected = torch.cat([torch.arange(k, dtype=torch.float32) + (step + 1) * (r + 1) for r in range(n)])
            assert torch.equal(full, expected)
        assert not copied_in_place and copied_otherwise
        # ring convention: (n-1)/n of the full buffer per all-gather, 5 all-gathers
        assert bytes_sent == {"all_gather": 5 * (n - 1) * k * 4}


def _late_peer(rank):
    g = ShmGroup(None, nbytes=1 << 16, timeout=0.5)
    g.barrier()
    if rank == 1:
        return None  # never comes to the second barrier
    start = time.monotonic()
    try:
        g.barrier()
    except ShmTimeout as e:
        return str(e), time.monotonic() - start
    return "no error", 0.0


@pytest.mark.slow
def test_barrier_timeout_names_the_missing_rank():
    message, waited = launch(_late_peer, 2)[0]
    assert "group ranks [1] (global [1]) did not arrive within 0.5 s" in message
    assert 0.5 <= waited < 3.0


def _killed_mid_run(rank, how):
    g = ShmGroup(None, nbytes=1 << 16, timeout=30)
    grad = g.buffer("g", 6, torch.float32, per_rank=True)
    out = torch.empty(2)
    for step in range(1000):
        if rank == 1 and step == 3:
            if how == "exit":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGKILL)
        grad.fill_(step)
        g.reduce_scatter(out, grad)
    return True


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_killed_rank_ends_the_others_and_leaks_no_segment(how):
    before = _segments()
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 (exited with code 3|was killed by SIGKILL)"):
        launch(_killed_mid_run, 3, how, timeout=60)
    assert time.monotonic() - start < 10  # the launcher ended the others; no wait for the 30 s barrier
    assert _segments() - before == set()


def _killed_while_owning_a_name(rank):
    if rank == 0:  # as if killed between creating a segment and unlinking it after setup
        open(os.path.join(SHM_DIR, f"hpf_{os.getpid()}_setup"), "wb").close()
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


@pytest.mark.slow
def test_launch_sweeps_segments_of_a_rank_killed_during_setup():
    before = _segments()
    with pytest.raises(RankError, match="rank 0 was killed by SIGKILL"):
        launch(_killed_while_owning_a_name, 2)
    assert _segments() - before == set()


def _bad_inputs(rank):
    g = ShmGroup(None, nbytes=1024)
    full = g.buffer("full", 8, torch.float32)
    grad = g.buffer("grad", 8, torch.float32, per_rank=True)
    errors = []
    for call in (lambda: g.all_gather_into(torch.empty(8), torch.empty(4)),  # full outside the segment
                 lambda: g.all_gather_into(full, torch.empty(3)),
                 lambda: g.all_gather_into(grad, torch.empty(4)),
                 lambda: g.reduce_scatter(torch.empty(4), full),
                 lambda: g.reduce_scatter(torch.empty(4), grad, op="max"),
                 lambda: g.buffer("full", 9, torch.float32),
                 lambda: g.buffer("huge", 10 ** 6, torch.float32)):
        try:
            call()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    g.close()
    try:
        g.barrier()
    except RuntimeError as e:
        errors.append(str(e))
    return errors


def _segment_too_large(rank):
    try:
        ShmGroup(None, nbytes=1 << 50)  # 1 PiB: far beyond any /dev/shm
    except RuntimeError as e:
        return str(e)


@pytest.mark.slow
def test_segment_larger_than_dev_shm_is_a_clear_error_on_every_rank():
    for message in launch(_segment_too_large, 2):
        assert re.search(r"rank 0 could not create a \d+-byte segment in /dev/shm", message)
        assert "--shm-size" in message


@pytest.mark.slow
def test_bad_inputs_say_what_to_pass():
    errors = launch(_bad_inputs, 2)[0]
    expected = ["full must be a slice of this group's ShmGroup.buffer(..., per_rank=False)",
                "full has 8 elements, but shard has 3 and world_size is 2",
                "full must be a slice of this group's ShmGroup.buffer(..., per_rank=False)",
                "full must be a slice of this group's ShmGroup.buffer(..., per_rank=True)",
                "op must be one of ('sum', 'mean'), got 'max'",
                "buffer 'full' exists as (numel, dtype, per_rank)=(8, torch.float32, False)",
                "create the ShmGroup with a larger nbytes",
                "ShmGroup is closed"]
    assert len(errors) == len(expected)
    for error, text in zip(errors, expected):
        assert error is not None and text in error, (error, text)
