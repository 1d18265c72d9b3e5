"""The run folder of ``hpf train`` (``--out``). Its run.json says what the run is (every option)
and how it ended, so ``--resume`` needs no other flag, a changed option is named before any
rank starts, and a run that stopped before its first checkpoint never locks the folder."""
from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

from hpf import checkpoint
from hpf import jobspec
from hpf.cli.common import CliError, write_atomic

RUN_FILE = "run.json"
# What --resume does with each option: hpf.jobspec declares it (the mesh is inherited).
FIXED = jobspec.resumed(jobspec.FIXED)
INHERITED = ("mesh",) + jobspec.resumed(jobspec.INHERITED)
OPTIONS = FIXED + INHERITED


def read_run(folder: Path) -> dict | None:
    """A run folder's run.json, or None when it has none. One that cannot be read (truncated,
    as on a full disk) is a CliError naming it: its options are the run's, and defaults in
    their place would train another run without a word."""
    file = folder / RUN_FILE
    if not file.is_file():
        return None
    try:
        run = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        run = e
    if not isinstance(run, dict) or not isinstance(run.get("options", {}), dict):
        why = f"{type(run).__name__}: {run}" if isinstance(run, Exception) else "not a JSON object of the run's options"
        raise CliError(f"{file} is damaged ({why}); it holds the run's options, which --resume, hpf eval and hpf "
                       "generate read: restore it from a backup, or start a new run in another --out")
    return run


def write_run(folder: Path, run: dict) -> None:
    write_atomic(folder / RUN_FILE, json.dumps(run, indent=1) + "\n")


def set_status(folder: Path, status: str, **fields) -> None:
    """Record how the run ended ("done", "stopped" (--timeout), "failed: ...", "interrupted") in its run.json
    (a damaged one is left as it is: the error that ends the run is the one to report)."""
    try:
        run = read_run(folder)
    except CliError:
        return
    if run is not None:
        write_run(folder, {**run, "status": status, **fields})


def options_of(args) -> dict:
    """The run's options as run.json keeps them (JSON values)."""
    out = {k: getattr(args, k) for k in OPTIONS if k != "mesh"}
    out["data"] = str(args.data) if args.data else None
    out["fsdp_axes"] = list(args.fsdp_axes) if args.fsdp_axes else None
    out["mesh"] = dict(args.mesh)
    return out


def _steps_done(folder: Path) -> int:
    try:
        with open(folder / "metrics.jsonl") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def checkpoint_step(path: Path) -> int | None:
    """The step of a checkpoint hpf train named (``step_000300``), else None."""
    m = re.fullmatch(r"step_(\d+)", Path(path).name)
    return int(m[1]) if m else None


def _in_use(run: dict) -> bool:
    """Whether the run's driver process still runs on this host (a live run is never clobbered)."""
    if run.get("status") != "running" or run.get("host") != socket.gethostname() or not run.get("pid"):
        return False
    try:
        os.kill(int(run["pid"]), 0)
    except (OSError, ValueError):
        return False
    return int(run["pid"]) != os.getpid()


class Complete(Exception):
    """--resume of a run that has nothing left to do: said in one line, exit code 0."""


def resolve(args, out: Path, fresh: dict, lead: bool = True) -> tuple[str | None, str | None]:
    """Settle the options against the run already in ``out`` (if any), filling ``args`` in place.

    ``fresh`` holds a new run's defaults; options not given are None in ``args`` until this
    fills them. Returns (the checkpoint to resume from or None, a note to print or None).
    Raises CliError when the folder holds a run this command must not touch or change, and
    Complete when ``--resume`` finds nothing left to train. Under torchrun every rank resolves; only
    the ``lead`` (rank 0, which writes run.json) checks that no other run uses the folder."""
    previous = read_run(out) if out.is_dir() else None
    has_run = previous is not None or (out / "metrics.jsonl").exists()
    if lead and previous is not None and _in_use(previous):
        raise CliError(f"--out {out} is in use by a running hpf train (pid {previous['pid']}); pick another folder")
    status, done = (previous or {}).get("status", "stopped"), _steps_done(out)
    newest = checkpoint.latest(out / "checkpoints") if has_run else None
    resume, note, source = None, None, None
    if args.resume not in (None, "latest"):  # an explicit checkpoint, maybe of another run folder
        resume = args.resume
        if not Path(resume).is_dir():
            raise CliError(f"--resume {resume}: no such checkpoint folder")
        source = read_run(Path(resume).resolve().parent.parent)
    elif args.resume == "latest" and args.out is None:
        raise CliError("--resume with no PATH resumes the run in --out DIR; pass --out or a checkpoint PATH")
    elif args.resume == "latest" and not has_run:
        raise CliError(f"--resume: --out {out} holds no run to go on from; check the folder, or start the run "
                       "without --resume")
    elif has_run and status == "done" and (args.resume is None or newest is None or (args.steps or 0) <= done):
        if args.resume is None:
            raise CliError(f"--out {out} already holds a finished run ({done} steps); pick another folder, or "
                           "pass --resume --steps N to train it further")
        _fill(args, (previous or {}).get("options") or {}, fresh, strict=True)  # a changed option: refused
        raise Complete(f"the run in {out} is complete ({done} steps); nothing to do")
    elif newest is not None:
        if args.resume is None:
            raise CliError(f"--out {out} holds a run that stopped at step {done} ({status}) with a checkpoint at "
                           f"{newest.name}; pass --resume to go on from it (its run.json has every option), or "
                           "pick another folder")
        resume, source = str(newest), previous
    elif has_run:  # stopped before its first checkpoint: nothing to keep, so it starts again
        note = (f"--out {out} holds a run that stopped at step {done} ({status}) before its first checkpoint; "
                "it starts again from step 1")
        source = previous if args.resume else None
    saved = (source or {}).get("options") or {}
    _fill(args, saved, fresh, strict=resume is not None)
    if resume and saved.get("steps") not in (None, args.steps):
        note = (f"--steps {args.steps} changes the run's {saved['steps']} steps"
                + (f" (its {args.schedule} lr schedule now ends at step {args.steps})" if args.schedule != "constant"
                   else ""))
    step = checkpoint_step(Path(resume)) if resume else None
    if step is not None and step >= args.steps:
        raise Complete(f"the run of {resume} is complete: the checkpoint is at step {step} of {args.steps}; "
                       "nothing to do")
    return resume, note


def _fill(args, saved: dict, fresh: dict, strict: bool) -> None:
    """Options not given come from the saved run, else from ``fresh``. With ``strict`` (a
    checkpoint to resume), a given option in FIXED that differs from the saved one is an error."""
    given_mesh = args.mesh is not None or args.world_size is not None
    if not given_mesh and saved.get("mesh"):
        args.mesh = saved["mesh"]
    changed = []
    for key in OPTIONS:
        if key == "mesh":
            continue
        value, old = getattr(args, key), saved.get(key)
        if key == "data" and value is not None:
            value = str(value)
        if key == "fsdp_axes" and value is not None:
            value = list(value)
        if value is None:
            value = old if key in saved else fresh.get(key)
        elif strict and key in FIXED and key != "steps" and key in saved and value != old:
            changed.append(f"--{key.replace('_', '-')} {value} differs from the run's {old}")
        if key == "data" and value is not None:
            value = Path(value)
        if key == "fsdp_axes" and value is not None:
            value = tuple(value)
        setattr(args, key, value)
    if changed:
        raise CliError("--resume keeps what the run computes (run.json): " + "; ".join(changed)
                       + "; drop the flag, or start a new run in another --out")
