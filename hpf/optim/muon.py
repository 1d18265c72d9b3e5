"""Muon over a pytree of full tensors (single device), with an AdamW fallback.

Matrices (ndim >= 2; ndim > 2 is a batch of matrices over the leading dims, e.g. MoE experts
[E, m, n]) step along the orthogonalized momentum; vectors, embeddings and the head use AdamW.
The math is split into batch functions (muon_momentum_, orthogonalize, apply_muon_updates_,
adamw_update_) so the distributed Muon can run the same code on the matrices an owner gathers:
momentum is elementwise and works on shards, only orthogonalize needs whole matrices.
The momentum and update rules are torch.optim.Muon's (torch 2.13), so results match it.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Any, Callable, NamedTuple, Sequence, Union

import optree
import torch

from hpf_kernels import newton_schulz, resolve_coefficients

__all__ = [
    "muon", "Optimizer", "muon_momentum_", "orthogonalize", "muon_direction", "update_scale",
    "apply_muon_updates_", "adamw_update_", "default_use_adamw",
]

Schedule = Union[float, Callable[[int], float]]
ADAMW_PATH = re.compile(r"(^|/)(embed|pos|head)($|/)")
SCALES = ("keller", "original", "moonlight", "match_rms_adamw")


class Optimizer(NamedTuple):
    """optax-style pair: init(params) -> state; update(grads, state, params) -> (params, state)."""

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], tuple[Any, Any]]


def default_use_adamw(path: str, tensor: torch.Tensor) -> bool:
    """Embeddings, positions and the output head stay on AdamW, as in Keller's and Moonlight's Muon."""
    return ADAMW_PATH.search(path) is not None


def update_scale(rows: int, cols: int, scale: Union[str, float]) -> float:
    """Multiplier on lr for one [rows, cols] matrix, so updates have a shape-independent RMS.

    "keller" / "original": sqrt(max(1, rows/cols)) (torch's "original");
    "moonlight" / "match_rms_adamw": 0.2 * sqrt(max(rows, cols)), RMS of AdamW's update; a number: itself.
    """
    if scale in ("keller", "original"):
        return math.sqrt(max(1, rows / cols))  # math.sqrt, as torch, so lr * scale rounds the same
    if scale in ("moonlight", "match_rms_adamw"):
        return 0.2 * math.sqrt(max(rows, cols))
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return float(scale)
    raise ValueError(f"scale must be one of {SCALES} or a number, got {scale!r}")


def muon_momentum_(grads: Sequence[torch.Tensor], bufs: Sequence[torch.Tensor], momentum: float,
                   nesterov: bool) -> list[torch.Tensor]:
    """buf <- mu*buf + (1-mu)*g in place (torch.optim.Muon's lerp form); return what to orthogonalize.

    Elementwise, so it runs on shards as well as on full matrices.
    """
    torch._foreach_lerp_(list(bufs), list(grads), 1 - momentum)
    if nesterov:
        return list(torch._foreach_lerp(list(grads), list(bufs), momentum))
    return list(bufs)


def orthogonalize(matrices: Sequence[torch.Tensor], *, ns_steps: int = 5, coefficients="keller",
                  compute_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Newton-Schulz of each matrix; same-shape matrices (any leading batch dims) go in one batched call."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, m in enumerate(matrices):
        groups[(tuple(m.shape[-2:]), m.dtype, m.device)].append(i)
    out: list[torch.Tensor] = [None] * len(matrices)  # type: ignore[list-item]
    for (shape, _, _), members in groups.items():
        parts = [matrices[i].reshape(-1, *shape) for i in members]
        stacked = parts[0] if len(parts) == 1 else torch.cat(parts)
        ortho = newton_schulz(stacked, coefficients, ns_steps, compute_dtype=compute_dtype)
        for i, piece in zip(members, ortho.split([p.shape[0] for p in parts])):
            out[i] = piece.view(matrices[i].shape)
    return out


def muon_direction(grads: Sequence[torch.Tensor], bufs: Sequence[torch.Tensor], *, momentum: float,
                   nesterov: bool = True, ns_steps: int = 5, coefficients="keller",
                   compute_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Momentum (bufs updated in place), then orthogonalization: Muon's unscaled step directions."""
    updates = muon_momentum_(grads, bufs, momentum, nesterov)
    return orthogonalize(updates, ns_steps=ns_steps, coefficients=coefficients,
                         compute_dtype=compute_dtype)


def apply_muon_updates_(params: Sequence[torch.Tensor], directions: Sequence[torch.Tensor], *,
                        lr: float, weight_decay: float, scale: Union[str, float]) -> None:
    """p *= 1 - lr*wd (decoupled), then p -= lr * scale(m, n) * direction, in place."""
    if weight_decay:
        torch._foreach_mul_(list(params), 1 - lr * weight_decay)
    by_step: dict[float, tuple[list, list]] = defaultdict(lambda: ([], []))
    for p, d in zip(params, directions):
        step = lr * update_scale(p.shape[-2], p.shape[-1], scale)
        by_step[step][0].append(p)
        by_step[step][1].append(d)
    for step, (ps, ds) in by_step.items():
        torch._foreach_add_(ps, ds, alpha=-step)


def adamw_update_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                  exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *, step: int,
                  lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """One AdamW step in place, the op order of torch.optim.AdamW(foreach=True); step counts from 1."""
    params, grads, exp_avgs, exp_avg_sqs = map(list, (params, grads, exp_avgs, exp_avg_sqs))
    if not params:
        return
    beta1, beta2 = betas
    if weight_decay:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, (1 - beta2**step) ** 0.5)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -(lr / (1 - beta1**step)))


def _value(schedule: Schedule, step: int, name: str) -> float:
    value = schedule(step) if callable(schedule) else schedule
    if not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{name} must be a number >= 0 (or a callable step -> number), got {value!r}")
    return float(value)


def muon(lr: Schedule = 0.02, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
         coefficients="keller", scale: Union[str, float] = "keller", weight_decay: float = 0.0,
         adamw_lr: Schedule = 3e-4, adamw_betas: tuple[float, float] = (0.9, 0.95),
         adamw_eps: float = 1e-8, adamw_weight_decay: float = 0.0,
         use_adamw: Callable[[str, torch.Tensor], bool] | None = None,
         ns_compute_dtype: torch.dtype | None = None) -> Optimizer:
    """Muon for tensors with ndim >= 2, AdamW for the rest and for paths use_adamw(path, tensor) picks.

    update(grads, state, params) changes params and state in place (no copy of the model, and
    FSDP shards stay views into their flat buffers) and returns them. lr and adamw_lr may be
    callables of the step count (0 on the first update). ns_compute_dtype: None = the kernel's
    choice for the device (fp32 on CPU, bf16 on accelerators).
    """
    resolve_coefficients(coefficients, ns_steps)  # bad coefficients fail here, not at step 1
    update_scale(1, 1, scale)
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
    if not all(0.0 <= b < 1.0 for b in adamw_betas) or len(adamw_betas) != 2:
        raise ValueError(f"adamw_betas must be two numbers in [0, 1), got {adamw_betas!r}")
    use_adamw = use_adamw or default_use_adamw

    def on_muon(path: str, p: torch.Tensor) -> bool:
        return p.ndim >= 2 and not use_adamw(path, p)

    def init(params):
        paths, leaves, treedef = _flatten(params, "params")
        exp_avg = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in leaves]
        exp_avg_sq = [p.new_empty(0) if on_muon(path, p) else torch.zeros_like(p)
                      for path, p in zip(paths, leaves)]
        return {"step": 0, "exp_avg": treedef.unflatten(exp_avg),
                "exp_avg_sq": treedef.unflatten(exp_avg_sq)}

    def update(grads, state, params):
        paths, leaves, treedef = _flatten(params, "params")
        grad_leaves = _leaves_like(grads, treedef, paths, leaves, "grads")
        avg = _leaves_like(state["exp_avg"], treedef, paths, leaves, "state['exp_avg']")
        avg_sq = optree.tree_leaves(state["exp_avg_sq"])
        step = state["step"]
        is_muon = [on_muon(path, p) for path, p in zip(paths, leaves)]
        pick = lambda xs, want: [x for x, m in zip(xs, is_muon) if m == want]  # noqa: E731

        lr_now = _value(lr, step, "lr")
        directions = muon_direction(pick(grad_leaves, True), pick(avg, True), momentum=momentum,
                                    nesterov=nesterov, ns_steps=ns_steps, coefficients=coefficients,
                                    compute_dtype=ns_compute_dtype)
        apply_muon_updates_(pick(leaves, True), directions, lr=lr_now, weight_decay=weight_decay,
                            scale=scale)
        adamw_update_(pick(leaves, False), pick(grad_leaves, False), pick(avg, False),
                      pick(avg_sq, False), step=step + 1, lr=_value(adamw_lr, step, "adamw_lr"),
                      betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay)
        return params, {**state, "step": step + 1}

    return Optimizer(init, update)


def _flatten(tree, what: str):
    raw_paths, leaves, treedef = optree.tree_flatten_with_path(tree)
    paths = ["/".join(str(k) for k in path) for path in raw_paths]
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
            raise TypeError(f"{what} leaf {path!r} must be a floating-point torch.Tensor, "
                            f"got {type(leaf).__name__}")
    return paths, leaves, treedef


def _leaves_like(tree, treedef, paths, params, what: str) -> list[torch.Tensor]:
    """Leaves of `tree`, checked to have the params' structure and shapes (errors name the path)."""
    if optree.tree_structure(tree) != treedef:
        raise ValueError(f"{what} must have the same tree structure as params: got "
                         f"{optree.tree_structure(tree)}, expected {treedef}")
    leaves = optree.tree_leaves(tree)
    for path, leaf, p in zip(paths, leaves, params):
        if not isinstance(leaf, torch.Tensor) or leaf.shape != p.shape:
            got = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise ValueError(f"{what} at {path!r} has shape {got}, but the param has "
                             f"{tuple(p.shape)}")
    return leaves
