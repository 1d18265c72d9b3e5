"""``hpf calibrate``: measure this machine for ``hpf simulate --hardware FILE`` (hpf.sim.calibrate),
saying each stage as it begins, since a calibration takes minutes."""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from hpf.cli.common import CliError, write_atomic
from hpf.jobspec import positive


def _shape(text: str) -> tuple[str, str, int]:
    """A ``[model:]config/local_batch`` argument (a GPT's without ``model:``), checked before
    anything is measured."""
    from hpf.models import MODELS, spec_of

    model, _, rest = text.rpartition(":")
    model = model or "gpt"
    name, _, batch = rest.partition("/")
    configs = spec_of(MODELS[model]).configs if model in MODELS else {}
    if name not in configs or not batch.isdigit() or int(batch) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give [model:]config/local_batch with a model of {sorted(MODELS)} (gpt when left out), one "
            f"of its configs ({model}: {sorted(configs)}) and a batch >= 1, e.g. tiny/4 or moe:tiny/4")
    return model, name, int(batch)


def cmd_calibrate(args) -> int:
    from hpf.sim import calibrate as cal, calibrate_terms as terms

    if not (args.out or args.update):
        raise CliError("give --out FILE (a full calibration) or --update FILE (the terms it lacks)")
    update = None
    if args.update:
        try:
            update = json.loads(args.update.read_text())
            update["links"]["gloo"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CliError(f"--update {args.update} is not a calibration file ({type(e).__name__}: {e}); "
                           "make one with hpf calibrate --out FILE") from None
    out = args.out or args.update
    try:  # can the file be written? (checked beside it: --out appears only when the calibration is whole)
        out.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out.parent).close()
        if out.is_dir():
            raise IsADirectoryError(21, "it is a folder")
    except OSError as e:
        raise CliError(f"--out {out} cannot be written ({e.strerror}); pick a file you can write") from None
    total, done, started = cal.stages(args.world_sizes, update), [0], time.perf_counter()

    def stage(what: str) -> None:
        done[0] += 1
        print(f"calibrate  [{done[0]}/{total}] {what}  ({time.perf_counter() - started:.0f} s so far)", flush=True)

    if update is None:
        result, load = cal.with_load(lambda: cal.calibrate(args.world_sizes, args.shapes, reps=args.reps,
                                                           launches=args.launches, stage=stage))
        result["load"] = {"all": load}
        print(f"calibrate  other processes used {load['others_cores']:.2f} of {load['cores']} cores while it ran "
              "(recorded in the file: a busy machine's figures predict slower steps)", flush=True)
    else:
        result = update
        if "issue_when" not in result:
            terms.add_issue_costs(result, args.reps, args.launches, stage)
        if "fsdp2_comm_when" not in result:
            terms.add_fsdp2_comm(result, args.reps, launches=args.launches, stage=stage)
        if "sync_when" not in result:
            terms.add_sync_terms(result, args.reps, launches=args.launches, stage=stage)
    write_atomic(out, json.dumps(result, indent=1) + "\n")
    worlds = ", ".join(map(str, result["links"]["gloo"]))
    print(f"wrote {out} in {time.perf_counter() - started:.0f} s: links on {worlds} ranks (gloo, shared memory), "
          f"compute of {', '.join(sorted(result['compute']))} ([model:]config/local batch/ranks[/precision]), peak "
          f"{result['peak_flops'] / 1e9:.0f} GFLOP/s at efficiency {result['efficiency']:.2f}")
    model, config, batch = args.shapes[0]
    print(f"use it as: hpf simulate --hardware {out} --model {model} --config {config} --local-batch {batch} "
          f"--world-size {args.world_sizes[0]}")
    return 0


def add_parser(sub, help_: str):
    calibrate = sub.add_parser(
        "calibrate", help=help_,
        description="Measure this machine for hpf simulate: alpha and beta of gloo and shared-memory collectives per "
                    "group size, the compute of model shapes in fp32 and bf16 with every rank busy, how collectives and compute slow "
                    "each other on shared cores, per-unit overheads, and FSDP2's own collective path. About 3 "
                    "minutes with the defaults on 2 cores; one line per stage. Predictions for shapes and rank "
                    "counts it did not measure are extrapolated, and hpf simulate says so.")
    calibrate.add_argument("--out", type=Path, metavar="FILE", help="the calibration JSON to write")
    calibrate.add_argument("--update", type=Path, metavar="FILE",
                           help="measure only the terms this calibration file lacks (written to --out if given, "
                                "else in place)")
    calibrate.add_argument("--world-sizes", type=positive(int), nargs="+", default=[2, 4], metavar="N",
                           help="rank counts to measure links and compute on (default: 2 4)")
    calibrate.add_argument("--shapes", type=_shape, nargs="+", default=[("gpt", "tiny", 4), ("gpt", "small", 2)],
                           metavar="[MODEL:]CONFIG/B",
                           help="model (gpt when left out), config and sequences per rank to measure compute of, in "
                                "fp32 and bf16 (default: tiny/4 small/2; e.g. moe:tiny/4)")
    calibrate.add_argument("--reps", type=positive(int), default=7, help="repetitions per figure (default: 7)")
    calibrate.add_argument("--launches", type=positive(int), default=3,
                           help="each figure is the median of this many launches (default: 3)")
    calibrate.set_defaults(run=cmd_calibrate)
    return calibrate
