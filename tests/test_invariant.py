"""``shard_step(invariant=True)``: the same bits at any world size, mesh shape, topology,
accumulation, recompute and grad mode, and equal, bit for bit, to plain torch doing the same
arithmetic (atoms summed by the canonical tree) on one process."""
import functools
import hashlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hpf
from hpf import random as R
from hpf.comm.canonical import Partials, aligned_blocks, exact_parts, exact_square_sum, exact_total, tree_sum
from hpf.launcher import launch
from hpf.models import gpt, llama
from references import atom_training, pairwise_sum

ADAMW = dict(lr=1e-2, weight_decay=0.01)
CONFIG = gpt.CONFIGS["tiny"]
BATCH, ATOM = 12, 1  # 12 atoms: worlds 1, 2, 3 and 4 hold 12, 6, 4 and 3 atoms (aligned or not)


# -- the canonical order, alone ---------------------------------------------------------------------------------
def _values(draw_floats, n, size=5):
    return [torch.tensor(draw_floats[i * size:(i + 1) * size], dtype=torch.float32) for i in range(n)]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(1, 40).flatmap(lambda n: st.tuples(
    st.just(n), st.sampled_from([w for w in range(1, n + 1) if n % w == 0]),
    st.lists(st.floats(-1e6, 1e6, width=32), min_size=5 * n, max_size=5 * n))))
def test_ranks_partial_sums_meet_in_the_tree_one_process_sums(case):
    n, world, floats = case
    values = _values(floats, n)
    k = n // world
    parts = {}
    for r in range(world):
        mine = Partials()
        for i in range(r * k, (r + 1) * k):
            mine.push(i, values[i].clone())
        assert [node for node, _ in mine.nodes] == aligned_blocks(r * k, k)
        parts.update(mine.nodes)
    assert torch.equal(tree_sum(parts, n), pairwise_sum([v.clone() for v in values]))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.floats(-1, 1, width=32), st.integers(-60, 60)), min_size=1, max_size=300),
       st.lists(st.integers(0, 300), max_size=6))
def test_the_squares_sum_to_the_same_bits_however_the_shards_cut(pairs, cuts):
    x = torch.tensor([m * 2.0 ** e for m, e in pairs], dtype=torch.float32)
    top = float(x.double().abs().max()) ** 2
    whole = exact_total(exact_parts(exact_square_sum([x], top)), top)
    bounds = [0, *sorted(c % (len(x) + 1) for c in cuts), len(x)]
    ranks = [exact_parts(exact_square_sum([x[a:b]], top)) for a, b in zip(bounds, bounds[1:])]
    assert exact_total([sum(col) for col in zip(*ranks)], top) == whole
    exact = math.fsum(float(v) ** 2 for v in x.double())  # (each square exact in float64)
    # only squares' bits below 2**-62 of the largest are dropped, and the total is rounded once
    assert exact - len(x) * 2.0 ** -62 * top * 2 - 2.0 ** -52 * exact <= whole <= exact * (1 + 2.0 ** -52)


# -- one process: plain torch, bit for bit --------------------------------------------------------------------
def _batch(step, first=0, rows=BATCH):
    return gpt.global_batch(CONFIG, BATCH, 0, step)[first:first + rows]


def test_world_one_equals_plain_torch_on_the_same_atoms_bit_for_bit():
    loss_fn = gpt.loss_for(CONFIG)
    params = gpt.init(CONFIG, R.key(0))
    want_losses, want = atom_training(loss_fn, params, _batch, 4, 2, **ADAMW)
    with hpf.shard_step(loss_fn, mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw(**ADAMW), invariant=True,
                        atom_size=2) as step:
        state = step.init(params)
        losses = []
        for s in range(4):
            state, m = step(state, _batch(s))
            losses.append(m["loss"])
        got = dict(zip(*hpf.tree.flatten(step.full_params(state))[:2]))
    assert losses == want_losses
    for path, x in want.items():
        assert torch.equal(got[path], x), path


# -- what it refuses, by name -----------------------------------------------------------------------------------
def _loss(params, batch):
    return ((batch @ params["w"]) ** 2).mean()


@pytest.mark.parametrize("options, match", [
    ({"invariant": True}, "needs atom_size"),
    ({"atom_size": 2}, "pass invariant=True too"),
    ({"invariant": 1, "atom_size": 2}, "pass True or False"),
    ({"invariant": True, "atom_size": 2, "mixed_precision": "fp16"}, "fp16 loss scaling"),
    ({"invariant": True, "atom_size": 2, "mesh": hpf.Mesh({"node": 2, "local": 2}),
      "topology": hpf.Topology(slow_weights="int8")}, "low-bit slow tier"),
])
def test_options_it_does_not_cover_are_refused_by_name(options, match):
    options = {"mesh": hpf.Mesh({"dp": 1}), "optimizer": hpf.optim.adamw(), **options}
    with pytest.raises((ValueError, TypeError), match=match):
        hpf.shard_step(_loss, **options)


def test_a_local_batch_that_is_not_whole_atoms_is_refused_before_any_update():
    params = {"w": torch.randn(4, 3)}
    with hpf.shard_step(_loss, mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw(), invariant=True,
                        atom_size=4) as step:
        state = step.init(params)
        with pytest.raises(ValueError, match="not a whole number of atoms"):
            step(state, torch.randn(6, 4))
        assert torch.equal(step.full_params(state)["w"], params["w"])


def test_tensor_parallel_axes_are_refused_naming_the_param():
    with hpf.shard_step(_loss, mesh=hpf.Mesh({"dp": 1, "tp": 1}), optimizer=hpf.optim.adamw(), invariant=True,
                        atom_size=1, param_specs={"w": hpf.P(None, "tp")}, fsdp_axes=("dp",)) as step:
        with pytest.raises(hpf.MeshError, match="'w'.*tp"):
            step.init({"w": torch.randn(4, 3)})


# -- launched: every layout gives the same digests ----------------------------------------------------------------
def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _run(rank, mesh_axes, options, steps=5):
    """(losses, params, optimizer state) digests of a keyed-init GPT with clipping on this mesh."""
    mesh = hpf.Mesh(mesh_axes)
    options = dict(options)
    recompute = options.pop("recompute", "none")
    opt = hpf.optim.muon(lr=1e-2) if options.pop("optimizer", "adamw") == "muon" else hpf.optim.adamw(**ADAMW)
    module = MODELS[options.pop("model", "gpt")]
    config = module.CONFIGS["tiny"]
    rows = BATCH // mesh.size
    with hpf.shard_step(module.loss_for(config, recompute=recompute), mesh=mesh, optimizer=opt, invariant=True,
                        atom_size=ATOM, max_grad_norm=0.5, **options) as step:
        state = step.init(functools.partial(module.init, config), key=R.key(0))
        losses = []
        for s in range(steps):
            state, m = step(state, _batch(s, rank * rows, rows))
            losses.append(m["loss"])
        full = hpf.tree.flatten(step.full_params(state))[1]
        opt_state = [x for x in hpf.tree.flatten(state.opt_state)[1] if isinstance(x, torch.Tensor)]
    # the optimizer state is sharded: its digest is of this rank's shard, compared between equal meshes
    return _digest([torch.tensor(losses, dtype=torch.float64)]), _digest(full), _digest(opt_state)


def _several(rank, mesh_axes, runs):
    return [_run(rank, mesh_axes, options) for options in runs]


TWO_TIER = {"topology": hpf.Topology()}
MODELS = {"gpt": gpt, "llama": llama}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_same_bits_at_every_world_size_and_layout(optimizer):
    base = {"optimizer": optimizer}
    want = _run(0, {"dp": 1}, base)
    four = launch(_several, 4, {"node": 2, "local": 2},
                  [base, {**base, **TWO_TIER}, {**base, "accumulate": 3}, {**base, "hsdp": True}], timeout=240)
    others = [launch(_run, w, {"dp": w}, base, timeout=240) for w in (2, 3)]
    got = {"1": [want[:2]],
           **{f"{w}": [r[:2] for r in rs] for w, rs in zip((2, 3), others)},
           "2x2 flat": [r[0][:2] for r in four], "2x2 two-tier": [r[1][:2] for r in four],
           "2x2 accumulate 3": [r[2][:2] for r in four], "2x2 HSDP": [r[3][:2] for r in four]}
    for name, digests in got.items():
        assert digests == [want[:2]] * len(digests), name
    assert [r[0][2] for r in four] == [r[1][2] for r in four]  # same mesh: the same optimizer shards


@pytest.mark.slow
def test_recompute_and_torch_func_give_the_same_bits():
    runs = [{}, {"recompute": "all"}, {"grad": "torch.func", "recompute": "all"}]
    got = launch(_several, 2, {"dp": 2}, runs, timeout=240)
    assert all(len(set(per_rank)) == 1 for per_rank in got), got
    assert got[0][0][:2] == _run(0, {"dp": 1}, {})[:2]


def _resumed(rank, mesh_axes, folder, save_at, steps=6):
    """Losses and params digests of steps [save_at, steps): trained from step 0 with a save at
    ``save_at`` when the folder is empty, else restored from it onto this mesh."""
    mesh = hpf.Mesh(mesh_axes)
    rows = BATCH // mesh.size
    with hpf.shard_step(gpt.loss_for(CONFIG), mesh=mesh, optimizer=hpf.optim.adamw(**ADAMW), invariant=True,
                        atom_size=ATOM, max_grad_norm=0.5) as step:
        state = step.init(functools.partial(gpt.init, CONFIG), key=R.key(0))
        first = 0
        if any(folder.iterdir()):
            state, _ = step.restore(folder / "ckpt")
            first = save_at
        losses = []
        for s in range(first, steps):
            if s == save_at and first == 0:
                step.save(state, folder / "ckpt")
            state, m = step(state, _batch(s, rank * rows, rows))
            losses.append(m["loss"])
        full = hpf.tree.flatten(step.full_params(state))[1]
    return losses[-(steps - save_at):], _digest(full)


@pytest.mark.slow
def test_a_checkpoint_from_four_ranks_resumed_on_two_continues_the_same_bits(tmp_path):
    uninterrupted = launch(_resumed, 4, {"dp": 4}, tmp_path, 3, timeout=240)[0]
    resumed = launch(_resumed, 2, {"dp": 2}, tmp_path, 3, timeout=240)[0]
    assert resumed == uninterrupted


@pytest.mark.slow
def test_llama_and_bf16_give_the_same_bits_on_one_and_three_ranks():
    runs = [{"model": "llama"}, {"model": "llama", "optimizer": "muon"}, {"mixed_precision": "bf16"}]
    got = launch(_several, 3, {"dp": 3}, runs, timeout=240)
    assert [r[:2] for r in got[0]] == [_run(0, {"dp": 1}, options)[:2] for options in runs]


@pytest.mark.slow
def test_hpf_train_invariant_gives_one_and_two_ranks_the_same_bits_on_matmuls_that_split_by_thread(tmp_path):
    """A world of one rank gets all the cores from hpf.launch, one of two half of them; GPT small's
    matmuls split their sums by thread, so --invariant pins one thread per rank (else they differ)."""
    import subprocess
    import sys

    from hpf import checkpoint

    def params(world: int) -> list[torch.Tensor]:
        out = tmp_path / str(world)
        proc = subprocess.run([sys.executable, "-m", "hpf", "train", "--config", "small", "--world-size", str(world),
                               "--batch-size", "4", "--steps", "2", "--invariant", "--atom-size", "1", "--save-every",
                               "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return hpf.tree.flatten(checkpoint.load_params(out / "checkpoints" / "step_000002"))[1]
    one, two = params(1), params(2)
    assert len(one) == len(two) and all(torch.equal(a, b) for a, b in zip(one, two))
