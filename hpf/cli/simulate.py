"""``hpf simulate``: predicted step time, exposed communication and tokens/s at any scale."""
from __future__ import annotations

import sys
from pathlib import Path

from hpf import sim
from hpf.cli.common import CliError, check_ep_axis, only_searched, job_parser, mesh_of
from hpf.jobspec import BATCH_SIZE, inputs, positive
from hpf.cli.machine import HELP, hardware_of
from hpf.models import data_axes, model_config

SWEEP_LOCAL_BATCH = 4  # --sweep's sequences per rank: weak scaling, the same at every rank count
from hpf.plots import missing_matplotlib


def add_parser(sub, help_: str):
    simulate = sub.add_parser(
        "simulate", parents=[job_parser("simulate")], help=help_,
        description="Predict step time, exposed communication and tokens/s of hpf, FSDP2 and Megatron DDP from "
                    "the plan alone (hpf.sim: alpha-beta links per tier, the step's schedule as an event "
                    "simulation). Example: hpf simulate --config 1b --mesh node=48,local=16 --hardware "
                    "cloudmatrix384 --mixed-precision bf16")
    simulate.add_argument("--hardware", metavar="NAME|FILE", help=HELP)
    simulate.add_argument("--local-batch", type=positive(int), default=None, metavar="B",
                          help="sequences per rank per step, per tp group with a tp axis (default: hpf train's, its "
                               f"global batch of {BATCH_SIZE} over the data ranks; with --sweep {SWEEP_LOCAL_BATCH}, "
                               "weak scaling)")
    simulate.add_argument("--sweep", metavar="N,N,...",
                          help="rank counts for a scaling curve, e.g. 16,32,64,128,256,512,768 (meshes of whole "
                               "fast domains: node=N/fast,local=fast)")
    simulate.add_argument("--plot", type=Path, metavar="DIR",
                          help="with --sweep: write step_time.png, exposed_comm.png, tokens_per_rank.png into DIR "
                               "(needs matplotlib; without it one line says so and the table is still printed)")
    simulate.add_argument("--no-pipeline", action="store_true", help="hpf waits for each unit's reduction")
    simulate.add_argument("--estimate", action="store_true",
                          help="predict a shape the --hardware calibration never measured, from FLOPs at a measured "
                               "shape's efficiency (a guess: 18x off on a CPU); without it such a shape is refused")
    simulate.set_defaults(run=cmd_simulate)
    return simulate


def cmd_simulate(args) -> int:
    try:
        module, config = model_config(args.model, args.config)
    except ValueError as e:
        raise CliError(str(e)) from None
    check_ep_axis(args.model, args.ep_axis)
    only_searched(args.slow_precision)
    if args.local_batch is None:  # hpf train's: its global batch over the data ranks
        data = 1 if args.sweep else mesh_of(args).axis_size(data_axes(mesh_of(args).axis_names))
        args.local_batch = SWEEP_LOCAL_BATCH if args.sweep else max(1, BATCH_SIZE // data)
    kw = dict(local_batch=args.local_batch, fsdp_axes=args.fsdp_axes, pipeline=not args.no_pipeline,
              model=args.model, optimizer=args.optimizer, **inputs(args, "sim"))
    # Megatron DDP keeps full replicas: no baseline for a model whose experts only fit split
    strategies = ("hsdp" if args.hsdp else "hpf", "fsdp2") + (() if args.ep_axis else ("ddp",))
    if args.plot and not args.sweep:
        raise CliError("--plot draws the scaling curve: give --sweep too")
    if args.sweep:
        try:
            ranks = [int(n) for n in args.sweep.split(",")]
        except ValueError:
            raise CliError(f"--sweep {args.sweep!r}: give rank counts separated by commas, e.g. 16,32,64") from None
        hw, where = hardware_of(args, max(ranks), args.local_batch)
        refuse_uncalibrated(args, hw, ranks)
        rows = sim.sweep(args.config, ranks, hw, strategies, **kw)
    else:
        mesh = mesh_of(args)
        hw, where = hardware_of(args, mesh.size, args.local_batch)
        refuse_uncalibrated(args, hw, [mesh.size])
        rows = [(mesh.size, sim.compare(args.config, mesh, hw, strategies, **kw))]
    reader = "tp group" if args.mesh and "tp" in args.mesh else "rank"  # (a tp group reads one share)
    print(f"hpf simulate: {args.model} {args.config!r}, {args.local_batch} x {config.seq_len} tokens per "
          f"{reader}, {args.mixed_precision or 'fp32'}, hardware {hw.name}, hpf {args.topology}"
          f"{' HSDP' if args.hsdp else ''}{f' (slow tier {args.slow_precision})' if args.slow_precision else ''}"
          f"{f', experts over {args.ep_axis}' if args.ep_axis else ''}"
          f"{', Muon (its tax in hpf rows only; the baselines with AdamW)' if args.optimizer == 'muon' else ''}; "
          "the baselines as modelled in hpf.sim")
    print(f"{'ranks':>6} {'strategy':<8} {'step ms':>9} {'exposed':>8} {'tokens/s':>12} {'tok/s/rank':>11} "
          f"{'hpf vs':>7} {'fast busy ms':>12} {'slow busy ms':>12}")
    for n, res in rows:
        ours = res[strategies[0]].step_s
        for name, r in res.items():
            versus = "-" if name == strategies[0] else f"{ours / r.step_s - 1:+.1%}"
            print(f"{n:>6} {name:<8} {r.step_s * 1e3:>9.2f} {r.exposed_share:>8.1%} {r.tokens_per_s:>12,.0f} "
                  f"{r.tokens_per_s / n:>11,.0f} {versus:>7} {r.busy_s['fast'] * 1e3:>12.2f} "
                  f"{r.busy_s['slow'] * 1e3:>12.2f}")
    print(f"  hpf vs: {strategies[0]}'s step time against that row's (-20%: a step 20% shorter than that strategy's)")
    print(f"  assumed: {where}")
    for note in hw.notes:
        print(f"  note: {note}")
    for n, _ in rows:
        for warning in sim.extrapolation(args.config, args.local_batch, n, hw, args.model, args.mixed_precision):
            print(f"hpf: warning: {warning}", file=sys.stderr)
    if args.plot:
        skipped = missing_matplotlib("--plot")
        if skipped:
            print(skipped, file=sys.stderr)
        else:
            for f in save_simulate_plots(rows, args.plot):
                print(f"  wrote {f}")
    return 0


def refuse_uncalibrated(args, hw, ranks: list[int]) -> None:
    """A calibration that never measured this job's shape gives no prediction of it, only a guess:
    refuse and name the shape to calibrate (unless --estimate)."""
    shape = sim.uncalibrated_shape(args.config, args.local_batch, hw, args.model)
    if shape is None or args.estimate or args.hardware is None:  # (this machine's own: hardware_of measured it)
        return
    measured = sorted(hw.compute)
    raise CliError(f"--hardware {args.hardware}: its calibration measured the compute of {', '.join(measured)} "
                   f"(config/local batch/ranks), not {shape}, so a step of it could only be guessed from FLOPs at "
                   f"another shape's efficiency (on a CPU: 18x off). Measure it: hpf calibrate --shapes {shape} "
                   f"--world-sizes {' '.join(map(str, ranks))} --update {args.hardware}; or pass --estimate for the guess")


def save_simulate_plots(rows, out: Path) -> list[Path]:
    """step_time.png, exposed_comm.png, tokens_per_rank.png of a sweep, one line per strategy."""
    from matplotlib.figure import Figure

    out.mkdir(parents=True, exist_ok=True)
    ranks = [n for n, _ in rows]
    files = []
    for fname, label, value in (("step_time.png", "step time (ms)", lambda r, n: r.step_s * 1e3),
                                ("exposed_comm.png", "exposed communication (% of step)",
                                 lambda r, n: 100 * r.exposed_share),
                                ("tokens_per_rank.png", "tokens/s per rank", lambda r, n: r.tokens_per_s / n)):
        fig = Figure(figsize=(6, 3.5), layout="constrained")
        ax = fig.subplots()
        for name in rows[0][1]:
            ax.plot(ranks, [value(res[name], n) for n, res in rows], marker="o", label=name)
        ax.set(xlabel="ranks", ylabel=label, xscale="log", title=label)
        ax.set_xticks(ranks, [str(n) for n in ranks])  # the swept counts, not log-scale minor labels
        ax.minorticks_off()
        ax.legend()
        ax.grid(alpha=0.3)
        fig.savefig(out / fname, dpi=120)
        files.append(out / fname)
    return files
