"""hpf.sim: the alpha-beta formulas by hand, bytes equal to the plan report's, schedule
properties that must hold for any inputs, and the CLI. No calibration runs here."""
import json
import dataclasses
import math

import pytest
import torch

import hpf
from hpf import cli, sim
from hpf.models import gpt
from hpf.sim.costs import stage_time
from hpf.report import PlanReport

CM = sim.PROFILES["cloudmatrix384"]
IDEAL = sim.Link(alpha=0.0, beta=math.inf)


def test_ring_allreduce_and_two_tier_by_hand():
    # 4 ranks, 1 MB, alpha 10 us, beta 1 GB/s: 3 steps + 3/4 of 1 ms
    assert sim.ring_time(4, 1e6, 1e-5, 1e9) == pytest.approx(3e-5 + 0.75e-3)
    assert sim.allreduce_time(4, 1e6, 1e-5, 1e9) == pytest.approx(2 * (3e-5 + 0.75e-3))
    assert sim.ring_time(1, 1e6, 1e-5, 1e9) == 0.0
    fast, slow = sim.Link(alpha=1e-6, beta=100e9), sim.Link(alpha=1e-5, beta=10e9)
    # 8 fast x 4 slow, 64 MB: fast ring on 64 MB, then a slow ring on 8 MB
    expect = (7e-6 + 7 / 8 * 64e6 / 100e9) + (3e-5 + 3 / 4 * 8e6 / 10e9)
    assert sim.two_tier_time(8, 4, 64e6, fast, slow) == pytest.approx(expect)
    # a stage in the report's bytes: (p-1)/p * n sent gives the ring formula exactly
    assert stage_time(slow, 4, 3 / 4 * 8e6) == pytest.approx(3e-5 + 3 / 4 * 8e6 / 10e9)


@pytest.mark.parametrize("axes,topology,hsdp", [({"node": 4, "local": 8}, "two-tier", False),
                                               ({"node": 4, "local": 8}, "flat", False),
                                               ({"node": 2, "local": 4}, "two-tier", True),
                                               ({"dp": 6}, "flat", False)])
def test_predicted_bytes_equal_the_plan_reports(axes, topology, hsdp):
    mesh = hpf.Mesh(axes)
    plan = hpf.plan(gpt.init(gpt.CONFIGS["small"], device="meta"), mesh, hsdp=hsdp)
    report = PlanReport.of(plan, compute_dtype=torch.bfloat16, reduce_dtype=torch.float32, master_dtype=torch.float32,
                           hierarchical=topology == "two-tier")
    r = sim.simulate("small", mesh, CM, "hsdp" if hsdp else "hpf", mixed_precision="bf16", topology=topology)
    assert r.bytes == report.comm


def test_shared_memory_skips_the_backward_regathers_as_the_report_says():
    mesh = hpf.Mesh({"dp": 2})
    plan = hpf.plan(gpt.init(gpt.CONFIGS["small"], device="meta"), mesh)
    r = sim.simulate("small", mesh, CM, shm=True)
    assert r.bytes == PlanReport.of(plan, hierarchical=True, shm=True).comm


@pytest.mark.parametrize("hw_name", ["cloudmatrix384", "ascend910c-roce", "h100"])
@pytest.mark.parametrize("ranks", [16, 64, 256])
def test_pipeline_on_is_never_slower_than_off(hw_name, ranks):
    hw = sim.PROFILES[hw_name]
    mesh = sim.sweep_mesh(ranks, hw)
    for cfg, batch in (("1b", 1), ("small", 2)):
        on = sim.simulate(cfg, mesh, hw, local_batch=batch)
        off = sim.simulate(cfg, mesh, hw, local_batch=batch, pipeline=False)
        assert on.step_s <= off.step_s * (1 + 1e-12)
        assert on.exposed_comm_s <= off.exposed_comm_s + 1e-12


@pytest.mark.parametrize("strategy", sim.STRATEGIES)
def test_ideal_links_give_no_exposed_comm_and_the_compute_time(strategy):
    hw = dataclasses.replace(CM, fast=IDEAL, slow=IDEAL, scale_out=None, mem_bw=math.inf)
    r = sim.simulate("1b", {"node": 4, "local": 16}, hw, strategy, local_batch=2)
    flops = gpt.unit_flops(gpt.CONFIGS["1b"], 2)
    compute = 3 * sum(flops.values()) / (hw.peak_flops * hw.efficiency)  # forward + 2x backward, by hand
    assert r.exposed_comm_s == 0.0
    assert r.step_s == pytest.approx(compute, rel=1e-12)
    assert r.tokens_per_s == pytest.approx(64 * 2 * 2048 / compute)


def test_a_slow_tier_costs_flat_fsdp2_more_than_two_tier_hpf():
    hw = sim.PROFILES["ascend910c-roce"]
    res = sim.compare("1b", {"node": 16, "local": 16}, hw, local_batch=1, mixed_precision="bf16")
    # the slow tier carries 1/16 of hpf's bytes but all of FSDP2's flat ring
    assert res["hpf"].busy_s["slow"] < res["fsdp2"].busy_s["slow"] / 8
    assert res["hpf"].step_s < res["fsdp2"].step_s


def test_cli_simulate_prints_the_three_strategies(capsys):
    code = cli.main(["simulate", "--config", "small", "--mesh", "node=4,local=16", "--hardware", "h100"])
    out = capsys.readouterr().out
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("64 ")]
    assert [r[1] for r in rows] == ["hpf", "fsdp2", "ddp"]
    expect = sim.simulate("small", {"node": 4, "local": 16}, "h100", "fsdp2", local_batch=4)
    assert float(rows[1][2]) == pytest.approx(expect.step_s * 1e3, abs=0.006)


def test_cli_simulate_sweep_and_errors(capsys):
    assert cli.main(["simulate", "--config", "small", "--sweep", "16,32", "--hardware", "cloudmatrix384"]) == 0
    out = capsys.readouterr().out
    assert sum(line.strip().startswith(("16 ", "32 ")) for line in out.splitlines()) == 6
    assert cli.main(["simulate", "--config", "small", "--sweep", "24"]) == 2
    assert "multiple of 16" in capsys.readouterr().err
    assert cli.main(["simulate", "--config", "small", "--hardware", "nope"]) == 2
    assert "unknown hardware" in capsys.readouterr().err


@pytest.mark.parametrize("text,says", [("not json", "JSONDecodeError"), ('{"links": {}}', "'peak_flops'")])
def test_cli_simulate_names_a_file_that_is_not_a_calibration(text, says, capsys, tmp_path):
    path = tmp_path / "calib.json"
    path.write_text(text)
    assert cli.main(["simulate", "--config", "tiny", "--mesh", "dp=2", "--hardware", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path} is not a calibration" in err and says in err and "hpf calibrate --out" in err


def test_plan_points_to_simulate(capsys):
    assert cli.main(["plan", "--config", "tiny", "--mesh", "node=2,local=2"]) == 0
    assert "hpf simulate --config tiny --mesh node=2,local=2" in capsys.readouterr().out


def test_the_exposed_share_is_the_mean_ranks_which_waits_out_its_lead_on_the_slowest():
    """Calibrated compute is the slowest rank's; a rank ``skew`` ahead of it does the same work
    in (1 - skew) of the time and waits the rest out in collectives: with ideal links, exactly
    skew x the step. The step time stays the slowest rank's."""
    def hw(skew):
        return dataclasses.replace(CM, fast=IDEAL, slow=IDEAL, scale_out=None, mem_bw=math.inf, kernel_overhead_s=0.0,
                                   compute={"tiny/1/4": {"block_s": 3e-3, "root_s": 1e-3, "skew": skew}})
    even, skewed = (sim.simulate("tiny", {"node": 2, "local": 2}, hw(s), local_batch=1) for s in (0.0, 0.25))
    assert even.step_s == skewed.step_s == pytest.approx(3 * 3e-3 + 1e-3)  # 3 blocks and the root
    assert even.exposed_comm_s == 0.0
    assert skewed.exposed_comm_s == pytest.approx(0.25 * skewed.step_s)


def test_compute_slows_while_a_contending_link_is_busy_and_the_link_only_where_it_overlaps_compute():
    from hpf.sim.costs import stage
    from hpf.sim.timeline import Timeline

    link = sim.Link(alpha=0.0, beta=1.0, cpu_slowdown=2.0, busy_slowdown=3.0, busy_latency=1.0)
    tl = Timeline()
    end = tl.submit([stage("w", link, 10.0, "fast", "all_gather", {})])
    tl.run(10.0)  # half speed for the 10 s the link is busy (5 s of work), then full speed
    assert (end, tl.t) == (10.0, 15.0)
    # a replay that knows a step computed over [0, 5) of its 100 s: the stage overlaps it half the time
    tl2 = Timeline([([(0.0, 5.0)], 100.0)])
    assert tl2.submit([stage("w", link, 10.0, "fast", "all_gather", {})]) == pytest.approx(10 * (1 + 0.5 * 2) + 0.5)
    # no compute before: the alone time
    assert Timeline([]).submit([stage("w", link, 10.0, "fast", "all_gather", {})]) == 10.0


def test_contention_follows_each_step_not_absolute_time():
    """A later step's stage meets the earlier pass's steady step at the same offset from the
    step's start (the first replay's drift once left tiny's last step with no contention at
    all), and passes are averaged (one pass's alignment flips the next's)."""
    from hpf.sim.costs import stage
    from hpf.sim.timeline import Timeline

    link = sim.Link(alpha=0.0, beta=1.0, busy_slowdown=3.0)
    stages = [stage("w", link, 10.0, "fast", "all_gather", {})]
    tl = Timeline([([(0.0, 5.0)], 20.0)])
    tl.t = 47.0  # third step, 7 s later than the earlier pass's (40 s)
    tl.begin_step()
    assert tl.submit(stages) == pytest.approx(47.0 + 10 * (1 + 0.5 * 2))
    tl.t = 67.0 + 15.0  # the next step's start is 20 s on: its [0, 5) again, seen from 15 s in
    tl.free.clear()
    assert tl.submit(stages) == pytest.approx(82.0 + 10 * (1 + 0.5 * 2))  # wraps: [15, 25) meets [20, 25)
    two = Timeline([([(0.0, 5.0)], 100.0), ([], 100.0)])
    assert two.submit(stages) == pytest.approx(10 * (1 + 0.25 * 2))


def test_cpu_overheads_grow_with_ranks_per_core():
    hw = dataclasses.replace(CM, cores=2, kernel_overhead_s=1e-3)
    assert hw.overhead(1e-3, 2) == 1e-3 and hw.overhead(1e-3, 4) == 2e-3
    assert CM.overhead(1e-3, 768) == 1e-3  # accelerators: no cores given, no scaling


def test_moe_hooks_count_active_flops_and_the_plan_reports_a2a_bytes():
    from hpf.models import moe

    c = moe.CONFIGS["small"]
    mesh = hpf.Mesh({"node": 2, "local": 4})
    flops = moe.unit_flops(c, 2)
    tokens, d = 2 * c.seq_len, c.d_model
    moe_block = 2 * tokens * (4 * d * d + d * c.n_experts + (c.top_k + c.n_shared) * 3 * d * c.d_expert) \
        + 4 * tokens * c.seq_len * d
    assert flops[f"blocks/{c.n_layers - 1}"] == moe_block  # top_k of n_experts, by hand
    a2a = moe.unit_a2a(c, 1, mesh, "local", 2)
    assert set(a2a) == {f"blocks/{i}" for i in range(c.n_dense_layers, c.n_layers)}
    # dispatch + combine, forward + backward: the four exchanges plan --model moe counts
    sent = sum(4 * n * 3 // 4 for n, _ in a2a.values())
    assert sent == moe.dispatch_bytes(c, 4, c.seq_len, 2)
    assert moe.unit_a2a(c, 1, mesh, None, 2) == {}


def test_moe_all_to_alls_are_exposed_and_vanish_on_ideal_links():
    mesh = {"node": 2, "local": 4}
    r = sim.simulate("small", mesh, CM, model="moe", local_batch=2, mixed_precision="bf16", ep_axis="local")
    ideal = dataclasses.replace(CM, fast=IDEAL, slow=IDEAL, scale_out=None, mem_bw=math.inf)
    r0 = sim.simulate("small", mesh, ideal, model="moe", local_batch=2, mixed_precision="bf16", ep_axis="local")
    assert r.exposed_comm_s > 0 and r0.exposed_comm_s == 0.0
    assert r0.step_s < r.step_s
    with pytest.raises(ValueError, match="has no experts"):
        sim.simulate("small", mesh, CM, ep_axis="local")


def test_cli_simulate_moe_505b(capsys):
    assert cli.main(["simulate", "--model", "moe", "--config", "505b", "--mesh", "node=48,local=16", "--ep-axis",
                     "local", "--local-batch", "1", "--mixed-precision", "bf16"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("768 ")]
    assert [r[1] for r in rows] == ["hpf", "fsdp2"]  # no full-replica DDP of 505B params


def test_a_group_measured_among_fewer_ranks_slows_with_ranks_per_core():
    """A 2-rank group measured in a 2-rank job, used in a 4-rank job on 2 cores: its handoffs
    and copies share the cores with twice the ranks, so the stage takes twice as long."""
    two = sim.Link(alpha=1e-3, beta=1e9, rs_beta=5e8, busy_latency=2e-3)
    four = sim.Link(alpha=5e-3, beta=1e8)
    hw = dataclasses.replace(CM, fast={2: two, 4: four}, slow=two, cores=2, shared_links=True)
    assert hw.link("fast", 2, 2) == two
    s = hw.link("fast", 2, 4)
    assert (s.alpha, s.beta, s.rs_beta, s.busy_latency) == pytest.approx((2e-3, 5e8, 2.5e8, 4e-3))
    assert hw.link("fast", 4, 4) == four  # measured in its own world: as measured
    assert hw.link("fast", 2, 8).alpha == pytest.approx(4e-3)
    assert dataclasses.replace(hw, fast={(2, 4): four, 2: two}).link("fast", 2, 4) == four  # measured there
    assert dataclasses.replace(hw, cores=0).link("fast", 2, 4) == two  # accelerators: no cores, no slicing


def test_each_gather_and_reduction_costs_the_compute_thread_its_issue_seconds():
    link = sim.Link(alpha=1e-6, beta=1e11, issue_s=1e-3)
    hw = dataclasses.replace(CM, fast=link, slow=link)
    plain = dataclasses.replace(hw, fast=dataclasses.replace(link, issue_s=0.0),
                                slow=dataclasses.replace(link, issue_s=0.0))
    mesh = {"node": 2, "local": 2}
    units = len(gpt.unit_flops(gpt.CONFIGS["tiny"], 1))
    with_issue, without = (sim.simulate("tiny", mesh, h, local_batch=1) for h in (hw, plain))
    # every unit is gathered at least once and reduced once per step, each 1 ms on the compute thread
    assert with_issue.step_s - without.step_s >= 2 * units * 1e-3 - 1e-9
    assert with_issue.compute_s - without.compute_s >= 2 * units * 1e-3 - 1e-9
    fsdp2 = [sim.simulate("tiny", mesh, h, "fsdp2", local_batch=1).step_s for h in (hw, plain)]
    assert fsdp2[0] == fsdp2[1]  # measured through hpf's comm: FSDP2's overheads are its own


def test_fsdp2_on_cpu_ranks_waits_for_each_collective_on_its_own_figures():
    """FSDP2 without device streams runs every all-gather and reduce-scatter synchronously, and
    pays its own calibrated path (Link.ops) where there is one; hpf's figures stay its own."""
    link = sim.Link(alpha=1e-4, beta=1e9, native_rs_alpha=3e-4, native_rs_beta=1e9)
    cpu = dataclasses.replace(CM, fast=link, slow=link, shared_links=True, mem_bw=math.inf, peak_flops=1e8)
    run = lambda hw: sim.simulate("tiny", {"dp": 2}, hw, "fsdp2", local_batch=1)  # noqa: E731
    r = run(cpu)
    assert r.exposed_comm_s == pytest.approx(r.busy_s["fast"] + r.busy_s["slow"])  # all of it waited
    acc = run(dataclasses.replace(cpu, shared_links=False))  # streams: reductions overlap backward
    assert acc.exposed_comm_s < acc.busy_s["fast"] + acc.busy_s["slow"] - 1e-4
    own = dataclasses.replace(link, ops={"fsdp2_reduce_scatter": (3e-4 + 1e-2, 1e9)})
    r2 = run(dataclasses.replace(cpu, fast=own, slow=own))
    units = len(gpt.unit_flops(gpt.CONFIGS["tiny"], 1))
    assert r2.step_s - r.step_s == pytest.approx(units * 1e-2)  # one reduce-scatter per unit, 10 ms more each
    assert own.figures("reduce_scatter") == link.figures("reduce_scatter") == (1e-4, 1e9)  # hpf's: untouched
    assert link.figures("fsdp2_reduce_scatter") == (3e-4, 1e9)  # uncalibrated: torch's own reduce-scatter
    assert own.sliced(2.0).figures("fsdp2_reduce_scatter") == pytest.approx((2 * (3e-4 + 1e-2), 5e8))


def test_flat_gloo_reductions_sum_their_slices_on_the_compute_thread():
    """hpf's flat reduce-scatter on gloo is an all-to-all plus a sum of the p slices by the
    thread that finds it landed: 3 (p-1)/p accesses of the bucket's grads at mem_bw, beside the
    2 of packing the grads, on the compute thread (waited or polled)."""
    link = sim.Link(alpha=0.0, beta=1e15)
    cpu = dataclasses.replace(CM, fast=link, slow=link, shared_links=True, cores=0)
    busy = lambda hw, topology: (lambda r: (r.compute_s + r.exposed_comm_s, r))(  # noqa: E731
        sim.simulate("tiny", {"dp": 2}, hw, local_batch=1, topology=topology))
    base, _ = busy(dataclasses.replace(cpu, mem_bw=math.inf), "flat")
    slow, r = busy(dataclasses.replace(cpu, mem_bw=1e6), "flat")
    grads = 2 * sum(r.bytes["reduce_scatter"].values())  # p = 2: a rank sends half of each bucket
    assert slow - base == pytest.approx((2 + 1.5) * grads / 1e6, rel=1e-6)
    two = [busy(dataclasses.replace(cpu, mem_bw=m), "two-tier")[0] for m in (math.inf, 1e6)]
    assert two[1] - two[0] == pytest.approx(2 * grads / 1e6, rel=1e-6)  # TieredComm sums on its workers


def test_two_collectives_on_a_gloo_process_group_overlap_by_the_calibrated_share():
    """gloo's ProcessGroup has two worker threads: a collective issued beside a running one takes
    its own time plus ``overlap`` x the time they share (1: one after the other, as before)."""
    from hpf.sim.timeline import Timeline

    def ends(overlap):
        link = sim.Link(alpha=0.0, beta=1.0, overlap=overlap)
        tl = Timeline()
        return [tl.submit([("pg", s, "slow", "all_gather", {}, link)]) for s in (2.0, 1.0)]
    assert ends(1.0) == [2.0, 3.0]
    assert ends(0.25) == [2.0, 1.25]
    assert ends(0.0) == [2.0, 1.0]
    cpu = lambda o: dataclasses.replace(CM, fast=sim.Link(alpha=1e-3, beta=1e8, overlap=o),  # noqa: E731
                                        slow=sim.Link(alpha=1e-3, beta=1e8, overlap=o), shared_links=True)
    flat = [sim.simulate("tiny", {"node": 2, "local": 2}, cpu(o), local_batch=1, topology="flat").step_s
            for o in (0.0, 1.0)]
    assert flat[0] < flat[1]


def _slowest_rank(rank):
    import time

    from hpf.sim.measure import median_slowest_each
    return median_slowest_each([lambda: time.sleep(0.002 + 0.01 * rank), lambda: None], reps=3, min_s=0.1)


@pytest.mark.slow
def test_calibration_times_the_slowest_rank_and_its_ranks_agree_on_the_rep_count():
    """Both ranks pick the rep count from the slowest probe (a mismatch would hang their barriers),
    and every rank reports rank 1's sleep, not its own; the skew is rank 0's lead on rank 1 over
    rank 1's time: (12 - 7) / 12 ms = 0.42 for the sleeps alone, less by their overheads."""
    from hpf.launcher import launch

    for (slow, fast), (skew, _) in launch(_slowest_rank, 2, timeout=120):
        assert slow >= 0.012 and fast < slow
        assert 0.3 < skew <= 0.42


def test_calibration_takes_the_median_of_launches_leaf_by_leaf(monkeypatch):
    from hpf.sim import measure

    runs = iter([{"a": (1.0, 9.0), 16: [3.0]}, {"a": (2.0, 1.0), 16: [1.0]}, {"a": (9.0, 2.0), 16: [2.0]}])
    monkeypatch.setattr(measure, "launch", lambda fn, world, *a: [next(runs)])
    assert measure.median_of_launches(None, 2, launches=3) == {"a": (2.0, 2.0), 16: [2.0]}


def test_calibration_sizes_cover_the_models_largest_bucket():
    from hpf.sim.calibrate import sizes_for
    from hpf.sim.measure import SIZES_MIB

    assert sizes_for([("tiny", 4), ("small", 2)]) == SIZES_MIB  # buckets of 0.01-3 MiB: inside the fit
    medium = sizes_for([("medium", 1)])  # a 190 MiB root bucket
    assert medium[:len(SIZES_MIB)] == SIZES_MIB and medium[-2] < 190 <= medium[-1]


@pytest.mark.slow
@pytest.mark.parametrize("run,cases", [("", 17), ("tiny_runs/1", 7)])
def test_the_committed_validation_is_of_the_committed_model(run, cases):
    """``--repredict`` replays docs/simulate/validation (no processes): every case's predicted step
    time and exposed share from its rounds' calibrations must be what the run predicted, or the
    docs' validation table (docs/simulate.md) is of another model."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "simulate_vs_measured.py", "--repredict", str(root / "docs/simulate/validation" / run)],
                         cwd=root / "benchmarks", capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0].count("/") >= 2]
    assert len(rows) == cases
    for case, then, now, _, _, then_exposed, now_exposed, _ in rows:
        assert float(now) == pytest.approx(float(then), rel=1e-6), case
        assert float(now_exposed.rstrip("%")) == pytest.approx(float(then_exposed.rstrip("%")), abs=1e-4), case


@pytest.mark.parametrize("argv,names", [(["--shapes", "bogus/2"], "'bogus/2'"), (["--shapes", "tiny"], "'tiny'"),
                                        (["--launches", "0"], "'0'"), (["--reps", "-1"], "'-1'")])
def test_calibrate_refuses_bad_arguments_before_measuring(argv, names, capsys, monkeypatch):
    from hpf.cli import main
    from hpf.sim import calibrate, measure

    for measures in (calibrate, measure):  # calibrate launches the overhead's rank; measure every other
        monkeypatch.setattr(measures, "launch", lambda *a, **k: pytest.fail("measured despite a bad argument"))
    with pytest.raises(SystemExit):
        main(["calibrate", "--out", "unused.json", *argv])
    assert names in capsys.readouterr().err


def test_calibrate_interrupted_leaves_no_file_and_a_finished_one_is_whole(tmp_path, monkeypatch, capsys):
    """Ctrl-C during hpf calibrate --out NEW left an empty NEW; the file now appears only whole."""
    from hpf.cli import main
    from hpf.sim import calibrate

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    out = tmp_path / "calib.json"
    monkeypatch.setattr(calibrate, "calibrate", interrupted)
    assert main(["calibrate", "--out", str(out)]) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nor a temporary file beside it
    result = {"links": {"gloo": {"2": {}}}, "compute": {"gpt/tiny/1/2": 1.0}, "peak_flops": 1e9, "efficiency": 0.5}
    monkeypatch.setattr(calibrate, "calibrate", lambda *a, **k: result)
    assert main(["calibrate", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == result and sorted(p.name for p in tmp_path.iterdir()) == ["calib.json"]


def test_simulate_s_default_local_batch_is_hpf_train_s(capsys):
    """hpf train splits its global batch (32 sequences) over the data ranks: 16 per rank on 2, 16 per tp
    group on dp=2 x tp=2; hpf simulate predicts that job by default (it assumed 4: issue 60 item 7);
    a --sweep keeps 4 per rank at every size (weak scaling)."""
    from hpf import cli
    from hpf.jobspec import BATCH_SIZE

    for mesh, reader in ((["--world-size", "2"], "rank"), (["--mesh", "dp=2,tp=2"], "tp group"), (["--world-size", "4"], "rank")):
        assert cli.main(["simulate", *mesh, "--hardware", "h100"]) == 0
        data = 2 if mesh[-1] in ("2", "dp=2,tp=2") else 4
        assert f"{BATCH_SIZE // data} x 16 tokens per {reader}," in capsys.readouterr().out
    assert cli.main(["simulate", "--sweep", "16,32", "--hardware", "h100"]) == 0
    assert "4 x 16 tokens per rank," in capsys.readouterr().out
