"""``hpf plan``: per-rank memory and communication of any config on any mesh, from meta tensors."""
from __future__ import annotations

import dataclasses

import torch

import hpf
from hpf.cli.common import CliError, job_parser, mesh_of, mesh_text, sharding_of, topology_of
from hpf.jobspec import inputs
from hpf.cli.search import add_options as add_search_options, cmd_search
from hpf.models import TP_AXIS, has_experts, model_config, spec_of
from hpf.memory import predict, state_report
from hpf.report import PlanReport, fixed, millions
from hpf.planning import step_plan
from hpf.precision import MixedPrecision


# hpf plan's --batch-size: the batch the search searches for, else the one the predicted peak assumes
BATCH_SIZE_FLAG = dict(default=None, shown="one per rank", help="the global batch in sequences, split evenly over the "
                       "ranks that read data (a tensor-parallel group reads one share): the one --search searches "
                       "for, else the one the predicted peak assumes")


def plan_of(args, mesh: hpf.Mesh, fast_major: bool = False) -> hpf.Plan:
    """The plan shard_step makes for these arguments, from meta tensors (shapes only);
    ``fast_major``: with ``Topology(fast_major=True)``'s shard order."""
    module, config = model_config(args.model, args.config)
    return step_plan(spec_of(module).init(config, device="meta"), mesh, **plan_arguments(args, mesh, config, fast_major))


def plan_arguments(args, mesh: hpf.Mesh, config, fast_major: bool = False) -> dict:
    """shard_step's plan arguments for this job (sharding, topology, hsdp): ``hpf plan`` prints
    and ``--check`` checks the plan of these."""
    topology = topology_of(args)
    if fast_major:
        topology = dataclasses.replace(topology, fast_major=True)
    return {**sharding_of(args.model, config, mesh, args.fsdp_axes, args.ep_axis), "topology": topology,
            "hsdp": args.hsdp}


def muon_by_order(args, mesh: hpf.Mesh, plan: hpf.Plan) -> str:
    """Muon's bytes per tier with shards numbered node-major (``plan``) and fast-major."""
    from hpf.optim.muon_owners import muon_traffic

    def mib(p):
        total, slow = muon_traffic(hpf.optim.muon(), p)
        return f"{(total - slow) / 2**20:,.2f} MiB fast, {slow / 2**20:,.2f} MiB slow"
    return (f"Muon's pieces per step, all ranks: {mib(plan)} with shards numbered node-major (the default); "
            f"{mib(plan_of(args, mesh, fast_major=True))} fast-major (Topology(fast_major=True))")


def report_of(args, plan: hpf.Plan) -> tuple[PlanReport, str]:
    """The plan report for these arguments, its optimizer state counted for --optimizer, and a
    line that says what that state is."""
    return state_report(plan, args.mixed_precision, args.optimizer, hierarchical=args.topology == "two-tier",
                        cpu=not torch.accelerator.is_available())  # (the ranks hpf train starts here)


def report_dtype_bytes(args) -> int:
    """Bytes per element of activations moved in compute: the compute dtype (fp32 without --mixed-precision)."""
    mp = MixedPrecision.parse(args.mixed_precision)
    return torch.finfo(mp.compute_dtype if mp else torch.float32).bits // 8


def readers_batch(args, plan: hpf.Plan) -> tuple[int, int]:
    """(ranks that read their own share of the batch, the global batch): a tensor-parallel group
    reads one share; --batch-size, or one sequence per reader."""
    readers = plan.mesh.size // plan.compute_size
    return readers, args.batch_size or readers


def tp_bytes(module, config, plan: hpf.Plan, args) -> str:
    """The tensor-parallel traffic per rank and step: each block's psums forward and backward, and
    the partial grads of the params replicated over the tp axes, all-reduced once."""
    readers, batch = readers_batch(args, plan)
    p = plan.compute_size
    ring = 2 * (p - 1) / p  # what one rank sends in a ring all-reduce, per byte of the buffer
    unit_psums = spec_of(module).need("unit_psums", "hpf plan's tensor-parallel sums need")
    psums = sum(sum(v) for v in unit_psums(config, batch // readers, report_dtype_bytes(args)).values())
    partial = sum(n * 4 for b in plan.buckets for n in plan.partial_numel(b).values())
    tier = "fast" if set(plan.compute_axes) <= set(plan.mesh.fast_axes) else "slow"
    return (f"  {'all_reduce (TP)':<16}  {fixed(2 * ring * psums / 2**20):>12} MiB on the {tier} tier: each block's "
            f"psums forward and backward ({batch // readers} sequences per tp group), and "
            f"{fixed(ring * partial / 2**20)} MiB of partial grads of the params replicated over "
            f"{','.join(plan.compute_axes)}")


def peak_line(module, config, plan: hpf.Plan, report: PlanReport, args) -> str:
    """hpf.memory's predicted peak per rank for this job run here (CPU ranks without an accelerator)."""
    readers, batch = readers_batch(args, plan)
    cpu = not torch.accelerator.is_available()
    mem = predict(module, config, plan, report, local_batch=batch // readers, cpu=cpu, **inputs(args, "memory"))
    return (f"predicted peak per rank, global batch {batch} ({batch // readers} sequences per "
            f"{'tp group' if plan.compute_size > 1 else 'rank'}), on {'CPU' if cpu else 'accelerator'} ranks: "
            f"{mem.format()}")


def cmd_plan(args) -> int:
    module, config = model_config(args.model, args.config)
    mesh = mesh_of(args)
    if args.search:
        return cmd_search(args, mesh)
    plan = plan_of(args, mesh)
    report, state = report_of(args, plan)
    print(f"{args.model} {args.config!r}: {millions(spec_of(module).num_params(config))} params in {len(plan.slots)} tensors, "
          f"{len(plan.units)} FSDP units, {len(plan.buckets)} flat buckets")
    print(f"mesh {mesh_text(dict(zip(mesh.axis_names, mesh.shape)))} ({mesh.size} ranks); "
          f"FSDP axes {','.join(plan.fsdp_axes) or '-'}; "
          + (f"tensor parallel over {','.join(plan.compute_axes)} (heads and MLP columns split, never gathered "
             "there); " if plan.compute_size > 1 else "") + f"fast tier {','.join(mesh.fast_axes)}; "
          f"{args.topology} collectives{', HSDP' if args.hsdp else ''}; precision {args.mixed_precision or 'fp32'}")
    print(state)
    if args.optimizer == "muon" and args.topology == "two-tier":
        print(muon_by_order(args, mesh, plan))
    print(report.format())
    if plan.compute_size > 1:
        print(tp_bytes(module, config, plan, args))
    print(peak_line(module, config, plan, report, args))
    if spec_of(module).dispatch_bytes:  # MoE token all-to-alls: 0 without --ep-axis
        ep = mesh.axis_size(args.ep_axis) if args.ep_axis else 1
        a2a = spec_of(module).dispatch_bytes(config, ep, config.seq_len, dtype_bytes=report_dtype_bytes(args))
        tiers = {"fast": a2a, "slow": 0} if args.ep_axis in mesh.fast_axes else {"fast": 0, "slow": a2a}
        print(f"  {'all_to_all (MoE)':<16}  {fixed(tiers['fast'] / 2**20):>12} MiB   {fixed(tiers['slow'] / 2**20):>12} MiB   "
              f"(one {config.seq_len}-token sequence per rank, uniform routing, ep={ep} over {args.ep_axis or '-'})")
    model = "" if args.model == "gpt" else f"--model {args.model} "
    ep = f" --ep-axis {args.ep_axis}" if args.ep_axis else ""
    print(f"predicted step time, exposed communication and tokens/s, hpf vs FSDP2 vs Megatron DDP: "
          f"hpf simulate {model}--config {args.config} --mesh {mesh_text(dict(zip(mesh.axis_names, mesh.shape)))}"
          f"{ep} --hardware cloudmatrix384 (or h100, or a calibration file)")
    if args.check and has_experts(module):  # a model with experts routes on values
        raise CliError(f"--check runs on meta tensors, which cannot route --model {args.model}'s tokens (routing "
                       "depends on values); validate it with hpf train --mode validate on a small mesh instead")
    if args.check:
        one_sequence = torch.empty(1, config.seq_len + 1, dtype=torch.int64, device="meta")
        loss_fn = spec_of(module).loss(config, **({"tp_axis": TP_AXIS} if TP_AXIS in mesh.axis_names else {}))
        checked = hpf.check_plan(loss_fn, spec_of(module).init(config, device="meta"), mesh, one_sequence,
                                 mixed_precision=args.mixed_precision, **plan_arguments(args, mesh, config))
        if args.optimizer == "muon":  # (what Muon refuses of a plan it refuses when bound to it, as the step binds it)
            try:
                hpf.optim.muon().for_plan(checked.plan, checked.rank)
            except ValueError as e:
                raise CliError(f"--check: the plan's layouts hold, but --optimizer muon refuses it: {e}") from None
        print(checked)
    return 0


def add_parser(sub, help_: str):
    plan = sub.add_parser(
        "plan", parents=[job_parser("plan", own={"batch_size": BATCH_SIZE_FLAG})], help=help_,
        description="Print the plan report of a GPT config on a virtual mesh of any size, from meta "
                    "tensors; starts no process. Example: hpf plan --config 1b --mesh node=96,local=8 "
                    "(also how to size a config too big to train here)")
    plan.add_argument("--check", action="store_true",
                      help="also run validation mode for rank 0's view of the mesh on meta tensors "
                           "(hpf.check_plan): layouts and shapes of the whole step, forward and backward")
    add_search_options(plan, train=False)
    plan.set_defaults(run=cmd_plan)
    return plan
