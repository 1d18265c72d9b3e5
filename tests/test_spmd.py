"""The engine is SPMD by construction (issue 27): every collective a rank issues follows the loss
function's reads, never its references, gc or timing.

- References held on one rank only, and gc.collect() on one rank, change nothing: the step
  equals plain single-process torch.
- Reads that differ across ranks raise ScheduleMismatchError on every rank, naming the read,
  within seconds (equal-size units, which pair up, and different-size ones, which would hang).
- 64 generated loss programs (random read orders, re-reads, slices, ties, references kept on
  random ranks, gc.collect() at random points on one rank), each equal to plain torch.
  ``HPF_SPMD_PROGRAMS=N`` runs N of them (64 keep the suite short; raise it for a deeper search).
"""
import gc
import os
import random
import time

import pytest
import torch

import hpf
from hpf.launcher import launch
from references import adamw_training
from toy_models import LM_D, lm_batch, lm_block, lm_head_loss, lm_params

STEPS, N_BLOCKS = 2, 4
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
KEPT: list = []  # references a "debugging" loss function keeps (module-level, as users do)
batch_of, block, head_loss = lm_batch, lm_block, lm_head_loss


def init(seed=0, tie=None, wide_last=False):
    params = lm_params(n_blocks=N_BLOCKS, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    if wide_last:  # a last block of another size: its gather cannot pair with another block's
        params["blocks"][-1]["extra"] = torch.randn(3 * LM_D, generator=g)
    if tie == "root":
        params["head"] = params["embed"]
    elif tie == "across":
        params["blocks"][3]["w"] = params["blocks"][0]["w"]
    elif tie == "same_block":
        params["blocks"][2] = params["blocks"][0]
    return params


def reference(loss_fn, params, steps=STEPS):
    """Plain autograd + torch.optim.AdamW on the whole global batch (unused params: zero grads)."""
    losses, _, by_path = adamw_training(loss_fn, params, batch_of, steps, zero_unused=True, **ADAMW)
    return losses, list(by_path.values())


def train(rank, mesh, loss_fn, params, steps=STEPS, after_step=lambda: None):
    step = hpf.shard_step(loss_fn, mesh=mesh, optimizer=hpf.optim.adamw(**ADAMW))
    state = step.init(params)
    losses = []
    for s in range(steps):
        state, metrics = step(state, batch_of(s, rank, mesh.size))
        losses.append(metrics["loss"])
        after_step()
    return losses, hpf.tree.flatten(step.full_params(state))[1]


def assert_same(run, ref):
    torch.testing.assert_close(run[0], ref[0], rtol=1e-5, atol=0)
    for got, want in zip(run[1], ref[1]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# -- the two programs ----------------------------------------------------------------------------
def kept_on_rank_0(rank):
    def loss_fn(params, tokens):
        x = params["embed"][tokens[:, :-1]]
        for blk in params["blocks"]:
            if rank == 0:
                KEPT.append(blk["w"])  # a debugging reference, on rank 0 only
            x = block(x, blk)
        x = x + 0.5 * torch.tanh(x @ params["blocks"][0]["w"])  # block 0 read again after the loop
        return head_loss(params, x, tokens)
    return loss_fn


def _kept(rank):
    return train(rank, hpf.Mesh({"dp": 2}), kept_on_rank_0(rank), init(), after_step=KEPT.clear)


@pytest.mark.slow
def test_a_reference_held_on_one_rank_trains_like_plain_torch():
    runs = launch(_kept, 2, timeout=120)
    assert runs[0][0] == runs[1][0]
    assert_same(runs[0], reference(kept_on_rank_0(1), init()))


AGAIN = {"equal": (1, 2), "wide": (1, 3), "resident": (2, 3)}  # the block each rank re-reads after the loop


def _rank_dependent_reads(rank, case):
    wide_last = case == "wide"

    def loss_fn(params, tokens):
        x = params["embed"][tokens[:, :-1]]
        for blk in params["blocks"]:
            x = block(x, {"w": blk["w"], "b": blk["b"]})
        again = params["blocks"][AGAIN[case][rank]]  # rank-dependent
        return head_loss(params, x + 0.1 * again["b"], tokens)

    start = time.monotonic()
    try:
        train(rank, hpf.Mesh({"dp": 2}), loss_fn, init(wide_last=wide_last), steps=1)
    except hpf.ScheduleMismatchError as e:
        return str(e), time.monotonic() - start
    return None, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("case", list(AGAIN))
def test_rank_dependent_reads_raise_a_named_error_on_every_rank_within_seconds(case):
    """equal: two equal-size units (their gathers would pair up); wide: units of different sizes
    (their gathers would hang, or abort gloo); resident: units still gathered (no collective
    differs, only the reads: the step's all-reduce finds it before any update)."""
    for message, seconds in launch(_rank_dependent_reads, 2, case, timeout=120):
        print(f"{case}: {seconds:.1f} s: {message}")
        assert message is not None, "the ranks read different units and nobody noticed"
        assert seconds < 30
        mine, other = AGAIN[case]
        assert f"rank 0: read blocks/{mine} (read 5 of the step)" in message, message
        assert f"rank 1: read blocks/{other} (read 5 of the step)" in message, message


# -- generated programs ---------------------------------------------------------------------------------------
OPS = ("loop", "reversed", "slice", "index", "read_all_then_use", "reuse_held", "tied_read")


def program(seed):
    """A random SPMD loss program: the reads and the math are drawn from ``seed`` alone."""
    rng = random.Random(seed)
    ops = []
    for _ in range(rng.randint(1, 4)):
        op = rng.choice(OPS)
        if op == "slice":
            a = rng.randrange(N_BLOCKS)
            ops.append((op, a, rng.randint(a + 1, N_BLOCKS), rng.choice([1, -1])))
        elif op in ("index", "reuse_held", "tied_read"):
            ops.append((op, rng.randrange(-N_BLOCKS, N_BLOCKS), round(rng.uniform(0.2, 1.0), 2)))
        elif op == "read_all_then_use":
            idx = [rng.randrange(N_BLOCKS) for _ in range(rng.randint(2, N_BLOCKS))]
            ops.append((op, tuple(idx)))
        else:
            ops.append((op,))
    return rng.choice([None, None, "root", "across", "same_block"]), ops


def make_loss(ops, noise=None):
    """The loss function of ``ops``; ``noise(where)`` may keep references or run gc (rank-local)."""
    def loss_fn(params, tokens):
        blocks, held = params["blocks"], None
        x = params["embed"][tokens[:, :-1]]
        for i, op in enumerate(ops):
            noise and noise(("op", i), params)
            kind = op[0]
            if kind in ("loop", "reversed"):
                for blk in (blocks if kind == "loop" else reversed(blocks)):
                    noise and noise(("block", blk), params)
                    x = block(x, blk, 0.5)
            elif kind == "slice":
                for blk in blocks[op[1]:op[2]][::op[3]]:
                    x = block(x, blk, 0.3)
            elif kind == "index":
                held = blocks[op[1]]
                x = block(x, held, op[2])
            elif kind == "read_all_then_use":
                read = [blocks[j] for j in op[1]]  # every read first, the math after
                noise and noise(("read all", read), params)
                for blk in read:
                    x = block(x, blk, 0.2)
            elif kind == "reuse_held" and held is not None:
                x = block(x, held, op[2])  # a block read earlier, used again without a read
            elif kind == "tied_read":
                x = x + op[2] * torch.tanh(x @ blocks[op[1]]["w"].T)
        return head_loss(params, x, tokens)
    return loss_fn


def rank_noise(rank, seed):
    """Rank-local habits: references kept in a global list, gc.collect(), on random ranks."""
    rng = random.Random(seed * 7919 + rank)
    keep_rank, gc_rank = rng.randrange(2), rng.randrange(2)

    def noise(where, params):
        if rank == keep_rank and rng.random() < 0.5:
            KEPT.append(where[1] if where[0] != "op" else params["embed"])
        if rank == gc_rank and rng.random() < 0.3:
            gc.collect()
    return noise


def _generated(rank, seeds):
    mesh = hpf.Mesh({"dp": 2})
    out = {}
    for seed in seeds:
        tie, ops = program(seed)
        clear = (lambda: None) if seed % 3 == 0 else KEPT.clear  # some keep their references across steps
        out[seed] = train(rank, mesh, make_loss(ops, rank_noise(rank, seed)), init(seed, tie), after_step=clear)
        KEPT.clear()
    return out


N_PROGRAMS = int(os.environ.get("HPF_SPMD_PROGRAMS", 64))


@pytest.mark.slow
def test_generated_programs_equal_plain_torch():
    start = time.monotonic()
    runs = launch(_generated, 2, range(N_PROGRAMS), timeout=280)
    elapsed = time.monotonic() - start
    for seed in range(N_PROGRAMS):
        tie, ops = program(seed)
        assert runs[0][seed][0] == runs[1][seed][0], f"program {seed}: ranks report different losses"
        try:
            assert_same(runs[0][seed], reference(make_loss(ops), init(seed, tie)))
        except AssertionError as e:
            raise AssertionError(f"program {seed} ({tie=}, {ops}): {e}") from None
    print(f"{N_PROGRAMS} generated programs on 2 ranks in {elapsed:.1f} s")
