"""What a step carries and what it reports: ``TrainState`` (the sharded params and optimizer
state the step takes and returns) and ``StepStats`` (its counters since the last read). Plain
data, apart from the step, so checkpoints and validation mode name them without importing it.
``zeros`` makes the state's zero buffers (grads, optimizer moments, shards before their values)."""
from __future__ import annotations

import ctypes
import math
import mmap
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

__all__ = ["StepStats", "TrainState", "GATHER_STATS", "zeros", "zeros_like", "populate", "FRESH_PAGES_BYTES"]

#: a CPU zero buffer of at least this many bytes is fresh pages (see ``zeros``)
FRESH_PAGES_BYTES = 1 << 20


def zeros(shape, dtype: torch.dtype, device=None) -> torch.Tensor:
    """``torch.zeros(shape)`` that writes no memory yet on a CPU: a buffer of ``FRESH_PAGES_BYTES``
    or more is a private anonymous mapping, whose pages the kernel zeroes at their first write.
    torch.zeros faults every page in and writes it again, at init: for GPT 1b on 4 ranks that is 3
    GiB of grads and AdamW moments a rank before any step, where FSDP2 makes only the params. The
    step faults them in at its first call (``populate``). 4 KiB pages, no transparent huge pages:
    on this VM a huge page's first write cost 3x torch.zeros' whole cost."""
    device = torch.device("cpu" if device is None else device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < FRESH_PAGES_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (unmapped with the tensor)
    return torch.frombuffer(pages, dtype=dtype).view(shape)


def populate(tensors) -> None:
    """Fault in the pages of these CPU tensors (``zeros``' fresh ones) in one call each, Linux's
    MADV_POPULATE_WRITE. A first use that reads before it writes (AdamW's ``lerp_`` and ``mul_`` of
    its moments) would map the zero page and fault again at the write: 1.3x torch.zeros' cost where
    this is 0.75x (measured). Elsewhere (no such call: Linux before 5.14, macOS) the pages fault at
    first use. Anything but a contiguous CPU tensor of ``FRESH_PAGES_BYTES`` or more is skipped."""
    if _LIBC is None:
        return
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous() and t.nbytes >= FRESH_PAGES_BYTES:
            lo = -(-t.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE  # (whole pages inside the tensor)
            hi = (t.data_ptr() + t.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
            if hi > lo:
                _LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_POPULATE_WRITE)


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    except OSError:
        return None
    if libc is not None:
        libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return libc


_MADV_POPULATE_WRITE = 23  # (linux/mman.h; an older kernel refuses it with EINVAL, which leaves the pages as they are)
_LIBC = _libc()


def zeros_like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.zeros_like(x, dtype=dtype)``, by ``zeros`` where ``x`` is contiguous (its layout is then the same)."""
    if x.layout != torch.strided or not x.is_contiguous():
        return torch.zeros_like(x, dtype=dtype)
    return zeros(x.shape, dtype or x.dtype, x.device)


class TrainState(NamedTuple):
    """The sharded train state: one flat master shard per plan bucket, and optimizer state.

    Args:
        params: this rank's flat master shard of every plan bucket, in bucket order.
        opt_state: the optimizer's state for those shards (its ``init`` made it).
        loss_scale: fp16's loss-scaling state (:class:`hpf.losses.LossScaleState`), else None.
        error_feedback: with slow-tier error feedback (:class:`hpf.precision.SlowPrecision`), this rank's
            residual of each bucket's quantized grad exchange (an empty tensor where none
            crosses the slow tier), carried to the next step and saved in checkpoints; else None.

    Raises:
        Nothing itself; a step given a state of another plan raises (validation mode names
        the bucket).
    """

    params: list[torch.Tensor]
    opt_state: Any
    loss_scale: Any = None
    error_feedback: list[torch.Tensor] | None = None


@dataclass(frozen=True)
class StepStats:
    """What a step moved, waited for and gathered since its ``init`` (``step.stats()``).

    ``later - earlier`` of two snapshots is what happened between them (the peaks and the
    memory held are the later snapshot's).

    Args:
        steps: calls of the step.
        bytes: ``(op, tier) -> bytes`` this rank sent, by hpf.comm.cost's ring model
            (``op``: all_gather, reduce_scatter, all_reduce; ``tier``: fast or slow), and under
            distributed Muon ``("muon", tier)``: the payload of its point-to-point pieces.
        step_s, optimizer_s, comm_wait_s, compile_s: seconds summed over the steps, as each
            step's metrics report them (``comm_wait_s``: compute blocked on a collective).
        gathers: unit gathers; ``extra_gathers`` those beyond loop-style use (each unit once in
            forward and at most once in backward).
        peak_blocks, peak_bytes: the most block units gathered at once, and their bytes.
        live_blocks, live_bytes: the block units, and the bytes, gathered now (a closed step's:
            what its close left held, nothing unless a param tensor outlived it).

    Raises:
        Nothing.
    """

    steps: int = 0
    bytes: Counter = field(default_factory=Counter)
    step_s: float = 0.0
    optimizer_s: float = 0.0
    comm_wait_s: float = 0.0
    compile_s: float = 0.0
    gathers: int = 0
    extra_gathers: int = 0
    peak_blocks: int = 0
    peak_bytes: int = 0
    live_blocks: int = 0
    live_bytes: int = 0

    def __sub__(self, earlier: "StepStats") -> "StepStats":
        delta = {f: getattr(self, f) - getattr(earlier, f) for f in _SUMMED}
        return StepStats(bytes=Counter({k: n - earlier.bytes.get(k, 0) for k, n in self.bytes.items()}), **delta,
                         peak_blocks=self.peak_blocks, peak_bytes=self.peak_bytes, live_blocks=self.live_blocks,
                         live_bytes=self.live_bytes)

    def slow_bytes(self) -> dict[str, int]:
        """op -> bytes this rank sent across the slow tier."""
        return {op: n for (op, tier), n in self.bytes.items() if tier == "slow"}


#: the fields of StepStats that are the engine's own gather counts (hpf.engine.gather.MemoryStats has
#: each, by the same name: ``step.stats()`` takes them from there)
GATHER_STATS = ("gathers", "extra_gathers", "peak_blocks", "peak_bytes", "live_blocks", "live_bytes")
_SUMMED = ("steps", "step_s", "optimizer_s", "comm_wait_s", "compile_s", "gathers", "extra_gathers")
