"""One rank's timeline: its compute thread, its FIFO collective workers and its reductions in flight.

hpf.sim.model plays a step's schedule on it; ``InFlight`` is the engine's bound on the reductions
in flight (hpf.engine.reduce)."""
from __future__ import annotations

from collections import Counter, defaultdict

from ..engine.reduce import to_wait
from .costs import Options, Unit

__all__ = ["Timeline", "issue_buckets", "InFlight"]


class Timeline:
    """One rank's compute thread and FIFO collective workers; times in seconds.

    ``speed`` and ``peers`` make it a rank ahead of the slowest: its CPU work takes ``speed`` x
    the calibrated (slowest rank's) seconds, and no collective starts before the slowest rank
    issued it (``peers``: that rank's issue time of each collective, by ``_key``)."""

    def __init__(self, history: list[tuple[list, float]] = (), speed: float = 1.0, peers: dict | None = None):
        self.speed, self.peers = speed, peers
        self.issued: dict[tuple, float] = {}  # collective -> when this rank issued it
        self._counts: Counter = Counter()
        self.t = self.t0 = 0.0
        self.free = defaultdict(float)
        self.contended: list[tuple[float, float, float]] = []  # (start, end, compute slowdown) of busy links
        self.computing: list[tuple[float, float]] = []  # this step's compute intervals from its start
        # earlier passes' last steps (compute intervals, step time), each repeated as a steady state:
        # where a stage overlaps compute. Averaged over the passes, as one pass's alignment flips the next's.
        self.history = [[(a + k * T, b + k * T) for k in (-1, 0, 1, 2) for a, b in ivs] for ivs, T in history]
        self.reset_counters()

    def begin_step(self):
        self.t0, self.computing = self.t, []

    def _overlap(self, start: float, end: float) -> float:
        """The share of [start, end) the earlier passes' steady steps spent computing."""
        if end <= start:
            return 0.0
        start, end = start - self.t0, end - self.t0
        both = sum(max(0.0, min(end, b) - max(start, a)) for ivs in self.history for a, b in ivs
                   if a < end and b > start)
        return both / (end - start) / len(self.history) if self.history else 0.0

    def reset_counters(self):
        self.busy, self.wait, self.compute_s, self.opt_s = Counter(), 0.0, 0.0, 0.0
        self.bytes = {op: {"fast": 0, "slow": 0} for op in ("all_gather", "reduce_scatter", "all_reduce")}

    def _key(self, what) -> tuple:
        """The n-th issue of a collective (a bucket's stages, or the step's all-reduce): the same
        collective on every rank, whatever order each rank's timing issued the others in."""
        self._counts[what] += 1
        return what, self._counts[what]

    def _start(self, what) -> float:
        """When a collective issued now can start: here, once the slowest rank issued it too."""
        key = self._key(what)
        self.issued[key] = self.t
        return max(self.t, self.peers.get(key, self.t)) if self.peers is not None else self.t

    def sync(self, seconds: float) -> None:
        """The step's closing all-reduce (loss and grad norm): every rank leaves it together; its
        time, and a faster rank's wait for the slowest in it, are not engine waits."""
        self.t = self._start("sync") + seconds

    def submit(self, stages, what=None) -> float:
        """Run ``stages`` (one bucket's, in order) from now; ``what`` names the collective
        (default: the stages list, which a unit keeps for its bucket). Returns when it ends."""
        t = self._start(id(stages) if what is None else what)
        for worker, seconds, tier, op, nbytes, link in stages:
            other = None
            if worker == "pg" and link.overlap < 1.0:  # gloo's two worker threads: the earlier-free one
                worker = min(("pg", "pg#2"), key=lambda w: self.free[w])
                other = "pg" if worker == "pg#2" else "pg#2"
            start = max(t, self.free[worker])
            if seconds > 0 and (link.busy_slowdown > 1.0 or link.busy_latency):  # slower beside compute
                share = self._overlap(start, start + seconds)
                seconds *= 1.0 + share * (link.busy_slowdown - 1.0)
                seconds += share * link.busy_latency
            if other is not None:  # beside one still running: + overlap x the time they share
                seconds += link.overlap * max(0.0, min(seconds, self.free[other] - start))
            t = start + seconds
            self.free[worker] = t
            if link.cpu_slowdown > 1.0 and seconds > 0:
                self.contended.append((start, t, link.cpu_slowdown))
            self.busy[tier] += seconds
            for k, n in nbytes.items():
                self.bytes[op][k] += n
        return t

    def wait_until(self, end: float):
        if end > self.t:
            self.wait += end - self.t
            self.t = end

    def run(self, seconds: float, optimizer: bool = False):
        """``seconds`` of compute-thread work; slower while a contending link is busy. Stages
        are all submitted before the compute that overlaps them (one thread issues both),
        so their busy intervals are known here."""
        start = self.t
        self.contended = [c for c in self.contended if c[1] > start]
        t, left = start, seconds * self.speed
        while left > 0:
            active = [c for c in self.contended if c[0] <= t < c[1]]
            rate = 1.0 / max((c[2] for c in active), default=1.0)
            edges = [c[1] for c in active] + [c[0] for c in self.contended if c[0] > t]
            span = min(edges, default=float("inf")) - t
            if span * rate >= left:
                t += left / rate
                break
            t += span
            left -= span * rate
        self.t = t
        if t > start:
            self.computing.append((start - self.t0, t - self.t0))
        if optimizer:
            self.opt_s += t - start
        else:
            self.compute_s += t - start


def issue_buckets(tl: Timeline, per_bucket: list) -> float:
    """Each bucket's stages submitted from now: when the last of them ends."""
    return max((tl.submit(stages) for stages in per_bucket), default=tl.t)


class InFlight:
    """The simulated rank's reductions in flight and the engine's bound on them (hpf.engine.reduce)."""

    def __init__(self, tl: Timeline, opts: Options):
        self.tl, self.opts = tl, opts
        self.items: list[tuple[bool, float, float]] = []  # per reduction issued: (holds memory, end, landing's sum)

    def make_room(self) -> None:
        """Reducer._make_room: landed ones are polled (and summed), then the oldest waited for."""
        tl = self.tl
        while self.items and self.items[0][1] <= tl.t:
            tl.run(self.items.pop(0)[2])
        for _ in range(to_wait([holds for holds, _, _ in self.items])):
            _, end, land = self.items.pop(0)
            tl.wait_until(end)
            tl.wait_until(tl.t + land)

    def issue(self, u: Unit) -> None:
        tl = self.tl
        self.make_room()
        tl.run(u.issue_s)
        end = issue_buckets(tl, u.reduce)
        if not self.opts.pipeline:  # waited (and summed) at once
            tl.wait_until(end)
            tl.wait_until(tl.t + u.land_s)
        self.items.append((u.holds_grads, end, u.land_s if self.opts.pipeline else 0.0))

    def wait_all(self) -> None:
        for _, end, land in self.items:
            self.tl.wait_until(end)
            self.tl.wait_until(self.tl.t + land)
        self.items.clear()
