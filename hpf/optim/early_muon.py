"""One step's distributed Muon work, begun bucket by bucket as grads land in backward
(``EarlyMuon``): momentum, pieces sent to owners, Newton-Schulz, written after the decision."""
from __future__ import annotations

import torch

from .muon_math import MuonState, qk_clip_
from .stage import Hyper, run

__all__ = ["EarlyMuon"]


class EarlyMuon:
    """One step's Muon work on the plan's flat shards, begun bucket by bucket as grads land.

    ``landed(buckets)``: the momentum of every Muon matrix in those buckets (into copies of the
    state unless ``in_place``), Newton-Schulz of those wholly on this rank, and the pieces of
    split ones posted to their owners; an owner orthogonalizes a split matrix once its pieces
    have arrived (polled, never waited for, so backward never blocks on a peer) and posts the
    results back. ``finish`` waits for the rest; ``apply`` writes params and state. Until
    ``apply`` nothing the caller owns changes, so a step that is skipped drops it (``finish``
    only). Tags are offset by ``epoch``: pieces of an attempt dropped after an error never pair
    with a later attempt's. Every rank lands the buckets in the plan's reduction order, so each
    posts the same pieces; p2p pairing is by peer and tag, so timing differences do not matter.
    """

    def __init__(self, dm: "DistMuon", grads, state: MuonState, scale: float, epoch: int, in_place: bool):
        self.dm, self.grads, self.state, self.scale, self.in_place = dm, grads, state, scale, in_place
        self.tag0 = epoch * (2 * dm._n_tags + 2)
        self.bufs: dict[int, torch.Tensor] = {}  # matrix -> its new momentum piece
        self.dirs: dict[int, torch.Tensor] = {}  # matrix -> its direction (flat; a held piece for held ones)
        self.waiting: list[tuple[int, torch.Tensor, list, list]] = []  # owned: (matrix, whole, receives, arrivals)
        self.posted: list = []  # sends, and the held pieces' results
        self.arrivals: list = []  # the held pieces' low-bit results (dm._arrival)
        self.todo: list[tuple[int, torch.Tensor]] = []  # matrices wholly here, not yet orthogonalized
        self.finished = False

    def grads_final(self, buckets) -> None:
        """The grads of ``buckets`` are final (summed and reduced): start their matrices."""
        dm = self.dm
        idx = [i for b in buckets for i in dm._by_bucket.get(b, ())]
        order = dm._momentum_order
        xs = [order[i] for i in idx]
        if xs:
            gs = [self.grads[x.bucket][x.mine] for x in xs]
            if self.scale != 1.0:
                gs = list(torch._foreach_mul(gs, self.scale))  # (the step scales the grads alike, in place)
            bufs = [self.state.exp_avg[x.bucket][x.mine] for x in xs]
            if not self.in_place:
                bufs = [b.clone() for b in bufs]
            ups = dm.stage.momentum_(gs, bufs)
            self.bufs.update(zip(idx, bufs))
            dtype = dm.comm_dtype or ups[0].dtype
            self.todo += [(i, u) for i, x, u in zip(idx, xs, ups) if x.owner == -1]
            sends, recvs = [], []
            for i, x, u in zip(idx, xs, ups):
                if x.owner == dm.rank:
                    whole, arrivals = dm._assemble(x, u, dtype), []
                    self.waiting.append((i, whole, dm._exchange([], [
                        (r, dm._arrival(r, "grads", whole[part], arrivals), self.tag0 + 2 * x.tag)
                        for r, part in x.others]), arrivals))
                elif x.owner != -1:
                    self.dirs[i] = torch.empty(x.mine.stop - x.mine.start, dtype=dtype, device=u.device)
                    sends.append((x.owner, dm._wire(x.owner, "grads", u, dtype), self.tag0 + 2 * x.tag))
                    recvs.append((x.owner, dm._arrival(x.owner, "weights", self.dirs[i], self.arrivals),
                                  self.tag0 + 2 * x.tag + 1))
            self.posted += dm._exchange(sends, recvs)
        if not self.in_place:  # (in place, after the decision: one batched NS in finish, as many as can)
            self._owners(wait=False)

    def finish(self) -> None:
        """Wait for every piece: owners orthogonalize what is left, every rank's results land."""
        if not self.finished:
            self._owners(wait=True)
            self.dm._unpack(self.posted, self.arrivals)
            self.posted, self.arrivals, self.finished = [], [], True

    def apply(self, grads, params, aux: dict | None = None) -> bool:
        """Write the step (after the decision: ``grads`` already scaled by the step); False,
        with nothing changed, when some matrix never landed (the caller updates instead)."""
        dm, m, state = self.dm, self.dm.muon, self.state
        order = dm._momentum_order
        if len(self.bufs) != len(order):
            self.finish()
            return False
        m.check_rates(int(state.count) + 1)
        gamma = m.qk_gamma(aux)
        state.count.add_(1)
        step = int(state.count)
        run(dm.rest, [grads[b][s] for b, s, _ in dm.adamw], {"exp_avg": [state.exp_avg[b][s] for b, s, _ in dm.adamw],
            "exp_avg_sq": [state.exp_avg_sq[b][c] for b, _, c in dm.adamw]}, [params[b][s] for b, s, _ in dm.adamw],
            Hyper(step))  # (AdamW's part, while pieces travel)
        self.finish()
        if not self.in_place and order:
            torch._foreach_copy_([state.exp_avg[x.bucket][x.mine] for x in order], [self.bufs[i] for i in range(len(order))])
        part, h = dm.matrices.at(Hyper(step))  # (its lr this step, and its decay stage's weight decay)
        lr, wd = h.lr, part.stages[0].weight_decay
        n_here = len(dm.local) + len(dm.owned)
        dm._apply(params, order[:n_here], [self.dirs[i][x.in_matrix] for i, x in enumerate(order[:n_here])], lr, wd)
        dm._apply(params, order[n_here:], [self.dirs[i] for i in range(n_here, len(order))], lr, wd)
        if gamma is not None:  # each rank its own pieces: no communication
            qk_clip_([(params[b][mine], shape, first, heads) for b, mine, shape, first, heads in dm.qk], gamma)
        return True

    def _owners(self, wait: bool) -> None:
        """Orthogonalize the matrices wholly here and the owned ones whose pieces have all
        arrived (``wait``: all of them), in one batched call, and post each holder its piece."""
        dm = self.dm
        ready = [w for w in self.waiting if wait or all(r.is_completed() for r in w[2])]
        if not ready and not self.todo:
            return
        self.waiting = [w for w in self.waiting if not any(w is r for r in ready)]
        for _, _, reqs, arrivals in ready:
            dm._unpack(reqs, arrivals)
        order = dm._momentum_order
        mats = self.todo + [(i, order[i].whole(whole).to(self.bufs[i].dtype)) for i, whole, _, _ in ready]
        self.todo = []
        sends = []
        for (i, _), d in zip(mats, self._orthogonalize([(order[i], u) for i, u in mats])):
            x = order[i]
            self.dirs[i] = d = x.flat(d.view(x.shape))
            sends += [(r, dm._wire(r, "weights", d[part], dm.comm_dtype or self.bufs[i].dtype), self.tag0 + 2 * x.tag + 1)
                      for r, part in x.others]
        if sends:
            self.posted += dm._exchange(sends, [])

    def _orthogonalize(self, mats: list) -> list[torch.Tensor]:
        """Newton-Schulz of (matrix, values) pairs, same shapes batched; flat directions."""
        return [d.reshape(-1) for d in self.dm.stage.orthogonalize([u.view(x.shape) for x, u in mats])]
