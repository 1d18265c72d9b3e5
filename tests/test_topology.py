"""Topology-aware FSDP on a 2x2 mesh ({"node": 2, "local": 2}: 2 hosts of 2 ranks).

Every variant (flat, HSDP, two-tier over gloo or shared memory, with and without the
backward pipeline) matches plain single-process autograd + torch.optim.AdamW; slow-tier
bytes follow the 1/local model; a killed or hung rank ends the run with an error that says
who, without leaking shared memory; and with the pipeline no backward compute waits on a
slow-tier reduction.
"""
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import hpf
from hpf import SlowLink, Topology
from hpf.launcher import RankError, launch
from hpf.models import gpt
from references import adamw_training
from hpf.tree import flatten
from hpf.report import PlanReport

CONFIG = gpt.CONFIGS["tiny"]
MESH = {"node": 2, "local": 2}
WORLD = 4
BATCH = 8  # global; 2 rows per rank
STEPS = 3
LR, WEIGHT_DECAY = 1e-2, 0.1
SHM_DIR = "/dev/shm"

VARIANTS = {  # name -> shard_step keywords
    "flat": {},
    "hsdp": {"hsdp": True},
    "flat_tiered": {"topology": Topology(hierarchical=False, fast_transport="pg")},
    "hier_pg": {"topology": Topology(fast_transport="pg")},
    "hier_pg_fast_major": {"topology": Topology(fast_transport="pg", fast_major=True)},
    "hier_shm_fast_major": {"topology": Topology(fast_transport="shm", fast_major=True)},
    "hier_pg_no_pipeline": {"topology": Topology(fast_transport="pg", pipeline=False)},
    "hier_shm": {"topology": Topology(fast_transport="shm")},
    "hier_shm_update_after_backward": {"topology": Topology(fast_transport="shm"), "overlap_optimizer": False},
    "hier_shm_small_buckets": {"topology": Topology(fast_transport="shm", bucket_bytes=16 << 10)},
    "hier_shm_no_pipeline": {"topology": Topology(fast_transport="shm", pipeline=False)},
    "hsdp_shm": {"topology": Topology(fast_transport="shm"), "hsdp": True},
}


def _local_batch(step: int, rank: int) -> torch.Tensor:
    rows = BATCH // WORLD
    return gpt.global_batch(CONFIG, BATCH, seed=0, step=step)[rank * rows:(rank + 1) * rows]


def _make_step(loss_fn=None, **kwargs):
    return hpf.shard_step(loss_fn or gpt.loss_for(CONFIG), mesh=hpf.Mesh(MESH),
                          optimizer=hpf.optim.adamw(lr=LR, weight_decay=WEIGHT_DECAY), **kwargs)


def _run_variants(rank):
    """Each variant for STEPS steps: losses, final full params, and the byte counters of the
    steady-state step 2 (a step gathers the next step's first units once its optimizer is done)."""
    out = {}
    for name, kwargs in VARIANTS.items():
        step = _make_step(**kwargs)
        state = step.init(gpt.init(CONFIG))
        gathers = [0] * len(step.plan.buckets)  # all-gather calls per bucket, counted at the comm
        all_gather = step.comm.all_gather

        def counted(b, out_, shard, all_gather=all_gather, gathers=gathers):
            gathers[b] += 1
            return all_gather(b, out_, shard)

        step.comm.all_gather = counted
        losses, norms = [], []
        for s in range(STEPS):
            state, metrics = step(state, _local_batch(s, rank))
            losses.append(metrics["loss"])
            norms.append(metrics["grad_norm"])
            if s == 0:
                bytes_before, gathers_before = step.stats(), list(gathers)
            if s == 1:
                comm_bytes = dict((step.stats() - bytes_before).bytes)
                gathers_step = [n - m for n, m in zip(gathers, gathers_before)]
        hier = kwargs.get("topology") is not None and kwargs["topology"].hierarchical
        full = step.full_params(state)
        step.close()
        paths, leaves, _ = flatten(full)
        out[name] = {
            "losses": losses,
            "grad_norms": norms,
            "params": dict(zip(paths, (x.numpy() for x in leaves))) if rank == 0 else None,
            "bytes": comm_bytes,
            "gathers": gathers_step,
            "bucket_units": [b.unit for b in step.plan.buckets],
            "report": PlanReport.of(step.plan, hierarchical=hier).comm,
        }
    return out


@pytest.fixture(scope="module")
def reference():
    """Plain autograd and torch.optim.AdamW on the full model and the full global batch."""
    losses, norms, params = adamw_training(
        lambda p, b: gpt.loss(p, b, n_heads=CONFIG.n_heads), gpt.init(CONFIG),
        lambda s: gpt.global_batch(CONFIG, BATCH, seed=0, step=s), STEPS, lr=LR, weight_decay=WEIGHT_DECAY)
    return losses, norms, {p: x.numpy() for p, x in params.items()}


@pytest.fixture(scope="module")
def runs():
    """All variants in one launch (process start-up dominates these tiny steps)."""
    return launch(_run_variants, WORLD, timeout=240)


@pytest.mark.tolerance
@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_matches_single_process_adamw(runs, reference, variant):
    ref_losses, ref_norms, ref_params = reference
    for rank_result in runs:  # every rank reports the same global values
        # The sharded loss is a mean of 4 local means, the reference one mean over all rows:
        # they differ in summation order only (measured 2e-7 relative, a few ulps).
        np.testing.assert_allclose(rank_result[variant]["losses"], ref_losses, rtol=1e-6, atol=0)
        # AdamW is blind to the grads' scale, the grad norm is not: it catches a missing or
        # double division by the data-parallel size, or a replica counted twice (HSDP).
        np.testing.assert_allclose(rank_result[variant]["grad_norms"], ref_norms, rtol=1e-5, atol=0)
    params = runs[0][variant]["params"]
    assert params.keys() == ref_params.keys()
    for path, ref in ref_params.items():
        # AdamW's step lr * m / (sqrt(v) + eps) normalizes each grad, so a grad's relative
        # rounding error e moves its param by about lr * e per step. Summation order alone
        # makes e ~1e-7 for most grads but up to ~1e-3 for the tiny q/k grads of the nearly
        # uniform first attention, sums of terms that nearly cancel (measured: max param diff
        # 1.08e-5 = lr * 1.1e-3, one element of blocks/0/w_qkv). atol = lr * 5e-3 leaves a 5x
        # margin; a wrong shard, step or lr moves params by ~lr, 200x more.
        np.testing.assert_allclose(params[path], ref, rtol=0, atol=LR * 5e-3, err_msg=f"{variant}: {path}")


def _shard_bytes() -> dict[str, int]:
    """Bytes of one rank's fp32 shard of each unit, from the model's shapes alone."""
    params = gpt.init(CONFIG, device="meta")
    units = {"<root>": sum(params[k].numel() for k in ("embed", "pos", "norm_f", "head"))}
    for i, block in enumerate(params["blocks"]):
        units[f"blocks/{i}"] = sum(x.numel() for x in block.values())
    return {u: 4 * math.ceil(n / WORLD) for u, n in units.items()}


# Bytes one rank sends over the slow tier per all-gather or reduce-scatter, in shards,
# under hpf/comm/cost.py's documented model (each rank sends its contribution to every peer):
# flat: its shard to the 2 ranks of the other node; two-tier: its shard to the 1 rank of
# the other node with the same local index (the fast stage then moves 2-shard blocks
# between the 2 local ranks).
SLOW_SHARDS = {"flat_tiered": 2, "hier_pg": 1}
FAST_SHARDS = {"flat_tiered": 1, "hier_pg": 2}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(SLOW_SHARDS))
def test_byte_counters_and_plan_report_follow_the_tier_model(runs, variant):
    shard = _shard_bytes()
    result = runs[0][variant]
    units = result["bucket_units"]
    assert sorted(units) == sorted(shard)  # one fp32 bucket per unit
    one_pass = sum(shard.values())  # one collective over every unit
    gathered = sum(n * shard[u] for n, u in zip(result["gathers"], units))  # the calls the engine made
    for tier, shards in (("slow", SLOW_SHARDS[variant]), ("fast", FAST_SHARDS[variant])):
        assert result["bytes"]["reduce_scatter", tier] == shards * one_pass
        assert result["bytes"]["all_gather", tier] == shards * gathered
        assert result["report"]["reduce_scatter"][tier] == shards * one_pass
        # the report: root once, every block twice (forward, backward re-gather) but the
        # last two (the residency bound), which backward finds still gathered -- the same
        # count the engine made
        blocks = sorted((u for u in shard if u != "<root>"), key=lambda u: int(u.split("/")[1]))
        twice = sum(shard[u] for u in blocks[:-2])
        assert result["report"]["all_gather"][tier] == shards * (sum(shard.values()) + twice)
        assert result["report"]["all_gather"][tier] == result["bytes"]["all_gather", tier]
        assert result["report"]["all_reduce"][tier] == 0  # full shard: no replicas


@pytest.mark.slow
def test_update_during_backward_is_bitwise_the_update_after_it(runs):
    overlapped, after = runs[0]["hier_shm"], runs[0]["hier_shm_update_after_backward"]
    assert overlapped["losses"] == after["losses"] and overlapped["grad_norms"] == after["grad_norms"]
    for path, value in after["params"].items():
        assert np.array_equal(overlapped["params"][path], value), path


@pytest.mark.slow
def test_small_buckets_split_units(runs):
    units = runs[0]["hier_shm_small_buckets"]["bucket_units"]  # it matches the reference above
    assert len(units) > len(set(units))


@pytest.mark.slow
def test_shared_memory_units_are_gathered_once_per_step(runs):
    # units refilled during backward (optimizer overlap) are not gathered again by the next step
    for variant in ("hier_shm", "hier_shm_update_after_backward"):
        assert runs[0][variant]["gathers"] == [1] * len(runs[0][variant]["bucket_units"]), variant


@pytest.mark.slow
def test_two_tier_slow_bytes_are_one_over_local_of_flat(runs):
    hier, flat = runs[0]["hier_pg"], runs[0]["flat_tiered"]
    assert hier["gathers"] == flat["gathers"]  # same schedule, so bytes compare per call
    local = MESH["local"]
    for op in ("all_gather", "reduce_scatter"):
        assert hier["bytes"][op, "slow"] * local == flat["bytes"][op, "slow"] > 0
        assert hier["report"][op]["slow"] * local == flat["report"][op]["slow"] > 0


# -- reliability ---------------------------------------------------------------------------------

def _hpf_segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("hpf_")}


def _fail_on_step_2(rank, pid_dir, how, timeout_s):
    """Rank 1 is SIGKILLed (or hangs) inside its loss function on step 2; shm topology."""
    with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    calls = [0]
    loss = gpt.loss_for(CONFIG)

    def failing_loss(params, batch):
        calls[0] += 1
        if rank == 1 and calls[0] == 2:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)
        return loss(params, batch)

    step = _make_step(failing_loss, topology=Topology(fast_transport="shm", timeout_s=timeout_s))
    state = step.init(gpt.init(CONFIG))
    assert all(step.comm.is_shared(b.index) for b in step.plan.buckets), "the fast tier should be shared memory"
    for s in range(STEPS):
        state, _ = step(state, _local_batch(s, rank))
    return "finished"


def _launch_failing(how, tmp_path, timeout, timeout_s):
    before = _hpf_segments()
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(_fail_on_step_2, WORLD, str(tmp_path), how, timeout_s, timeout=timeout)
    elapsed = time.monotonic() - start
    pids = [(tmp_path / f"{r}.pid").read_text() for r in range(WORLD)]
    # only segments our ranks created count: other test runs may share /dev/shm
    leaked = {n for n in _hpf_segments() - before if n.split("_")[1] in pids}
    return info.value, elapsed, leaked


@pytest.mark.slow
def test_killed_rank_ends_the_run_promptly_and_leaks_no_shared_memory(tmp_path):
    timeout = 120
    # timeout_s is long, so only the launcher's view of the death can end the run quickly
    err, elapsed, leaked = _launch_failing("kill", tmp_path, timeout, timeout_s=60.0)
    assert err.rank == 1 and "rank 1 was killed by SIGKILL" in str(err)
    assert elapsed < timeout / 4  # the launcher saw the death; it did not sit out its timeout
    assert leaked == set()


@pytest.mark.slow
def test_hung_rank_makes_its_peers_raise_a_timeout_that_names_the_late_rank(tmp_path):
    """No launcher needed: the peers' own shared-memory barriers time out (torchrun case)."""
    # 5 s: long enough that a rank starved on the 2 oversubscribed cores does not trip it
    err, elapsed, leaked = _launch_failing("hang", tmp_path, timeout=120, timeout_s=5.0)
    # rank 0 waits for rank 1 directly; rank 2 for rank 3, itself stuck behind rank 1
    # on the slow tier; whichever times out first is reported
    assert err.rank in (0, 2)
    late = {0: 1, 2: 3}[err.rank]
    assert "ShmTimeout" in str(err) and f"(global [{late}]) did not arrive within 5 s" in str(err)
    assert elapsed < 60  # Topology.timeout_s ended it, not the launch timeout
    assert leaked == set()


# -- the backward pipeline ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _GatedLink(SlowLink):
    """An emulated slow link that holds every slow-tier reduction until backward has ended.

    If any backward compute waited on a slow-tier reduction, backward could not end while the
    gate is shut: the wait in delay() would run out (`patience`) and count as `stalled`.
    A deadlock-style check, so it needs no timing assumption beyond "backward of a tiny model
    takes less than `patience`". Gathers pass freely.
    """

    patience: float = 30.0
    gate: threading.Event = field(default_factory=threading.Event, compare=False)
    stalled: list = field(default_factory=list, compare=False)

    def delay(self, nbytes: int) -> float:
        if threading.current_thread().name == "hpf-reduce-slow" and not self.gate.wait(self.patience):
            self.stalled.append(nbytes)
            self.gate.set()  # one stall proves the point; let the rest of the step run
        return 0.0


class _Hooked(hpf.ShardStep):
    """A step that calls ``before``/``after`` around each micro-batch's forward and backward, and
    ``landed`` once the step's reductions have landed (ShardStep's documented hooks)."""

    before = after = landed = staticmethod(lambda: None)

    def forward_backward(self, *args, **kwargs):
        self.before()
        try:
            return super().forward_backward(*args, **kwargs)
        finally:
            self.after()

    def after_reductions(self):
        self.landed()


def _hooked_step(**options) -> _Hooked:
    return _Hooked(gpt.loss_for(CONFIG), hpf.StepConfig(mesh=hpf.Mesh(MESH), **options))


def _stalls_in_backward(rank, pipeline, patience):
    link = _GatedLink(patience=patience)
    step = _hooked_step(optimizer=hpf.optim.adamw(lr=LR, weight_decay=WEIGHT_DECAY),
                        topology=Topology(fast_transport="shm", pipeline=pipeline, slow_link=link))
    state = step.init(gpt.init(CONFIG))
    step.before = link.gate.clear  # the micro-batch starts: hold slow reductions
    step.after = link.gate.set  # its backward has ended: the step now waits for reductions
    for s in range(2):
        state, _ = step(state, _local_batch(s, rank))
    step.close()
    return len(link.stalled)


class _RecordingAdamW:
    """AdamW that logs which buckets each partial update touches, next to the engine's events."""

    capabilities = hpf.optim.Capabilities(partial=True)  # (no for_plan: nothing to set up)

    def __init__(self, events):
        self.inner, self.events = hpf.optim.adamw(lr=LR, weight_decay=WEIGHT_DECAY), events

    def init(self, params):
        return self.inner.init(params)

    def update(self, grads, state, params):
        return self.inner.update(grads, state, params)

    def partial_update(self, state, params):
        apply = self.inner.partial_update(state, params)

        def logged(buckets, grads):
            self.events.append(("update", tuple(buckets)))
            apply(buckets, grads)
        return logged


def _overlap_schedule(rank, overlap):
    """Step 2's updates, all-gathers and the landing of its reductions, by unit (one bucket each)."""
    events = []
    step = _hooked_step(optimizer=_RecordingAdamW(events), topology=Topology(fast_transport="pg"),
                        overlap_optimizer=overlap)
    state = step.init(gpt.init(CONFIG))
    all_gather = step.comm.all_gather
    step.comm.all_gather = lambda b, *args: (events.append(("gather", (b,))), all_gather(b, *args))[1]
    step.landed = lambda: events.append(("land",))
    state, _ = step(state, _local_batch(0, rank))
    events.clear()
    step(state, _local_batch(1, rank))
    step.close()
    unit_of = {b.index: b.unit for b in step.plan.buckets}
    return [(e[0], tuple(unit_of[b] for b in e[1])) if len(e) > 1 else e for e in events]


@pytest.mark.slow
def test_nothing_is_updated_before_the_decision_and_the_next_steps_first_units_gather_during_the_rest():
    """The step's one global decision comes before any update (ranks never part in the state);
    with the overlap, the units the next step reads first (the root, and the first two blocks:
    the residency bound) are updated first and start gathering while the rest is updated."""
    first, rest = ("<root>", "blocks/0", "blocks/1"), ("blocks/2",)
    overlapped = launch(_overlap_schedule, WORLD, True, timeout=120)[0]
    after = overlapped[overlapped.index(("land",)) + 1:]
    assert not any(e[0] == "update" for e in overlapped[:overlapped.index(("land",))])
    assert after[0][0] == "update" and sorted(after[0][1]) == sorted(first)
    assert after[1:] == [("gather", (u,)) for u in first] + [("update", rest)]
    plain = launch(_overlap_schedule, WORLD, False, timeout=120)[0]
    after = plain[plain.index(("land",)) + 1:]
    assert [e[0] for e in after] == ["gather"] * 3 and not any(e[0] == "update" for e in plain)


def _pipeline_cases(rank):
    # patience: 20 s is far above a tiny model's backward (ms) even on loaded cores
    return (_stalls_in_backward(rank, pipeline=True, patience=20.0),
            _stalls_in_backward(rank, pipeline=False, patience=0.2))


@pytest.mark.slow
def test_pipeline_never_makes_backward_wait_on_a_slow_reduction():
    """Shared memory holds every grad buffer for good, so the engine's bound on reductions in
    flight (hpf.engine.reduce.IN_FLIGHT) frees nothing there and never waits: every slow-tier
    reduction may stay in flight until backward ends. (Over process groups the bound holds: two
    in flight; tests/test_reduce.py.)"""
    with_pipeline, without = zip(*launch(_pipeline_cases, WORLD, timeout=240))
    assert with_pipeline == (0,) * WORLD
    # the control: without the pipeline each unit's reduction is waited for in backward,
    # so the instrument does see such a wait (once per step: then the gate stays open)
    assert without == (2,) * WORLD


def _os_threads_over_closed_steps(rank):
    cfg = gpt.CONFIGS["tiny"]
    mesh, counts = hpf.Mesh({"node": 2, "local": 2}), []
    for _ in range(4):
        step = hpf.shard_step(gpt.loss_for(cfg), mesh=mesh, optimizer=hpf.optim.adamw(lr=1e-3), topology=Topology())
        state, _ = step(step.init(gpt.init(cfg)), gpt.global_batch(cfg, 8, 0, 0)[rank * 2:rank * 2 + 2])
        step.close()
        del step, state
        counts.append(len(os.listdir(f"/proc/{os.getpid()}/task")))
    return counts


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_a_closed_two_tier_comm_leaves_no_threads_behind():
    """A closed TieredComm destroys the process groups it made: steps built one after another on
    one mesh (a search measuring candidates, a notebook cell run again) add no gloo threads.
    Before, each step left about 18 OS threads per rank (1,574 in one benchmark process)."""
    counts = launch(_os_threads_over_closed_steps, 4, timeout=120)[0]
    assert counts[-1] == counts[0], counts
