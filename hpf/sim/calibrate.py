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
The measuring itself is hpf.sim.measure's; the terms ``--update`` adds are hpf.sim.calibrate_terms'.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import resource
import socket
import statistics
import time

import numpy as np
import optree
import torch

from ..comm import world
from ..comm.handles import reduce_scatter_async
from ..launcher import launch
from ..mesh import Mesh
from ..models import MODELS, gpt
from ..planning import plan
from .calibrate_terms import add_fsdp2_comm, add_issue_costs, add_sync_terms, quiet
from .hardware import compute_key, parse_compute_key
from .measure import SIZES_MIB, contention, fit_alpha_beta, median_of_launches, median_slowest, median_slowest_each

__all__ = ["calibrate", "stages", "tiny_overhead_per_pass", "as_shape", "sizes_for", "check_layers_fit", "with_load"]


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
            ("gloo", "all_gather"): median_slowest(lambda: world.all_gather_into(full, shard), reps),
            ("gloo", "reduce_scatter"): median_slowest(lambda: reduce_scatter_async(res, full).wait(), reps),
            ("gloo", "native_reduce_scatter"): median_slowest(lambda: world.reduce_scatter_into(res, full), reps),
            ("shm", "all_gather"): median_slowest(lambda: group.all_gather_into(full_all[:numel], shard), reps),
            ("shm", "reduce_scatter"): median_slowest(lambda: group.reduce_scatter(res, grad_all[:numel]), reps),
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
    out["contention"] = {"gloo": contention(gloo_of, small, large, reps),
                         "shm": contention(shm_of, small, large, reps, stretch_at=min(4 * large, largest * 4))}
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
            slowest, skew = median_slowest_each(fns, reps, min_s=1.0)
            times = dict(zip((1, depth), slowest))
            block = max((times[depth] - times[1]) / (depth - 1), 1e-6)
            out[compute_key(model, name, batch, world.world_size(), precision)] = {
                "block_s": block, "root_s": max(times[1] - block, 0.0), "skew": skew[1]}
    # AdamW's memory rate (the optimizer and copy model) and a big matmul's peak, also under load
    n = 1 << 22
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], foreach=True)
    adamw_s = median_slowest(opt.step, reps)
    a = torch.randn(1024, 1024)
    mm_s = median_slowest(lambda: a @ a, reps)
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


def stages(world_sizes, update: dict | None = None) -> int:
    """How many times calibrate (or ``--update`` of the calibration ``update``) calls ``stage``."""
    w = len(world_sizes if update is None else update["links"]["gloo"])
    if update is None:
        return 6 * w + 2
    return (0 if "issue_when" in update else 2 * w) + (0 if "fsdp2_comm_when" in update else w + 1) \
        + (0 if "sync_when" in update else w)


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
              sizes_mib=None, reps: int = 7, launches: int = 3, stage=quiet, quick: bool = False,
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
        meas = median_of_launches(_comm_rank, w, sizes, reps, launches=launches)
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
        comp, bw, pk = median_of_launches(_compute_rank, w, list(shapes), reps, tuple(precisions), launches=launches)
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
