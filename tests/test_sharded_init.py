"""Params born sharded: ``step.init(init_fn, key=...)`` gives every rank exactly the shards that
``step.init(init_fn(key))`` cuts from the whole params, bit for bit, without building them.

The one-process tests compare each rank's shards on virtual meshes of every layout (world sizes
1-4, two-tier numbering, HSDP, experts over an axis, mixed precision's fp32 masters); the launched
ones gather a real run's params and compare them with ``init_fn(key)`` run eagerly in one process."""
import dataclasses
import functools

import pytest
import torch

import hpf
from hpf import random as R
from hpf.launcher import launch
from hpf.models import gpt, llama, moe
from hpf.sharded_init import same_bits, trace_init
from hpf.planning import step_plan
from references import born_mismatch


def users_init(key):
    """An init of one's own: arithmetic, broadcasting, views, a tie, a QR (not sliceable) and constants."""
    k = R.split(key, 5)
    embed = R.normal(k[0], (37, 11)) * 0.02
    scale = R.uniform(k[1], (11,), minval=0.5, maxval=1.5)
    return {"embed": embed,
            "blocks": [{"w": (R.truncated_normal(R.fold_in(k[2], i), -2, 2, (13, 11)) * scale).t().contiguous(),
                        "q": torch.linalg.qr(R.normal(R.fold_in(k[3], i), (9, 9)))[0] * 0.5,
                        "b": torch.zeros(13), "g": torch.full((11,), 2.0),
                        "s": R.normal(R.fold_in(k[4], i), (4, 20, 3))[1, 2:19:2].flatten()} for i in range(3)],
            "head": embed, "norm": torch.ones(11).clamp(0, 0.5)}


TINY = {"gpt": (gpt, gpt.CONFIGS["tiny"]), "llama": (llama, llama.CONFIGS["tiny"]), "moe": (moe, moe.CONFIGS["tiny"])}
MESHES = {"1": {"dp": 1}, "2": {"dp": 2}, "3": {"dp": 3}, "4": {"dp": 4}, "2x2": {"node": 2, "local": 2}}


def _init_fn(name):
    if name == "users":
        return users_init
    module, config = TINY[name]
    return functools.partial(module.init, config)


def _specs(name, mesh, ep):
    if name == "moe" and ep:
        return dict(param_specs=moe.param_specs(TINY["moe"][1], ep, tuple(mesh.axis_names)))
    return {}


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("name", ["users", "gpt", "llama", "moe"])
def test_each_ranks_shards_are_the_ones_cut_from_the_whole_params(name, mesh_name):
    key = R.key(7)
    traced, whole = trace_init(_init_fn(name), key), _init_fn(name)(key)
    assert same_bits(traced.full_params(), whole)
    mesh = hpf.Mesh(MESHES[mesh_name])
    options = [dict(topology=hpf.Topology()), dict(hsdp=True)] if mesh.size == 4 and len(mesh.shape) == 2 else [{}]
    ep = [None, mesh.axis_names[0]] if name == "moe" and TINY["moe"][1].n_experts % mesh.shape[0] == 0 else [None]
    for opts in options:
        for axis in ep:
            plan = step_plan(traced.meta_params, mesh, **_specs(name, mesh, axis), **opts)
            for rank in range(mesh.size):
                for dtype in (None, torch.float64):  # (mixed precision keeps masters in a dtype of its own)
                    born = traced.shards(plan, rank, dtype)
                    cut = plan.shards(whole, rank, dtype)
                    assert len(born) == len(cut) and all(torch.equal(a, b) for a, b in zip(born, cut)), \
                        (opts, axis, rank, dtype)


def test_a_tie_stays_one_param():
    traced = trace_init(users_init, R.key(0))
    assert traced.meta_params["head"] is traced.meta_params["embed"]
    plan = step_plan(traced.meta_params, hpf.Mesh({"dp": 2}))
    assert plan.ties == {"head": "embed"}


def test_torchs_global_rng_and_uninitialized_memory_are_refused_by_path():
    with pytest.raises(ValueError, match=r"'blocks/0/w'.*global RNG.*hpf\.random"):
        trace_init(lambda k: {"blocks": [{"w": torch.randn(3, 3)}]}, R.key(0))
    with pytest.raises(ValueError, match=r"'b' from uninitialized memory"):
        trace_init(lambda k: {"a": R.normal(k, (2,)), "b": torch.empty(5)}, R.key(0))
    full = trace_init(lambda k: {"b": torch.empty(5).fill_(3.0)}, R.key(0)).full_params()
    assert torch.equal(full["b"], torch.full((5,), 3.0))  # filled memory is fine


def test_init_takes_an_init_function_with_its_key_or_a_params_tree_alone():
    step = hpf.shard_step(gpt.loss_for(gpt.CONFIGS["tiny"]), mesh=hpf.Mesh({"dp": 1}),
                          optimizer=hpf.optim.adamw(lr=1e-3))
    with pytest.raises(TypeError, match=r"needs the key.*key=hpf\.random\.key"):
        step.init(functools.partial(gpt.init, gpt.CONFIGS["tiny"]))
    with pytest.raises(TypeError, match="a key goes with an init function"):
        step.init(gpt.init(gpt.CONFIGS["tiny"]), key=R.key(0))
    with pytest.raises(TypeError, match="takes a key"):
        step.init(functools.partial(gpt.init, gpt.CONFIGS["tiny"]), key=torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match="hpf.random keys"):
        gpt.init(gpt.CONFIGS["tiny"], torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", ["gpt", "tied llama"])
def test_one_process_step_from_an_init_function_trains_as_from_its_params(name):
    """(A tied llama born sharded trained untied, issue 55 item 3: the head is the embedding.)"""
    module, config = (gpt, gpt.CONFIGS["tiny"]) if name == "gpt" else (
        llama, dataclasses.replace(llama.CONFIGS["tiny"], tie_embeddings=True))
    batch = gpt.global_batch(gpt.CONFIGS["tiny"], 4, 0, 0) % config.vocab_size
    params, losses = [], []
    for made_from in ("function", "params"):
        step = hpf.shard_step(module.loss_for(config), mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw(lr=1e-2))
        state = (step.init(functools.partial(module.init, config), key=R.key(2)) if made_from == "function"
                 else step.init(module.init(config, R.key(2))))
        for _ in range(3):
            state, m = step(state, batch)
        losses.append(m["loss"])
        params.append(step.full_params(state))
        step.close()
    assert losses[0] == losses[1] and same_bits(params[0], params[1])
    assert name == "gpt" or params[0]["head"] is params[0]["embed"]


def _gathered_equals_eager(rank, name, axes, two_tier, ep, mp):
    mesh = hpf.Mesh(axes)
    module, config = TINY[name] if name != "users" else (None, None)
    loss_fn = module.loss_for(config) if module else (lambda p, x: sum(v.sum() for v in hpf.tree.flatten(p)[1]) * x.sum())
    kw = _specs(name, mesh, ep)
    if name == "moe":
        kw["fsdp_axes"] = tuple(mesh.axis_names)
    step = hpf.shard_step(loss_fn, mesh=mesh, optimizer=hpf.optim.adamw(lr=1e-3),
                          topology=hpf.Topology() if two_tier else None, mixed_precision=mp, **kw)
    with step:
        state = step.init(_init_fn(name), key=R.key(3))
        return same_bits(step.full_params(state), _init_fn(name)(R.key(3)))


@pytest.mark.slow
@pytest.mark.parametrize("name, axes, two_tier, ep, mp", [
    ("gpt", {"dp": 3}, False, None, None),
    ("llama", {"node": 2, "local": 2}, True, None, "bf16"),
    ("moe", {"node": 2, "local": 2}, True, "node", None),
    ("users", {"dp": 2}, False, None, None),
])
def test_a_launched_runs_gathered_params_equal_init_fn_run_in_one_process(name, axes, two_tier, ep, mp):
    world = 1
    for n in axes.values():
        world *= n
    assert launch(_gathered_equals_eager, world, name, axes, two_tier, ep, mp, timeout=240) == [True] * world


def _different_keys(rank):
    step = hpf.shard_step(gpt.loss_for(gpt.CONFIGS["tiny"]), mesh=hpf.Mesh({"dp": 2}),
                          optimizer=hpf.optim.adamw(lr=1e-3))
    with step:
        step.init(functools.partial(gpt.init, gpt.CONFIGS["tiny"]), key=R.key(rank))


@pytest.mark.slow
def test_ranks_given_different_keys_are_refused_at_init():
    with pytest.raises(hpf.launcher.RankError, match="ParamsMismatchError.*init_fn and key"):
        launch(_different_keys, 2, timeout=120)



# -- issue 55: each op the evaluator re-derived wrongly was a silent wrong init ----------------------------
def _issue6_init(key):
    """The views and movements of issue 55 item 6, on 3 ranks, each param bigger than one node
    the evaluator computes whole."""
    import einops
    k = R.split(key, 4)
    x = R.normal(k[0], (24, 30, 16))
    y = x.transpose(0, 1).permute(2, 0, 1)[:, -10:, ::3].select(1, -2)        # [16, 10]
    z = torch.cat([y, y.flip(0)], 0).roll(3, 1).repeat(30, 1)                  # [960, 10]
    w = R.uniform(k[1], (70, 90))
    return {"z": z, "r": einops.rearrange(x, "a b c -> (b c) a")[-500:-5:7].clone(),
            "u": x.unfold(1, 4, 3).narrow(0, -20, 17).contiguous(),
            "d": R.normal(k[2], (3, 80, 90)).diagonal(5, 1, 2).expand(60, 3, 80).contiguous(),
            "s": torch.stack(w.chunk(3, 1), 0)[:, -100:, 1:].contiguous(), "n": w[-60::2, -1000:][:, ::-1 + 2]}


@pytest.mark.parametrize("item, init_fn, world", [
    ("1: a slice torch clamps", lambda k: {"a": R.normal(k, (90, 130))[-91:], "b": R.normal(k, (90, 130))[-200:-100]}, 2),
    ("2: int64 arithmetic", lambda k: {"a": R.normal(k, (90, 130)) + (torch.full((90, 130), 2**60 + 1) % 7).float()}, 2),
    ("3: one tensor at three paths", lambda k: (lambda x: {"a": x, "b": x.detach(), "c": x.view(90, 130)})(
        R.normal(k, (90, 130))), 2),
    ("4: sigmoid", lambda k: {"a": (R.normal(k, (89, 103)) * 4).sigmoid()}, 3),
    ("4: silu", lambda k: {"a": torch.nn.functional.silu(R.normal(k, (89, 103)) * 4)}, 3),
    ("4: pow", lambda k: {"a": (R.normal(k, (89, 103)) * 4).abs() ** 1.7}, 3),
    ("6: views and movements", _issue6_init, 3),
    # (found by tests/test_init_fuzz.py: a pointwise op keeps its input's transposed strides, so eager's
    # reshape of the permuted result is a view, which the same view of a contiguous meta base is not)
    ("6: a reshape that is a view only in eager's strides", lambda k: {
        "a": R.uniform(k, (90, 50)).t().sqrt().permute(1, 0).reshape(-1, 10)}, 3),
])
def test_born_shards_equal_eager_for_what_was_re_derived_wrongly(item, init_fn, world):
    assert born_mismatch(init_fn, R.key(0), hpf.Mesh({"dp": world})) is None


@pytest.mark.parametrize("through", ["transpose", "cast", "slice", "pointwise", "partly filled"])
def test_uninitialized_memory_is_refused_through_any_op_that_reads_it(through):
    make = {"transpose": lambda: torch.empty(90, 130).t(), "cast": lambda: torch.empty(90, 130).double(),
            "slice": lambda: torch.empty(90, 130)[3:], "pointwise": lambda: torch.empty(90, 130) * 0 + 1,
            "partly filled": lambda: torch.empty(90, 130).index_fill_(0, torch.tensor([0]), 1.0)}[through]
    with pytest.raises(ValueError, match=r"'blocks/1/w' from uninitialized memory"):
        trace_init(lambda k: {"blocks": [{"w": R.normal(k, (3,))}, {"w": make()}]}, R.key(0))
    filled = trace_init(lambda k: {"w": torch.empty(9, 13).copy_(R.normal(k, (9, 13))).t()}, R.key(0)).full_params()
    assert torch.equal(filled["w"], R.normal(R.key(0), (9, 13)).t())


@pytest.mark.parametrize("op", ["nonzero", "mask", "item"])
def test_data_dependent_ops_are_refused_by_path(op):
    make = {"nonzero": lambda x: torch.nonzero(x > 0).float(), "mask": lambda x: x[x > 0],
            "item": lambda x: x * x.sum().item()}[op]
    with pytest.raises(ValueError, match=r"params leaf 'm/w' with a data-dependent op"):
        trace_init(lambda k: {"m": {"w": make(R.normal(k, (90, 130)))}}, R.key(0))


# -- issue 58 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["users", "gpt", "llama", "moe"])
def test_the_inits_are_traced_on_meta_tensors_not_make_fxs_fake_ones(name):
    """(Item 1: make_fx's fake tensors import dynamo and sympy, about 1 s a rank, most of GPT medium's
    born-sharded init on 4 ranks; its graph stays the one that init_fn falls back to.)"""
    traced = trace_init(_init_fn(name), R.key(3))
    vals = [n.meta["val"] for n in traced.graph.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    assert vals and all(v.device.type == "meta" for v in vals)
    assert same_bits(traced.full_params(), _init_fn(name)(R.key(3)))


@pytest.mark.slow
def test_a_born_sharded_init_imports_neither_dynamo_nor_sympy():
    """(Item 1: each import is a cost every rank pays in step.init; the trace, the shards and the
    step's state need neither.)"""
    import subprocess
    import sys

    code = ("import functools, sys, torch, hpf\nfrom hpf.models import gpt\n"
            "step = hpf.shard_step(gpt.loss_for(gpt.CONFIGS['tiny']), mesh=hpf.Mesh({'dp': 1}), "
            "optimizer=hpf.optim.adamw(lr=1e-3))\n"
            "state = step.init(functools.partial(gpt.init, gpt.CONFIGS['tiny']), key=hpf.random.key(0))\n"
            "step.close()\nprint(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
