"""An elastic job's copies: a shard state packed into one buffer, and the way to a rank's buddy."""
from __future__ import annotations

import json
import socket
from typing import Any

import optree
import torch

from ..comm import schedule, world
from ..comm.shm import ShmGroup
from ..comm.transport import PointToPoint
from ..errors import UnrecoverableLossError


class Copy:
    """A shard state packed into one byte buffer, with what it takes to unpack it."""

    def __init__(self, buf: torch.Tensor, header: list):
        self.buf, self.header = buf, header

    @staticmethod
    def layout(state) -> tuple[list, int]:
        """(header, bytes) of ``state`` packed: each leaf's dtype, shape and offset, 8-byte aligned (so
        each views back as its dtype)."""
        header, at = [], 0
        for x in optree.tree_leaves(state):
            header.append([str(x.dtype).removeprefix("torch."), list(x.shape), at])
            at += aligned(x)
        return header, at

    @classmethod
    def of(cls, state, spare: list[torch.Tensor] | None = None) -> "Copy":
        """``state`` packed, into a buffer of ``spare`` of the right size where there is one (a boundary's
        buffer reused, not 10s of MB allocated and faulted in at every boundary)."""
        header, nbytes = cls.layout(state)
        copy = cls(take(spare, nbytes), header)
        for x, into in zip(optree.tree_leaves(state), copy.parts()):
            into.copy_(raw(x))
        return copy

    def parts(self) -> list[torch.Tensor]:
        """Each leaf's bytes in the buffer (unpadded)."""
        return [self.buf[at:at + _nbytes(dtype, shape)] for dtype, shape, at in self.header]

    def unpack(self, like) -> Any:
        """The state, as views of the buffer, in the structure of ``like`` (a state of this job)."""
        leaves, treedef = optree.tree_flatten(like)
        if len(leaves) != len(self.header):
            raise UnrecoverableLossError(f"hpf.elastic: a copy holds {len(self.header)} tensors where the state has "
                                         f"{len(leaves)}; the ranks run different optimizers or models")
        out = [part.view(getattr(torch, dtype)).view(shape) for part, (dtype, shape, _) in zip(self.parts(), self.header)]
        return optree.tree_unflatten(treedef, out)


def _nbytes(dtype: str, shape: list) -> int:
    return int(torch.Size(shape).numel()) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def raw(x: torch.Tensor) -> torch.Tensor:
    """A leaf's bytes (a view where it is contiguous)."""
    return x.detach().reshape(-1).contiguous().view(torch.uint8)


def take(spare: list[torch.Tensor] | None, nbytes: int) -> torch.Tensor:
    """A byte buffer of ``nbytes``: one of ``spare`` (removed from it) if one fits, else a new one."""
    for i, buf in enumerate(spare or []):
        if buf.numel() == nbytes:
            return spare.pop(i)
    return torch.empty(nbytes, dtype=torch.uint8)



def aligned(t: torch.Tensor) -> int:
    """A part's bytes on the wire: padded to 8, so every part views back as its dtype."""
    return -(-t.numel() * t.element_size() // 8) * 8


def padded_bytes(t: torch.Tensor) -> torch.Tensor:
    data = raw(t)
    return torch.cat([data, data.new_zeros(aligned(t) - data.numel())])



SHARED_MEMORY = True  # buddies on one host write each other's copies into shared memory (False: the process group)
_ROW_HEAD = 64  # a shared row's first word says which boundary its copy is of; the copy starts a cache line on


class Link:
    """A generation's way from a rank to its buddy (``to``) and from its partner (``frm``): the partner's
    layout, and, where the members share a host, two rows each in one shared-memory segment
    (hpf.comm.shm) that a rank's partner writes its copy into, one memcpy and no socket. The rows
    alternate boundaries; a row's first word is the boundary written + 1, set after its bytes, so the
    copy is whole once the word says so, even if its writer died just after. What a rank wrote into its
    buddy's row is its own copy too (the segment outlives the buddy), so it packs none of its own."""

    def __init__(self, header: list, nbytes: int, to: int, frm: int, members: list[int]):
        self.mine, self.nbytes, self.to, self.frm_rank, self.frm = header, nbytes, to, frm, members[frm]  # (frm: the partner's member id)
        self.rows, self.row_bytes, self.sent = None, 0, 0
        self.theirs = _partner_layout(header, nbytes, to, frm)
        said = world.all_gather_object((socket.gethostname(), nbytes))
        if SHARED_MEMORY and len({host for host, _ in said}) == 1:
            row = _ROW_HEAD + -(-max(b for _, b in said) // _ROW_HEAD) * _ROW_HEAD
            self.group = ShmGroup(None, 2 * len(said) * row, name_prefix="hpf_elastic")
            self.rows = [self.group.rows(self.group.buffer(k, row, torch.uint8, per_rank=True)) for k in ("even", "odd")]
            self.row_bytes = 2 * row  # (this rank's two rows)

    @property
    def shared(self) -> bool:
        """Whether the copies go through shared memory (the members share a host)."""
        return self.rows is not None

    def send(self, t: int, leaves: list, spare: list[torch.Tensor]) -> Copy | None:
        self.sent += 1
        if self.shared:
            row = self.rows[self.sent % 2][self.to]
            for x, part in zip(leaves, Copy(row[_ROW_HEAD:], self.mine).parts()):
                part.copy_(raw(x))
            row[:8].view(torch.int64)[0] = t + 1
            return None
        partner = Copy(take(spare, self.theirs[1]), self.theirs[0])
        sends = [(self.to, raw(x), 16 + k) for k, x in enumerate(leaves) if x.numel()]
        recvs = [(self.frm_rank, part, 16 + k) for k, part in enumerate(partner.parts()) if part.numel()]
        schedule.wait(PointToPoint(world.exchange(sends, recvs)), "the elastic copies of a boundary")
        return partner

    def written(self) -> Copy:
        """This rank's own copy of the boundary it sent last: what it wrote into its buddy's shared row."""
        return Copy(self.rows[self.sent % 2][self.to][_ROW_HEAD:_ROW_HEAD + self.nbytes], self.mine)

    def landed(self, t: int) -> Copy | None:
        """The partner's copy of boundary ``t`` in this rank's shared row, if it is whole."""
        row = self.rows[self.sent % 2][world.rank()]
        if int(row[:8].view(torch.int64)[0]) != t + 1:
            return None
        return Copy(row[_ROW_HEAD:_ROW_HEAD + self.theirs[1]], self.theirs[0])


def _partner_layout(header: list, nbytes: int, to: int, frm: int) -> tuple[list, int]:
    """Tell rank ``to`` this rank's copy layout (``header``, ``nbytes``) and hear rank ``frm``'s."""
    head = torch.tensor(list(json.dumps(header).encode()), dtype=torch.uint8)
    sizes, theirs = torch.tensor([head.numel(), nbytes]), torch.zeros(2, dtype=torch.int64)
    schedule.wait(PointToPoint(world.exchange([(to, sizes, 1)], [(frm, theirs, 1)])), "an elastic copy's sizes")
    their_head = torch.empty(int(theirs[0]), dtype=torch.uint8)
    schedule.wait(PointToPoint(world.exchange([(to, head, 2)], [(frm, their_head, 2)])), "an elastic copy's layout")
    return json.loads(bytes(their_head.tolist()).decode()), int(theirs[1])
