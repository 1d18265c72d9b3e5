"""The plan: shards reassemble to the params exactly, and the report's totals add up."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hpf
from hpf import P
from hpf.models import gpt
from hpf.report import PlanReport

AXES = ("a", "b", "c")


@st.composite
def problems(draw):
    """A random mesh, FSDP axes, params tree (with a unit list) and per-param specs."""
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    mesh = hpf.Mesh(dict(zip(AXES, sizes)))
    fsdp = tuple(a for a in mesh.axis_names if draw(st.booleans()))
    compute = [a for a in mesh.axis_names if a not in fsdp]

    def leaf():
        ndim = draw(st.integers(0, 3))
        shape = [draw(st.integers(1, 5)) for _ in range(ndim)]
        entries: list = [()] * ndim
        for a in mesh.axis_names:  # each axis splits at most one dim; a dim may take several axes
            if ndim and draw(st.booleans()):
                d = draw(st.integers(0, ndim - 1))
                entries[d] = entries[d] + (a,)
        for d, axes in enumerate(entries):  # non-FSDP axes must divide their dim: grow it to fit
            shape[d] *= mesh.axis_size([a for a in axes if a in compute])
        spec_entries = [axes if axes else None for axes in entries]
        return torch.randn(shape, dtype=draw(st.sampled_from([torch.float32, torch.bfloat16]))), P(*spec_entries)

    n_blocks = draw(st.integers(0, 3))
    pairs = {"root": leaf(), "blocks": [{"x": leaf(), "y": leaf()} for _ in range(n_blocks)], "z": leaf()}
    params = {"root": pairs["root"][0], "z": pairs["z"][0],
              "blocks": [{k: v[0] for k, v in b.items()} for b in pairs["blocks"]]}
    specs = {"root": pairs["root"][1], "z": pairs["z"][1],
             "blocks": [{k: v[1] for k, v in b.items()} for b in pairs["blocks"]]}
    return mesh, fsdp, params, specs, draw(st.booleans()), draw(st.sampled_from([0, 8, 40, 200]))


def reassemble(plan, params):
    """Rebuild every full param from all ranks' shards, using only the plan's offsets and
    the mesh coordinates (independent of Plan.local_block)."""
    mesh = plan.mesh
    shards = [plan.shards(params, r) for r in range(mesh.size)]
    out = {p: torch.full(s.global_shape, float("nan"), dtype=s.dtype) for p, s in plan.slots.items()}
    for r in range(mesh.size):
        for b in plan.buckets:
            group = mesh.group_ranks(b.shard_axes, r, order=b.shard_order) if b.shard_axes else [r]
            flat = torch.cat([shards[q][b.index] for q in group])
            assert flat.numel() == b.padded_numel and b.padded_numel % b.shard_size == 0
            for s in b.slots:
                block = flat[s.offset:s.offset + s.numel].view(s.local_shape)
                index = []
                for d, n in enumerate(s.local_shape):
                    axes = [a for a in s.spec.dim_axes(d) if a in plan.compute_axes]
                    i = mesh.group_index(axes, r) if axes else 0
                    index.append(slice(i * n, (i + 1) * n))
                out[s.path][tuple(index)] = block
    return out


@settings(max_examples=60, deadline=None)
@given(problems())
def test_shards_reassemble_exactly(problem):
    mesh, fsdp, params, specs, hierarchical, bucket_bytes = problem
    plan = hpf.plan(params, mesh, specs, fsdp_axes=fsdp, fast_major=hierarchical, bucket_bytes=bucket_bytes)
    rebuilt = reassemble(plan, params)
    paths, leaves, _ = hpf.tree.flatten(params)
    for path, leaf in zip(paths, leaves):
        assert torch.equal(rebuilt[path], leaf), path
    # every param slice is held by the shard positions the plan says, and only those
    for b in plan.buckets:
        for s in b.slots:
            held = [i for i in range(b.shard_size)
                    if max(s.offset, b.shard_range(i)[0]) < min(s.offset + s.numel, b.shard_range(i)[1])]
            assert held == b.holders(s)


def test_units_are_list_elements():
    params = gpt.init(gpt.CONFIGS["tiny"], device="meta")
    plan = hpf.plan(params, hpf.Mesh({"dp": 4}))
    assert list(plan.units) == ["<root>", "blocks/0", "blocks/1", "blocks/2"]
    assert plan.slots["blocks/1/w_up"].unit == "blocks/1" and plan.slots["embed"].unit == "<root>"


def test_bucket_bytes_caps_buckets_in_tree_order():
    params = gpt.init(gpt.CONFIGS["tiny"], device="meta")
    mesh = hpf.Mesh({"dp": 4})
    whole = hpf.plan(params, mesh)
    cap = 4 * 1000  # tiny's block: two 25-vectors, 25x25, 25x75, 25x38 and 38x25 fp32 matrices
    split = hpf.plan(params, mesh, bucket_bytes=cap)
    assert len(split.buckets) > len(split.units) == len(whole.units) == len(whole.buckets)
    for name, unit in split.units.items():
        buckets = [split.buckets[i] for i in unit.buckets]
        # the unit's params, in tree order, dealt into consecutive buckets
        assert [s.path for b in buckets for s in b.slots] == [s.path for s in whole.buckets[whole.units[name].buckets[0]].slots]
        for b in buckets:
            assert b.numel * 4 <= cap or len(b.slots) == 1, (name, [s.path for s in b.slots])
        for b, after in zip(buckets, buckets[1:]):  # a bucket closes only when the next param would not fit
            assert (b.numel + after.slots[0].numel) * 4 > cap
    with pytest.raises(ValueError, match="bucket_bytes=-1"):
        hpf.plan(params, mesh, bucket_bytes=-1)


def test_768_rank_plan_of_1b_gpt_adds_up():
    config = gpt.CONFIGS["1b"]
    params = gpt.init(config, device="meta")
    mesh = hpf.Mesh({"node": 96, "local": 8})
    plan = hpf.plan(params, mesh)
    report = PlanReport.of(plan)
    n_params = sum(x.numel() for x in hpf.tree.flatten(params)[1])
    assert n_params == gpt.num_params(config)
    # every rank stores one shard of every bucket; summed, that is the padded total
    assert report.params_bytes * mesh.size == report.padded_total_bytes
    padding = report.padded_total_bytes - 4 * n_params
    assert 0 <= padding < 4 * len(plan.buckets) * mesh.size
    # peak gathered = root unit + the two largest blocks, in full
    root = sum(b.padded_numel for b in plan.buckets if b.unit == "<root>") * 4
    block = sum(b.padded_numel for b in plan.buckets if b.unit == "blocks/0") * 4
    assert report.peak_gathered_bytes == root + 2 * block
    assert PlanReport.of(plan, resident_units=3).peak_gathered_bytes == root + 3 * block  # the residency bound
    # all-gather: each rank sends its shard to 767 peers per gather; blocks are gathered
    # twice (forward, backward), except the last two (the residency bound), which backward
    # finds still gathered
    shard_bytes = {u: sum(b.shard_numel for b in plan.buckets if b.unit == u) * 4 for u in plan.units}
    last = {f"blocks/{config.n_layers - 1}", f"blocks/{config.n_layers - 2}"}
    expect_ag = sum((1 if u == "<root>" or u in last else 2) * n * 767 for u, n in shard_bytes.items())
    ag = report.comm["all_gather"]
    assert ag["fast"] + ag["slow"] == expect_ag
    assert ag["fast"] * (768 - 8) == ag["slow"] * 7  # 7 peers on the host, 760 off it
    assert "per-rank memory (768 ranks)" in report.format()


def test_hsdp_rules_split_buckets_and_report_all_reduce():
    params = gpt.init(gpt.CONFIGS["tiny"], device="meta")
    mesh = hpf.Mesh({"node": 2, "local": 2})
    plan = hpf.plan(params, mesh, hpf.rules([(r"blocks/\d+/w_\w+", P("local")), (r".*", P())]))
    b0 = [plan.buckets[i] for i in plan.units["blocks/0"].buckets]
    assert sorted(b.shard_axes for b in b0) == [(), ("local",)]
    assert all(b.replicate_axes == ("node",) for b in b0 if b.shard_axes)
    report = PlanReport.of(plan)
    assert report.comm["all_reduce"]["slow"] > 0
    hier = PlanReport.of(plan, hierarchical=True)
    assert hier.comm["all_gather"] == report.comm["all_gather"]  # local-only gathers don't change
    assert math.isclose(report.params_bytes, sum(b.shard_numel for b in plan.buckets) * 4)
