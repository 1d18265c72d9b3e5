"""hpf.checkpoint: DCP format, resharding restore, exact resume, bad checkpoints, torch's tools.

References are independent of the code under test: the full params (step.full_params or the
init tensors), plain torch (dcp_to_torch_save, an FSDP2 module), and uninterrupted runs."""
import contextlib
import dataclasses
import errno
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import optree
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import hpf
from hpf import P
from hpf import checkpoint as ck
from hpf.checkpoint import agreement
from hpf.launcher import launch
from hpf.models import gpt
from hpf.step import TrainState

CFG = gpt.CONFIGS["tiny"]
BATCH = 12  # global; splits over 4, 3, 2 and 1 ranks
STEPS = 20  # the resume tests: save at step 6, compare the 14 steps after it


def local_batch(step_i, rank, world):
    n = BATCH // world
    return gpt.global_batch(CFG, BATCH, 0, step_i)[rank * n:(rank + 1) * n]


def make_step(axes, optimizer=None, **kw):
    return hpf.shard_step(gpt.loss_for(CFG), mesh=hpf.Mesh(axes), optimizer=optimizer or hpf.optim.adamw(lr=1e-2),
                          **kw)


def leaves_equal(a, b):
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    return len(la) == len(lb) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(la, lb))


# -- the layout: boxes and chunks ------------------------------------------------------------
def test_boxes_tile_any_flat_interval():
    rng = random.Random(0)
    for _ in range(500):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 4)))
        n = int(np.prod(shape, dtype=np.int64))
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        x = torch.arange(n).view(shape)
        got = []
        for f, off, size in ck.boxes(shape, a, b):
            block = x[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1)
            assert block.tolist() == list(range(f, f + block.numel()))  # contiguous, starts at f
            got += block.tolist()
        assert got == list(range(a, b))
        assert len(ck.boxes(shape, a, b)) <= max(1, 2 * len(shape) - 1)


@pytest.mark.parametrize("axes,kw", [
    ({"dp": 2, "tp": 2}, dict(fsdp_axes=("dp",), param_specs=hpf.rules([(r"blocks/\d+/w_up", P("dp", "tp")),
                                                                          (r"head", P("tp")), (r".*", P("dp"))]))),
    ({"node": 2, "local": 3}, dict(hsdp=True)),
    ({"node": 2, "local": 2}, dict(fast_major=True)),
    ({"node": 2, "local": 2}, {}),
])
def test_chunks_of_every_rank_tile_the_full_params(axes, kw):
    """The chunks all ranks of a virtual mesh would write rebuild each full param exactly, once
    after dedup (non-FSDP block offsets, padding, HSDP replicas)."""
    full = gpt.init(gpt.GPTConfig(67, 16, 24, 3, 4, 38))  # dims the tp axis divides
    mesh = hpf.Mesh(axes)
    fsdp = kw.get("fsdp_axes")
    plan = hpf.plan(full, mesh, kw.get("param_specs"), fsdp, hsdp=kw.get("hsdp", False),
                    fast_major=kw.get("fast_major", False))
    paths, leaves, _ = hpf.tree.flatten(full)
    rebuilt = {ck.key_of(p): torch.full_like(x, float("nan")) for p, x in zip(paths, leaves)}
    seen = {}
    opt = hpf.optim.adamw()
    for r in range(mesh.size):
        shards = plan.shards(full, r)
        sd = ck.state_dict(ck.Layout(plan, r, opt), TrainState(shards, opt.init(shards)))
        for key, obj in sd.items():
            if key not in rebuilt:
                continue
            for off, view in obj.views.items():
                region = tuple(slice(o, o + s) for o, s in zip(off, view.shape))
                if (key, off) in seen:  # a replica: same box, same data
                    assert seen[(key, off)] == tuple(view.shape) and torch.equal(rebuilt[key][region], view)
                seen[(key, off)] = tuple(view.shape)
                rebuilt[key][region] = view
        assert sd["optimizer.count"].dim() == 0 and "optimizer.state.head.exp_avg_sq" in sd
    for p, x in zip(paths, leaves):
        assert torch.equal(rebuilt[ck.key_of(p)], x), p


# -- one process -----------------------------------------------------------------------------
def test_one_process_round_trip_torch_tools_and_async(tmp_path):
    step = make_step({"dp": 1})
    state = step.init(gpt.init(CFG))
    for i in range(3):
        state, _ = step(state, local_batch(i, 0, 1))
    step.save(state, tmp_path / "step_3", extra={"step": 3, "rng": ck.rng_state()})
    full = step.full_params(state)
    assert leaves_equal(ck.load_params(tmp_path / "step_3"), full)
    dcp_to_torch_save(tmp_path / "step_3", tmp_path / "t.pt")
    saved = torch.load(tmp_path / "t.pt", weights_only=False)
    paths, leaves, _ = hpf.tree.flatten(full)
    assert all(torch.equal(saved[p.replace("/", ".")], x) for p, x in zip(paths, leaves))
    assert int(saved["optimizer.count"]) == 3 and saved["extra"]["step"] == 3
    assert "optimizer.state.blocks.1.w_qkv.exp_avg" in saved

    # async: the state keeps changing in place while the save runs; the checkpoint holds step 3
    handle = step.save(state, tmp_path / "async_3", async_save=True)
    reference = []
    for i in range(3, 6):
        state, m = step(state, local_batch(i, 0, 1))
        reference.append(m["loss"])
    assert handle.wait() == tmp_path / "async_3"
    assert leaves_equal(ck.load_params(tmp_path / "async_3"), full)

    # exact resume in a fresh step built from meta params
    again = make_step({"dp": 1})
    empty = again.init(gpt.init(CFG, device="meta"))
    with pytest.raises(RuntimeError, match="meta params.*step.restore"):  # zeros must never train silently
        again(empty, local_batch(3, 0, 1))
    restored, extra = again.restore(tmp_path / "async_3")
    assert extra is None
    losses = []
    for i in range(3, 6):
        restored, m = again(restored, local_batch(i, 0, 1))
        losses.append(m["loss"])
    assert losses == reference  # bitwise


def test_rng_helpers_round_trip():
    saved = ck.rng_state()
    a = (random.random(), np.random.rand(), torch.rand(2))
    ck.set_rng_state(saved)
    b = (random.random(), np.random.rand(), torch.rand(2))
    assert a[:2] == b[:2] and torch.equal(a[2], b[2])


def test_keep_last_and_an_interrupted_save(tmp_path):
    step = make_step({"dp": 1})
    state = step.init(gpt.init(CFG))
    for i in range(1, 5):
        step.save(state, tmp_path / f"step_{i}", keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["step_3", "step_4"]
    # a save killed half-way leaves a .tmp directory: it is never picked, and it is named in errors
    (tmp_path / "step_5.tmp").mkdir()
    (tmp_path / "step_5.tmp" / "__0_0.distcp").write_bytes(b"partial")
    assert ck.latest(tmp_path) == tmp_path / "step_4"
    with pytest.raises(ck.CheckpointError, match="incomplete save"):
        step.restore(tmp_path / "step_5.tmp")
    step.save(state, tmp_path / "step_5", keep_last=2)  # the stale .tmp is replaced
    assert sorted(os.listdir(tmp_path)) == ["step_4", "step_5"]
    # saving to an existing name replaces it only once the new one is complete
    state.params[0].add_(1.0)
    step.save(state, tmp_path / "step_5")
    assert leaves_equal(ck.load_params(tmp_path / "step_5"), step.full_params(state))


def test_bad_checkpoints_raise_checkpoint_error_naming_path_and_key(tmp_path):
    step = make_step({"dp": 1})
    state = step.init(gpt.init(CFG))
    good = tmp_path / "good"
    step.save(state, good)

    def copy(name):
        import shutil
        shutil.copytree(good, tmp_path / name)
        return tmp_path / name

    def expect(path, *needles, into=step):
        with pytest.raises(ck.CheckpointError) as e:
            into.restore(path)
        for n in (str(path),) + needles:
            assert n in str(e.value), (n, str(e.value))
        return str(e.value)

    cases = {}
    cases["missing dir"] = expect(tmp_path / "nope", "no such checkpoint")
    (tmp_path / "plain").mkdir()
    cases["not a checkpoint"] = expect(tmp_path / "plain", "not an hpf checkpoint")
    t = copy("truncated")
    data = sorted(t.glob("*.distcp"))[-1]
    data.write_bytes(data.read_bytes()[:100])
    cases["truncated data"] = expect(t, "truncated", data.name)
    c = copy("corrupt")
    (c / ".metadata").write_bytes(b"garbage")
    cases["corrupt metadata"] = expect(c, "corrupt")
    m = copy("missing_file")
    os.remove(sorted(m.glob("*.distcp"))[0])
    cases["missing file"] = expect(m, "missing")

    other = hpf.shard_step(gpt.loss_for(gpt.CONFIGS["small"]), mesh=hpf.Mesh({"dp": 1}),
                           optimizer=hpf.optim.adamw())
    other.init(gpt.init(gpt.CONFIGS["small"], device="meta"))
    cases["another model"] = expect(good, "'blocks.0.norm1'", "shape", into=other)
    deeper = hpf.shard_step(gpt.loss_for(CFG), mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw())
    deeper.init(gpt.init(gpt.GPTConfig(67, 16, 25, 4, 5, 38), device="meta"))
    cases["missing key"] = expect(good, "'blocks.3.norm1'", "missing", into=deeper)
    f64 = make_step({"dp": 1})
    f64.init(gpt.init(CFG, dtype=torch.float64, device="meta"))
    cases["another dtype"] = expect(good, "torch.float32", "torch.float64", into=f64)
    mu = make_step({"dp": 1}, optimizer=hpf.optim.muon())
    mu.init(gpt.init(CFG, device="meta"))
    cases["another optimizer"] = expect(good, "AdamW", "DistMuon", into=mu)
    for name, message in cases.items():
        print(f"{name}: {message}")


# -- several processes ------------------------------------------------------------------------
def _run(step, state, start, stop, rank, world):
    losses = []
    for i in range(start, stop):
        state, m = step(state, local_batch(i, rank, world))
        losses.append(m["loss"])
    return state, losses


def _first_run(rank, root):
    """2x2: 20 steps, an async save at step 6 overlapping steps 7..; then a same-mesh resume."""
    step = make_step({"node": 2, "local": 2})
    state = step.init(gpt.init(CFG))
    state, head = _run(step, state, 0, 6, rank, 4)
    full6 = step.full_params(state)
    step.save(state, f"{root}/step_6", extra={"step": 6}, async_save=True)
    state, tail = _run(step, state, 6, STEPS, rank, 4)
    step.wait_save()
    again = make_step({"node": 2, "local": 2})
    empty = again.init(gpt.init(CFG, device="meta"))
    with pytest.raises(RuntimeError, match="meta params.*step.restore"):  # zeros must never train silently
        again(empty, local_batch(3, 0, 1))
    restored, extra = again.restore(f"{root}/step_6")
    _, resumed = _run(again, restored, extra["step"], STEPS, rank, 4)
    return tail, resumed, full6


def _resume_dp3(rank, root):
    step = make_step({"dp": 3})
    step.init(gpt.init(CFG, device="meta"))
    state, extra = step.restore(f"{root}/step_6")
    return _run(step, state, extra["step"], STEPS, rank, 3)[1]


@pytest.mark.slow
def test_resume_is_exact_on_the_same_mesh_and_close_on_others(tmp_path):
    tail, resumed, full6 = launch(_first_run, 4, str(tmp_path), timeout=280)[0]
    assert resumed == tail  # bitwise, same mesh
    assert leaves_equal(ck.load_params(tmp_path / "step_6"), full6)
    on3 = launch(_resume_dp3, 3, str(tmp_path), timeout=280)[0]
    torch.testing.assert_close(torch.tensor(on3), torch.tensor(tail), rtol=1e-5, atol=0)
    assert not dist.is_initialized()
    one = make_step({"dp": 1})
    one.init(gpt.init(CFG, device="meta"))
    state, extra = one.restore(tmp_path / "step_6")
    on1 = _run(one, state, extra["step"], STEPS, 0, 1)[1]
    torch.testing.assert_close(torch.tensor(on1), torch.tensor(tail), rtol=1e-5, atol=0)


def _muon_by_order(rank, root, fast_major, resume):
    """Muon, 2x2 two-tier, shards numbered fast-major or node-major: 2 steps and a save (or a
    restore of that save), then 2 more; their losses."""
    step = make_step({"node": 2, "local": 2}, optimizer=hpf.optim.muon(lr=0.02),
                     topology=hpf.Topology(fast_major=fast_major))
    with step:
        if resume:
            step.init(gpt.init(CFG, device="meta"))
            state, _ = step.restore(f"{root}/step_2")
        else:
            state, _ = _run(step, step.init(gpt.init(CFG)), 0, 2, rank, 4)
            step.save(state, f"{root}/step_2", extra={"step": 2})
        return _run(step, state, 2, 4, rank, 4)[1]


@pytest.mark.slow
def test_a_checkpoint_saved_fast_major_restores_node_major_and_on_another_world(tmp_path):
    """Muon's state and the params move between shard orders as between meshes: by their place
    in each whole param, so the run goes on as it would have."""
    tail = launch(_muon_by_order, 4, str(tmp_path), True, False, timeout=280)[0]
    node_major = launch(_muon_by_order, 4, str(tmp_path), False, True, timeout=280)[0]
    torch.testing.assert_close(torch.tensor(node_major), torch.tensor(tail), rtol=1e-6, atol=0)
    one = make_step({"dp": 1}, optimizer=hpf.optim.muon(lr=0.02))
    one.init(gpt.init(CFG, device="meta"))
    state, extra = one.restore(tmp_path / "step_2")
    torch.testing.assert_close(torch.tensor(_run(one, state, 2, 4, 0, 1)[1]), torch.tensor(tail), rtol=1e-5, atol=0)


class _Module(torch.nn.Module):
    """An nn.Module whose state-dict names are hpf's dotted paths."""

    def __init__(self, tree):
        super().__init__()
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        for k, v in items:
            if isinstance(v, torch.Tensor):
                self.register_parameter(str(k), torch.nn.Parameter(torch.zeros_like(v)))
            else:
                self.add_module(str(k), _Module(v))


def _muon_then_fsdp2(rank, root):
    """Muon on dp=2: save at step 2, run to 4; then FSDP2 loads the params with dcp.load."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    step = make_step({"dp": 2}, optimizer=hpf.optim.muon(lr=0.02))
    state = step.init(gpt.init(CFG))
    state, _ = _run(step, state, 0, 2, rank, 2)
    step.save(state, f"{root}/step_2", extra={"step": 2})
    full = step.full_params(state)
    _, tail = _run(step, state, 2, 4, rank, 2)
    model = fully_shard(_Module(gpt.init(CFG)), mesh=init_device_mesh("cpu", (2,)))
    sd = model.state_dict()
    dcp_load(sd, checkpoint_id=f"{root}/step_2")
    paths, leaves, _ = hpf.tree.flatten(full)
    loaded = {k: v.full_tensor() for k, v in sd.items()}
    ok = sorted(loaded) == sorted(p.replace("/", ".") for p in paths) and all(
        torch.equal(loaded[p.replace("/", ".")], x) for p, x in zip(paths, leaves))
    return ok, tail


@pytest.mark.slow
def test_muon_state_reshards_and_fsdp2_loads_the_params(tmp_path):
    ok, tail = launch(_muon_then_fsdp2, 2, str(tmp_path), timeout=280)[0]
    assert ok
    one = make_step({"dp": 1}, optimizer=hpf.optim.muon(lr=0.02))
    one.init(gpt.init(CFG, device="meta"))
    state, extra = one.restore(tmp_path / "step_2")
    on1 = _run(one, state, extra["step"], 4, 0, 1)[1]
    torch.testing.assert_close(torch.tensor(on1), torch.tensor(tail), rtol=1e-5, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("job", [["--mesh", "dp=2"], ["--model", "moe", "--mesh", "dp=2,ep=2", "--ep-axis", "ep"]],
                         ids=["gpt", "moe-ep"])
def test_cli_resumes_from_the_last_complete_checkpoint_after_a_killed_save(tmp_path, job):
    """Bitwise the uninterrupted run's losses; MoE also its expert loads (the balancing bias is
    in the checkpoint's extra)."""
    from hpf import cli

    common = ["train", *job, "--batch-size", "8", "--seed", "3"]
    assert cli.main([*common, "--steps", "6", "--out", str(tmp_path / "whole")]) == 0
    run = tmp_path / "run"
    assert cli.main([*common, "--steps", "4", "--save-every", "2", "--keep-last", "1", "--out", str(run)]) == 0
    assert sorted(os.listdir(run / "checkpoints")) == ["step_000004"]
    # the run died while saving step 6: a partial .tmp directory with a metadata file but no hpf.json
    partial = run / "checkpoints" / "step_000006.tmp"
    partial.mkdir()
    (partial / ".metadata").write_bytes(b"half")
    assert cli.main([*common, "--steps", "6", "--out", str(run), "--resume"]) == 0
    whole, resumed = cli.read_metrics(tmp_path / "whole" / "metrics.jsonl"), cli.read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]  # bitwise, same mesh
    assert [r.get("expert_imbalance") for r in resumed] == [r.get("expert_imbalance") for r in whole]


def test_load_params_of_tied_weights_feeds_to_hf(tmp_path):
    """A tied Llama (tie_embeddings, as the 1b config): load_params gives one tensor at both
    paths, the init's values, and llama.to_hf writes it (issue 28 item 10)."""
    from safetensors.torch import load_file

    from hpf.models import llama

    c = dataclasses.replace(llama.CONFIGS["tiny"], tie_embeddings=True)
    params = llama.init(c)
    step = hpf.shard_step(llama.loss_for(c), mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw())
    step.save(step.init(params), tmp_path / "ckpt")
    back = ck.load_params(tmp_path / "ckpt")
    assert back["head"] is back["embed"]
    assert leaves_equal(back, params)
    llama.to_hf(c, back, tmp_path / "hf")
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(hf["model.embed_tokens.weight"], params["embed"]) and "lm_head.weight" not in hf


class _HeadState(NamedTuple):
    count: torch.Tensor
    buf: list  # per bucket: this rank's elements of "head" only


class _HeadMomentum:
    """A user's optimizer on flat shards whose state packs one param's elements, as DistMuon's
    exp_avg_sq packs its AdamW params: it says so in its capabilities (state_layout)."""

    capabilities = hpf.optim.Capabilities(for_plan=True, state_layout={"buf": frozenset({"head"})})

    def __init__(self, plan=None, rank=0):
        self.plan, self.rank = plan, rank

    def for_plan(self, plan, rank):
        return _HeadMomentum(plan, rank)

    def init(self, shards):
        sizes = []
        for b in self.plan.buckets:
            position = self.plan.shard_index(b, self.rank)
            sizes.append(sum(b.local_piece(s, position).numel for s in b.slots if s.path == "head"))
        return _HeadState(torch.zeros((), dtype=torch.int64), [s.new_zeros(n) for s, n in zip(shards, sizes)])

    def update(self, grads, state, params):
        return params, state


def test_an_optimizer_describes_its_packed_state_to_checkpoints(tmp_path):
    """Checkpoints place optimizer state by its declared state_layout, not by knowing DistMuon."""
    assert hpf.optim.capabilities(_HeadMomentum()).state_layout
    step = make_step({"dp": 1}, optimizer=_HeadMomentum())
    full = gpt.init(CFG)
    state = step.init(full)
    for i, t in enumerate(state.opt_state.buf):
        t.copy_(torch.arange(t.numel()) + 100.0 * i)
    step.save(state, tmp_path / "ckpt")
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "t.pt")
    saved = torch.load(tmp_path / "t.pt", weights_only=False)
    head = next(t for t in state.opt_state.buf if t.numel())
    assert torch.equal(saved["optimizer.state.head.buf"], head.view(full["head"].shape))
    again = make_step({"dp": 1}, optimizer=_HeadMomentum())
    again.init(gpt.init(CFG, device="meta"))
    restored, _ = again.restore(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(restored.opt_state.buf, state.opt_state.buf))


def test_keep_last_removes_only_the_older_checkpoints_of_its_own_series(tmp_path):
    """keep_last never touches a user's other folders, even hpf checkpoints (issue 28 item 6)."""
    step = make_step({"dp": 1})
    state = step.init(gpt.init(CFG))
    step.save(state, tmp_path / "best")
    step.save(state, tmp_path / "run_b_7")
    (tmp_path / "notes").mkdir()
    for i in range(1, 5):
        step.save(state, tmp_path / f"step_{i}", keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["best", "notes", "run_b_7", "step_3", "step_4"]
    with pytest.raises(ValueError, match="number at the end"):
        step.save(state, tmp_path / "final", keep_last=2)
    assert not (tmp_path / "final").exists()


def test_restore_is_strict_and_strict_false_lists_what_it_dropped(tmp_path):
    """A 3-layer checkpoint does not restore silently into a 2-layer model (issue 28 item 5)."""
    deep = gpt.init(CFG)
    step = make_step({"dp": 1})
    step.save(step.init(deep), tmp_path / "deep")
    shallow_cfg = dataclasses.replace(CFG, n_layers=2)
    shallow = hpf.shard_step(gpt.loss_for(shallow_cfg), mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw())
    shallow.init(gpt.init(shallow_cfg, device="meta"))
    with pytest.raises(ck.CheckpointError, match=r"'blocks\.2\.[a-z_0-9]+'.*strict=False"):
        shallow.restore(tmp_path / "deep")
    with pytest.warns(UserWarning, match=r"dropped \d+ checkpoint key.*'blocks\.2\.") as caught:
        state, _ = shallow.restore(tmp_path / "deep", strict=False)
    message = str(caught[0].message)
    assert all(f"'blocks.2.{k}'" in message for k in deep["blocks"][2]) and "optimizer.state.blocks.2." in message
    want = {**deep, "blocks": deep["blocks"][:2]}
    assert leaves_equal(shallow.full_params(state), want)


def _ranks_disagree_then_save_last(rank, root):
    """Different paths on the two ranks (a timestamp that ticked), then an async save as the
    function's last action: hpf.launch must finish it."""
    step = make_step({"dp": 2})
    state, _ = step(step.init(gpt.init(CFG)), local_batch(0, rank, 2))
    errors = []
    for call in (lambda: step.save(state, f"{root}/ckpt_{rank}"), lambda: step.restore(f"{root}/ckpt_{rank}")):
        with pytest.raises(ck.CheckpointError) as e:
            call()
        errors.append(str(e.value))
    full = step.full_params(state)
    step.save(state, f"{root}/last_1", async_save=True)
    return errors, full


@pytest.mark.slow
def test_ranks_must_agree_on_the_path_and_launch_finishes_an_async_save(tmp_path):
    """Issue 28 items 4 (a CheckpointError on every rank, nothing published) and 8 (hpf.launch)."""
    (errors, full), (other, _) = launch(_ranks_disagree_then_save_last, 2, str(tmp_path), timeout=120)
    for message in errors + other:
        assert "ckpt_0" in message and "ckpt_1" in message and "same path" in message, message
    assert [p.name for p in tmp_path.iterdir()] == ["last_1"]
    assert leaves_equal(ck.load_params(tmp_path / "last_1"), full)


def _rank_0_saves_alone(rank, root, then):
    step = make_step({"dp": 2})
    state, _ = step(step.init(gpt.init(CFG)), local_batch(0, rank, 2))
    if rank == 0:  # the torch.save habit
        step.save(state, f"{root}/step_1")
    if then == "next step":
        step(state, local_batch(1, rank, 2))


@pytest.mark.slow
@pytest.mark.parametrize("then", ["next step", "return"])
def test_a_save_on_rank_0_alone_is_a_named_error_within_seconds(tmp_path, then):
    """Issue 28 item 7: not a hang until the launch timeout."""
    t0 = time.monotonic()
    with pytest.raises(hpf.launch.RankError, match=r"ScheduleMismatchError: .*rank 0: checkpoint step\.save"):
        launch(_rank_0_saves_alone, 2, str(tmp_path), then, timeout=120)
    assert time.monotonic() - t0 < 60
    assert ck.latest(tmp_path) is None


_TORCHRUN_SAVE = """
import sys, time, torch, hpf
import torch.distributed.checkpoint as dcp
from hpf.models import gpt
save = dcp.save
dcp.save = lambda *a, **k: (time.sleep(1), save(*a, **k))[1]  # a save that outlasts the script
hpf.launch.init_distributed()
cfg = gpt.CONFIGS["tiny"]
step = hpf.shard_step(gpt.loss_for(cfg), mesh=hpf.Mesh({"dp": 2}), optimizer=hpf.optim.adamw())
state = step.init(gpt.init(cfg))
step.save(state, sys.argv[1], async_save=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("end", ["hpf.launch.shutdown()", "torch.distributed.destroy_process_group()"])
def test_torchrun_script_finishes_or_reports_an_async_save(tmp_path, end):
    """Issue 28 item 8 under torchrun: hpf.launch.shutdown() publishes the save; a bare
    destroy_process_group() (the old README ending) is reported, with a failing exit status."""
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", _TORCHRUN_SAVE + end, str(tmp_path / "ckpt")],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    if end == "hpf.launch.shutdown()":
        assert [p.returncode for p in procs] == [0, 0], outs
        assert leaves_equal(ck.load_params(tmp_path / "ckpt"), gpt.init(CFG))
    else:
        assert all(p.returncode == 1 for p in procs), outs
        assert all(f"the async save to {tmp_path / 'ckpt'} failed" in o and "hpf.launch.shutdown()" in o
                   for o in outs), outs
        assert ck.latest(tmp_path) is None


# -- a failed save is never reported as saved ----------------------------------------------------
def _full_disk(*args, **kwargs):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_that_fails_in_dcp_is_a_checkpoint_error_and_nothing_is_published(tmp_path, monkeypatch, async_save):
    """DCP reports a writer's error as CheckpointException, a BaseException: it must still be a
    CheckpointError (an ``except Exception`` sees it), never a returned path."""
    step = make_step({"dp": 1})
    state = step.init(gpt.init(CFG))
    step.save(state, tmp_path / "step_1")
    monkeypatch.setattr(torch.distributed.checkpoint.FileSystemWriter, "write_data", _full_disk)
    with pytest.raises(ck.CheckpointError, match=r"saving .*step_2: OSError: \[Errno 28\] No space left"):
        step.save(state, tmp_path / "step_2", async_save=async_save)
        step.wait_save()
    assert sorted(os.listdir(tmp_path)) == ["step_1"] and ck.latest(tmp_path) == tmp_path / "step_1"


@contextlib.contextmanager
def _tmpfs(path, size="64k"):
    """A small filesystem at ``path`` (needs root, as CI runs); the test is skipped without it."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root); the fault-injecting writer test covers this")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.slow
def test_hpf_train_on_a_full_disk_fails_loudly(tmp_path, capsys):
    """--save-every onto a filesystem too small for one checkpoint: rc 1, one line naming the save
    and the full disk (whichever rank reports first: each names the first failing rank's cause),
    run.json "failed", and no checkpoint that looks complete."""
    from hpf import cli

    run = tmp_path / "run"
    with _tmpfs(run / "checkpoints"):
        code = cli.main(["train", "--mesh", "dp=2", "--batch-size", "8", "--steps", "4", "--save-every", "2",
                         "--out", str(run)])
        assert ck.latest(run / "checkpoints") is None and os.listdir(run / "checkpoints") == []
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and re.search(r"CheckpointError: saving .*step_000002: .*the disk is full", err[0])
    assert json.loads((run / "run.json").read_text())["status"].startswith("failed")


def _peer_reports(rank):
    from hpf.checkpoint_files import save_failed
    error = OSError(errno.ENOSPC, "No space left on device") if rank == 0 else None  # (rank 1 wrote its part)
    return str(save_failed(Path("/nowhere/step_2"), agreement.first_error(error, None)))


@pytest.mark.slow
def test_every_rank_names_the_first_failing_ranks_cause():
    """A rank that wrote its part said "another rank failed to write its part", and the CLI printed
    whichever rank failed first: the full disk went unnamed about 1 run in 5."""
    mine, peer = launch(_peer_reports, 2, timeout=60)
    assert "OSError: [Errno 28] No space left on device" in mine and "the disk is full" in mine, mine
    assert "rank 0: OSError: [Errno 28] No space left on device" in peer and "the disk is full" in peer, peer


# -- integrity: every file is checked against the manifest's CRC-32 -------------------------------
def test_a_flipped_byte_or_a_truncated_file_is_a_checkpoint_error_naming_the_file(tmp_path):
    """Same-size corruption used to load silently (values off by up to 21)."""
    step = make_step({"dp": 1})
    state = step.init(gpt.init(CFG))
    path = tmp_path / "step_1"
    step.save(state, path, extra={"step": 1})
    full = step.full_params(state)
    for name in ["__0_0.distcp", ".metadata", "hpf.json"]:
        f = path / name
        data = f.read_bytes()
        for bad in (data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 4]) + data[len(data) // 2 + 1:],
                    data[:-1]):
            f.write_bytes(bad)
            with pytest.raises(ck.CheckpointError, match=re.escape(name)):  # restore reads every byte
                step.restore(path)
            try:  # load_params reads the params alone: an error naming the file, or the values as saved
                assert leaves_equal(ck.load_params(path), full)
            except ck.CheckpointError as e:
                assert name in str(e)
        f.write_bytes(data)
    assert leaves_equal(ck.load_params(path), full)


@pytest.mark.slow
def test_checkpoint_fuzz_a_few_corruptions(tmp_path):
    """benchmarks/checkpoint_fuzz.py's trials in small: every corruption a CheckpointError naming the file
    (the closing figure runs 200 over GPT small)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from checkpoint_fuzz import fuzz

    def save(rank):
        step = make_step({"dp": 2})
        step.save(step.init(gpt.init(CFG)), tmp_path / "c")
    launch(save, 2)
    counts = fuzz(tmp_path / "c", CFG, trials=8, seed=1)  # (load, outcome) -> how many
    assert counts[("restore", "named")] == 8 and {k for _, k in counts} <= {"named", "unaffected"}, counts


def test_a_manifest_without_its_file_list_is_an_error_not_a_warning(tmp_path):
    """Issue 45 item 2: without "files" nothing was checked (a warning only), so .metadata could name any file."""
    step = make_step({"dp": 1})
    state = step.init(gpt.init(CFG))
    path = tmp_path / "step_1"
    step.save(state, path, extra={"step": 1, "rng": ck.rng_state()})  # numpy's RNG state: arrays are data
    assert step.restore(path)[1]["step"] == 1
    header = json.loads((path / "hpf.json").read_text())
    (path / "hpf.json").write_text(json.dumps({k: v for k, v in header.items() if k not in ("files", "crc32")}))
    for load in (step.restore, ck.load_params):
        with pytest.raises(ck.CheckpointError, match=r"hpf\.json: lists no files .*restore a checkpoint this hpf saved"):
            load(path)
