"""Validation mode: the fail-fast error classes, plan checks at 768 ranks in one process,
gradient equivalence, and bit-identical results to production (the op rules: test_validate_rules.py).

Expected layouts and grads are written down or computed independently (plain autograd on the
unsharded model); the two-rank runs are grouped into one launched job per fixture.
"""
import functools

import numpy as np
import optree
import pytest
import torch
import torch.nn.functional as F

import hpf
from hpf import P
from hpf import axis_index, check_plan
from hpf.launcher import launch
from hpf.models import gpt
from hpf.validate import (
    CHECKS, BatchMismatchError, GradientMismatchError, IndivisibleLayoutError, LossNotReplicatedError,
    NonFiniteLayoutError, ParamsTreeError, PartialSumError, PrecisionError, ShardedContractionError, check_grads,
)
from references import autograd_grads
from toy_models import (D, MEGATRON_SPECS, megatron_loss, megatron_mlp, megatron_params, megatron_tokens,
                        psum_with_identity_backward)

BIG_TP = hpf.Mesh({"dp": 96, "tp": 8})  # 768 ranks


def plan_check(loss_fn, specs=MEGATRON_SPECS, mesh=BIG_TP, **kwargs):
    return check_plan(loss_fn, megatron_params(), mesh, megatron_tokens(4), param_specs=specs, fsdp_axes=("dp",), **kwargs)


# ============================================================================ plan checks at scale
def test_plan_check_of_a_tensor_parallel_model_on_768_ranks():
    report = plan_check(megatron_loss, rank=BIG_TP.size - 1)
    assert report.ops > 50 and report.unused == []
    assert report.loss_layout == "dp: varying (different on each rank), tp: replicated"


def test_plan_check_of_the_gpt_on_768_ranks():
    config = gpt.CONFIGS["tiny"]
    mesh = hpf.Mesh({"node": 96, "local": 8})
    batch = torch.empty(2, config.seq_len + 1, dtype=torch.int64, device="meta")
    report = check_plan(gpt.loss_for(config), gpt.init(config, device="meta"), mesh, batch, mixed_precision="bf16")
    assert report.plan.mesh.size == 768 and report.unused == []


def test_check_plan_checks_the_plan_the_step_makes_with_its_topology():
    """One plan recipe: a topology that shapes the plan (shard order, bucket cap, a low-bit slow
    tier) gives check_plan the plan shard_step makes, not the default one (issue 49)."""
    from hpf.planning import step_plan
    config = gpt.CONFIGS["tiny"]
    params, mesh = gpt.init(config, device="meta"), hpf.Mesh({"node": 2, "local": 2})
    batch = torch.empty(1, config.seq_len + 1, dtype=torch.int64, device="meta")
    topology = hpf.Topology(fast_major=True, bucket_bytes=4096, slow_grads="int8")

    def layout(plan):
        return [(b.unit, [s.path for s in b.slots], b.shard_numel, b.shard_order) for b in plan.buckets], plan.slow_precision
    checked = check_plan(gpt.loss_for(config), params, mesh, batch, topology=topology).plan
    assert layout(checked) == layout(step_plan(params, mesh, topology=topology))
    assert layout(checked) != layout(check_plan(gpt.loss_for(config), params, mesh, batch).plan)


def test_hpf_plan_check_checks_the_tensor_parallel_step(capsys):
    """``hpf plan --mesh dp=2,tp=2 --check`` checks the tensor-parallel loss on the tp plan (the
    psums seen, the loss replicated over tp), as hpf train runs it."""
    from hpf.cli import main
    assert main(["plan", "--config", "small", "--mesh", "dp=2,tp=2", "--check"]) == 0
    assert "tp: replicated" in capsys.readouterr().out


def test_hpf_plan_check_binds_muon_to_the_plan_as_the_step_does(capsys, monkeypatch):
    """It said "plan check OK" for Muon on a tp mesh, and hpf train failed at step 1 (issue 60 item 6).
    Muon now orthogonalizes tp-split matrices (the check passes, as hpf train runs); what it still
    refuses of a plan the check refuses, in Muon's words."""
    from hpf.cli import main
    from hpf.optim import dist_muon
    for mesh in ("dp=2,tp=2", "dp=4"):
        assert main(["plan", "--config", "small", "--mesh", mesh, "--optimizer", "muon", "--check"]) == 0
        assert "plan check OK" in capsys.readouterr().out

    def refuse(plan, slot):
        raise ValueError(f"distributed Muon: parameter {slot.path!r} is refused")
    monkeypatch.setattr(dist_muon, "check_whole_matrices", refuse)
    assert main(["plan", "--config", "small", "--mesh", "dp=2,tp=2", "--optimizer", "muon", "--check"]) == 2
    err = capsys.readouterr().err
    assert "muon refuses it" in err and "distributed Muon: parameter 'blocks/0/w_" in err, err


# ============================================================================ the fail-fast checks
def test_the_checks_are_the_documented_error_classes():
    assert [c.__name__ for c in CHECKS] == [
        "PartialSumError", "ShardedContractionError", "LossNotReplicatedError", "BatchMismatchError",
        "ParamsTreeError", "PrecisionError", "NonFiniteLayoutError", "IndivisibleLayoutError", "QuantizationError",
        "TokenLostError", "ExpertPlacementError", "GateSumError"]
    assert issubclass(ParamsTreeError, hpf.SpecError) and issubclass(IndivisibleLayoutError, hpf.SpecError)
    # production mode's except clauses catch validation mode's forms of its two errors
    assert issubclass(NonFiniteLayoutError, hpf.NonFiniteError)
    assert issubclass(IndivisibleLayoutError, hpf.spec.IndivisibleSpecError)


def test_each_error_name_is_one_class():
    """An exception name means one class across hpf.errors, hpf.spec and hpf.validate (the
    validation forms of production errors are subclasses with names of their own)."""
    import hpf.errors
    import hpf.validate.errors
    classes: dict[str, set] = {}
    for module in (hpf.errors, hpf.spec, hpf.validate, hpf.validate.errors):
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, type) and issubclass(obj, BaseException):
                classes.setdefault(obj.__name__, set()).add(obj)
                assert obj.__name__ == name, f"{module.__name__}.{name} is {obj.__qualname__}"
    assert {n: c for n, c in classes.items() if len(c) > 1} == {}


def no_psum_mlp(a, blk):
    return F.gelu(a @ blk["w_up"]) @ blk["w_down"]


def test_partial_sum_error_for_a_missing_psum():
    with pytest.raises(PartialSumError) as info:
        plan_check(lambda p, b: megatron_loss(p, b, mlp=no_psum_mlp))
    msg = str(info.value)
    assert msg.startswith("add:") and "'blocks/0/w_down'" in msg and "hpf.psum(x, 'tp')" in msg


def test_sharded_contraction_error_without_reduction():
    specs = hpf.rules([(r"blocks/\d+/w_(q|k|v|up)", P(None, "tp")), (r"blocks/\d+/w_o", P("tp", None)), (r".*", P())])
    with pytest.raises(ShardedContractionError) as info:  # w_down left replicated: nothing lines up with w_up's split
        plan_check(megatron_loss, specs)
    msg = str(info.value)
    assert msg.startswith("matmul contracts") and "'blocks/0/w_up'" in msg and "'blocks/0/w_down'" in msg
    assert "shard dim 0 of parameter 'blocks/0/w_down'" in msg


def test_loss_not_replicated_error_by_layout():
    def each_rank_its_own_row(params, batch):
        return megatron_loss(params, batch[axis_index("tp")][None])

    with pytest.raises(LossNotReplicatedError) as info:
        plan_check(each_rank_its_own_row)
    msg = str(info.value)
    assert "varying" in msg and "'tp'" in msg and "axis_index" in msg and "parameter 'head'" in msg


def test_params_tree_error_for_a_spec_tree_of_another_structure():
    specs = optree.tree_map(lambda _: P(), megatron_params())
    del specs["blocks"][1]["w_o"]
    with pytest.raises(ParamsTreeError) as info:
        plan_check(megatron_loss, specs)
    assert "check_plan" in str(info.value) and "'blocks/1/w_o'" in str(info.value)


def test_precision_error_for_an_implicit_upcast_under_bf16():
    def fp32_scale(params, batch):
        scale = torch.ones(D, device=params["head"].device)  # float32, meets bf16 activations
        return megatron_loss({**params, "embed": params["embed"] * scale}, batch)

    with pytest.raises(PrecisionError) as info:
        plan_check(fp32_scale, mixed_precision="bf16")
    msg = str(info.value)
    assert msg.startswith("mul:") and "parameter 'embed'" in msg and ".to(torch.bfloat16)" in msg


def test_indivisible_spec_error_when_a_non_fsdp_axis_does_not_divide():
    specs = hpf.rules([(r"head", P(None, "tp")), (r".*", P())])  # V = 17 columns over 8 ranks
    with pytest.raises(IndivisibleLayoutError) as info:
        plan_check(megatron_loss, specs)
    assert "'head' dim 1 has size 17" in str(info.value) and "check_plan" in str(info.value)


# -- classes that need values: a one-rank validating step in this process ---------------------------
ONE = hpf.Mesh({"dp": 1, "tp": 1})


def one_rank_step(loss_fn):
    step = hpf.shard_step(loss_fn, mesh=ONE, optimizer=hpf.optim.adamw(lr=1e-2), param_specs=MEGATRON_SPECS,
                          fsdp_axes=("dp",), mode="validate")
    return step, step.init(megatron_params())


def test_non_finite_error_names_the_first_op_of_the_loss():
    def log_of_negative(params, batch):
        h = params["embed"][batch[:, :-1]]
        return torch.log(h @ params["head"] - 100.0).mean()

    step, state = one_rank_step(log_of_negative)
    with pytest.raises(NonFiniteLayoutError) as info:
        step(state, megatron_tokens(2))
    assert "at log (inputs finite" in str(info.value) and "parameter 'head'" in str(info.value)


def test_non_finite_error_names_the_parameter_of_the_grads():
    def sqrt_at_zero(params, batch):  # finite loss; d sqrt(x)/dx at 0 is inf, times 0 -> nan
        return megatron_loss(params, batch) + (params["blocks"][1]["norm"] * 0).sqrt().sum()

    step, state = one_rank_step(sqrt_at_zero)
    with pytest.raises(NonFiniteLayoutError) as info:
        step(state, megatron_tokens(2))
    assert "the grads of ['blocks/1/norm']" in str(info.value)


def test_params_tree_error_for_a_state_of_another_plan():
    step, state = one_rank_step(megatron_loss)
    with pytest.raises(ParamsTreeError) as info:
        step(hpf.TrainState(state.params[1:], state.opt_state), megatron_tokens(2))
    # the state lost bucket 0: the first bucket whose shard then has the wrong shape is named, with its params
    k = next(i for i, (a, b) in enumerate(zip(state.params, state.params[1:])) if a.shape != b.shape)
    first = step.plan.buckets[k].slots[0].path
    assert str(info.value).startswith("step(state, batch): the state does not match") and repr(first) in str(info.value)


# ============================================================================ two ranks
ADAMW = dict(lr=1e-2, weight_decay=0.0)


def _equivalence(rank, mesh, fsdp_axes, specs, loss_fn, params, batches, wrong_loss_fn=None):
    """Production and validation from the same params; then check_grads on a fresh state."""
    dp = mesh.axis_size(fsdp_axes)
    i = mesh.group_index(fsdp_axes, rank) if fsdp_axes else 0
    local = [b[i * len(b) // dp:(i + 1) * len(b) // dp] for b in batches]
    out = {}
    for mode in ("production", "validate"):
        step = hpf.shard_step(loss_fn, mesh=mesh, optimizer=hpf.optim.adamw(**ADAMW), param_specs=specs,
                              fsdp_axes=fsdp_axes, mode=mode)
        state = step.init(params)
        losses = []
        for b in local:
            state, metrics = step(state, b)
            losses.append(metrics["loss"])
        out[mode] = (losses, optree.tree_map(lambda x: x.numpy(), step.full_params(state)))
    state = step.init(params)
    report = step.check_grads(state, local[0], rtol=1e-5, atol=1e-7)
    out["report"] = (report.errors, optree.tree_map(lambda x: x.numpy(), report.sharded))
    # the same model with a collective whose backward is wrong (check_grads works on either mode's step)
    wrong = hpf.shard_step(wrong_loss_fn or loss_fn, mesh=mesh, optimizer=hpf.optim.adamw(**ADAMW),
                           param_specs=specs, fsdp_axes=fsdp_axes)
    try:
        check_grads(wrong, wrong.init(params), local[0])
        out["wrong_backward"] = None
    except GradientMismatchError as err:
        out["wrong_backward"] = str(err)
    return out


def assert_close_to_scale(got, want, path):
    """fp32: the sharded path sums per-rank partial grads, the reference one full batch, so
    elements that nearly cancel carry ulp noise of their summands: measured <= 4e-6 of the
    tensor's largest grad. 1e-5 of it is far below a missing or doubled contribution (O(1))."""
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max() + 1e-9, path


def reference_grads(loss_fn, params, batch):
    return {p: g.numpy() for p, g in autograd_grads(loss_fn, params, batch).items()}


TINY = gpt.CONFIGS["tiny"]
RUNS = {
    "gpt_dp2": (hpf.Mesh({"dp": 2}), ("dp",), None, gpt.loss_for(TINY), gpt.init(TINY),
                [gpt.global_batch(TINY, 4, 0, s) for s in range(2)]),
    "tp2": (hpf.Mesh({"tp": 2}), (), MEGATRON_SPECS, megatron_loss, megatron_params(), [megatron_tokens(3, seed=s) for s in range(2)]),
}
WRONG_BACKWARD = {"tp2": functools.partial(megatron_loss, psum=psum_with_identity_backward)}


@pytest.fixture(scope="module", params=list(RUNS))
def equivalence(request):
    mesh, fsdp_axes, specs, loss_fn, params, batches = RUNS[request.param]
    return request.param, launch(_equivalence, mesh.size, mesh, fsdp_axes, specs, loss_fn, params, batches,
                                 WRONG_BACKWARD.get(request.param), timeout=240)


@pytest.mark.slow
def test_validate_and_production_are_identical(equivalence):
    _, runs = equivalence
    for out in runs:
        (prod_losses, prod_params), (val_losses, val_params) = out["production"], out["validate"]
        assert prod_losses == val_losses
        for a, b in zip(hpf.tree.flatten(prod_params)[1], hpf.tree.flatten(val_params)[1]):
            assert np.array_equal(a, b)


@pytest.mark.slow
def test_check_grads_matches_plain_autograd(equivalence):
    name, runs = equivalence
    _, _, _, loss_fn, params, batches = RUNS[name]
    want = reference_grads(loss_fn, params, batches[0])
    errors, sharded = runs[0]["report"]
    assert list(errors) == list(want)
    for path, got in zip(*hpf.tree.flatten(sharded)[:2]):
        assert_close_to_scale(got, want[path], path)
        assert errors[path][0] <= 1e-5 * np.abs(want[path]).max() + 1e-9  # the report saw the same


@pytest.mark.slow
def test_check_grads_catches_a_wrong_collective_backward(equivalence):
    name, runs = equivalence
    if name == "gpt_dp2":  # no psum in that model: the wrong backward never runs
        assert runs[0]["wrong_backward"] is None
    else:
        rows = {line.split()[0]: line for line in runs[0]["wrong_backward"].splitlines()[1:] if line.strip()}
        # the replicated embedding feeds the sharded blocks: its grad misses the other rank's part;
        # the head only sees replicated values after the last psum, so its grad stays right
        assert rows["embed"].endswith("FAIL") and rows["blocks/0/w_up"].endswith("FAIL")
        assert not rows["head"].endswith("FAIL")


# -- errors only several ranks can see ---------------------------------------------------------------------
def dropout_mlp(a, blk):  # dropout on replicated activations: each rank's mask must be the same
    return F.dropout(megatron_mlp(a, blk), 0.5)


def _rank_errors(rank):
    torch.manual_seed(rank)  # per-rank RNG: dropout masks differ across "tp"
    cases = {
        "batch_shape": (megatron_loss, megatron_tokens(3)[: 3 - rank]),
        "batch_values": (megatron_loss, megatron_tokens(3, seed=rank)),
        "loss_values": (lambda p, b: megatron_loss(p, b, mlp=dropout_mlp), megatron_tokens(3)),
    }
    out = {}
    for name, (loss_fn, batch) in cases.items():
        step = hpf.shard_step(loss_fn, mesh=hpf.Mesh({"tp": 2}), optimizer=hpf.optim.adamw(), param_specs=MEGATRON_SPECS,
                              fsdp_axes=(), mode="validate")
        state = step.init(megatron_params())
        try:
            step(state, batch)
            out[name] = None
        except Exception as err:  # noqa: BLE001 - the test inspects it
            out[name] = (type(err).__name__, str(err))
    return out


@pytest.fixture(scope="module")
def rank_errors():
    return launch(_rank_errors, 2, timeout=240)[0]


@pytest.mark.slow
def test_batch_mismatch_error_for_shapes_across_ranks(rank_errors):
    kind, msg = rank_errors["batch_shape"]
    assert kind == BatchMismatchError.__name__ and "rank 1" in msg and "(2, 7)" in msg and "(3, 7)" in msg


@pytest.mark.slow
def test_batch_mismatch_error_for_values_across_tensor_parallel_ranks(rank_errors):
    kind, msg = rank_errors["batch_values"]
    assert kind == BatchMismatchError.__name__ and "differ only along the non-FSDP axes ('tp',)" in msg


@pytest.mark.slow
def test_loss_not_replicated_error_for_values_across_tensor_parallel_ranks(rank_errors):
    kind, msg = rank_errors["loss_values"]
    assert kind == LossNotReplicatedError.__name__ and "ranks [0, 1]" in msg and "dropout" in msg


@pytest.mark.slow
def test_validate_equals_production_on_dp_x_tp():
    mesh = hpf.Mesh({"dp": 2, "tp": 2})
    batches = [megatron_tokens(4, seed=s) for s in range(2)]
    runs = launch(_equivalence, 4, mesh, ("dp",), MEGATRON_SPECS, megatron_loss, megatron_params(), batches, timeout=280)
    want = reference_grads(megatron_loss, megatron_params(), batches[0])
    for out in runs:
        assert out["production"][0] == out["validate"][0]
        for path, got in zip(*hpf.tree.flatten(out["report"][1])[:2]):
            assert_close_to_scale(got, want[path], path)
