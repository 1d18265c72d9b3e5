"""Training quality with a low-bit slow tier: the README's real run (Llama small on the Python
standard library's sources, 300 steps, 2x2 mesh, cosine schedule, seed 0) three times, with
full-precision, int8/int8 and int8/int4 (error feedback, the int4 default) slow tiers.

Prints the final held-out losses and their ratios to the full-precision run's (targets: within
0.5% for int8/int8, 1.5% for int8/int4), writes docs/results/lowbit_quality.json and draws the
three held-out curves in one figure, docs/lowbit_quality.png (docs/topology.md shows both).
The runs are deterministic, so the figures reproduce on the same mesh and torch build.

    python benchmarks/lowbit_quality.py [--quick] [--json docs/results/lowbit_quality.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from common import report_ratio

ROOT = Path(__file__).resolve().parent.parent
RUNS = {"full precision": None, "int8 weights, int8 grads": "int8,int8",
        "int8 weights, int4 grads + error feedback": "int8,int4"}
TARGETS = {"int8 weights, int8 grads": ("quality/int8_int8/eval_loss", "<=1.005"),
           "int8 weights, int4 grads + error feedback": ("quality/int8_int4/eval_loss", "<=1.015")}


def train(hpf: list[str], data: Path, out: Path, slow: str | None, steps: int, every: int, config: str) -> dict:
    cmd = [*hpf, "train", "--model", "llama", "--config", config, "--data", str(data), "--eval-every", str(every),
           "--steps", str(steps), "--schedule", "cosine", "--out", str(out)]
    if slow:
        cmd += ["--slow-precision", slow]
    print("$ " + " ".join(cmd[len(hpf) - 1:]), flush=True)
    started = time.perf_counter()
    subprocess.run(cmd, check=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"command": " ".join(["hpf", *cmd[len(hpf):]]), "wall_s": time.perf_counter() - started,
            "losses": [r["loss"] for r in records],
            "eval_losses": [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]}


def plot(runs: dict, config: str, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 3.8), layout="constrained")
    ax = fig.subplots()
    for name, r in runs.items():
        steps, losses = zip(*r["eval_losses"])
        ax.plot(steps, losses, marker="o", label=name)
    ax.set(xlabel="step", ylabel="held-out loss", title=f"Llama {config} on the standard library, 2 x 2 mesh")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20 steps of llama tiny: a smoke run of this script")
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "results" / "lowbit_quality.json")
    ap.add_argument("--png", type=Path, default=ROOT / "docs" / "lowbit_quality.png")
    args = ap.parse_args()
    steps, every, config = (20, 10, "tiny") if args.quick else (300, 50, "small")
    hpf = [sys.executable, "-m", "hpf"]
    stdlib = Path(sysconfig.get_path("stdlib"))
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch) / "data"
        subprocess.run([*hpf, "prepare", *map(str, sorted(stdlib.glob("*.py"))), "--out", str(data)], check=True)
        runs = {name: train(hpf, data, Path(scratch) / f"run{i}", slow, steps, every, config)
                for i, (name, slow) in enumerate(RUNS.items())}
    base = runs["full precision"]["eval_losses"][-1][1]
    ratios = {}
    for name, (key, target) in TARGETS.items():
        final = runs[name]["eval_losses"][-1][1]
        ratios[key] = {"value": final / base, "target": target}
        print(f"{name}: final held-out loss {final:.4f} vs {base:.4f} full precision")
        report_ratio(key, final / base, target)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"settings": {"quick": args.quick, "config": config, "steps": steps,
                                                  "cores": len(os.sched_getaffinity(0))},
                                     "runs": runs, "ratios": ratios}, indent=1) + "\n")
    plot(runs, config, args.png)
    print(f"wrote {args.json} and {args.png}")


if __name__ == "__main__":
    main()
