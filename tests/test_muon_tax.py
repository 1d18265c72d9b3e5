"""Distributed Muon's tax in hpf.sim (hpf simulate --optimizer muon, and the plan search): the
busiest rank's Newton-Schulz FLOPs at the matmul rate plus its pieces' time on each tier's link,
run after the step's decision."""
import dataclasses
import math

import pytest

import hpf
from hpf import cli, search, sim
from hpf.models import gpt
from hpf.optim.muon_owners import muon_sends

CM = sim.PROFILES["cloudmatrix384"]
SMALL = gpt.CONFIGS["small"]


def matrix_flops_by_hand(c, steps=5):
    """Standard NS FLOPs of every GPT block matrix: per step 4 r^2 s + 2 r^3, r the short side."""
    shapes = [(c.d_model, 3 * c.d_model), (c.d_model, c.d_model), (c.d_model, c.d_ff), (c.d_ff, c.d_model)]
    return c.n_layers * sum(steps * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in shapes)


def test_one_rank_pays_every_matrix_at_the_matmul_rate_and_sends_nothing():
    plan = sim.plan_for(gpt, SMALL, hpf.Mesh({"dp": 1}))
    assert sim.muon_tax(plan, CM) == pytest.approx(matrix_flops_by_hand(SMALL) / (CM.peak_flops * CM.efficiency))


def test_the_tax_is_the_busiest_ranks_ns_plus_its_sends_and_the_step_grows_by_it():
    mesh = hpf.Mesh({"node": 2, "local": 2})
    plan = sim.plan_for(gpt, SMALL, mesh)
    slow_link = dataclasses.replace(CM.slow, beta=1e8)  # a slow tier slow enough to matter
    hw = dataclasses.replace(CM, slow=slow_link, scale_out=None)
    tax = sim.muon_tax(plan, hw)
    compute_only = sim.muon_tax(plan, dataclasses.replace(hw, fast=sim.Link(0.0, math.inf),
                                                          slow=sim.Link(0.0, math.inf)))
    sends = muon_sends(hpf.optim.muon(), plan)
    assert any(c["slow"] for c in sends.values())
    assert tax > compute_only > 0
    assert tax <= compute_only + max(c["fast"] / hw.fast.beta + c["slow"] / slow_link.beta + hw.fast.latency
                                     + slow_link.latency for c in sends.values()) + 1e-15
    muon, adamw = (sim.simulate("small", mesh, hw, local_batch=2, optimizer=o) for o in ("muon", "adamw"))
    assert muon.step_s == pytest.approx(adamw.step_s + tax, rel=1e-9)
    assert muon.optimizer_s == pytest.approx(adamw.optimizer_s + tax, rel=1e-9)
    floor = [sim.compute_floor("small", mesh, hw, local_batch=2, optimizer=o) for o in ("muon", "adamw")]
    assert floor[0] == pytest.approx(floor[1] + tax)
    baseline = [sim.simulate("small", mesh, hw, "fsdp2", local_batch=2, optimizer=o).step_s for o in ("muon", "adamw")]
    assert baseline[0] == baseline[1]  # the baselines are modelled with AdamW


def test_the_plan_search_weighs_muon():
    adamw, muon = (search.search("gpt", "small", {"node": 2, "local": 2}, "h100", optimizer=o, top=1).ranked[0]
                   for o in ("adamw", "muon"))
    assert muon.sim.optimizer_s > adamw.sim.optimizer_s


def test_cli_simulate_with_muon(capsys):
    assert cli.main(["simulate", "--config", "small", "--mesh", "node=2,local=2", "--hardware", "h100",
                     "--optimizer", "muon", "--local-batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "Muon (its tax in hpf rows only" in out
    row = next(line.split() for line in out.splitlines() if line.split()[:2] == ["4", "hpf"])
    want = sim.simulate("small", {"node": 2, "local": 2}, "h100", local_batch=4, optimizer="muon")
    assert float(row[2]) == pytest.approx(want.step_s * 1e3, abs=0.006)
    with pytest.raises(ValueError, match="optimizer 'sgd'"):
        sim.simulate("small", {"dp": 2}, "h100", optimizer="sgd")
