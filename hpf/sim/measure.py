"""How a calibration measures on ranks that share cores: timings, medians, contention, alpha-beta fits.

Each rank's timings, the slowest rank's median over interleaved reps, the median over launches, a
collective's contention with compute, and the alpha-beta fit over buffer sizes: what hpf.sim.calibrate
and hpf.sim.calibrate_terms measure with."""
from __future__ import annotations

import queue
import statistics
import threading
import time

import numpy as np
import optree
import torch

from ..comm import world
from ..launcher import launch

__all__ = ["SIZES_MIB", "fit_alpha_beta", "median_slowest", "median_slowest_each", "contention", "timed",
           "median_of_launches"]

SIZES_MIB = (1 / 64, 0.0625, 0.25, 1, 4, 16)  # the collective sizes alpha and beta are fitted on


def fit_alpha_beta(p: int, sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least squares of t = (p-1)*alpha + (p-1)/p * n/beta over buffer sizes n (bytes), on
    relative residuals: unweighted, the 16 MiB point's noise decides alpha, which then
    says nothing about the small collectives it is for."""
    t = np.asarray(seconds, float)
    slope, intercept = np.polyfit(np.asarray(sizes, float), t, 1, w=1.0 / t)
    slope = max(slope, 1e-15)
    return max(intercept, 0.0) / (p - 1), (p - 1) / p / slope


def median_slowest(fn, reps: int, pick=statistics.median, min_s: float = 0.3) -> float:
    return median_slowest_each([fn], reps, pick, min_s)[0][0]


def median_slowest_each(fns, reps: int, pick=statistics.median,
                         min_s: float = 0.3) -> tuple[list[float], list[float]]:
    """Each of ``fns`` timed in turn (interleaved, so drifting load hits them alike), every rank at
    once after a barrier: the ``pick`` over reps of the slowest rank's time. At least ``reps`` reps,
    more (up to 8x) while they take under ``min_s`` together: on shared cores a millisecond call's
    median of 7 moves by 2-4x between calibrations. The ranks agree on the count. Also each fn's
    skew: the median over reps of the mean rank's lead on the slowest, as a fraction of the
    slowest's time (ranks sharing cores finish the same work 4-30% apart here)."""
    probe = torch.tensor([timed(lambda: [fn() for fn in fns])], dtype=torch.float64)
    world.all_reduce(probe, op="max")
    reps = max(reps, min(8 * reps, int(min_s / max(float(probe), 1e-6))))
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            world.barrier()
            ts.append(timed(fn))
    every = world.all_gather_object(times)
    per_rep = [list(zip(*(r[i] for r in every))) for i in range(len(fns))]  # per fn: reps x ranks
    return ([pick([max(ts) for ts in reps_]) for reps_ in per_rep],
            [statistics.median((max(ts) - statistics.mean(ts)) / max(ts) for ts in reps_) for reps_ in per_rep])


def contention(comm_of, small: int, large: int, reps: int, stretch_at: int = 0) -> tuple[float, float, float]:
    """How a collective and compute share this rank's cores, as hpf's comm workers run beside
    the compute thread: (compute slowdown while the collective runs; the collective's time
    stretch and its extra seconds per call while compute runs). The stretch and the extra
    come from two sizes (bytes: ``small`` and ``stretch_at`` or ``large``), as alpha and beta
    do: on loaded cores a collective mostly pays a fixed wait per call (a descheduled peer),
    not a slower copy. Beside compute, each call goes to an idle worker thread and compute runs
    until it lands, as the engine issues a bucket's collective and computes a unit (a worker kept
    busy by calls in a row would wait for peers that compute keeps off the cores, which a real
    step's collectives do not). Medians of ``2 * reps`` pairs, alone and beside compute interleaved."""
    side = _BesideCompute()
    out = {}
    big = stretch_at or large
    for nbytes, calls in ((small, 16), (big, 4)):  # the small one's wait is a scheduler's: more calls
        fn = comm_of(nbytes)
        pairs = [(side.alone(fn, calls) / calls, side.beside_compute(fn, calls)) for _ in range(2 * reps)]
        out[nbytes] = tuple(statistics.median(p[i] for p in pairs) for i in (0, 1))  # (interleaved)
    (s_a, s_c), (l_a, l_c) = out[small], out[big]
    extra = max(0.0, s_c - s_a)  # the small collective's added time: a wait per call
    stretch = min(max(1.0, (l_c - extra) / l_a), 10.0)  # the rest: slower copies
    # compute's slowdown: matmuls timed inside a long loop of the large collective
    fn = comm_of(large)
    n_mm = max(1, int(0.5 * 8 * l_c * large / big / max(timed(lambda: side.work(3)) / 3, 1e-6)))
    t_mm = statistics.median(side.alone(lambda: side.work(n_mm)) for _ in range(3))
    slow = statistics.median(side.loop_beside_compute(fn, 8, n_mm) / t_mm for _ in range(reps))
    side.close()
    return max(1.0, slow), stretch, extra


class _BesideCompute:
    """A worker thread for collectives beside this rank's compute thread, as hpf's comm workers
    run, and the compute: matmuls long enough per call that the GIL is free most of the time,
    as in a model."""

    def __init__(self):
        self.a = torch.randn(384, 384)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        for fn, box, done in iter(self.jobs.get, None):
            box.append(timed(fn))
            done.set()

    def work(self, n: int) -> None:
        for _ in range(n):
            self.a @ self.a

    @staticmethod
    def alone(fn, n: int = 1) -> float:
        world.barrier()
        return timed(lambda: [fn() for _ in range(n)])

    def beside_compute(self, fn, calls: int) -> float:
        """Seconds per collective, each issued to the worker with compute on this thread until it lands."""
        box = []
        for _ in range(calls):
            done = threading.Event()
            world.barrier()
            self.jobs.put((fn, box, done))
            while not done.is_set():
                self.work(1)
        return sum(box) / calls

    def loop_beside_compute(self, fn, n_comm: int, n_mm: int) -> float:
        """The seconds of n_mm matmuls while a loop of n_comm collectives runs on the worker."""
        done, box = threading.Event(), []
        world.barrier()
        self.jobs.put((lambda: [fn() for _ in range(n_comm)], box, done))
        t_mm = timed(lambda: self.work(n_mm))
        while not done.is_set():
            self.work(1)
        return t_mm

    def close(self) -> None:
        self.jobs.put(None)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def median_of_launches(fn, world: int, *args, launches: int = 3):
    """The element-wise median of ``launches`` launches of ``fn`` (rank 0's results): one launch
    spans a few seconds and can land on a slow spell of the shared host, where a small
    collective's median reads several times its usual value."""
    runs = [launch(fn, world, *args)[0] for _ in range(launches)]
    return optree.tree_map(lambda *xs: statistics.median(xs), *runs)
