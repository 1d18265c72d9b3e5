"""The engine's reductions in flight (hpf.engine.reduce): however slow the link, at most
``IN_FLIGHT`` reductions hold their flat grad buffers at once, on the flat and the two-tier
collectives, and the step still equals plain autograd + torch.optim.AdamW."""
import time
import weakref

import numpy as np
import pytest

import hpf
from hpf import SlowLink, Topology
from hpf.comm.handles import wait_for
from hpf.engine.reduce import IN_FLIGHT
from hpf.launcher import launch
from hpf.models import gpt
from hpf.tree import flatten
from references import adamw_training

CONFIG = gpt.CONFIGS["tiny"]  # 3 blocks and the root: 4 reductions a step
BATCH, STEPS, LR = 4, 2, 1e-2


class _LandsWhenWaited:
    """A reduction that never reports itself landed to a poll (a link slower than backward): it
    lands only when the engine waits for it; ``waited[0]`` is set once it has."""

    def __init__(self, handle, waited: list):
        self.handle, self.waited = handle, waited

    def done(self) -> bool:
        return False

    def wait(self, timeout=None) -> bool:
        self.waited[0] = self.waited[0] or wait_for(self.handle, timeout)
        return self.waited[0]


def _alive(flat: weakref.ref, waited: list) -> bool:
    """Whether a reduction's flat grads are still held. One the engine has waited for gets a
    second to be freed: gloo's worker thread drops its own reference to a tensor just after the
    work reports done (CI saw that race under load); a flat still held after that is held."""
    deadline = time.monotonic() + (1.0 if waited[0] else 0.0)
    while flat() is not None and time.monotonic() < deadline:
        time.sleep(0.001)
    return flat() is not None


def _most_held(rank, world, tiered):
    """The most units whose flat grads were alive at one reduction or take of a flat, over STEPS
    steps, and this rank's final params."""
    topology = Topology(fast_transport="pg", slow_link=SlowLink(latency_s=0.02)) if tiered else None
    mesh = hpf.Mesh({"node": 2, "local": world // 2} if tiered else {"dp": world})
    step = hpf.shard_step(gpt.loss_for(CONFIG), mesh=mesh, optimizer=hpf.optim.adamw(lr=LR), topology=topology)
    state = step.init(gpt.init(CONFIG))
    comm, unit_of = step.comm, {b.index: b.unit for b in step.plan.buckets}
    issued: list[tuple[str, weakref.ref, list]] = []  # (unit, its flat, whether waited) per reduction issued
    most = [0]
    grad_buffer, reduce = comm.grad_buffer, comm.reduce

    def count(extra: set):
        held = {u for u, flat, waited in issued if _alive(flat, waited)} | extra
        most[0] = max(most[0], len(held))

    def take(b, dtype):
        count({unit_of[b]})
        return grad_buffer(b, dtype)

    def slow_reduce(b, shard, flat):
        waited = [False]
        issued.append((unit_of[b], weakref.ref(flat), waited))
        count(set())
        return _LandsWhenWaited(reduce(b, shard, flat), waited)

    comm.grad_buffer, comm.reduce = take, slow_reduce
    rows = BATCH // world
    for s in range(STEPS):
        state, _ = step(state, gpt.global_batch(CONFIG, BATCH, seed=0, step=s)[rank * rows:(rank + 1) * rows])
    paths, leaves, _ = flatten(step.full_params(state))
    comm.close()
    return most[0], len(set(unit_of.values())), dict(zip(paths, (x.numpy() for x in leaves)))


@pytest.mark.slow
@pytest.mark.parametrize("world, tiered", [(2, False), (4, True)], ids=["flat", "two-tier"])
def test_at_most_in_flight_reductions_hold_memory_and_the_step_is_plain_torchs(world, tiered):
    _, _, want = adamw_training(lambda p, b: gpt.loss(p, b, n_heads=CONFIG.n_heads), gpt.init(CONFIG),
                                lambda s: gpt.global_batch(CONFIG, BATCH, seed=0, step=s), STEPS, lr=LR)
    for most, units, params in launch(_most_held, world, world, tiered, timeout=120):
        assert units > IN_FLIGHT  # (else the bound could not show)
        assert most == IN_FLIGHT
        for path, x in params.items():
            np.testing.assert_allclose(x, want[path].numpy(), rtol=1e-4, atol=1e-5, err_msg=path)
