"""``hpf train``: the main job, on local processes (hpf.launch) or as one torchrun rank.

Every argument is checked in the driver process before any rank starts, so a mistake costs
one line on stderr, not a traceback from four processes."""
from __future__ import annotations

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
from hpf.launcher import init_distributed, is_launched, launch, rank, world_size
from hpf.models import gpt, model_config
from hpf.optim.schedules import constant
from hpf.plots import breakdown, save_plots
from hpf.progress import Progress
from hpf.report import PlanReport

# Per config: AdamW lr (also Muon's AdamW fallback), Muon lr, linear warmup steps. Picked so the
# first 10 steps at the default batch fall steadily (small at a flat 0.01 started above ln V and
# oscillated); tiny and small were measured, medium and 1b are GPT-2/3 practice.
TRAIN_DEFAULTS = {"tiny": (1e-2, 0.02, 0), "small": (3e-3, 0.02, 20), "medium": (6e-4, 0.02, 100),
                  "1b": (3e-4, 0.02, 200)}
STEP_METRICS = ("loss", "grad_norm", "step_s", "comm_wait_s", "optimizer_s")  # from shard_step's metrics


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
    ep_axis: str | None = None


def _make_optimizer(name: str, lr: float, adamw_lr: float, warmup: int):
    """--optimizer at --lr, ramped linearly over ``warmup`` steps, then held (hpf.optim.schedules)."""
    if name == "muon":  # AdamW at the config's AdamW lr for embeddings, head and vectors
        return hpf.optim.muon(lr=constant(lr, warmup), adamw_lr=constant(adamw_lr, warmup))
    return hpf.optim.adamw(lr=constant(lr, warmup))


def _make_step(job: TrainJob, mesh: hpf.Mesh):
    module, config = model_config(job.model, job.config)
    # a model with a training-loop Balancer (moe) returns its aux counts and takes --ep-axis
    loss_fn = module.loss_for(config, job.ep_axis, aux=True) if hasattr(module, "Balancer") else module.loss_for(config)
    return hpf.shard_step(loss_fn, mesh=mesh,
                          optimizer=_make_optimizer(job.optimizer, job.lr, _defaults(job.config)[0], job.warmup),
                          **sharding_of(job.model, config, mesh, job.fsdp_axes, job.ep_axis), mode=job.mode,
                          mixed_precision=job.mixed_precision, hsdp=job.hsdp, topology=topology_of(job.topology))


def _defaults(config: str) -> tuple[float, float, int]:
    """TRAIN_DEFAULTS of a config name; a name it lacks (a model's own config) gets tiny's."""
    return TRAIN_DEFAULTS.get(config, TRAIN_DEFAULTS["tiny"])


def _train_rank(rank: int, job: TrainJob) -> None:
    """One rank of ``hpf train``; rank 0 also shows progress and writes the metrics."""
    module, config = model_config(job.model, job.config)
    mesh = hpf.Mesh(job.axes)
    progress = Progress(job.steps, label="train") if rank == 0 else None
    if progress:  # a big config's first step can take minutes: say it has begun, and that it runs
        progress.start(f"step 1 of {job.steps}: init, first gathers and warm-up")
    step = _make_step(job, mesh)
    state = step.init(module.init(config, torch.Generator().manual_seed(job.seed)))
    tokens = gpt.synthetic_batches(config, job.batch_size, job.seed, rank=rank, world_size=mesh.size,
                                   device=default_device())
    # loop state that rides in each batch and moves by the step's metrics (moe: the expert bias)
    balancer = module.Balancer(config, default_device()) if hasattr(module, "Balancer") else None
    batches = tokens if balancer is None else map(balancer.batch, tokens)
    tokens_per_step = job.batch_size * config.seq_len
    if rank != 0:
        for _ in range(job.steps):
            state, m = step(state, next(batches))
            if balancer is not None:
                balancer.update(m)
        return
    try:
        with open(job.metrics_path, "w") as out:
            for i in range(1, job.steps + 1):
                state, m = step(state, next(batches))
                record = {"step": i, **{k: m[k] for k in STEP_METRICS}, "tokens_per_s": tokens_per_step / m["step_s"]}
                extra = {}
                if balancer is not None:
                    record["expert_imbalance"] = balancer.update(m)
                    extra = {"experts max/mean": f"{record['expert_imbalance']:.2f}"}
                out.write(json.dumps(finite_or_none(record), allow_nan=False) + "\n")  # NaN -> null: valid JSON
                out.flush()  # a crashed or interrupted run keeps its metrics so far
                progress.update(i, {"loss": f"{m['loss']:.4f}", "tokens/s": f"{record['tokens_per_s'] / 1e3:.1f}k",
                                    "comm wait": f"{m['comm_wait_s'] / m['step_s']:.0%}", **extra})
    finally:
        progress.close()


def _banner(job: TrainJob, n_units: int) -> str:
    """The first line of a run, the same under hpf.launch and torchrun."""
    module, config = model_config(job.model, job.config)
    warmup = f" after {job.warmup} warmup steps" if job.warmup else ""
    return (f"hpf train: {job.model} {job.config!r} ({module.num_params(config) / 1e6:.2f}M params, {n_units} FSDP units) "
            f"on {math.prod(job.axes.values())} ranks, mesh {mesh_text(job.axes)}, "
            f"{job.topology}{' HSDP' if job.hsdp else ''}, {job.optimizer} lr {job.lr:g}{warmup}, "
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
    module, config = model_config(job.model, job.config)
    parts = {"params": report.params_bytes, "grads": report.grad_bytes, "optimizer": report.optimizer_bytes,
             "gathered": report.peak_gathered_bytes,
             "activations ~": _activation_bytes(config, job.batch_size // report.world_size * config.seq_len,
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


def _prepare_out(out: Path) -> None:
    """Create the run folder, or say in one line why it cannot be."""
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} is a file, not a folder; pick a folder for the run")
    if (out / "metrics.jsonl").exists():
        raise CliError(f"--out {out} already holds a run (metrics.jsonl); pick another folder")
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
    _, config = model_config(args.model, args.config)
    if torchrun and mesh.size != world_size():
        raise CliError(f"--mesh has {mesh.size} ranks but torchrun started {world_size()}; make them agree")
    if args.batch_size % mesh.size:
        raise CliError(f"--batch-size {args.batch_size} is the global batch and must split evenly over "
                       f"{mesh.size} ranks; use a multiple of {mesh.size}")
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
    job = TrainJob(args.config, dict(zip(mesh.axis_names, mesh.shape)), args.fsdp_axes, args.optimizer,
                   args.lr or (muon_lr if args.optimizer == "muon" else adamw_lr), args.steps, args.batch_size,
                   args.mode, args.seed, args.mixed_precision, args.topology, args.hsdp,
                   str(out / "metrics.jsonl"), warmup if args.warmup is None else args.warmup, args.model,
                   args.ep_axis)
    _make_step(job, mesh)  # checks optimizer, mode and precision here, before any rank starts
    plan = plan_of(args, mesh)  # checks the axes
    _check_memory(job, report_of(args, plan)[0],
                  int(os.environ.get("LOCAL_WORLD_SIZE", mesh.size)) if torchrun else mesh.size)
    if lead:
        _prepare_out(out)
        (out / "run.json").write_text(json.dumps(
            {**asdict(job), "plots": plots, "hpf": hpf.__version__, "torch": torch.__version__,
             "started": datetime.datetime.now().isoformat(timespec="seconds")}, indent=1) + "\n")
        print(_banner(job, len(plan.units)))
        print(f"data: {args.batch_size} x {config.seq_len} tokens per step from a fixed random Markov "
              f"source; run folder {out}", flush=True)
    started = time.perf_counter()
    if torchrun:
        init_distributed(timeout=args.timeout)
        _train_rank(rank(), job)
        torch.distributed.destroy_process_group()
    else:
        launch(_train_rank, mesh.size, job, timeout=args.timeout)
    if not lead:
        return 0
    wall = time.perf_counter() - started
    records = read_metrics(out / "metrics.jsonl")
    files = [out / "metrics.jsonl", out / "run.json"]
    if plots and not plots.startswith("skipped"):
        files += save_plots(records, out, f"loss: {args.model} {args.config!r}, mesh {mesh_text(job.axes)}, "
                                          f"{args.optimizer}{', ' + args.mixed_precision if args.mixed_precision else ''}")
    print(summary(records, wall, files))
    return 0


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
        f"  step time   {median['step_s'] * 1e3:.1f} ms median: compute {compute * 1e3:.1f}, "
        f"exposed comm {comm * 1e3:.1f}, optimizer {opt * 1e3:.1f} ms",
        f"  throughput  {median['tokens_per_s']:,.0f} tokens/s median; waiting on communication "
        f"{sum(r['comm_wait_s'] for r in records) / total_step:.0%} of step time",
        "  files       " + "\n              ".join(str(f) for f in files),
    ])


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
    train.add_argument("--mode", choices=tuple(STEPS), default="production",
                       help="validate runs the same plan with layout checks on every op (default: production)")
    train.add_argument("--seed", type=positive(int, least=0), default=0,
                       help="seeds the init and the data (default: 0)")
    train.add_argument("--out", type=Path, metavar="DIR", help="run folder (default: runs/<timestamp>)")
    train.add_argument("--plot", action="store_true",
                       help="save loss.png and step_breakdown.png into the run folder (needs matplotlib; "
                            "without it one line says so and training goes on)")
    train.add_argument("--timeout", type=positive(float), default=3600.0, metavar="S",
                       help="end the run after this many seconds; also bounds each collective (default: 3600)")
    train.set_defaults(run=cmd_train)
