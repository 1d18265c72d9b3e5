"""The cross-rank schedule check (hpf.comm.schedule): ranks that issue different collectives get
ScheduleMismatchError naming the first difference, on every rank, within seconds; ranks that only
run at different speeds never do."""
import re
import time

import pytest
import torch
import torch.distributed as dist

from hpf.comm import schedule
from hpf.launcher import launch


def _mismatched_ops(rank):
    t0 = time.monotonic()
    schedule.rendezvous("warm-up")
    if rank == 0:
        schedule.LOG.record("all-gather", "blocks/1", 7)
        handle = dist.all_gather_single(torch.empty(20), torch.ones(10), async_op=True)
    else:
        schedule.LOG.record("all-reduce", "totals")
        handle = dist.all_reduce(torch.ones(3), async_op=True)
    try:
        schedule.wait(handle)
    except schedule.ScheduleMismatchError as e:
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


def _slow_peer(rank):
    schedule.rendezvous("warm-up")
    if rank == 1:
        time.sleep(schedule.SUSPECT_S + 2)  # rank 0 waits past the suspicion point, then the peer arrives
    schedule.rendezvous("late")
    x = torch.full((4,), float(rank))
    schedule.LOG.record("all-reduce", "x")
    schedule.wait(dist.all_reduce(x, async_op=True))
    return x.tolist()


@pytest.mark.slow
def test_mismatched_collectives_name_the_difference_on_every_rank_within_seconds():
    for message, seconds in launch(_mismatched_ops, 2, timeout=120):
        assert message is not None and seconds < 30
        assert re.search(r"disagree at event \d+ of their schedules: rank 0: all-gather blocks/1 \(backward\)", message)
        assert "rank 1: all-reduce totals" in message


@pytest.mark.slow
def test_a_slow_peer_is_not_a_mismatch():
    assert launch(_slow_peer, 2, timeout=120) == [[1.0] * 4, [1.0] * 4]


def test_digest_parts_detect_any_single_difference():
    log = schedule.ScheduleLog()
    for unit in ("blocks/0", "blocks/1"):
        log.record("all-gather", unit)
    same = schedule.digest_parts(log.digest())
    other = schedule.ScheduleLog()
    for unit in ("blocks/0", "blocks/2"):
        other.record("all-gather", unit)
    diff = schedule.digest_parts(other.digest())
    sums = lambda parts: [sum(p) for p in zip(*parts)]  # noqa: E731 - what a SUM all-reduce gives
    assert schedule.parts_agree(sums([same, same, same]), 3)
    assert not schedule.parts_agree(sums([same, same, diff]), 3)


def test_report_ignores_a_rank_that_is_only_behind():
    ev = [(1, 0, "all-gather", "blocks/0", 0), (2, 0, "all-gather", "blocks/1", 0)]
    assert schedule._report([{"rank": 0, "events": ev}, {"rank": 1, "events": ev[:1]}]) is None
    other = ev[:1] + [(2, 0, "all-gather", "blocks/2", 0)]
    assert "rank 1: all-gather blocks/2" in schedule._report([{"rank": 0, "events": ev}, {"rank": 1, "events": other}])


def test_device_collectives_order_streams_and_settle_on_the_cpu():
    """On an accelerator a wait only orders the compute stream after the collective (the CPU runs
    on, as FSDP2's); at the step's end the CPU polls them, so a hang is named there."""
    from hpf.comm.handles import StreamWork

    class FakeWork:
        def __init__(self):
            self.waits, self.completed = [], False

        def wait(self, *args):
            self.waits.append(args)
            return True

        def get_future(self):  # (what the engine polls: see hpf.comm.handles.work_done)
            return self

        def done(self):
            return self.completed

    work = FakeWork()
    handle = StreamWork(work)
    assert handle.wait(5.0) and work.waits == [()], "a device wait must not pass a timeout (that blocks the CPU)"
    settled = StreamWork.settled([handle])
    start = time.monotonic()
    assert settled.wait(0.05) is False and time.monotonic() - start < 1.0
    work.completed = True
    assert settled.wait(0.05) is True


def _one_rank_hangs(rank):
    schedule.rendezvous("warm-up")
    if rank == 2:
        time.sleep(60)  # hung outside any collective
    schedule.rendezvous("after", "the hang")


@pytest.mark.slow
def test_a_timeout_names_the_rank_that_hung_and_launch_blames_it():
    """The waiting ranks' TimeoutError names the rank that never waited alongside, and RankError
    blames that rank (it blamed the first rank that waited)."""
    from hpf.launcher import RankError

    with pytest.raises(RankError) as info:
        launch(_one_rank_hangs, 3, collective_timeout=8, timeout=50)
    assert info.value.rank == 2
    assert "rank 2 hung" in str(info.value) and "rank 2 never waited alongside" in str(info.value)


def _catch_the_mismatch(rank):
    schedule.SUSPECT_S = 0.3
    if rank == 1:
        schedule._POLL_S = 2.0  # rank 0 (holding the TCPStore) finds the mismatch first, and returns
    got = _mismatched_ops(rank)[0]
    return got is not None and "ranks disagree" in got


@pytest.mark.slow
def test_a_caught_mismatch_is_the_named_error_on_the_slower_rank_too():
    """Ranks that catch ScheduleMismatchError and return: rank 0, whose process holds the store
    (torchrun's, or master_port's TCPStore), used to exit before the slower rank read the report,
    which then got gloo's 'connection closed'. shutdown() now lingers until every rank raised it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert launch(_catch_the_mismatch, 2, master_port=port, timeout=60) == [True, True]
