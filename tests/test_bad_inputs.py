"""Misuse gets a clear error before it corrupts anything (issue 11), or is accepted and gives
plain torch's result.

:data:`CASES` is the catalogue: case name -> (what triggers it, the error type, words the
message must contain: the path / argument and the fix). Most run in one process (a mesh of
size 1, or plans on meta tensors); the cross-rank ones (values differing at init, a donated
state, uneven batches, a non-finite loss on one rank, ``full_params(rank=0)``) run in one
``hpf.launch`` of 2 ranks. The accepted cases are compared with tests/references.py.
"""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import optree
import torch
import torch.nn.functional as F

import hpf
from hpf import P
from hpf.misuse import clean_params, finite_or_none
from hpf.launcher import launch
from hpf.spec import SpecTreeError
from references import adamw_training

ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
ONE = hpf.Mesh({"dp": 1})


def params(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.5  # noqa: E731
    return {"w_in": r(4, 8), "blocks": [{"w": r(8, 8), "b": r(8)} for _ in range(2)], "head": r(8, 1)}


def loss_fn(p, batch):
    h = batch["x"] @ p["w_in"]
    for blk in p["blocks"]:
        h = torch.tanh(h @ blk["w"] + blk["b"])
    return F.mse_loss(h @ p["head"], batch["y"])


def batch(step, n=8):
    g = torch.Generator().manual_seed(100 + step)
    return {"x": torch.randn(n, 4, generator=g), "y": torch.randn(n, 1, generator=g)}


def _step_on_meta():
    """init takes meta params (shapes only, for step.restore); a step before the restore would
    train zeros, so it raises."""
    step = make()
    state = step.init(torch.utils._pytree.tree_map(lambda x: x.to("meta"), params()))
    step(state, batch(0))


def make(opt=None, loss=loss_fn, **kw):
    return hpf.shard_step(loss, optimizer=opt or hpf.optim.adamw(**ADAMW), **{"mesh": ONE, **kw})


def init(p=None, **kw):
    return make(**kw).init(params() if p is None else p)


def run(steps=3, opt=None, p=None, loss=loss_fn, batches=batch, **kw):
    step = make(opt, loss, **kw)
    state = step.init(params() if p is None else p)
    for s in range(steps):
        state, _ = step(state, batches(s))
    return step, state


def with_leaf(path, value):
    p = params()
    node = p
    *head, last = path.split("/")
    for k in head:
        node = node[int(k)] if isinstance(node, list) else node[k]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return p


def donated_reuse():
    step = make()
    s0 = step.init(params())
    step(s0, batch(0))
    step(s0, batch(1))


def foreign_state():
    """Step B given step A's state: the same number of shards, other sizes (it failed deep in
    gloo with 'invalid tensor size' on 2 ranks)."""
    a = make().init(params())
    wide = {**params(), "blocks": [{"w": torch.zeros(8, 8), "b": torch.zeros(8)}, {"w": torch.zeros(8, 8),
                                                                                 "b": torch.zeros(8)}],
            "head": torch.zeros(8, 2)}
    b = make(loss=lambda p, bt: loss_fn({**p, "head": p["head"][:, :1]}, bt))
    b.init(wide)
    b(a, batch(0))


def donated_full_params():
    step = make()
    s0 = step.init(params())
    s1, _ = step(s0, batch(0))
    step(s1, batch(1))
    step.full_params(s1)


def schedule(bad_step, value):
    return lambda s: value if s == bad_step else 1e-2


def nan_loss(p, b):
    return loss_fn(p, b) * float("nan")


def sqrt_at_zero(p, b):  # finite loss, inf grad: d sqrt(x)/dx at 0
    return loss_fn(p, b) + torch.sqrt(p["blocks"][1]["b"][0] * 0)


def one_proc_mesh2():
    hpf.shard_step(loss_fn, mesh=hpf.Mesh({"dp": 2}), optimizer=hpf.optim.adamw()).init(params())


def plan(param_specs=None, fsdp_axes=None, mesh=hpf.Mesh({"node": 2, "local": 2})):
    hpf.plan(torch.utils._pytree.tree_map(lambda x: x.to("meta"), params()), mesh, param_specs, fsdp_axes)


# name -> (trigger, error type, words the message must name)
CASES = {
    # params given to init
    "int leaf": (lambda: init(with_leaf("blocks/0/b", torch.arange(8))), TypeError,
                 ["'blocks/0/b'", "floating", "batch"]),
    "bool leaf": (lambda: init(with_leaf("head", torch.ones(8, 1, dtype=torch.bool))), TypeError,
                  ["'head'", "floating"]),
    "complex leaf": (lambda: init(with_leaf("head", torch.randn(8, 1, dtype=torch.complex64))), TypeError,
                     ["'head'", "complex64", "torch.view_as_real"]),  # AdamW's g*g was 1 lr off per step
    "python float leaf": (lambda: init(with_leaf("w_in", 3.0)), TypeError, ["'w_in'", "torch.as_tensor"]),
    "None leaf": (lambda: init(with_leaf("blocks/1/b", None)), TypeError, ["'blocks/1/b'", "tensor"]),
    # issue 45 item 6: one slot for both, the loss saw x where y was given (loss 5.0, plain torch 37.0)
    "paths a/b and a, b collide": (lambda: init({"a/b": torch.ones(2), "a": {"b": torch.full((2,), 3.0)}}),
                                   ValueError, ["('a', 'b')", "('a/b',)", "'a/b'", "Rename a key"]),
    "keys 0 and '0' collide": (lambda: hpf.plan({0: torch.ones(4), "0": torch.ones(4)}, hpf.Mesh({"dp": 4})),
                               ValueError, ["(0,)", "('0',)", "path '0'"]),
    "a step on meta params": (lambda: _step_on_meta(), RuntimeError, ["meta params", "step.restore"]),
    "empty block list": (lambda: init({**params(), "blocks": []}), ValueError, ["'blocks'", "empty list"]),
    "nested empty list": (lambda: init({**params(), "enc": {"layers": []}}), ValueError,
                          ["'enc/layers'", "empty list"]),
    # the loss function
    "loss is a float": (lambda: run(1, loss=lambda p, b: 1.0), TypeError, ["scalar tensor", "float"]),
    "loss of shape (2,)": (lambda: run(1, loss=lambda p, b: torch.stack([loss_fn(p, b)] * 2)), TypeError,
                           ["scalar tensor", "(2,)"]),
    "loss without params": (lambda: run(1, loss=lambda p, b: b["y"].sum()), ValueError,
                            ["does not depend on the params"]),
    "int loss": (lambda: run(1, loss=lambda p, b: (loss_fn(p, b) * 100).long()), TypeError,
                 ["torch.int64", "real floating-point"]),
    "zero count": (lambda: run(1, loss=lambda p, b: hpf.weighted(loss_fn(p, b) * 0, 0)), hpf.NonFiniteError,
                   ["global count is 0", "all padding", "on_nonfinite='skip'"]),  # not "lower the learning rate"
    "NaN loss": (lambda: run(1, loss=nan_loss), hpf.NonFiniteError, ["loss", "non-finite", "nothing was updated",
                                                                       "on_nonfinite"]),
    "inf grad, finite loss": (lambda: run(1, loss=sqrt_at_zero), hpf.NonFiniteError, ["grad norm", "validate"]),
    # issue 45 item 14: torch's hint was "Remove the torch.compiler.disable call", which the user cannot act on
    "fullgraph=True over unit reads": (lambda: run(1, loss=torch.compile(loss_fn, fullgraph=True, backend="eager")),
                                       RuntimeError, ["fullgraph=True", "graph break",
                                                      "torch.compile(block, fullgraph=True)"]),
    # learning rates and clipping
    "adamw lr nan": (lambda: hpf.optim.adamw(lr=float("nan")), ValueError, ["lr=nan", "finite"]),
    "adamw lr inf": (lambda: hpf.optim.adamw(lr=float("inf")), ValueError, ["lr=inf", "finite"]),
    "adamw lr < 0": (lambda: hpf.optim.adamw(lr=-1e-3), ValueError, ["lr=-0.001", ">= 0"]),
    "adamw schedule < 0": (lambda: run(3, opt=hpf.optim.adamw(lr=schedule(3, -0.1))), ValueError,
                           ["lr schedule", "-0.1", "step 3"]),
    "adamw schedule nan": (lambda: run(2, opt=hpf.optim.adamw(lr=schedule(1, float("nan")))), ValueError,
                           ["lr schedule", "nan", "step 1"]),
    "muon lr nan": (lambda: hpf.optim.muon(lr=float("nan")), ValueError, ["muon: lr=nan"]),
    "muon adamw_lr < 0": (lambda: hpf.optim.muon(adamw_lr=-1.0), ValueError, ["muon: adamw_lr=-1.0"]),
    "muon schedule < 0": (lambda: run(2, opt=hpf.optim.muon(lr=schedule(2, -0.5))), ValueError,
                          ["muon: lr schedule", "-0.5", "step 2"]),
    "muon adamw_lr schedule inf": (lambda: run(1, opt=hpf.optim.muon(adamw_lr=schedule(1, float("inf")))),
                                   ValueError, ["muon: adamw_lr schedule", "inf", "step 1"]),
    "max_grad_norm nan": (lambda: make(max_grad_norm=float("nan")), ValueError, ["max_grad_norm=nan", "finite"]),
    "max_grad_norm inf": (lambda: make(max_grad_norm=float("inf")), ValueError, ["max_grad_norm=inf", "None"]),
    "max_grad_norm 0": (lambda: make(max_grad_norm=0.0), ValueError, ["max_grad_norm=0.0", "> 0"]),
    "max_grad_norm < 0": (lambda: make(max_grad_norm=-1.0), ValueError, ["max_grad_norm=-1.0"]),
    # shard_step arguments
    "on_nonfinite unknown": (lambda: make(on_nonfinite="ignore"), ValueError, ["on_nonfinite='ignore'", "skip"]),
    "mode unknown": (lambda: make(mode="fast"), ValueError, ["mode='fast'", "production"]),
    "optimizer without update": (lambda: make(opt=object()), TypeError, ["init()", "hpf.optim.adamw"]),
    "mixed_precision bad name": (lambda: make(mixed_precision="bf32"), ValueError, ["'bf32'", "bf16"]),
    "mixed_precision int dtype": (lambda: make(mixed_precision=torch.int32), ValueError, ["torch.int32",
                                                                                           "torch.bfloat16"]),
    "mixed_precision number": (lambda: make(mixed_precision=16), ValueError, ["mixed_precision=16"]),
    "slow tier: int4 weights": (lambda: hpf.Topology(slow_weights="int4"), ValueError,
                                ["slow_weights='int4'", "'int8'", "grads only"]),
    "slow tier: unknown format": (lambda: hpf.Topology(slow_grads="int2"), ValueError, ["slow_grads='int2'", "'int4'"]),
    "slow tier: odd int4 block": (lambda: hpf.Topology(slow_grads="int4", slow_block=33), ValueError,
                                  ["slow_block=33", "even"]),
    "quantize: block does not divide": (lambda: __import__("hpf_kernels").quantize(torch.zeros(100), "int8", 64),
                                        ValueError, ["block size 64", "100 values", "pad"]),
    # specs and rules
    "bad regex in rules": (lambda: hpf.rules([(r"blocks/[0-9", P())]), hpf.SpecError,
                           ["'blocks/[0-9'", "regular expression"]),
    "rule maps to a str": (lambda: hpf.rules([(r".*", "dp")]), hpf.SpecError, ["'.*'", "hpf.P"]),
    "no rule matches": (lambda: plan(hpf.rules([(r"blocks/.*", P())])), hpf.SpecError, ["'head'", "catch-all"]),
    "spec names a non-axis": (lambda: plan(hpf.rules([(r".*", P("dp"))])), hpf.SpecError, ["'dp'", "mesh axis"]),
    "spec longer than dims": (lambda: plan(hpf.rules([(r"blocks/\d+/b", P("node", "local")), (r".*", P())])),
                              hpf.SpecError, ["'blocks/0/b'", "1 dims"]),
    "spec axis twice": (lambda: plan(hpf.rules([(r"blocks/\d+/w", P("local", "local")), (r".*", P())])),
                        hpf.SpecError, ["'blocks/0/w'", "'local'", "twice"]),
    "fsdp_axes non-axis": (lambda: plan(fsdp_axes="dq"), hpf.SpecError, ["'dq'", "not an axis"]),
    "spec tree of another structure": (lambda: plan({"w_in": P(), "head": P()}), SpecTreeError,
                                       ["blocks/0/w", "hpf.rules"]),
    # meshes and process groups
    "Mesh of a str": (lambda: hpf.Mesh("dp"), hpf.MeshError, ["dict", "hpf.Mesh({"]),
    "Mesh pairs name twice": (lambda: hpf.Mesh([("dp", 2), ("dp", 2)]), hpf.MeshError, ["twice"]),
    "Mesh empty": (lambda: hpf.Mesh({}), hpf.MeshError, ["at least one axis"]),
    "Mesh size 0": (lambda: hpf.Mesh({"dp": 0}), hpf.MeshError, ["'dp'", "positive"]),
    "fast_axes non-axis": (lambda: hpf.Mesh({"dp": 2}, fast_axes="local"), hpf.MeshError, ["'local'", "('dp',)"]),
    "2-rank mesh, no job": (one_proc_mesh2, hpf.MeshError, ["no process group", "hpf.launch",
                                                             "init_distributed()"]),
    # the train state
    "step before init": (lambda: make()(None, batch(0)), RuntimeError, ["step.init"]),
    "a foreign state": (foreign_state, ValueError, ["state shard 2", "'head'", "(48,)", "another step or plan"]),
    "donated state reused": (donated_reuse, hpf.DonatedStateError, ["already passed to step",
                                                                     "state, metrics = step(state, batch)"]),
    "full_params of a donated state": (donated_full_params, hpf.DonatedStateError, ["full_params",
                                                                                     "already passed"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name):
    trigger, kind, words = CASES[name]
    with pytest.raises(kind) as info:
        trigger()
    message = str(info.value)
    for w in words:
        assert w in message, f"{name}: {w!r} missing from: {message}"


def test_catalogue_is_big_enough():
    assert len(CASES) >= 40
    assert len({kind for _, kind, _ in CASES.values()}) >= 8


# -- the state stays as it was when a step raises ------------------------------------------------------------
def snapshot(state):
    return [t.clone() for t in state.params], [t.clone() for t in torch.utils._pytree.tree_leaves(state.opt_state)]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1]))


@pytest.mark.parametrize("overlap", [True, False])
def test_nonfinite_raise_leaves_state_and_step_usable(overlap):
    flag = {"nan": False}
    step = make(loss=lambda p, b: nan_loss(p, b) if flag["nan"] else loss_fn(p, b), overlap_optimizer=overlap)
    state = step.init(params())
    state, _ = step(state, batch(0))
    before = snapshot(state)
    flag["nan"] = True
    with pytest.raises(hpf.NonFiniteError):
        step(state, batch(1))
    assert same(before, snapshot(state))
    flag["nan"] = False  # the same state goes on, as if the bad step never happened
    state, m = step(state, batch(1))
    ref, _, _ = adamw_training(loss_fn, params(), batch, 2, **ADAMW)
    assert m["loss"] == pytest.approx(ref[1], rel=1e-5)


def test_nonfinite_grad_raise_with_overlap_keeps_state_finite():
    step = make(loss=sqrt_at_zero)
    state = step.init(params())
    with pytest.raises(hpf.NonFiniteError):
        step(state, batch(0))
    assert all(torch.isfinite(t).all() for t in state.params)


def test_skip_leaves_state_unchanged_and_reports():
    bad = {1}
    step = make(loss=lambda p, b: nan_loss(p, b) if b["step"] in bad else loss_fn(p, b), on_nonfinite="skip")
    state = step.init(params())
    losses = []
    for s in range(3):
        b = {**batch(s), "step": s}
        before = snapshot(state)
        state, m = step(state, b)
        assert m["skipped"] == (s in bad)
        if s in bad:
            assert same(before, snapshot(state)) and math.isnan(m["loss"])
        else:
            losses.append(m["loss"])
    # the skipped step is as if it never was: steps 0 and 2 match the reference's steps 0 and 1 on those batches
    ref, _, _ = adamw_training(loss_fn, params(), lambda s: batch([0, 2][s]), 2, **ADAMW)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)


# -- accepted inputs give plain torch's result ---------------------------------------------------------------
def hpf_losses(steps=3, p=None, loss=loss_fn, batches=batch, **kw):
    step = make(kw.pop("opt", None), loss, **kw)
    state = step.init(params() if p is None else p)
    out = []
    for s in range(steps):
        state, m = step(state, batches(s))
        out.append(m["loss"])
    full = step.full_params(state)
    step.close()
    return out, full


def check_against_reference(losses, full, ref_losses, ref_params, rtol=1e-5, atol=2e-5):
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol)
    for path, x in zip(hpf.tree.paths(full), hpf.tree.flatten(full)[1]):
        torch.testing.assert_close(x, ref_params[path], rtol=rtol, atol=atol, msg=path)


def test_nn_parameter_and_requires_grad_leaves_are_detached():
    """Every leaf an nn.Parameter (or requiring grad): all trained, as plain tensors would be."""
    p = optree.tree_map(torch.nn.Parameter, params())
    losses, full = hpf_losses(p=p)
    ref_l, _, ref_p = adamw_training(loss_fn, params(), batch, 3, **ADAMW)
    check_against_reference(losses, full, ref_l, ref_p)
    assert not any(x.requires_grad for x in hpf.tree.flatten(clean_params(p))[1])


def test_leaves_beside_params_that_require_grad_are_frozen_as_in_torch():
    """Some leaves require grad, the others do not: torch trains only the first (issue 28, item 3)."""
    p = params()
    p["w_in"] = torch.nn.Parameter(p["w_in"])
    p["blocks"][0]["w"].requires_grad_()
    losses, full = hpf_losses(p=p)
    ref_l, _, ref_p = adamw_training(loss_fn, params(), batch, 3, trainable=lambda path: path in ("w_in", "blocks/0/w"),
                                     **ADAMW)
    check_against_reference(losses, full, ref_l, ref_p)
    assert torch.equal(full["head"], params()["head"]), "a frozen leaf moved"


@pytest.mark.parametrize("kw", [
    dict(topology=hpf.Topology()),
    dict(mesh=hpf.Mesh({"dp": 1, "tp": 1}), fsdp_axes=("dp",),
         param_specs=hpf.rules([(r"blocks/\d+/w", P("dp", "tp")), (r".*", P())])),
], ids=["two-tier topology", "size-1 tp axis"])
def test_one_process_runs_need_no_process_group(kw):
    """A 1-process run has no process group: a two-tier topology and size-1 axes must not ask for one."""
    losses, full = hpf_losses(**kw)
    ref_l, _, ref_p = adamw_training(loss_fn, params(), batch, 3, **ADAMW)
    check_against_reference(losses, full, ref_l, ref_p)


def test_loss_of_shape_1_is_a_scalar():
    losses, full = hpf_losses(loss=lambda p, b: loss_fn(p, b).reshape(1))
    ref_l, _, ref_p = adamw_training(loss_fn, params(), batch, 3, **ADAMW)
    check_against_reference(losses, full, ref_l, ref_p)


def test_dtype_mixed_precision_and_fp32_batch_under_bf16():
    """mixed_precision=torch.bfloat16 is "bf16"; an fp32 batch is cast like FSDP2's policy casts inputs."""
    by_dtype = hpf_losses(mixed_precision=torch.bfloat16)
    by_name = hpf_losses(mixed_precision="bf16", batches=lambda s: {k: v.to(torch.bfloat16) for k, v in batch(s).items()})
    assert by_dtype[0] == by_name[0]
    ref_l, _, ref_p = adamw_training(loss_fn, params(), lambda s: {k: v.to(torch.bfloat16) for k, v in batch(s).items()},
                                     3, compute_dtype=torch.bfloat16, **ADAMW)
    # bf16 compute: the sharded run reduces grads in fp32, the reference accumulates them through bf16 casts
    check_against_reference(*by_dtype, ref_l, ref_p, rtol=2e-2, atol=2e-2)


def test_int_batch_leaves_stay_int_under_bf16():
    seen = {}

    def loss(p, b):
        seen["idx"], seen["x"] = b["idx"].dtype, b["x"].dtype
        return loss_fn(p, b)
    hpf_losses(1, loss=loss, mixed_precision="bf16", batches=lambda s: {**batch(s), "idx": torch.arange(3)})
    assert seen == {"idx": torch.int64, "x": torch.bfloat16}


def test_string_axes_and_mesh_pairs():
    mesh = hpf.Mesh([("node", 2), ("local", 2)], fast_axes="local")
    assert mesh == hpf.Mesh({"node": 2, "local": 2}) and mesh.fast_axes == ("local",)
    meta = torch.utils._pytree.tree_map(lambda x: x.to("meta"), params())
    assert hpf.plan(meta, mesh, fsdp_axes="local").fsdp_axes == ("local",)
    from hpf.planning import step_plan
    assert step_plan(meta, mesh, fsdp_axes="local").fsdp_axes == ("local",)


def test_muon_with_only_vectors_is_adamw():
    vec = {"a": torch.randn(5, generator=torch.Generator().manual_seed(1)), "blocks": [{"b": torch.randn(5)}]}
    loss = lambda p, b: ((p["a"] * p["blocks"][0]["b"] - b) ** 2).mean()  # noqa: E731
    step = make(opt=hpf.optim.muon(adamw_lr=1e-2), loss=loss)
    state = step.init(vec)
    losses = []
    for s in range(3):
        state, m = step(state, torch.full((5,), float(s)))
        losses.append(m["loss"])
    ref_l, _, ref_p = adamw_training(loss, vec, lambda s: torch.full((5,), float(s)), 3, lr=1e-2, betas=(0.9, 0.95),
                                     eps=1e-8, weight_decay=0.0)
    check_against_reference(losses, step.full_params(state), ref_l, ref_p)


def test_metrics_records_are_valid_json():
    record = finite_or_none({"loss": float("nan"), "grad_norm": float("inf"), "step": 3, "step_s": 0.1})
    assert json.loads(json.dumps(record, allow_nan=False)) == {"loss": None, "grad_norm": None, "step": 3,
                                                              "step_s": 0.1}


@pytest.mark.slow
def test_hpf_train_exits_nonzero_on_nonfinite_loss(tmp_path, monkeypatch, capsys):
    """The launched ranks are forked, so a patched loss reaches them."""
    import dataclasses

    from hpf import cli
    from hpf.models import gpt
    from hpf.models.spec import dense_loss
    real = gpt.loss_for

    def loss_for(config, **kw):
        inner, calls = real(config, **{**kw, "weighted": False}), [0]  # a mean, to multiply by NaN

        def loss(p, b):
            calls[0] += 1
            return inner(p, b) * (float("nan") if calls[0] == 3 else 1.0)
        return loss
    monkeypatch.setattr(gpt, "SPEC", dataclasses.replace(gpt.SPEC, loss=dense_loss(loss_for)))
    rc = cli.main(["train", "--world-size", "1", "--steps", "5", "--batch-size", "2", "--topology", "flat",
                   "--out", str(tmp_path / "run"), "--timeout", "120"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "NonFiniteError" in err[0], err
    records = cli.read_metrics(tmp_path / "run" / "metrics.jsonl")  # valid JSON, the steps before the bad one
    assert [r["step"] for r in records] == [1, 2]


# -- across ranks: one launch of 2 ranks --------------------------------------------------------------------
def _expect(kind, fn, *words):
    try:
        fn()
    except kind as e:
        missing = [w for w in words if w not in str(e)]
        return f"missing {missing} in {e}" if missing else "ok"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def _ranks(rank):
    mesh = hpf.Mesh({"dp": 2})
    out = {}
    mk = lambda **kw: hpf.shard_step(kw.pop("loss", loss_fn), mesh=mesh, optimizer=hpf.optim.adamw(**ADAMW), **kw)  # noqa: E731
    # different values at init: the model would be a mix of the ranks' params
    p = params()
    if rank == 1:
        p["blocks"][1]["w"][2, 3] += 1e-3
    out["values differ"] = _expect(hpf.ParamsMismatchError, lambda: mk().init(p), "'blocks/1/w'", "same full params")
    q = params()
    if rank == 1:
        q["head"] = torch.zeros(8, 2)
    out["shapes differ"] = _expect(hpf.ParamsMismatchError, lambda: mk().init(q), "head", "same full params tree")
    # a donated state used again
    step = mk(fsdp_axes="dp")
    s0 = step.init(params())
    s1, _ = step(s0, batch(rank))
    out["donated"] = _expect(hpf.DonatedStateError, lambda: step(s0, batch(rank)), "already passed to step")
    # uneven local batches: raise (a mean of means would be silently wrong)
    out["uneven"] = _expect(hpf.UnevenBatchError, lambda: step(s1, batch(rank, n=8 if rank == 0 else 6)),
                            "differ in shape", "evenly")
    # a NaN loss on rank 1 only: both ranks raise, no rank's state moves
    before = [t.clone() for t in s1.params]
    out["nan on one rank"] = _expect(hpf.NonFiniteError, lambda: step(s1, {**batch(rank), "x": batch(rank)["x"] *
                                                                          (float("nan") if rank else 1.0)}),
                                     "non-finite", "nothing was updated")
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, s1.params))
    # the state goes on; full_params on rank 0 only (every rank calls it)
    s2, m = step(s1, batch(rank))
    full = step.full_params(s2, rank=0)
    out["full on rank 0"] = (full is not None) == (rank == 0)
    return out, m["loss"], [x.numpy() for x in hpf.tree.flatten(step.full_params(s2))[1]]


@pytest.mark.slow
def test_across_two_ranks():
    results = launch(_ranks, 2, timeout=240)
    for out, _, _ in results:
        assert out == {"values differ": "ok", "shapes differ": "ok", "donated": "ok", "uneven": "ok",
                       "nan on one rank": "ok", "unchanged": True, "full on rank 0": True}, out
    # the two good steps are plain torch's two steps on the global batches (rank 0's rows, then rank 1's)
    glob = lambda s: {k: torch.cat([batch(0)[k], batch(1)[k]]) for k in ("x", "y")}  # noqa: E731
    ref_l, _, ref_p = adamw_training(loss_fn, params(), glob, 2, **ADAMW)
    assert results[0][1] == pytest.approx(ref_l[1], rel=1e-5)
    for x, want in zip(results[0][2], ref_p.values()):
        np.testing.assert_allclose(x, want.numpy(), rtol=1e-5, atol=2e-5)


_TORCHRUN_RANK = """
import torch, hpf, torch.distributed as dist
step = hpf.shard_step(lambda p, b: (p['w'] ** 2).sum(), mesh=hpf.Mesh({'dp': 2}), optimizer=hpf.optim.adamw())
state = step.init({'w': torch.ones(4)})
print('initialized', dist.is_initialized(), dist.get_world_size())
"""


@pytest.mark.slow
def test_init_starts_the_process_group_under_torchrun(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", _TORCHRUN_RANK], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all("initialized True 2" in o for o in outs), outs


def test_standalone_adamw_updates_complex_params_as_torch_does():
    """Issue 45 item 8: g*g of a complex g is not |g|^2 (off by about lr from torch per step)."""
    g = torch.Generator().manual_seed(0)
    start = {"z": torch.randn(3, 2, dtype=torch.complex64, generator=g), "x": torch.randn(4, generator=g)}
    grads = [{k: torch.randn(v.shape, dtype=v.dtype, generator=g) for k, v in start.items()} for _ in range(3)]
    ours = {k: v.clone() for k, v in start.items()}
    opt = hpf.optim.adamw(**ADAMW)
    state = opt.init(ours)
    theirs = {k: v.clone().requires_grad_() for k, v in start.items()}
    torch_opt = torch.optim.AdamW(list(theirs.values()), foreach=False, **ADAMW)
    for grad in grads:
        ours, state = opt.update(grad, state, ours)
        for k, t in theirs.items():
            t.grad = grad[k].clone()
        torch_opt.step()
    assert not torch.allclose(ours["z"], start["z"], atol=1e-3)  # it moved
    for k in start:
        torch.testing.assert_close(ours[k], theirs[k].detach(), rtol=1e-6, atol=1e-7)
