"""One schedule, three readers: the simulator's predicted order of gathers, reads and reductions
(hpf.sim.schedule, which replays the engine's own policies: hpf.engine.replay) equals the
schedule the engine records while it trains (hpf.comm.schedule.LOG), event for event, for each
model and option set; and hpf.memory reads the same replay.

One process: on one rank, bf16 compute makes every bucket a gathered copy (a cast), so the
residency policy runs in full without a process group. The 2-rank check (flat and two-tier,
fp32 shards) shares one launch."""
import dataclasses

import pytest
import torch

import hpf
from hpf import sim
from hpf.comm.schedule import LOG
from hpf.engine.replay import loop_reads, replay
from hpf.models import gpt, llama, moe
from hpf.planning import ROOT

STEPS = 3
MODELS = {m.__name__.rsplit(".", 1)[1]: (m, dataclasses.replace(m.CONFIGS["tiny"], n_layers=5))  # 5 blocks: a
          for m in (gpt, llama, moe)}                                                          # bound of 3 re-gathers
OPTIONS = {"default": {}, "resident_units=3": {"resident_units": 3}, "resident_units=1": {"resident_units": 1},
           "accumulate=2": {"accumulate": 2}, "recompute=all": {"recompute": "all"},
           "recompute=every_other": {"recompute": "every_other"},
           "accumulate=2,recompute=all,resident_units=3": {"accumulate": 2, "recompute": "all", "resident_units": 3}}


def recorded(module, config, mesh, options, rank=0, world_size=1, **step_kw) -> tuple[list, hpf.Plan]:
    """The engine's schedule over STEPS steps: (kind, unit, n) of its gathers (n: in backward),
    reads and reductions (n: the bucket), in the order it recorded them; and its plan."""
    options = dict(options)
    step = hpf.shard_step(module.loss_for(config, recompute=options.pop("recompute", "none")), mesh=hpf.Mesh(mesh),
                          optimizer=hpf.optim.adamw(lr=1e-3), **options, **step_kw)
    with step:
        state = step.init(module.init(config, hpf.random.key(0)))
        batches = module.synthetic_batches(config, 4 * world_size, 0, rank=rank, world_size=world_size)
        start = LOG.seq
        for _ in range(STEPS):
            state, _ = step(state, next(batches))
        kinds = {"all-gather": "gather", "read": "read", "reduce-scatter": "reduce"}
        events = [(kinds[kind], unit, bool(n) if kind == "all-gather" else 0 if kind == "read" else n)
                  for seq, _, kind, unit, n in LOG.events if seq > start and kind in kinds]
        return events, step.plan


def predicted(module, config, mesh, plan, options, **sim_kw) -> list:
    """hpf.sim's schedule for the same job, in the same terms (a reduction: one per trained bucket)."""
    out = []
    for step in sim.schedule(config, mesh, "h100", model=module, local_batch=4, steps=STEPS, **options, **sim_kw):
        for kind, unit, backward in step.collectives():
            if kind == "reduce":
                out += [("reduce", unit, b) for b in plan.units[unit].buckets if not plan.buckets[b].frozen]
            else:
                out.append((kind, unit, backward if kind == "gather" else 0))
    return out


def first_difference(a: list, b: list) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"event {i}: engine {a[i:i + 3]}, simulator {b[i:i + 3]} (lengths {len(a)}, {len(b)})"


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("model", MODELS)
def test_the_simulator_predicts_the_engines_schedule_event_for_event(model, option):
    module, config = MODELS[model]
    engine, plan = recorded(module, config, {"dp": 1}, OPTIONS[option], mixed_precision="bf16")
    assert sum(k == "gather" and back for k, _, back in engine) > 0, "backward re-gathers: the residency policy ran"
    sim_events = predicted(module, config, {"dp": 1}, plan, OPTIONS[option], mixed_precision="bf16", topology="flat")
    assert engine == sim_events, first_difference(engine, sim_events)


def test_a_perturbed_schedule_is_caught():
    """The check can fail: the old simulator's rule (two blocks resident, whatever the bound) and
    a recomputed block kept gathered (no re-gather in backward) both differ from the engine's."""
    module, config = MODELS["gpt"]
    engine, plan = recorded(module, config, {"dp": 1}, {"resident_units": 3}, mixed_precision="bf16")
    assert engine != predicted(module, config, {"dp": 1}, plan, {"resident_units": 2}, mixed_precision="bf16",
                               topology="flat")
    recompute, plan = recorded(module, config, {"dp": 1}, {"recompute": "all"}, mixed_precision="bf16")
    kept = [e for e in recompute if not (e[0] == "gather" and e[2])]  # what "kept gathered till backward" predicts
    assert recompute != kept


def test_the_replay_follows_the_bound_and_issues_reductions_in_order():
    blocks = [f"blocks/{i}" for i in range(5)]
    units = [ROOT] + blocks
    for capacity in (1, 2, 3):
        (step,) = replay(units, {ROOT}, loop_reads(units), units, capacity=capacity)
        assert max(len(e.resident) for e in step.events if e.kind in ("loss", "backward")) <= capacity
        forward = [e.unit for e in step.events if e.kind == "gather" and not e.backward]
        assert forward == [ROOT] + blocks  # each block gathered once in forward
        regathered = [e.unit for e in step.events if e.kind == "gather" and e.backward]
        assert regathered == list(reversed(blocks[:len(blocks) - capacity]))
        assert [e.unit for e in step.events if e.kind == "reduce"] == list(reversed(units))
        assert step.next_first == [ROOT] + blocks[:capacity]


def test_the_memory_model_reads_the_replayed_residency():
    """hpf.memory's gathered units at each moment are the replay's: with a bound of 3, the last
    block's backward still has three blocks gathered (the old model said two: the block and the
    one prefetched below it, whatever the bound)."""
    from hpf.memory import step_memory
    from hpf.models.recompute import Activations
    from hpf.report import PlanReport

    module, config = MODELS["gpt"]
    plan = sim.plan_for(module, config, hpf.Mesh({"dp": 2}))
    size = {u: sum(b.padded_numel * 4 for b in plan.buckets if b.unit == u) for u in plan.units}
    n = config.n_layers
    acts = Activations(tuple((0, 0, 2**40 if k == n - 1 else 0) for k in range(n)), 0, 0)  # the last backward peaks
    for bound, gathered in ((2, [n - 2, n - 1]), (3, [n - 3, n - 2, n - 1])):
        peak = step_memory(PlanReport.of(plan), plan, acts, resident_units=bound)
        assert peak.when == f"the backward of blocks/{n - 1}"
        assert peak.parts["gathered"] == size[ROOT] + sum(size[f"blocks/{k}"] for k in gathered)


#: (topology, mesh, shared memory): the flat collectives, the two-tier ones over process groups
#: only, and the two-tier ones whose fast tier is shared memory (every unit gathered for good)
LAYOUTS = {"flat": ("flat", {"dp": 2}, False), "two-tier": ("two-tier", {"node": 2, "local": 1}, False),
           "two-tier shm": ("two-tier", {"node": 1, "local": 2}, True)}
TWO_RANK_OPTIONS = ("default", "accumulate=2,recompute=all,resident_units=3")


def _two_ranks(rank):
    out = {}
    for model in ("gpt", "moe"):
        module, config = MODELS[model]
        for name in TWO_RANK_OPTIONS:
            for layout, (topology, mesh, _) in LAYOUTS.items():
                kw = {"topology": hpf.Topology()} if topology == "two-tier" else {}
                out[model, name, layout] = recorded(module, config, mesh, OPTIONS[name], rank, 2, **kw)
    return out


@pytest.mark.slow
def test_the_simulator_predicts_the_schedule_of_two_ranks_flat_and_two_tier():
    from hpf.launcher import launch

    runs = launch(_two_ranks, 2, timeout=240)
    assert runs[0].keys() == runs[1].keys() and len(runs[0]) == 2 * len(TWO_RANK_OPTIONS) * len(LAYOUTS)
    for (model, name, layout), (engine, plan) in runs[0].items():
        assert runs[1][model, name, layout][0] == engine, "ranks agree"
        module, config = MODELS[model]
        topology, mesh, shm = LAYOUTS[layout]
        assert any(k == "gather" and back for k, _, back in engine) != shm, "re-gathers unless in shared memory"
        sim_events = predicted(module, config, mesh, plan, OPTIONS[name], topology=topology, shm=shm)
        assert engine == sim_events, f"{model} {name} {layout}: " + first_difference(engine, sim_events)
