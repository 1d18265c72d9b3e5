"""The residency policy (hpf.engine.residency) on its own, without a process group: its gathers
and evictions follow from the sequence of reads and the bound alone, and loop-style use keeps
the two-block bound with one gather per block in forward."""
from hpf.engine.residency import Residency
from hpf.planning import ROOT

BLOCKS = [f"blocks/{i}" for i in range(6)]


def run(policy: Residency, reads: list[list[str]], backward: list[str] | None = None):
    """Replay a step; returns (gathers in order, the most units resident at once)."""
    gathers, peak = [], 0

    def take(acts):
        nonlocal peak
        gathers.extend(acts.gather + acts.prefetch)
        peak = max(peak, len(policy.resident))
    take(policy.begin())
    for units in reads:
        take(policy.read(units))
    policy.start_backward()
    for u in backward or []:
        take(policy.need([u]))
        policy.done(u)
    policy.end_step()
    return gathers, peak


def test_loop_style_gathers_each_block_once_forward_and_all_but_the_last_two_backward():
    policy = Residency.of(["<root>"] + BLOCKS, pinned={"<root>"}, capacity=2)
    gathers, peak = run(policy, [[b] for b in BLOCKS], list(reversed(BLOCKS)))
    assert peak <= 2
    forward, backward = gathers[:len(BLOCKS) + 1], gathers[len(BLOCKS) + 1:]
    assert forward == ["<root>"] + BLOCKS
    assert backward == list(reversed(BLOCKS[:-2]))


def test_the_next_step_prefetches_what_this_step_read_first_and_next():
    policy = Residency.of(BLOCKS, pinned=set(), capacity=2)
    order = list(reversed(BLOCKS))
    run(policy, [[b] for b in order], BLOCKS)  # step 1: the first guess (tree order) was wrong
    gathers, peak = run(policy, [[b] for b in order], BLOCKS)  # step 2: learned
    assert gathers[:len(order)] == order and peak <= 2


def test_the_same_reads_give_the_same_gathers_whatever_else_happens():
    reads = [[BLOCKS[i]] for i in (0, 1, 2, 0, 3, 1, 4, 5, 2)]
    one = run(Residency.of(BLOCKS, set(), 2), reads, BLOCKS[::-1])
    two = run(Residency.of(BLOCKS, set(), 2), reads, BLOCKS[::-1])
    assert one == two


def test_units_read_together_are_never_evicted_by_that_read():
    policy = Residency.of(BLOCKS, set(), capacity=2)
    policy.begin()
    for b in BLOCKS[:4]:
        policy.read([b])
    acts = policy.read([BLOCKS[0], BLOCKS[5]])  # block 5 ties a leaf to block 0: both are read
    assert {BLOCKS[0], BLOCKS[5]} <= set(policy.resident) and not set(acts.evict) & {BLOCKS[0], BLOCKS[5]}


def test_a_bound_of_one_never_prefetches():
    policy = Residency.of(BLOCKS, set(), capacity=1)
    policy.begin()
    for b in BLOCKS:
        acts = policy.read([b])
        assert not acts.prefetch and len(policy.resident) == 1


def test_a_later_micro_batch_starts_from_the_steps_first_reads():
    policy = Residency.of(BLOCKS, set(), capacity=2)
    policy.begin()
    for b in BLOCKS:
        policy.read([b])
    policy.start_backward()
    for b in reversed(BLOCKS):
        policy.need([b])
        policy.done(b)
    acts = policy.resume()
    assert acts.prefetch == BLOCKS[:2] and list(policy.resident) == BLOCKS[:2]


def test_accumulation_gathers_each_micro_batch_as_a_step_of_its_own():
    """With K micro-batches a step gathers K times what one micro-batch does: the end of a
    micro-batch's forward predicts no next unit, so it prefetches nothing that backward must then
    gather again (learning the whole step's reads did: 21 gathers instead of 17 for 5 blocks, K=2)."""
    from hpf.engine.replay import loop_reads, replay

    units = [ROOT] + [f"blocks.{i}" for i in range(5)]
    for k in (1, 2, 4):
        steps = replay(units, {ROOT}, loop_reads(units), units, accumulate=k, steps=2)
        gathers = sum(e.kind == "gather" for e in steps[1].events) + len(steps[1].next_first)
        assert gathers == 1 + k * (5 + 3), (k, gathers)  # the root; per micro-batch 5 forward, 3 backward
