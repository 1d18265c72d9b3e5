"""Megatron tensor parallelism in the built-in models, composed with FSDP: heads and MLP columns
split over a ``tp`` axis, the row-parallel products summed over it, each weight stored
FSDP-sharded over the data axes. Every run is checked against plain torch autograd on the whole
model in one process; checkpoints move between tp sizes by each param's place."""
import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hpf
from hpf import random as R
from hpf.comm.collectives import SPMD, spmd
from hpf.launcher import RankError, launch
from hpf.models import gpt, llama, moe, specs_for
from hpf import memory, search, sim
from hpf.report import PlanReport
from hpf.planning import step_plan
from references import adamw_training

# head counts and widths the tp axis divides
MODELS = {"gpt": (gpt, gpt.GPTConfig(67, 16, 24, 3, 4, 38)),
          "llama": (llama, llama.LlamaConfig(vocab_size=67, seq_len=16, d_model=24, n_layers=3, n_heads=4,
                                             n_kv_heads=2, d_ff=38))}
BATCH, STEPS, LR = 8, 20, 1e-2


def _step(name, mesh, two_tier=False, **how):
    module, config = MODELS[name]
    data = tuple(a for a in mesh.axis_names if a != "tp")
    return hpf.shard_step(module.loss_for(config, tp_axis="tp", **how), mesh=mesh, optimizer=hpf.optim.adamw(lr=LR),
                          param_specs=module.param_specs(config, "tp", data), fsdp_axes=data,
                          topology=hpf.Topology() if two_tier else None)


def _train(rank, axes, two_tier, root):
    """Both models for STEPS steps on this mesh; the tp=2 x dp=2 runs save their state, and train
    again sequence parallel (``name/sp``)."""
    mesh, out = hpf.Mesh(axes), {}
    data = tuple(a for a in mesh.axis_names if a != "tp")
    index, readers = mesh.group_index(data, rank), mesh.axis_size(data)
    rows = BATCH // readers
    runs = [(name, {}) for name in MODELS] + ([(name, {"sequence_parallel": True}) for name in MODELS] if root else [])
    for name, how in runs:
        module, config = MODELS[name]
        with _step(name, mesh, two_tier, **how) as step:
            state = step.init(functools.partial(module.init, config), key=R.key(0))
            losses = []
            for s in range(STEPS):
                state, m = step(state, gpt.global_batch(config, BATCH, 0, s)[index * rows:(index + 1) * rows])
                losses.append(m["loss"])
            if root is not None and not how:
                step.save(state, f"{root}/{name}")
            out[name + ("/sp" if how else "")] = (losses, step.full_params(state))
    return out


@functools.lru_cache(maxsize=None)
def _reference(name):
    module, config = MODELS[name]
    return adamw_training(module.loss_for(config), module.init(config, R.key(0)),
                          lambda s: gpt.global_batch(config, BATCH, 0, s), STEPS, lr=LR)


@pytest.mark.slow
@pytest.mark.parametrize("axes, two_tier", [pytest.param({"tp": 2}, False, marks=pytest.mark.tolerance),
                                            ({"dp": 2, "tp": 2}, False), ({"node": 2, "tp": 2}, True)],
                         ids=["tp2", "dp2xtp2", "two-tier"])
def test_tensor_parallel_training_equals_one_process(axes, two_tier, tmp_path):
    root = str(tmp_path) if "dp" in axes else None
    world = 1
    for n in axes.values():
        world *= n
    runs = launch(_train, world, axes, two_tier, root, timeout=280)
    for name in runs[0]:  # (name/sp: sequence parallel, the same model)
        want_losses, _, want_params = _reference(name.partition("/")[0])
        for got in runs:  # every rank reports the global loss
            # the same fp32 math, its sums split over ranks: a few ulps a step (1e-5 relative after 20)
            torch.testing.assert_close(torch.tensor(got[name][0]), torch.tensor(want_losses), rtol=1e-5, atol=0,
                                       msg=name)
        for path, x in zip(*hpf.tree.flatten(runs[0][name][1])[:2]):
            torch.testing.assert_close(x, want_params[path], rtol=0, atol=LR * 5e-3, msg=f"{name} {path}")
    if root is None:
        return
    for name, (module, config) in MODELS.items():  # the tp=2 checkpoint onto tp=1 and onto dp=4: every element
        saved = runs[0][name][1]
        assert _same(hpf.checkpoint.load_params(f"{root}/{name}"), saved)
        assert launch(_restore_on_dp4, 4, name, f"{root}/{name}", timeout=200) == [True] * 4


def _restore_on_dp4(rank, name, path):
    module, config = MODELS[name]
    step = hpf.shard_step(module.loss_for(config), mesh=hpf.Mesh({"dp": 4}), optimizer=hpf.optim.adamw(lr=LR))
    with step:
        step.init(module.init(config, device="meta"))
        state, _ = step.restore(path)
        return _same(step.full_params(state), hpf.checkpoint.load_params(path))


def _same(a, b) -> bool:
    la, lb = hpf.tree.flatten(a)[1], hpf.tree.flatten(b)[1]
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


def test_the_plan_splits_heads_and_mlp_columns_and_stores_them_fsdp_sharded():
    module, config = MODELS["llama"]
    mesh = hpf.Mesh({"dp": 2, "tp": 2})
    plan = step_plan(module.init(config, device="meta"), mesh, module.param_specs(config, "tp", ("dp",)),
                     fsdp_axes=("dp",))
    d, hd = config.d_model, config.head_dim
    shapes = {p: s.local_shape for p, s in plan.slots.items()}
    assert shapes["blocks/0/wq"] == (config.n_heads * hd // 2, d) and shapes["blocks/0/wk"] == (hd, d)
    assert shapes["blocks/0/wo"] == (d, config.n_heads * hd // 2) and shapes["blocks/0/w_down"] == (d, 19)
    assert shapes["embed"] == (config.vocab_size, d)  # replicated over tp
    assert {b.shard_axes for b in plan.buckets} == {("dp",)}
    assert {b.split_axes for b in plan.buckets} == {(), ("tp",)}


def test_tensor_parallelism_is_refused_where_it_cannot_act():
    with pytest.raises(ValueError, match="one of the data axes"):
        gpt.param_specs(MODELS["gpt"][1], "dp", ("dp",))
    with pytest.raises(ValueError, match="tp_axis too"):
        gpt.loss_for(MODELS["gpt"][1], sequence_parallel=True)
    with pytest.raises(ValueError, match="dropout"):
        gpt.loss_for(gpt.GPTConfig(67, 16, 24, 3, 4, 38, dropout=0.1), tp_axis="tp", sequence_parallel=True)


def test_moe_splits_its_attention_over_tp_and_its_experts_over_ep():
    config = moe.CONFIGS["tiny"]
    mesh = hpf.Mesh({"dp": 2, "tp": 2})
    plan = step_plan(moe.init(config, device="meta"), mesh, specs_for(moe, config, "dp", ("dp",), "tp"),
                     fsdp_axes=("dp",))
    d = config.d_model
    assert plan.slots["blocks/1/wq"].local_shape == (d // 2, d) and plan.slots["blocks/1/wo"].local_shape == (d, d // 2)
    assert plan.slots["blocks/1/experts/w1"].local_shape[0] == config.n_experts // 2  # (over ep = dp)
    assert plan.slots["blocks/1/router"].local_shape == (config.n_experts, d)  # whole on every tp rank


def _odd_heads(rank):
    """5 heads of 6: every dim splits evenly over 2, the heads do not (specs of even splits, not
    gpt.param_specs, which splits in whole heads)."""
    config = gpt.GPTConfig(67, 16, 30, 2, 5, 36)
    mesh, P = hpf.Mesh({"tp": 2}), hpf.P
    even = hpf.rules([(r"blocks/\d+/(w_qkv|w_up)", P(None, "tp")), (r"blocks/\d+/(w_o|w_down)", P("tp", None)),
                      (".*", P())])
    step = hpf.shard_step(gpt.loss_for(config, tp_axis="tp"), mesh=mesh, optimizer=hpf.optim.adamw(lr=LR),
                          param_specs=even, fsdp_axes=())
    with step:
        state = step.init(functools.partial(gpt.init, config), key=R.key(0))
        step(state, gpt.global_batch(config, 2, 0, 0))


@pytest.mark.slow
def test_a_tp_size_that_splits_a_head_is_a_named_error():
    with pytest.raises(RankError, match="splits the 5 heads of w_qkv mid-head"):
        launch(_odd_heads, 2, timeout=120)


# -- the planner, the memory model, the simulator and the search know the tp axis -------------------
def _plans(config="small"):
    """gpt ``config``'s plan on dp=2 x tp=2 (tensor parallel) and on dp=2 alone."""
    cfg = gpt.CONFIGS[config]
    params = gpt.init(cfg, device="meta")
    tp = step_plan(params, hpf.Mesh({"dp": 2, "tp": 2}), gpt.param_specs(cfg, "tp", ("dp",)), fsdp_axes=("dp",))
    return cfg, tp, step_plan(params, hpf.Mesh({"dp": 2}))


def test_no_unit_is_gathered_along_the_tp_axis():
    """Every bucket is gathered over dp alone, and holds a rank's tp block of each split param: a
    block unit gathers half its split weights (and its norms whole), never the full unit."""
    cfg, tp, dp = _plans()
    assert all("tp" not in b.shard_axes + b.replicate_axes and b.shard_axes == ("dp",) for b in tp.buckets)

    def gathered(plan, unit):
        return sum(plan.buckets[b].padded_numel for b in plan.units[unit].buckets)
    split = sum(math.prod(dp.slots[p].local_shape) for p in dp.slot_paths("blocks/0") if tp.slots[p].split_axes)
    assert split and gathered(tp, "blocks/0") == gathered(dp, "blocks/0") - split // 2  # (both pad to even)
    assert gathered(tp, "<root>") == gathered(dp, "<root>")  # embedding, head: replicated over tp
    report_tp, report_dp = PlanReport.of(tp), PlanReport.of(dp)
    assert report_tp.peak_gathered_bytes < report_dp.peak_gathered_bytes
    assert report_tp.comm["all_gather"]["fast"] + report_tp.comm["all_gather"]["slow"] < \
        report_dp.comm["all_gather"]["fast"] + report_dp.comm["all_gather"]["slow"]


def test_the_memory_model_counts_a_tp_rank_s_share():
    """hpf.memory on a tp plan: the activations of a block are one rank's heads and MLP columns (the
    norms and the residual stream whole), the params its local blocks."""
    cfg, tp, dp = _plans()
    whole, share = gpt.activations(cfg, 4), gpt.activations(cfg, 4, tp=2)
    n, d, f = 4 * cfg.seq_len, cfg.d_model, cfg.d_ff
    assert whole.blocks[0][0] - share.blocks[0][0] == n * ((4 * d + 2 * f) * 4 // 2 + 4 * cfg.n_heads // 2)
    assert share.blocks[0][1] == whole.blocks[0][1] and share.root_saved == whole.root_saved
    mem_tp = memory.predict(gpt, cfg, tp, memory.state_report(tp)[0], local_batch=4, topology="flat")
    mem_dp = memory.predict(gpt, cfg, dp, memory.state_report(dp)[0], local_batch=4, topology="flat")
    assert mem_tp.total < mem_dp.total and mem_tp.parts["params"] < mem_dp.parts["params"]
    assert memory.step_memory(memory.state_report(tp)[0], tp, share, comm="flat").total == mem_tp.total


def test_the_simulator_and_the_search_know_the_tp_axis():
    """hpf.sim on dp=2 x tp=2: a block's compute is half a rank's (the global batch split over 2 data
    ranks, not 4), its psums run forward and backward; the search carves tp off the last axis and
    can always keep tp=1 (its plans are a superset of those without tensor parallelism)."""
    kw = dict(model="gpt", topology="flat")
    tp = sim.simulate("1b", {"dp": 2, "tp": 2}, "h100", local_batch=2, **kw)  # 2 sequences per tp group
    dp = sim.simulate("1b", {"dp": 4}, "h100", local_batch=1, **kw)  # the same 4 global sequences
    assert tp.tokens == dp.tokens
    assert tp.compute_s == pytest.approx(dp.compute_s, rel=0.15)  # the same FLOPs per rank but the root's
    plan = sim.plan_for(gpt, gpt.CONFIGS["1b"], hpf.Mesh({"dp": 2, "tp": 2}))
    assert plan.compute_axes == ("tp",) and all(b.shard_axes == ("dp",) for b in plan.buckets)
    result = search.search("gpt", "small", {"dp": 4}, "h100", global_batch=8)
    tried = {r.candidate.tp for r in search.candidates("gpt", "small", {"dp": 4}, "h100", global_batch=8)}
    assert tried == {1, 2, 4}
    held = search.search("gpt", "small", {"dp": 4}, "h100", global_batch=8, fixed={"tp": 1})
    assert result.best.step_s <= held.best.step_s * (1 + search.SAME_WITHIN)
    two = next(r for r in result.ranked if r.candidate.tp == 2) if any(r.candidate.tp == 2 for r in result.ranked) \
        else None
    if two is not None:
        args = two.candidate.step_args("gpt", gpt.CONFIGS["small"], hpf.Mesh({"dp": 4}))
        assert args["mesh"].axis_names == ("dp", "tp") and args["fsdp_axes"] == ("dp",)
        assert "tensor parallel over 2" in two.candidate.label()


def test_the_tp_psums_are_in_the_simulated_step():
    """A tp axis adds each block's psums (forward and backward) to the compute thread, and the
    all-reduce of the grads replicated over tp after the reductions: a slower link makes the step
    slower by their time alone."""
    import dataclasses as dc

    hw = sim.hardware("h100")  # tp is the fast tier there: only the psums use its link (FSDP runs over dp)
    slow = hw.replace(fast=dc.replace(hw.fast, beta=hw.fast.beta / 100))
    kw = dict(model="gpt", topology="flat", local_batch=2)
    fast_step, slow_step = (sim.simulate("1b", {"dp": 2, "tp": 2}, h, **kw).step_s for h in (hw, slow))
    cfg = gpt.CONFIGS["1b"]
    psums = 4 * cfg.n_layers * (2 * cfg.seq_len * cfg.d_model * 4)  # 4 per block a step, [2 x T x D] fp32 each
    plan = sim.plan_for(gpt, cfg, hpf.Mesh({"dp": 2, "tp": 2}))
    # embed, head (the root's shard) and each block's two norms (whole on dp position 0, which shares
    # the block's bucket with the split weights): their fp32 grads are partial sums over tp
    root = plan.buckets[plan.units["<root>"].buckets[0]]
    partial = (root.shard_numel + cfg.n_layers * 2 * cfg.d_model) * 4
    assert slow_step - fast_step == pytest.approx((psums + partial) * (99 / hw.fast.beta), rel=0.02)  # 2(p-1)/p = 1


def _compose(rank):
    """GPT on dp=2 x tp=2 with each option the issue names, a few steps each against the one-process
    reference; validation mode on the built-in model run without its psums (tp_axis dropped)."""
    from hpf.models import mesh_for
    from hpf.precision import SlowPrecision

    module, config = MODELS["gpt"]
    mesh, out = hpf.Mesh({"dp": 2, "tp": 2}), {}
    rows = slice(rank // 2 * BATCH // 2, (rank // 2 + 1) * BATCH // 2)  # (rank = dp x 2 + tp)
    specs = module.param_specs(config, "tp", ("dp",))

    def run(steps, loss_fn, mesh=mesh, specs=specs, fsdp=("dp",), model=(module, config), **kw):
        with hpf.shard_step(loss_fn, mesh=mesh, optimizer=hpf.optim.adamw(lr=LR), param_specs=specs, fsdp_axes=fsdp,
                            **kw) as step:
            state = step.init(functools.partial(model[0].init, model[1]), key=R.key(0))
            losses = []
            for s in range(steps):
                state, m = step(state, gpt.global_batch(model[1], BATCH, 0, s)[rows])
                losses.append(m["loss"])
            return losses
    out["recompute+accumulate"] = run(4, module.loss_for(config, "all", tp_axis="tp"), accumulate=2)
    out["sequence parallel+recompute"] = run(4, module.loss_for(config, "every_other", tp_axis="tp",
                                                                sequence_parallel=True))
    out["bf16"] = run(4, module.loss_for(config, tp_axis="tp"), mixed_precision="bf16")
    out["compile"] = run(2, module.loss_for(config, compile=True, tp_axis="tp"))
    two_tier = mesh_for({"node": 2, "local": 1, "tp": 2})  # tp in the fast tier with local, node the slow one
    out["int8 slow tier"] = run(4, module.loss_for(config, tp_axis="tp"), mesh=two_tier,
                                specs=module.param_specs(config, "tp", ("node", "local")), fsdp=("node", "local"),
                                topology=hpf.Topology.with_slow(SlowPrecision.parse("int8")))
    tiny = moe.CONFIGS["tiny"]  # its attention over tp, its experts over ep = dp
    out["moe"] = run(4, moe.loss_for(tiny, "dp", tp_axis="tp"), specs=specs_for(moe, tiny, "dp", ("dp",), "tp"),
                     model=(moe, tiny))
    try:
        run(1, module.loss_for(config), mode="validate")  # (tp_axis dropped: the row-parallel sums are missing)
        out["validate"] = "no error"
    except Exception as e:  # noqa: BLE001 - the test names the type
        out["validate"] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.slow
def test_tensor_parallelism_composes_with_the_step_s_options():
    got = launch(_compose, 4, timeout=280)[0]
    module, config = MODELS["gpt"]
    ref = lambda dtype: adamw_training(module.loss_for(config), module.init(config, R.key(0)),  # noqa: E731
                                       lambda s: gpt.global_batch(config, BATCH, 0, s), 4, lr=LR, compute_dtype=dtype)[0]
    fp32, bf16 = ref(torch.float32), ref(torch.bfloat16)
    for name in ("recompute+accumulate", "sequence parallel+recompute"):
        torch.testing.assert_close(torch.tensor(got[name]), torch.tensor(fp32), rtol=1e-5, atol=0, msg=name)
    torch.testing.assert_close(torch.tensor(got["compile"]), torch.tensor(fp32[:2]), rtol=1e-4, atol=0)
    torch.testing.assert_close(torch.tensor(got["bf16"]), torch.tensor(bf16), rtol=1e-2, atol=0)  # bf16's sums
    torch.testing.assert_close(torch.tensor(got["int8 slow tier"]), torch.tensor(fp32), rtol=1e-2, atol=0)
    assert got["int8 slow tier"] != fp32  # (int8 gathers do round)
    assert got["validate"].startswith("PartialSumError") and "psum" in got["validate"], got["validate"]
    tiny = moe.CONFIGS["tiny"]
    want = adamw_training(moe.loss_for(tiny), moe.init(tiny, R.key(0)), lambda s: moe.global_batch(tiny, BATCH, 0, s),
                          4, lr=LR)[0]
    torch.testing.assert_close(torch.tensor(got["moe"]), torch.tensor(want), rtol=1e-5, atol=0)


# -- any tp size on any config: uneven splits in whole heads, replicated key heads -----------------
def _config(model, heads, kv, head_dim, d_ff):
    if model == "gpt":
        return gpt, gpt.GPTConfig(vocab_size=11, seq_len=5, d_model=heads * head_dim, n_layers=1, n_heads=heads, d_ff=d_ff)
    return llama, llama.LlamaConfig(vocab_size=11, seq_len=5, d_model=8, n_layers=1, n_heads=heads, n_kv_heads=kv,
                                    d_ff=d_ff, head_dim=head_dim)


def _branches(module, config, blk, h):
    """The attention's and the MLP's row-parallel products of one block on the normed stream h:
    what each tp rank computes before the psum (the sum over ranks is the one-process value)."""
    if module is gpt:
        return gpt.attention(blk, h, config.n_heads)[0] + gpt.mlp(blk, h)
    cos, sin = llama.rope_cos_sin(config, h.shape[1], h.device, h.dtype)
    up = torch.nn.functional.silu(torch.nn.functional.linear(h, blk["w_gate"])) * torch.nn.functional.linear(h, blk["w_up"])
    return llama.attention(blk, h, cos, sin, config, "tp")[0] + torch.nn.functional.linear(up, blk["w_down"])


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.sampled_from(["gpt", "llama"]), st.integers(1, 4), st.integers(1, 4), st.sampled_from([2, 4]),
       st.integers(1, 13), st.integers(1, 8), st.integers(0, 2 ** 16))
def test_any_split_of_heads_kv_heads_and_mlp_gives_the_one_process_branches_and_grads(model, kv, group, head_dim, d_ff,
                                                                                     tp, seed):
    """Over (heads, kv heads, d_ff, tp): the plan's blocks (uneven in whole heads, key heads replicated
    where tp does not divide them), each rank's branches summed over the ranks, equal the one-process
    branches, and each rank's grads put at its block's place (summed where replicated) equal the
    one-process grads. In fp64: both sides are the same dot products of length <= 64 rounded in
    another order, so they differ by at most 64 u |a||b| per product (u = 2^-53, 7e-15 relative), far
    under 1e-9 of the magnitudes, while a wrong head, key head or column moves them by O(1) of it."""
    heads = kv * group  # (gpt: no grouped heads, kv = heads)
    kv = kv if model == "llama" else heads
    if tp > heads:
        with pytest.raises(ValueError, match=f"n_heads={heads}: use tp={heads} or less"):
            _config(model, heads, kv, head_dim, d_ff)[0].param_specs(_config(model, heads, kv, head_dim, d_ff)[1],
                                                                     "tp", (), tp=tp)
        return
    module, config = _config(model, heads, kv, head_dim, d_ff)
    torch.manual_seed(seed)
    full = {k: torch.randn(v.shape, dtype=torch.float64, requires_grad=True)
            for k, v in module.init(config)["blocks"][0].items() if v.dim() == 2}  # (the norms: not in the branches)
    h = torch.randn(2, config.seq_len, config.d_model, dtype=torch.float64)
    cot = torch.randn(2, config.seq_len, config.d_model, dtype=torch.float64)
    want = _branches(module, config, full, h)
    want_grads = torch.autograd.grad((want * cot).sum(), list(full.values()))
    want = want.detach()
    mesh = hpf.Mesh({"tp": tp})
    plan = step_plan({"blocks": [full]}, mesh, module.param_specs(config, "tp", (), tp=tp), fsdp_axes=())
    got, grads = torch.zeros_like(want), {k: torch.zeros_like(v, requires_grad=False) for k, v in full.items()}
    for r in range(tp):
        blk = {}
        for k, v in full.items():
            path = f"blocks/0/{k}"
            stored = plan.local_block(path, v.detach(), r)
            assert stored.shape == plan.slots[path].local_shape
            block = stored[tuple(slice(0, n) for n in plan.block_shape(path, r))]
            assert not stored.count_nonzero() - block.count_nonzero()  # the padding is zeros
            blk[k] = block.clone().requires_grad_()
        with spmd(SPMD(mesh, r, (), virtual=True)):
            part = _branches(module, config, blk, h)
        got += part.detach()
        for (k, v), g in zip(blk.items(), torch.autograd.grad((part * cot).sum(), list(blk.values()))):
            at = tuple(slice(o, o + n) for o, n in zip(plan.block_offsets(f"blocks/0/{k}", r), g.shape))
            grads[k][at] += g
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9 * scale)
    for (k, g), w in zip(grads.items(), want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-9 * w.abs().max().item(), msg=k)


DEFAULT = {"gpt": (gpt, gpt.CONFIGS["tiny"]), "llama": (llama, llama.CONFIGS["tiny"])}  # 5 heads, d_ff 38; GQA 6 on 2, d_ff 37


def _train_default(rank, axes, root):
    """The default configs on ``axes`` for STEPS steps, by hpf.models.layout (what hpf train runs);
    each saves its state at the end."""
    from hpf.models import layout

    mesh, out = hpf.Mesh(axes), {}
    specs_mesh = mesh.axis_size("tp")
    data = tuple(a for a in mesh.axis_names if a != "tp")
    index, rows = mesh.group_index(data, rank), BATCH // mesh.axis_size(data)
    for name, (module, config) in DEFAULT.items():
        specs, fsdp = layout(module, config, mesh.axis_names, tp=specs_mesh)
        with hpf.shard_step(module.loss_for(config, tp_axis="tp"), mesh=mesh, optimizer=hpf.optim.adamw(lr=LR),
                            param_specs=specs, fsdp_axes=fsdp) as step:
            state = step.init(functools.partial(module.init, config), key=R.key(0))
            losses = []
            for s in range(STEPS):
                state, m = step(state, gpt.global_batch(config, BATCH, 0, s)[index * rows:(index + 1) * rows])
                losses.append(m["loss"])
            step.save(state, f"{root}/{name}")
            again, _ = step.restore(f"{root}/{name}")
            out[name] = (losses, step.full_params(state), _same(step.full_params(again), step.full_params(state)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("axes", [{"tp": 4}, {"dp": 2, "tp": 2}], ids=["tp4", "dp2xtp2"])
def test_the_default_configs_train_tensor_parallel_split_unevenly_as_one_process(axes, tmp_path):
    """gpt tiny's 5 heads split 2/1/1/1 and 3/2, llama tiny's 6 heads 2/2/1/1 with its 2 key heads
    replicated over tp=4, its d_ff 37 as 10/9/9/9 and 19/18: the losses and params of plain torch on
    the whole model in one process, and a checkpoint of the padded blocks holds the params alone."""
    runs = launch(_train_default, 4, axes, str(tmp_path), timeout=280)
    for name, (module, config) in DEFAULT.items():
        want_losses, _, want_params = adamw_training(module.loss_for(config), module.init(config, R.key(0)),
                                                     lambda s, c=config: gpt.global_batch(c, BATCH, 0, s), STEPS, lr=LR)
        for got in runs:  # the same bound and reason as test_tensor_parallel_training_equals_one_process
            torch.testing.assert_close(torch.tensor(got[name][0]), torch.tensor(want_losses), rtol=1e-5, atol=0,
                                       msg=name)
            assert got[name][2], f"{name}: the restored state differs"
        for path, x in zip(*hpf.tree.flatten(runs[0][name][1])[:2]):
            torch.testing.assert_close(x, want_params[path], rtol=0, atol=LR * 5e-3, msg=f"{name} {path}")
        assert _same(hpf.checkpoint.load_params(f"{tmp_path}/{name}"), runs[0][name][1])


def test_a_tp_size_larger_than_the_heads_is_refused_in_the_words_of_the_config():
    with pytest.raises(ValueError, match=r"n_heads=5: use tp=5 or less \(e.g. --mesh dp=2,tp=4 on 8 ranks\)"):
        specs_for(gpt, gpt.CONFIGS["tiny"], None, ("dp",), "tp", 8)
    with pytest.raises(ValueError, match="n_heads=6: use tp=6 or less"):
        specs_for(llama, llama.CONFIGS["tiny"], None, ("dp",), "tp", 8)
    with pytest.raises(hpf.spec.IndivisibleSpecError, match="'w' dim 1 has size 15, not whole blocks of 4"):
        step_plan({"w": torch.empty(2, 15, device="meta")}, hpf.Mesh({"tp": 4}), hpf.P(None, "tp", granule=(1, 4)),
                  fsdp_axes=())
    with pytest.raises(hpf.spec.IndivisibleSpecError, match="or let it split unevenly with P"):
        step_plan({"w": torch.empty(2, 15, device="meta")}, hpf.Mesh({"tp": 4}), hpf.P(None, "tp"), fsdp_axes=())


def test_a_block_s_norms_share_its_bucket_with_its_tp_split_weights():
    """One bucket per block unit (the norms, replicated over tp, ride with the split weights: one
    gather and one reduce-scatter a block, not two of each), its grad norm counting each norm
    weight once (2 tp ranks hold it) and each split weight's block on its own rank."""
    cfg, tp, dp = _plans()
    for unit in tp.units:
        assert len(tp.units[unit].buckets) == len(dp.units[unit].buckets) == 1, unit
    b = tp.buckets[tp.slots["blocks/0/norm1"].bucket]
    assert b is tp.buckets[tp.slots["blocks/0/w_qkv"].bucket] and b.split_axes == ("tp",)
    assert {p: tp.replicas(s) for p, s in tp.slots.items() if p.startswith("blocks/0/")} == {
        "blocks/0/norm1": 2, "blocks/0/norm2": 2, "blocks/0/w_qkv": 1, "blocks/0/w_o": 1, "blocks/0/w_up": 1,
        "blocks/0/w_down": 1}
    norms = 2 * cfg.d_model  # (the slots in tree order: norm1, norm2 first)
    assert b.runs(0, tp.partial_axes) == [(slice(0, norms), ("tp",)), (slice(norms, b.shard_numel), ())]
    assert b.runs(1, tp.partial_axes) == [(slice(0, b.shard_numel), ())]


CLIP = 0.05


def _clipped(rank):
    mesh = hpf.Mesh({"dp": 2, "tp": 2})
    index = mesh.group_index(("dp",), rank)
    module, config = MODELS["gpt"]
    step = hpf.shard_step(module.loss_for(config, tp_axis="tp"), mesh=mesh, optimizer=hpf.optim.adamw(lr=LR),
                          param_specs=module.param_specs(config, "tp", ("dp",)), fsdp_axes=("dp",),
                          max_grad_norm=CLIP)
    with step:
        state, norms = step.init(functools.partial(module.init, config), key=R.key(0)), []
        for s in range(4):
            state, m = step(state, gpt.global_batch(config, BATCH, 0, s)[index * BATCH // 2:(index + 1) * BATCH // 2])
            norms.append(m["grad_norm"])
        return norms, step.full_params(state)


@pytest.mark.slow
def test_clipping_on_dp2_x_tp2_equals_one_process():
    """max_grad_norm with a block's norms and split weights in one bucket: the global grad norm
    (each replicated norm counted once, not once per tp rank) and the clipped training equal
    clip_grad_norm_ in one process."""
    module, config = MODELS["gpt"]
    _, want_norms, want = adamw_training(module.loss_for(config), module.init(config, R.key(0)),
                                         lambda s: gpt.global_batch(config, BATCH, 0, s), 4, lr=LR,
                                         max_grad_norm=CLIP)
    assert min(want_norms) > CLIP, "the reference must clip on every step for this test to mean anything"
    for norms, params in launch(_clipped, 4, timeout=200):
        # fp32 sums of squares split over ranks and pieces: a few ulps of the norm (1e-5 relative)
        torch.testing.assert_close(torch.tensor(norms, dtype=torch.float64),
                                   torch.tensor(want_norms, dtype=torch.float64), rtol=1e-5, atol=0)
        for path, x in zip(*hpf.tree.flatten(params)[:2]):
            torch.testing.assert_close(x, want[path], rtol=0, atol=LR * 5e-3, msg=path)
