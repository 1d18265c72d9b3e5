"""``hpf train --elastic``: one rank's training loop under hpf.elastic, and the driver's part.

A lost rank is survived in memory (hpf.elastic) on one data axis, which shrinks and grows back.
metrics.jsonl is written by whichever member is rank 0 at the time, each step once (a redone
step keeps its first line: in the invariant mode the redo has the same bits). Each loss and join
(the step, the seconds, the bytes received) goes back to the driver, which prints it and keeps
it in run.json's ``elastic``. Under torchrun each member is one torchrun's worker, meeting the
others in ``hpf store`` (served here too), and the last generation's rank 0 writes the summary."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import socket
import time
from pathlib import Path

import hpf
from hpf import elastic, launcher
from hpf.cli import run_folder
from hpf.cli.common import CliError
from hpf.cli.job import (TrainJob, batches_of, first_state, make_step, peak_flops, pin_threads, read_metrics, run_keys,
                         save_checkpoint, step_flops, step_record)
from hpf.comm import world
from hpf.misuse import finite_or_none
from hpf.models import MODELS, mesh_for, spec_of
from hpf.optim.lr_schedules import Schedule

# the options an elastic run does not take yet, and why
_REFUSED = {"timeout": "it runs to the end", "dropout": "its masks need each rank's example keys",
            "eval_every": "the held-out loss is not evaluated", "plan": "its world changes", "trace": "",
            "tensorboard": ""}


def checked_mesh(args, mesh: hpf.Mesh, given: bool) -> hpf.Mesh:
    """The mesh of an elastic run: one data axis of ``mesh.size`` ranks (``given``: --mesh was passed,
    and must be one); refuses what it cannot run, naming the option, and sets --invariant's atom size
    to one that every world it passes through splits the batch into."""
    if launcher.is_launched():
        _check_member(args, mesh, given)
    for name, why in _REFUSED.items():
        if getattr(args, name, None) not in (None, False, 0):
            raise CliError(f"--elastic does not take --{name.replace('_', '-')} yet" + (f" ({why})" if why else "")
                           + "; drop one of them")
    if spec_of(MODELS[args.model]).balancer:
        raise CliError(f"--elastic: --model {args.model} keeps loop state (its expert bias) the copies do not hold; "
                       "use gpt or llama")
    if given and len(mesh.axis_names) > 1:
        raise CliError(f"--elastic shrinks one data axis; --mesh has {mesh.axis_names}: pass --world-size "
                       f"{mesh.size} instead")
    if args.accumulate != 1:
        raise CliError("--elastic does not take --accumulate yet; drop it (or raise --batch-size)")
    n, b = mesh.size, args.batch_size
    worlds = [w for w in (n, n - 1) if w >= 1]
    if any(b % w for w in worlds):
        need = math.lcm(*worlds)
        raise CliError(f"--elastic: --batch-size {b} must split over {n} ranks and, after a loss, over {n - 1}; "
                       f"use a multiple of {need} (e.g. --batch-size {need * max(1, round(b / need))})")
    if args.invariant and args.atom_size is None:  # atoms every world's local batch is made of
        args.atom_size = math.gcd(*(b // w for w in worlds))
    if args.hsdp and n % 2:
        raise CliError(f"--elastic --hsdp runs two replicas of {n} / 2 ranks; pass an even --world-size")
    return elastic_mesh(n, args.hsdp)


def elastic_mesh(n: int, hsdp: bool) -> hpf.Mesh:
    """The mesh of an elastic world of ``n`` ranks: one data axis; with --hsdp, where ``n`` is even, two
    machines of ``n / 2`` ranks whose replicas are each other's copies (nothing is sent at a boundary)."""
    return mesh_for({"node": 2, "local": n // 2} if hsdp and n % 2 == 0 else {"dp": n})


def _step(job: TrainJob, n: int):
    """The job's step on ``n`` ranks (--hsdp only where the world splits in two replicas)."""
    return make_step(dataclasses.replace(job, hsdp=job.hsdp and n % 2 == 0), elastic_mesh(n, job.hsdp))


def _check_member(args, mesh: hpf.Mesh, given: bool) -> None:
    """Under torchrun: one member per torchrun (its agent restarts only it; one torchrun over every
    member would restart them all when one fails, and no copy in memory would be left), meeting in
    ``hpf store``. Names what is missing."""
    how = ("run each member under a torchrun of its own: HPF_ELASTIC_STORE=HOST:PORT (of `hpf store`) "
           "HPF_ELASTIC_MEMBER=<0..N-1> torchrun --nnodes 1 --nproc-per-node 1 --max-restarts R -m hpf train "
           "--elastic --world-size N ... (docs/elastic.md)")
    if launcher.world_size() != 1 or not {"HPF_ELASTIC_STORE", "HPF_ELASTIC_MEMBER"} <= set(os.environ):
        raise CliError(f"--elastic under torchrun: {how}")
    if args.world_size is None and not given:
        raise CliError("--elastic under torchrun needs --world-size N, the members the job starts with")
    if args.replacements:
        raise CliError("--elastic under torchrun: --replacements is torchrun's --max-restarts (a restarted member "
                       "joins at a step boundary); drop --replacements")
    if os.environ.setdefault("HPF_ELASTIC_WORLD_SIZE", str(mesh.size)) != str(mesh.size):
        raise CliError(f"HPF_ELASTIC_WORLD_SIZE={os.environ['HPF_ELASTIC_WORLD_SIZE']} but --world-size is "
                       f"{mesh.size}; make them agree or drop HPF_ELASTIC_WORLD_SIZE")
    launcher.elastic_member()  # (checks HPF_ELASTIC_MEMBER)


def starts_run_folder() -> bool:
    """Whether this process makes the run folder: the driver, or under torchrun member 0's first worker."""
    if not launcher.is_launched():
        return True
    return (os.environ.get("HPF_ELASTIC_MEMBER", os.environ.get("RANK")) == "0"
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")


def run(job: TrainJob, size: int, out: Path) -> bool:
    """Run the elastic ranks: launch them, or under torchrun be one member. The process that ends as
    the driver (or the last generation's rank 0) prints each loss and join and keeps them in run.json;
    returns whether this process is it (and so writes the run's summary)."""
    if starts_run_folder():  # (a resumed run keeps the lines of the steps it does not redo)
        done = (run_folder.checkpoint_step(Path(job.resume)) or 0) if job.resume else 0
        kept = [r for r in read_metrics(job.metrics_path) if r["step"] <= done] if done and os.path.exists(
            job.metrics_path) else []
        Path(job.metrics_path).write_text("".join(json.dumps(r) + "\n" for r in kept))
    if launcher.is_launched():
        launcher.init_distributed()
        result = elastic_rank(0, job)
        launcher.shutdown()
        if result is None or result["rank"] != 0:
            return False
        survived = result
    else:
        results = hpf.launch(elastic_rank, size, job, elastic=True, replacements=job.replacements)
        survived = next(r for r in results if r is not None)
    survived.pop("rank")  # (which rank it was is not the run's record)
    for e in survived["events"]:
        print(describe(e), flush=True)
    run_folder.set_status(out, "running", elastic=survived)
    return True


def describe(e: dict) -> str:
    """One line for a loss or a join survived."""
    who = ", ".join(map(str, e["ranks"]))
    if e["event"] == "lost":
        what = f"rank {who} lost in step {e['at_step'] + 1}: {e['world_size']} ranks went back to step {e['back_to']}"
    else:
        what = f"rank {who} joined after step {e['at_step']}: {e['world_size']} ranks"
    return f"elastic: {what}, state rebuilt in {e['seconds']:.2f} s ({e['bytes_received'] / 2**20:.2f} MiB received)"


def elastic_rank(rank: int, job: TrainJob) -> dict:
    """One rank of ``hpf train --elastic``: hpf.elastic.train on the job's model, data and step; the
    last state is saved as hpf train saves it (``--resume`` and ``load_params`` read it)."""
    pin_threads(job)
    module, config = job.model_config()
    lr = Schedule(job.schedule, job.lr, total_steps=job.steps, warmup=job.warmup)
    tokens, flops, (peak, _) = job.batch_size * config.seq_len, step_flops(module, config, job.batch_size), peak_flops()
    lines = _Lines(Path(job.metrics_path))

    def on_step(i: int, m: dict) -> None:
        if world.rank() == 0:
            n = world.world_size()
            mfu = flops / m["step_s"] / (peak * n) if peak else None
            lines.add({**step_record(i, m, tokens / m["step_s"], lr(i), mfu), "copy_s": m["copy_s"], "world_size": n,
                       "time": time.time()})

    def at_boundary(step, state, t: int) -> None:  # (not async: a rank lost while it writes is survived)
        if 0 < t < job.steps and job.save_due(t):
            save_checkpoint(job, step, state, t, config, None, None, async_save=False)

    run = elastic.train(functools.partial(_step, job), functools.partial(module.init, config),
                        _Batches(job, config), job.steps,
                        key=run_keys(job.seed)[0], on_step=on_step, at_boundary=at_boundary, rejoin_wait=job.rejoin_wait,
                        first=lambda step: first_state(job, step, module, config, None))
    if run.step is None:  # a replacement the job ended without
        return None
    save_checkpoint(job, run.step, run.state, job.steps, config, None, None)
    run.step.wait_save()
    run.step.close()
    return {"events": run.events, "copy_bytes": run.copy_bytes, "world_size": world.world_size(), "rank": world.rank()}


def add_store_parser(sub, help_: str):
    p = sub.add_parser("store", help=help_, description=(
        "Host the store an elastic job's members meet in under torchrun (hpf train --elastic, one torchrun per "
        "member): it outlives every member, so any of them may be lost. Exits once the job has finished."))
    p.add_argument("--port", type=int, default=29400, help="the TCP port to serve on (default 29400; 0: a free one)")
    p.set_defaults(run=cmd_store)
    return p


def cmd_store(args) -> int:
    """Serve until the job's last generation says it finished, and a few seconds more for the members' last reads."""
    finished: list[float] = []

    def ready(port: int) -> None:
        print(f"hpf store: serving on {socket.gethostname()}:{port}; start each member with "
              f"HPF_ELASTIC_STORE={socket.gethostname()}:{port} (docs/elastic.md)", flush=True)

    def until(store) -> bool:
        if not finished and store.check([launcher.JOB_DONE_KEY]):
            finished.append(time.monotonic())
        return bool(finished) and time.monotonic() - finished[0] > _LINGER_S

    launcher.serve_store("0.0.0.0", args.port, ready, until)
    print("hpf store: the job finished", flush=True)
    return 0


_LINGER_S = 5.0  # how long hpf store serves after the job finished (the members' last reads)


class _Batches:
    """``batches(step, rank, world_size)`` over the job's data: one reader, which a redone step or a
    new world restarts at its position (opening a token folder each step would be I/O a step)."""

    def __init__(self, job: TrainJob, config):
        self.job, self.config, self.next, self.reader = job, config, None, None

    def __call__(self, t: int, rank: int, world_size: int):
        if self.next != (t, rank, world_size):
            self.reader = batches_of(self.job, self.config, "train", rank, world_size, start=t)
        self.next = (t + 1, rank, world_size)
        return next(self.reader)


class _Lines:
    """metrics.jsonl as rank 0 now appends to it: each step once (a rank that becomes rank 0 after
    a loss reads where the file is)."""

    def __init__(self, path: Path):
        self.path, self.last = path, None

    def add(self, record: dict) -> None:
        if self.last is None:
            text = self.path.read_text() if self.path.exists() else ""
            self.last = max((json.loads(x)["step"] for x in text.splitlines() if x.strip()), default=0)
        if record["step"] <= self.last:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(finite_or_none(record), allow_nan=False) + "\n")
        self.last = record["step"]
