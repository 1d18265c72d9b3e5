"""Running `hpf` as a user does, for the command tests: a subprocess, its exit code and its one-line error."""
import os
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
