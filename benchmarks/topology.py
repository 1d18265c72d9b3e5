"""Topology-aware FSDP on a 2x2 mesh ({"node": 2, "local": 2}: 2 emulated hosts of 2 ranks), gloo.

All variants start from the same GPT params, see the same batches and use the same AdamW;
they run interleaved in one job (order rotated every round, medians):
  flat          hpf, flat collectives on gloo (topology=None)
  hsdp          hpf, shard within a host, replicate across hosts, gloo
  flat_tiered   Topology(hierarchical=False): flat collectives on the worker threads (bytes baseline)
  hier_pg       Topology(fast_transport="pg"): two-tier collectives, both tiers on gloo
  hier_shm      Topology(fast_transport="shm"): two-tier, fast tier in shared memory
  hsdp_shm      hier_shm with hsdp=True
  limit         the same model unsharded on each rank's local batch, no communication at all
  fsdp2_hsdp    torch FSDP2 fully_shard on a (2, 2) DeviceMesh (replicate dim 0, shard dim 1),
                nn.Module of the same math (benchmarks/step_vs_fsdp2.py), torch.optim.AdamW
Printed: (1) bytes over the slow tier per step, two-tier vs flat; (2) shared-memory vs gloo
all-gather / reduce-scatter throughput, 1-64 MiB, on the 2 ranks of one emulated host;
(3) median step times; (4) with an EMULATED slow link (every slow-tier collective takes at
least latency + bytes / bandwidth: its comm thread sleeps what the real loopback transfer
leaves of that), the share of step time compute waits on communication: backward pipeline
on vs off, the optimizer update after backward instead of overlapped with it, and no link.
Usage: python benchmarks/topology.py [--config small] [--layers N] [--batch 8] [--rounds 5] [--quick]
"""
from __future__ import annotations

import statistics

import numpy as np
import torch

import hpf
from hpf import SlowLink, Topology
from hpf.launcher import launch
from hpf.models import gpt
from hpf.report import PlanReport

from common import (config_of, median_ms, mib, parse_step_args, print_table, report_ratio, step_bench_parser,
                    time_steps)
from shm_vs_gloo import _bench as shm_vs_gloo_bench
from step_vs_fsdp2 import LOCAL_LOSS, adamw_step, fsdp2_gpt, make_limit

MESH = {"node": 2, "local": 2}
WORLD = 4
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
VARIANTS = {
    "flat": {},
    "hsdp": {"hsdp": True},
    "flat_tiered": {"topology": Topology(hierarchical=False, fast_transport="pg")},
    "hier_pg": {"topology": Topology(fast_transport="pg")},
    "hier_shm": {"topology": Topology(fast_transport="shm")},
    "hsdp_shm": {"topology": Topology(fast_transport="shm"), "hsdp": True},
}


def make_hpf(params, config, mesh, **kwargs):
    step = hpf.shard_step(gpt.loss_for(config), mesh=mesh, optimizer=hpf.optim.adamw(**ADAMW), **kwargs)
    box = [step.init(params)]
    run_metrics = []

    def run(batch):
        box[0], metrics = step(box[0], batch)
        run_metrics.append(metrics)
        return metrics["loss"]
    run.step, run.metrics = step, run_metrics
    return run


def make_fsdp2_hsdp(params, config):
    return adamw_step(fsdp2_gpt(params, config, (MESH["node"], MESH["local"]), ("node", "local")), ADAMW)


def _time(impls, batches, args):
    """Interleaved seconds per step and losses per impl (each impl walks the same batch list)."""
    def reset_counters(_losses):
        for run in impls.values():
            if hasattr(run, "metrics"):
                run.warm = run.step.stats()
                run.metrics.clear()
    times, losses, _cpu = time_steps(impls, batches, args, after_warmup=reset_counters)
    return times, losses


def rank_main(rank, args):
    config = config_of(args)
    params = gpt.init(config, hpf.random.key(0))
    mesh = hpf.Mesh(MESH)
    local = args.batch // WORLD
    batches = [gpt.global_batch(config, args.batch, 0, s)[rank * local:(rank + 1) * local] for s in range(8)]
    out = {}

    # (1) + (3): no slow link; every variant and FSDP2 HSDP, interleaved
    impls = {n: make_hpf(params, config, mesh, **kw) for n, kw in VARIANTS.items()}
    impls["fsdp2_hsdp"] = make_fsdp2_hsdp(params, config)
    impls["limit"] = make_limit(params, config, ADAMW)
    times, losses = _time(impls, batches, args)
    steps = args.rounds * args.calls
    out["times"], out["losses"] = times, losses
    sent = {n: (impls[n].step.stats() - impls[n].warm).slow_bytes() for n in VARIANTS}
    out["slow_bytes"] = {n: {op: b / steps for op, b in by_op.items()} for n, by_op in sent.items()}
    out["report"] = {n: PlanReport.of(
        impls[n].step.plan, hierarchical=bool(kw.get("topology") and kw["topology"].hierarchical)).comm for n, kw in VARIANTS.items()}
    for run in impls.values():
        if hasattr(run, "step"):
            run.step.close()
    del impls

    # (4): the emulated slow link, backward pipeline on vs off; and no link, as the floor
    link = SlowLink(latency_s=args.latency_ms * 1e-3, bandwidth=args.bandwidth_mbs * 1e6)
    slow = {name: make_hpf(params, config, mesh, overlap_optimizer=o,
                           topology=Topology(fast_transport="shm", pipeline=p, slow_link=lk))
            for name, p, o, lk in (("link_pipeline_on", True, True, link), ("link_pipeline_off", False, True, link),
                                   ("link_update_after_backward", True, False, link),
                                   ("no_link_pipeline_on", True, True, None))}
    out["slow_times"], out["slow_losses"] = _time(slow, batches, args)
    out["waits"] = {n: [(m["comm_wait_s"], m["step_s"]) for m in run.metrics] for n, run in slow.items()}
    for run in slow.values():
        run.step.close()
    return out


def check_same_math(losses: dict) -> None:
    """Every implementation must compute the same losses, or their timings compare nothing."""
    losses = {n: v for n, v in losses.items() if n not in LOCAL_LOSS}
    ref = np.array(losses["flat"])
    drift = max(float(np.max(np.abs(np.array(v) - ref))) for v in losses.values())
    first = {n: v[0] for n, v in losses.items()}
    spread = max(first.values()) - min(first.values())
    print(f"sanity: step-0 loss spread {spread:.1e}, max loss difference over {len(ref)} steps {drift:.1e}")
    if spread > 1e-5 or drift > 1e-3:
        raise SystemExit(f"the implementations disagree ({first}): the comparison is meaningless")


def main():
    ap = step_bench_parser(__doc__)
    ap.add_argument("--latency-ms", type=float, default=2.0, help="emulated slow link: latency per collective")
    ap.add_argument("--bandwidth-mbs", type=float, default=100.0, help="emulated slow link: MB/s per rank")
    ap.add_argument("--mib", type=int, nargs="+", default=[1, 4, 16, 64], help="shm vs gloo sizes")
    ap.add_argument("--reps", type=int, default=7, help="shm vs gloo repetitions")
    args = parse_step_args(ap)
    if args.quick:
        args.mib, args.reps = [1, 64], 3
    config = config_of(args)
    print(f"GPT {args.config}, {config.n_layers} layers ({gpt.num_params(config) / 1e6:.2f}M params), global batch {args.batch}, "
          f"mesh {MESH}, gloo, torch {torch.__version__}")
    ranks = launch(rank_main, WORLD, args, timeout=3600)
    out = ranks[0]
    check_same_math(out["losses"])

    # (1) slow-tier bytes
    print("\n(1) bytes sent over the slow tier per rank per step (engine counters; plan report)")
    rows = []
    for n in ("flat", "flat_tiered", "hier_pg", "hier_shm"):
        sb, rep = out["slow_bytes"][n], out["report"][n]
        rows.append([n, mib(sb.get("all_gather", 0)), mib(sb.get("reduce_scatter", 0)), mib(sum(sb.values())),
                     mib(sum(t["slow"] for t in rep.values()))])
    for n in ("hsdp", "hsdp_shm"):  # the engines do not count the replica all-reduce; the report does
        rep = out["report"][n]
        rows.append([n, mib(rep["all_gather"]["slow"]), mib(rep["reduce_scatter"]["slow"]),
                     f"all-reduce {mib(rep['all_reduce']['slow'])} (report)", mib(sum(t["slow"] for t in rep.values()))])
    print_table(["variant", "all-gather", "reduce-scatter", "total", "report total"], rows)
    total = {n: sum(out["slow_bytes"][n].values()) for n in ("flat", "flat_tiered", "hier_pg", "hier_shm")}
    print("  hier_pg vs flat_tiered: the same schedule, so exactly the 1/local model; hier_shm also skips the "
          "backward re-gathers (params stay in the shared buffer)")
    report_ratio("slow_bytes/hier_pg/flat", total["hier_pg"] / total["flat_tiered"], "<=0.5")
    report_ratio("slow_bytes/hier_shm/flat", total["hier_shm"] / total["flat"], "<=0.5")

    # (2) shared memory vs gloo on the 2 ranks of one emulated host (the fast-tier group)
    print(f"\n(2) all-gather / reduce-scatter on one host's {MESH['local']} ranks, fp32, full-buffer size, "
          f"median of {args.reps} (slowest rank per rep); GB/s = full buffer bytes / time")
    table = launch(shm_vs_gloo_bench, MESH["local"], args.mib, args.reps, timeout=1800)[0]
    t = {(m, op, kind): s for _, m, op, kind, s in table}
    print("    like for like with gloo (and with what hpf does): all-gather copies the shard in ('shm'); "
          "reduce-scatter starts from\n    the packed grad buffer, which hpf packs straight into the shared row "
          "('in place'); the other column is shown too")
    rows = []
    for m in args.mib:
        for op in ("all-gather", "reduce-scatter"):
            g, s, ip = (t[m, op, k] for k in ("gloo", "shm", "shm in place"))
            gbs = lambda sec: (m << 20) / sec / 1e9  # noqa: E731
            rows.append([m, op, f"{gbs(g):.2f}", f"{gbs(s):.2f}", f"{g / s:.1f}x", f"{gbs(ip):.2f}", f"{g / ip:.1f}x"])
    print_table(["MiB", "op", "gloo GB/s", "shm GB/s", "shm/gloo", "in place GB/s", "in place/gloo"], rows)
    top = max(args.mib)
    report_ratio(f"shm/gloo/all-gather/{top}MiB", t[top, "all-gather", "gloo"] / t[top, "all-gather", "shm"], ">=5")
    report_ratio(f"shm/gloo/reduce-scatter/{top}MiB",
                 t[top, "reduce-scatter", "gloo"] / t[top, "reduce-scatter", "shm in place"], ">=5")
    report_ratio(f"shm/gloo/reduce-scatter+copy/{top}MiB",
                 t[top, "reduce-scatter", "gloo"] / t[top, "reduce-scatter", "shm"])

    # (3) step time
    med = {n: median_ms(v) for n, v in out["times"].items()}
    print(f"\n(3) median step time over {len(out['times']['flat'])} interleaved steps each")
    print_table(["variant", "ms/step", "min ms", "max ms", "vs flat", "vs fsdp2_hsdp"],
                [[n, med[n], min(v) * 1e3, max(v) * 1e3, f"{med[n] / med['flat']:.3f}",
                  f"{med[n] / med['fsdp2_hsdp']:.3f}"] for n, v in out["times"].items()])
    report_ratio("step/hier_shm/flat", med["hier_shm"] / med["flat"])
    report_ratio("step/hier_shm/fsdp2_hsdp", med["hier_shm"] / med["fsdp2_hsdp"], "<=0.8")
    report_ratio("step/hsdp_shm/fsdp2_hsdp", med["hsdp_shm"] / med["fsdp2_hsdp"], "<=0.8")
    report_ratio("step/hier_shm/limit", med["hier_shm"] / med["limit"])

    # (4) emulated slow link
    check_same_math({"flat": out["losses"]["flat"][:len(out["slow_losses"]["link_pipeline_on"])],
                     **out["slow_losses"]})
    print(f"\n(4) EMULATED slow link ({args.latency_ms:g} ms + bytes / {args.bandwidth_mbs:g} MB/s per slow-tier "
          "collective at least, slept on the comm thread), hier_shm.\n    exposed = comm_wait_s / step_s. rank 0: as "
          "rank 0 sees it, which on 4 ranks time-sliced over few cores includes waiting for descheduled\n"
          "    peers; critical: per step the least-waiting rank (the one the others wait for), i.e. the "
          "communication on the critical path")
    rows, exposed = [], {}
    for n, times in out["slow_times"].items():
        per_step = list(zip(*(r["waits"][n] for r in ranks)))  # per step: (wait, step_s) of every rank
        rank0 = [s[0][0] / s[0][1] for s in per_step]
        crit = [min(w for w, _ in s) / statistics.median(t for _, t in s) for s in per_step]
        exposed[n] = statistics.median(crit)
        rows.append([n, median_ms(times), median_ms([s[0][0] for s in per_step]),
                     f"{100 * statistics.median(rank0):.1f}%", f"{100 * exposed[n]:.1f}%",
                     f"{100 * min(crit):.1f}-{100 * max(crit):.1f}%"])
    print_table(["variant", "ms/step", "rank 0 wait ms", "rank 0 exposed", "critical exposed", "critical range"],
                rows)
    report_ratio("exposed_comm/link/pipeline_on", exposed["link_pipeline_on"], "<=0.05")
    report_ratio("exposed_comm/link/pipeline_off", exposed["link_pipeline_off"])
    report_ratio("exposed_comm/link/update_after_backward", exposed["link_update_after_backward"])
    report_ratio("exposed_comm/no_link/pipeline_on", exposed["no_link_pipeline_on"])
    report_ratio("step/link/pipeline_on/off", median_ms(out["slow_times"]["link_pipeline_on"])
                 / median_ms(out["slow_times"]["link_pipeline_off"]))


if __name__ == "__main__":
    main()
