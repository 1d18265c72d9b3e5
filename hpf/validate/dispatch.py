"""MoE dispatch invariants, checked in validation mode (``collectives.validating()``).

A router or dispatch bug trains silently wrong: a token copy dropped or doubled, a token
computed by an expert another rank owns, gates that do not sum to 1. Validation mode checks
each, on the values (the routing is data, not layout), and raises the named error on every
rank of the expert-parallel axis together (one rank raising alone would leave the others
waiting in the next all-to-all). Production mode runs none of this.

The model calls the checks by name (``collectives.run_check("moe gates", ...)``, "moe
dispatch"); this module registers them, so models never import validation code.
"""
from __future__ import annotations

import torch

from ..comm import world
from ..comm import collectives
from .errors import DispatchError, ExpertPlacementError, GateSumError, TokenLostError

__all__ = ["check_gates", "check_dispatch", "check_placement", "check_return", "raise_together", "DispatchChecks",
           # re-exported: callers raise them as dispatch.X
           "DispatchError", "ExpertPlacementError", "GateSumError", "TokenLostError"]


def check_gates(gates: torch.Tensor, route_scale: float, where: str, rtol: float = 1e-4) -> str | None:
    """Every token's gates [T, k] are finite, >= 0 and sum to ``route_scale``. Returns an error message."""
    g = gates.detach().float()
    sums = g.sum(-1)
    bad = ~torch.isfinite(sums) | ((sums - route_scale).abs() > rtol * abs(route_scale)) | (g < 0).any(-1)
    if not bool(bad.any()):
        return None
    t = int(bad.nonzero()[0, 0])
    return (f"{where}: token {t}'s gates {[round(v, 6) for v in g[t].tolist()]} sum to {float(sums[t]):.6g}, not "
            f"route_scale {route_scale:g} ({int(bad.sum())} of {len(g)} tokens): normalize the top-k gates "
            "(gates / gates.sum(-1, keepdim=True) * route_scale) after picking them")


def check_dispatch(ids: torch.Tensor, tok: torch.Tensor, n_tokens: int, k: int, n_experts: int, where: str) -> str | None:
    """The sender's side: ``ids`` (expert of each copy, in send order) are valid experts, and
    ``tok`` (token of each copy) sends every token exactly k times. Returns an error message."""
    if len(ids) != n_tokens * k or len(tok) != n_tokens * k:
        return f"{where}: {len(ids)} token copies for {n_tokens} tokens x top-{k}; each token needs exactly {k}"
    out_of_range = (ids < 0) | (ids >= n_experts)
    if bool(out_of_range.any()):
        i = int(out_of_range.nonzero()[0, 0])
        return (f"{where}: token {int(tok[i])} is routed to expert {int(ids[i])}, not one of 0..{n_experts - 1}, "
                "so it would be lost: check the router's top-k indices")
    per_token = torch.bincount(tok, minlength=n_tokens)
    bad = (per_token != k).nonzero()
    if len(bad):
        t = int(bad[0, 0])
        return (f"{where}: token {t} is sent to {int(per_token[t])} experts, not its top-{k} "
                f"({len(bad)} tokens affected): the dispatch order must be a permutation of the token copies")
    return None


def check_placement(recv_ids: torch.Tensor, recv_counts: torch.Tensor, owner: int, n_local: int,
                    axis: str, where: str) -> str | None:
    """The receiver's side: every copy that arrived is for an expert this rank owns (experts
    ``owner * n_local ..`` on the ``axis`` rank ``owner``), and the counts agree with the ids."""
    lo = owner * n_local
    wrong = (recv_ids < lo) | (recv_ids >= lo + n_local)
    if bool(wrong.any()):
        i = int(wrong.nonzero()[0, 0])
        return (f"{where}: rank {owner} of {axis!r} received a token for expert {int(recv_ids[i])}, but owns experts "
                f"{lo}..{lo + n_local - 1} ({int(wrong.sum())} of {len(recv_ids)} copies misplaced): send token "
                "copies sorted by expert, so the chunk for rank j holds only rank j's experts")
    got = torch.bincount(recv_ids - lo, minlength=n_local)
    if not torch.equal(got.cpu(), recv_counts.sum(0).cpu()):
        return (f"{where}: rank {owner} of {axis!r} received {got.tolist()} copies per local expert, but the "
                f"exchanged counts say {recv_counts.sum(0).tolist()}: the counts and the tokens disagree")
    return None


def check_return(sent_ids: torch.Tensor, back_ids: torch.Tensor, where: str) -> str | None:
    """The combine: each copy comes back to the place it was sent from (checked by sending
    each copy's expert id out and back along with it)."""
    if back_ids.shape != sent_ids.shape or not torch.equal(back_ids, sent_ids):
        n = len(sent_ids) if back_ids.shape != sent_ids.shape else int((back_ids != sent_ids).sum())
        return (f"{where}: {n} token copies came back from the experts to another place than they left "
                "from: the reverse exchange must undo the dispatch permutation exactly")
    return None


def raise_together(message: str | None, error: type[DispatchError], axis: str | None, device=None) -> None:
    """Raise ``error`` on every rank of ``axis`` if any of them has a message."""
    ctx = collectives.current()
    failed = torch.tensor([message is not None], dtype=torch.int32, device=device)
    if axis is not None and ctx is not None and not ctx.virtual and ctx.mesh.axis_size((axis,)) > 1:
        world.all_reduce(failed, group=ctx.mesh.group((axis,)))
    if message is not None:
        raise error(message)
    if int(failed):
        raise error(f"another rank of {axis!r} found a {error.__name__} in the MoE dispatch (its message names it); "
                    "this rank stops with it")


# -- the checks the MoE model runs by name (hpf.comm.collectives.run_check) ---------------------------
@collectives.register_check("moe gates")
def _gates(gates: torch.Tensor, route_scale: float, axis: str | None) -> None:
    raise_together(check_gates(gates, route_scale, "MoE router"), GateSumError, axis, gates.device)


@collectives.register_check("moe dispatch")
class DispatchChecks:
    """The sender's side at once; ``placement`` then checks the receivers' side and the return
    trip, by sending the expert ids along the tokens' way and back."""

    def __init__(self, ids: torch.Tensor, tok: torch.Tensor, n_tokens: int, k: int, n_experts: int, axis):
        self.ids, self.axis = ids, axis
        raise_together(check_dispatch(ids, tok, n_tokens, k, n_experts, "MoE dispatch"), TokenLostError, axis,
                       ids.device)

    def placement(self, send, recv, recv_counts, n_local: int, perm) -> None:
        axis = self.axis
        recv_ids = collectives.all_to_all(self.ids, axis, 0, 0, send_sizes=send, recv_sizes=recv)
        owner = int(collectives.axis_index(axis))
        raise_together(check_placement(recv_ids, recv_counts, owner, n_local, axis, "MoE dispatch"),
                       ExpertPlacementError, axis, recv_ids.device)
        back = collectives.all_to_all(recv_ids[perm][perm.argsort()], axis, 0, 0, send_sizes=recv, recv_sizes=send)
        raise_together(check_return(self.ids, back, "MoE combine"), TokenLostError, axis, back.device)
