"""Muon against AdamW on real text: Llama small on the Python standard library, 300 steps, 3 seeds.

The README's real run (benchmarks/real_run.py) with ``--optimizer muon`` and ``--optimizer adamw``
(each at the config's default lr: Muon 0.02 for matrices with AdamW at 3e-3 for the rest; AdamW
3e-3), cosine schedule, held-out loss every 50 steps, 2 ranks, seeds 0-2 (init and data order).
Writes docs/results/muon_quality.json (every step's loss and the held-out losses of each run)
and docs/muon_quality.png (both optimizers' curves, mean over seeds with the min-max band, and
the held-out points), and prints the final held-out losses.

    python benchmarks/muon_quality.py [--steps 300] [--seeds 3] [--world-size 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from common import report_ratio, write_results

ROOT = Path(__file__).resolve().parent.parent
OPTIMIZERS = ("adamw", "muon")


def train(hpf: str, data: Path, out: Path, optimizer: str, seed: int, args) -> dict:
    cmd = [hpf, "train", "--model", "llama", "--config", "small", "--data", str(data), "--eval-every", "50",
           "--steps", str(args.steps), "--schedule", "cosine", "--world-size", str(args.world_size),
           "--optimizer", optimizer, "--seed", str(seed), "--out", str(out)]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"optimizer": optimizer, "seed": seed, "command": " ".join(cmd[1:]), "wall_s": time.perf_counter() - t,
            "losses": [r["loss"] for r in records],
            "eval_losses": [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]}


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, color in zip(OPTIMIZERS, ("tab:blue", "tab:orange")):
        mine = [r for r in runs if r["optimizer"] == name]
        steps = range(1, len(mine[0]["losses"]) + 1)
        by_step = list(zip(*(r["losses"] for r in mine)))
        ax.plot(steps, [statistics.mean(x) for x in by_step], color=color, lw=1, label=f"{name} train (mean)")
        ax.fill_between(steps, [min(x) for x in by_step], [max(x) for x in by_step], color=color, alpha=0.2, lw=0)
        evals = list(zip(*([loss for _, loss in r["eval_losses"]] for r in mine)))
        at = [s for s, _ in mine[0]["eval_losses"]]
        ax.errorbar(at, [statistics.mean(x) for x in evals],
                    yerr=[[statistics.mean(x) - min(x) for x in evals], [max(x) - statistics.mean(x) for x in evals]],
                    color=color, marker="o", ms=4, ls="--", capsize=3, label=f"{name} held-out")
    ax.set(xlabel="step", ylabel="loss", ylim=(None, 4.0),
           title=f"Llama small, stdlib text: Muon vs AdamW ({len(runs) // 2} seeds, min-max band)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "results" / "muon_quality.json")
    ap.add_argument("--png", type=Path, default=ROOT / "docs" / "muon_quality.png")
    args = ap.parse_args()
    hpf = str(Path(sys.executable).parent / "hpf")
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch) / "stdlib"
        files = sorted(str(p) for p in Path(sysconfig.get_path("stdlib")).glob("*.py"))
        subprocess.run([hpf, "prepare", *files, "--out", str(data)], check=True, stdout=subprocess.DEVNULL)
        for seed in range(args.seeds):
            for name in OPTIMIZERS:
                runs.append(train(hpf, data, Path(scratch) / f"{name}-{seed}", name, seed, args))
                print(f"{name} seed {seed}: held-out {runs[-1]['eval_losses'][-1][1]:.4f} "
                      f"({runs[-1]['wall_s']:.0f} s)", flush=True)
    print("final held-out loss per seed, and mean:")
    mean = {}
    for name in OPTIMIZERS:
        finals = [r["eval_losses"][-1][1] for r in runs if r["optimizer"] == name]
        mean[name] = statistics.mean(finals)
        print(f"  {name:6s} " + "  ".join(f"{x:.4f}" for x in finals) + f"   mean {mean[name]:.4f}")
    report_ratio("muon/adamw_final_held_out_loss", mean["muon"] / mean["adamw"])
    write_results(args.json, {"runs": runs})  # (before the plot: its environment must not count the plot)
    plot(runs, args.png)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
