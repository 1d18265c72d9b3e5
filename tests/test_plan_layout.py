"""The plan is the one home of layout facts: the part of a param a shard holds, a unit's param
paths, the parallel sizes, and the one recipe for the plan a step makes (HSDP included)."""
import pytest
import torch

import hpf
from hpf import P, Topology
from hpf.models import gpt, has_experts, moe, specs_for
from hpf.planning import step_plan
from hpf.precision import SlowPrecision


def _params():
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(7, 6, generator=g), "blocks": [{"w": torch.randn(6, 6, generator=g),
                                                                  "b": torch.randn(5, generator=g)} for _ in range(2)]}


@pytest.mark.parametrize("axes", [{"dp": 3}, {"node": 2, "local": 2}, {"dp": 4}])
def test_local_pieces_tile_every_param_exactly(axes):
    """Each shard's pieces, put where ``param`` says, rebuild every param's flat from the full
    buffer: no element lost, none held twice; the shard side indexes the rank's shard."""
    params = _params()
    mesh = hpf.Mesh(axes)
    plan = hpf.plan(params, mesh)
    for b in plan.buckets:
        full = plan.flat_buffer(b, {s.path: params_at(params, s.path) for s in b.slots})
        for slot in b.slots:
            rebuilt = torch.full((slot.numel,), float("nan"))
            for position in range(b.shard_size):
                piece = b.local_piece(slot, position)
                shard = full[b.shard_range(position)[0]:b.shard_range(position)[1]]
                assert piece.numel == piece.param.stop - piece.param.start >= 0
                assert torch.isnan(rebuilt[piece.param]).all(), "an element held by two shards"
                rebuilt[piece.param] = shard[piece.held]
            assert torch.equal(rebuilt, params_at(params, slot.path).reshape(-1)), slot.path
            assert sum(b.local_piece(slot, i).numel for i in range(b.shard_size)) == slot.numel
            assert [i for i in range(b.shard_size) if b.local_piece(slot, i).numel] == b.holders(slot)


def params_at(params, path):
    node = params
    for key in path.split("/"):
        node = node[int(key)] if isinstance(node, list) else node[key]
    return node


def test_slot_paths_and_parallel_sizes():
    plan = hpf.plan(_params(), hpf.Mesh({"dp": 2, "tp": 2}), hpf.rules([(r"blocks/\d+/w", P(None, "tp")),
                                                                         (r".*", P("dp"))]), fsdp_axes=("dp",))
    assert sorted(plan.slot_paths("blocks/1")) == ["blocks/1/b", "blocks/1/w"]  # (two buckets: w is split over tp)
    assert [p for u in plan.units for p in plan.slot_paths(u)] == \
        [s.path for u in plan.units for b in plan.units[u].buckets for s in plan.buckets[b].slots]
    assert (plan.dp_size, plan.compute_size) == (2, 2)
    assert (hpf.plan(_params(), hpf.Mesh({"node": 2, "local": 2})).dp_size,
            hpf.plan(_params(), hpf.Mesh({"node": 2, "local": 2})).compute_size) == (4, 1)


def test_hsdp_is_one_rule_for_the_step_the_cli_and_the_simulator():
    mesh = hpf.Mesh({"node": 2, "local": 2})
    params = gpt.init(gpt.CONFIGS["tiny"], device="meta")
    plan = hpf.plan(params, mesh, hsdp=True)
    assert {b.shard_axes for b in plan.buckets} == {("local",)} and {b.replicate_axes for b in plan.buckets} == {("node",)}
    via_step = step_plan(params, mesh, topology=Topology(bucket_bytes=4096), hsdp=True)
    assert [(b.shard_axes, b.shard_order, b.numel) for b in via_step.buckets] == \
        [(b.shard_axes, b.shard_order, b.numel) for b in
         hpf.plan(params, mesh, hsdp=True, fast_major=True, bucket_bytes=4096).buckets]
    simulated = hpf.sim.plan_for(gpt, gpt.CONFIGS["tiny"], mesh, hsdp=True)
    assert [(b.shard_axes, b.replicate_axes) for b in simulated.buckets] == \
        [(b.shard_axes, b.replicate_axes) for b in step_plan(params, mesh, topology=Topology(), hsdp=True).buckets]
    with pytest.raises(ValueError, match="hsdp=True replicates params across the slow tier"):
        hpf.plan(params, hpf.Mesh({"dp": 4}), hsdp=True)


def test_topology_with_slow_precision_keeps_every_field():
    slow = SlowPrecision("int8", "int4", block=64, error_feedback=True)
    topology = Topology.with_slow(slow, bucket_bytes=1 << 20)
    assert topology.slow_precision == slow and topology.bucket_bytes == 1 << 20
    assert Topology.with_slow(None) == Topology()
    assert topology.plan_options() == {"fast_major": False, "bucket_bytes": 1 << 20, "slow_precision": slow}


def test_model_specs_have_one_home():
    assert has_experts(moe) and not has_experts(gpt)
    assert specs_for(gpt, gpt.CONFIGS["tiny"], None, ("dp",)) is None
    with pytest.raises(ValueError, match="model gpt has no experts"):
        specs_for(gpt, gpt.CONFIGS["tiny"], "dp", ("dp",))
    assert specs_for(moe, moe.CONFIGS["tiny"], "dp", ("dp",)) is not None
