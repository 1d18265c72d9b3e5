"""The low-bit slow tier (``hpf.Topology(slow_weights=..., slow_grads=...)``) on a 2x2 mesh.

What is checked, against independent single-process references built here from plain autograd
and the reference quantizer (hpf_kernels, tested on its own in test_quant.py):
- the params the loss function sees are the full params with each shard quantized and
  dequantized, the same on every rank, and the fp32 masters are never quantized;
- the reduced grads are the two-stage sum (fast tier exact, then each row sent to a slow peer
  quantized, this rank's own row exact, HSDP replicas all quantized) within one code step;
- slow-tier bytes: the engine's counters, the transports' real bytes and the plan report agree,
  and meet the issue's ratios (GPT small, from the plan report);
- error feedback: residuals are carried, skipped steps leave them as they were, and a resumed
  run is bitwise the uninterrupted one; HSDP replicas stay bitwise equal; Muon's slow-tier
  pieces travel low-bit; validation mode reports per-param errors and raises past a tolerance.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import hpf
from hpf import Topology
from hpf.launcher import launch
from hpf.models import gpt
from hpf.planning import step_plan
from hpf.precision import SlowPrecision
from hpf.validate import QuantizationError
from hpf_kernels import dequantize, quantize
from hpf_kernels.formats import FORMATS
from hpf.report import PlanReport
from references import autograd_grads
from test_cli import run_main

CONFIG = gpt.CONFIGS["tiny"]
MESH = {"node": 2, "local": 2}
WORLD, BATCH, BLOCK, STEPS, LR = 4, 8, 64, 3, 1e-2

VARIANTS = {  # name -> shard_step keywords
    "full": {"topology": Topology(fast_transport="shm")},
    "int8": {"topology": Topology(fast_transport="shm", slow_weights="int8", slow_grads="int8", slow_block=BLOCK)},
    "fp8_int4": {"topology": Topology(fast_transport="pg", slow_weights="fp8", slow_grads="int4", slow_block=BLOCK,
                                      slow_error_feedback=True)},
    "hsdp_int8": {"topology": Topology(fast_transport="shm", slow_grads="int8", slow_block=BLOCK), "hsdp": True},
}


def _batch(step: int, rank: int) -> torch.Tensor:
    rows = BATCH // WORLD
    return gpt.global_batch(CONFIG, BATCH, seed=0, step=step)[rank * rows:(rank + 1) * rows]


def _make(loss_fn=None, optimizer=None, **kw):
    return hpf.shard_step(loss_fn or gpt.loss_for(CONFIG), mesh=hpf.Mesh(MESH),
                          optimizer=optimizer or hpf.optim.adamw(lr=LR), **kw)


def _recording_loss(seen: dict):
    """gpt's loss; the first call also records the params it is handed (the gathered views)."""
    loss = gpt.loss_for(CONFIG)

    def recording(params, batch):
        if not seen:
            seen.update({k: v.detach().clone() for k, v in params.items() if k != "blocks"})
            for i, block in enumerate(params["blocks"]):
                seen.update({f"blocks/{i}/{k}": v.detach().clone() for k, v in block.items()})
        return loss(params, batch)
    return recording


def _reduce_moved(comm) -> int:
    """Bytes the slow tier's reduction transports really sent (their own counters)."""
    transports = {id(t): t for (d, _, tier), t in comm._route.items() if d == "reduce" and tier == "slow"}
    return sum(t.bytes_sent["all_to_all"] for t in transports.values())


def _variant(rank: int, name: str, kw: dict, ckpt: str) -> dict:
    seen: dict = {}
    step = _make(_recording_loss(seen), **kw)
    state = step.init(gpt.init(CONFIG))
    comm = step.comm
    grads = [g.clone() for g in step.grads(state, _batch(0, rank))]  # no update: residuals untouched
    out = {"seen": seen, "grads": grads, "residual_after_grads": [float(r.abs().max()) if r.numel() else 0.0
                                                                  for r in state.error_feedback or ()]}
    losses = []
    for s in range(STEPS):
        if s == 1:
            before, moved = step.stats(), _reduce_moved(comm)
        state, m = step(state, _batch(s, rank))
        losses.append(m["loss"])
        if s == 1:
            out["bytes"] = (step.stats() - before).slow_bytes()
            out["moved_reduce"] = _reduce_moved(comm) - moved
        if s == 0 and state.error_feedback is not None:  # checkpoint after step 1, resumed below
            step.save(state, ckpt)
    out["losses"] = losses
    out["masters"] = [p.clone() for p in state.params]
    out["feedback"] = None if state.error_feedback is None else [r.clone() for r in state.error_feedback]
    out["report"] = PlanReport.of(step.plan, hierarchical=True, shm=any(step.comm.is_shared(b.index) for b in step.plan.buckets))
    if state.error_feedback is not None:  # resume from step 1 on a new step: bitwise the same run
        again = _make(**kw)
        again.init(gpt.init(CONFIG, device="meta"))
        resumed, _ = again.restore(ckpt)
        for s in range(1, STEPS):
            resumed, _ = again(resumed, _batch(s, rank))
        out["resumed"] = ([p.clone() for p in resumed.params], [r.clone() for r in resumed.error_feedback])
        again.close()
    step.close()
    return out


def _skipped_step(rank: int) -> dict:
    """int4 with error feedback and on_nonfinite="skip": a step whose loss is nan leaves the
    residuals (and everything else) exactly as they were."""
    scale = [1.0]
    loss = gpt.loss_for(CONFIG)
    step = _make(lambda p, b: loss(p, b) * scale[0], on_nonfinite="skip", **VARIANTS["fp8_int4"])
    state = step.init(gpt.init(CONFIG))
    state, _ = step(state, _batch(0, rank))
    kept = [r.clone() for r in state.error_feedback], [p.clone() for p in state.params]
    scale[0] = float("nan")
    state, m = step(state, _batch(1, rank))
    same = all(torch.equal(a, b) for a, b in zip(kept[0], state.error_feedback)) and all(
        torch.equal(a, b) for a, b in zip(kept[1], state.params))
    step.close()
    return {"skipped": m["skipped"], "unchanged": same, "residual": max(float(r.abs().max()) for r in kept[0])}


def _muon(rank: int) -> dict:
    """Muon's pieces across the slow tier: low-bit (int8) against full precision."""
    out = {}
    for name, topo in (("full", Topology(fast_transport="shm")),
                       ("int8", Topology(fast_transport="shm", slow_weights="int8", slow_grads="int8", slow_block=BLOCK))):
        step = _make(optimizer=hpf.optim.muon(lr=0.02, adamw_lr=LR), topology=topo)
        state = step.init(gpt.init(CONFIG))
        losses = []
        for s in range(STEPS):
            state, m = step(state, _batch(s, rank))
            losses.append(m["loss"])
        out[name] = (losses, step.plan_optimizer.slow_bytes_sent)  # (the fast tier's pieces stay full precision)
        step.close()
    return out


def _validate(rank: int) -> dict:
    out = {}
    for tol in (1.0, 1e-6):
        step = _make(mode="validate", quantization_tolerance=tol, **VARIANTS["int8"])
        state = step.init(gpt.init(CONFIG))
        before = [p.clone() for p in state.params]
        try:
            state, m = step(state, _batch(0, rank))
            out[tol] = m["quantization"]
        except QuantizationError as e:
            out[tol] = (str(e), all(torch.equal(a, b) for a, b in zip(before, state.params)))
        step.close()
    return out


class _SGD:
    """p <- p - grad: the params after T steps are p0 minus the sum of the grads the step received."""

    def init(self, params):
        return ()

    def update(self, grads, state, params):
        torch._foreach_sub_(list(params), list(grads))
        return params, state


FEEDBACK_STEPS = (60, 120)


def _constant_grads(rank: int) -> dict:
    """Each rank's grads are the same every step (a linear loss), mostly far below their block's
    max (an int4 step drops them): the params after T steps, with error feedback and without."""
    shapes = {"w": (64, 128), "v": (96, 64)}
    gen = torch.Generator().manual_seed(100 + rank)
    coeff = {k: torch.randn(s, generator=gen) * torch.where(torch.rand(s, generator=gen) < 0.02, 20.0, 1.0)
             for k, s in shapes.items()}
    out = {"coeff": coeff}
    for ef in (True, False):
        topo = Topology(fast_transport="shm", slow_grads="int4", slow_block=BLOCK, slow_error_feedback=ef)
        step = _make(lambda p, b: sum((p[k] * coeff[k]).sum() for k in p), optimizer=_SGD(), topology=topo)
        state = step.init({k: torch.zeros(s) for k, s in shapes.items()})
        for t in range(1, FEEDBACK_STEPS[-1] + 1):
            state, _ = step(state, torch.zeros(WORLD, 1))
            if t in FEEDBACK_STEPS:
                out[ef, t] = step.full_params(state)
        step.close()
    return out


def _all(rank: int, ckpt: str) -> dict:
    out = {name: _variant(rank, name, kw, ckpt + name) for name, kw in VARIANTS.items()}
    out["skip"] = _skipped_step(rank)
    out["muon"] = _muon(rank)
    out["validate"] = _validate(rank)
    out["constant"] = _constant_grads(rank)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every variant in one launch (process start-up dominates these tiny steps)."""
    return launch(_all, WORLD, str(tmp_path_factory.mktemp("ckpt") / "step1_"), timeout=280)


def _plan(name: str):
    kw = VARIANTS[name]
    return step_plan(gpt.init(CONFIG), hpf.Mesh(MESH), topology=kw["topology"], hsdp=kw.get("hsdp", False))


def _roundtrip(rows: torch.Tensor, fmt: str) -> torch.Tensor:
    return dequantize(quantize(rows, fmt, BLOCK, backend="reference"), fmt, BLOCK, torch.empty_like(rows),
                      backend="reference")


def _scales(rows: torch.Tensor, fmt: str) -> torch.Tensor:
    amax = rows.reshape(rows.shape[0], -1, BLOCK).abs().amax(-1, keepdim=True)
    return (amax / FORMATS[fmt].qmax).expand(-1, -1, BLOCK).reshape(rows.shape)


def _gathered_reference(name: str) -> dict[str, torch.Tensor]:
    """The full params as a low-bit gather makes them: every shard quantized and dequantized."""
    plan, params = _plan(name), gpt.init(CONFIG)
    full = dict(zip(*hpf.tree.flatten(params)[:2]))
    fmt = plan.slow_precision.weights if plan.slow_precision else None
    out = {}
    for b in plan.buckets:
        flat = plan.flat_buffer(b, full)
        if fmt and b.shard_size > 1:
            flat = _roundtrip(flat.view(b.shard_size, -1), fmt).view(-1)
        out.update({p: v.clone() for p, v in plan.views(b, flat).items()})
    return out


# -- in one process: options, bytes, the simulator ---------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    ({"slow_weights": "int4"}, r"slow_weights='int4': use one of \['bf16', 'fp8', 'int8'\] \(int4 is for grads only"),
    ({"slow_grads": "fp16"}, r"slow_grads='fp16': use one of \['bf16', 'fp8', 'int8', 'int4'\]"),
    ({"slow_weights": "int8", "slow_block": 0}, "slow_block=0: give the number of values per scale"),
    ({"slow_grads": "int4", "slow_block": 100.5}, "slow_block=100.5"),
    ({"slow_grads": "int4", "slow_block": 33}, "int4 packs two values per byte, so its block must be even"),
    ({"slow_error_feedback": True}, "set slow_grads too"),
    ({"slow_grads": "int8", "hierarchical": False}, "use hierarchical=True"),
])
def test_bad_slow_tier_options_say_what_is_allowed(kw, match):
    with pytest.raises(ValueError, match=match):
        Topology(**kw)


def test_slow_precision_defaults_and_parse():
    assert Topology().slow_precision is None
    int4 = Topology(slow_grads="int4").slow_precision
    assert int4 == SlowPrecision(None, "int4", 128, False)  # error feedback only when asked for
    assert Topology(slow_grads="int4", slow_error_feedback=True).slow_precision.error_feedback is True
    assert SlowPrecision.parse("int8") == SlowPrecision("int8", "int8")
    assert SlowPrecision.parse("none,int4") == SlowPrecision(None, "int4")
    assert SlowPrecision.parse("none") is None
    assert SlowPrecision.parse("int8,int4,no-ef") == SlowPrecision("int8", "int4", error_feedback=False)
    assert SlowPrecision.parse("int8,int4,ef").text() == "int8,int4,ef" and int4.text() == "none,int4"
    assert SlowPrecision.parse("none,int8,ef").text() == "none,int8,ef" and SlowPrecision.parse("int8").text() == "int8,int8"
    for bad, match in (("int4", "write none,int4"), ("int8,int8,int8", "W,G,ef"), ("int8,", "W, W,G"),
                       ("none,none,ef", "set slow_grads too")):
        with pytest.raises(ValueError, match=match):
            SlowPrecision.parse(bad)


def test_tolerance_needs_a_low_bit_tier_and_validation_mode():
    mesh, opt = hpf.Mesh({"dp": 1}), hpf.optim.adamw()
    with pytest.raises(ValueError, match="nothing is quantized"):
        hpf.StepConfig(mesh=mesh, optimizer=opt, mode="validate", quantization_tolerance=0.1)
    with pytest.raises(ValueError, match="checked in mode='validate'"):
        hpf.StepConfig(mesh=mesh, optimizer=opt, quantization_tolerance=0.1, topology=Topology(slow_grads="int8"))
    with pytest.raises(ValueError, match="finite number > 0"):
        hpf.StepConfig(mesh=mesh, optimizer=opt, mode="validate", quantization_tolerance=-1.0,
                       topology=Topology(slow_grads="int8"))


def test_only_shards_that_cross_the_slow_tier_are_padded_to_whole_blocks():
    params = gpt.init(CONFIG, device="meta")
    mesh = hpf.Mesh(MESH)
    # HSDP: replicated across the slow tier, weights never cross it, so low-bit weights alone are refused
    with pytest.raises(ValueError, match="nothing to act on"):
        step_plan(params, mesh, topology=Topology(slow_weights="int8", slow_block=BLOCK), hsdp=True)
    low = step_plan(params, mesh, topology=Topology(slow_weights="int8", slow_block=BLOCK))
    plain = step_plan(params, mesh, topology=Topology())
    for a, b in zip(low.buckets, plain.buckets):
        assert a.align == BLOCK and a.shard_numel % BLOCK == 0 and 0 <= a.shard_numel - b.shard_numel < BLOCK


def _small_report(slow: str | None):
    """GPT small's plan report on 2x2, bf16 compute and fp32 grads, slow tier ``slow`` ("W,G")."""
    low = SlowPrecision.parse(slow)
    topology = Topology(slow_weights=low and low.weights, slow_grads=low and low.grads,
                        slow_error_feedback=bool(low and low.error_feedback))
    plan = step_plan(gpt.init(gpt.CONFIGS["small"], device="meta"), hpf.Mesh(MESH), topology=topology)
    return PlanReport.of(plan, compute_dtype=torch.bfloat16, reduce_dtype=torch.float32, hierarchical=True)


def _slow_report(slow: str | None) -> dict:
    return _small_report(slow).comm


def test_gpt_small_slow_tier_bytes_meet_the_issue_ratios():
    """Per step, plan report, bf16 compute and fp32 grads, GPT small on 2x2, scales included."""
    base, int8, int4 = _slow_report(None), _slow_report("int8,int8"), _slow_report("int8,int4")
    weights = int8["all_gather"]["slow"] / base["all_gather"]["slow"]
    grads8 = int8["reduce_scatter"]["slow"] / base["reduce_scatter"]["slow"]
    grads4 = int4["reduce_scatter"]["slow"] / base["reduce_scatter"]["slow"]
    assert weights <= 0.53 and grads8 <= 0.28 and grads4 <= 0.15, (weights, grads8, grads4)
    # what the formats imply at block 128: 1 + 4/128 bytes per value (int8), 0.5 + 4/128 (int4), padding aside
    assert weights == pytest.approx((1 + 4 / 128) / 2, rel=2e-3)
    assert grads8 == pytest.approx((1 + 4 / 128) / 4, rel=2e-3) and grads4 == pytest.approx((0.5 + 4 / 128) / 4, rel=2e-3)
    assert int8["all_gather"]["fast"] == pytest.approx(base["all_gather"]["fast"], rel=1e-3)  # the fast tier stays


def test_the_simulator_counts_the_same_bytes_and_the_quantize_cost():
    from hpf import sim

    kw = dict(local_batch=1, mixed_precision="bf16")
    ef = "int8,int4,ef"  # with error feedback: its residuals' memory and passes are counted too
    full = sim.simulate("small", MESH, "cloudmatrix384", **kw)
    low = sim.simulate("small", MESH, "cloudmatrix384", slow_precision=ef, **kw)
    assert low.bytes["all_gather"]["slow"] == _slow_report(ef)["all_gather"]["slow"]
    assert low.bytes["reduce_scatter"]["slow"] == _slow_report(ef)["reduce_scatter"]["slow"]
    assert low.bytes["all_gather"]["fast"] == pytest.approx(full.bytes["all_gather"]["fast"], rel=1e-3)  # (padding)
    # the slow link is busy for fewer bytes; the quantize passes on its worker cost memory time
    report = _small_report(ef)
    plan = step_plan(gpt.init(gpt.CONFIGS["small"], device="meta"), hpf.Mesh(MESH),
                     topology=Topology(slow_weights="int8", slow_grads="int4", slow_error_feedback=True))
    # one fp32 residual row per slow peer (one here); this rank's own row never leaves it
    assert report.feedback_bytes == 4 * sum(b.shard_numel for b in plan.buckets) > 0
    assert report.codec_bytes > 0
    hw = sim.hardware("cloudmatrix384")
    free = sim.simulate("small", MESH, dataclasses.replace(hw, mem_bw=1e30), slow_precision=ef, **kw)
    slower = sim.simulate("small", MESH, dataclasses.replace(hw, mem_bw=hw.mem_bw / 100), slow_precision=ef,
                          **kw)
    assert free.busy_s["slow"] < low.busy_s["slow"] < slower.busy_s["slow"]
    assert slower.busy_s["slow"] - free.busy_s["slow"] == pytest.approx(
        sum(b * 100 / hw.mem_bw for b in [report.codec_bytes]), rel=0.05)
    with pytest.raises(ValueError, match="use topology='two-tier'"):
        sim.simulate("small", MESH, "cloudmatrix384", topology="flat", slow_precision="int8")


# -- 2x2, one launch ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_loss_sees_each_shard_quantized_the_same_on_every_rank(runs, name):
    want = _gathered_reference(name)
    for r in range(WORLD):
        seen = runs[r][name]["seen"]
        assert seen.keys() == want.keys()
        for path, value in want.items():
            assert torch.equal(seen[path], value), f"{name}, rank {r}: {path}"
    if name != "full" and name != "hsdp_int8":  # quantized weights differ from the masters, which stay exact
        params = dict(zip(*hpf.tree.flatten(gpt.init(CONFIG))[:2]))
        assert any(not torch.equal(want[p], params[p]) for p in params)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_reduced_grads_are_the_two_stage_low_bit_sum(runs, name):
    """Reference: each rank's local grads by plain autograd at the params it saw, summed over the
    fast tier exactly, then each row quantized on its way to its slow peer (own row exact; HSDP:
    every replica's shard quantized), summed, divided by the data-parallel size."""
    plan, seen = _plan(name), _gathered_reference(name)
    slow = plan.slow_precision
    mesh = plan.mesh
    flats = {}  # rank -> bucket -> its local grad flat
    for r in range(WORLD):
        grads = autograd_grads(gpt.loss_for(CONFIG), hpf.tree.unflatten(hpf.tree.structure(gpt.init(CONFIG)),
                                                                        list(seen.values())), _batch(0, r))
        flats[r] = [plan.flat_buffer(b, grads) for b in plan.buckets]
    for b in plan.buckets:
        n_fast = mesh.axis_size(tuple(a for a in b.shard_axes if a in mesh.fast_axes))
        fmt = slow.grads if slow else None
        for r in range(WORLD):
            node, local = mesh.coords(r)
            blocks = plan.stage_blocks(b)  # node-major: local rank l's fast-tier part is shard (n, l) of each node n
            fast_sum = lambda nd: sum(flats[mesh.rank_of((nd, i))][b.index] for i in range(2)).view(  # noqa: E731
                blocks, n_fast, -1)[:, local].reshape(-1)
            if not b.replicate_axes:  # shard over both axes: block `local` of each node, row `node` is ours
                rows = {nd: fast_sum(nd).view(2, -1) for nd in range(2)}
                parts = [rows[nd][node] if nd == node or not fmt else _roundtrip(rows[nd], fmt)[node] for nd in range(2)]
                step = sum(1.5 * _scales(rows[nd], fmt)[node] for nd in range(2) if nd != node) if fmt else 0
            else:  # HSDP: the fast tier's shard, then every replica's quantized
                shards = {nd: fast_sum(nd).view(1, -1) for nd in range(2)}
                parts = [_roundtrip(shards[nd], fmt)[0] if fmt else shards[nd][0] for nd in range(2)]
                step = sum(1.5 * _scales(shards[nd], fmt)[0] for nd in range(2)) if fmt else 0
            want = (parts[0] + parts[1]) / WORLD
            got = runs[r][name]["grads"][b.index]
            err = (got - want).abs()
            assert (err <= step / WORLD + 1e-5 * want.abs().max() + 1e-9).all(), f"{name} bucket {b.index} rank {r}"
            assert (err <= 1e-5 * want.abs().max() + 1e-9).float().mean() > 0.99, f"{name} bucket {b.index} rank {r}"


@pytest.mark.slow
def test_training_follows_the_full_precision_run(runs):
    full = runs[0]["full"]["losses"]
    for name in ("int8", "fp8_int4", "hsdp_int8"):
        for r in range(WORLD):
            assert runs[r][name]["losses"] == runs[0][name]["losses"]  # the global loss, on every rank
        for a, b in zip(runs[0][name]["losses"], full):
            assert abs(a - b) < 1e-2 * b, name
    assert runs[0]["int8"]["losses"] != full  # quantization did happen


@pytest.mark.slow
@pytest.mark.parametrize("name", ["int8", "fp8_int4"])
def test_slow_bytes_engine_transports_and_report_agree(runs, name):
    for r in range(WORLD):
        got, report = runs[r][name]["bytes"], runs[r][name]["report"].comm
        assert got["reduce_scatter"] == report["reduce_scatter"]["slow"] > 0
        assert got["reduce_scatter"] == runs[r][name]["moved_reduce"]  # what the slow transports really sent
        assert got["all_gather"] <= report["all_gather"]["slow"] and got["all_gather"] > 0
    full = runs[0]["full"]["report"].comm
    assert runs[0][name]["report"].comm["reduce_scatter"]["slow"] < 0.3 * full["reduce_scatter"]["slow"]


@pytest.mark.slow
def test_error_feedback_is_carried_saved_and_resumed_bitwise(runs):
    for r in range(WORLD):
        out = runs[r]["fp8_int4"]
        assert out["residual_after_grads"] == [0.0] * len(out["residual_after_grads"])  # grads() updates nothing
        assert any(x.abs().max() > 0 for x in out["feedback"]) and all(torch.isfinite(x).all() for x in out["feedback"])
        params, feedback = out["resumed"]
        assert all(torch.equal(a, b) for a, b in zip(params, out["masters"]))
        assert all(torch.equal(a, b) for a, b in zip(feedback, out["feedback"]))
        assert runs[r]["int8"]["feedback"] is None  # int8 keeps none unless asked


@pytest.mark.slow
def test_error_feedback_makes_the_grads_received_sum_to_the_grads_sent(runs):
    """Constant grads: without feedback, each step drops the same part of them (most values sit
    below an int4 step), so the params drift from the exact sum linearly; with it, the residual
    stays bounded, so what arrives sums to the exact grads up to that residual, and the error
    shrinks as 1/T. The exact params: p0 - T * the mean over ranks of each rank's grads."""
    mean = {k: sum(runs[r]["constant"]["coeff"][k] for r in range(WORLD)) / WORLD for k in ("w", "v")}

    def error(ef: bool, t: int) -> float:
        got = runs[0]["constant"][ef, t]
        return max(float((got[k] + t * mean[k]).norm() / (t * mean[k]).norm()) for k in mean)
    short, long = FEEDBACK_STEPS
    assert error(False, long) > 0.05  # the drift error feedback is there to remove
    assert error(True, long) < 0.25 * error(False, long)
    assert error(True, long) < 0.7 * error(True, short)  # a bounded residual: the error falls with T
    assert all(torch.equal(runs[r]["constant"][True, long][k], runs[0]["constant"][True, long][k])
               for r in range(WORLD) for k in mean)


@pytest.mark.slow
def test_a_skipped_step_leaves_the_residuals_as_they_were(runs):
    for r in range(WORLD):
        skip = runs[r]["skip"]
        assert skip["skipped"] and skip["unchanged"] and skip["residual"] > 0


@pytest.mark.slow
def test_hsdp_replicas_stay_bitwise_equal(runs):
    for r in range(WORLD):
        node, local = hpf.Mesh(MESH).coords(r)
        peer = hpf.Mesh(MESH).rank_of((1 - node, local))
        assert all(torch.equal(a, b) for a, b in zip(runs[r]["hsdp_int8"]["masters"], runs[peer]["hsdp_int8"]["masters"]))


@pytest.mark.slow
def test_muon_pieces_cross_the_slow_tier_low_bit(runs):
    muon = runs[0]["muon"]
    (full, _), (low, _) = muon["full"], muon["int8"]
    assert all(abs(a - b) < 1e-2 * b for a, b in zip(low, full)) and low != full
    total = lambda name: sum(runs[r]["muon"][name][1] for r in range(WORLD))  # noqa: E731
    assert 0 < total("int8") < 0.6 * total("full")


@pytest.mark.slow
def test_validation_mode_reports_per_param_errors_and_fails_past_the_tolerance(runs):
    report = runs[0]["validate"][1.0]
    paths = set(hpf.tree.flatten(gpt.init(CONFIG))[0])
    assert set(report) == paths
    params = dict(zip(*hpf.tree.flatten(gpt.init(CONFIG))[:2]))
    for path, stats in report.items():
        assert set(stats) == {"weights_max_abs", "weights_rel", "grads_max_abs", "grads_rel"}
        # int8: at most half a step of the largest block scale of the bucket (blocks may straddle params)
        assert stats["weights_max_abs"] <= 0.5 / 127 * max(float(p.abs().max()) for p in params.values()) * 1.001
        assert 0 <= stats["weights_rel"] and 0 <= stats["grads_rel"]
    assert max(s["weights_rel"] for s in report.values()) > 0 and max(s["grads_rel"] for s in report.values()) > 0
    for r in range(WORLD):
        assert runs[r]["validate"][1.0] == report  # one all-reduce: every rank reports the same
        message, unchanged = runs[r]["validate"][1e-6]
        assert "past quantization_tolerance=1e-06" in message and unchanged


# -- the command line ------------------------------------------------------------------------------
def test_plan_and_simulate_take_slow_precision(capsys):
    code, out, err = run_main(["plan", "--config", "small", "--mixed-precision", "bf16", "--slow-precision",
                               "int8,int4,ef"], capsys)
    assert code == 0, err
    assert "slow tier low-bit: int8 weights, int4 grads (block 128, error feedback)" in out
    mib = lambda text, op: float(text.split(f"  {op}")[1].split()[2])  # noqa: E731 - the slow tier's column
    _, full, _ = run_main(["plan", "--config", "small", "--mixed-precision", "bf16"], capsys)
    assert mib(out, "all_gather") / mib(full, "all_gather") == pytest.approx(0.516, abs=0.01)
    assert mib(out, "reduce_scatter") / mib(full, "reduce_scatter") == pytest.approx(0.133, abs=0.01)
    assert "error feedback" in out.split("per-rank bytes")[0]  # the residuals' memory
    code, out, err = run_main(["simulate", "--config", "tiny", "--mesh", "node=2,local=2", "--slow-precision", "int8",
                               "--hardware", "cloudmatrix384"],
                          capsys)
    assert code == 0 and "(slow tier int8,int8)" in out, err


@pytest.mark.parametrize("argv, names", [
    (["plan", "--slow-precision", "int4"], "none,int4"),
    (["plan", "--slow-precision", "int9,int8"], "slow_weights='int9'"),
    (["plan", "--slow-precision", "int8", "--topology", "flat"], "needs --topology two-tier"),
    (["train", "--slow-precision", "int8", "--topology", "flat", "--steps", "1"], "needs --topology two-tier"),
])
def test_bad_slow_precision_is_a_one_line_error(argv, names, capsys):
    code, out, err = run_main(argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and names in err and "Traceback" not in err, err


@pytest.mark.slow
def test_train_records_slow_precision_in_the_run_folder(tmp_path, capsys):
    import json

    code, out, err = run_main(["train", "--mesh", "node=2,local=1", "--steps", "1", "--slow-precision", "int8,int4",
                           "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert "(slow tier int8,int4)" in out.splitlines()[0]
    assert json.loads((tmp_path / "run.json").read_text())["options"]["slow_precision"] == "int8,int4"
