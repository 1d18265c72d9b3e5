"""Running `hpf` as a user does, for the command tests: a subprocess, its exit code and its one-line error."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent


NO_MATPLOTLIB = ("import sys; sys.modules['matplotlib'] = None; from hpf.cli import main; "
                 "raise SystemExit(main())")  # what an install without the plot extra sees


def hpf_cmd(*args, env=None, code=None, timeout=240):
    """subprocess.run of `python -m hpf <args>` (or `python -c <code> <args>`) with this checkout first."""
    rendezvous = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    env = {**{k: v for k, v in os.environ.items() if k not in rendezvous},
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    argv = [sys.executable, "-c", code] if code else [sys.executable, "-m", "hpf"]
    return subprocess.run(argv + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def one_error_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("hpf") and "error:" in lines[0] and "Traceback" not in proc.stderr
    return lines[0]


CALIBRATION = REPO / "docs" / "simulate" / "validation" / "calib_small_0.json"  # small/2 on 2 and 4 ranks


def records(folder: Path) -> list[dict]:
    """A run folder's metrics.jsonl, a dict per step."""
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def losses(folder: Path) -> list[float]:
    return [r["loss"] for r in records(folder)]


def calibrated_here(tmp_path) -> dict:
    """An environment whose user cache holds a calibration of this machine."""
    cache = tmp_path / "cache" / "hpf" / f"calibration-{socket.gethostname()}.json"
    cache.parent.mkdir(parents=True)
    cache.write_text(CALIBRATION.read_text())
    return {"XDG_CACHE_HOME": str(tmp_path / "cache")}
