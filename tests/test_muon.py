"""hpf.optim.muon against torch.optim.Muon / torch.optim.AdamW run on the same params and grads.

Matching precision: torch.optim.Muon always runs Newton-Schulz in bf16, so these tests pass
ns_compute_dtype=bf16, and hpf then performs the same ops in the same order (lerp momentum,
normalize, addmm-form NS steps, p*(1-lr*wd), p - (lr*scale)*O). On this CPU the results are
bitwise equal; ATOL = 1e-6 only leaves room for fp32 rounding if a BLAS ever blocks a batched
matmul differently from the 2-D one. A real bug (momentum form, scale, wd order, a norm across
experts) moves params by ~lr * 1e-2 = 2e-4 or more per step, far above it.
"""
import math

import optree
import pytest
import torch

from hpf.optim.muon_math import update_scale
from hpf.optim.muon_optimizer import muon

ATOL = 1e-6
BF16 = torch.bfloat16


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(50, 16, generator=g),
        "blocks": [
            {"w_in": torch.randn(32, 16, generator=g), "w_out": torch.randn(16, 48, generator=g),
             "bias": torch.randn(48, generator=g)}
            for _ in range(2)  # two blocks: same-shape matrices share one batched NS call
        ],
        "head": torch.randn(16, 50, generator=g),
    }


def torch_leaves(tree):
    return [p.clone().requires_grad_() for p in optree.tree_leaves(tree)]


def run_both(params, grads_per_step, hpf_opt, torch_opts, torch_params):
    state = hpf_opt.init(params)
    treedef = optree.tree_structure(params)
    for step, grads in enumerate(grads_per_step):
        for p, g in zip(torch_params, grads):
            p.grad = g.clone()
        for opt in torch_opts:
            opt.step()
        params, state = hpf_opt.update(optree.tree_unflatten(treedef, grads), state, params)
    return params, state


def random_grads(params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) for p in optree.tree_leaves(params)]
            for _ in range(steps)]


def assert_leaves_close(tree, torch_params):
    for got, want in zip(optree.tree_leaves(tree), torch_params):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=ATOL)


@pytest.mark.parametrize("scale, adjust_lr_fn", [("keller", "original"), ("moonlight", "match_rms_adamw")])
@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon_and_adamw_over_20_steps(scale, adjust_lr_fn, nesterov):
    params = make_params()
    tparams = torch_leaves(params)
    paths = ["/".join(map(str, p)) for p in optree.tree_paths(params)]
    on_muon = [p.ndim == 2 and path not in ("embed", "head") for path, p in zip(paths, tparams)]
    torch_muon = torch.optim.Muon([p for p, m in zip(tparams, on_muon) if m], lr=0.02,
                                  weight_decay=0.1, momentum=0.95, nesterov=nesterov,
                                  adjust_lr_fn=adjust_lr_fn)
    torch_adamw = torch.optim.AdamW([p for p, m in zip(tparams, on_muon) if not m], lr=3e-3,
                                    betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
    opt = muon(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov, scale=scale,
               adamw_lr=3e-3, adamw_weight_decay=0.05, ns_compute_dtype=BF16)
    params, state = run_both(params, random_grads(params, 20), opt, [torch_muon, torch_adamw], tparams)
    assert_leaves_close(params, tparams)
    assert int(state.count) == 20


def test_expert_weights_equal_per_expert_torch_runs():
    # [E, m, n] experts, with gradient scales 1e-3..1e3 across E: a norm across the expert axis
    # would shrink the small experts' steps; torch.optim.Muon sees each expert as its own matrix.
    E = 3
    params = {"experts": torch.randn(E, 24, 12, generator=torch.Generator().manual_seed(2))}
    tparams = [params["experts"][e].clone().requires_grad_() for e in range(E)]
    torch_muon = torch.optim.Muon(tparams, lr=0.02, weight_decay=0.1, adjust_lr_fn="original")
    opt = muon(lr=0.02, weight_decay=0.1, ns_compute_dtype=BF16)
    state = opt.init(params)
    g = torch.Generator().manual_seed(3)
    for _ in range(10):
        grad = torch.randn(E, 24, 12, generator=g) * torch.tensor([1e-3, 1.0, 1e3]).view(E, 1, 1)
        for e, p in enumerate(tparams):
            p.grad = grad[e].clone()
        torch_muon.step()
        params, state = opt.update({"experts": grad}, state, params)
    torch.testing.assert_close(params["experts"], torch.stack([p.detach() for p in tparams]),
                               rtol=0, atol=ATOL)


def test_lr_schedule_callable():
    params = {"w": torch.randn(20, 30, generator=torch.Generator().manual_seed(4))}
    tparams = torch_leaves(params)
    torch_muon = torch.optim.Muon(tparams, lr=0.0, weight_decay=0.1, adjust_lr_fn="original")
    schedule = lambda step: 0.02 / step  # 1-based step, as hpf.optim.adamw  # noqa: E731
    opt = muon(lr=schedule, weight_decay=0.1, ns_compute_dtype=BF16)
    state = opt.init(params)
    for step, (grad,) in enumerate(random_grads(params, 5)):
        torch_muon.param_groups[0]["lr"] = schedule(step + 1)
        tparams[0].grad = grad.clone()
        torch_muon.step()
        params, state = opt.update({"w": grad}, state, params)
    assert_leaves_close(params, tparams)


def test_custom_use_adamw_routes_matrix_to_adamw():
    params = {"a": torch.randn(8, 12), "b": torch.randn(12, 8)}
    tparams = torch_leaves(params)
    torch_muon = torch.optim.Muon([tparams[0]], lr=0.02, weight_decay=0.0, adjust_lr_fn="original")
    torch_adamw = torch.optim.AdamW([tparams[1]], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    opt = muon(use_adamw=lambda path, t: path == "b", adamw_lr=1e-3, ns_compute_dtype=BF16)
    params, _ = run_both(params, random_grads(params, 5), opt, [torch_muon, torch_adamw], tparams)
    assert_leaves_close(params, tparams)


def test_weight_decay_is_decoupled():
    # Zero grads: NS(0) = 0 and AdamW's step is 0/(0+eps), so only the decay p *= (1 - lr*wd) acts.
    params = {"w": torch.randn(8, 6), "b": torch.randn(6)}
    start = {k: v.clone() for k, v in params.items()}
    opt = muon(lr=0.1, weight_decay=0.5, adamw_lr=0.01, adamw_weight_decay=2.0)
    state = opt.init(params)
    for _ in range(3):
        params, state = opt.update({"w": torch.zeros(8, 6), "b": torch.zeros(6)}, state, params)
    torch.testing.assert_close(params["w"], start["w"] * (1 - 0.1 * 0.5) ** 3)
    torch.testing.assert_close(params["b"], start["b"] * (1 - 0.01 * 2.0) ** 3)


def test_fp32_default_step_is_scaled_orthogonal():
    # One step from zero momentum: direction = NS(g) (nesterov: (1-mu)g + mu(1-mu)g, same direction),
    # so (p0 - p1) / (lr * scale) must have singular values in Keller's [0.6, 1.2] band.
    params = {"w": torch.zeros(64, 16)}
    opt = muon(lr=0.1)
    params, _ = opt.update({"w": torch.randn(64, 16)}, opt.init(params), params)
    sv = torch.linalg.svdvals(-params["w"] / (0.1 * math.sqrt(64 / 16)))
    assert sv.min() > 0.6 and sv.max() < 1.2


def test_state_is_eager_and_mirrors_params():
    params = make_params()
    state = muon().init(params)
    treedef = optree.tree_structure(params)
    assert optree.tree_structure(state.exp_avg) == treedef
    assert optree.tree_structure(state.exp_avg_sq) == treedef
    assert state.exp_avg_sq["blocks"][0]["w_in"].numel() == 0  # Muon needs no second moment
    assert state.exp_avg_sq["embed"].shape == params["embed"].shape


def test_update_scale_values():
    assert update_scale(64, 16, "keller") == update_scale(64, 16, "original") == 2.0
    assert update_scale(16, 64, "keller") == 1.0
    assert update_scale(16, 64, "moonlight") == pytest.approx(1.6)
    assert update_scale(16, 64, 0.5) == 0.5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"scale": "rms"}, "scale must be one of"),
        ({"coefficients": [(1.0, 2.0, 3.0)] * 2}, "2 per-step tuples but steps=5"),
        ({"momentum": 1.0}, r"momentum must be in \[0, 1\)"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        muon(**kwargs)


def test_bad_grads_name_the_path():
    params = make_params()
    opt = muon()
    state = opt.init(params)
    grads = optree.tree_map(torch.zeros_like, params)
    grads["blocks"][1]["w_in"] = torch.zeros(16, 32)
    with pytest.raises(ValueError, match=r"grads at 'blocks/1/w_in' has shape \(16, 32\)"):
        opt.update(grads, state, params)
    del grads["head"]
    with pytest.raises(ValueError, match="same tree structure as params"):
        opt.update(grads, state, params)
