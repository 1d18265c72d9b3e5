"""A checkpoint, a store value, a socket are data and endpoints, never code: crafted payloads
that would write a marker file are refused with an error naming the file, and the marker is
never written (each of these ran on hpf before 0.37's reading-as-data changes)."""
import json
import os
import pickle
import time
import zlib

import numpy as np
import optree
import pytest
import torch
import torch.distributed as dist

import hpf
from hpf import checkpoint as ck
from hpf.checkpoint import saving
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
        header["files"][name] = [len(data), {"0": zlib.crc32(data)}]  # (the whole file: one CRC at offset 0)
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
    monkeypatch.setattr(saving, "not_data", lambda extra: None)  # a crafted checkpoint skips that check
    marker = tmp_path / "ran"
    step, path = _saved(tmp_path, extra={"step": 1, "x": Payload(marker)})
    monkeypatch.undo()
    assert not marker.exists()
    with pytest.raises(ck.CheckpointError, match=r"__0_0\.distcp: key 'extra' is not plain data"):
        step.restore(path)
    assert not marker.exists()


def _store_payload(rank, marker, deep):
    schedule.SUSPECT_S = 0.3  # rank 0 publishes its log and compares soon
    schedule.rendezvous("warm-up")
    x = torch.ones(2)
    schedule.LOG.record("all-reduce", "x")
    if rank == 1:  # another process that reaches the store writes under a rank's key
        time.sleep(1.0)
        store = world.store()
        store.set("hpf/schedule/1", b"[" * 100000 if deep else
                  pickle.dumps({"rank": 1, "events": [], "failed": None, "p": Payload(marker)}))
        store.add("hpf/schedule/waiting", 1)  # so rank 0 reads every log now
        time.sleep(1.0)
        store.add("hpf/schedule/waiting", -1)
    schedule.wait(dist.all_reduce(x, async_op=True))
    return x.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("deep", [False, True], ids=["pickle", "nested-100000-deep"])
def test_a_crafted_store_value_never_runs_and_is_a_named_error(tmp_path, deep):
    """Issue 45 item 3: '[' * 100000 ended the waiting rank with an uncaught RecursionError; a
    pickle was skipped without a word. Either is now an error naming the key and the rank."""
    marker = tmp_path / "ran"
    with pytest.raises(schedule.StoreValueError, match=r"key hpf/schedule/1 \(rank 1's schedule log\) holds a "
                                                       r"value hpf rank 1 did not write \((ValueError|"
                                                       r"UnicodeDecodeError).*private store") as info:
        launch(_store_payload, 2, str(marker), deep, timeout=60)
    assert info.value.rank == 0 and ("nested 100000 deep" in str(info.value)) == deep
    assert not marker.exists()


def test_store_values_are_bounded_before_they_are_parsed(monkeypatch):
    monkeypatch.setattr(schedule.LOG, "broken", None)  # (restored: a bad value marks the log broken)
    good = json.dumps({"rank": 1, "events": [[1, 0, "read", 'blocks/"0\\[', 1]] * 2048, "failed": "x[[["}).encode()
    assert schedule._read_logs([good.replace(b'"rank": 1', b'"rank": 0'), good])[1]["events"][0][3] == 'blocks/"0\\['
    for bad, says in [(b"[" * 100000, "nested 100000 deep"), (b'["\\\\"' + b"[" * 100000, "nested 100001 deep"),
                      (b" " * (5 << 20), "5242880 bytes"), (b'{"rank": 0}', "KeyError"), (good, "not a schedule log")]:
        with pytest.raises(schedule.StoreValueError, match=rf"key hpf/schedule/0 \(rank 0's .*{says}"):
            schedule._read_logs([bad])


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


# -- issue 45 items 1 and 2: numpy dtypes that hold pointers; files outside the checkpoint -------------
_NP_CORE = getattr(np, "_core", None) or np.core


class ObjectDtype:
    """Pickles as ``np.dtype("O8")`` with no state (none is needed to build it)."""

    def __reduce__(self):
        return np.dtype, ("O8", False, True)


class PointerDtype:
    """Pickles as a void dtype with one object field whose flags say it holds no objects (0)."""

    def __reduce__(self):
        return np.dtype, ("V8", False, True), (3, "|", None, ("a",), {"a": (ObjectDtype(), 0)}, 8, 1, 0)


class RawArray:
    """Pickles as a numpy array of ``dtype`` built from ``data`` (bytes, or a list for an object dtype)."""

    def __init__(self, dtype, data):
        self.dtype, self.data = dtype, data

    def __reduce__(self):
        n = len(self.data) if isinstance(self.data, list) else 1
        return _NP_CORE.multiarray._reconstruct, (np.ndarray, (0,), b"b"), (1, (n,), self.dtype, False, self.data)


@pytest.mark.parametrize("what, array", [
    ("void dtype with an object field flagged as none", RawArray(PointerDtype(), b"\x41" * 8)),  # 8 bytes: a pointer
    ("object dtype", RawArray(ObjectDtype(), [1, 2]))])
def test_a_numpy_array_whose_bytes_may_be_pointers_is_refused_in_extra_even_resealed(tmp_path, monkeypatch, what,
                                                                                       array):
    """Item 1: such an array restored, then np.random.set_state (or repr) followed its bytes: SIGSEGV."""
    with pytest.raises(ck.CheckpointError, match="extra"):  # refused at the save
        _saved(tmp_path / "a", extra={"rng": array})
    monkeypatch.setattr(saving, "not_data", lambda extra: None)  # a crafted checkpoint skips that check
    step, path = _saved(tmp_path, extra={"step": 1, "rng": {"numpy": array}})
    monkeypatch.undo()  # (its manifest is sealed over the crafted bytes, as anyone can seal one)
    with pytest.raises(ck.CheckpointError, match=r"__0_0\.distcp: key 'extra' is not plain data .*(VoidDType|"
                                                 r"extra\['rng'\]\['numpy'\] is a numpy ndarray of dtype '\|O')"):
        step.restore(path)


def test_plain_numpy_values_in_extra_still_restore(tmp_path):
    extra = {"rng": ck.rng_state(), "f": np.float32(1.5), "s": np.array(["ab"]), "t": np.datetime64("2026-12-01")}
    step, path = _saved(tmp_path, extra=extra)
    got = step.restore(path)[1]
    assert np.array_equal(got["rng"]["numpy"][1], extra["rng"]["numpy"][1]) and got["f"] == np.float32(1.5)
    assert got["s"][0] == "ab" and got["t"] == extra["t"]


@pytest.mark.parametrize("where", ["../../other/step_1/__0_0.distcp", "{other}/step_1/__0_0.distcp"])
def test_metadata_naming_a_file_outside_the_checkpoint_is_refused_even_when_listed(tmp_path, where):
    """Item 2: a storage path such as ../other/__0_0.distcp (or an absolute one) loaded another
    checkpoint's tensors once the manifest listed it."""
    step, path = _saved(tmp_path / "mine")
    other = tmp_path / "other"
    step.save(step.init(optree.tree_map(lambda t: t + 1, gpt.init(CFG))), other / "step_1")
    where = where.format(other=other)
    metadata = pickle.loads((path / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = where
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    header = json.loads((path / "hpf.json").read_text())
    header["files"][where] = json.loads((other / "step_1" / "hpf.json").read_text())["files"]["__0_0.distcp"]
    header["files"].update(ck.sums(path, [".metadata"]))
    (path / "hpf.json").write_text(json.dumps(ck.seal(header)))  # listed, checksummed and sealed
    assert (path / where).is_file()  # (the path leads to the other checkpoint's file)
    for load in (step.restore, ck.load_params):
        with pytest.raises(ck.CheckpointError, match=r"names the file .*not in the checkpoint's folder"):
            load(path)
