"""The synthetic token source every model trains on in tests and benchmarks: a fixed-seed Markov chain.

A batch is a pure function of (seed, step), so the data a job sees does not depend on its world
size and a single-process reference replays it; any config with ``vocab_size`` and ``seq_len`` fits.
"""
from __future__ import annotations

import functools
from typing import Iterator

import numpy as np
import torch

__all__ = ["SUCCESSORS_PER_TOKEN", "global_batch", "synthetic_batches"]

SUCCESSORS_PER_TOKEN = 4  # each token of the synthetic Markov source has this many likely successors


@functools.lru_cache(maxsize=8)
def _markov_source(vocab_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(successors [V, K], cumulative probs [V, K]): a sparse random transition matrix.

    Stored as K successors per token instead of a dense [V, V] matrix, which for a 32k
    vocab would take 4 GB.
    """
    rng = np.random.default_rng([seed, 0])
    successors = rng.integers(vocab_size, size=(vocab_size, SUCCESSORS_PER_TOKEN))
    probs = rng.dirichlet(np.ones(SUCCESSORS_PER_TOKEN), size=vocab_size)
    cdf = np.cumsum(probs, axis=1)
    cdf[:, -1] = 1.0  # guard against rounding leaving the last bucket just below 1
    return successors, cdf


def global_batch(config, batch_size: int, seed: int, step: int) -> torch.Tensor:
    """The whole batch [batch_size, seq_len+1] of ``step``: a pure function of (seed, step)."""
    for name, value, least in (("batch_size", batch_size, 1), ("seed", seed, 0), ("step", step, 0)):
        if not isinstance(value, (int, np.integer)) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    successors, cdf = _markov_source(config.vocab_size, int(seed))
    rng = np.random.default_rng([int(seed), 1, int(step)])
    tokens = np.empty((batch_size, config.seq_len + 1), dtype=np.int64)
    tokens[:, 0] = rng.integers(config.vocab_size, size=batch_size)
    uniforms = rng.random((batch_size, config.seq_len))
    for t in range(config.seq_len):
        current = tokens[:, t]
        choice = (uniforms[:, t, None] >= cdf[current]).sum(axis=1)
        tokens[:, t + 1] = successors[current, choice]
    return torch.from_numpy(tokens)


def synthetic_batches(config, batch_size: int, seed: int, *, rank: int = 0,
                      world_size: int = 1, device=None, start: int = 0) -> Iterator[torch.Tensor]:
    """Endless local batches: rank r gets rows [r*B/W, (r+1)*B/W) of each step's global batch,
    from the batch of step ``start`` on (0-based: a resumed run passes its step count).

    ``batch_size`` is the GLOBAL batch size, so the data seen by the whole job does not depend
    on ``world_size`` and a single-process reference can replay it with ``global_batch``.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if batch_size % world_size:
        raise ValueError(
            f"batch_size={batch_size} (the global batch size) is not divisible by world_size={world_size}; "
            f"use a multiple of {world_size}"
        )
    local = batch_size // world_size
    step = start
    while True:
        yield global_batch(config, batch_size, seed, step)[rank * local:(rank + 1) * local].to(device)
        step += 1
