"""Muon's Newton-Schulz started during backward (muon(overlap=True), hpf.optim.EarlyUpdate).

As each unit's grads land, distributed Muon computes the momentum (into copies of the state)
and Newton-Schulz of that unit's matrices, and sends split matrices' pieces to their owners;
only after the step's global decision does it write params and state. Checked here, in one
2-rank launch of GPT tiny: the params equal single-process Muon on the full model after 20
steps with overlap on and off; the work really starts before the decision (Newton-Schulz calls
counted before ``Decider.decide``); a non-finite step that started it changes nothing; a step
whose grads are clipped (so the early work assumed the wrong scale) drops it and equals the
overlap-off step bitwise; an hpf.weighted loss (hpf train's) keeps its early work too.
"""
import numpy as np
import pytest
import torch

import hpf
from hpf import decision
from hpf.launcher import launch
from hpf.models import gpt
from hpf.optim import muon_math
from hpf.optim.dist_muon import DistMuon
from hpf.optim.muon_optimizer import muon
from references import functional_training

TINY = gpt.CONFIGS["tiny"]
MUON = dict(lr=0.02, weight_decay=0.1, adamw_lr=1e-2, adamw_weight_decay=0.05)
STEPS = 20
# As test_dist_muon's TRAIN_TOL: the sharded grads are the same mean summed in another order (a few
# ulps), which NS can grow to ~3e-7 of a param per step (measured here: <= 5.6e-7 after 20 steps);
# a missing, stale or misplaced update moves a param by ~lr * |O| ~ 5e-3.
TOL = dict(rtol=1e-5, atol=2e-5)


def batches(step):
    return gpt.global_batch(TINY, 8, 0, step)


def params0():
    return gpt.init(TINY, hpf.random.key(0))


class EarlyNS:
    """Counts, per step, the Newton-Schulz calls made before the step's decision, and the
    steps that ran DistMuon.update after it (the early work dropped, or none)."""

    def __enter__(self):
        self.before, self.after, self.decided, self.updates = [], [], False, 0
        ns, decide, update = muon_math.newton_schulz, decision.Decider.decide, DistMuon.update

        def counting_ns(*args, **kwargs):
            (self.after if self.decided else self.before)[-1] += 1
            return ns(*args, **kwargs)

        def deciding(*args, **kwargs):
            self.decided = True
            return decide(*args, **kwargs)

        def updating(*args, **kwargs):
            self.updates += 1
            return update(*args, **kwargs)
        self._restore = ns, decide, update
        muon_math.newton_schulz, decision.Decider.decide, DistMuon.update = counting_ns, deciding, updating
        return self

    def new_step(self):
        self.before.append(0)
        self.after.append(0)
        self.decided = False

    def __exit__(self, *exc):
        muon_math.newton_schulz, decision.Decider.decide, DistMuon.update = self._restore


def snapshot(step, state):
    return ([p.clone() for p in hpf.tree.flatten(step.full_params(state))[1]],
            [t.clone() for t in hpf.tree.flatten(state.opt_state)[1]])


def train(rank, steps=STEPS, poison=(), weighted=False, **kwargs):
    """GPT tiny on 2 ranks with Muon; ``poison``: steps whose loss is made NaN (skipped);
    ``weighted``: the loss is hpf.weighted(token sum, token count), as hpf train's."""
    factor = [1.0]
    base = gpt.loss_for(TINY, weighted=weighted)
    loss_fn = (lambda p, b: base(p, b) * factor[0]) if poison else base
    step = hpf.shard_step(loss_fn, mesh=hpf.Mesh({"dp": 2}), on_nonfinite="skip",
                          **{"optimizer": muon(**MUON), **kwargs})
    state = step.init(params0())
    losses, skipped, unchanged = [], [], []
    with EarlyNS() as counts:
        for s in range(steps):
            factor[0] = float("nan") if s in poison else 1.0
            before = snapshot(step, state) if s in poison else None
            counts.new_step()
            state, metrics = step(state, batches(s)[rank * 4:(rank + 1) * 4])
            losses.append(metrics["loss"])
            skipped.append(metrics["skipped"])
            if before is not None:
                after = snapshot(step, state)
                unchanged.append(all(torch.equal(a, b) for x, y in zip(before, after) for a, b in zip(x, y)))
    params, opt_state = snapshot(step, state)
    step.close()
    return {"losses": losses, "params": params, "opt_state": opt_state, "skipped": skipped, "unchanged": unchanged,
            "ns_before": counts.before, "ns_after": counts.after, "updates": counts.updates, "split": len(step.plan_optimizer.owned)
            + len(step.plan_optimizer.held)}


def checks(rank):
    return {
        "on": train(rank, optimizer=muon(**MUON, overlap=True)),
        "off": train(rank, optimizer=muon(**MUON, overlap=False)),
        "weighted": train(rank, weighted=True, optimizer=muon(**MUON, overlap=True)),
        "accumulate": train(rank, weighted=True, accumulate=2, optimizer=muon(**MUON, overlap=True)),
        "skip": train(rank, 4, poison=(1,), optimizer=muon(**MUON, overlap=True)),
        "skip_off": train(rank, 4, poison=(1,), optimizer=muon(**MUON, overlap=False)),
        "clip_on": train(rank, 3, max_grad_norm=1e-3, optimizer=muon(**MUON, overlap=True)),
        "clip_off": train(rank, 3, max_grad_norm=1e-3, optimizer=muon(**MUON, overlap=False)),
    }


@pytest.fixture(scope="module")
def ranks():
    return launch(checks, 2, timeout=300)


def reference():
    """Plain autograd on the full model, one process, fed to hpf's single-device Muon."""
    losses, params = functional_training(gpt.loss_for(TINY), params0(), batches, muon(**MUON), STEPS)
    return losses, hpf.tree.flatten(params)[1]


@pytest.mark.slow
def test_overlap_on_and_off_match_single_process_muon_after_20_steps(ranks):
    losses, leaves = reference()
    for mode in ("on", "off", "weighted", "accumulate"):
        run = ranks[0][mode]
        assert run["losses"] == ranks[1][mode]["losses"]
        np.testing.assert_allclose(run["losses"], losses, rtol=1e-5, atol=1e-6)
        for got, want in zip(run["params"], leaves, strict=True):
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"overlap {mode}: {m}")
    assert all(r["on"]["split"] for r in ranks), "no split matrix: the owners' exchange during backward is untested"


@pytest.mark.slow
def test_newton_schulz_starts_before_the_decision_only_with_overlap(ranks):
    for r in ranks:
        # hpf.weighted: the global count is all-reduced before backward, so its work starts and is kept too
        for mode in ("on", "weighted", "accumulate"):
            assert all(n > 0 for n in r[mode]["ns_before"]), r[mode]["ns_before"]
            assert r[mode]["updates"] == 0, "the early work was dropped and the update ran after the decision"
        assert not any(r["off"]["ns_before"]), r["off"]["ns_before"]
        assert r["off"]["updates"] == STEPS


@pytest.mark.slow
def test_a_skipped_step_that_started_early_applies_nothing(ranks):
    for r in ranks:
        run = r["skip"]
        assert run["skipped"] == [False, True, False, False]
        assert run["ns_before"][1] > 0, "the poisoned step did not start Newton-Schulz early: nothing was tested"
        assert run["unchanged"] == [True], "the skipped step changed params or optimizer state"
        for got, want in zip(run["params"] + run["opt_state"], r["skip_off"]["params"] + r["skip_off"]["opt_state"]):
            torch.testing.assert_close(got, want, **TOL)


@pytest.mark.slow
def test_clipped_steps_drop_the_early_work_and_equal_overlap_off_exactly(ranks):
    for r in ranks:
        on, off = r["clip_on"], r["clip_off"]
        assert all(n > 0 for n in on["ns_before"])
        assert on["updates"] == 3, "a clipped step kept early work computed at the unclipped scale"
        assert on["losses"] == off["losses"]
        for got, want in zip(on["params"] + on["opt_state"], off["params"] + off["opt_state"]):
            assert torch.equal(got, want)
