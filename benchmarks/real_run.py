"""The README's real run, measured: text from the Python standard library, Llama small, 300 steps.

Runs exactly ``COMMANDS`` (the README shows the same lines; tests/test_docs.py checks it) in a
scratch folder and writes the figures the docs show (docs/checkpoints.md) to
docs/results/real_run.json: every step's loss, the held-out losses and the wall time. The run
is deterministic, so its losses reproduce bit for bit on the same mesh, torch build, Python (its standard
library is the text) and CPU; another CPU's kernels round in other places, which 300 steps carry into the
third decimal.

    python benchmarks/real_run.py [--json docs/results/real_run.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import write_results

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = [
    "STDLIB=$(python3 -c 'import sysconfig; print(sysconfig.get_path(\"stdlib\"))')",
    "hpf prepare $STDLIB/*.py --out data/stdlib",
    "hpf train --model llama --config small --data data/stdlib --eval-every 50 --steps 300 --schedule cosine "
    "--save-every 100 --out runs/stdlib",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "results" / "real_run.json")
    args = ap.parse_args()
    hpf_bin = Path(sys.executable).parent  # the hpf command of this interpreter's environment
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "PATH": f"{hpf_bin}{os.pathsep}{os.environ['PATH']}"}
        started = time.perf_counter()
        subprocess.run(" && ".join(COMMANDS), shell=True, check=True, cwd=scratch, env=env, executable="/bin/bash")
        wall = time.perf_counter() - started
        with open(Path(scratch) / "runs" / "stdlib" / "metrics.jsonl") as f:
            records = [json.loads(line) for line in f if line.strip()]
        run = json.loads((Path(scratch) / "runs" / "stdlib" / "run.json").read_text())
    result = {"commands": COMMANDS, "losses": [r["loss"] for r in records],
              "eval_losses": [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None],
              "wall_s": wall, "ranks": math.prod(run["axes"].values())}
    print(f"loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}, held-out {result['eval_losses'][-1][1]:.4f}, "
          f"{wall:.0f} s")
    write_results(args.json, result)


if __name__ == "__main__":
    shutil.which("bash") or sys.exit("real_run.py needs bash (the README's commands are bash)")
    main()
