"""Issue 30: activation recomputation in the models, the memory model (hpf.memory) against what
autograd saves and what a step allocates, and the plan search (hpf.search, hpf plan --search,
hpf train --plan) against an exhaustive simulation of its own space."""
import dataclasses
import json
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

import hpf
from hpf import memory, search, sim
from hpf.report import PlanReport
from hpf.engine.reduce import IN_FLIGHT
from hpf.cli.job import run_keys
from hpf.models import gpt, llama, moe
import cli_helpers
from references import autograd_grads

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

SMALL = [(gpt, "tiny"), (gpt, "small"), (llama, "tiny"), (llama, "small"), (moe, "tiny"), (moe, "small")]


def saved_bytes(loss_fn, params, batch) -> int:
    """Bytes of the distinct non-param storages autograd saves for backward: the independent count."""
    leaves = hpf.tree.flatten(params)[1]
    for x in leaves:
        x.requires_grad_(True)
    params_at = {x.untyped_storage().data_ptr() for x in leaves}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params_at:
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(params, batch)
    return sum(seen.values())


# -- the models ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("module, name", SMALL, ids=[f"{m.__name__.rsplit('.', 1)[1]}-{n}" for m, n in SMALL])
def test_activations_hook_counts_what_autograd_saves(module, name, dtype):
    config, batch = module.CONFIGS[name], 2
    counted = saved_bytes(module.loss_for(config), module.init(config, dtype=dtype),
                          gpt.global_batch(config, batch, 0, 0))
    acts = module.activations(config, batch, torch.finfo(dtype).bits // 8)
    predicted = sum(s for s, _, _ in acts.blocks) + acts.root_saved
    assert predicted == pytest.approx(counted, rel=0.03)


@pytest.mark.parametrize("recompute", ["all", "every_other"])
@pytest.mark.parametrize("module", [gpt, llama, moe], ids=["gpt", "llama", "moe"])
def test_recomputed_blocks_give_the_plain_grads(module, recompute):
    config = module.CONFIGS["tiny"]
    params, batch = module.init(config), gpt.global_batch(config, 3, 0, 0)
    plain = autograd_grads(module.loss_for(config), params, batch)
    again = autograd_grads(module.loss_for(config, recompute=recompute), params, batch)
    assert plain.keys() == again.keys()
    for path in plain:
        torch.testing.assert_close(again[path], plain[path], rtol=0, atol=0, msg=path)


def test_recompute_checkpoints_the_blocks_it_names(monkeypatch):
    from hpf.models import recompute as rc

    called = []
    monkeypatch.setattr(rc, "checkpoint", lambda fn, *a, **k: called.append(1) or fn(*a))
    config = gpt.CONFIGS["tiny"]  # 3 blocks
    for mode, want in (("none", 0), ("every_other", 1), ("all", 3)):
        called.clear()
        gpt.loss_for(config, mode)(gpt.init(config), gpt.global_batch(config, 1, 0, 0))
        assert len(called) == want, mode


def test_an_unknown_recompute_names_the_choices():
    with pytest.raises(ValueError, match="recompute='some'.*none, all, every_other"):
        gpt.loss_for(gpt.CONFIGS["tiny"], "some")


# -- the memory model -------------------------------------------------------------------------------
def _memory(config="small", ranks=4, local_batch=4, **kw):
    cfg = gpt.CONFIGS[config]
    kw.pop("tiered", None)  # (the plan is the same: shards are numbered node-major either way)
    plan = sim.plan_for(gpt, cfg, hpf.Mesh({"dp": ranks}))
    report = memory.state_report(plan, kw.get("mixed_precision"))[0]
    return memory.predict(gpt, cfg, plan, report, local_batch=local_batch, **kw), plan, report


def test_memory_counts_the_reductions_the_engines_in_flight_bound_keeps():
    """The engine waits for the oldest reduction before it issues one past the bound (to_wait),
    so a big block reduced first no longer holds memory two reductions later: by blocks/0's
    backward only blocks/2's and blocks/1's flat grads are in flight, and the peak is at
    blocks/1's (the model counted the largest ever issued, and put a 32 MB higher peak at blocks/0)."""
    sizes = [10_000_000, 1_000_000, 1_000_000, 5_000_000]  # blocks/3, issued first, is the big one
    params = {"embed": torch.empty(100, device="meta"), "blocks": [{"w": torch.empty(n, device="meta")} for n in sizes]}
    plan = hpf.plan(params, hpf.Mesh({"dp": 2}))
    peak = memory.step_memory(PlanReport.of(plan), plan, None, comm="flat")
    flat = {b.unit: b.padded_numel * 4 for b in plan.buckets}
    assert peak.when == "the backward of blocks/1"
    assert peak.parts["reductions"] == 2 * (flat["blocks/3"] + flat["blocks/2"])  # gloo: a receive buffer beside each


def test_memory_terms_follow_the_engine():
    plain, plan, report = _memory(topology="flat")
    assert (plain.parts["params"], plain.parts["optimizer"]) == (report.params_bytes, report.optimizer_bytes)
    # reductions: the engine keeps at most IN_FLIGHT in flight, each with gloo's receive buffer: at
    # the peak, the last IN_FLIGHT issued (backward issues the blocks top down, then the root)
    flats = sum(b.padded_numel * 4 for b in plan.buckets)
    units = {u: sum(b.padded_numel * 4 for b in plan.buckets if b.unit == u) for u in plan.units}
    n = len(units) - 1
    order = [f"blocks/{k}" for k in reversed(range(n))] + ["<root>"]
    peak = memory.step_memory(report, plan, None, comm="flat")  # no activations: gathered units, grads, reductions
    issued = order if peak.when == "the end of backward" else order[:order.index(peak.when.rsplit(" ", 1)[1])]
    assert len(issued) >= IN_FLIGHT and peak.parts["reductions"] == 2 * sum(units[u] for u in issued[-IN_FLIGHT:])
    assert memory.step_memory(report, plan, None, comm="tiered").parts == peak.parts  # the same bound
    # accumulation: a quarter of the activations, every bucket's sums held
    acc = _memory(topology="flat", accumulate=4)[0]
    assert acc.parts["accumulated grads"] == flats and acc.parts["activations"] < plain.parts["activations"] / 3
    # recompute "all": the activations shrink; a recomputed block is gathered again for its backward,
    # so no more than the root and two blocks are gathered at once
    rec = _memory(topology="flat", recompute="all")[0]
    blocks = sorted((n for u, n in units.items() if u != "<root>"), reverse=True)
    assert rec.parts["activations"] < plain.parts["activations"] / 2
    assert rec.parts["gathered"] <= units["<root>"] + sum(blocks[:2])
    # bf16: half the gathered bytes, plus the compute copy of the shards
    bf16 = _memory(topology="flat", mixed_precision="bf16")[0]
    assert bf16.parts["compute shards"] == report.params_bytes // 2
    # the shared-memory fast tier maps every full buffer once per host, and every grad row
    shm = _memory(topology="two-tier", cpu=True, tiered=True)[0]
    assert shm.parts["shared memory"] >= flats and "reductions" not in shm.parts or not shm.parts["reductions"]
    with pytest.raises(ValueError, match="comm='ring'"):
        memory.step_memory(report, plan, None, comm="ring")


@pytest.mark.slow
@pytest.mark.parametrize("config, local_batch", [("tiny", 8), ("small", 2)])
@pytest.mark.parametrize("recompute", ["none", "all"])
def test_predicted_peak_is_within_15_percent_of_the_measured(config, local_batch, recompute, tmp_path):
    """The peak each rank's thread allocates in 2 steps (torch.profiler), as benchmarks/memory_model.py."""
    from memory_model import measure, predicted

    hpf.launch(measure, 2, config, 2, local_batch, recompute, 2, str(tmp_path), timeout=280)
    measured = max(json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    bound = predicted(config, 2, local_batch, recompute)  # IN_FLIGHT reductions still held
    landed = predicted(config, 2, local_batch, recompute, reduce_copies=0)  # each one landed at once
    assert landed.total * 0.85 <= measured <= bound.total * 1.15, (landed.total, measured, bound.total)


# -- the simulator's new options --------------------------------------------------------------------
def test_sim_micro_batches_and_recompute():
    kw = dict(local_batch=4, mixed_precision="bf16", model="gpt")
    one = sim.simulate("1b", {"node": 4, "local": 8}, "h100", **kw)
    four = sim.simulate("1b", {"node": 4, "local": 8}, "h100", accumulate=4, **kw)
    # each micro-batch gathers the blocks again (the pinned root only changes with the update), as the
    # engine's schedule says (hpf.sim.schedule: tests/test_schedule_replay.py checks it is the engine's); one reduction
    from hpf.comm.cost import bucket_comm_bytes

    plan = sim.plan_for(gpt, gpt.CONFIGS["1b"], hpf.Mesh({"node": 4, "local": 8}))
    unit_bytes = Counter()
    for b in plan.buckets:
        unit_bytes[b.unit] += bucket_comm_bytes(plan.mesh, b, torch.bfloat16, torch.float32, True)["all_gather"]["slow"]
    for n, result in ((1, one), (4, four)):
        last = sim.schedule("1b", {"node": 4, "local": 8}, "h100", accumulate=n, **kw)[-1]
        gathers = [e.unit for e in last.events if e.kind == "gather"] + last.next_first
        assert result.bytes["all_gather"]["slow"] == sum(unit_bytes[u] for u in gathers)
    assert four.bytes["all_gather"]["slow"] >= 4 * one.bytes["all_gather"]["slow"] - 3 * unit_bytes["<root>"] > 0
    assert four.bytes["reduce_scatter"] == one.bytes["reduce_scatter"]
    rec = sim.simulate("1b", {"node": 4, "local": 8}, "h100", recompute="all", **kw)
    blocks = sum(gpt.unit_flops(gpt.CONFIGS["1b"], 4)[u] for u in gpt.unit_flops(gpt.CONFIGS["1b"], 4) if u != "<root>")
    hw = sim.hardware("h100")
    assert rec.compute_s - one.compute_s == pytest.approx(blocks / (hw.peak_flops * hw.efficiency), rel=0.02)
    for extra in ({}, {"accumulate": 2}, {"recompute": "every_other"}, {"topology": "flat"}):
        assert sim.compute_floor("1b", {"node": 4, "local": 8}, "h100", **kw, **extra) <= \
            sim.simulate("1b", {"node": 4, "local": 8}, "h100", **kw, **extra).step_s


# -- the search -------------------------------------------------------------------------------------
def test_search_keeps_the_exhaustive_top_five():
    """Branch and bound prunes only candidates that could not enter the top 5: the same top 5 as
    simulating every candidate under the cap."""
    mesh, cap = {"node": 2, "local": 4}, 20 * 2**30  # compute-bound: the floor prunes; fp32's memory does not fit
    result = search.search("gpt", "1b", mesh, "h100", global_batch=32, memory_per_rank=cap)
    every = search.candidates("gpt", "1b", mesh, "h100", global_batch=32)
    fits = [r for r in every if r.memory.total <= cap]
    assert result.candidates == len(every) and result.over_memory == len(every) - len(fits) > 0
    times = sorted(search.simulate(r.candidate, "gpt", "1b", mesh, "h100", 32).step_s for r in fits)
    assert sorted(r.step_s for r in result.ranked)[:5] == pytest.approx(times[:5], rel=1e-12)
    assert result.pruned > 0 and len(result.ranked) + result.pruned == len(fits)
    assert all(r.memory.total <= cap for r in result.ranked)
    assert {c.candidate.accumulate for c in every} == {1, 2, 4}
    assert {c.candidate.recompute for c in every} == {"none", "every_other", "all"}
    text = result.format()
    assert "fell to memory:" in text and "fell to time:" in text and "why #1:" in text
    assert len([line for line in text.splitlines() if line[:2].strip().isdigit()]) == 5


def test_search_of_the_paper_setups_is_fast_and_covers_experts():
    started = time.perf_counter()
    big = search.search("gpt", "1b", {"node": 96, "local": 8}, "cloudmatrix384", memory_per_rank=64 * 2**30)
    dense_s = time.perf_counter() - started
    started = time.perf_counter()
    moe_result = search.search("moe", "505b", {"node": 48, "local": 16}, "cloudmatrix384", memory_per_rank=64 * 2**30)
    moe_s = time.perf_counter() - started
    assert moe_result.best.memory.total <= 64 * 2**30 and moe_result.best.candidate.recompute != "none"
    with pytest.raises(search.NoFeasiblePlan, match=r"the smallest \(.*\) needs [\d.]+ GiB per rank"):
        search.search("moe", "505b", {"node": 48, "local": 16}, "cloudmatrix384", memory_per_rank=4 * 2**30)
    assert dense_s < 10 and moe_s < 10  # the target, loaded machine or not: both take about a second
    assert big.best.candidate.mixed_precision == "bf16"
    assert moe_result.best.candidate.ep_axis in ("node", "local")  # 192 experts split 4 or 12 per die
    every = search.candidates("moe", "505b", {"node": 48, "local": 16}, "cloudmatrix384")
    assert {r.candidate.ep_axis for r in every} == {None, "node", "local"} and len(every) == moe_result.candidates
    assert not any(r.candidate.hsdp for r in every)  # the MoE's explicit specs make HSDP the same plan: dropped


def test_search_holds_fixed_options_and_refuses_bad_ones():
    held = search.search("moe", "tiny", {"dp": 4}, "h100", fixed={"mixed_precision": None, "ep_axis": "dp"})
    assert {(r.candidate.mixed_precision, r.candidate.ep_axis) for r in held.ranked} == {(None, "dp")}
    with pytest.raises(ValueError, match="global batch 6 must split evenly over the 4 ranks"):
        search.search("gpt", "tiny", {"dp": 4}, "h100", global_batch=6)
    with pytest.raises(ValueError, match="'precision'.*not search dimensions"):
        search.search("gpt", "tiny", {"dp": 4}, "h100", fixed={"precision": "bf16"})


def test_the_low_bit_slow_tier_is_searched_only_when_asked_and_held_when_given():
    """Low-bit slow tiers round weights and grads, so a search tries them only with ``low_bit``;
    where the slow link bounds the step (GPT small on 2 nodes of H100s) they win, and a held
    precision is held (two-tier layouts only: the flat ring has no slow stage)."""
    from hpf.precision import SlowPrecision

    mesh = {"node": 2, "local": 2}
    plain = search.candidates("gpt", "small", mesh, "h100", global_batch=16)
    asked = search.candidates("gpt", "small", mesh, "h100", global_batch=16, low_bit=True)
    assert {r.candidate.slow_precision for r in plain} == {None}
    assert {r.candidate.slow_precision for r in asked} == {None, "int8,int8", "int8,int4"}
    assert all(r.candidate.topology == "two-tier" for r in asked if r.candidate.slow_precision)
    assert len(asked) == len(plain) + 2 * sum(r.candidate.topology == "two-tier" for r in plain)
    exact = search.search("gpt", "small", mesh, "h100", global_batch=16)
    low = search.search("gpt", "small", mesh, "h100", global_batch=16, low_bit=True)
    assert low.best.candidate.slow_precision and low.best.step_s < 0.9 * exact.best.step_s
    assert "slow tier int8" in low.format().splitlines()[2]
    topology = low.step_args()["topology"]
    assert topology.slow_precision == SlowPrecision.parse(low.best.candidate.slow_precision)
    ef = "int8,int4,ef"
    held = search.search("gpt", "small", mesh, "h100", global_batch=16, fixed={"slow_precision": ef, "hsdp": False})
    assert {(r.candidate.topology, r.candidate.slow_precision) for r in held.ranked} == {("two-tier", ef)}
    # the residuals' memory: fp32, one per value this rank sends low-bit (its row for the one slow peer)
    plan = sim.plan_for(gpt, gpt.CONFIGS["small"], hpf.Mesh(mesh), None, None, False,
                        held.best.candidate.bucket_bytes, SlowPrecision.parse(ef))
    assert held.best.memory.parts["error feedback"] == 4 * sum(b.shard_numel for b in plan.buckets) > 0


def _run_searched(rank, result_json):
    result = search.SearchResult(**result_json)
    step = hpf.shard_step(result.loss_fn(), optimizer=hpf.optim.adamw(lr=1e-2), **result.step_args())
    config = gpt.CONFIGS["tiny"]
    state = step.init(gpt.init(config))
    losses = []
    for s in range(2):
        state, m = step(state, gpt.global_batch(config, 8, 0, s)[rank * 4:(rank + 1) * 4])
        losses.append(m["loss"])
    return losses


@pytest.mark.slow
def test_the_api_choice_runs_and_trains_like_the_reference():
    from references import adamw_training

    result = search.search("gpt", "tiny", {"dp": 2}, "h100", global_batch=8, fixed={"mixed_precision": None})
    choice = result.best.candidate
    assert set(result.step_args()) == {"mesh", "param_specs", "fsdp_axes", "hsdp", "topology", "mixed_precision",
                                       "accumulate", "batch_axes", "mode"}
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    losses = hpf.launch(_run_searched, 2, fields, timeout=280)[0]
    config = gpt.CONFIGS["tiny"]
    want, _, _ = adamw_training(gpt.loss_for(config), gpt.init(config), lambda s: gpt.global_batch(config, 8, 0, s),
                                2, lr=1e-2, weight_decay=0.0)
    assert losses == pytest.approx(want, rel=1e-4), choice


# -- the command line -------------------------------------------------------------------------------
def hpf_cmd(*args, timeout=300):
    return cli_helpers.hpf_cmd(*args, timeout=timeout, cwd=REPO)


@pytest.mark.slow
def test_cli_plan_search_prints_the_top_five_and_saves(tmp_path):
    proc = hpf_cmd("plan", "--search", "--model", "moe", "--config", "tiny", "--mesh", "node=2,local=2",
                   "--hardware", "h100", "--batch-size", "8", "--save", tmp_path / "plan.json")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("hpf plan --search: moe 'tiny'") and "candidates" in lines[0]
    ranked = [line for line in lines if line[:2].strip().isdigit()]
    assert len(ranked) == 5 and "ms" in ranked[0] and "MiB" in ranked[0]
    assert sum(line.startswith(("fell to memory:", "fell to time:")) for line in lines) == 2
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["model"] == "moe" and saved["batch_size"] == 8 and saved["mesh"] == {"node": 2, "local": 2}
    assert search.Candidate(**saved["choice"]["options"]).label() in ranked[0]


@pytest.mark.slow
def test_cli_plan_search_tries_the_low_bit_slow_tier_when_asked():
    args = ("plan", "--search", "--config", "small", "--mesh", "node=2,local=2", "--hardware", "h100",
            "--batch-size", "16")
    asked, plain = hpf_cmd(*args, "--slow-precision", "auto"), hpf_cmd(*args)
    assert asked.returncode == 0 and plain.returncode == 0, asked.stderr + plain.stderr
    assert "slow tier int8" in asked.stdout.splitlines()[2] and "slow tier" not in plain.stdout


@pytest.mark.parametrize("argv, names", [
    (["plan", "--search", "--memory-per-rank", "lots"], "--memory-per-rank"),
    (["plan", "--search", "--memory-per-rank", "1KB", "--hardware", "h100"], "the smallest"),
    (["plan", "--search", "--batch-size", "6", "--hardware", "h100"], "global batch 6"),
    (["plan", "--search", "--hardware", "abacus"], "--hardware"),
    (["train", "--plan", "auto", "--hardware", "h100", "--hsdp"], "--hsdp"),
    (["train", "--plan", "/no/such/plan.json"], "--plan"),
    (["train", "--plan", "/no/such/plan.json", "--slow-precision", "auto"], "replays a search already made"),
    (["simulate", "--slow-precision", "auto"], "--slow-precision auto lets the plan search choose"),
    (["plan", "--slow-precision", "auto"], "--slow-precision auto lets the plan search choose"),
])
def test_search_options_get_one_line_errors(argv, names, capsys):
    from hpf import cli

    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "error:" in err and names in err and "Traceback" not in err


@pytest.mark.slow
def test_cli_train_replays_a_saved_plan_and_refuses_another_job(tmp_path):
    saved = tmp_path / "plan.json"
    proc = hpf_cmd("plan", "--search", "--config", "tiny", "--world-size", "2", "--hardware", "h100",
                   "--batch-size", "8", "--mixed-precision", "bf16", "--save", saved)
    assert proc.returncode == 0, proc.stderr
    choice = json.loads(saved.read_text())["choice"]["options"]
    proc = hpf_cmd("train", "--plan", saved, "--steps", "2", "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    assert f"plan: {search.Candidate(**choice).label()} (from {saved}, searched on h100)" in proc.stdout
    options = json.loads((tmp_path / "run" / "run.json").read_text())["options"]
    tp = choice.pop("tp")  # (the mesh says it: a tp axis split off the last one)
    assert {k: options[k] for k in choice} == choice
    assert options["batch_size"] == 8 and options["mesh"] == {"dp": 2} and tp == 1  # (tiny's 5 heads: no tp=2)
    proc = hpf_cmd("train", "--plan", saved, "--config", "small", "--out", tmp_path / "other")
    assert proc.returncode == 2 and "was searched for --config tiny" in proc.stderr
    tampered = json.loads(saved.read_text())
    tampered["choice"]["options"]["tp"] = 3  # a tp size that does not divide the mesh's last axis
    saved.write_text(json.dumps(tampered))
    proc = hpf_cmd("train", "--plan", saved, "--out", tmp_path / "tp3")
    assert proc.returncode == 2 and "tp=3 cannot split --mesh dp=2" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_cli_train_moe_recomputed_in_micro_batches_matches_one_process(tmp_path):
    """Experts over ep, 2 micro-batches (the bias is not split: moe.BATCH_AXES), every block
    recomputed: step 1's loss is the one-process loss of the same params and batch."""
    proc = hpf_cmd("train", "--model", "moe", "--mesh", "dp=2,ep=2", "--ep-axis", "ep", "--steps", "1",
                   "--batch-size", "8", "--accumulate", "2", "--recompute", "all", "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    assert "recompute all" in proc.stdout
    loss = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    config = moe.CONFIGS["tiny"]
    batch = moe.batch_with_bias(moe.global_batch(config, 8, 0, 0), torch.zeros(config.n_moe_layers, config.n_experts))
    want = moe.loss_for(config)(moe.init(config, run_keys(0)[0]), batch)
    assert loss == pytest.approx(want.item(), rel=1e-5)


@pytest.mark.slow
def test_cli_train_plan_auto_searches_this_machine(tmp_path):
    proc = hpf_cmd("train", "--plan", "auto", "--hardware", "h100", "--world-size", "1", "--steps", "1",
                   "--batch-size", "4", "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("plan: "))
    assert "searched" in line and "on hardware h100 (--hardware)" in line and "per rank" in line
    options = json.loads((tmp_path / "run" / "run.json").read_text())["options"]
    fields = [f.name for f in dataclasses.fields(search.Candidate) if f.name != "tp"]  # (tp: the mesh's tp axis)
    tp = options["mesh"].get("tp", 1)
    assert search.Candidate(tp=tp, **{k: options[k] for k in fields}).label() in line


@pytest.mark.parametrize("key, value, said", [("accumulate", 0, "must be positive"), ("accumulate", "2", "a str"),
                                              ("topology", "bogus", "not one of"), ("hsdp", "yes", "does not take"),
                                              ("batch_size", -8, "must be positive"),
                                              *[("tp", tp, "positive int") for tp in (0, -2, True, 2.0, "2")]])
def test_cli_train_checks_a_plan_file_as_it_checks_options(tmp_path, capsys, key, value, said):
    """A tampered --plan FILE is one line naming the value (it was a ZeroDivisionError, a TypeError,
    or a flat run that recorded topology "bogus" in run.json; tp 0 a ZeroDivisionError, 2.0 a mesh
    of float sizes)."""
    from hpf import cli

    options = dataclasses.asdict(search.Candidate())
    saved = {"model": "gpt", "config": "tiny", "mesh": {"dp": 1}, "batch_size": 4, "choice": {"options": options}}
    (saved if key == "batch_size" else options)[key] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(saved))
    assert cli.main(["train", "--plan", str(path), "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{key} is {value!r}" in err and said in err, err
    assert not (tmp_path / "run" / "run.json").exists()


def test_a_cpu_never_gets_bf16_and_a_tie_inside_the_error_bars_goes_to_the_simpler_plan():
    # On this machine's calibration (CPU ranks), bf16 is emulated and slower: not searched unless held
    from cli_helpers import CALIBRATION
    cpu = search.search("gpt", "small", {"node": 2, "local": 2}, str(CALIBRATION), global_batch=32)
    assert {r.candidate.mixed_precision for r in cpu.ranked} == {None}
    held = search.search("gpt", "small", {"node": 2, "local": 2}, str(CALIBRATION), global_batch=32,
                         fixed={"mixed_precision": "bf16"})
    assert held.best.candidate.mixed_precision == "bf16"
    # The paper's 1B setup: a 256 MiB bucket cap is predicted 0.1% faster than none, far inside the
    # error bars: the plan that changes fewer options wins
    big = search.search("gpt", "1b", {"node": 96, "local": 8}, "cloudmatrix384", memory_per_rank=64 * 2**30)
    fastest = min(big.ranked, key=lambda r: r.step_s)
    assert fastest.candidate.bucket_bytes and fastest.step_s < big.best.step_s
    assert big.best.step_s <= fastest.step_s * (1 + search.SAME_WITHIN)
    assert big.best.candidate == search.Candidate(mixed_precision="bf16")
    assert "inside hpf.sim's error bars" in big.why()


@pytest.mark.parametrize("tp", [0, -2, True, 2.0, "2", 3])
def test_carve_tp_refuses_what_is_not_a_size_that_divides_the_last_axis(tp):
    from hpf.models import carve_tp

    with pytest.raises(ValueError, match=f"tp={tp!r}"):
        carve_tp(hpf.Mesh({"dp": 2}), tp)
