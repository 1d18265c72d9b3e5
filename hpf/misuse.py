"""Misuse checks of the production step: each catches a mistake before it corrupts state,
and its message names the parameter path (or argument) and the fix.

The catalogue of what is caught, and what is accepted and handled instead, is
:data:`CATALOGUE` (the README's troubleshooting table is generated from it). The per-step
checks ride in the step's one all-reduce (hpf.step: finiteness, batch shapes, the schedule
digest); the ones here run once, at ``init`` or when an argument is given.
"""
from __future__ import annotations

import math
import re
from typing import Any

import torch

from . import tree as tree_util
from .comm import world
from .errors import (CapturedTensorError, DonatedStateError, NonFiniteError, ParamsMismatchError, StaleParamError,
                     UnevenBatchError, UnusedParamsError)

__all__ = ["CATALOGUE", "clean_params", "frozen_paths", "check_same_on_all_ranks", "finite_or_none"]


#: (error class, when, what the message tells you to do): the README's troubleshooting table.
CATALOGUE: tuple[tuple[str, str, str], ...] = (
    ("ParamsMismatchError", "ranks pass `init` different params (paths, shapes, dtypes or values)",
     "give every rank the same full params (same seed); names the first differing path"),
    ("DonatedStateError", "a state already passed to `step` (donated) is passed to `step` or `full_params`",
     "keep the returned state: `state, m = step(state, batch)`"),
    ("StaleParamError", "loss_fn uses a param tensor kept from an earlier step or micro-batch (a global, a "
     "closure, a cache, a `torch.compile`d function that captured it as a constant)",
     "read params only from the `params` argument of the current call; pass them to compiled functions as "
     "arguments"),
    ("CapturedTensorError", "under `grad=\"torch.func\"`, a block run by `params[...].apply(i, fn, *args)` "
     "computes with a tensor that needs grad but reaches it through a closure or a global, not `args`",
     "pass the tensor in `args` (any pytree of tensors), or use `grad=\"autograd\"`"),
    ("UnusedParamsError", "a step's loss reached none of the params it was given (every grad zero): an "
     "`nn.Module` or closure computing with its own weights",
     "compute with the `params` argument; for a Module, `params, loss_fn = hpf.from_module(model, loss)`"),
    ("UnevenBatchError", "local batches differ in shape across ranks",
     "split the global batch evenly; or pad, mask and divide by a global count (`hpf.psum`)"),
    ("NonFiniteError", "the loss or the global grad norm is NaN/inf (checked before the update)",
     "find the op (run `mode=\"validate\"`: it names it), lower the lr, or pass `on_nonfinite=\"skip\"`"),
    ("ValueError", "an lr or schedule value that is NaN, inf or < 0 (with the step), `max_grad_norm` <= 0 or NaN",
     "fix the schedule / value"),
    ("TypeError", "a params leaf that is int/bool, or not a tensor; a loss that is not one element",
     "keep int data in the batch; `loss_fn` returns a scalar tensor"),
    ("ValueError", "an empty list of blocks", "drop the empty list"),
    ("ValueError", "two params leaves whose paths read the same (`{\"a/b\": x, \"a\": {\"b\": y}}`, keys `0` "
     "and `\"0\"`)", "rename a key; the message names both"),
    ("ValueError", "a low-bit slow tier (`hpf.Topology(slow_weights=..., slow_grads=...)`) with an unknown format, "
     "`int4` weights, an odd block under int4, or `hierarchical=False`; a quantize block that does not divide a row",
     "weights: bf16, fp8 or int8; grads: also int4; an even block; the message lists what is allowed"),
    ("RuntimeError", "a step, save or `full_params` on a state `init` built from meta params, before `step.restore`",
     "call `state, extra = step.restore(path)` first (meta params are for restoring a checkpoint)"),
    ("SpecError", "a rule regex that does not compile, a spec naming a non-axis, no matching rule",
     "fix the pattern / spec named in the message"),
    ("MeshError", "a mesh that is not name -> size, a size/world mismatch, no process group under torchrun",
     "`hpf.Mesh({'dp': 4})`; `hpf.launch.init_distributed()` or torchrun"),
    ("accepted", "`nn.Parameter`/`requires_grad` leaves, `mixed_precision=torch.bfloat16`, an fp32 batch under "
     "bf16, `fsdp_axes=\"dp\"`, `Mesh([(\"dp\", 2)])`, a loss of shape (1,), Muon with only vectors",
     "nothing: detached (leaves beside them with requires_grad=False are frozen, as in torch); a dtype policy; floating batch leaves cast to the compute dtype; one axis; pairs; a "
     "scalar; AdamW for all"),
)


# -- params at init ---------------------------------------------------------------------------------------
def clean_params(params: Any, *, allow_meta: bool = False) -> Any:
    """The params as plain floating tensors: ``nn.Parameter`` and ``requires_grad`` leaves are
    detached (the step owns the grads); int/bool leaves, meta tensors (unless ``allow_meta``) and
    empty lists of blocks raise, naming the path and the fix."""
    _check_no_empty_lists(params, "")
    tree_util.check_leaves(params)
    paths, leaves, treedef = tree_util.flatten(params)
    for path, x in zip(paths, leaves):
        if x.is_complex():  # AdamW's g*g is not |g|^2 for complex g: refused, not trained wrong
            raise TypeError(f"params leaf {path!r} is a {x.dtype} tensor; hpf's optimizers update real tensors. "
                            "Pass torch.view_as_real(leaf) (a trailing dim of 2: torch's AdamW trains complex "
                            "params exactly so) and torch.view_as_complex it back in the loss function")
        if not x.is_floating_point():
            raise TypeError(f"params leaf {path!r} is a {x.dtype} tensor; params must be floating tensors "
                            "(the optimizer updates them). Move int/bool buffers into the batch, or cast the "
                            "leaf with .float()")
        if x.is_meta and not allow_meta:
            raise ValueError(f"params leaf {path!r} is a meta tensor (no values): step.init needs real values. "
                             "Pass real tensors (meta params are for hpf.plan / hpf.check_plan), or call "
                             "step.restore(path) after init to load a checkpoint")
    return tree_util.unflatten(treedef, [x.detach() for x in leaves])


def frozen_paths(params: Any, frozen: Any = None) -> set[str]:
    """The params to keep fixed: those ``frozen`` names (a regex on the "/"-joined path, or a
    callable ``path -> bool``), or by default torch's convention: once some leaf requires grad
    (``nn.Parameter`` leaves do), the leaves that do not are frozen. A tree of plain tensors
    (none requires grad, the pure-function way) trains every leaf."""
    paths, leaves, _ = tree_util.flatten(params)
    if frozen is not None:
        if isinstance(frozen, str):
            pattern = re.compile(frozen)
            return {p for p in paths if pattern.fullmatch(p)}
        if not callable(frozen):
            raise TypeError(f"frozen={frozen!r}: give a regex on parameter paths, a callable (path) -> bool, or None")
        return {p for p in paths if frozen(p)}
    flags = [isinstance(x, torch.Tensor) and x.requires_grad for x in leaves]
    return {p for p, f in zip(paths, flags) if not f} if any(flags) else set()


def _check_no_empty_lists(node: Any, path: str) -> None:
    if isinstance(node, list) and not node:
        raise ValueError(f"params path {path or '<root>'!r} is an empty list: each list element is an FSDP unit, "
                         "so a list needs at least one block. Drop the empty list from the params tree")
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, (list, tuple)) else ()
    for k, child in children:
        _check_no_empty_lists(child, f"{path}/{k}" if path else str(k))


def check_same_on_all_ranks(plan, full_params: Any, device: torch.device, made_by: str | None = None) -> None:
    """Fail at init, not with a silently mixed model, when ranks were given different params:
    paths, shapes and dtypes by one object all-gather, values by one int64 all-reduce of a
    bitwise, position-weighted hash per parameter. Params born sharded have no values yet:
    ``made_by`` (the digest of their init function and key) is compared instead."""
    if world.world_size() == 1:
        return
    paths, leaves, _ = tree_util.flatten(full_params)
    meta = any(x.is_meta for x in leaves)  # shapes only (before step.restore): no values to compare
    mine = [(p, s.global_shape, str(s.dtype)) for p, s in plan.slots.items()] + [("meta params", meta)]
    if made_by is not None:
        mine.append(("init_fn and key", made_by))
    everyone = world.all_gather_object(mine)
    for r, theirs in enumerate(everyone):
        if theirs != mine:
            diff = next((a, b) for a, b in zip(mine + [None] * len(theirs), theirs + [None] * len(mine)) if a != b)
            raise ParamsMismatchError(
                f"rank {r} has different params than rank {world.rank()}: {diff[1]} vs {diff[0]} (path, shape, "
                "dtype). Every rank must call step.init with the same full params tree (or init_fn and key)")
    if meta:
        return
    hashes = torch.stack([_bit_hash(x) for x in leaves]).to(device)
    both = torch.cat([hashes, ~hashes])  # max(~h) = ~min(h): one MAX all-reduce gives min and max
    world.all_reduce(both, op="max")
    differ = [p for p, hi, lo in zip(paths, both[:len(paths)].tolist(), both[len(paths):].tolist()) if hi != ~lo]
    if differ:
        raise ParamsMismatchError(
            f"params differ in value across ranks at {differ[:5]}{'...' if len(differ) > 5 else ''} (first: "
            f"{differ[0]!r}); step.init takes the same full params on every rank. Seed the init the same on "
            "every rank (e.g. torch.Generator().manual_seed(0)), or load them from one file")


def _bit_hash(x: torch.Tensor, chunk: int = 1 << 22) -> torch.Tensor:
    """An int64 hash of the exact bits of ``x`` (so NaNs compare, and a swap of two values changes it)."""
    flat = x.detach().reshape(-1)
    if flat.is_floating_point():
        flat = flat + 0.0  # -0.0 -> +0.0: equal values, equal hash
        flat = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), chunk):
        part = flat[start:start + chunk].to(torch.int64)
        weights = torch.arange(start, start + part.numel(), device=flat.device).remainder_(65521).mul_(2).add_(1)
        total += (part * weights).sum()  # int64 wraps: exact and order-independent
    return total.cpu()


# -- arguments ------------------------------------------------------------------------------------------------
def finite_or_none(record: dict) -> dict:
    """A metrics record that is valid JSON: NaN and inf become None (null)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
