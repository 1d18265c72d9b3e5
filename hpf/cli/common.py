"""What every ``hpf`` subcommand shares: one-line errors, argument types, the mesh and the
options that describe a job (config, mesh, precision, topology, optimizer)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import hpf
from hpf.cli.command import CliError, Parser
from hpf.launcher import is_launched, world_size
from hpf.models import MODELS, TP_AXIS, data_axes, has_experts, mesh_for, specs_for, tp_size
from hpf import jobspec
from hpf.jobspec import add_arguments, positive

DEFAULT_MESH = {"node": 2, "local": 2}  # 2 "hosts" x 2 local ranks: exercises both tiers


# ------------------------------------------------------------------ argument types

def parse_mesh(text: str) -> dict[str, int]:
    """``"node=2,local=2"`` -> ``{"node": 2, "local": 2}`` (outer to inner, as hpf.Mesh takes)."""
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = (s.strip() for s in part.partition("="))
        if not sep or not name or not size.isdigit():
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a mesh; write name=size pairs, outer to inner, e.g. node=2,local=2")
        if int(size) < 1:
            raise argparse.ArgumentTypeError(f"{text!r} gives axis {name!r} size {int(size)}; sizes must be >= 1")
        if name in axes:
            raise argparse.ArgumentTypeError(f"{text!r} names axis {name!r} twice")
        axes[name] = int(size)
    return axes


def write_atomic(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file beside it, then a rename, so an
    interrupted write (Ctrl-C, a kill) never leaves an empty or partial file at ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ------------------------------------------------------------------ shared: mesh and optional parts

def mesh_of(args) -> hpf.Mesh:
    axes = args.mesh or ({"dp": args.world_size} if args.world_size else default_axes())
    mesh = mesh_for(axes)  # (node=2,local=2,tp=2: tp shares the fast tier with local)
    if args.world_size is not None and mesh.size != args.world_size:
        raise CliError(f"--mesh {mesh_text(axes)} has {mesh.size} ranks but --world-size is "
                       f"{args.world_size}; make them agree or give only one")
    return mesh


def default_axes() -> dict[str, int]:
    """2 x 2 locally; under torchrun, the machines it started: node x local ranks per machine."""
    if not is_launched():
        return DEFAULT_MESH
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))
    return {"node": world_size() // local, "local": local} if world_size() > local else {"dp": local}


def mesh_text(axes) -> str:
    return ",".join(f"{a}={n}" for a, n in axes.items())




def sharding_of(model: str, config, mesh: hpf.Mesh, fsdp_axes, ep_axis: str | None) -> dict:
    """shard_step's ``param_specs`` and ``fsdp_axes`` for --model: a mesh axis named ``tp`` runs
    gpt and llama tensor parallel over it, moe's attention (FSDP over the others); a model with
    experts (moe) places them on --ep-axis; the others shard every param over the FSDP axes."""
    module = MODELS[model]
    check_ep_axis(model, ep_axis)
    if TP_AXIS in mesh.axis_names:
        data = tuple(fsdp_axes or data_axes(mesh.axis_names))
        if TP_AXIS in data:
            raise CliError(f"--mesh {mesh_text(dict(zip(mesh.axis_names, mesh.shape)))}: the axis {TP_AXIS} runs tensor "
                           "parallelism and is no FSDP axis; leave it out of --fsdp-axes")
        if ep_axis is not None and ep_axis not in data:
            raise CliError(f"--ep-axis {ep_axis} is not one of the data axes ({', '.join(data)}) of --mesh "
                           f"{mesh_text(dict(zip(mesh.axis_names, mesh.shape)))}: expert parallelism borrows a data axis")
        try:
            specs = specs_for(module, config, ep_axis, data, TP_AXIS, tp_size(mesh))
        except ValueError as e:
            raise CliError(f"--mesh {mesh_text(dict(zip(mesh.axis_names, mesh.shape)))}: {e}") from None
        return {"param_specs": specs, "fsdp_axes": data}
    if not has_experts(module):
        return {"param_specs": None, "fsdp_axes": fsdp_axes}
    data = tuple(fsdp_axes or mesh.axis_names)
    if ep_axis is not None and ep_axis not in data:
        raise CliError(f"--ep-axis {ep_axis} is not one of the FSDP axes ({', '.join(data)}) of --mesh "
                       f"{mesh_text(dict(zip(mesh.axis_names, mesh.shape)))}: expert parallelism borrows a data axis")
    return {"param_specs": specs_for(module, config, ep_axis, data), "fsdp_axes": data}


def check_ep_axis(model: str, ep_axis: str | None) -> None:
    """--ep-axis names a model with experts."""
    if ep_axis is not None and not has_experts(MODELS[model]):
        raise CliError(f"--ep-axis {ep_axis}: --model {model} has no experts; use --model moe")


def only_searched(slow: str | None) -> None:
    """``--slow-precision auto`` outside a plan search: a one-line error."""
    if slow == "auto":
        raise CliError("--slow-precision auto lets the plan search choose the slow tier's precision: use it with "
                       "hpf plan --search or hpf train --plan auto, or give a precision (e.g. int8,int4)")


def topology_of(job) -> hpf.Topology | None:
    """--topology, --bucket-bytes and --slow-precision (of parsed flags or a TrainJob) as shard_step's
    ``topology`` (hpf.jobspec.step_topology), a mistake as one line."""
    only_searched(job.slow_precision)
    try:
        return jobspec.step_topology(job)
    except ValueError as e:
        raise CliError(str(e)) from None


def job_parser(command: str, *, resumable: bool = False, own: dict[str, dict] | None = None) -> Parser:
    """The parent parser of ``command`` (train, plan, simulate): the mesh, then the options hpf.jobspec
    declares for it (their defaults, help and types are there; ``own``: see add_arguments)."""
    job = Parser(add_help=False)
    job.add_argument("--world-size", type=positive(int), metavar="N",
                     help="number of ranks; alone it gives a 1-D mesh dp=N (default: 4 as node=2,local=2)")
    job.add_argument("--mesh", type=parse_mesh, metavar="AXES",
                     help="named mesh axes, outer to inner; the last one is the fast tier (default: "
                          "node=2,local=2; under torchrun node=<machines>,local=<ranks per machine>)")
    add_arguments(job, command, resumable=resumable, own=own)
    return job
