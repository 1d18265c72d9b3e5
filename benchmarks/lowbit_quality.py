"""Training quality with a low-bit slow tier: the README's real run (Llama small on the Python
standard library's sources, 300 steps, 2x2 mesh, cosine schedule) with full-precision, int8/int8
and int8/int4 (plain rounding, the default, and with error feedback) slow tiers, each on the same
seeds.

One run's final held-out loss moves by a few % under any perturbation: a control run that only
rounds the slow tier's grads to bf16 (2**-9 relative) is part of the table, and the ratios
compare means over the seeds. Prints the mean final held-out losses and their ratios to the
full-precision mean (targets: within 0.5% for int8/int8, 1.5% for int8/int4), writes
docs/results/lowbit_quality.json and draws the mean held-out curves in one figure,
docs/lowbit_quality.png (docs/topology.md shows both). The runs are deterministic, so the
figures reproduce on the same mesh and torch build.

    python benchmarks/lowbit_quality.py [--seeds 0,1,2] [--quick] [--json docs/results/lowbit_quality.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from common import report_ratio, write_results

ROOT = Path(__file__).resolve().parent.parent
RUNS = {"full precision": None, "control: bf16 grads": "none,bf16", "int8 weights, int8 grads": "int8,int8",
        "int8 weights, int4 grads": "int8,int4", "int8 weights, int4 grads + error feedback": "int8,int4,ef"}
TARGETS = {"control: bf16 grads": ("quality/control_bf16_grads/eval_loss", ""),
           "int8 weights, int8 grads": ("quality/int8_int8/eval_loss", "<=1.005"),
           "int8 weights, int4 grads": ("quality/int8_int4/eval_loss", "<=1.015"),
           "int8 weights, int4 grads + error feedback": ("quality/int8_int4_ef/eval_loss", "<=1.015")}


def train(hpf: list[str], data: Path, out: Path, slow: str | None, steps: int, every: int, config: str,
          seed: int) -> dict:
    cmd = [*hpf, "train", "--model", "llama", "--config", config, "--data", str(data), "--eval-every", str(every),
           "--steps", str(steps), "--schedule", "cosine", "--seed", str(seed), "--out", str(out)]
    if slow:
        cmd += ["--slow-precision", slow]
    print("$ " + " ".join(cmd[len(hpf) - 1:]), flush=True)
    started = time.perf_counter()
    subprocess.run(cmd, check=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    shown = " ".join(["hpf", *cmd[len(hpf):]]).replace(str(data), "data/stdlib").replace(str(out), f"runs/{out.name}")
    return {"command": shown, "wall_s": time.perf_counter() - started,
            "losses": [r["loss"] for r in records],
            "eval_losses": [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]}


def final(seeds: list[dict]) -> float:
    """The mean over seeds of the last held-out loss."""
    return sum(r["eval_losses"][-1][1] for r in seeds) / len(seeds)


def plot(runs: dict, config: str, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 3.8), layout="constrained")
    ax = fig.subplots()
    for name, seeds in runs.items():
        steps = [s for s, _ in seeds[0]["eval_losses"]]
        mean = [sum(r["eval_losses"][i][1] for r in seeds) / len(seeds) for i in range(len(steps))]
        ax.plot(steps, mean, marker="o", label=name)
    ax.set(xlabel="step", ylabel=f"held-out loss (mean of {len(seeds)} seeds)",
           title=f"Llama {config} on the standard library, 2 x 2 mesh")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20 steps of llama tiny, one seed: a smoke run of this script")
    ap.add_argument("--seeds", default="0,1,2", help="the seeds every setting runs (default: 0,1,2)")
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "results" / "lowbit_quality.json")
    ap.add_argument("--png", type=Path, default=ROOT / "docs" / "lowbit_quality.png")
    args = ap.parse_args()
    steps, every, config = (20, 10, "tiny") if args.quick else (300, 50, "small")
    seeds = [0] if args.quick else [int(x) for x in args.seeds.split(",")]
    hpf = [sys.executable, "-m", "hpf"]
    stdlib = Path(sysconfig.get_path("stdlib"))
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch) / "data"
        subprocess.run([*hpf, "prepare", *map(str, sorted(stdlib.glob("*.py"))), "--out", str(data)], check=True)
        runs = {name: [train(hpf, data, Path(scratch) / f"run{i}_{seed}", slow, steps, every, config, seed)
                       for seed in seeds] for i, (name, slow) in enumerate(RUNS.items())}
    base = final(runs["full precision"])
    ratios = {}
    for name, (key, target) in TARGETS.items():
        ratios[key] = {"value": final(runs[name]) / base, "target": target, "run": name}
        each = ", ".join(f"{r['eval_losses'][-1][1]:.4f}" for r in runs[name])
        print(f"{name}: final held-out loss {final(runs[name]):.4f} vs {base:.4f} full precision (means of "
              f"{len(seeds)} seeds: {each})")
        report_ratio(key, final(runs[name]) / base, target)
    write_results(args.json, {"settings": {"config": config, "steps": steps, "seeds": seeds}, "runs": runs,
                              "ratio_runs": {key: r["run"] for key, r in ratios.items()}}, quick=args.quick)
    plot(runs, config, args.png)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
