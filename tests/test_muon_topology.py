"""Distributed Muon's owners placed by topology: on a two-tier mesh each split matrix is owned on
the node (the ranks sharing the fast tier) that holds most of it, so the least of it crosses the
slow tier; the plan's prediction of those bytes (hpf.optim.muon_owners.muon_traffic, which hpf plan
prints) equals what DistMuon sends, and owners that hold no piece give single-device Muon."""
from collections import Counter

import pytest
import torch

import hpf
from hpf.models import gpt
from hpf.optim import muon_owners
from hpf.optim.dist_muon import DistMuon
from hpf.optim.muon_owners import assign_owners, muon_paths, muon_traffic
from hpf.optim.muon_optimizer import muon

MESH = hpf.Mesh({"node": 2, "local": 2})


def node(rank):
    return MESH.coords(rank)[0]


def split_matrices(plan, paths):
    """(bucket, shard group, slot, {node: elements held there}) of every matrix split across ranks."""
    for b in plan.buckets:
        for ranks in muon_owners._shard_groups(plan, b):
            for slot in b.slots:
                holders = b.holders(slot)
                if slot.path in paths and len(holders) > 1:
                    held = Counter()
                    for i in holders:
                        held[node(ranks[i])] += b.local_piece(slot, i).numel
                    yield b, ranks, slot, held


@pytest.mark.parametrize("hierarchical", [True, False])
def test_owners_sit_on_the_node_holding_most_and_slow_bytes_are_the_least_owners_allow(hierarchical):
    plan = hpf.plan(gpt.init(gpt.CONFIGS["small"], device="meta"), MESH, fast_major=hierarchical)
    paths = muon_paths(muon(), plan)
    owners, load = assign_owners(plan, paths, 5)
    least = 0
    for b, ranks, slot, held in split_matrices(plan, paths):
        owner = owners[(b.index, ranks, slot.path)]
        assert held[node(owner)] == max(held.values()), slot.path
        least += 2 * 4 * (slot.numel - max(held.values()))  # the other nodes' pieces, there and back, fp32
    total, slow = muon_traffic(muon(), plan)
    assert least > 0 and slow == least <= total
    assert owners == assign_owners(plan, paths, 5)[0]  # a pure function of the plan


def test_a_one_tier_mesh_keeps_every_holder_a_candidate():
    plan = hpf.plan(gpt.init(gpt.CONFIGS["small"], device="meta"), hpf.Mesh({"dp": 4}))
    _, load = assign_owners(plan, muon_paths(muon(), plan), 5)
    loads = [load[r] for r in range(4)]
    assert max(loads) / (sum(loads) / 4) < 1.08  # the balance of test_dist_muon's owner test
    assert muon_traffic(muon(), plan)[1] == 0  # one node: nothing crosses a slow tier


# -- 4 ranks, a two-tier plan: owners that hold no piece, against single-device Muon -------------
STEPS = 20  # the bar: single-device Muon's params at rtol 1e-5 after 20 steps


def run_two_tier(rank):
    from test_dist_muon import MUON, gpt_params, synthetic_grads

    params = gpt_params()
    plan = hpf.plan(params, MESH, fast_major=True)
    opt = DistMuon(muon(**MUON), plan, rank)
    shards = plan.shards(params, rank)
    state = opt.init(shards)
    for grads in synthetic_grads(params, STEPS):
        shards, state = opt.update(plan.shards(grads, rank), state, shards)
    return {"shards": [s.clone() for s in shards], "sent": (opt.bytes_sent, opt.slow_bytes_sent),
            "owns_without_a_piece": sum(x.mine.start == x.mine.stop for x in opt.owned)}


@pytest.mark.slow
def test_two_tier_owners_that_hold_no_piece_match_single_device_muon():
    from hpf.launcher import launch
    from test_dist_muon import MUON, gpt_params, reference_muon

    runs = launch(run_two_tier, 4, timeout=240)
    assert sum(r["owns_without_a_piece"] for r in runs) > 0  # the case under test happens
    params = gpt_params()
    plan = hpf.plan(params, MESH, fast_major=True)
    paths, leaves, _ = hpf.tree.flatten(reference_muon(params, STEPS))
    want = dict(zip(paths, leaves))
    for rank in range(MESH.size):
        for b in plan.buckets:
            flat = torch.cat([runs[q]["shards"][b.index] for q in plan.shard_ranks(b, rank)])
            for path, got in plan.views(b, flat).items():
                torch.testing.assert_close(got, want[path], rtol=1e-5, atol=2e-6,
                                           msg=lambda m: f"rank {rank}, {path}: {m}")
    # the engine's counters over STEPS updates, against the plan's per-step prediction
    predicted = muon_traffic(muon(**MUON), plan)
    assert tuple(sum(r["sent"][i] for r in runs) for i in (0, 1)) == tuple(STEPS * x for x in predicted)
