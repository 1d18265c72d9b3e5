"""A checkpoint, a store value, a socket are data and endpoints, never code: crafted payloads
that would write a marker file are refused with an error naming the file, and the marker is
never written (each of these ran on hpf before 0.37's reading-as-data changes)."""
import json
import os
import pickle
import time
import zlib

import pytest
import torch
import torch.distributed as dist

import hpf
from hpf import checkpoint as ck
from hpf.comm import schedule, world
from hpf.launcher import launch
from hpf.models import gpt

CFG = gpt.CONFIGS["tiny"]


class Payload:
    """Unpickling it opens ``marker`` for writing (creating it): the code a crafted file runs."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _saved(tmp_path, extra=None):
    step = hpf.shard_step(gpt.loss_for(CFG), mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw(lr=1e-2))
    state = step.init(gpt.init(CFG))
    step.save(state, tmp_path / "step_1", extra=extra)
    return step, tmp_path / "step_1"


def _rewrite(path, name, data: bytes):
    """Replace a file of a checkpoint and update its manifest entry, as an attacker can."""
    (path / name).write_bytes(data)
    header = json.loads((path / "hpf.json").read_text())
    if "files" in header:  # (an hpf without checksums has no manifest)
        header["files"][name] = [len(data), zlib.crc32(data)]
        (path / "hpf.json").write_text(json.dumps(ck.seal(header)))


def test_a_crafted_metadata_pickle_never_runs(tmp_path):
    step, path = _saved(tmp_path)
    marker = tmp_path / "ran"
    _rewrite(path, ".metadata", pickle.dumps(Payload(marker)))
    with pytest.raises(ck.CheckpointError, match=r"\.metadata.*not DCP metadata.*never code"):
        ck.load_params(path)
    with pytest.raises(ck.CheckpointError, match=r"\.metadata"):
        step.restore(path)
    assert not marker.exists()


def test_a_crafted_extra_never_runs_and_is_named(tmp_path, monkeypatch):
    with pytest.raises(ck.CheckpointError, match="extra: .*weights_only"):  # refused at the save
        _saved(tmp_path / "a", extra={"arr": Payload(tmp_path / "never")})
    monkeypatch.setattr(ck, "not_data", lambda extra: None)  # a crafted checkpoint skips that check
    marker = tmp_path / "ran"
    step, path = _saved(tmp_path, extra={"step": 1, "x": Payload(marker)})
    monkeypatch.undo()
    assert not marker.exists()
    with pytest.raises(ck.CheckpointError, match=r"__0_0\.distcp: key 'extra' is not plain data"):
        step.restore(path)
    assert not marker.exists()


def _store_payload(rank, marker):
    schedule.SUSPECT_S = 0.3  # rank 0 publishes its log and compares soon
    schedule.rendezvous("warm-up")
    x = torch.ones(2)
    schedule.LOG.record("all-reduce", "x")
    if rank == 1:  # another process that reaches the store writes under a rank's key
        time.sleep(1.0)
        store = world.store()
        store.set("hpf/schedule/1", pickle.dumps({"rank": 1, "events": [], "failed": None, "p": Payload(marker)}))
        store.add("hpf/schedule/waiting", 1)  # so rank 0 reads every log now
        time.sleep(1.0)
        store.add("hpf/schedule/waiting", -1)
    schedule.wait(dist.all_reduce(x, async_op=True))
    return x.tolist()


@pytest.mark.slow
def test_a_crafted_store_value_never_runs(tmp_path):
    marker = tmp_path / "ran"
    assert launch(_store_payload, 2, str(marker), timeout=60) == [[2.0, 2.0]] * 2
    assert not marker.exists()


def _sockets(rank):
    """This rank's TCP sockets' local addresses (hex, as /proc/net/tcp writes them)."""
    dist.all_reduce(torch.ones(1))
    inodes = {os.readlink(f"/proc/self/fd/{fd}")[8:-1] for fd in os.listdir("/proc/self/fd")
              if os.path.exists(f"/proc/self/fd/{fd}") and os.readlink(f"/proc/self/fd/{fd}").startswith("socket:[")}
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                found.append(fields[1].rsplit(":", 1)[0])
    return os.environ.get("GLOO_SOCKET_IFNAME"), found


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc socket tables")
def test_launch_binds_the_ranks_sockets_to_loopback():
    for ifname, addresses in launch(_sockets, 2, timeout=60):
        assert ifname in ("lo", "lo0")  # set by launch, whatever the hostname resolves to
        assert addresses and set(addresses) <= {"0100007F", "00000000000000000000000001000000"}, addresses
