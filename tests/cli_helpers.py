"""Running `hpf` as a user does, for the command tests: a process, its exit code and its one-line error."""
import atexit
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent


NO_MATPLOTLIB = ("import sys; sys.modules['matplotlib'] = None; from hpf.cli import main; "
                 "raise SystemExit(main())")  # what an install without the plot extra sees


def hpf_cmd(*args, env=None, code=None, timeout=240, fresh=False, cwd=None):
    """`python -m hpf <args>` (or `python -c <code> <args>`) with this checkout first, as a
    subprocess.CompletedProcess: run by the preloaded interpreter (``Zygote``), or, ``fresh``,
    by a new one (what start-up itself does: packaging, imports)."""
    env = {**_base_env(), **(env or {})}
    argv = [sys.executable, "-c", code] if code else [sys.executable, "-m", "hpf"]
    argv += [str(a) for a in args]
    if fresh:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    return Zygote.get().command([argv[1], *argv[3:]], env, code, timeout, cwd)  # (runpy sets -m's argv[0])


def _base_env() -> dict:
    rendezvous = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    return {**{k: v for k, v in os.environ.items() if k not in rendezvous},
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


class Zygote:
    """tests/cli_zygote.py, started once per test session: each command a fork of it."""

    _one = None

    @classmethod
    def get(cls) -> "Zygote":
        if cls._one is None or cls._one.proc.poll() is not None:
            cls._one = cls()
        return cls._one

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("cli_zygote.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_base_env())
        self.replies = queue.Queue()
        threading.Thread(target=self._read, name="cli-zygote-replies", daemon=True).start()
        atexit.register(self.proc.kill)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.replies.put(json.loads(line))
        self.replies.put({"code": None, "pid": None})

    def command(self, argv: list, env: dict, code, timeout: float, cwd=None) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="hpf-cmd-") as folder:
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            out.touch()
            err.touch()
            request = {"argv": argv, "env": env, "code": code, "cwd": str(cwd or os.getcwd()), "stdout": str(out),
                       "stderr": str(err)}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = self.replies.get(timeout=60)["pid"]
            try:
                returncode = self.replies.get(timeout=timeout)["code"]
            except queue.Empty:
                os.killpg(pid, signal.SIGKILL)
                self.replies.get(timeout=60)
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text()) from None
            if returncode is None:
                raise RuntimeError("the preloaded interpreter (tests/cli_zygote.py) died")
            return subprocess.CompletedProcess(argv, returncode, out.read_text(), err.read_text())


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
