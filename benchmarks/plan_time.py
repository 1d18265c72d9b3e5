"""How long the one-time plan resolution takes for the 1B GPT on a 768-rank virtual mesh.

Everything runs on meta tensors in one process: no data, no process group.
Usage: python benchmarks/plan_time.py [--reps 5] [--mesh node=96,local=8] [--config 1b]
"""
import argparse
import statistics
import time

import hpf
from hpf.models import gpt
from hpf.report import PlanReport


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="1b", choices=sorted(gpt.CONFIGS))
    ap.add_argument("--mesh", default="node=96,local=8")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args()
    mesh = hpf.Mesh({k: int(v) for k, v in (kv.split("=") for kv in args.mesh.split(","))})
    config = gpt.CONFIGS[args.config]
    plan_s, report_s = [], []
    for _ in range(1 if args.quick else args.reps):
        t0 = time.perf_counter()
        params = gpt.init(config, device="meta")
        plan = hpf.plan(params, mesh)
        t1 = time.perf_counter()
        text = PlanReport.of(plan).format()
        t2 = time.perf_counter()
        plan_s.append(t1 - t0)
        report_s.append(t2 - t1)
    print(text)
    print(f"{args.config} GPT ({gpt.num_params(config) / 1e9:.2f}B params) on {mesh} ({mesh.size} ranks): "
          f"plan {statistics.median(plan_s) * 1e3:.1f} ms, report {statistics.median(report_s) * 1e3:.1f} ms "
          f"(median of {len(plan_s)})")


if __name__ == "__main__":
    main()
