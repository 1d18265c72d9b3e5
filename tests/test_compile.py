"""torch.compile inside hpf.shard_step: compiled blocks, a compiled loss function and
fullgraph blocks train exactly as eager hpf and as plain single-process torch; misuse is named.

One launched 2-rank run does every check (compiling costs seconds a graph); the tests compare
what it returned. Tolerances are test_step's (the same sums in the same order, except that
inductor may fuse elementwise ops: measured <= 7e-6 relative on params after 3 steps).
"""
import numpy as np
import pytest
import torch

import hpf
from hpf.launcher import launch
from hpf.models import gpt
from references import adamw_training

TINY = gpt.CONFIGS["tiny"]
STEPS, BATCH, SEED = 3, 8, 0
# eps bounds how far a grad's rounding moves an update: d/dg of g/(|g|+eps) is at most 1/eps, so
# |du| <= lr |dg| / eps. Compiled kernels (and MKL's code paths: MKL_CBWR) sum in other orders,
# |dg| <= ~6e-7 here (fp32, ~1e3 terms of ~1e-2), so eps=1e-3 keeps 3 steps' drift under 2e-5. With
# eps=1e-8 a grad near its own rounding error flips sign(g) and moves a param by up to 2 lr: under
# MKL_CBWR=COMPATIBLE one element of 1875 moved 2.8e-5.
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.1)
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=1e-5, atol=2e-5)

pytestmark = pytest.mark.slow


def train(rank, loss_fn, steps=STEPS, optimizer=None, **kwargs):
    from torch._dynamo.utils import counters
    step = hpf.shard_step(loss_fn, mesh=hpf.Mesh({"dp": 2}), optimizer=optimizer or hpf.optim.adamw(**ADAMW), **kwargs)
    state = step.init(gpt.init(TINY, hpf.random.key(SEED)))
    batches = gpt.synthetic_batches(TINY, BATCH, SEED, rank=rank, world_size=2)
    losses, compile_s, graphs = [], [], []
    for _ in range(steps):
        state, m = step(state, next(batches))
        losses.append(m["loss"])
        compile_s.append(m["compile_s"])
        graphs.append(counters["stats"]["unique_graphs"])
    return {"losses": losses, "compile_s": compile_s, "graphs": graphs, "peak_blocks": step.stats().peak_blocks,
            "params": [p.numpy() for p in hpf.tree.flatten(step.full_params(state))[1]]}


def error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares the type and message
        return type(e).__name__, str(e)
    return None


@torch.compile(fullgraph=True)
def fullgraph_block(blk, x):  # (a code object of its own: dynamo caches graphs per code object)
    return gpt.block(blk, x, n_heads=TINY.n_heads)


def fullgraph_loss(params, batch):
    x = params["embed"][batch[:, :-1]] + params["pos"][: batch.shape[1] - 1]
    for blk in params["blocks"]:
        x = fullgraph_block(blk, x)
    return gpt.token_cross_entropy(gpt.rms_norm(x, params["norm_f"]) @ params["head"], batch[:, 1:])


KEPT = {}


@torch.compile
def block_with_a_kept_param(blk, x):
    """Uses the first block it was ever given: a compiled function holding a param past its step."""
    KEPT.setdefault("blk", blk)
    return gpt.block(KEPT["blk"], x, n_heads=TINY.n_heads)


def kept_param_loss(params, batch):
    x = params["embed"][batch[:, :-1]]
    for blk in params["blocks"]:
        x = block_with_a_kept_param(blk, x)
    return torch.nn.functional.cross_entropy((x @ params["embed"].T).flatten(0, 1), batch[:, 1:].flatten())


def rank_checks(rank):
    torch.manual_seed(0)
    out = {"eager": train(rank, gpt.loss_for(TINY)),
           "block": train(rank, gpt.loss_for(TINY, compile=True)),
           "whole": train(rank, torch.compile(gpt.loss_for(TINY))),
           "fullgraph": train(rank, fullgraph_loss),
           "validate": train(rank, gpt.loss_for(TINY, compile=True), mode="validate"),
           "eager_recompute_accumulate": train(rank, gpt.loss_for(TINY, recompute="all", weighted=True), accumulate=2),
           "recompute_accumulate": train(rank, gpt.loss_for(TINY, recompute="all", weighted=True, compile=True),
                                         accumulate=2)}
    muon_frozen = dict(optimizer=hpf.optim.muon(lr=0.02, adamw_lr=1e-2), frozen=r"blocks/0/.*",
                       mixed_precision="bf16")
    out["eager_muon_frozen_bf16"] = train(rank, gpt.loss_for(TINY), **muon_frozen)
    out["muon_frozen_bf16"] = train(rank, gpt.loss_for(TINY, compile=True), **muon_frozen)
    out["kept_param"] = error_of(lambda: train(rank, kept_param_loss))
    out["ragged"] = error_of(lambda: ragged_dynamic(rank))

    def one_rank_reads_backwards(params, batch):
        blocks = params["blocks"]
        order = range(len(blocks)) if rank == 0 else reversed(range(len(blocks)))
        x = params["embed"][batch[:, :-1]]
        for i in order:
            x = gpt.block(blocks[i], x, n_heads=TINY.n_heads)
        return x.square().mean()
    # (last: both leave the ranks out of step; the second still names its own cause)
    out["mismatch"] = error_of(lambda: train(rank, torch.compile(one_rank_reads_backwards), steps=1))
    out["compile_fails_on_rank_1"] = compile_fails_on_rank_1(rank)
    return out


def ragged_dynamic(rank):
    """A loss compiled with dynamic=True traces any length, but ranks' batches of different
    lengths make a mean of per-rank means: refused, as eager is."""
    step = hpf.shard_step(torch.compile(gpt.loss_for(TINY), dynamic=True), mesh=hpf.Mesh({"dp": 2}),
                          optimizer=hpf.optim.adamw(**ADAMW))
    state = step.init(gpt.init(TINY, hpf.random.key(SEED)))
    batch = next(gpt.synthetic_batches(TINY, BATCH, SEED, rank=rank, world_size=2))
    step(state, batch[:, : 10 + rank])


def compile_fails_on_rank_1(rank):
    """Rank 1's block does not compile; it then waits in the next collective call, as a rank
    that catches the error would: both ranks must name the cause."""
    def no_compiler(gm, inputs):
        raise RuntimeError("no compiler on this rank")
    block = torch.compile(lambda blk, x: gpt.block(blk, x, n_heads=TINY.n_heads),
                          backend=no_compiler if rank == 1 else "eager")

    def loss(params, batch):
        x = params["embed"][batch[:, :-1]]
        for blk in params["blocks"]:
            x = block(blk, x)
        return x.square().mean()
    step = hpf.shard_step(loss, mesh=hpf.Mesh({"dp": 2}), optimizer=hpf.optim.adamw(**ADAMW))
    state = step.init(gpt.init(TINY, hpf.random.key(SEED)))
    failed = error_of(lambda: step(state, next(gpt.synthetic_batches(TINY, BATCH, SEED, rank=rank, world_size=2))))
    return failed if failed[0] == "ScheduleMismatchError" else error_of(lambda: step.full_params(state))


@pytest.fixture(scope="module")
def runs():
    results = launch(rank_checks, 2, timeout=280)
    assert results[0]["block"]["losses"] == results[1]["block"]["losses"]
    return results


@pytest.fixture(scope="module")
def reference():
    losses, _, params = adamw_training(gpt.loss_for(TINY), gpt.init(TINY, hpf.random.key(SEED)),
                                       lambda s: gpt.global_batch(TINY, BATCH, SEED, s), STEPS, **ADAMW)
    return losses, [p.numpy() for p in params.values()]


def assert_same(run, losses, params):
    np.testing.assert_allclose(run["losses"], losses, **LOSS_TOL)
    assert len(run["params"]) == len(params)
    for got, want in zip(run["params"], params):
        np.testing.assert_allclose(got, want, **PARAM_TOL)


@pytest.mark.parametrize("name", ["eager", "block", "whole", "fullgraph", "validate"])
def test_compiled_parts_train_like_plain_torch(runs, reference, name):
    assert_same(runs[0][name], *reference)


def test_recompute_accumulation_and_weighted_loss_compiled_equal_eager(runs):
    eager = runs[0]["eager_recompute_accumulate"]
    assert_same(runs[0]["recompute_accumulate"], eager["losses"], eager["params"])


def test_muon_frozen_params_and_bf16_compiled_stay_close_to_eager(runs):
    """bf16: inductor keeps fused elementwise chains in fp32 where eager rounds each op to bf16,
    so the two differ by bf16 rounding (measured 1e-3 relative on the loss); frozen params
    must stay exactly as initialized in both."""
    eager, compiled = runs[0]["eager_muon_frozen_bf16"], runs[0]["muon_frozen_bf16"]
    np.testing.assert_allclose(compiled["losses"], eager["losses"], rtol=1e-2)
    init = hpf.tree.flatten(gpt.init(TINY, hpf.random.key(SEED)))
    for path, got, want, start in zip(init[0], compiled["params"], eager["params"], init[1]):
        if path.startswith("blocks/0/"):
            assert np.array_equal(got, start.numpy()) and np.array_equal(want, start.numpy()), path
        else:
            assert not np.array_equal(got, start.numpy()), path


@pytest.mark.parametrize("name", ["block", "whole", "fullgraph", "recompute_accumulate"])
def test_compiled_once_on_the_first_step(runs, name):
    run = runs[0][name]
    assert run["compile_s"][0] > 0
    assert run["compile_s"][1:] == [0.0] * (STEPS - 1)
    assert run["graphs"][1:] == [run["graphs"][0]] * (STEPS - 1), "recompiled after the first step"


def test_eager_steps_report_no_compile_time(runs):
    assert runs[0]["eager"]["compile_s"] == [0.0] * STEPS


def test_a_param_kept_by_a_compiled_function_past_its_step_is_named_on_every_rank(runs):
    for r in runs:
        kind, message = r["kept_param"]
        assert kind == "StaleParamError", message
        assert "blocks/0" in message and "earlier step" in message and "arguments" in message


def test_compiled_loss_whose_ranks_read_differently_is_a_schedule_mismatch(runs):
    for r in runs:
        kind, message = r["mismatch"]
        assert kind == "ScheduleMismatchError", message


def test_a_compile_failure_on_one_rank_is_named_on_every_rank(runs):
    for r in runs:
        kind, message = r["compile_fails_on_rank_1"]
        assert kind == "ScheduleMismatchError", message
        assert "rank 1 raised" in message and "no compiler on this rank" in message


def test_ragged_batches_under_a_dynamic_compiled_loss_are_refused_on_every_rank(runs):
    for r in runs:
        kind, message = r["ragged"]
        assert kind == "UnevenBatchError", message


@pytest.mark.parametrize("name", ["block", "whole", "fullgraph"])
def test_compiled_blocks_keep_at_most_two_units_gathered(runs, name):
    """The FSDP property: a compiled block's saved params are freed and gathered again for its
    backward, so a loop-style loss holds at most two of TINY's three blocks at once."""
    assert runs[0][name]["peak_blocks"] <= 2
