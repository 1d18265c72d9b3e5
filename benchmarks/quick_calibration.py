"""The default hardware's quick calibration against measured steps (docs/simulate.md's table).

For each job: the quick calibration the default makes (hpf.cli.machine: the job's shape and world,
fp32, 3 repetitions, one launch), taken whatever the load (the CPU time other processes took is
recorded), `hpf simulate` on it, and `hpf train`'s measured median step, one JSON line per job.

    python benchmarks/quick_calibration.py                  # small and medium on 2 and 4 ranks, about 15 min here
    python benchmarks/quick_calibration.py small/2 small/4  # some of them
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hpf.cli.machine import QUICK_REPS  # noqa: E402
from hpf.sim import calibrate as cal  # noqa: E402

# config, ranks, sequences per rank, steps measured (medium: 6-40 s a step here)
JOBS = {"small/2": ("small", 2, 16, 12), "small/4": ("small", 4, 8, 12), "medium/2": ("medium", 2, 1, 4),
        "medium/4": ("medium", 4, 1, 4)}


def hpf(*argv: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "hpf", *argv], capture_output=True, text=True, env=env, check=True)
    return proc.stdout


def one(config: str, ranks: int, local: int, steps: int, folder: Path) -> dict:
    started = time.perf_counter()
    calib, load = cal.with_load(lambda: cal.calibrate((ranks,), (("gpt", config, local),), reps=QUICK_REPS,
                                                      launches=1, quick=True, precisions=(None,)))
    path = folder / f"calib_{config}_{ranks}.json"
    path.write_text(json.dumps(calib))
    seconds = time.perf_counter() - started
    job = ["--config", config, "--world-size", str(ranks)]
    predicted = float(re.search(r"^\s+\d+ hpf\s+([\d.]+)", hpf("simulate", "--hardware", str(path), *job,
                                                               "--local-batch", str(local)), re.M)[1])
    load_before = os.getloadavg()[0]
    out = hpf("train", *job, "--batch-size", str(ranks * local), "--steps", str(steps), "--out", str(folder / f"{config}_{ranks}"))
    measured = float(re.search(r"step time\s+([\d.]+) ms median", out)[1])
    return {"job": f"{config}, {ranks} ranks x {local}", "calibration_s": round(seconds),
            "others_cores": load["others_cores"], "predicted_ms": predicted, "measured_ms": measured,
            "ratio": round(predicted / measured, 3), "load_average_at_run": [load_before, os.getloadavg()[0]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jobs", nargs="*", metavar="CONFIG/RANKS", help=f"some of {', '.join(JOBS)} (default: all)")
    args = parser.parse_args()
    unknown = set(args.jobs) - set(JOBS)
    if unknown:
        parser.error(f"{', '.join(sorted(unknown))}: use some of {', '.join(JOBS)}")
    with tempfile.TemporaryDirectory() as folder:
        for name in args.jobs or JOBS:
            print(json.dumps(one(*JOBS[name], Path(folder))), flush=True)


if __name__ == "__main__":
    main()
