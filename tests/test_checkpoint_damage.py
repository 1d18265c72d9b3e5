"""Damaged and crafted checkpoints (issue 55 items 9, 11, 18) and the differential fuzzer that
keeps them so: random damage to every field of every file of a checkpoint (a file removed or
truncated, a JSON field removed, retyped or truncated, a chunk dropped from ``.metadata``, a
size, dtype, offset or length changed), the CRCs re-sealed where the damage is structural so the
checks behind them are reached. Each load ends in a CheckpointError with the state as it was
before the call, or in an exact restore (every param and optimizer tensor bitwise as saved).

Re-sealed edits that are indistinguishable from another genuine checkpoint (a tensor's bytes
changed and their CRC recomputed, two chunks' storage swapped) are not generated: a seal anyone
can recompute proves no origin (hpf.checkpoint_files)."""
from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import random
import shutil
from pathlib import Path

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

import hpf
from hpf import checkpoint as ck
from hpf.checkpoint_files import seal, sums
from hpf.launcher import launch


FUZZ_EMPTY = True  # the fuzzed model has a zero-size leaf (item 11; False to see what else it finds without it)


def _params(empty=True):
    g = torch.Generator().manual_seed(0)
    return {"emb": torch.randn(7, 6, generator=g), "blocks": [{"w": torch.randn(6, 6, generator=g),
                                                              "b": torch.randn(6, generator=g)} for _ in range(2)],
            "gain": torch.randn((), generator=g), **({"empty": torch.zeros(0, 4)} if empty else {})}


def _loss(p, batch):
    x = batch @ p["emb"].T
    for blk in p["blocks"]:
        x = torch.tanh(x[:, :6] @ blk["w"] + blk["b"])
    return (x * p["gain"]).square().mean() + (p["empty"].sum() if "empty" in p else 0)


def _step(world=1):
    return hpf.shard_step(_loss, mesh=hpf.Mesh({"dp": world}), optimizer=hpf.optim.adamw(lr=1e-2))


def _batch(rank, world):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    return x[rank * 4 // world:(rank + 1) * 4 // world]


def _save(rank, path, world, empty):
    step = _step(world)
    state = step.init(_params(empty))
    state, _ = step(state, _batch(rank, world))
    step.save(state, path, extra={"step": 1})
    step.close()


def _snapshot(state) -> list[torch.Tensor]:
    return [t.clone() for t in optree.tree_leaves(state) if isinstance(t, torch.Tensor)]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def reseal(path: Path, data_files=()) -> None:
    """Recompute hpf.json's checksums of ``.metadata`` (and ``data_files``, against the current
    ``.metadata``) and its own seal: the edit passes the CRCs and reaches the checks behind them."""
    header = json.loads((path / "hpf.json").read_text())
    header["files"].update(sums(path, [".metadata"]))
    if data_files:
        metadata = pickle.loads((path / ".metadata").read_bytes())
        header["files"].update(sums(path, list(data_files), metadata))
    (path / "hpf.json").write_text(json.dumps(seal(header)))


# -- the damage -----------------------------------------------------------------------------------
_OTHER_TYPES = [None, True, 3, -1, 10 ** 13, 2.5, "x", "torch.zeros", [], [10 ** 13], {}, {"a": 1}]


def _slots(node, out, top=True):
    """(container, key) of every value in a JSON document (the seal itself excluded)."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in list(items):
        if not (top and k == "crc32"):
            out.append((node, k))
            _slots(v, out, False)
    return out


def damage_header(path: Path, rng: random.Random) -> str:
    header = json.loads((path / "hpf.json").read_text())
    node, k = rng.choice(_slots(header, []))
    v, op = node[k], rng.choice(["remove", "retype", "truncate"])
    if op == "remove":
        del node[k]
    elif op == "retype":
        node[k] = rng.choice([t for t in _OTHER_TYPES if type(t) is not type(v)])
    elif isinstance(v, (str, list)):
        node[k] = v[:rng.randrange(len(v))] if v else v
    elif isinstance(v, dict):
        node[k] = dict(list(v.items())[:rng.randrange(len(v))] if v else [])
    elif isinstance(v, int) and not isinstance(v, bool):
        node[k] = v // rng.randint(2, 10)
    (path / "hpf.json").write_text(json.dumps(seal(header)))
    return f"hpf.json: {op} {k!r} ({str(v)[:40]})"


def damage_metadata(path: Path, rng: random.Random) -> str:
    md = pickle.loads((path / ".metadata").read_bytes())
    tensors = [k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")]
    key = rng.choice(tensors)
    saved = md.state_dict_metadata[key]
    storage = [i for i in md.storage_data if i.fqn == key] or list(md.storage_data)
    op = rng.choice(["drop chunk", "drop chunk and storage", "chunk offset", "chunk size", "key size", "dtype",
                     "remove key", "remove storage", "storage length", "storage offset", "storage file"])
    i = rng.randrange(len(saved.chunks))
    c = saved.chunks[i]

    def bumped(size):
        dims = list(size)
        if dims:
            d = rng.randrange(len(dims))
            dims[d] = max(0, dims[d] + rng.choice([-2, -1, 1, 3]))
        return torch.Size(dims)
    if op.startswith("drop chunk"):
        del saved.chunks[i]
        if op.endswith("storage"):
            md.storage_data = {s: v for s, v in md.storage_data.items() if not (s.fqn == key and tuple(s.offset) == tuple(c.offsets))}
    elif op == "chunk offset":
        saved.chunks[i] = ChunkStorageMetadata(bumped(c.offsets), c.sizes)
    elif op == "chunk size":
        saved.chunks[i] = ChunkStorageMetadata(c.offsets, bumped(c.sizes))
    elif op == "key size":
        saved.size = bumped(saved.size) if len(saved.size) else torch.Size([2])
    elif op == "dtype":
        saved.properties = dataclasses.replace(saved.properties, dtype=rng.choice([torch.float64, torch.int32, torch.bfloat16]))
    elif op == "remove key":
        del md.state_dict_metadata[key]
    else:
        s = rng.choice(storage)
        info = md.storage_data[s]
        if op == "remove storage":
            del md.storage_data[s]
        elif op == "storage length":
            md.storage_data[s] = dataclasses.replace(info, length=max(0, info.length + rng.choice([-500, -1, 1, 10 ** 9])))
        elif op == "storage offset":
            md.storage_data[s] = dataclasses.replace(info, offset=max(0, info.offset + rng.choice([-3, 1, 7, 10 ** 9])))
        else:
            md.storage_data[s] = dataclasses.replace(info, relative_path=rng.choice([".metadata", "hpf.json", "nope",
                                                                                    "../x", ""]))
    (path / ".metadata").write_bytes(pickle.dumps(md))
    reseal(path)
    return f".metadata: {op} of {key!r}"


def damage_bytes(path: Path, rng: random.Random) -> str:
    """Any file: removed, truncated (re-sealed or not), a byte flipped, a range dropped (not re-sealed)."""
    f = rng.choice(sorted(p for p in path.iterdir() if p.is_file()))
    data = f.read_bytes()
    op = rng.choice(["remove", "truncate", "truncate, re-sealed", "flip", "drop range"])
    at = rng.randrange(len(data)) if data else 0
    if op == "remove":
        f.unlink()
    elif op.startswith("truncate"):
        f.write_bytes(data[:at])
        if op.endswith("re-sealed") and f.suffix == ".distcp":
            reseal(path, [f.name])
    elif op == "flip" and data:
        f.write_bytes(data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1:])
    else:
        f.write_bytes(data[:at] + data[at + rng.randint(1, 64):])
    return f"{f.name}: {op} at {at}"


DAMAGES = [damage_header, damage_metadata, damage_bytes]


class Target:
    """A saved checkpoint, a step to restore it into, and what an exact restore gives."""

    def __init__(self, root: Path, world: int, empty: bool = FUZZ_EMPTY):
        self.good = root / "good"
        if world == 1:
            _save(0, self.good, 1, empty)
        else:
            launch(_save, world, self.good, world, empty)
        self.step = _step()
        self.state, self.extra = self.step.restore(self.good, self.step.init(_params(empty)))
        self.saved, self.params = _snapshot(self.state), ck.load_params(self.good)
        self.before = [torch.full_like(t, 7) if t.is_floating_point() else t + 5 for t in self.saved]
        self.root = root

    def trial(self, damage, seed: int) -> str:
        path = self.root / f"trial_{seed}"
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(self.good, path)
        what = damage(path, random.Random(seed))
        live = [t for t in optree.tree_leaves(self.state) if isinstance(t, torch.Tensor)]
        torch._foreach_copy_(live, self.before)
        try:
            _, extra = self.step.restore(path, self.state)
        except ck.CheckpointError as e:
            assert str(path) in str(e), (what, str(e))
            assert _same(_snapshot(self.state), self.before), f"{what}: a failed restore changed the state ({e})"
        else:
            assert _same(_snapshot(self.state), self.saved) and extra == self.extra, f"{what}: restored other values"
        try:
            params = ck.load_params(path)
        except ck.CheckpointError as e:
            assert str(path) in str(e), (what, str(e))
        else:
            assert _same(optree.tree_leaves(params), optree.tree_leaves(self.params)) and \
                optree.tree_structure(params) == optree.tree_structure(self.params), f"{what}: load_params: other values"
        shutil.rmtree(path)
        return what


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    target = Target(tmp_path_factory.mktemp("damage1"), 1)
    yield target
    target.step.close()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A checkpoint without a zero-size leaf: the items' cases, apart from item 11."""
    target = Target(tmp_path_factory.mktemp("plain"), 1, empty=False)
    yield target
    target.step.close()


@settings(max_examples=80, deadline=None, derandomize=True, database=None)
@given(damage=st.sampled_from(DAMAGES), seed=st.integers(0, 2 ** 31))
def test_checkpoint_damage_fuzz_one_rank(one_rank, damage, seed):
    one_rank.trial(damage, seed)


@pytest.mark.slow
def test_checkpoint_damage_fuzz_two_ranks(tmp_path):
    """The larger budget, on a checkpoint 2 ranks saved (several chunks per key)."""
    target = Target(tmp_path, 2)
    seen = set()

    @settings(max_examples=600, deadline=None, derandomize=True, database=None)
    @given(damage=st.sampled_from(DAMAGES), seed=st.integers(0, 2 ** 31))
    def fuzz(damage, seed):
        seen.add(target.trial(damage, seed).split(" at ")[0])
    try:
        fuzz()
    finally:
        target.step.close()
    assert len(seen) > 40, seen


def _restore_each(rank, good, paths):
    """On each launched rank: restore ``good``, then each damaged copy into a state of 7s: (error
    or not, the state unchanged after an error or exactly good's after a restore) per copy."""
    step = _step(2)
    state = step.init(_params(FUZZ_EMPTY))
    state, _ = step.restore(good, state)
    saved = _snapshot(state)
    live = [t for t in optree.tree_leaves(state) if isinstance(t, torch.Tensor)]
    before = [torch.full_like(t, 7) if t.is_floating_point() else t + 5 for t in saved]
    out = []
    for path in paths:
        torch._foreach_copy_(live, before)
        try:
            step.restore(path, state)
            out.append(("restored", _same(_snapshot(state), saved)))
        except ck.CheckpointError as e:
            out.append((str(e), _same(_snapshot(state), before)))
    step.close()
    return out


@pytest.mark.slow
def test_checkpoint_damage_fuzz_restored_on_two_ranks(tmp_path):
    """Damaged copies of a 2-rank checkpoint, each restored by 2 launched ranks: an error on
    every rank with every rank's state as it was, or an exact restore on every rank."""
    good = tmp_path / "good"
    launch(_save, 2, good, 2, FUZZ_EMPTY)
    rng, paths = random.Random(5), []
    for i in range(40):
        path = tmp_path / f"d{i}"
        shutil.copytree(good, path)
        DAMAGES[i % 3](path, random.Random(rng.randrange(2 ** 31)))
        paths.append(path)
    ranks = launch(_restore_each, 2, good, paths)
    for i, outcomes in enumerate(zip(*ranks)):
        kinds = {o[0] == "restored" for o in outcomes}
        assert len(kinds) == 1 and all(ok for _, ok in outcomes), (paths[i], outcomes)


# -- the items, one case each -------------------------------------------------------------------------
def _drop_chunk(path: Path, key: str, keep: int) -> None:
    md = pickle.loads((path / ".metadata").read_bytes())
    md.state_dict_metadata[key].chunks = md.state_dict_metadata[key].chunks[:keep]
    (path / ".metadata").write_bytes(pickle.dumps(md))
    reseal(path)


def test_a_key_without_its_chunk_is_refused_before_anything_changes(plain, tmp_path):
    """Item 9 (one rank): a key whose only chunk is dropped from .metadata (re-sealed) kept its
    pre-restore values, and load_params returned uninitialized memory."""
    path = tmp_path / "c"
    shutil.copytree(plain.good, path)
    _drop_chunk(path, "blocks.0.w", 0)
    live = [t for t in optree.tree_leaves(plain.state) if isinstance(t, torch.Tensor)]
    torch._foreach_copy_(live, plain.before)
    for load in (lambda: plain.step.restore(path, plain.state), lambda: ck.load_params(path)):
        with pytest.raises(ck.CheckpointError, match=r"'blocks\.0\.w'.*(no chunks|cover)"):
            load()
    assert _same(_snapshot(plain.state), plain.before)


@pytest.mark.slow
def test_a_checkpoint_that_covers_part_of_a_param_is_refused(tmp_path):
    """Item 9: 2 ranks saved; all but the first of a param's chunks dropped from .metadata (re-sealed)."""
    path = tmp_path / "c"
    launch(_save, 2, path, 2, False)
    md = pickle.loads((path / ".metadata").read_bytes())
    assert len(md.state_dict_metadata["emb"].chunks) > 1
    _drop_chunk(path, "emb", 1)
    step = _step()
    state = step.init(_params(False))
    before = _snapshot(state)
    with pytest.raises(ck.CheckpointError, match=r"'emb': its chunks in \.metadata cover 18 of its 42 elements"):
        step.restore(path, state)
    assert _same(_snapshot(state), before)
    with pytest.raises(ck.CheckpointError, match=r"'emb': its chunks .* cover 18 of its 42"):
        ck.load_params(path)
    step.close()


def _zero_size_init(key):
    return {"w": hpf.random.normal(key, (5, 3)), "z": torch.zeros(0, 3), "b": torch.zeros(3)}


@pytest.mark.parametrize("path", ["full params", "init_fn"])
def test_a_zero_size_leaf_round_trips(tmp_path, path):
    """Item 11: a zero-size leaf saved a checkpoint that could not be restored ("key 'z' is missing")."""
    loss = lambda p, b: (b @ p["w"] + p["b"]).square().sum() + p["z"].sum()  # noqa: E731
    step = hpf.shard_step(loss, mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw(lr=1e-2))
    key = hpf.random.key(0)
    state = step.init(_zero_size_init(key)) if path == "full params" else step.init(_zero_size_init, key=key)
    state, _ = step(state, torch.ones(2, 5))
    step.save(state, tmp_path / "c")
    full = step.full_params(state)
    again = hpf.shard_step(loss, mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw(lr=1e-2))
    restored, _ = again.restore(tmp_path / "c", again.init(_zero_size_init(key)))
    assert _same(_snapshot(restored), _snapshot(state))
    loaded = ck.load_params(tmp_path / "c")
    assert loaded["z"].shape == (0, 3) and _same(optree.tree_leaves(loaded), optree.tree_leaves(full))
    other = hpf.shard_step(loss, mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw(lr=1e-2))
    with pytest.raises(ck.CheckpointError, match=r"key 'z' has shape \(0, 3\) in the checkpoint, but this model's is \(0, 4\)"):
        other.restore(tmp_path / "c", other.init({**_zero_size_init(key), "z": torch.zeros(0, 4)}))
    for s in (step, again, other):
        s.close()


def _edit_header(path: Path, edit) -> None:
    header = json.loads((path / "hpf.json").read_text())
    edit(header)
    (path / "hpf.json").write_text(json.dumps(seal(header)))


@pytest.mark.parametrize("case,field", [
    ("no tree", "tree"), ("no tensors", "tensors"), ("a number leaf", "tree/emb"),
    ("a torch function dtype", "tensors/emb"), ("a huge shape", "emb"), ("no optimizer", "optimizer"),
    ("files retyped", "files/.metadata"),
])
def test_a_crafted_header_is_a_checkpoint_error_naming_file_and_field(plain, tmp_path, case, field, monkeypatch):
    """Item 18: valid JSON, CRC re-sealed: KeyError 'tree', a TypeError, or an attempt to allocate
    10**13 elements. Now a CheckpointError naming hpf.json (or the key) and the field, before any allocation."""
    path = tmp_path / "c"
    shutil.copytree(plain.good, path)
    edits = {"no tree": lambda h: h.pop("tree"), "no tensors": lambda h: h.pop("tensors"),
             "a number leaf": lambda h: h["tree"].update(emb=3),
             "a torch function dtype": lambda h: h["tensors"]["emb"].__setitem__(1, "torch.zeros"),
             "a huge shape": lambda h: h["tensors"]["emb"].__setitem__(0, [10 ** 7, 10 ** 6]),
             "no optimizer": lambda h: h.pop("optimizer"),
             "files retyped": lambda h: h["files"].__setitem__(".metadata", 5)}
    _edit_header(path, edits[case])
    allocations = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocations.append(a) or real_empty(*a, **k))
    if case == "a huge shape":  # only load_params reads the shapes: checked against .metadata and the file first
        with pytest.raises(ck.CheckpointError, match=r"'emb' has shape \(7, 6\) in the checkpoint.*\(10000000, 1000000\)"):
            ck.load_params(path)
        assert not any(10 ** 7 in (a[0] if a and isinstance(a[0], (list, tuple)) else a) for a in allocations)
        return
    for load in (ck.load_params, ck.meta, lambda p: plain.step.restore(p, plain.state)):
        with pytest.raises(ck.CheckpointError) as e:
            load(path)
        assert "hpf.json" in str(e.value) and f"field {field!r}" in str(e.value), str(e.value)


# -- item 10: keep_last ----------------------------------------------------------------------------
def test_keep_last_orders_the_series_by_the_step_the_run_is_at(tmp_path):
    """Item 10: a run resumed from step_4 (step_9 was bad) saved step_5 and step_6 with
    keep_last=1; save returned step_6's path, and the folder held only the abandoned step_9."""
    step = _step()
    state = step.init(_params(False))
    for i in (3, 4, 9):
        step.save(state, tmp_path / f"step_{i}")
    state, _ = step.restore(tmp_path / "step_4", state)
    assert step.save(state, tmp_path / "step_5", keep_last=2).wait() == tmp_path / "step_5"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4", "step_5"]
    assert step.save(state, tmp_path / "step_6", keep_last=1).wait() == tmp_path / "step_6"
    assert [p.name for p in tmp_path.iterdir()] == ["step_6"] and ck.latest(tmp_path) == tmp_path / "step_6"
    step.close()


# -- item 22: a full disk, however torch reports it ------------------------------------------------
def _torch_short_write(*args, **kwargs):  # what torch's zip writer raises when the disk fills inside it
    raise RuntimeError("[enforce fail at inline_container.cc:783] . unexpected pos 4416 vs 4308\n"
                       "frame #0: c10::ThrowEnforceNotMet(char const*, int, char const*, std::string const&, void const*)")


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_is_named_however_torch_reports_it(tmp_path, monkeypatch, async_save):
    """Item 22: torch's 'enforce fail at inline_container.cc ... unexpected pos' is a full disk."""
    step = _step()
    state = step.init(_params(False))
    step.save(state, tmp_path / "step_1")
    monkeypatch.setattr(torch.distributed.checkpoint.FileSystemWriter, "write_data", _torch_short_write)
    with pytest.raises(ck.CheckpointError, match=r"saving .*step_2: RuntimeError: \[enforce fail at inline_container"
                                                 r"\.cc:783\] \. unexpected pos 4416 vs 4308: the disk is full \(no space "
                                                 r"left, \d+ bytes free on .*\); free space or save elsewhere; nothing "
                                                 r"was published$"):
        step.save(state, tmp_path / "step_2", async_save=async_save)
        step.wait_save()
    assert ck.latest(tmp_path) == tmp_path / "step_1" and sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
    step.close()
