"""One rank of ``hpf train``: the job's plain-data description and the training loop it runs.

The driver (``hpf.cli.train``) checks every option and builds a ``TrainJob``; the ranks
(forked by hpf.launch, or started by torchrun) only run it."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import hpf
from hpf import checkpoint
from hpf import data as token_data
from hpf.misuse import finite_or_none
from hpf.comm import world as comm_world
from hpf.cli.common import CliError, sharding_of, topology_of
from hpf.comm.world import default_device
from hpf.jobspec import JobSpec, inputs
from hpf.models import TP_AXIS, data_axes, gpt, mesh_for, model_config, spec_of
from hpf.optim.muon_math import qk_clip_factors
from hpf.optim.lr_schedules import Schedule
from hpf.plots import comm_share
from hpf.progress import Progress

# Per config: AdamW lr (also Muon's AdamW fallback), Muon lr, linear warmup steps. Picked so the
# first 10 steps at the default batch fall steadily (tiny and small measured; medium and 1b
# follow GPT-2/3 practice).
TRAIN_DEFAULTS = {"tiny": (1e-2, 0.02, 0), "small": (3e-3, 0.02, 20), "medium": (6e-4, 0.02, 100),
                  "1b": (3e-4, 0.02, 200)}
STEP_METRICS = ("loss", "grad_norm", "skipped", "step_s", "comm_wait_s", "optimizer_s", "compile_s")  # from shard_step's metrics
EVAL_BATCHES = 4  # held-out batches (of --batch-size sequences) per evaluation, the same ones each time


@dataclass(frozen=True, kw_only=True)
class TrainJob(JobSpec):
    """Everything a rank needs: the job's options (hpf.jobspec declares each, with its flag) and what
    the driver settled; plain data, so it travels to forked ranks unchanged."""

    axes: dict  # the mesh's axes (--mesh, --world-size: a resumed run inherits the mesh)
    metrics_path: str
    vocab_size: int | None = None  # the data's (meta.json)
    resume: str | None = None  # a checkpoint folder, resolved by the driver
    trace_dir: str | None = None  # --trace: Chrome traces of a few steps, one per rank and a merged one
    tensorboard: str | None = None  # --tensorboard: the event folder rank 0 writes the metrics to
    stop_at: float | None = None  # --timeout: the wall-clock time (time.time()) after which the run stops cleanly

    def model_config(self):
        return model_config(self.model, self.config, self.vocab_size)

    def eval_due(self, i: int) -> bool:
        """--eval-every N: after every N-th step and after the last one."""
        return bool(self.eval_every) and (i % self.eval_every == 0 or i == self.steps)

    def save_due(self, i: int) -> bool:
        """After every --save-every N-th step, and after the last step of a run that checkpoints
        (--save-every, --timeout, or a resumed run): a clean end always saves the step it ended at,
        so --resume and hpf eval see it. (--timeout's own stop saves too: see train_rank.)"""
        if self.save_every and i % self.save_every == 0:
            return True
        return i == self.steps and bool(self.save_every or self.stop_at is not None or self.resume)

    def stop_due(self) -> bool:
        """--timeout: whether its time is up, agreed by every rank (the latest clock decides), so
        all stop after the same step. A collective, each step, only with --timeout."""
        if self.stop_at is None:
            return False
        late = torch.tensor([float(time.time() >= self.stop_at)])
        comm_world.all_reduce(late, op="max")
        return bool(late.item())

    @property
    def checkpoints(self) -> Path:
        return Path(self.metrics_path).parent / "checkpoints"


def defaults(config: str) -> tuple[float, float, int]:
    """TRAIN_DEFAULTS of a config name; a name it lacks (a model's own config) gets tiny's."""
    return TRAIN_DEFAULTS.get(config, TRAIN_DEFAULTS["tiny"])


def make_step(job: TrainJob, mesh: hpf.Mesh):
    """The job's shard_step: --optimizer at --lr along --schedule after --warmup. AdamW decays
    matrices only (hpf.optim.default_weight_decay_mask: not norms, biases or embeddings)."""
    module, config = job.model_config()
    spec = spec_of(module)
    sharding, tp = sharding_of(job.model, config, mesh, job.fsdp_axes, job.ep_axis), TP_AXIS in mesh.axis_names

    def lr(peak: float) -> Schedule:
        return Schedule(job.schedule, peak, total_steps=job.steps, warmup=job.warmup)
    if job.qk_clip and tp:
        raise CliError("--qk-clip with tensor parallelism (a tp axis in --mesh) is not supported: QK-Clip scales "
                       "whole heads of the full weights; drop one of them")
    qk = dict(qk_clip=job.qk_clip, qk_heads=spec.qk_heads(config)) if job.qk_clip else {}
    if job.optimizer == "muon":  # AdamW at the config's AdamW lr for embeddings, head and vectors
        optimizer = hpf.optim.muon(lr=lr(job.lr), adamw_lr=lr(defaults(job.config)[0]), ns_variant=job.ns_variant,
                                   **qk)
    else:
        optimizer = hpf.optim.adamw(lr=lr(job.lr), weight_decay_mask=hpf.optim.default_weight_decay_mask)
    # token-weighted: the step's loss is the global token mean, over micro-batches and ranks;
    # a model with a training-loop Balancer (moe) returns its aux counts and takes --ep-axis
    how = dict(recompute=job.recompute, weighted=True, compile=job.compile, **({"max_logits": True} if qk else {}))
    if job.dropout:  # the training loss alone: held-out loss, eval and generate run without dropout
        config = dataclasses.replace(config, dropout=job.dropout)
    if job.sequence_parallel and (not tp or spec.balancer):
        raise CliError("--sequence-parallel splits gpt's and llama's sequence over the tensor-parallel axis: give "
                       "--mesh a tp axis (e.g. dp=2,tp=2)" + (f"; --model {job.model} runs tp in its attention only"
                                                              if tp else ""))
    if tp:
        how["tp_axis"] = TP_AXIS
        how.update({"sequence_parallel": True} if job.sequence_parallel else {})
    loss_fn = (spec.loss(config, ep_axis=job.ep_axis, aux=True, **how) if spec.balancer else spec.loss(config, **how))
    return hpf.shard_step(loss_fn, mesh=mesh, optimizer=optimizer, batch_axes=spec.batch_axes,
                          topology=topology_of(job), **sharding, **inputs(job, "step"), **invariant_of(job))


def invariant_of(job: TrainJob) -> dict:
    """--invariant's options: the atom size given, else the global batch over 8 (or over its
    largest divisor up to 8), so every world size that divides it runs the same atoms."""
    if not job.invariant:
        if job.atom_size is not None:
            raise CliError(f"--atom-size {job.atom_size} is --invariant's: pass --invariant too")
        return {}
    return {"invariant": True, "atom_size": job.atom_size or job.batch_size // max(
        d for d in range(1, 9) if job.batch_size % d == 0)}


def run_keys(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hpf train's keys from --seed: (the params' init key, the dropout key, folded with each step)."""
    init_key, dropout_key = hpf.random.split(hpf.random.key(seed))
    return init_key, dropout_key


def _with_example_keys(batches, job: TrainJob, rank: int, world: int, start: int):
    """--dropout: each local batch with its examples' keys, ``example_keys(fold_in(dropout key,
    step), first row of this rank, rows)``: the masks of the whole job's examples do not depend
    on the world size."""
    dropout_key = run_keys(job.seed)[1]
    for i, tokens in enumerate(batches, start=start + 1):
        rows = tokens.shape[0]
        keys = hpf.random.example_keys(hpf.random.fold_in(dropout_key, i), rank * rows, rows)
        yield {"tokens": tokens, "keys": keys.to(tokens.device)}


def data_rank(mesh: hpf.Mesh, rank: int) -> tuple[int, int]:
    """(this rank's index among the ranks that split the data, their count): the ranks of one
    tensor-parallel group read the same rows."""
    axes = data_axes(mesh.axis_names)
    return mesh.group_index(axes, rank), mesh.axis_size(axes)


def batches_of(job: TrainJob, config, split: str, rank: int, world: int, start: int):
    """This rank's rows of the global batches from step ``start`` (0-based) on: a pure function
    of (seed, position), so a resumed run reads exactly what an uninterrupted one would."""
    where = dict(rank=rank, world_size=world, device=default_device())
    if job.data:
        return token_data.TokenData(job.data, split).batches(job.batch_size, config.seq_len, job.seed,
                                                            state={"seed": job.seed, "step": start}, **where)
    return gpt.synthetic_batches(config, job.batch_size, job.seed, start=start, **where)


def step_flops(module, config, batch_size: int) -> float:
    """Model FLOPs of one step on the global batch: forward and backward, 3x the forward (the
    model's ``unit_flops``, else 2 x params x tokens); recomputation is not counted, as in MFU."""
    spec = spec_of(module)
    if spec.unit_flops:
        return 3.0 * sum(spec.unit_flops(config, batch_size).values())
    return 3.0 * 2.0 * spec.num_params(config) * batch_size * config.seq_len


def peak_flops() -> tuple[float | None, str]:
    """MFU's peak per rank and where it comes from: an accelerator's profile (hpf.sim's H100 and
    H200: bf16 dense), else none. A CPU has no published peak, and a calibration's matmul rate
    moves with the load, so a CPU run prints no MFU, whatever is cached."""
    from hpf import sim

    if not torch.accelerator.is_available():
        return None, "a CPU has no published peak"
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    for key in ("h200", "h100"):
        if key in name.lower():
            return sim.hardware(key).peak_flops, f"the {key} profile's bf16 dense peak"
    return None, f"no peak known for {name or 'this accelerator'}"


def peak_memory() -> int:
    """This process's peak memory so far: an accelerator's allocated bytes, else the host RSS."""
    if torch.accelerator.is_available():
        return int(torch.accelerator.max_memory_allocated())
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def read_metrics(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def pin_threads(job: TrainJob) -> None:
    """--invariant: one intra-op thread per rank at every world size (hpf.launch gives a rank the cores
    over the ranks, torchrun all of them), since matmuls and reductions split their sums by thread:
    the bits would follow the thread count (GPT small: 2 threads and 1 differ in 3 steps)."""
    if job.invariant:
        torch.set_num_threads(1)


def train_rank(rank: int, job: TrainJob) -> int | None:
    """One rank of ``hpf train``; rank 0 also shows progress and writes the metrics. Returns the
    step --timeout stopped the run after (its checkpoint saved), or None when it ran to the end."""
    pin_threads(job)
    module, config = job.model_config()
    mesh = mesh_for(job.axes)
    progress = Progress(job.steps, label="train") if rank == 0 else None
    if progress:  # a big config's first step can take minutes: say it has begun, and that it runs
        progress.start(f"restore {job.resume}, first gathers and warm-up" if job.resume else
                       f"step 1 of {job.steps}: init, first gathers and warm-up")
    step = make_step(job, mesh)
    # loop state that rides in each batch and moves by the step's metrics (moe: the expert bias)
    balancer = spec_of(module).balancer(config, default_device()) if spec_of(module).balancer else None
    state, done = first_state(job, step, module, config, balancer)
    if progress:
        progress.first = done  # a resumed run's rate and ETA count only the steps it runs
    batches, evaluate = _rank_data(job, module, config, mesh, rank, done, balancer)
    tokens_per_step = job.batch_size * config.seq_len
    flops, (peak, peak_source) = step_flops(module, config, job.batch_size), peak_flops()
    lr = Schedule(job.schedule, job.lr, total_steps=job.steps, warmup=job.warmup)
    if progress:
        progress.note("metrics     lr, peak memory (rank 0), tokens/s, " + (
            f"MFU against {peak / 1e12:.3g} TFLOP/s per rank ({peak_source})" if peak else f"no MFU: {peak_source}"))
    kept = []  # a resumed run keeps the metrics of the steps it does not redo
    if rank == 0 and job.resume and os.path.exists(job.metrics_path):
        kept = [r for r in read_metrics(job.metrics_path) if r["step"] <= done]
    skipped = 0  # steps with non-finite grads (fp16 overflow): no update
    stopped = None
    try:
        with (_Metrics(job, kept) if rank == 0 else contextlib.nullcontext()) as out, \
                _traced(job, rank, mesh.size) as advance:
            for i in range(done + 1, job.steps + 1):
                state, m = step(state, next(batches))
                advance()
                record = step_record(i, m, tokens_per_step / m["step_s"], lr(i),
                                     flops / m["step_s"] / (peak * mesh.size) if peak else None)
                skipped += m["skipped"]
                if evaluate and job.eval_due(i):
                    record["eval_loss"] = evaluate(step, state)
                record.update(_loop_metrics(m, job, balancer))
                stop = job.stop_due()
                if job.save_due(i) or stop:
                    save_checkpoint(job, step, state, i, config, balancer, progress)
                if out is not None:
                    out.write(record)
                    progress.update(i, _shown(record, m, skipped))
                if stop:
                    stopped = i
                    break
        step.wait_save()
    finally:
        if progress:
            progress.close()
    return stopped


def step_record(i: int, m: dict, tokens_per_s: float, lr: float, mfu: float | None) -> dict:
    """Step ``i``'s line of metrics.jsonl, from the step's metrics ``m``."""
    return {"step": i, **{k: m[k] for k in STEP_METRICS}, "tokens_per_s": tokens_per_s, "lr": lr,
            "peak_memory_bytes": peak_memory(), **({"mfu": mfu} if mfu is not None else {}),
            **({"loss_scale": m["loss_scale"]} if "loss_scale" in m else {})}


def _rank_data(job: TrainJob, module, config, mesh: hpf.Mesh, rank: int, done: int, balancer):
    """This rank's train batches from step ``done`` on (with the examples' keys under --dropout,
    the expert bias for moe), and its held-out evaluation (None without --eval-every)."""
    reader, readers = data_rank(mesh, rank)
    tokens = batches_of(job, config, "train", reader, readers, start=done)
    if job.dropout:
        tokens = _with_example_keys(tokens, job, reader, readers, start=done)
    batches = tokens if balancer is None else map(balancer.batch, tokens)
    return batches, _held_out(job, module, config, reader, readers) if job.eval_every else None


def _loop_metrics(m: dict, job: TrainJob, balancer) -> dict:
    """A step's metrics of the loop's own state (moe: the experts' imbalance) and options (--qk-clip)."""
    out = {} if balancer is None else {"expert_imbalance": balancer.update(m)}
    return {**out, **(qk_clip_record(m, job.qk_clip) if job.qk_clip else {})}


def qk_clip_record(metrics: dict, tau: float) -> dict:
    """--qk-clip's metrics of a step: how many heads QK-Clip scaled (their max logit passed tau,
    the rule hpf.optim.muon applies) and the largest max logit of any head."""
    logits = metrics["aux"]["max_attn_logit"]
    return {"qk_heads_clipped": int((qk_clip_factors(logits, tau) < 1).sum()), "qk_max_logit": float(logits.max())}


def _held_out(job: TrainJob, module, config, rank: int, world: int) -> token_data.HeldOut:
    """--eval-every: the held-out loss, on the same batches at every evaluation."""
    held_out = batches_of(job, config, "val", rank, world, start=0)
    return token_data.HeldOut(spec_of(module).loss(config), [next(held_out) for _ in range(EVAL_BATCHES)])


def first_state(job: TrainJob, step, module, config, balancer) -> tuple[Any, int]:
    """The train state the run starts from, and the steps already done: fresh from the seed, or
    (--resume) from a checkpoint of hpf train's, with its RNG state and the loop's own state."""
    if not job.resume:
        return step.init(functools.partial(spec_of(module).init, config), key=run_keys(job.seed)[0]), 0  # born sharded
    step.init(spec_of(module).init(config, device="meta"))  # meta params: shapes only; the checkpoint fills the shards
    state, extra = step.restore(job.resume)
    if not (isinstance(extra, dict) and {"step", "rng"} <= extra.keys()):
        raise ValueError(f"--resume {job.resume}: this checkpoint was not written by hpf train (its extra is "
                         f"{type(extra).__name__}, not a dict with 'step' and 'rng'); load its params with "
                         "hpf.checkpoint.load_params instead")
    done = int(extra["step"])
    if done >= job.steps:
        raise ValueError(f"--resume {job.resume}: this checkpoint is at step {done}, and the run has "
                         f"{job.steps} steps; nothing is left to train")
    checkpoint.set_rng_state(extra["rng"])
    if balancer is not None:
        balancer.bias = extra["expert_bias"].to(balancer.bias.device)
    return state, done


def save_checkpoint(job: TrainJob, step, state, i: int, config, balancer, progress, async_save: bool = True) -> None:
    """A checkpoint after step ``i``, async unless told: the write overlaps the next steps."""
    extra = {"step": i, "rng": checkpoint.rng_state()}
    if balancer is not None:
        extra["expert_bias"] = balancer.bias.cpu()
    path = job.checkpoints / f"step_{i:06d}"
    step.save(state, path, extra=extra, keep_last=job.keep_last, async_save=async_save,
              meta={"model": job.model, "config": dataclasses.asdict(config), "step": i})
    if progress:
        progress.note(f"checkpoint  step {i} -> {path} (written in the background)")


def _shown(record: dict, m: dict, skipped: int) -> dict[str, str]:
    """The progress line's fields for one step."""
    shown = {"loss": f"{m['loss']:.4f}"}
    if "eval_loss" in record:
        shown["eval"] = f"{record['eval_loss']:.4f}"
    shown.update({"tokens/s": f"{record['tokens_per_s'] / 1e3:.1f}k",
                  "comm wait": f"{comm_share([record]):.0%}"})
    if skipped:
        shown["skipped"] = str(skipped)
    if m["compile_s"] >= 0.05:
        shown["compile"] = f"{m['compile_s']:.1f}s"
    if "qk_heads_clipped" in record:
        shown["qk clipped"] = f"{record['qk_heads_clipped']} heads, max logit {record['qk_max_logit']:.3g}"
    if "expert_imbalance" in record:
        shown["experts max/mean"] = f"{record['expert_imbalance']:.2f}"
    return shown


class _Metrics:
    """Rank 0's record of each step: a line of metrics.jsonl (flushed, so a crashed run keeps its
    steps so far) and, with --tensorboard, the same scalars as TensorBoard events."""

    def __init__(self, job: TrainJob, kept: list[dict]):
        self.file = open(job.metrics_path, "w")
        self.board = None
        if job.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # the tensorboard extra; the driver checked it

            self.board = SummaryWriter(job.tensorboard, purge_step=kept[-1]["step"] + 1 if kept else None)
        for r in kept:
            self.file.write(json.dumps(r) + "\n")

    def write(self, record: dict) -> None:
        record = finite_or_none(record)  # NaN -> null: valid JSON
        self.file.write(json.dumps(record, allow_nan=False) + "\n")
        self.file.flush()
        if self.board is not None:
            for key, value in record.items():
                if key != "step" and value is not None:
                    self.board.add_scalar(key, value, record["step"])
            self.board.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()
        if self.board is not None:
            self.board.close()


@contextlib.contextmanager
def _traced(job: TrainJob, rank: int, world: int):
    """--trace: yields advance() for after each step. Skips 2 warm-up steps (as many as the run
    allows), traces up to 3 into <dir>/rank<r>.json; rank 0 then merges them into trace.json."""
    if job.trace_dir is None:
        yield lambda: None
        return
    from hpf import trace
    folder = Path(job.trace_dir)
    skip = min(2, job.steps - 1)
    with trace.tracing(folder / f"rank{rank}.json", skip_steps=skip, steps=min(3, job.steps - skip)) as advance:
        yield advance
    if world > 1:  # every rank's file is written before rank 0 reads them
        comm_world.barrier()
    if rank == 0:
        trace.merge_traces([folder / f"rank{r}.json" for r in range(world)], folder / "trace.json")
