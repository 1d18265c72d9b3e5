"""The one declaration of a training job's options (torchtitan's ``JobConfig`` idea).

Each field of :class:`JobSpec` carries its default, its help text, how its flag parses, which
commands take it, what ``hpf train --resume`` does with it, and which of the simulator's and
the memory model's inputs it is. Everything else is derived from here: the ``hpf train``,
``plan`` and ``simulate`` flags (:func:`add_arguments`), the run's ``TrainJob`` (a subclass),
run.json's resume policy, the plan search's ``Candidate`` fields and their defaults
(:func:`searched`), and the keyword arguments of ``hpf.sim`` and ``hpf.memory.predict``
(:func:`inputs`). A new option is one field here.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .topology import Topology
from .config import MODES
from .models import MODELS, spec_of
from .models.recompute import RECOMPUTE
from .optim.lr_schedules import NAMES as SCHEDULES
from .precision import PRECISIONS, SlowPrecision

__all__ = ["JobSpec", "FIXED", "INHERITED", "TRAIN", "JOB", "add_arguments", "defaults", "resumed", "inputs",
           "searched", "checked", "step_topology", "positive", "axes_list", "slow_precision", "BATCH_SIZE"]

FIXED, INHERITED = "fixed", "inherited"  # --resume: keep run.json's value (refuse another) / take it unless given
TRAIN, JOB = ("train",), ("train", "plan", "simulate")  # the commands that take an option
BATCH_SIZE = 32  # hpf train's global batch, in sequences, when --batch-size is not given


# ------------------------------------------------------------------ how flags parse

def positive(kind, least=None):
    """An argparse type: a finite number > 0 (or >= ``least``)."""
    def check(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if value <= 0 if least is None else value < least:
            raise argparse.ArgumentTypeError(f"{text!r} must be " + ("positive" if least is None else f">= {least}"))
        return value
    return check


def axes_list(text: str) -> tuple[str, ...]:
    axes = tuple(a.strip() for a in text.split(",") if a.strip())
    if not axes:
        raise argparse.ArgumentTypeError("give mesh axis names separated by commas, e.g. node,local")
    return axes


def slow_precision(text: str) -> str:
    """``--slow-precision W[,G[,ef]]``: "int8" (both sides), "int8,int4", "none,int8,ef" -> "W,G,ef" (checked);
    "auto": the plan search chooses (hpf.cli.common.only_searched)."""
    if text == "auto":
        return text
    try:
        slow = SlowPrecision.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return slow.text() if slow else "none,none"


def option(default, help: str, *, commands=TRAIN, resume: str | None = INHERITED, feeds: tuple[str, ...] = (),
           shown: str | None = None, **flag) -> Any:
    """A JobSpec field. ``help`` gets "(default: ``shown`` or the default)" unless ``shown`` is "";
    ``feeds``: "step" (an hpf.shard_step option as it is), "sim" (a keyword of hpf.sim.simulate) and
    "memory" (of hpf.memory.predict); ``flag``:
    argparse's type, choices and metavar (a bool default is a store_true flag)."""
    return dataclasses.field(default=default, metadata=dict(help=help, commands=commands, resume=resume, feeds=feeds,
                                                            shown=shown, flag=flag))


# ------------------------------------------------------------------ the options

_CONFIGS = sorted(set().union(*(spec_of(m).configs for m in MODELS.values())))


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """What a job computes and how it runs, one field per ``hpf train`` option (``hpf plan`` and
    ``hpf simulate`` take the ``JOB`` ones). Plain data, so it travels to forked ranks unchanged."""

    model: str = option("gpt", "the pure-function model from hpf.models", commands=JOB, resume=FIXED,
                        choices=sorted(MODELS))
    config: str = option("tiny", "a config of --model, from hpf.models.<model>.CONFIGS", commands=JOB, resume=FIXED,
                         choices=_CONFIGS)
    fsdp_axes: tuple | None = option(None, "axes params are sharded and gathered over, e.g. local", commands=JOB,
                                     shown="all", type=axes_list, metavar="AXES")
    mixed_precision: str | None = option(
        None, "compute dtype, with fp32 master shards and fp32 grad reduction", commands=JOB, shown="off",
        feeds=("step", "sim", "memory"), choices=sorted(PRECISIONS))
    topology: str = option(
        "two-tier", "two-tier: fast-tier collectives first (shared memory between local CPU ranks), 1/fast-size of "
        "the bytes over the slow tier, reductions overlapping backward; flat: one collective over all ranks",
        commands=JOB, feeds=("sim", "memory"), choices=("two-tier", "flat"))
    slow_precision: str | None = option(
        None, "a low-bit slow tier: the format weights are gathered in and grads exchanged in across the slow tier "
        "(W: bf16, fp8, int8; G: also int4; none: full precision; W alone sets both), block-quantized with fp32 "
        "masters and fp32 sums; ef: grad error feedback (default: off); auto: with hpf plan --search or hpf train "
        "--plan auto, the search tries int8 and int8,int4 too (lossy: off unless asked)", commands=JOB,
        shown="none", feeds=("sim",), type=slow_precision, metavar="W[,G[,ef]]")
    ep_axis: str | None = option(
        None, "--model moe: the data axis experts are split over (expert parallelism); dense params still shard "
        "over every FSDP axis, experts over the others", commands=JOB, shown="none", feeds=("sim",), metavar="AXIS")
    hsdp: bool = option(False, "shard params within the fast tier only and replicate them across the slow tier",
                        commands=JOB, shown="", feeds=("step",))
    bucket_bytes: int = option(
        0, "two-tier: split each unit into fused collectives of at most this many bytes, so one's slow stage "
        "overlaps the next one's fast stage", commands=JOB, shown="0, one per unit", feeds=("sim",),
        type=positive(int, least=0), metavar="BYTES")
    optimizer: str = option(
        "adamw", "muon: Muon for weight matrices (one momentum each; owners balanced by Newton-Schulz FLOPs), AdamW "
        "for embeddings, head and vectors", commands=JOB, resume=FIXED, choices=("adamw", "muon"))
    steps: int = option(100, "", resume=FIXED, type=positive(int))
    batch_size: int = option(BATCH_SIZE, "global batch in sequences, split over the ranks", commands=("train", "plan"),
                             resume=FIXED, type=positive(int), metavar="B")
    lr: float | None = option(None, "peak learning rate", resume=FIXED, shown="", type=positive(float))  # (help: cli)
    warmup: int | None = option(None, "steps of linear lr warmup from 0", resume=FIXED, shown="per config, see --lr",
                                type=positive(int, least=0), metavar="STEPS")
    schedule: str = option("constant", "learning rate over the run, after --warmup: cosine or linear decay to 0 at "
                           "--steps, or constant", resume=FIXED, choices=SCHEDULES)
    data: str | None = option(None, "train on a token folder from `hpf prepare` (its vocab sets the model's) instead "
                              "of the synthetic Markov source", resume=FIXED, shown="", type=Path, metavar="DIR")
    eval_every: int = option(0, "with --data: held-out loss every N steps and at the end (eval_loss in the progress "
                             "line, metrics.jsonl and the loss plot)", shown="", type=positive(int), metavar="N")
    save_every: int = option(
        0, "save a checkpoint every N steps into <out>/checkpoints (DCP format, async: the write overlaps the next "
        "steps); a run with --save-every, --timeout or --resume also saves the step it ends at", shown="",
        type=positive(int), metavar="N")
    elastic: bool = option(
        False, "survive a lost rank (SIGKILL, a machine): the ranks left re-form and rebuild its shards from "
        "their peers' copies in memory, and redo only the step in flight (hpf.elastic, docs/elastic.md); "
        "one data axis (--world-size), with --invariant the same bits as a run that never failed", shown="")
    replacements: int = option(0, "with --elastic: start up to N new ranks for lost ones; each joins at a step "
                               "boundary and the world grows back", shown="0", type=positive(int, least=0), metavar="N")
    rejoin_wait: float = option(
        0.0, "with --elastic: after a loss, hold the next step boundary up to S seconds for a new rank (a "
        "--replacements rank, or the worker torchrun restarts) to join, so the world grows back before it steps on; "
        "0: go on at once on the ranks left", shown="0", type=positive(float, least=0), metavar="S")
    keep_last: int = option(3, "keep the newest K checkpoints", type=positive(int), metavar="K")
    accumulate: int = option(
        1, "gradient accumulation: each rank runs its share of --batch-size as K micro-batches (activations of one "
        "micro-batch), reducing grads once per step", feeds=("step", "sim", "memory"), type=positive(int), metavar="K")
    recompute: str = option(
        "none", "activation checkpointing: every_other or all blocks keep only their input and run their forward "
        "again in backward (less activation memory, more compute)", feeds=("sim", "memory"), choices=RECOMPUTE)
    dropout: float = option(
        0.0, "dropout on the embeddings and every residual branch (gpt, llama), with masks drawn from per-example "
        "keys (hpf.random.example_keys), so they do not depend on the world size and recomputed blocks see the "
        "same ones", resume=FIXED, shown="0", type=positive(float, least=0.0), metavar="P")
    sequence_parallel: bool = option(
        False, "with a tp axis in --mesh: the norms and the residual stream split along the sequence over it too "
        "(all-gather and reduce-scatter instead of each psum; Megatron's sequence parallelism)", shown="")
    compile: bool = option(False, "torch.compile each block (compiled once, on the first step: its compile time is "
                           "in the progress line and metrics.jsonl's compile_s)", shown="")
    ns_variant: str = option(
        "standard", "with --optimizer muon: Newton-Schulz's iteration; gram has fewer FLOPs on rectangular "
        "matrices, auto picks per shape (hpf.optim.muon's ns_variant)", resume=FIXED, choices=("standard", "gram", "auto"))
    qk_clip: float | None = option(
        None, "with --optimizer muon: QK-Clip (Kimi K2's MuonClip): after each update, scale the query and key "
        "weights of every head whose max attention logit exceeded TAU (gpt, llama)", resume=FIXED, shown="off",
        type=positive(float), metavar="TAU")
    mode: str = option("production", "validate runs the same plan with layout checks on every op", feeds=("step",),
                       choices=MODES)
    invariant: bool = option(
        False, "the same bits at any scale: losses and params that do not depend on the world size, the mesh, "
        "the topology, --accumulate or --recompute (docs/invariant.md); each rank's sequences run in atoms of "
        "--atom-size, summed in one fixed order", resume=FIXED, shown="")
    atom_size: int | None = option(
        None, "with --invariant: sequences per atom, the same at every mesh", resume=FIXED,
        shown="--batch-size over 8, or over its largest divisor up to 8", type=positive(int), metavar="N")
    seed: int = option(0, "seeds the init and the data", resume=FIXED, type=positive(int, least=0))


# ------------------------------------------------------------------ what is derived

def _fields(command: str | None = None) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(JobSpec) if command is None or command in f.metadata["commands"]]


def _field(name: str) -> dataclasses.Field:
    """The option ``name``'s field (TypeError, naming where to declare it, for one JobSpec lacks)."""
    found = [f for f in _fields() if f.name == name]
    if not found:
        raise TypeError(f"{name!r} is no JobSpec option: declare it in hpf.jobspec first")
    return found[0]


def _help(f: dataclasses.Field, mine: dict) -> str:
    text, shown = mine.get("help", f.metadata["help"]), mine.get("shown", f.metadata["shown"])
    default = shown if shown is not None else mine.get("default", f.default)
    return f"{text} (default: {default})".lstrip() if default != "" else text


def add_arguments(parser: argparse.ArgumentParser, command: str, *, resumable: bool = False,
                  own: dict[str, dict] | None = None) -> None:
    """``command``'s flags, one per JobSpec field it takes, ``--fsdp-axes`` for ``fsdp_axes``.
    ``resumable`` (hpf train): every flag defaults to None, so a resumed run can tell what was
    given (run.json fills the rest, else :func:`defaults`); ``own``: a field's ``help``, ``default``
    and ``shown`` default where the command says more or differs (hpf plan's --batch-size)."""
    for f in _fields(command):
        mine = (own or {}).get(f.name, {})
        kw = dict(help=_help(f, mine), default=None if resumable else mine.get("default", f.default))
        if isinstance(f.default, bool):
            kw["action"] = "store_true"
        else:
            kw.update(f.metadata["flag"])
        parser.add_argument("--" + f.name.replace("_", "-"), **kw)


def defaults(command: str = "train") -> dict[str, Any]:
    """The default of each of ``command``'s options: a new run's."""
    return {f.name: f.default for f in _fields(command)}


def resumed(policy: str | None = None) -> tuple[str, ...]:
    """The options run.json keeps (``policy``: only the FIXED or the INHERITED ones)."""
    return tuple(f.name for f in _fields("train") if f.metadata["resume"] and policy in (None, f.metadata["resume"]))


def inputs(job: Any, feeds: str) -> dict[str, Any]:
    """The options that ``feeds`` "step" (hpf.shard_step's options), "sim" (hpf.sim.simulate's keywords)
    or "memory" (hpf.memory.predict's), read from ``job`` (a JobSpec, a search Candidate, parsed flags);
    one it lacks (a command without that flag) has its default."""
    return {f.name: getattr(job, f.name, f.default) for f in _fields() if feeds in f.metadata["feeds"]}


def checked(name: str, value: Any) -> Any:
    """``value`` of option ``name`` as its flag would take it (a saved plan file's, say): None where the
    default is None, a bool for a switch, else the flag's type and choices on its text.

    Raises:
        ValueError: a value the flag would refuse, saying why."""
    f = _field(name)
    if isinstance(f.default, bool) or value is None:
        if not (isinstance(value, bool) if isinstance(f.default, bool) else f.default is None):
            raise ValueError("not a value of this option")
        return value
    flag = f.metadata["flag"]
    try:
        out = flag["type"](str(value)) if "type" in flag else str(value)
    except argparse.ArgumentTypeError as e:
        raise ValueError(str(e)) from None
    if type(out) is not type(value):
        raise ValueError(f"a {type(value).__name__}")
    if "choices" in flag and out not in flag["choices"]:
        raise ValueError(f"not one of {sorted(flag['choices'])}")
    return out


def step_topology(job: Any):
    """shard_step's ``topology`` for ``job``'s topology, bucket_bytes and slow_precision (a JobSpec,
    a search Candidate, parsed flags): ``hpf.Topology`` for "two-tier", None (the flat ring) for "flat".

    Raises:
        ValueError: a bucket cap or a low-bit slow tier with the flat ring, which has neither."""
    low = SlowPrecision.parse(job.slow_precision)
    if job.topology == "two-tier":
        return Topology.with_slow(low, bucket_bytes=job.bucket_bytes)
    if job.bucket_bytes:
        raise ValueError(f"--bucket-bytes {job.bucket_bytes} needs --topology two-tier: the flat ring runs one "
                         "collective per unit")
    if low:
        raise ValueError(f"--slow-precision {job.slow_precision} needs --topology two-tier: the flat ring has no "
                         "slow stage of its own (the fast tier stays at full precision)")
    return None


def searched(name: str) -> Any:
    """A plan search dimension's field (hpf.search.Candidate): the option ``name``, with its default."""
    return dataclasses.field(default=_field(name).default)
