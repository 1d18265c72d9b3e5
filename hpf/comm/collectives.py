"""Explicit collectives over the non-FSDP mesh axes, as in ``jax.shard_map``.

Inside ``loss_fn`` a parameter split over a non-FSDP axis (tensor or expert parallel) is
the local block, and the function combines blocks itself: ``hpf.psum``, ``hpf.all_gather``,
``hpf.all_to_all``, ``hpf.axis_index``. The step says which mesh and rank are running by
setting an :class:`SPMD` context while ``loss_fn`` runs. Outside any step they act as on a
one-rank mesh (identities, index 0), so the same ``loss_fn`` runs unsharded on full params
as a single-process reference.

Gradient semantics: every backward is the exact adjoint of its forward, so grads are right
for any program with no layout types at run time (production sees plain tensors):

* ``psum``: all-reduce forward, all-reduce of the cotangent backward.
* ``all_gather``: reduce-scatter (sum) backward.
* ``psum_scatter``: reduce-scatter forward, all-gather backward.
* ``all_to_all``: the inverse all-to-all backward.

Sizes: every rank of the axis must pass the same shape and dtype (an uneven all-to-all: but
its split dim). A tiny all-reduce of a digest checks that before the data moves and raises one
ValueError naming each rank's shape, on every rank (gloo aborted the process; nccl may pair the
buffers up wrong). Outside a step and in validation mode every call is checked; a production
step checks its first step's calls only, so the steady state pays nothing.

The convention that makes these adjoints correct: a value replicated over an axis carries a
*partial* cotangent on each rank (the true cotangent is their sum). The step seeds each
rank's backward with ``1/n`` for a loss replicated over ``n`` non-FSDP ranks, and sums the
grads of params replicated over a non-FSDP axis. ``psum`` with an *identity* backward (as in
shard_map with replication checking) is only right together with implicit ``pvary`` casts
on every replicated value that meets a per-rank value (Megatron's ``f``); a plain-tensor
production step cannot insert those, so its grads for e.g. an embedding feeding a
tensor-parallel block would miss the other ranks' contributions. The adjoint convention
needs no such casts.
"""
from __future__ import annotations

import contextlib
import contextvars
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.overrides import handle_torch_function, has_torch_function

from ..mesh import Mesh, MeshError
from . import world
from .schedule import digest_parts, parts_agree
from .handles import reduce_scatter_async

__all__ = ["psum", "psum_scatter", "all_gather", "all_to_all", "axis_index", "SPMD", "spmd", "current", "validating", "register_check",
           "run_check"]


@dataclass(frozen=True)
class SPMD:
    """Which mesh and rank the running ``loss_fn`` belongs to.

    ``virtual``: no process group (a plan check on meta tensors); collectives then only
    produce outputs of the right shape.
    """

    mesh: Mesh
    rank: int
    fsdp_axes: tuple[str, ...]
    virtual: bool = False
    validate: bool = False  # validation mode: models check their data-dependent invariants (MoE dispatch)
    # whether explicit collectives first check that the ranks agree on shapes (_same_on_every_rank): always
    # outside a step and in validation mode; a production step checks its first step's (a shape that
    # depends on the rank is a bug in the program, there from the first step), then saves the all-reduce
    check_shapes: bool = True

    def axes(self, axis: str | Sequence[str], op: str) -> tuple[str, ...]:
        """``axis`` as a tuple of non-FSDP mesh axes, in mesh order; errors name the op."""
        want = (axis,) if isinstance(axis, str) else tuple(axis)
        if not want:
            raise MeshError(f"hpf.{op}: give at least one mesh axis name")
        for a in want:
            if a not in self.mesh.axis_names:
                raise MeshError(f"hpf.{op}: {a!r} is not an axis of {self.mesh}; axes are "
                                f"{self.mesh.axis_names}")
            if a in self.fsdp_axes:
                raise MeshError(
                    f"hpf.{op} over {a!r}: that is an FSDP axis. Its params arrive gathered and its "
                    f"ranks see different batches, which the step averages itself; explicit "
                    f"collectives are for the other (tensor/expert parallel) axes. Leave {a!r} out "
                    f"of fsdp_axes to compute sharded over it")
        return tuple(a for a in self.mesh.axis_names if a in want)


_CURRENT: contextvars.ContextVar[SPMD | None] = contextvars.ContextVar("hpf_spmd", default=None)


def current() -> SPMD | None:
    return _CURRENT.get()


def validating() -> bool:
    """Whether the running ``loss_fn`` is in a validation-mode step (checks cost time: only then).
    Never while torch.compile traces: validation mode runs compiled code eagerly (and a traced
    ContextVar read would break the graph)."""
    if torch.compiler.is_compiling():
        return False
    ctx = _CURRENT.get()
    return ctx is not None and ctx.validate


_CHECKS: dict[str, Callable] = {}


def register_check(name: str) -> Callable[[Callable], Callable]:
    """Decorator: validation mode runs the function at the model's ``run_check(name, ...)``.

    hpf.validate registers its checks here, so models call them by name and never import
    validation code (production mode never loads it)."""
    def register(fn: Callable) -> Callable:
        _CHECKS[name] = fn
        return fn
    return register


def run_check(name: str, *args: Any, **kwargs: Any) -> Any:
    """The registered check ``name`` on these values in a validation-mode step (its result, e.g.
    an object with later checks); None outside validation mode, at no cost."""
    if not validating():
        return None
    if name not in _CHECKS:
        raise RuntimeError(f"validation mode has no check {name!r}: hpf.validate registers it on import")
    return _CHECKS[name](*args, **kwargs)


@contextlib.contextmanager
def spmd(ctx: SPMD | None) -> Iterator[None]:
    """Run the body as ``ctx``'s rank (None: as a one-rank mesh)."""
    token = _CURRENT.set(ctx)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _setup(axis, op: str):
    """(group, size, virtual) of the current context; size 1 outside any step."""
    ctx = _CURRENT.get()
    if ctx is None:
        return None, 1, False
    axes = ctx.axes(axis, op)
    n = ctx.mesh.axis_size(axes)
    group = None if ctx.virtual or n == 1 else ctx.mesh.group(axes)
    return group, n, ctx.virtual


def _same_on_every_rank(op: str, axis, x: torch.Tensor, group, skip_dim: int | None = None) -> None:
    """Before a collective whose sizes come from the caller: the ranks of ``group`` agree on ``x``'s
    shape (but ``skip_dim``, an uneven all-to-all's split) and dtype, or all raise one ValueError
    naming each rank's. Sizes that differ would abort the process in gloo or pair up wrong in nccl;
    one all-reduce of a digest (``digest_parts``) finds them first. Not under torch.compile: a
    traced graph's collectives are its own; and only while the context says so (``SPMD.check_shapes``)."""
    ctx = _CURRENT.get()
    if torch.compiler.is_compiling() or not ctx.check_shapes:
        return
    shape = [d for i, d in enumerate(x.shape) if i != skip_dim]
    key = f"{shape} {x.dtype}"
    sums = torch.tensor(digest_parts(zlib.crc32(key.encode())), dtype=torch.float64, device=x.device)
    dist.all_reduce(sums, group=group)
    if parts_agree(sums.tolist(), dist.get_world_size(group)):
        return
    keys = world.all_gather_object(key, group)
    told = ", ".join(f"rank {r}: {k}" for r, k in enumerate(keys))
    raise ValueError(f"hpf.{op} over {axis!r}: the ranks pass different tensors ({told}, by position along the axis"
                     f"{'; the split dim aside' if skip_dim is not None else ''}); every rank of the axis must pass "
                     "the same shape and dtype")


# -- psum ------------------------------------------------------------------------------------------
class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):  # (setup_context: torch.func transforms can run it)
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def psum(x: torch.Tensor, axis: str | Sequence[str]) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``axis``: every rank gets the total (all-reduce).

    Backward all-reduces the cotangent (the exact adjoint, see the module doc). Outside a
    step it returns ``x`` as on a one-rank mesh.

    Args:
        x: this rank's tensor; the same shape on every rank of the group.
        axis: a non-FSDP mesh axis name, or several (one group over all of them).

    Raises:
        MeshError: ``axis`` is empty, not an axis of the step's mesh, or an FSDP axis.
        ValueError: the ranks of the axis pass different shapes or dtypes (found before any data moves).
    """
    if has_torch_function((x,)):
        return handle_torch_function(psum, (x,), x, axis)
    group, n, virtual = _setup(axis, "psum")
    if n == 1:
        return x.view_as(x)  # a new tensor, never the input itself (validation tracks tensors)
    if virtual:
        return x.clone()
    _same_on_every_rank("psum", axis, x, group)
    return _AllReduce.apply(x, group)


# -- all_gather --------------------------------------------------------------------------------------
def gather_dim0(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """Every rank's ``x`` of ``group`` (size n), concatenated along dim 0 in group-rank order."""
    out = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter0(x: torch.Tensor, group, n: int) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // n,) + tuple(x.shape[1:]))
    reduce_scatter_async(out, x.contiguous(), group).wait()
    return out


class _AlongDim(torch.autograd.Function):
    """An all-gather (``gather``) or a reduce-scatter of x along ``dim``; backward runs the other on
    the cotangent (each is the other's adjoint)."""

    @staticmethod
    def forward(x, group, n, dim, gather):
        return (gather_dim0 if gather else _reduce_scatter0)(x.movedim(dim, 0), group, n).movedim(0, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.n, ctx.dim, ctx.gather = inputs

    @staticmethod
    def backward(ctx, grad):
        other = _reduce_scatter0 if ctx.gather else gather_dim0
        return other(grad.movedim(ctx.dim, 0), ctx.group, ctx.n).movedim(0, ctx.dim), None, None, None, None


def all_gather(x: torch.Tensor, axis: str | Sequence[str], dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order along ``axis``.

    Backward reduce-scatters (sums) the cotangent back to each rank's block.

    Args:
        x: this rank's block; the same shape on every rank of the group.
        axis: a non-FSDP mesh axis name, or several.
        dim: the dim to concatenate along (negative counts from the end).

    Raises:
        MeshError: ``axis`` is empty, not an axis of the step's mesh, or an FSDP axis.
        ValueError: the ranks of the axis pass different shapes or dtypes (found before any data moves).
        IndexError: ``dim`` is out of range for ``x``.
    """
    if has_torch_function((x,)):
        return handle_torch_function(all_gather, (x,), x, axis, dim=dim)
    group, n, virtual = _setup(axis, "all_gather")
    dim = normalize_dim(x, dim, "all_gather", "dim")
    if n == 1:
        return x.view_as(x)
    if virtual:
        return torch.cat([x] * n, dim)
    _same_on_every_rank("all_gather", axis, x, group)
    return _AlongDim.apply(x, group, n, dim, True)


# -- psum_scatter --------------------------------------------------------------------------------------
def psum_scatter(x: torch.Tensor, axis: str | Sequence[str], dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``axis`` and keep this rank's block of the sum along ``dim``
    (reduce-scatter: block i of n to the rank at position i). Sequence parallelism's exit from a
    row-parallel product, where ``psum`` would give every rank the whole sum.

    Backward all-gathers the cotangent (the exact adjoint). Outside a step it returns ``x``.

    Raises:
        MeshError: ``axis`` is empty, not an axis of the step's mesh, or an FSDP axis.
        ValueError: the ranks of the axis pass different shapes or dtypes (found before any data moves).
        IndexError: ``dim`` is out of range for ``x``.
        ValueError: the axis size does not divide ``x``'s ``dim``.
    """
    if has_torch_function((x,)):
        return handle_torch_function(psum_scatter, (x,), x, axis, dim=dim)
    group, n, virtual = _setup(axis, "psum_scatter")
    dim = normalize_dim(x, dim, "psum_scatter", "dim")
    if n == 1:
        return x.view_as(x)
    if x.shape[dim] % n:
        raise ValueError(f"hpf.psum_scatter over {axis!r} ({n} ranks) of dim {dim} of size {x.shape[dim]}: the ranks "
                         f"must divide it; use a size divisible by {n}")
    if virtual:
        return x.narrow(dim, 0, x.shape[dim] // n).clone()
    _same_on_every_rank("psum_scatter", axis, x, group)
    return _AlongDim.apply(x, group, n, dim, False)


# -- all_to_all ----------------------------------------------------------------------------------------
def _exchange(x: torch.Tensor, group, n: int, split_dim: int, concat_dim: int) -> torch.Tensor:
    send = torch.stack(x.chunk(n, split_dim)).contiguous()  # [n, chunk...]: chunk j goes to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), concat_dim)  # block j came from rank j


class _Exchange(torch.autograd.Function):
    """An all-to-all ``fn(x, *args)`` whose backward is the same exchange with ``inverse`` args."""

    @staticmethod
    def forward(x, fn, args, inverse):
        return fn(x, *args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.fn, _, ctx.inverse = inputs

    @staticmethod
    def backward(ctx, grad):
        return ctx.fn(grad, *ctx.inverse), None, None, None


def all_to_all(x: torch.Tensor, axis: str | Sequence[str], split_dim: int, concat_dim: int, *,
               send_sizes: Sequence[int] | None = None, recv_sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Split ``x`` into n chunks along ``split_dim``, send chunk j to rank j of ``axis``, and
    concatenate the chunks received along ``concat_dim`` (in sender order).

    Backward runs the inverse exchange (``split_dim`` and ``concat_dim`` swapped). Uneven
    splits (MoE token dispatch): ``send_sizes[j]`` rows of ``split_dim`` go to rank j
    (``split_dim == concat_dim``); ``recv_sizes`` (what each rank sends here) is exchanged
    first when not given, so no rank waits on a guess.

    Args:
        x: this rank's tensor; the same shape on every rank of the group (even splits).
        axis: a non-FSDP mesh axis name, or several (n = the product of their sizes).
        split_dim: the dim cut into n chunks, one per destination rank.
        concat_dim: the dim the received chunks are joined along.
        send_sizes: n row counts of ``split_dim`` for uneven chunks (None: n equal chunks).
        recv_sizes: n row counts this rank receives (None: exchanged first).

    Raises:
        MeshError: ``axis`` is empty, not an axis of the step's mesh, or an FSDP axis.
        ValueError: the ranks of the axis pass different shapes or dtypes (found before any data moves).
        IndexError: ``split_dim`` or ``concat_dim`` is out of range for ``x``.
        ValueError: n does not divide ``x.shape[split_dim]`` (pad it to a multiple of n, or
            pass ``send_sizes``), or the sizes are not n non-negative counts summing right.
    """
    if has_torch_function((x,)):
        kw = {} if send_sizes is None else {"send_sizes": send_sizes, "recv_sizes": recv_sizes}
        return handle_torch_function(all_to_all, (x,), x, axis, split_dim, concat_dim, **kw)
    group, n, virtual = _setup(axis, "all_to_all")
    split_dim = normalize_dim(x, split_dim, "all_to_all", "split_dim")
    concat_dim = normalize_dim(x, concat_dim, "all_to_all", "concat_dim")
    uneven = send_sizes is not None
    if uneven:
        send = _sizes(send_sizes, n, axis, "send_sizes", x.shape[split_dim])
        if split_dim != concat_dim:
            raise ValueError(f"hpf.all_to_all over {axis!r} with send_sizes: uneven chunks can only be "
                             f"concatenated along the dim they were split on; got split_dim {split_dim}, "
                             f"concat_dim {concat_dim}")
    elif x.shape[split_dim] % n:
        raise ValueError(f"hpf.all_to_all over {axis!r}: split_dim {split_dim} has size "
                         f"{x.shape[split_dim]}, which {n} ranks do not divide; pad it to a multiple of {n}, "
                         f"or pass send_sizes= for uneven chunks")
    if n == 1:
        return x.view_as(x)
    if virtual:
        return x.clone() if uneven else torch.cat(x.chunk(n, split_dim), concat_dim)
    _same_on_every_rank("all_to_all", axis, x, group, split_dim if uneven else None)
    if not uneven:
        return _Exchange.apply(x, _exchange, (group, n, split_dim, concat_dim), (group, n, concat_dim, split_dim))
    if recv_sizes is None:  # counts first: every rank learns what it will receive (no hang on a guess)
        counts = torch.tensor(send, dtype=torch.int64, device=x.device)
        recv_sizes = torch.empty_like(counts)
        dist.all_to_all_single(recv_sizes, counts, group=group)
    recv = _sizes(recv_sizes, n, axis, "recv_sizes", None)
    return _Exchange.apply(x, _exchange_v, (group, send, recv, split_dim), (group, recv, send, split_dim))


def _sizes(sizes, n: int, axis, name: str, total: int | None) -> list[int]:
    out = [int(s) for s in (sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes)]
    if len(out) != n or min(out, default=0) < 0 or (total is not None and sum(out) != total):
        raise ValueError(f"hpf.all_to_all over {axis!r}: {name}={out} must be {n} non-negative counts"
                         + (f" summing to {total} (the size of split_dim)" if total is not None else ""))
    return out


def _exchange_v(x: torch.Tensor, group, send: list[int], recv: list[int], dim: int) -> torch.Tensor:
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((sum(recv),) + tuple(x0.shape[1:]))
    dist.all_to_all_single(out, x0, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out.movedim(0, dim)


# -- axis_index ----------------------------------------------------------------------------------------
def axis_index(axis: str | Sequence[str]) -> torch.Tensor:
    """This rank's position along ``axis``: a 0-dim int64 CPU tensor (usable to index device
    tensors without a sync). Index with the tensor, e.g. ``x[i]`` or ``x.narrow(0, i * n, n)``,
    so validation mode can follow it; ``int(i)`` also works but is not tracked. Outside a
    step it is 0.

    Args:
        axis: a non-FSDP mesh axis name, or several (row-major position over them, in mesh order).

    Raises:
        MeshError: ``axis`` is empty, not an axis of the step's mesh, or an FSDP axis.
    """
    if torch._C._is_torch_function_mode_enabled():
        return handle_torch_function(axis_index, (), axis)
    ctx = _CURRENT.get()
    if ctx is None:
        return torch.tensor(0)
    return torch.tensor(ctx.mesh.group_index(ctx.axes(axis, "axis_index"), ctx.rank))


def normalize_dim(x: torch.Tensor, dim: int, op: str, name: str) -> int:
    """``dim`` of ``x`` as a non-negative index, or IndexError naming ``op``'s argument ``name``."""
    if not -x.dim() <= dim < max(x.dim(), 1):
        raise IndexError(f"hpf.{op}: {name}={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % max(x.dim(), 1)
