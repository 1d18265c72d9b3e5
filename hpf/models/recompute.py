"""Activation checkpointing per block, shared by the models' loss functions and their memory hooks.

A recomputed block keeps only its input for backward and runs its forward again there
(``torch.utils.checkpoint``, non-reentrant, so it works inside ``hpf.shard_step``'s pure loss
functions). ``"every_other"`` recomputes the odd blocks (1, 3, ...): about half the savings for
a third of ``"all"``'s extra compute per saved byte.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

from torch.utils.checkpoint import checkpoint

__all__ = ["RECOMPUTE", "Activations", "check", "compiled", "each_block", "recomputes"]

#: the ``recompute=`` values of the models' ``loss_for``
RECOMPUTE = ("none", "all", "every_other")


def check(recompute: str) -> str:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: use one of {', '.join(RECOMPUTE)}")
    return recompute


def recomputes(i: int, recompute: str) -> bool:
    """Whether block ``i`` recomputes its forward in backward."""
    return recompute == "all" or (recompute == "every_other" and i % 2 == 1)


@functools.lru_cache(maxsize=None)
def compiled(fn: Callable, cache: bool = True) -> Callable:
    """``torch.compile(fn)``, once per process: a model's block compiled, torchtitan's habit (every
    block has the same shapes, so one graph serves them all). ``cache=False``: without AOTAutograd's
    on-disk cache: a tensor-parallel block (hpf collectives inside it, graph breaks around them)
    loaded from that cache replays an output view with garbage sizes (torch 2.13: "invalid shape
    dimension" on the second run of the same program), so it compiles afresh in each process."""
    import torch
    fast = torch.compile(fn)
    if cache:
        return fast
    from torch._functorch import config

    def uncached(*args):
        with config.patch(enable_autograd_cache=False):
            return fast(*args)
    return uncached


def each_block(blocks, recompute: str, compile: bool = False, cache: bool = True):
    """Yields ``(i, run)`` per block, where ``run(fn, *args)`` is ``fn(block_i, *args)``,
    checkpointed where ``recompute`` says so, and with ``fn`` compiled (``compiled``, with
    ``cache``) if ``compile``. A list of blocks (hpf.shard_step passes one) is
    indexed inside the checkpoint, so a recomputed block is gathered again for its backward
    instead of held by the checkpoint from forward to backward (hpf.shard_step frees it between).
    Any other iterable is iterated once, in order (a recomputed block is then held)."""
    def runner(i: int, read: Callable):
        def run(fn: Callable, *args):
            fn = compiled(fn, cache) if compile else fn
            if getattr(blocks, "rematerializes", False):  # hpf under grad="torch.func": keeps only args
                return blocks.apply(i, fn, *args)
            if recomputes(i, recompute):
                return checkpoint(lambda *a: fn(read(), *a), *args, use_reentrant=False)
            return fn(read(), *args)
        return run

    if isinstance(blocks, Sequence):
        for i in range(len(blocks)):
            yield i, runner(i, lambda i=i: blocks[i])
    else:
        for i, blk in enumerate(blocks):
            yield i, runner(i, lambda blk=blk: blk)


@dataclass(frozen=True)
class Activations:
    """What a model's loss keeps for backward on one rank's micro-batch, in bytes (a model's
    ``activations(config, local_batch, dtype_bytes)`` hook; hpf.memory walks it through backward).

    ``blocks``: per block, (saved by its forward, its input: all a recomputed block keeps, the
    grads its backward holds at once on top); ``root_saved``: the embedding, final norm and loss;
    ``root_backward``: the loss's grads at the start of backward."""

    blocks: tuple[tuple[int, int, int], ...]
    root_saved: int
    root_backward: int

    @classmethod
    def of(cls, tokens: int, d_model: int, vocab: int, dtype_bytes: int, blocks: list[int],
           backward: list[int]) -> "Activations":
        """A decoder's: ``blocks`` saved and ``backward`` bytes per block, each fed a residual
        stream of ``d_model``; the root is the embedding, a final RMSNorm (:func:`norm_bytes`) and the fp32
        cross-entropy (log-softmax output and int64 targets saved; the grads of the logits, fp32
        and, in a lower compute dtype, cast back, at its backward)."""
        b = dtype_bytes
        root_saved = tokens * (norm_bytes(d_model, b) + 4 * vocab + 8)
        root_backward = tokens * vocab * (8 + (b if b != 4 else 0))
        return cls(tuple((s, tokens * d_model * b, g) for s, g in zip(blocks, backward)), root_saved, root_backward)


def norm_bytes(d_model: int, dtype_bytes: int) -> int:
    """What one RMSNorm (``layers.rms_norm``, normalized in fp32) saves per token: its fp32 input
    and rsqrt, and its output before and after the weight in the compute dtype."""
    return 4 * d_model + 4 + 2 * dtype_bytes * d_model
