"""Checkpoint fuzz: random byte flips and truncations over a saved checkpoint, then load it.

A GPT checkpoint (params + AdamW moments) is saved by 2 ranks; each trial corrupts one file
of it (a file picked uniformly, so the small hpf.json and .metadata are hit as often as the
tensor files): a random bit of a random byte flipped (3 trials in 4) or the file truncated at a
random length. Then ``hpf.checkpoint.load_params`` and ``step.restore`` (1 rank) each must
raise ``CheckpointError`` naming the corrupted file, or return exactly the uncorrupted values
(a load verifies the bytes it reads: load_params reads no optimizer state, so a flip there is
found by restore, not by it); the file is put back after the trial.
Printed: counts per outcome and load, and RATIOs of silent loads, of errors that do not name the
file, and of restores that were not refused (each target 0: restore reads every byte).
Outcomes: named (CheckpointError naming the file), unnamed (a CheckpointError that does not
name it), other (another exception), unaffected (no error, every value exactly as saved: the
corrupt bytes are ones this load does not read), silent (no error, some value changed).
Usage: python benchmarks/checkpoint_fuzz.py [--config small] [--trials 200] [--seed 0] [--quick]
"""
from __future__ import annotations

import argparse
import collections
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import optree
import torch

import hpf
from hpf import checkpoint
from hpf.launcher import launch
from hpf.models import gpt

from common import print_table, report_ratio


def _step(config):
    return hpf.shard_step(gpt.loss_for(config), mesh=hpf.Mesh({"dp": hpf.launch.world_size()}),
                          optimizer=hpf.optim.adamw())


def _save(rank, config_name, path):
    config = gpt.CONFIGS[config_name]
    step = _step(config)
    state = step.init(gpt.init(config))
    state, _ = step(state, gpt.global_batch(config, 4, 0, 0)[rank * 2:(rank + 1) * 2])
    step.save(state, path, extra={"step": 1, "rng": checkpoint.rng_state()})


def corrupt(path: Path, rng: random.Random) -> tuple[Path, bytes, str]:
    """Corrupt one file of checkpoint ``path``; returns (file, its original bytes, what was done)."""
    target = rng.choice(sorted(p for p in path.iterdir() if p.is_file()))
    data = target.read_bytes()
    if rng.random() < 0.75 and data:
        at, bit = rng.randrange(len(data)), rng.randrange(8)
        target.write_bytes(data[:at] + bytes([data[at] ^ (1 << bit)]) + data[at + 1:])
        return target, data, f"flip bit {bit} of byte {at}"
    cut = rng.randrange(len(data)) if data else 0
    target.write_bytes(data[:cut])
    return target, data, f"truncate to {cut} of {len(data)} bytes"


def same(a, b) -> bool:
    """Bitwise equal trees of tensors, arrays and plain values."""
    la, lb = optree.tree_leaves(a, none_is_leaf=True), optree.tree_leaves(b, none_is_leaf=True)
    return len(la) == len(lb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else np.array_equal(x, y) if isinstance(x, np.ndarray)
        else x == y for x, y in zip(la, lb))


def outcome(load, target: Path, pristine) -> str:
    try:
        got = load()
    except checkpoint.CheckpointError as e:
        return "named" if target.name in str(e) else "unnamed"
    except Exception:  # noqa: BLE001 -- counted: a corrupt file must be a CheckpointError
        return "other"
    return "unaffected" if same(got, pristine) else "silent"


def fuzz(path: Path, config, trials: int, seed: int) -> collections.Counter:
    step = _step(config)
    step.init(gpt.init(config, device="meta"))
    loads = {"load_params": lambda: checkpoint.load_params(path), "restore": lambda: step.restore(path)}
    pristine = {name: load() for name, load in loads.items()}
    rng = random.Random(seed)
    counts: collections.Counter = collections.Counter()
    for i in range(trials):
        target, original, what = corrupt(path, rng)
        try:
            for name, load in loads.items():
                result = outcome(load, target, pristine[name])
                counts[name, result] += 1
                if result not in ("named", "unaffected"):
                    print(f"trial {i}: {target.name} {what}: {name} -> {result}")
        finally:
            target.write_bytes(original)
    return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="small", choices=sorted(gpt.CONFIGS))
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="the tiny config, 20 corruptions")
    args = ap.parse_args()
    if args.quick:
        args.config, args.trials = "tiny", 20
    root = Path(tempfile.mkdtemp(prefix="hpf-ckpt-fuzz-"))
    try:
        path = root / "step_1"
        launch(_save, 2, args.config, str(path), timeout=600)
        counts = fuzz(path, gpt.CONFIGS[args.config], args.trials, args.seed)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    kinds = ("named", "unnamed", "other", "unaffected", "silent")
    print(f"GPT {args.config!r} checkpoint from 2 ranks, {args.trials} corruptions, each followed by load_params "
          "and restore")
    print_table(("outcome", "load_params", "restore"),
                [(k, counts.get(("load_params", k), 0), counts.get(("restore", k), 0)) for k in kinds])
    report_ratio("checkpoint_fuzz_silent_loads", float(sum(n for (_, k), n in counts.items() if k == "silent")), "<=0")
    report_ratio("checkpoint_fuzz_errors_not_named",
                 float(sum(n for (_, k), n in counts.items() if k in ("unnamed", "other"))), "<=0")
    report_ratio("checkpoint_fuzz_restores_not_refused",
                 float(args.trials - counts.get(("restore", "named"), 0)), "<=0")

if __name__ == "__main__":
    main()
