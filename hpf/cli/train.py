"""``hpf train``: the main job, on local processes (hpf.launch) or as one torchrun rank.

Every argument is checked in the driver process before any rank starts, so a mistake costs
one line on stderr, not a traceback from four processes."""
from __future__ import annotations

import datetime
import importlib
import math
import os
import socket
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

import hpf
from hpf import checkpoint
from hpf.errors import NonFiniteError
from hpf import data as token_data
from hpf.cli import elastic_run, run_folder
from hpf import jobspec
from hpf.cli.common import CliError, job_parser, mesh_of, mesh_text
from hpf.jobspec import positive
from hpf.cli.job import EVAL_BATCHES, TRAIN_DEFAULTS, TrainJob, defaults, invariant_of, make_step, read_metrics, train_rank
from hpf.cli.plan import plan_of, report_of
from hpf.cli.search import add_options as add_search_options, apply_plan, check_plan_flags, check_prediction
from hpf.launcher import Terminated, init_distributed, is_launched, launch, rank, shutdown, world_size
from hpf.memory import machine_memory, predict, size
from hpf.models import data_axes, model_config, MODELS, spec_of
from hpf.plots import breakdown, comm_share, missing_matplotlib, save_plots
from hpf.report import PlanReport, millions

__all__ = ["cmd_train", "add_parser", "summary", "check_trained", "read_metrics", "TRAIN_DEFAULTS", "EVAL_BATCHES"]


def _banner(job: TrainJob, n_units: int) -> str:
    """The first line of a run, the same under hpf.launch and torchrun."""
    module, config = job.model_config()
    warmup = f", {job.warmup} warmup steps" if job.warmup else ""
    return (f"hpf train: {job.model} {job.config!r} ({millions(spec_of(module).num_params(config))} params, {n_units} FSDP units) "
            f"on {_ranks(math.prod(job.axes.values()))}, mesh {mesh_text(job.axes)}, "
            f"{job.topology}{' HSDP' if job.hsdp else ''}{f' (slow tier {job.slow_precision})' if job.slow_precision else ''}"
            f", {job.optimizer} lr {job.lr:g} ({job.schedule}{warmup}), "
            f"{job.mixed_precision or 'fp32'} compute, "
            + (f"{job.accumulate} micro-batches per step, " if job.accumulate > 1 else "")
            + (f"recompute {job.recompute}, " if job.recompute != "none" else "")
            + ("compiled blocks, " if job.compile else "") + f"{job.mode} mode"
            + (f", invariant (atoms of {invariant_of(job)['atom_size']} sequences)"
               if job.invariant else ""))


def _ranks(n: int) -> str:
    return f"{n} rank" + ("s" if n != 1 else "")


def _check_memory(job: TrainJob, plan: hpf.Plan, report: PlanReport, local_ranks: int) -> None:
    """Refuse, before anything is allocated, a run whose ranks on this machine would not fit
    (hpf.memory's peak per rank). On the CPU the local ranks share the host's memory. Under
    torchrun with an accelerator each rank checks its own device (the driver of hpf.launch must
    not touch the device before the fork, so there only the host is checked)."""
    module, config = job.model_config()
    available, where = machine_memory(local_ranks)
    on_device = not where.startswith("host")
    mem = predict(module, config, plan, report, local_batch=job.batch_size // plan.mesh.axis_size(data_axes(
                      plan.mesh.axis_names)), cpu=not on_device, **jobspec.inputs(job, "memory"))
    if mem.total <= available:
        return
    raise CliError(
        f"--config {job.config} needs about {size(mem.total)} per rank (peak {mem.format()}), but the {where} is "
        f"{size(available)} per rank; hpf plan --search --config {job.config} finds a plan that fits (or lower "
        "--batch-size, or use more ranks)")


def _prepare_out(out: Path) -> None:
    """Create the run folder, or say in one line why it cannot be."""
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} is a file, not a folder; pick a folder for the run")
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write-test").touch()
        (out / ".write-test").unlink()
    except OSError as e:
        raise CliError(f"--out {out} cannot be written ({e.strerror}); pick a folder you can write to") from None


def _lr_and_warmup(args) -> str | None:
    """Settle --lr and --warmup (per config when not given); a note when the config's own warmup
    outlasts a short run. An explicit --warmup must end before the run does."""
    adamw_lr, muon_lr, warmup = defaults(args.config)
    args.lr = args.lr or (muon_lr if args.optimizer == "muon" else adamw_lr)
    if args.warmup and args.warmup >= args.steps and args.resume is None:  # a resumed run's were checked
        raise CliError(f"--warmup {args.warmup} is not below --steps {args.steps}: the lr would still be rising "
                       f"when the run ends; use a --warmup below {args.steps}")
    if args.warmup is None and warmup >= args.steps:
        if args.schedule != "constant":
            raise CliError(f"--config {args.config}'s warmup of {warmup} steps is not below --steps {args.steps}, "
                           f"so the {args.schedule} schedule would never decay; pass a --warmup below {args.steps}")
        args.warmup = warmup
        return (f"note: --config {args.config}'s warmup of {warmup} steps is not below --steps {args.steps}, so "
                f"the lr stays below its peak {args.lr:g}; pass --warmup to choose")
    args.warmup = warmup if args.warmup is None else args.warmup
    return None


def cmd_train(args) -> int:
    """Fork the ranks here with hpf.launch, or, under torchrun, be one of them."""
    torchrun = is_launched()
    lead = elastic_run.starts_run_folder() if args.elastic else rank() == 0  # rank 0 under torchrun; the driver otherwise
    out = args.out or Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    if args.plan:
        check_plan_flags(args)
    try:
        resume, note = run_folder.resolve(args, out, args.fresh, lead)
    except run_folder.Complete as done:
        if lead:
            print(f"hpf train: {done}")
        return 0
    mesh = mesh_of(args)
    lone = [f for f in ("replacements", "rejoin_wait") if getattr(args, f, None)] if not args.elastic else []
    if lone:
        raise CliError(f"--{lone[0].replace('_', '-')} is an option of --elastic runs; add --elastic or drop it")
    if args.elastic:
        mesh = elastic_run.checked_mesh(args, mesh, given=args.mesh is not None)
    args.mesh = dict(zip(mesh.axis_names, mesh.shape))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", mesh.size)) if torchrun else mesh.size
    plan_note, mesh = apply_plan(args, mesh, local_ranks) if args.plan else (None, mesh)
    vocab_size = _check_data_options(args)
    _check_muon_options(args)
    _check_dropout(args)
    warmup_note, plots = _check_run_options(args, mesh, vocab_size, torchrun, lead)
    job = TrainJob(**{**{k: getattr(args, k) for k in jobspec.defaults("train")},
                      "data": str(args.data) if args.data else None},
                   axes=args.mesh, metrics_path=str(out / "metrics.jsonl"), vocab_size=vocab_size, resume=resume,
                   trace_dir=None if args.trace is None else str(args.trace or out / "trace"),
                   tensorboard=None if args.tensorboard is None else str(args.tensorboard or out / "tensorboard"),
                   stop_at=time.time() + args.timeout if args.timeout else None)
    make_step(job, mesh)  # checks optimizer, mode and precision here, before any rank starts
    plan = plan_of(args, mesh)  # checks the axes
    _check_memory(job, plan, report_of(args, plan)[0], local_ranks)
    if lead:
        _start_run_folder(args, job, out, plots)
        print(_banner(job, len(plan.units)))
        print(_data_line(args, job, out), flush=True)
        for line in (plan_note, note, warmup_note):
            if line:
                print(line, flush=True)
    started = time.perf_counter()
    try:
        stopped, lead = (None, elastic_run.run(job, mesh.size, out)) if job.elastic else \
            (_run_ranks(args, job, mesh, torchrun, lead, out), lead)
        if lead:
            _finish(args, job, out, plots, time.perf_counter() - started, stopped)
    except BaseException as e:  # whatever ends the command with a code other than 0 says so in run.json
        if lead:
            run_folder.set_status(out, "interrupted" if isinstance(e, KeyboardInterrupt) else "terminated"
                                  if isinstance(e, Terminated) else f"failed: {type(e).__name__}")
        raise
    return 0


def _check_run_options(args, mesh: hpf.Mesh, vocab_size: int | None, torchrun: bool,
                       lead: bool) -> tuple[str | None, str | None]:
    """Check the options that need the mesh; (a note on the warmup, what --plot will save)."""
    model_config(args.model, args.config, vocab_size)  # (names a config the model lacks)
    if torchrun and not args.elastic and mesh.size != world_size():
        raise CliError(f"--mesh has {mesh.size} ranks but torchrun started {world_size()}; make them agree")
    readers = mesh.axis_size(data_axes(mesh.axis_names))  # (a tensor-parallel group reads one share)
    if args.batch_size % (readers * args.accumulate):
        per = f"{readers} ranks" + (f" x {args.accumulate} micro-batches" if args.accumulate > 1 else "")
        raise CliError(f"--batch-size {args.batch_size} is the global batch and must split evenly over {per}; "
                       f"use a multiple of {readers * args.accumulate}")
    warmup_note = _lr_and_warmup(args)
    plots = None
    if args.plot:
        skipped = missing_matplotlib("--plot")
        plots = "skipped: matplotlib is not installed" if skipped else "loss.png, step_breakdown.png"
        if skipped and lead:
            print(skipped, file=sys.stderr, flush=True)
    if args.tensorboard is not None:
        try:
            importlib.import_module("torch.utils.tensorboard")  # needs the tensorboard package
        except ImportError:
            raise CliError("--tensorboard needs the tensorboard package: pip install tensorboard (or pip install "
                           "-e '.[tensorboard]'); metrics.jsonl has the same scalars without it") from None
    return warmup_note, plots


def _start_run_folder(args, job: TrainJob, out: Path, plots: str | None) -> None:
    """Rank 0 makes the run folder and its run.json (status running); from here a failure's
    traceback goes to <out>/error.log."""
    _prepare_out(out)
    for folder, option in ((job.trace_dir, "--trace"), (job.tensorboard, "--tensorboard")):
        _make_folder(folder, option)
    run_folder.write_run(out, {
        **asdict(job), "options": run_folder.options_of(args), "plots": plots, "status": "running",
        "host": socket.gethostname(), "pid": os.getpid(), "hpf": hpf.__version__, "torch": torch.__version__,
        "started": datetime.datetime.now().isoformat(timespec="seconds")})
    args.log_dir = out


def _data_line(args, job: TrainJob, out: Path) -> str:
    _, config = job.model_config()
    source = (f"{args.data} (vocab {job.vocab_size}{f', held-out loss every {args.eval_every} steps' if args.eval_every else ''})"
              if args.data else "a fixed random Markov source")
    micro = f" in {args.accumulate} micro-batches" if args.accumulate > 1 else ""
    return (f"data: {args.batch_size} x {config.seq_len} tokens per step{micro} from {source}; run folder {out}"
            + (f"; resuming from {job.resume}" if job.resume else ""))


def _run_ranks(args, job: TrainJob, mesh: hpf.Mesh, torchrun: bool, lead: bool, out: Path) -> int | None:
    """Run the job's ranks; the step --timeout stopped after, or None."""
    if torchrun:
        init_distributed()
        stopped = train_rank(rank(), job)
        shutdown()  # finishes async saves, meets the other ranks, destroys the process group
        return stopped
    # --timeout stops cleanly; only a run still going long after (a hung step) is ended
    return launch(train_rank, mesh.size, job, timeout=args.timeout and 2 * args.timeout + 60)[0]


def _finish(args, job: TrainJob, out: Path, plots: str | None, wall: float, stopped: int | None) -> None:
    """Rank 0, after the ranks: check that something trained, print the summary, then set the
    status (a failure before that is "failed": ``cmd_train``)."""
    records = read_metrics(out / "metrics.jsonl")
    resumed_at = run_folder.checkpoint_step(Path(job.resume)) or 0 if job.resume else 0
    check_trained([r for r in records if r["step"] > resumed_at])
    files = [out / "metrics.jsonl", out / "run.json"]
    newest = checkpoint.latest(job.checkpoints)
    if newest is not None:
        files.append(f"{newest} (the newest checkpoint)")
    if job.trace_dir:  # open in https://ui.perfetto.dev or chrome://tracing
        files.append(Path(job.trace_dir) / "trace.json")
    if job.tensorboard:
        files.append(f"{job.tensorboard} (tensorboard --logdir {job.tensorboard})")
    if plots and not plots.startswith("skipped"):
        files += save_plots(records, out, f"loss: {args.model} {args.config!r}, mesh {mesh_text(job.axes)}, "
                                          f"{args.optimizer}{', ' + args.mixed_precision if args.mixed_precision else ''}")
    print(summary(records, wall, files, resumed_at, "done" if stopped is None else "stopped"))
    run_folder.set_status(out, "done" if stopped is None else "stopped")
    checked = check_prediction(args, [r for r in records if r["step"] > resumed_at + 1])  # (the first warms up)
    if checked:
        print(checked)
    if stopped is not None:
        print(f"  --timeout   {args.timeout:g} s ran out after step {stopped} of {job.steps}, which is saved; "
              f"go on with: hpf train --out {out} --resume")


def check_trained(records: list[dict]) -> None:
    """A run whose every step was skipped trained nothing: an error that says why, not "done".

    Raises:
        NonFiniteError: every record has ``skipped`` true."""
    if records and all(r.get("skipped") for r in records):
        scale = records[-1].get("loss_scale")
        raise NonFiniteError(
            f"every one of the {len(records)} steps was skipped: the grads were non-finite at each"
            + (f" (fp16 loss scale down to {scale:g})" if scale is not None else "") + ", so nothing was trained. "
            "Try --mixed-precision bf16 (or none) or a lower --lr; --mode validate names the op that overflows")


def _make_folder(folder: str | None, option: str) -> None:
    if folder is None:
        return
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CliError(f"{option} {folder} cannot be made ({e.strerror}); pick a folder you can write to") from None


def _check_muon_options(args) -> None:
    """--ns-variant and --qk-clip act on Muon only; QK-Clip needs a model that reports its logits."""
    asked = [f for f, on in (("--ns-variant", args.ns_variant != "standard"), ("--qk-clip", args.qk_clip))
             if on]
    if asked and args.optimizer != "muon":
        raise CliError(f"{' and '.join(asked)} set Muon's options, but --optimizer is {args.optimizer}; pass "
                       "--optimizer muon, or drop them")
    if args.qk_clip and spec_of(MODELS[args.model]).qk_heads is None:
        raise CliError(f"--qk-clip: --model {args.model} does not report its attention logits (no qk_heads); "
                       "use it with gpt or llama")


def _check_dropout(args) -> None:
    """--dropout is a probability, for the models whose configs have one."""
    if not args.dropout:
        return
    if args.dropout >= 1:
        raise CliError(f"--dropout {args.dropout}: a dropout probability lies in [0, 1); 0.1 is usual")
    config = next(iter(MODELS[args.model].CONFIGS.values()))
    if not hasattr(config, "dropout"):
        raise CliError(f"--dropout: --model {args.model} has no dropout; use it with gpt or llama")


def _check_data_options(args) -> int | None:
    """The vocab of --data (None without it), after checking the data options together."""
    if args.eval_every and not args.data:
        raise CliError("--eval-every needs --data DIR (held-out text); the synthetic source has no split")
    if not args.data:
        return None
    try:
        return int(token_data.read_meta(args.data)["vocab_size"])
    except (OSError, ValueError) as e:
        raise CliError(f"--data: {e}") from None


def summary(records: list[dict], wall_s: float, files: list, resumed_at: int = 0, ended: str = "done") -> str:
    """The closing lines; a resumed run's figures are of the steps it ran, its loss line of the whole run.
    ``ended``: "done", or "stopped" (--timeout)."""
    ran = [r for r in records if r["step"] > resumed_at] or records
    first, last = records[0], records[-1]
    records = ran
    median = {k: statistics.median(r[k] for r in records) for k in ("step_s", "tokens_per_s")}
    compute, comm, opt = (statistics.median(x) for x in zip(*map(breakdown, records)))
    tail = records[-min(10, len(records)):]
    return "\n".join([
        f"{ended}: {len(records)} steps in {wall_s:.1f} s" + (f" (steps {resumed_at + 1}-{last['step']}, resumed)"
                                                            if resumed_at else ""),
        f"  loss        {_loss(first['loss'])} (step {first['step']}) -> {_loss(last['loss'])} (step {last['step']}), "
        f"mean of last {len(tail)}: {_loss(_mean(r['loss'] for r in tail))}",
        *_skipped_summary(records),
        *_eval_summary(records),
        f"  step time   {median['step_s'] * 1e3:.1f} ms median: compute {compute * 1e3:.1f}, "
        f"exposed comm {comm * 1e3:.1f}, optimizer {opt * 1e3:.1f} ms",
        f"  throughput  {median['tokens_per_s']:,.0f} tokens/s median; waiting on communication "
        f"{comm_share(records):.0%} of the median step (exposed comm over step time)",
        *_compile_summary(records),
        *_qk_clip_summary(records),
        *_usage_summary(records),
        "  files       " + "\n              ".join(str(f) for f in files),
    ])


def _loss(value: float | None) -> str:
    """A loss as the summary prints it; metrics.jsonl keeps a non-finite one (a skipped step's) as null."""
    return "non-finite" if value is None else f"{value:.4f}"


def _mean(values) -> float | None:
    """The mean of the finite ``values`` (None where none is)."""
    finite = [v for v in values if v is not None]
    return statistics.fmean(finite) if finite else None


def _skipped_summary(records: list[dict]) -> list[str]:
    skipped = [r["step"] for r in records if r.get("skipped")]  # (older runs lack it)
    if not skipped:
        return []
    shown = ", ".join(map(str, skipped[:10])) + (", ..." if len(skipped) > 10 else "")
    return [f"  skipped     {len(skipped)} of {len(records)} steps (non-finite grads, no update): step"
            + ("s " if len(skipped) > 1 else " ") + shown]


def _usage_summary(records: list[dict]) -> list[str]:
    if "peak_memory_bytes" not in records[-1]:  # (older runs lack it)
        return []
    mfu = [r["mfu"] for r in records if r.get("mfu") is not None]
    return [f"  memory      peak {size(max(r.get('peak_memory_bytes', 0) for r in records))} (rank 0)"
            + (f"; MFU {statistics.median(mfu):.1%} median" if mfu else "")]


def _qk_clip_summary(records: list[dict]) -> list[str]:
    clipped = [r["qk_heads_clipped"] for r in records if "qk_heads_clipped" in r]  # --qk-clip runs only
    if not clipped:
        return []
    return [f"  qk-clip     fired in {sum(n > 0 for n in clipped)} of {len(clipped)} steps (up to {max(clipped)} "
            f"heads a step); max attention logit {max(r['qk_max_logit'] for r in records):.3g}"]


def _compile_summary(records: list[dict]) -> list[str]:
    compiled = [(r["step"], r["compile_s"]) for r in records if r.get("compile_s")]  # (older runs lack it)
    if not compiled:
        return []
    return [f"  compile     {sum(s for _, s in compiled):.1f} s, in step" + ("s " if len(compiled) > 1 else " ")
            + ", ".join(str(i) for i, _ in compiled)]


def _eval_summary(records: list[dict]) -> list[str]:
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if not evals:
        return []
    return [f"  eval loss   {evals[0][1]:.4f} (step {evals[0][0]}) -> {evals[-1][1]:.4f} (step {evals[-1][0]}), "
            f"held-out, {len(evals)} evaluations"]


def add_parser(sub, help_: str):
    defaults = "; ".join(f"{c} {a:g}/{m:g}, {w} warmup" for c, (a, m, w) in TRAIN_DEFAULTS.items())
    lr_help = (f"peak learning rate (default per config, adamw/muon lr and warmup steps: {defaults}; picked so the "
               "first 10 steps fall steadily. Muon's AdamW part keeps the adamw default)")
    train = sub.add_parser(
        "train", parents=[job_parser("train", resumable=True, own={"lr": {"help": lr_help}})], help=help_,
        description="Train a pure-function model (hpf.models) on local processes (hpf.launch), on synthetic "
                    "data from a fixed random Markov source or on a token folder (--data). Rank 0 shows progress "
                    "and writes <out>/metrics.jsonl, one JSON object per step, and <out>/run.json, every option "
                    "and how the run ended: --out DIR --resume goes on from the newest checkpoint with no other "
                    "flag. Under torchrun (torchrun --nproc-per-node 8 -m hpf train ...) each process is one rank.")
    train.add_argument("--resume", nargs="?", const="latest", metavar="PATH",
                       help="go on from a checkpoint (default: the newest complete one in <out>/checkpoints), on "
                            "any mesh; losses match the uninterrupted run")
    add_search_options(train, train=True)
    _add_output_options(train)
    # Options a resumed run takes from its run.json: None until run_folder.resolve fills them
    # (hpf.jobspec's defaults where the run has none).
    train.set_defaults(run=cmd_train, fresh={"mesh": None, **jobspec.defaults("train")})
    return train


def _add_output_options(train) -> None:
    """The run folder and what goes into it; --timeout."""
    train.add_argument("--out", type=Path, metavar="DIR", help="run folder (default: runs/<timestamp>)")
    train.add_argument("--plot", action="store_true",
                       help="save loss.png and step_breakdown.png into the run folder (needs matplotlib; "
                            "without it one line says so and training goes on)")
    train.add_argument("--trace", nargs="?", const="", metavar="DIR",
                       help="write Chrome/Perfetto traces of steps 3-5 (torch's ops and hpf's ranges: gathers, "
                            "each unit's forward and backward, reductions, optimizer, waits) into DIR "
                            "(default: <out>/trace): rank<r>.json per rank and trace.json, all ranks merged")
    train.add_argument("--tensorboard", nargs="?", const="", metavar="DIR",
                       help="also write metrics.jsonl's scalars as TensorBoard events into DIR (default: "
                            "<out>/tensorboard); needs the tensorboard package (the tensorboard extra)")
    train.add_argument("--timeout", type=positive(float), metavar="S",
                       help="stop cleanly once this many seconds have passed: after the step in flight, save a "
                            "checkpoint, exit 0 with status stopped (--resume goes on). A run still going at "
                            "2 S + 60 s (a hung step) is ended (default: no limit; a collective that waits on a "
                            "peer for hpf.launch's collective timeout raises on its own)")
