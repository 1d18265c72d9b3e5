"""``hpf plan --search`` and ``hpf train --plan auto|FILE``: the plan search (hpf.search) on the
command line, its options, and how a searched plan becomes ``hpf train``'s options."""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
import statistics

from hpf import jobspec, memory, search
from hpf.cli.common import CliError, mesh_text
from hpf.jobspec import positive
from hpf.cli.machine import HELP, hardware_of
from hpf.models.registry import check_tp
from hpf.search import Candidate
from hpf.precision import SlowPrecision

# hpf train's options a plan sets: hpf.search.Candidate's fields
PLANNED = tuple(f.name for f in dataclasses.fields(Candidate))
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def memory_bytes(text: str):
    """An argparse type: "auto", or bytes as a number with an optional unit (80GB, 64GiB, 1.5e9)."""
    if text == "auto":
        return text
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m[2].lower() if m else None
    try:
        value = float(m[1]) * _UNITS[unit] if m and unit in _UNITS else None
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size; give bytes with an optional unit "
                                         "(e.g. 64GiB, 80GB, 5e9) or auto (this machine's)")
    return int(value)


def _as_options(saved: dict, where: str) -> None:
    """Check a plan file's job and choice as the command line's options are checked (hpf.jobspec's
    types and choices): a tampered value is one line naming it, not a crash or a run that records it."""
    values = [(saved, k) for k in ("model", "config", "batch_size")] + [(saved["choice"]["options"], k) for k in PLANNED
                                                                           if k != "tp"]
    for holder, key in values:
        try:
            holder[key] = jobspec.checked(key, holder.get(key))
        except ValueError as e:
            raise CliError(f"--plan {where}: {key} is {holder.get(key)!r} ({e}), which --{key.replace('_', '-')} does "
                           "not take; write the file with hpf plan --search --save FILE") from None
    tp = saved["choice"]["options"].get("tp", 1)
    try:  # (no flag to check it as: the mesh's tp axis)
        check_tp(tp)
    except ValueError as e:
        raise CliError(f"--plan {where}: tp is {tp!r} ({e}); write the file with hpf plan --search --save FILE") from None


def add_options(parser, *, train: bool) -> None:
    """The search's options: hpf train's --plan or hpf plan's --search, the cap, the hardware that
    prices the candidates (plan also: the batch, --save)."""
    if train:
        parser.add_argument("--plan", metavar="auto|FILE",
                            help="run a searched plan: auto searches now (hpf plan --search on --hardware, capped at "
                                 "--memory-per-rank, default this machine's memory); FILE replays hpf plan --search "
                                 "--save FILE. It sets " + ", ".join("--" + o.replace("_", "-") for o in PLANNED))
    else:
        parser.add_argument("--search", action="store_true",
                            help="search the plan instead: tensor-parallel size (gpt, llama: a tp axis split off "
                                 "the mesh's last axis), FSDP layout, experts' axis, bucket bytes, precision, "
                                 "recomputation and micro-batches, under --memory-per-rank, ranked by hpf.sim's "
                                 "predicted step time on --hardware; --mixed-precision, --ep-axis, --hsdp and "
                                 "--slow-precision, when given, hold theirs (--slow-precision auto: search the low-bit "
                                 "slow tier too) (docs: plan_search.md)")
    parser.add_argument("--memory-per-rank", type=memory_bytes, metavar="BYTES|auto",
                        help="the search's cap on predicted peak memory per rank, e.g. 64GiB; auto: this machine's "
                             "(an accelerator's free memory under torchrun, else the host's available memory over "
                             "its ranks). Default: " +
                             ("auto" if train else "the --hardware profile's memory per rank, else auto"))
    parser.add_argument("--hardware", metavar="NAME|FILE",
                        help="what hpf.sim prices the candidates on: " + HELP)
    if not train:
        parser.add_argument("--save", metavar="FILE",
                            help="with --search: write the result as JSON for hpf train --plan FILE")


def _cap(args, hw, local_ranks: int, machine: bool) -> int:
    """--memory-per-rank in bytes: given; else the profile's (hpf plan, a published profile);
    else this machine's (``machine``: hpf train, which runs here)."""
    if args.memory_per_rank not in (None, "auto"):
        return args.memory_per_rank
    if args.memory_per_rank is None and hw.memory_bytes and not machine:
        return hw.memory_bytes
    return memory.machine_memory(local_ranks)[0]


def run_search(args, mesh, *, batch_size: int, local_ranks: int, machine: bool = False):
    """hpf.search.search for the command line's job; its errors as one line. Returns (the result,
    the line that says which hardware priced it)."""
    hw, where = hardware_of(args, mesh.size, batch_size // mesh.size, runs_here=machine)
    fixed = {k: getattr(args, k) for k in ("mixed_precision", "ep_axis") if getattr(args, k, None) is not None}
    if getattr(args, "hsdp", False):
        fixed["hsdp"] = True
    slow = getattr(args, "slow_precision", None)
    if slow not in (None, "auto"):  # held: a precision, or none
        low = SlowPrecision.parse(slow)
        fixed["slow_precision"] = low and low.text()
    try:
        return search.search(args.model, args.config, mesh, hw, global_batch=batch_size,
                             memory_per_rank=_cap(args, hw, local_ranks, machine), optimizer=args.optimizer,
                             fixed=fixed, low_bit=slow == "auto"), where
    except ValueError as e:
        raise CliError(str(e)) from None


def cmd_search(args, mesh) -> int:
    """hpf plan --search: the ranking, and with --save the file hpf train --plan replays."""
    result, where = run_search(args, mesh, batch_size=args.batch_size or mesh.size, local_ranks=mesh.size)
    print(result.format())
    print(f"assumed: {where}; global batch {result.global_batch} sequences"
          + (" (--batch-size)" if args.batch_size else " (one per rank: pass --batch-size, e.g. hpf train's 32)"))
    if args.save:
        result.save(args.save)
        model = "" if args.model == "gpt" else f"--model {args.model} "
        print(f"saved to {args.save}; run it with hpf train {model}--config {args.config} --plan {args.save}")
    return 0


def check_plan_flags(args) -> None:
    """Before the run folder fills defaults: --plan sets these options, so giving both is an error;
    --plan FILE also gives the job (model, config, mesh, batch) where the command line does not."""
    given = [o for o in PLANNED if getattr(args, o, None) not in (None, False, "auto")]  # (tp: the mesh's, no flag)
    if given:
        raise CliError(f"--plan {args.plan} chooses {', '.join('--' + o.replace('_', '-') for o in given)}; "
                       "drop them, or drop --plan")
    if args.slow_precision == "auto" and args.plan != "auto":
        raise CliError(f"--slow-precision auto asks the search to try a low-bit slow tier, and --plan {args.plan} "
                       "replays a search already made; search again with hpf plan --search --slow-precision auto")
    if args.plan == "auto":
        return
    try:
        saved = search.load(args.plan)
    except ValueError as e:
        raise CliError(f"--plan: {e}") from None
    _as_options(saved, args.plan)
    for key in ("model", "config", "mesh", "batch_size"):
        mine = getattr(args, key)
        if mine is None:
            setattr(args, key, saved[key])
            if key == "batch_size" and saved[key] != args.fresh["batch_size"]:
                args.plan_batch_note = (f"hpf train's default is {args.fresh['batch_size']}; pass --batch-size "
                                        f"{saved[key]} to say so, or search again with another --batch-size")
        elif mine != saved[key]:
            shown = mesh_text(mine) if key == "mesh" else mine
            raise CliError(f"--plan {args.plan} was searched for --{key.replace('_', '-')} "
                           f"{mesh_text(saved[key]) if key == 'mesh' else saved[key]}, not {shown}; search again "
                           "for this job (hpf plan --search ... --save FILE) or drop the option")
    args.plan_choice = saved["choice"]["options"]
    args.plan_hardware = saved.get("hardware", "unknown hardware")


def apply_plan(args, mesh, local_ranks: int) -> tuple[str, object]:
    """Set the run's options from the plan (searched now for --plan auto); returns the line that says
    so, and the mesh it runs on (a tensor-parallel choice splits a ``tp`` axis off the last one)."""
    if args.plan == "auto":
        result, hw = run_search(args, mesh, batch_size=args.batch_size, local_ranks=local_ranks, machine=True)
        choice, where = result.best.candidate, (f"searched {result.candidates} candidates in {result.seconds:.1f} s "
                                                f"on {hw}, predicted {result.best.step_s * 1e3:.3g} ms "
                                                f"per step, {memory.size(result.best.memory.total)} per rank")
        args.predicted_step_s = result.best.step_s  # checked against the measured steps at the end (check_prediction)
    else:
        choice, where = Candidate(**args.plan_choice), f"from {args.plan}, searched on {args.plan_hardware}"
    for key, value in dataclasses.asdict(choice).items():
        setattr(args, key, value)
    try:
        mesh = choice.mesh(mesh)
    except (ValueError, TypeError) as e:
        raise CliError(f"--plan: tp={choice.tp!r} cannot split --mesh {mesh_text(args.mesh)} ({e}); search again") from None
    args.mesh = dict(zip(mesh.axis_names, mesh.shape))
    note = getattr(args, "plan_batch_note", None)
    sets = [f"--batch-size {args.batch_size}" + (f" (the plan's; {note})" if note else "")]
    if choice.mixed_precision is None:
        sets.append("fp32 compute")
    else:
        import torch
        cpu = choice.mixed_precision == "bf16" and not torch.accelerator.is_available()
        sets.append(f"--mixed-precision {choice.mixed_precision}"
                    + (" (on a CPU, bf16 is emulated and slower than fp32)" if cpu else ""))
    if choice.tp > 1:
        sets.append(f"--mesh {mesh_text(args.mesh)}")
    return f"plan: {choice.label()} ({where}); it sets " + ", ".join(sets), mesh


TRUSTED = 1.5  # a prediction within this factor of the measured step is what hpf.sim promises here


def check_prediction(args, records: list[dict]) -> str | None:
    """--plan auto: the searched plan's predicted step against the run's measured median, and what to
    do when they differ by more than ``TRUSTED``x (None for a run without one)."""
    predicted = getattr(args, "predicted_step_s", None)
    if predicted is None or not records:
        return None
    measured = statistics.median(r["step_s"] for r in records)
    ratio = predicted / measured
    line = (f"  prediction  {predicted * 1e3:.4g} ms a step predicted, {measured * 1e3:.4g} ms measured "
            f"({ratio:.2f}x)")
    if not 1 / TRUSTED <= ratio <= TRUSTED:
        line += (f": off by more than {TRUSTED}x, so the plan may not be the fastest here; hpf calibrate --out FILE "
                 "measures this machine at length (then --hardware FILE), on a quiet machine")
    return line
