"""Calibrate the ``local-cpu`` profile on this machine: alpha and beta of gloo and of the
shared-memory transport (ShmGroup) per group size, AdamW's memory rate, a big matmul's
peak, the seconds of a block and root (forward + backward) of each model shape, in fp32 and
bf16, measured with every rank computing at once (the cores are shared as in a real run), how
much a collective and compute slow each other down when they share the cores, hpf's
per-unit CPU overhead (one rank, no communication), the compute thread's seconds per
collective issued through hpf's comm (``issue_s``), and FSDP2's own all-gather and
reduce-scatter path through ``fully_shard`` (``ops``; what the simulator charges FSDP2).
Collectives are fitted up to the shapes' largest bucket; every term is the median of
``--launches`` launches (a shared host has slow spells longer than one launch).

``hpf calibrate --out calib.json`` runs it (hpf.cli.calibrate); pass the file to
``hpf simulate --hardware calib.json``. The tests never run a calibration.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import queue
import resource
import socket
import statistics
import threading
import time

import numpy as np
import optree
import torch

from ..comm import world
from ..comm.transport import reduce_scatter_async
from ..launcher import launch
from ..mesh import Mesh
from ..models import MODELS, gpt
from ..planning import plan
from .hardware import compute_key, parse_compute_key

__all__ = ["calibrate", "fit_alpha_beta", "stages", "add_issue_costs", "add_fsdp2_comm", "add_sync_terms", "as_shape",
           "check_layers_fit", "with_load"]


def fit_alpha_beta(p: int, sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least squares of t = (p-1)*alpha + (p-1)/p * n/beta over buffer sizes n (bytes), on
    relative residuals: unweighted, the 16 MiB point's noise decides alpha, which then
    says nothing about the small collectives it is for."""
    t = np.asarray(seconds, float)
    slope, intercept = np.polyfit(np.asarray(sizes, float), t, 1, w=1.0 / t)
    slope = max(slope, 1e-15)
    return max(intercept, 0.0) / (p - 1), (p - 1) / p / slope


def _median_slowest(fn, reps: int, pick=statistics.median, min_s: float = 0.3) -> float:
    return _median_slowest_each([fn], reps, pick, min_s)[0][0]


def _median_slowest_each(fns, reps: int, pick=statistics.median,
                         min_s: float = 0.3) -> tuple[list[float], list[float]]:
    """Each of ``fns`` timed in turn (interleaved, so drifting load hits them alike), every rank at
    once after a barrier: the ``pick`` over reps of the slowest rank's time. At least ``reps`` reps,
    more (up to 8x) while they take under ``min_s`` together: on shared cores a millisecond call's
    median of 7 moves by 2-4x between calibrations. The ranks agree on the count. Also each fn's
    skew: the median over reps of the mean rank's lead on the slowest, as a fraction of the
    slowest's time (ranks sharing cores finish the same work 4-30% apart here)."""
    probe = torch.tensor([_timed(lambda: [fn() for fn in fns])], dtype=torch.float64)
    world.all_reduce(probe, op="max")
    reps = max(reps, min(8 * reps, int(min_s / max(float(probe), 1e-6))))
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            world.barrier()
            ts.append(_timed(fn))
    every = world.all_gather_object(times)
    per_rep = [list(zip(*(r[i] for r in every))) for i in range(len(fns))]  # per fn: reps x ranks
    return ([pick([max(ts) for ts in reps_]) for reps_ in per_rep],
            [statistics.median((max(ts) - statistics.mean(ts)) / max(ts) for ts in reps_) for reps_ in per_rep])


def _contention(comm_of, small: int, large: int, reps: int, stretch_at: int = 0) -> tuple[float, float, float]:
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
    n_mm = max(1, int(0.5 * 8 * l_c * large / big / max(_timed(lambda: side.work(3)) / 3, 1e-6)))
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
            box.append(_timed(fn))
            done.set()

    def work(self, n: int) -> None:
        for _ in range(n):
            self.a @ self.a

    @staticmethod
    def alone(fn, n: int = 1) -> float:
        world.barrier()
        return _timed(lambda: [fn() for _ in range(n)])

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
        t_mm = _timed(lambda: self.work(n_mm))
        while not done.is_set():
            self.work(1)
        return t_mm

    def close(self) -> None:
        self.jobs.put(None)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _median_of_launches(fn, world: int, *args, launches: int = 3):
    """The element-wise median of ``launches`` launches of ``fn`` (rank 0's results): one launch
    spans a few seconds and can land on a slow spell of the shared host, where a small
    collective's median reads several times its usual value."""
    runs = [launch(fn, world, *args)[0] for _ in range(launches)]
    return optree.tree_map(lambda *xs: statistics.median(xs), *runs)


def _comm_rank(rank, sizes, reps):
    from ..comm import ShmGroup

    n = world.world_size()
    largest = max(sizes) // 4 // n * n
    group = ShmGroup(None, nbytes=(n + 1) * largest * 4 + (1 << 20))
    full_all = group.buffer("full", largest, torch.float32)
    grad_all = group.buffer("grad", largest, torch.float32, per_rank=True)
    out = {}
    for nbytes in sizes:
        numel = nbytes // 4 // n * n
        k = numel // n
        full, shard, res = torch.randn(numel), torch.randn(k), torch.empty(k)
        out[nbytes] = {
            ("gloo", "all_gather"): _median_slowest(lambda: world.all_gather_into(full, shard), reps),
            ("gloo", "reduce_scatter"): _median_slowest(lambda: reduce_scatter_async(res, full).wait(), reps),
            ("gloo", "native_reduce_scatter"): _median_slowest(lambda: world.reduce_scatter_into(res, full), reps),
            ("shm", "all_gather"): _median_slowest(lambda: group.all_gather_into(full_all[:numel], shard), reps),
            ("shm", "reduce_scatter"): _median_slowest(lambda: group.reduce_scatter(res, grad_all[:numel]), reps),
        }
    def gloo_of(nbytes):
        numel = nbytes // 4 // n * n
        full, shard = torch.randn(numel), torch.randn(numel // n)
        return lambda: world.all_gather_into(full, shard)

    def shm_of(nbytes):
        numel = nbytes // 4 // n * n
        shard = torch.randn(numel // n)
        return lambda: group.all_gather_into(full_all[:numel], shard)
    small, large = 64 << 10, min(4 << 20, largest * 4)  # a small bucket and a block's
    # shared memory copies 4 MiB in 0.4 ms, inside the noise of the 3 ms wait: its stretch needs 16
    out["contention"] = {"gloo": _contention(gloo_of, small, large, reps),
                         "shm": _contention(shm_of, small, large, reps, stretch_at=min(4 * large, largest * 4))}
    group.close()
    return out


def _compute_rank(rank, shapes, reps, precisions=(None, "bf16")):
    """Seconds of forward + backward of a 1- and an up-to-4-layer model at each (model, config,
    local batch), in fp32 and in bf16 (params cast, as mixed precision's gathers hand them to the
    loss); the median rep of each, because runs are judged by their median step under the same
    shared load (the fastest rep would under-predict them)."""
    out = {}
    for model, name, batch in shapes:
        mod = MODELS[model]
        depth = min(max(mod.CONFIGS[name].n_layers, 2), 4)  # up to 4 blocks: less noise per block, bounded time
        for precision in precisions:
            fns = []
            for layers in (1, depth):
                cfg = _with_layers(mod.CONFIGS[name], layers)
                params = mod.init(cfg)
                if precision:
                    params = optree.tree_map(lambda p: p.to(torch.bfloat16), params)
                leaves = [p.requires_grad_() for p in optree.tree_leaves(params)]
                data, loss_fn = mod.global_batch(cfg, batch, 0, 0), mod.loss_for(cfg)
                fns.append(lambda params=params, leaves=leaves, data=data, loss_fn=loss_fn:
                           torch.autograd.grad(loss_fn(params, data), leaves))
            slowest, skew = _median_slowest_each(fns, reps, min_s=1.0)
            times = dict(zip((1, depth), slowest))
            block = max((times[depth] - times[1]) / (depth - 1), 1e-6)
            out[compute_key(model, name, batch, world.world_size(), precision)] = {
                "block_s": block, "root_s": max(times[1] - block, 0.0), "skew": skew[1]}
    # AdamW's memory rate (the optimizer and copy model) and a big matmul's peak, also under load
    n = 1 << 22
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], foreach=True)
    adamw_s = _median_slowest(opt.step, reps)
    a = torch.randn(1024, 1024)
    mm_s = _median_slowest(lambda: a @ a, reps)
    return out, 28 * n / adamw_s, 2 * 1024 ** 3 / mm_s


def tiny_overhead_per_pass(make_step, reps: int) -> float:
    """A framework's per-unit CPU cost beyond the model's math (its hooks, views, handles, update
    calls): one rank, no communication, the tiny GPT, whose math is nearly free. ``make_step(params,
    config)`` gives (a call running one training step on a batch, the unit passes it makes); its
    steps interleave with plain autograd on the same params, so drifting load hits both alike, and
    the difference of their 20% quantiles (other load only ever adds time) is spread over the passes."""
    cfg = gpt.CONFIGS["tiny"]
    params = gpt.init(cfg)
    data = gpt.global_batch(cfg, 4, 0, 0)
    run_step, passes = make_step(params, cfg)
    leaves = [p.requires_grad_() for p in torch.utils._pytree.tree_leaves(params)]
    loss_fn = gpt.loss_for(cfg)
    framework, plain = [], []
    for i in range(5 * reps + 3):
        t = time.perf_counter()
        run_step(data)
        t1 = time.perf_counter()
        torch.autograd.grad(loss_fn(params, data), leaves)
        if i >= 3:
            framework.append(t1 - t)
            plain.append(time.perf_counter() - t1)
    low = lambda ts: float(np.quantile(ts, 0.2))  # noqa: E731
    return max(low(framework) - low(plain), 0.0) / passes


def _hpf_step(params, cfg):
    """hpf's step on one rank, and its passes: each unit's forward and backward."""
    import hpf

    step = hpf.shard_step(gpt.loss_for(cfg), mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw(lr=1e-3),
                          topology=None)
    state = [step.init(params)]

    def run(data):
        state[0] = step(state[0], data)[0]
    return run, 2 * (cfg.n_layers + 1)


def _overhead_rank(rank, reps):
    return tiny_overhead_per_pass(_hpf_step, reps)


SIZES_MIB = (1 / 64, 0.0625, 0.25, 1, 4, 16)  # the collective sizes alpha and beta are fitted on


def as_shape(shape: tuple) -> tuple[str, str, int]:
    """A calibrated shape as (model, config, local batch); a (config, local batch) pair is a GPT's."""
    return tuple(shape) if len(shape) == 3 else ("gpt", *shape)


def sizes_for(shapes) -> tuple[float, ...]:
    """``SIZES_MIB``, extended by 4x steps to cover the largest bucket of the shapes' GPTs (MiB): above
    32 MiB glibc maps every fresh buffer anew, so a fit up to 16 MiB under-charges medium's 190 MiB
    root. Capped at 256 MiB (and a 32nd of the free shared and host memory: each rank maps several
    buffers of the size): a 505B model's buckets are extrapolated from there, not allocated."""
    largest = max(b.padded_numel * 4 / 2 ** 20 for model, name, _ in map(as_shape, shapes)
                  for b in plan(MODELS[model].init(MODELS[model].CONFIGS[name], device="meta"), Mesh({"dp": 2})).buckets)
    largest = min(largest, 256, _room_mib() / 32)
    sizes = list(SIZES_MIB)
    while sizes[-1] < largest:
        sizes.append(sizes[-1] * 4)
    return tuple(sizes)


def _with_layers(config, layers: int):
    """``config`` cut to ``layers`` blocks (a MoE keeps at most that many dense ones)."""
    cut = {"n_dense_layers": min(config.n_dense_layers, layers)} if hasattr(config, "n_dense_layers") else {}
    return dataclasses.replace(config, n_layers=layers, **cut)


def check_layers_fit(shapes) -> None:
    """Compute is timed on a 1-block model of each shape's width: refuse, before any rank starts,
    one this machine cannot hold (its params, grads and moments at fp32, 16 bytes each)."""
    room = _room_mib() * 2 ** 20
    for model, name, _ in shapes:
        mod = MODELS[model]
        need = 16 * mod.num_params(_with_layers(mod.CONFIGS[name], 1))
        if need > room:
            raise ValueError(f"calibrating {model} {name!r} times a 1-block model of its width, which needs about "
                             f"{need / 2**30:,.0f} GiB here ({room / 2**30:,.0f} GiB free): pass --hardware NAME "
                             "(hpf.sim's profiles, e.g. cloudmatrix384) or a calibration file made on a machine "
                             "that holds one block")


def _room_mib() -> float:
    """Free shared memory (where the shm collectives live) or host memory, whichever is less (MiB)."""
    from ..memory import machine_memory

    try:
        shm = os.statvfs("/dev/shm")
        free_shm = shm.f_bavail * shm.f_frsize
    except OSError:
        free_shm = float("inf")
    return min(free_shm, machine_memory(1)[0]) / 2 ** 20


class _Flat(torch.nn.Module):
    """One flat parameter whose forward reads it (so backward makes its full-size grad) and
    costs nothing else: a unit reduced to FSDP2's own work."""

    def __init__(self, numel: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(numel))

    def forward(self, x):
        return x + self.w[:1].sum()


def _fsdp2_comm_rank(rank, sizes, reps) -> dict:
    """FSDP2's own gather and reduction of a ``fully_shard``-ed flat param of each size (bytes), as
    its hooks run them in a step, synchronously on CPU ranks: a chain of such modules, forward (each
    gathered: copy-in, a fresh output, all_gather, copy-out; then resharded) and backward (each
    re-gathered, then its grad reduce-scattered: copy-in, FSDP2's op, the sharded grad's views).
    Per module: gather = forward / k, reduction = backward / k - gather. (Explicit ``unshard()``
    calls cost about half of a gather inside a forward at 16 KiB, so timing them would under-charge
    FSDP2.) The slowest rank's median, per op."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    w = world.world_size()
    mesh = init_device_mesh("cpu", (w,))
    out = {"all_gather": [], "reduce_scatter": []}
    x = torch.zeros(())
    for nbytes in sizes:
        k = 4 if nbytes <= 16 << 20 else 2  # fewer of the big ones: a 256 MiB module is 1 s a pass
        chain = torch.nn.Sequential(*[_Flat(nbytes // 4 // w * w) for _ in range(k)])
        for m in chain:
            fully_shard(m, mesh=mesh)
        fully_shard(chain, mesh=mesh)
        box = []
        (fwd, bwd), _ = _median_slowest_each([lambda: box.append(chain(x)), lambda: box.pop().backward()], reps)
        out["all_gather"].append(fwd / k)
        out["reduce_scatter"].append(max(bwd - fwd, 0.0) / k)
    return out


def _quiet(what: str) -> None:
    """The default ``stage`` callback: calibrate says nothing (``hpf calibrate`` prints each stage)."""


def stages(world_sizes, update: dict | None = None) -> int:
    """How many times calibrate (or ``--update`` of the calibration ``update``) calls ``stage``."""
    w = len(world_sizes if update is None else update["links"]["gloo"])
    if update is None:
        return 6 * w + 2
    return (0 if "issue_when" in update else 2 * w) + (0 if "fsdp2_comm_when" in update else w + 1) \
        + (0 if "sync_when" in update else w)


def add_fsdp2_comm(calib: dict, reps: int = 7, sizes_mib=SIZES_MIB, launches: int = 3, stage=_quiet) -> dict:
    """FSDP2's gather and reduce-scatter figures per gloo world, as ``ops`` of the gloo links (alpha,
    beta fitted as the others): what the simulator charges FSDP2 on CPU ranks, in place. Less the
    smallest size's seconds on one rank (hooks and Python: in ``fsdp2_unit_overhead_s`` already);
    the median of ``launches`` launches per size (the cores are shared)."""
    sizes = [int(m * 2 ** 20) for m in sizes_mib]

    stage("FSDP2's own collectives on 1 rank (its per-call floor)")
    one = _median_of_launches(_fsdp2_comm_rank, 1, sizes[:1], reps, launches=launches)
    for w, link in calib["links"]["gloo"].items():
        stage(f"FSDP2's all-gather and reduce-scatter through fully_shard on {w} ranks")
        meas = _median_of_launches(_fsdp2_comm_rank, int(w), sizes, reps, launches=launches)
        link.setdefault("ops", {}).update({
            f"fsdp2_{op}": fit_alpha_beta(int(w), sizes, [max(t - one[op][0], 1e-6) for t in ts])
            for op, ts in meas.items()})
    calib["fsdp2_comm_when"] = datetime.datetime.now().isoformat(timespec="seconds")
    return calib


def _issue_rank(rank, two_tier: bool, reps: int) -> float:
    """Seconds of the compute thread per collective through hpf's own comm (TieredComm on shared
    memory, or BucketComm on gloo), the tiny GPT's buckets, every rank computing small Python-heavy
    ops between issue and wait as a small model's step does: the issue and wait calls, and what the
    comm threads take from compute (GIL, cores). Comm vs no comm, interleaved; the slowest rank's median."""
    import hpf

    w = world.world_size()
    cfg = gpt.CONFIGS["tiny"]
    mesh = hpf.Mesh({"dp": w} if w <= 2 else {"node": w // 2, "local": 2})
    step = hpf.shard_step(gpt.loss_for(cfg), mesh=mesh, optimizer=hpf.optim.adamw(lr=1e-3),
                          topology=hpf.Topology() if two_tier else None)
    step.init(gpt.init(cfg))
    comm = step.comm
    bufs = [(b.index, comm.full_buffer(b.index, torch.float32), torch.randn(b.padded_numel // b.shard_size),
             comm.grad_buffer(b.index, torch.float32), torch.empty(b.padded_numel // b.shard_size))
            for b in step.plan.buckets]
    a = torch.randn(cfg.d_model, cfg.d_model)

    def compute():
        x = a
        for _ in range(50):
            x = torch.tanh(x @ a)

    def loop(with_comm: bool) -> float:  # compute-thread seconds outside waits, per collective
        busy = 0.0
        for b, full, shard, flat, grad in bufs:
            for issue in (lambda: comm.all_gather(b, full, shard), lambda: comm.reduce(b, grad, flat)):
                t = time.perf_counter()
                handle = issue() if with_comm else None
                compute()
                busy += time.perf_counter() - t
                if handle is not None:
                    handle.wait()
        return busy / (2 * len(bufs))

    costs = []
    for i in range(3 * reps + 2):  # noisy on shared cores: more reps than the long benchmarks
        world.barrier()
        with_comm = loop(True)
        world.barrier()
        if i >= 2:
            costs.append(with_comm - loop(False))
    step.close()
    per_rank = world.all_gather_object(statistics.median(costs))
    return max(0.0, max(per_rank))


def add_issue_costs(calib: dict, reps: int = 7, launches: int = 3, stage=_quiet) -> dict:
    """Measure ``issue_s`` for every (transport, world) of a calibration, in place (also what
    ``--update`` adds to a calibration file that lacks it)."""
    for transport, per in calib["links"].items():
        for w, link in per.items():
            stage(f"compute-thread cost per collective, {transport}, {w} ranks")
            link["issue_s"] = _median_of_launches(_issue_rank, int(w), transport == "shm", reps, launches=launches)
    calib["issue_when"] = datetime.datetime.now().isoformat(timespec="seconds")
    return calib


def _concurrency_rank(rank, nbytes: int, reps: int) -> float:
    """How far gloo's ProcessGroup runs two collectives at once (its worker threads, 2 by default),
    as hpf's flat comm overlaps them: an all-gather of ``nbytes`` issued with an all-to-all of 4x that
    (a gather beside a reduction), each alone and both together, interleaved. ``overlap`` =
    (together - longer) / shorter: 0 when they run side by side, 1 when they take the sum. Median of reps."""
    w = world.world_size()
    numel = nbytes // 4 // w * w
    full, shard, big, recv = torch.randn(numel), torch.randn(numel // w), torch.randn(4 * numel), torch.empty(4 * numel)
    ag = lambda: world.all_gather_into(full, shard, async_op=True)  # noqa: E731
    a2a = lambda: world.all_to_all_into(recv, big, async_op=True)  # noqa: E731
    ratios = []
    for i in range(reps + 1):
        ts = []
        for fn in (lambda: ag().wait(), lambda: a2a().wait(), lambda: [h.wait() for h in (a2a(), ag())]):
            world.barrier()
            ts.append(_timed(fn))
        if i:
            ratios.append((ts[2] - max(ts[:2])) / min(ts[:2]))
    every = world.all_gather_object(ratios)
    return min(max(statistics.median(statistics.mean(r) for r in zip(*every)), 0.0), 1.0)


def add_sync_terms(calib: dict, reps: int = 7, nbytes: int = 256 << 10, launches: int = 3, stage=_quiet) -> dict:
    """Per gloo world: ``overlap`` of two collectives at once (``_concurrency_rank``; ``nbytes``: a tiny
    GPT bucket's), in place."""
    for w, link in calib["links"]["gloo"].items():
        stage(f"two gloo collectives at once, {w} ranks")
        link["overlap"] = _median_of_launches(_concurrency_rank, int(w), nbytes, 2 * reps, launches=launches)
    calib["sync_when"] = datetime.datetime.now().isoformat(timespec="seconds")
    return calib


def _cpu_seconds() -> tuple[float, float]:
    """(the busy seconds of every core since boot, /proc/stat's; this process's and its reaped
    children's CPU seconds)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    mine = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), mine


def with_load(fn):
    """``fn()`` (which forks and reaps its ranks, as ``launch`` does) and the machine's load while it
    ran: {"others_cores": the cores other processes kept busy on average (the machine's busy time
    less this process's and its ranks'; a VM's stolen time counts), "own_cores": the cores it and
    its ranks used, "cores", "loadavg"}. Other work on the cores slows every figure measured."""
    started, (busy0, mine0) = time.perf_counter(), _cpu_seconds()
    out = fn()
    wall, (busy1, mine1) = time.perf_counter() - started, _cpu_seconds()
    own = (mine1 - mine0) / wall
    return out, {"others_cores": round(max(0.0, (busy1 - busy0) / wall - own), 3), "own_cores": round(own, 3),
                 "cores": len(os.sched_getaffinity(0)), "loadavg": [round(x, 2) for x in os.getloadavg()]}


def calibrate(world_sizes=(2, 4), shapes=(("tiny", 4), ("small", 2)),
              sizes_mib=None, reps: int = 7, launches: int = 3, stage=_quiet, quick: bool = False,
              precisions=(None, "bf16")) -> dict:
    """Measure and fit; returns the calibration dict (``json.dump`` it; hardware() loads the file).
    Every term is the median of ``launches`` launches; collectives at ``sizes_mib`` (default
    ``sizes_for(shapes)``); compute in each of ``precisions``. ``stage(what)`` is called as each of
    ``stages(world_sizes)`` parts begins. ``quick``: only the links, the compute and the per-unit
    overhead (what the plan search ranks hpf's candidates by; not FSDP2's path, the issue costs or
    the sync terms: those stay 0)."""
    shapes = [as_shape(s) for s in shapes]
    check_layers_fit(shapes)
    sizes_mib = sizes_mib or sizes_for(shapes)
    sizes = [int(m * 2 ** 20) for m in sizes_mib]
    links: dict = {"gloo": {}, "shm": {}}
    compute, mem_bw, peak = {}, [], []
    for w in world_sizes:
        stage(f"gloo and shared-memory collectives on {w} ranks, {len(sizes)} sizes up to {max(sizes_mib):g} MiB")
        meas = _median_of_launches(_comm_rank, w, sizes, reps, launches=launches)
        for transport in ("gloo", "shm"):
            link = {}
            ops = (("all_gather", ""), ("reduce_scatter", "rs_"))
            for op, key in ops + ((("native_reduce_scatter", "native_rs_"),) if transport == "gloo" else ()):
                alpha, beta = fit_alpha_beta(w, sizes, [meas[s][transport, op] for s in sizes])
                link[key + "alpha"], link[key + "beta"] = alpha, beta
            link["cpu_slowdown"], link["busy_slowdown"], link["busy_latency"] = meas["contention"][transport]
            link["source"] = (f"fitted on {len(sizes)} sizes {sizes_mib} MiB, {w} ranks, median of {reps}+ "
                              f"calls, median of {launches} launches")
            links[transport][w] = link
        named = " and ".join(p or "fp32" for p in precisions)
        stage(f"compute of {', '.join(compute_key(m, n, b, w) for m, n, b in shapes)} in {named}, AdamW and "
              "matmul rates")
        comp, bw, pk = _median_of_launches(_compute_rank, w, list(shapes), reps, tuple(precisions), launches=launches)
        compute.update(comp)
        mem_bw.append(bw)
        peak.append(pk)
    peak_flops = max(peak)
    effs = []
    for key, c in compute.items():
        model, name, batch, _, precision = parse_compute_key(key)
        if precision or model != "gpt":
            continue  # the fp32 peak's efficiency, from GPT's uniform blocks
        flops = gpt.unit_flops(gpt.CONFIGS[name], batch)
        if c["block_s"] > 1e-5:  # a block lost in the noise says nothing about efficiency
            effs.append(min(1.0, 3 * flops["blocks/0"] / c["block_s"] / peak_flops))
    stage("hpf's per-unit overhead on 1 rank")
    overhead = launch(_overhead_rank, 1, reps)[0]
    calib = {"host": socket.gethostname(), "when": datetime.datetime.now().isoformat(timespec="seconds"),
             "cores": len(os.sched_getaffinity(0)), "kernel_overhead_s": overhead,
             "torch": torch.__version__, "peak_flops": peak_flops, "efficiency": statistics.median(effs) if effs else 0.5,
             "mem_bw": statistics.median(mem_bw), "links": links, "compute": compute}
    if quick:
        return {**calib, "quick": True}
    calib = add_fsdp2_comm(add_issue_costs(calib, reps, launches, stage), reps, sizes_mib, launches, stage)
    return add_sync_terms(calib, reps, launches=launches, stage=stage)
