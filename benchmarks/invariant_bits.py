"""The same bits at any scale, measured: SHA-256 digests of a run's losses, final params and
optimizer state under every layout the invariant mode covers, in one table.

Each row trains the model from the same key on the same global batches (``--batch`` sequences,
atoms of ``--atom`` sequences) for ``--steps`` steps with clipping, and prints the digests of
its losses, its final full params and its optimizer state (gathered whole, so meshes compare).
Rows of one precision must agree; the script exits non-zero where they do not.
Usage: python benchmarks/invariant_bits.py [--model gpt|llama] [--optimizer adamw|muon] [--steps 50]
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import torch

import hpf
from hpf.launcher import launch
from hpf.models import gpt, llama

from common import print_table, report_ratio

MODELS = {"gpt": gpt, "llama": llama}
# name -> (mesh axes, shard_step options)
ROWS = {
    "world 1": ({"dp": 1}, {}),
    "world 2": ({"dp": 2}, {}),
    "world 3": ({"dp": 3}, {}),
    "world 4": ({"dp": 4}, {}),
    "node=2,local=2 flat": ({"node": 2, "local": 2}, {}),
    "node=2,local=2 two-tier": ({"node": 2, "local": 2}, {"topology": "two-tier"}),
    "node=2,local=2 HSDP": ({"node": 2, "local": 2}, {"hsdp": True}),
    "world 4 accumulate 2": ({"dp": 4}, {"accumulate": 2}),
    "world 2 accumulate 4": ({"dp": 2}, {"accumulate": 4}),
    "world 2 recompute all": ({"dp": 2}, {"recompute": "all"}),
    "world 2 torch.func": ({"dp": 2}, {"grad": "torch.func", "recompute": "all"}),
    "world 4 torchrun": ({"dp": 4}, {"torchrun": True}),
    "bf16 world 1": ({"dp": 1}, {"mixed_precision": "bf16"}),
    "bf16 world 4": ({"dp": 4}, {"mixed_precision": "bf16"}),
}


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def make_step(args, mesh, options):
    module = MODELS[args.model]
    config = module.CONFIGS[args.config]
    options = {k: v for k, v in options.items() if k != "torchrun"}
    recompute = options.pop("recompute", "none")
    if options.pop("topology", None):
        options["topology"] = hpf.Topology()
    opt = hpf.optim.muon(lr=1e-2) if args.optimizer == "muon" else hpf.optim.adamw(lr=3e-3, weight_decay=0.1)
    step = hpf.shard_step(module.loss_for(config, recompute=recompute), mesh=mesh, optimizer=opt, invariant=True,
                          atom_size=args.atom, max_grad_norm=1.0, **options)
    return step, functools.partial(module.init, config), config


def rank_main(rank, args, axes, options, folder):
    """Train, and save the final state to ``folder`` (its optimizer state is digested on one rank)."""
    torch.set_num_threads(1)
    mesh = hpf.Mesh(axes)
    step, init, config = make_step(args, mesh, options)
    rows = args.batch // mesh.size
    with step:
        state = step.init(init, key=hpf.random.key(0))
        losses = []
        for s in range(args.steps):
            batch = gpt.global_batch(config, args.batch, 0, s)[rank * rows:(rank + 1) * rows]
            state, m = step(state, batch)
            losses.append(m["loss"])
        full = hpf.tree.flatten(step.full_params(state))[1]
        step.save(state, folder)
    return {"losses": digest([torch.tensor(losses, dtype=torch.float64)]), "params": digest(full),
            "last_loss": losses[-1]}


def opt_state_digest(args, folder) -> str:
    """The optimizer state of a saved run, restored whole onto one rank (the checkpoint's resharding)."""
    step, init, _ = make_step(args, hpf.Mesh({"dp": 1}), {})
    with step:
        step.init(init, key=hpf.random.key(0))
        state, _ = step.restore(folder)
        return digest([x for x in hpf.tree.flatten(state.opt_state)[1] if isinstance(x, torch.Tensor)])


def run_row(args, name):
    axes, options = ROWS[name]
    world = 1
    for v in axes.values():
        world *= v
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "final")
        if options.get("torchrun"):
            got = torchrun_row(args, name, world, tmp, folder)
        elif world == 1:
            got = rank_main(0, args, axes, options, folder)
        else:
            got = launch(rank_main, world, args, axes, options, folder, timeout=3600)[0]
        return {**got, "opt_state": opt_state_digest(args, folder)}


def torchrun_row(args, name, world, tmp, folder):
    out = os.path.join(tmp, "row.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", __file__,
           "--child", name, "--child-out", out, "--child-folder", folder] + _own_args(args)
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(out) as f:
        return json.load(f)


def _own_args(args) -> list[str]:
    return ["--model", args.model, "--config", args.config, "--optimizer", args.optimizer, "--steps", str(args.steps),
            "--batch", str(args.batch), "--atom", str(args.atom)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt", choices=sorted(MODELS))
    ap.add_argument("--config", default="small")
    ap.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=12, help="global batch in sequences (12: worlds 1, 2, 3 and 4)")
    ap.add_argument("--atom", type=int, default=1, help="sequences per atom")
    ap.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    ap.add_argument("--quick", action="store_true", help="tiny config, 3 steps: a check of the script")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--child-folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.config, args.steps = "tiny", 3
    if args.child:  # one torchrun rank of a row
        axes, options = ROWS[args.child]
        rank = int(os.environ["RANK"])
        got = rank_main(rank, args, axes, options, args.child_folder)
        if rank == 0:
            with open(args.child_out, "w") as f:
                json.dump(got, f)
        return
    names = [n for n in ROWS if not args.rows or n in args.rows.split(",")]
    print(f"{args.model} {args.config}, {args.optimizer} with clipping, {args.steps} steps, global batch {args.batch} "
          f"in atoms of {args.atom}")
    got = {}
    for name in names:
        got[name] = run_row(args, name)
        print(f"  {name}: {got[name]}", flush=True)
    print_table(["row", "losses", "params", "optimizer state", "last loss"],
                [[n, r["losses"], r["params"], r["opt_state"], f"{r['last_loss']:.8f}"] for n, r in got.items()])
    groups = {}
    for n, r in got.items():
        groups.setdefault(n.startswith("bf16"), set()).add((r["losses"], r["params"], r["opt_state"]))
    distinct = max(len(g) for g in groups.values())
    report_ratio("distinct_digests_per_precision", float(distinct), "<=1")
    if distinct > 1:
        raise SystemExit("the rows of one precision disagree: the invariant mode's promise is broken")


if __name__ == "__main__":
    main()
