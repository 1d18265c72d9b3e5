"""``hpf train``: the main job, on local processes (hpf.launch) or as one torchrun rank.

Every argument is checked in the driver process before any rank starts, so a mistake costs
one line on stderr, not a traceback from four processes."""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import hpf
from hpf.api import STEPS
from hpf.checks import finite_or_none
from hpf.cli.common import CliError, mesh_of, mesh_text, positive, sharding_of, topology_of
from hpf.cli.plan import plan_of, report_of
from hpf.device import default_device
from hpf.launcher import init_distributed, is_launched, launch, rank, shutdown, world_size
from hpf import checkpoint
from hpf import data as token_data
from hpf.models import gpt, model_config
from hpf.optim.schedules import NAMES as SCHEDULES, Schedule
from hpf.plots import breakdown, save_plots
from hpf.progress import Progress
from hpf.report import PlanReport

# Per config: AdamW lr (also Muon's AdamW fallback), Muon lr, linear warmup steps. Picked so the
# first 10 steps at the default batch fall steadily (small at a flat 0.01 started above ln V and
# oscillated); tiny and small were measured, medium and 1b are GPT-2/3 practice.
TRAIN_DEFAULTS = {"tiny": (1e-2, 0.02, 0), "small": (3e-3, 0.02, 20), "medium": (6e-4, 0.02, 100),
                  "1b": (3e-4, 0.02, 200)}
STEP_METRICS = ("loss", "grad_norm", "step_s", "comm_wait_s", "optimizer_s")  # from shard_step's metrics
EVAL_BATCHES = 4  # held-out batches (of --batch-size sequences) per evaluation, the same ones each time


@dataclass(frozen=True)
class TrainJob:
    """Everything a rank needs; plain data, so it travels to forked ranks unchanged."""

    config: str
    axes: dict
    fsdp_axes: tuple | None
    optimizer: str
    lr: float
    steps: int
    batch_size: int
    mode: str
    seed: int
    mixed_precision: str | None
    topology: str
    hsdp: bool
    metrics_path: str
    warmup: int = 0
    model: str = "gpt"
    schedule: str = "constant"
    data: str | None = None  # a folder `hpf prepare` wrote; None: the synthetic Markov source
    vocab_size: int | None = None  # the data's (meta.json)
    eval_every: int = 0
    save_every: int = 0
    keep_last: int = 3
    resume: str | None = None  # a checkpoint folder, resolved by the driver
    accumulate: int = 1  # micro-batches per step (gradient accumulation)
    trace_dir: str | None = None  # --trace: Chrome traces of a few steps, one per rank and a merged one
    ep_axis: str | None = None  # --ep-axis: the mesh axis experts are split over (moe)

    def model_config(self):
        return model_config(self.model, self.config, self.vocab_size)

    def eval_due(self, i: int) -> bool:
        """--eval-every N: after every N-th step and after the last one."""
        return bool(self.eval_every) and (i % self.eval_every == 0 or i == self.steps)

    def save_due(self, i: int) -> bool:
        return bool(self.save_every) and i % self.save_every == 0

    @property
    def checkpoints(self) -> Path:
        return Path(self.metrics_path).parent / "checkpoints"


def _make_optimizer(job: TrainJob):
    """--optimizer at --lr along --schedule after --warmup (hpf.optim.schedules). AdamW decays
    matrices only (hpf.optim.default_weight_decay_mask: not norms, biases or embeddings)."""
    def lr(peak: float) -> Schedule:
        return Schedule(job.schedule, peak, total_steps=job.steps, warmup=job.warmup)
    if job.optimizer == "muon":  # AdamW at the config's AdamW lr for embeddings, head and vectors
        return hpf.optim.muon(lr=lr(job.lr), adamw_lr=lr(_defaults(job.config)[0]))
    return hpf.optim.adamw(lr=lr(job.lr), weight_decay_mask=hpf.optim.default_weight_decay_mask)


def _make_step(job: TrainJob, mesh: hpf.Mesh):
    module, config = job.model_config()
    # a model with a training-loop Balancer (moe) returns its aux counts and takes --ep-axis
    loss_fn = module.loss_for(config, job.ep_axis, aux=True) if hasattr(module, "Balancer") else module.loss_for(config)
    return hpf.shard_step(loss_fn, mesh=mesh, optimizer=_make_optimizer(job), accumulate=job.accumulate,
                          **sharding_of(job.model, config, mesh, job.fsdp_axes, job.ep_axis), mode=job.mode,
                          mixed_precision=job.mixed_precision, hsdp=job.hsdp, topology=topology_of(job.topology))


def _defaults(config: str) -> tuple[float, float, int]:
    """TRAIN_DEFAULTS of a config name; a name it lacks (a model's own config) gets tiny's."""
    return TRAIN_DEFAULTS.get(config, TRAIN_DEFAULTS["tiny"])


def _batches(job: TrainJob, config, split: str, rank: int, world: int, start: int):
    """This rank's rows of the global batches from step ``start`` (0-based) on: a pure function
    of (seed, position), so a resumed run reads exactly what an uninterrupted one would."""
    where = dict(rank=rank, world_size=world, device=default_device())
    if job.data:
        return token_data.TokenData(job.data, split).batches(job.batch_size, config.seq_len, job.seed,
                                                            state={"seed": job.seed, "step": start}, **where)
    return gpt.synthetic_batches(config, job.batch_size, job.seed, start=start, **where)


def _train_rank(rank: int, job: TrainJob) -> None:
    """One rank of ``hpf train``; rank 0 also shows progress and writes the metrics."""
    module, config = job.model_config()
    mesh = hpf.Mesh(job.axes)
    progress = Progress(job.steps, label="train") if rank == 0 else None
    if progress:  # a big config's first step can take minutes: say it has begun, and that it runs
        progress.start(f"step 1 of {job.steps}: init, first gathers and warm-up")
    step = _make_step(job, mesh)
    # loop state that rides in each batch and moves by the step's metrics (moe: the expert bias)
    balancer = module.Balancer(config, default_device()) if hasattr(module, "Balancer") else None
    done = 0
    if job.resume:  # meta params: shapes only; the checkpoint fills the shards
        step.init(module.init(config, device="meta"))
        state, extra = step.restore(job.resume)
        if not (isinstance(extra, dict) and {"step", "rng"} <= extra.keys()):
            raise ValueError(f"--resume {job.resume}: this checkpoint was not written by hpf train (its extra is "
                             f"{type(extra).__name__}, not a dict with 'step' and 'rng'); load its params with "
                             "hpf.checkpoint.load_params instead")
        done = int(extra["step"])
        checkpoint.set_rng_state(extra["rng"])
        if balancer is not None:
            balancer.bias = extra["expert_bias"].to(balancer.bias.device)
    else:
        state = step.init(module.init(config, torch.Generator().manual_seed(job.seed)))
    tokens = _batches(job, config, "train", rank, mesh.size, start=done)
    batches = tokens if balancer is None else map(balancer.batch, tokens)
    evaluate = None
    if job.eval_every:  # the same held-out batches at every evaluation
        held_out = _batches(job, config, "val", rank, mesh.size, start=0)
        evaluate = token_data.HeldOut(module.loss_for(config), [next(held_out) for _ in range(EVAL_BATCHES)])
    tokens_per_step = job.batch_size * config.seq_len
    kept = []  # a resumed run keeps the metrics of the steps it does not redo
    if rank == 0 and job.resume and os.path.exists(job.metrics_path):
        kept = [r for r in read_metrics(job.metrics_path) if r["step"] <= done]
    try:
        with (open(job.metrics_path, "w") if rank == 0 else contextlib.nullcontext()) as out, \
                _traced(job, rank, mesh.size) as advance:
            for r in kept:
                out.write(json.dumps(r) + "\n")
            for i in range(done + 1, job.steps + 1):
                state, m = step(state, next(batches))
                advance()
                record = {"step": i, **{k: m[k] for k in STEP_METRICS}, "tokens_per_s": tokens_per_step / m["step_s"]}
                if evaluate and job.eval_due(i):
                    record["eval_loss"] = evaluate(step, state)
                if balancer is not None:
                    record["expert_imbalance"] = balancer.update(m)
                if job.save_due(i):  # async: the write overlaps the next steps
                    extra = {"step": i, "rng": checkpoint.rng_state()}
                    if balancer is not None:
                        extra["expert_bias"] = balancer.bias.cpu()
                    step.save(state, job.checkpoints / f"step_{i:06d}", extra=extra, keep_last=job.keep_last,
                              async_save=True)
                if out is None:
                    continue
                out.write(json.dumps(finite_or_none(record), allow_nan=False) + "\n")  # NaN -> null: valid JSON
                out.flush()  # a crashed or interrupted run keeps its metrics so far
                shown = {"loss": f"{m['loss']:.4f}"}
                if "eval_loss" in record:
                    shown["eval"] = f"{record['eval_loss']:.4f}"
                shown.update({"tokens/s": f"{record['tokens_per_s'] / 1e3:.1f}k",
                              "comm wait": f"{m['comm_wait_s'] / m['step_s']:.0%}"})
                if "expert_imbalance" in record:
                    shown["experts max/mean"] = f"{record['expert_imbalance']:.2f}"
                progress.update(i, shown)
        step.wait_save()
    finally:
        if progress:
            progress.close()


@contextlib.contextmanager
def _traced(job: TrainJob, rank: int, world: int):
    """--trace: yields advance() for after each step. Skips 2 warm-up steps (as many as the run
    allows), traces up to 3 into <dir>/rank<r>.json; rank 0 then merges them into trace.json."""
    if job.trace_dir is None:
        yield lambda: None
        return
    from hpf import trace
    folder = Path(job.trace_dir)
    folder.mkdir(parents=True, exist_ok=True)
    skip = min(2, job.steps - 1)
    with trace.tracing(folder / f"rank{rank}.json", skip_steps=skip, steps=min(3, job.steps - skip)) as advance:
        yield advance
    if world > 1:  # every rank's file is written before rank 0 reads them
        torch.distributed.barrier()
    if rank == 0:
        trace.merge_traces([folder / f"rank{r}.json" for r in range(world)], folder / "trace.json")


def _banner(job: TrainJob, n_units: int) -> str:
    """The first line of a run, the same under hpf.launch and torchrun."""
    module, config = job.model_config()
    warmup = f", {job.warmup} warmup steps" if job.warmup else ""
    return (f"hpf train: {job.model} {job.config!r} ({module.num_params(config) / 1e6:.2f}M params, {n_units} FSDP units) "
            f"on {math.prod(job.axes.values())} ranks, mesh {mesh_text(job.axes)}, "
            f"{job.topology}{' HSDP' if job.hsdp else ''}, {job.optimizer} lr {job.lr:g} ({job.schedule}{warmup}), "
            f"{job.mixed_precision or 'fp32'} compute, {job.mode} mode")


def _host_memory_available() -> int:
    """Bytes the host can still give: MemAvailable (Linux), else its free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _activation_bytes(config, tokens: int, compute_bytes: int) -> int:
    """Saved activations of gpt.loss for ``tokens`` tokens: about L*(13d + 2f) values per token
    in the compute dtype plus 3V fp32 (logits, softmax, their grad), fitted on small configs."""
    per_token = config.n_layers * (13 * config.d_model + 2 * config.d_ff) * compute_bytes + 3 * config.vocab_size * 4
    return tokens * per_token


def _check_memory(job: TrainJob, report: PlanReport, local_ranks: int) -> None:
    """Refuse, before anything is allocated, a run whose ranks on this machine would not fit.

    On the CPU the local ranks share the host's memory. Under torchrun with an accelerator each
    rank checks its own device (the driver of hpf.launch must not touch the device before the
    fork, so there only the host is checked)."""
    module, config = job.model_config()
    parts = {"params": report.params_bytes, "grads": report.grad_bytes, "optimizer": report.optimizer_bytes,
             "gathered": report.peak_gathered_bytes,
             "activations ~": _activation_bytes(config, job.batch_size // report.world_size // job.accumulate * config.seq_len,
                                                2 if job.mixed_precision else 4)}
    init_copy = module.num_params(config) * 4  # each rank builds the full params on the host, then shards them
    if is_launched() and torch.accelerator.is_available():
        available, _ = torch.accelerator.get_memory_info(int(os.environ.get("LOCAL_RANK", 0)))
        where, ranks = f"{torch.accelerator.current_accelerator().type} memory free", 1
    else:
        parts["full init copy"] = init_copy
        available, where, ranks = _host_memory_available(), "host memory available", local_ranks
    per_rank = sum(parts.values())
    if per_rank * ranks <= available:
        return
    gib = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
    raise CliError(
        f"--config {job.config} needs about {gib(per_rank)} GiB per rank ("
        + ", ".join(f"{k} {gib(v)}" for k, v in parts.items()) + f") x {ranks} rank(s) here = "
        f"{gib(per_rank * ranks)} GiB, but {where} is {gib(available)} GiB; hpf plan --config {job.config} "
        "is the tool for sizing it on a bigger mesh (or lower --batch-size or the ranks)")


def _prepare_out(out: Path, resume: bool) -> None:
    """Create the run folder, or say in one line why it cannot be."""
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} is a file, not a folder; pick a folder for the run")
    if (out / "metrics.jsonl").exists() and not resume:
        raise CliError(f"--out {out} already holds a run (metrics.jsonl); pick another folder, or pass --resume "
                       "to go on from its newest checkpoint")
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write-test").touch()
        (out / ".write-test").unlink()
    except OSError as e:
        raise CliError(f"--out {out} cannot be written ({e.strerror}); pick a folder you can write to") from None


def cmd_train(args) -> int:
    """Fork the ranks here with hpf.launch, or, under torchrun, be one of them."""
    torchrun = is_launched()
    mesh = mesh_of(args)
    vocab_size = _check_data_options(args)
    _, config = model_config(args.model, args.config, vocab_size)
    if torchrun and mesh.size != world_size():
        raise CliError(f"--mesh has {mesh.size} ranks but torchrun started {world_size()}; make them agree")
    if args.batch_size % (mesh.size * args.accumulate):
        per = f"{mesh.size} ranks" + (f" x {args.accumulate} micro-batches" if args.accumulate > 1 else "")
        raise CliError(f"--batch-size {args.batch_size} is the global batch and must split evenly over {per}; "
                       f"use a multiple of {mesh.size * args.accumulate}")
    plots = None
    if args.plot:
        try:
            import matplotlib  # noqa: F401 -- only checked here; hpf.plots imports what it draws with
            plots = "loss.png, step_breakdown.png"
        except ImportError:
            plots = "skipped: matplotlib is not installed"
            if rank() == 0:
                print("hpf: warning: --plot skipped: matplotlib is not installed (pip install matplotlib, or "
                      "pip install -e '.[plot]'); training goes on", file=sys.stderr, flush=True)
    out = args.out or Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    lead = rank() == 0  # rank 0 under torchrun; the driver otherwise
    adamw_lr, muon_lr, warmup = _defaults(args.config)
    warmup = warmup if args.warmup is None else args.warmup
    if args.schedule != "constant" and warmup >= args.steps:
        raise CliError(f"--warmup {warmup} must be below --steps {args.steps} for the {args.schedule} schedule")
    same = ("config", "fsdp_axes", "optimizer", "steps", "batch_size", "mode", "seed", "mixed_precision",
            "topology", "hsdp", "model", "schedule", "keep_last", "accumulate", "ep_axis")
    job = TrainJob(**{k: getattr(args, k) for k in same}, axes=dict(zip(mesh.axis_names, mesh.shape)),
                   lr=args.lr or (muon_lr if args.optimizer == "muon" else adamw_lr), warmup=warmup,
                   metrics_path=str(out / "metrics.jsonl"), data=str(args.data) if args.data else None,
                   vocab_size=vocab_size, eval_every=args.eval_every or 0, save_every=args.save_every or 0,
                   resume=_resume_path(args, out),
                   trace_dir=None if args.trace is None else str(args.trace if args.trace != "" else out / "trace"))
    _make_step(job, mesh)  # checks optimizer, mode and precision here, before any rank starts
    plan = plan_of(args, mesh)  # checks the axes
    _check_memory(job, report_of(args, plan)[0],
                  int(os.environ.get("LOCAL_WORLD_SIZE", mesh.size)) if torchrun else mesh.size)
    if lead:
        _prepare_out(out, resume=job.resume is not None)
        (out / "run.json").write_text(json.dumps(
            {**asdict(job), "plots": plots, "hpf": hpf.__version__, "torch": torch.__version__,
             "started": datetime.datetime.now().isoformat(timespec="seconds")}, indent=1) + "\n")
        print(_banner(job, len(plan.units)))
        source = (f"{args.data} (vocab {vocab_size}{f', held-out loss every {args.eval_every} steps' if args.eval_every else ''})"
                  if args.data else "a fixed random Markov source")
        micro = f" in {args.accumulate} micro-batches" if args.accumulate > 1 else ""
        print(f"data: {args.batch_size} x {config.seq_len} tokens per step{micro} from {source}; run folder {out}"
              + (f"; resuming from {job.resume}" if job.resume else ""), flush=True)
    started = time.perf_counter()
    if torchrun:
        init_distributed(timeout=args.timeout)
        _train_rank(rank(), job)
        shutdown()
    else:
        launch(_train_rank, mesh.size, job, timeout=args.timeout)
    if not lead:
        return 0
    wall = time.perf_counter() - started
    records = read_metrics(out / "metrics.jsonl")
    files = [out / "metrics.jsonl", out / "run.json"]
    if job.trace_dir:  # open in https://ui.perfetto.dev or chrome://tracing
        files.append(Path(job.trace_dir) / "trace.json")
    if plots and not plots.startswith("skipped"):
        files += save_plots(records, out, f"loss: {args.model} {args.config!r}, mesh {mesh_text(job.axes)}, "
                                          f"{args.optimizer}{', ' + args.mixed_precision if args.mixed_precision else ''}")
    print(summary(records, wall, files))
    return 0


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


def _resume_path(args, out: Path) -> str | None:
    """The checkpoint --resume names: a path, or the newest complete one under <out>/checkpoints."""
    if args.resume is None:
        return None
    if args.resume != "latest":
        if not Path(args.resume).is_dir():
            raise CliError(f"--resume {args.resume}: no such checkpoint folder")
        return args.resume
    if args.out is None:
        raise CliError("--resume with no PATH resumes the run in --out DIR; pass --out or a checkpoint PATH")
    found = checkpoint.latest(out / "checkpoints")
    if found is None:
        raise CliError(f"--resume: no complete checkpoint in {out / 'checkpoints'}; start without --resume")
    return str(found)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summary(records: list[dict], wall_s: float, files: list[Path]) -> str:
    median = {k: statistics.median(r[k] for r in records) for k in ("step_s", "tokens_per_s")}
    compute, comm, opt = (statistics.median(x) for x in zip(*map(breakdown, records)))
    total_step = sum(r["step_s"] for r in records)
    tail = records[-min(10, len(records)):]
    return "\n".join([
        f"done: {len(records)} steps in {wall_s:.1f} s",
        f"  loss        {records[0]['loss']:.4f} (step 1) -> {records[-1]['loss']:.4f} (step {len(records)}), "
        f"mean of last {len(tail)}: {statistics.fmean(r['loss'] for r in tail):.4f}",
        *_eval_summary(records),
        f"  step time   {median['step_s'] * 1e3:.1f} ms median: compute {compute * 1e3:.1f}, "
        f"exposed comm {comm * 1e3:.1f}, optimizer {opt * 1e3:.1f} ms",
        f"  throughput  {median['tokens_per_s']:,.0f} tokens/s median; waiting on communication "
        f"{sum(r['comm_wait_s'] for r in records) / total_step:.0%} of step time",
        "  files       " + "\n              ".join(str(f) for f in files),
    ])


def _eval_summary(records: list[dict]) -> list[str]:
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if not evals:
        return []
    return [f"  eval loss   {evals[0][1]:.4f} (step {evals[0][0]}) -> {evals[-1][1]:.4f} (step {evals[-1][0]}), "
            f"held-out, {len(evals)} evaluations"]


def add_parser(sub, job, optimizer) -> None:
    train = sub.add_parser(
        "train", parents=[job, optimizer], help="train the GPT on local processes (the main job)",
        description="Train the pure-function GPT on local processes (hpf.launch) with synthetic data "
                    "from a fixed random Markov source. Rank 0 shows progress and writes "
                    "<out>/metrics.jsonl, one JSON object per step. Under torchrun "
                    "(torchrun --nproc-per-node 8 -m hpf train ...) each process is one rank.")
    train.add_argument("--steps", type=positive(int), default=100, help="(default: 100)")
    train.add_argument("--batch-size", type=positive(int), default=32, metavar="B",
                       help="global batch in sequences, split over the ranks (default: 32)")
    defaults = "; ".join(f"{c} {a:g}/{m:g}, {w} warmup" for c, (a, m, w) in TRAIN_DEFAULTS.items())
    train.add_argument("--lr", type=positive(float),
                       help=f"peak learning rate (default per config, adamw/muon lr and warmup steps: {defaults}; "
                            "picked so the first 10 steps fall steadily. Muon's AdamW part keeps the adamw default)")
    train.add_argument("--warmup", type=positive(int, least=0), metavar="STEPS",
                       help="steps of linear lr warmup from 0 (default: per config, see --lr)")
    train.add_argument("--schedule", choices=SCHEDULES, default="constant",
                       help="learning rate over the run, after --warmup: cosine or linear decay to 0 at --steps, "
                            "or constant (default: constant)")
    train.add_argument("--data", type=Path, metavar="DIR",
                       help="train on a token folder from `hpf prepare` (its vocab sets the model's) instead of "
                            "the synthetic Markov source")
    train.add_argument("--eval-every", type=positive(int), metavar="N",
                       help="with --data: held-out loss every N steps and at the end (eval_loss in the progress "
                            "line, metrics.jsonl and the loss plot)")
    train.add_argument("--save-every", type=positive(int), metavar="N",
                       help="save a checkpoint every N steps into <out>/checkpoints (DCP format, async: the write "
                            "overlaps the next steps)")
    train.add_argument("--keep-last", type=positive(int), default=3, metavar="K",
                       help="keep the newest K checkpoints (default: 3)")
    train.add_argument("--resume", nargs="?", const="latest", metavar="PATH",
                       help="go on from a checkpoint (default: the newest complete one in <out>/checkpoints), on "
                            "any mesh; losses match the uninterrupted run")
    train.add_argument("--accumulate", type=positive(int), default=1, metavar="K",
                       help="gradient accumulation: each rank runs its share of --batch-size as K micro-batches "
                            "(activations of one micro-batch), reducing grads once per step (default: 1)")
    train.add_argument("--mode", choices=tuple(STEPS), default="production",
                       help="validate runs the same plan with layout checks on every op (default: production)")
    train.add_argument("--seed", type=positive(int, least=0), default=0,
                       help="seeds the init and the data (default: 0)")
    train.add_argument("--out", type=Path, metavar="DIR", help="run folder (default: runs/<timestamp>)")
    train.add_argument("--plot", action="store_true",
                       help="save loss.png and step_breakdown.png into the run folder (needs matplotlib; "
                            "without it one line says so and training goes on)")
    train.add_argument("--trace", nargs="?", const="", metavar="DIR",
                       help="write Chrome/Perfetto traces of steps 3-5 (torch's ops and hpf's ranges: gathers, "
                            "each unit's forward and backward, reductions, optimizer, waits) into DIR "
                            "(default: <out>/trace): rank<r>.json per rank and trace.json, all ranks merged")
    train.add_argument("--timeout", type=positive(float), default=3600.0, metavar="S",
                       help="end the run after this many seconds; also bounds each collective (default: 3600)")
    train.set_defaults(run=cmd_train)
