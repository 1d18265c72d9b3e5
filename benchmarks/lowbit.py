"""The low-bit slow tier on GPT small, 2x2 mesh ({"node": 2, "local": 2}), gloo + shared memory.

(1) Slow-tier bytes per rank and step, int8 weights against bf16 weights (scales included),
    int8 and int4 grads against fp32 grads: from the plan report, and counted by the engine in
    a short run (bf16 compute, fp32 grads; the counters follow the plan report's model, and
    tests/test_lowbit.py checks them against what the transports really send).
(2) Step time with an EMULATED slow link (hpf.SlowLink: every slow-tier collective takes at
    least latency + bytes / bandwidth, slept on its comm thread): Topology(slow_weights="int8",
    slow_grads="int8") against today's two-tier step (Topology()), interleaved, medians; at the
    issue's link and at a 10x slower one (where the backward pipeline can no longer hide the
    full-precision slow tier behind compute).
Writes docs/results/lowbit.json (docs/topology.md renders it).
Usage: python benchmarks/lowbit.py [--config small] [--rounds 5] [--latency-ms 1] [--bandwidth-mbs 100] [--quick]
"""
from __future__ import annotations

from pathlib import Path

import torch

import hpf
from hpf import SlowLink, Topology
from hpf.launcher import launch
from hpf.models import gpt
from hpf.precision import SlowPrecision
from hpf.planning import step_plan
from hpf.report import PlanReport

from common import median_ms, mib, parse_step_args, print_table, report_ratio, step_bench_parser, step_runner, time_steps, write_results

MESH = {"node": 2, "local": 2}
WORLD = 4
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results" / "lowbit.json"
BYTES = {"bf16 weights, fp32 grads": None, "int8 weights, int8 grads": "int8,int8", "int8 weights, int4 grads": "int8,int4"}


def topology(slow: str | None, **kw) -> Topology:
    low = SlowPrecision.parse(slow)
    return Topology(fast_transport="shm", slow_weights=low and low.weights, slow_grads=low and low.grads, **kw)


def report_bytes(config) -> dict[str, dict[str, int]]:
    """Slow-tier bytes per step from the plan report, bf16 compute and fp32 grads."""
    out = {}
    for name, slow in BYTES.items():
        plan = step_plan(gpt.init(config, device="meta"), hpf.Mesh(MESH), topology=topology(slow))
        rep = PlanReport.of(plan, compute_dtype=torch.bfloat16, reduce_dtype=torch.float32, hierarchical=True,
                            shm=True)
        out[name] = {op: t["slow"] for op, t in rep.comm.items()}
    return out


def rank_main(rank, args):
    config = gpt.CONFIGS[args.config]
    params = gpt.init(config, hpf.random.key(0))
    mesh = hpf.Mesh(MESH)
    local = args.batch // WORLD
    batches = [gpt.global_batch(config, args.batch, 0, s)[rank * local:(rank + 1) * local] for s in range(8)]
    out = {"counted": {}}
    for name, slow in BYTES.items():  # (1) the engine's counters over one steady step
        step = hpf.shard_step(gpt.loss_for(config), mesh=mesh, optimizer=hpf.optim.adamw(**ADAMW),
                              mixed_precision="bf16", topology=topology(slow))
        run = step_runner(step, params)
        run(batches[0])
        before = step.stats()
        run(batches[1])
        out["counted"][name] = (step.stats() - before).slow_bytes()
        step.close()
    steps = {}
    for speed, mbs in (("", args.bandwidth_mbs), ("/10", args.bandwidth_mbs / 10)):
        link = SlowLink(latency_s=args.latency_ms * 1e-3, bandwidth=mbs * 1e6)
        for name, slow in (("two_tier", None), ("int8_int8", "int8,int8")):
            steps[name + speed] = hpf.shard_step(gpt.loss_for(config), mesh=mesh, optimizer=hpf.optim.adamw(**ADAMW),
                                                 topology=topology(slow, slow_link=link))
    impls = {name: step_runner(step, params) for name, step in steps.items()}
    out["times"], out["losses"], _ = time_steps(impls, batches, args)  # (2)
    for step in steps.values():
        step.close()
    return out


def main():
    ap = step_bench_parser(__doc__)
    ap.add_argument("--latency-ms", type=float, default=1.0, help="emulated slow link: latency per collective")
    ap.add_argument("--bandwidth-mbs", type=float, default=100.0, help="emulated slow link: MB/s per rank")
    ap.add_argument("--json", type=Path, default=RESULTS, help=f"results file (default: {RESULTS})")
    args = parse_step_args(ap)
    config = gpt.CONFIGS[args.config]
    print(f"GPT {args.config} ({gpt.num_params(config) / 1e6:.2f}M params), global batch {args.batch}, mesh {MESH}, "
          f"torch {torch.__version__}")
    planned = report_bytes(config)
    out = launch(rank_main, WORLD, args, timeout=3600)[0]

    print("\n(1) slow-tier bytes per rank per step, bf16 compute, fp32 grads (plan report; engine counters)")
    rows = [[name, mib(planned[name]["all_gather"]), mib(out["counted"][name]["all_gather"]),
             mib(planned[name]["reduce_scatter"]), mib(out["counted"][name]["reduce_scatter"])] for name in BYTES]
    print_table(["slow tier", "all-gather (plan)", "all-gather (engine)", "reduce-scatter (plan)",
                 "reduce-scatter (engine)"], rows)
    base = "bf16 weights, fp32 grads"
    ratios = {}
    for source, data in (("plan", planned), ("engine", out["counted"])):
        for key, (name, op, target) in {"int8_weights": ("int8 weights, int8 grads", "all_gather", "<=0.53"),
                                        "int8_grads": ("int8 weights, int8 grads", "reduce_scatter", "<=0.28"),
                                        "int4_grads": ("int8 weights, int4 grads", "reduce_scatter", "<=0.15")}.items():
            ratios[f"slow_bytes/{key}/{source}"] = (data[name][op] / data[base][op], target)
    for name, (value, target) in ratios.items():
        report_ratio(name, value, target)

    med = {n: median_ms(t) for n, t in out["times"].items()}
    drift = max(abs(a - b) for a, b in zip(out["losses"]["two_tier"], out["losses"]["int8_int8"]))
    print(f"\n(2) EMULATED slow link ({args.latency_ms:g} ms + bytes / {args.bandwidth_mbs:g} MB/s per slow-tier "
          f"collective; /10: a tenth of that bandwidth), median of {len(out['times']['two_tier'])} interleaved steps; "
          f"fp32 compute; largest loss difference {drift:.2e}")
    print_table(["variant", "ms/step", "min ms", "max ms"],
                [[n, med[n], min(t) * 1e3, max(t) * 1e3] for n, t in out["times"].items()])
    ratios["step/link/int8_int8/two_tier"] = (med["int8_int8"] / med["two_tier"], "<=0.6")
    ratios["step/link_10x_slower/int8_int8/two_tier"] = (med["int8_int8/10"] / med["two_tier/10"], "")
    for name, (value, target) in list(ratios.items())[-2:]:
        report_ratio(name, value, target)

    write_results(args.json, {
        "settings": {"config": args.config, "batch": args.batch, "rounds": args.rounds, "calls": args.calls,
                     "latency_ms": args.latency_ms, "bandwidth_mbs": args.bandwidth_mbs},
        "bytes": {"plan": planned, "engine": out["counted"]}, "step_ms": med}, quick=args.quick)


if __name__ == "__main__":
    main()
