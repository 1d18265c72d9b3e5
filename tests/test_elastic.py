"""hpf.elastic: a rank SIGKILLed mid-run is survived on the ranks left (and a replacement joins back),
with the final params bit for bit those of a run that never failed (invariant mode: the same bits at
any world size, so the reference is one process)."""
from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

import hpf
from hpf.elastic import copies, job as elastic_job
from hpf.launcher import launch
from hpf.models import gpt

CFG = gpt.CONFIGS["tiny"]
STEPS, BATCH = 6, 12  # 12 rows: worlds 4 and 3 both split it


def make_step(n):
    return hpf.shard_step(gpt.loss_for(CFG), mesh=hpf.Mesh({"dp": n}), optimizer=hpf.optim.adamw(lr=3e-3, weight_decay=0.1),
                          invariant=True, atom_size=1, max_grad_norm=1.0)


def batches(t, rank, n):
    rows = BATCH // n
    return gpt.global_batch(CFG, BATCH, 0, t)[rank * rows:(rank + 1) * rows]


def _full(step, state):
    return [x.clone() for x in hpf.tree.flatten(step.full_params(state))[1]]


@functools.cache
def reference():
    """One process, no fault: the trajectory every elastic run must reproduce exactly."""
    with make_step(1) as step:
        state = step.init(functools.partial(gpt.init, CFG), key=hpf.random.key(0))
        for t in range(STEPS):
            state, _ = step(state, batches(t, 0, 1))
        return _full(step, state)


def _elastic_rank(rank, kill, fail, rejoin_wait=0.0):
    torch.set_num_threads(1)

    def on_step(t, m):
        if (rank, t) == kill or (isinstance(kill, list) and [rank, t] in kill):
            os.kill(os.getpid(), signal.SIGKILL)
        if (rank, t) == fail:
            raise ValueError("a bug in the program on one rank")
    run = hpf.elastic.train(make_step, functools.partial(gpt.init, CFG), batches, STEPS, key=hpf.random.key(0),
                            on_step=on_step, rejoin_wait=rejoin_wait)
    full = _full(run.step, run.state)
    run.step.close()
    return full, run.events, hpf.launch.world_size()


@pytest.mark.slow
@settings(max_examples=3, deadline=None, derandomize=True)
@given(rank=st.integers(0, 3), at=st.integers(1, STEPS - 1), replace=st.booleans())
def test_a_killed_rank_is_survived_and_the_params_equal_a_run_that_never_failed(rank, at, replace):
    """With a replacement the boundary after the loss waits for it (rejoin_wait), so it joins even in
    the last step; without one that wait ends unanswered and the job goes on on 3 ranks."""
    results = launch(_elastic_rank, 4, (rank, at), None, 60.0 if replace else 0.5, timeout=90, elastic=True,
                     replacements=int(replace))
    assert results[rank] is None  # the killed one
    finished = [r for r in results if r is not None]
    assert len(finished) == (4 if replace else 3)
    for full, events, world in finished:
        assert world == len(finished)
        assert all(torch.equal(a, b) for a, b in zip(full, reference())), "params differ from the fault-free run"
    events = finished[0][1]
    assert events[0]["event"] == "lost" and events[0]["ranks"] == [rank]
    assert at - events[0]["back_to"] <= 1  # only the step in flight (or its unprotected boundary) is redone
    assert events[0]["seconds"] < 30


def _dies_in_the_rebuild(rank):
    """Rank 2 is killed after step 2; rank 1 dies once the rebuild after it has begun."""
    if rank == 1:
        elastic_job.Job._usable_boundary = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    return _elastic_rank(rank, (2, 2), None)


@pytest.mark.slow
def test_a_rank_lost_during_the_rebuild_is_named_not_hung():
    started = time.monotonic()
    with pytest.raises(hpf.launch.RankError, match=r"while rebuilding after losing rank\(s\) \[2\].*rank\(s\) \[1\] "
                                                   r"went silent during the rebuild"):
        launch(_dies_in_the_rebuild, 4, timeout=90, elastic=True)
    assert time.monotonic() - started < 60


def make_hsdp_step(n):
    """HSDP on 2 machines where the world splits in two (each rank's state lives on its replica peer),
    else FSDP over all: the copies go to buddies only then."""
    mesh = hpf.Mesh({"node": 2, "local": n // 2}, fast_axes=["local"]) if n % 2 == 0 else hpf.Mesh({"dp": n})
    return hpf.shard_step(gpt.loss_for(CFG), mesh=mesh, optimizer=hpf.optim.adamw(lr=3e-3, weight_decay=0.1),
                          invariant=True, atom_size=1, max_grad_norm=1.0, hsdp=n % 2 == 0)


def _hsdp_rank(rank, kill):
    torch.set_num_threads(1)

    def on_step(t, m):
        if (rank, t) == kill:
            os.kill(os.getpid(), signal.SIGKILL)
    run = hpf.elastic.train(make_hsdp_step, functools.partial(gpt.init, CFG), batches, STEPS, key=hpf.random.key(0),
                            on_step=on_step)
    full = _full(run.step, run.state)
    run.step.close()
    return full, run.events, run.copy_bytes, copies.Copy.of(run.state).buf.numel()


@pytest.mark.slow
@settings(max_examples=2, deadline=None, derandomize=True)
@given(rank=st.integers(0, 3), at=st.integers(1, STEPS - 1))
def test_under_hsdp_the_replicas_are_the_copies_and_a_lost_rank_is_rebuilt_from_them(rank, at):
    """Nothing is sent while the world is HSDP: a rank's copies are its own two last boundaries (its
    replica peer's are the same bits), and a lost rank's shards are rebuilt from its replica's."""
    results = launch(_hsdp_rank, 4, (rank, at), timeout=90, elastic=True, replacements=1)
    finished = [r for r in results if r is not None]
    assert len(finished) == 4
    for full, events, _, _ in finished:
        assert all(torch.equal(a, b) for a, b in zip(full, reference())), "params differ from the fault-free run"
        assert [e["event"] for e in events[-1:]] == ["joined"]
    assert finished[0][1][0]["event"] == "lost" and finished[0][1][0]["ranks"] == [rank]


@pytest.mark.slow
def test_under_hsdp_a_rank_holds_two_boundaries_of_its_own_state_and_nothing_else():
    for full, events, copy_bytes, own in launch(_hsdp_rank, 4, None, timeout=90, elastic=True):
        assert not events and all(torch.equal(a, b) for a, b in zip(full, reference()))
        assert copy_bytes == 2 * own


def _dies_in_the_copy(rank, where, at, shared):
    """Rank 1 is killed at boundary ``at``: before it sends its copy, or once it has sent it and waits
    for the others' (the copy of ``at`` is then whole for its loss, and no step is redone)."""
    copies.SHARED_MEMORY = shared
    if rank == 1 and where == "before the copy":
        swap, calls = elastic_job.swap, []

        def _swap(*args):
            calls.append(1)
            return os.kill(os.getpid(), signal.SIGKILL) if len(calls) == at + 1 else swap(*args)
        elastic_job.swap = _swap
    if rank == 1 and where == "after the copy":
        copied = elastic_job.copied
        elastic_job.copied = lambda job, t: os.kill(os.getpid(), signal.SIGKILL) if t == at else copied(job, t)
    return _elastic_rank(rank, None, None)


@pytest.mark.slow
@pytest.mark.parametrize("shared", [True, False], ids=["shared memory", "process group"])
@pytest.mark.parametrize("where", ["before the copy", "after the copy"])
@settings(max_examples=1, deadline=None)
@given(at=st.integers(1, STEPS - 1))
def test_a_rank_lost_while_a_boundary_is_copied_is_survived(where, shared, at):
    results = launch(_dies_in_the_copy, 4, where, at, shared, timeout=90, elastic=True)
    assert results[1] is None
    for full, events, world in [r for r in results if r is not None]:
        assert world == 3 and all(torch.equal(a, b) for a, b in zip(full, reference())), "params differ"
        assert events[0]["event"] == "lost" and events[0]["ranks"] == [1]
        assert events[0]["back_to"] == (at - 1 if where == "before the copy" else at)


def _copies_held(rank, shared):
    torch.set_num_threads(1)
    copies.SHARED_MEMORY = shared
    run = hpf.elastic.train(make_step, functools.partial(gpt.init, CFG), batches, STEPS, key=hpf.random.key(0))
    run.step.close()
    return run.copy_bytes, copies.Copy.layout(run.state)[1]


@pytest.mark.slow
@pytest.mark.parametrize("shared", [True, False], ids=["shared memory", "process group"])
def test_on_a_flat_mesh_a_rank_holds_its_own_state_and_two_of_its_partners(shared):
    """Its own copy and its partner's of the last boundary, and the buffer the next partner's copy
    lands in (while it lands, the boundary before is still whole). In shared memory only the two
    rows its partner writes, of one size for all with a cache line of header each: its own copy is
    the row it wrote into its buddy's."""
    held = launch(_copies_held, 4, shared, timeout=90, elastic=True)
    row = 64 + -(-max(own for _, own in held) // 64) * 64
    for i, (copy_bytes, own) in enumerate(held):
        assert copy_bytes == (2 * row if shared else own + 2 * held[(i - 1) % 4][1])


@pytest.mark.slow
def test_an_error_of_the_program_is_raised_not_survived():
    with pytest.raises(hpf.launch.RankError, match="a bug in the program on one rank"):
        launch(_elastic_rank, 2, None, (1, 2), timeout=120, elastic=True)


@pytest.mark.slow
def test_a_rank_lost_with_its_buddy_is_named_not_survived():
    """Rank 2's copies live on rank 3 (the next along the ring): losing both loses rank 2's shards."""
    with pytest.raises(hpf.launch.RankError, match=r"rank 2 was lost with rank 3, which held its copy"):
        launch(_elastic_rank, 4, [[2, 2], [3, 2]], None, timeout=90, elastic=True)


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(0, 5), max_size=3), max_size=5),
       dtypes=st.lists(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float64]), min_size=5,
                       max_size=5))
def test_a_copy_unpacks_to_the_same_bits(shapes, dtypes):
    state = [torch.randn(s).to(d) if d.is_floating_point else torch.randint(0, 100, s, dtype=d)
             for s, d in zip(shapes, dtypes)]
    back = copies.Copy.of(state).unpack(state)
    assert all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(state, back))


def test_replacements_need_an_elastic_launch():
    with pytest.raises(ValueError, match="needs elastic=True"):
        launch(_elastic_rank, 2, None, None, replacements=1)


def test_the_heartbeat_beats_while_the_shared_store_is_blocked(monkeypatch):
    """A rendezvous blocks in the store's get until its peers arrive; the beats go on meanwhile, from a
    connection of their own, or a live rank would be counted lost by its peers."""
    import datetime
    import threading
    import time

    import torch.distributed as dist
    from hpf import launcher
    from hpf.comm import liveness

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=3))
    monkeypatch.setenv("HPF_ELASTIC_STORE", f"127.0.0.1:{server.port}")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setitem(launcher.group._ELASTIC, "base", None)
    job = elastic_job.Job(None, None, None, 1, None, None)
    job.members = [0]
    job._beat()
    try:
        blocked = threading.Thread(target=job.store.get, args=("a key set later",))
        blocked.start()
        time.sleep(0.2)
        before = int(server.add("hpf/elastic/beat/0", 0))
        time.sleep(2.0)
        beats = int(server.add("hpf/elastic/beat/0", 0)) - before
        server.set("a key set later", "1")
        blocked.join()
        assert beats >= 4, "the heartbeat stalled behind a blocked get"
    finally:
        job.heartbeat.stop()
        liveness.watch(None)


def _slow_receiver(rank):
    import time

    from hpf.comm import world
    from hpf.comm.transport import PointToPoint

    x = torch.arange(1 << 16, dtype=torch.float32) if rank == 0 else torch.empty(1 << 16)
    if rank == 1:
        time.sleep(1.0)  # the peer is late: every one of rank 0's polls below times out first
    requests = PointToPoint(world.exchange([(1, x, 7)], []) if rank == 0 else world.exchange([], [(0, x, 7)]))
    polls = 1
    while not requests.wait(0.05):
        polls += 1
    return polls, torch.equal(x, torch.arange(1 << 16, dtype=torch.float32))


@pytest.mark.slow
def test_point_to_point_requests_survive_timed_waits_that_time_out():
    """gloo completes a send or receive whose timed wait times out with that error; the elastic
    copies poll theirs (to check heartbeats meanwhile), so a slow peer must not lose the transfer."""
    (polls, sent), (_, received) = launch(_slow_receiver, 2, timeout=60)
    assert polls > 5 and received


def _rank_pids(driver: int) -> dict[int, int]:
    """rank -> pid of the ranks an hpf train driver forked (hpf.launch names them hpf-rank<r>)."""
    from pathlib import Path

    kids = [int(x) for x in Path(f"/proc/{driver}/task/{driver}/children").read_text().split()]
    names = {k: Path(f"/proc/{k}/comm").read_text().strip() for k in kids}
    return {int(n.removeprefix("hpf-rank")): k for k, n in names.items() if n.startswith("hpf-rank")}


CLI_STEPS = 40


def _train_command(out, world, *flags) -> list[str]:
    return [sys.executable, "-m", "hpf", "train", "--world-size", str(world), "--batch-size", "6", "--steps", str(CLI_STEPS),
            "--invariant", "--out", str(out), *flags]


def _wait_for_steps(out, n: int) -> None:
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= n) and time.monotonic() < deadline:
        time.sleep(0.01)


SAVE_EVERY = CLI_STEPS // 4


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The same job on one rank, never failing, saved every SAVE_EVERY steps: what every elastic run must equal."""
    out = tmp_path_factory.mktemp("one")
    reference = subprocess.run(_train_command(out, 1, "--atom-size", "1", "--save-every", str(SAVE_EVERY), "--keep-last", "4"),
                               capture_output=True, text=True, timeout=120)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    return out


@pytest.fixture(scope="module")
def one_rank_params(one_rank):
    return _final_params(one_rank)


def _final_params(out, step: int = CLI_STEPS) -> list[torch.Tensor]:
    from hpf import checkpoint

    return hpf.tree.flatten(checkpoint.load_params(out / "checkpoints" / f"step_{step:06d}"))[1]


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="finds the rank processes through Linux's /proc")
def test_hpf_train_elastic_survives_a_rank_killed_from_outside_with_the_bits_of_a_run_that_never_failed(
        tmp_path, one_rank):
    """... and --save-every saves the checkpoints of the steps after the loss too, on the ranks left."""
    proc = subprocess.Popen(_train_command(tmp_path, 3, "--elastic", "--save-every", str(SAVE_EVERY), "--keep-last", "4"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for_steps(tmp_path, 3)
    os.kill(_rank_pids(proc.pid)[2], signal.SIGKILL)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert "elastic: rank 2 lost" in out
    run = json.loads((tmp_path / "run.json").read_text())
    assert [e["event"] for e in run["elastic"]["events"]] == ["lost"] and run["elastic"]["world_size"] == 2
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, CLI_STEPS + 1)) and lines[-1]["world_size"] == 2
    for saved in range(SAVE_EVERY, CLI_STEPS + 1, SAVE_EVERY):
        _assert_equal(_final_params(tmp_path, saved), _final_params(one_rank, saved))


@pytest.mark.slow
def test_hpf_train_elastic_resumes_its_checkpoint_to_the_bits_of_a_run_that_never_stopped(tmp_path, one_rank_params):
    """What a loss it cannot survive tells the user to do: --resume (the run stays elastic)."""
    half = subprocess.run(_train_command(tmp_path, 3, "--elastic", "--steps", str(CLI_STEPS // 2), "--save-every",
                                         str(SAVE_EVERY)), capture_output=True, text=True, timeout=120)
    assert half.returncode == 0, half.stdout + half.stderr
    rest = subprocess.run([sys.executable, "-m", "hpf", "train", "--out", str(tmp_path), "--resume", "--steps", str(CLI_STEPS)],
                          capture_output=True, text=True, timeout=120)
    assert rest.returncode == 0, rest.stdout + rest.stderr
    assert json.loads((tmp_path / "run.json").read_text())["elastic"]["world_size"] == 3
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, CLI_STEPS + 1))
    _assert_equal(_final_params(tmp_path), one_rank_params)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="finds the worker processes through Linux's /proc")
def test_under_torchrun_a_member_torchrun_restarts_is_survived_and_rejoins_with_the_same_bits(tmp_path, one_rank_params):
    """One torchrun per member around hpf store: the killed member's agent restarts its worker, which
    joins at a boundary (3 -> 2 -> 3 ranks; --rejoin-wait holds the boundary after the loss for it, so
    a restart slowed by load still joins before the end); every torchrun exits 0 and the params equal one rank's."""
    store = subprocess.Popen([sys.executable, "-m", "hpf", "store", "--port", "0"], stdout=subprocess.PIPE, text=True)
    port = re.search(r":(\d+);", store.stdout.readline()).group(1)
    env = {**os.environ, "HPF_ELASTIC_STORE": f"127.0.0.1:{port}"}
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
                                "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
                                "--rdzv-id", f"member{m}", "-m", "hpf",
                                *_train_command(tmp_path, 3, "--elastic", "--rejoin-wait", "120")[3:]],
                               env={**env, "HPF_ELASTIC_MEMBER": str(m)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for m in range(3)]
    try:
        _wait_for_steps(tmp_path, 3)
        agent = agents[2].pid
        os.kill(int(Path(f"/proc/{agent}/task/{agent}/children").read_text().split()[0]), signal.SIGKILL)
        outs = [a.communicate(timeout=180)[0] for a in agents]
        assert [a.returncode for a in agents] == [0, 0, 0], outs
        assert store.wait(timeout=30) == 0
    finally:
        for p in (*agents, store):
            p.kill()
    assert "elastic: rank 2 lost" in outs[0] and "elastic: rank 5 joined" in outs[0], outs[0]
    run = json.loads((tmp_path / "run.json").read_text())
    assert [e["event"] for e in run["elastic"]["events"]] == ["lost", "joined"] and run["elastic"]["world_size"] == 3
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, CLI_STEPS + 1))
    _assert_equal(_final_params(tmp_path), one_rank_params)


@pytest.mark.parametrize("env, flags, says", [
    ({}, ["--world-size", "3"], "--elastic under torchrun: run each member under a torchrun of its own"),
    ({"HPF_ELASTIC_STORE": "127.0.0.1:1", "HPF_ELASTIC_MEMBER": "0"}, [], "needs --world-size N"),
    ({"HPF_ELASTIC_STORE": "127.0.0.1:1", "HPF_ELASTIC_MEMBER": "3"}, ["--world-size", "3"],
     "HPF_ELASTIC_MEMBER='3' of HPF_ELASTIC_WORLD_SIZE='3'"),
    ({"HPF_ELASTIC_STORE": "127.0.0.1:1", "HPF_ELASTIC_MEMBER": "0"}, ["--world-size", "3", "--replacements", "1"],
     "--replacements is torchrun's --max-restarts"),
], ids=["no-store", "no-world-size", "member", "replacements"])
def test_hpf_train_elastic_under_torchrun_names_what_a_member_lacks(tmp_path, capsys, monkeypatch, env, flags, says):
    from hpf.cli import main

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", **env}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HPF_ELASTIC_WORLD_SIZE", "")  # (recorded, so that what main sets is undone)
    monkeypatch.delenv("HPF_ELASTIC_WORLD_SIZE")
    assert main(["train", "--elastic", "--steps", "2", "--batch-size", "6", "--out", str(tmp_path / "run"), *flags]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    (["--world-size", "4", "--batch-size", "16"], "--batch-size 16 must split over 4 ranks and, after a loss, over 3"),
    (["--mesh", "dp=2,tp=2", "--batch-size", "12"], "--elastic shrinks one data axis"),
    (["--world-size", "4", "--batch-size", "12", "--timeout", "60"], "--elastic does not take --timeout"),
    (["--world-size", "4", "--batch-size", "12", "--accumulate", "2"], "--elastic does not take --accumulate"),
    (["--world-size", "4", "--batch-size", "12", "--model", "moe"], "--model moe keeps loop state"),
    (["--world-size", "3", "--batch-size", "6", "--hsdp"], "--elastic --hsdp runs two replicas"),
], ids=["batch", "tp", "timeout", "accumulate", "moe", "hsdp-odd"])
def test_hpf_train_elastic_refuses_what_it_cannot_survive_before_any_rank_starts(tmp_path, capsys, flags, says):
    from hpf.cli import main

    assert main(["train", "--elastic", "--steps", "2", "--out", str(tmp_path / "run"), *flags]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("flag", [["--replacements", "1"], ["--rejoin-wait", "5"]], ids=["replacements", "rejoin-wait"])
def test_an_elastic_option_without_elastic_is_refused_not_ignored(tmp_path, capsys, flag):
    from hpf.cli import main

    assert main(["train", "--steps", "2", "--out", str(tmp_path / "run"), *flag]) == 2
    assert f"{flag[0]} is an option of --elastic runs" in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
