"""Issue 57: a rank SIGKILLed mid-run, survived in memory (hpf train --elastic), side by side with a
checkpoint restart (hpf train --save-every 10, then --resume), on the same kills.

GPT small, 4 ranks, 50 steps, --invariant (the same bits at any world size), batch 12 (it splits
over 4 and 3 ranks). Each kill is a SIGKILL of one rank process, sent from outside once step k's
line is in metrics.jsonl and a random part of a step later (so step k + 1 is in flight on some
ranks; the killed one may still be finishing step k), k and the rank drawn at random (seeded):
  elastic  one run goes on on the ranks left (with --grow, a replacement joins: 3 -> 4). Reported:
           exit code, the finished steps the survivors redo (0: the killed rank had copied step
           k; 1: it died before finishing or copying it, so step k was still in flight for the
           job), seconds from the kill to the first step finished after the state was rebuilt,
           total wall, and whether the final params' SHA-256 equals the uninterrupted run's.
  restart  the kill ends the job; --resume goes on from the last checkpoint. Reported: total wall
           of both runs, steps recomputed, and the same SHA check.
Then the cost without failures: --elastic against plain hpf train, interleaved over rounds, the
median per-step time (step_s + copy_s, the boundary's copy to the buddy, against step_s), and
the memory the copies take per rank.
Without --invariant (--default-kills of the kills): the final params against an uninterrupted run
that changes mesh at the step the elastic one went back to (its max |difference|).
With --torchrun only the elastic kills run, as one torchrun per member around hpf store (docs/elastic.md):
the killed member's torchrun (--max-restarts 0) reports its worker's death, the others exit 0;
a grow is --max-restarts 1, whose restarted worker joins.
With --hsdp every run is HSDP on 2 x 2 where the world is even: the replicas are the copies.
Usage: python benchmarks/elastic.py [--config small] [--kills 5] [--grow 2] [--rounds 3] [--hsdp] [--torchrun] [--quick]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import print_table, report_ratio

WORLD, BATCH = 4, 12


def _train(out: Path, args, *extra: str, invariant: bool = True, world: int = WORLD) -> list[str]:
    hsdp = args.hsdp and world % 2 == 0  # (a plain run's HSDP mesh is named; --elastic --hsdp makes its own)
    size = ["--mesh", f"node=2,local={world // 2}"] if hsdp and "--elastic" not in extra else ["--world-size", str(world)]
    return [sys.executable, "-m", "hpf", "train", "--config", args.config, "--steps", str(args.steps), *size,
            "--batch-size", str(BATCH), *(["--invariant", "--atom-size", "1"] if invariant else []),
            *(["--hsdp"] if hsdp else []), "--out", str(out), *extra]


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _ranks(pid: int) -> dict[int, int]:
    """rank -> pid of the rank processes the hpf train driver forked (hpf.launch names them hpf-rank<r>)."""
    kids = [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    names = {k: Path(f"/proc/{k}/comm").read_text().strip() for k in kids}
    return {int(n.removeprefix("hpf-rank")): k for k, n in names.items() if n.startswith("hpf-rank")}


def run(cmd: list[str], out: Path, kill: tuple[int, int] | None = None) -> dict:
    """Run ``cmd``; with ``kill`` = (step, rank): SIGKILL that rank once the step's line is written."""
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed_at, done_at_kill = _kill_at(out, kill, lambda: proc.poll() is None, lambda r: _ranks(proc.pid)[r])
    text = proc.communicate()[0]
    if kill and killed_at is None:
        raise SystemExit(f"the run ended before step {kill[0]}, where rank {kill[1]} was to be killed:\n{text[-2000:]}")
    return {"rc": proc.returncode, "wall_s": time.time() - started, "killed_at": killed_at, "done_at_kill": done_at_kill,
            "text": text}


def _kill_at(out: Path, kill: tuple[int, int] | None, running, pid_of) -> tuple[float | None, int | None]:
    """SIGKILL rank ``kill[1]`` (``pid_of`` it) at a random point of the step after ``kill[0]``'s line:
    (when, the steps then finished)."""
    while kill and running():
        done = _records(out)
        if done and done[-1]["step"] >= kill[0]:
            time.sleep(random.Random(kill[0]).uniform(0, done[-1]["step_s"]))  # at a random point of the next step
            os.kill(pid_of(kill[1]), signal.SIGKILL)
            return time.time(), max(r["step"] for r in _records(out))
        time.sleep(0.01)
    return None, None


def run_torchrun(cmd: list[str], out: Path, kill: tuple[int, int], restarts: int) -> dict:
    """``cmd`` (hpf train --elastic) as one torchrun per member around hpf store (docs/elastic.md), each
    ``--max-restarts restarts``; SIGKILL member ``kill[1]``'s worker. rc: the worst of the members that
    were not killed (the killed one's torchrun reports its worker's death unless it restarts it)."""
    started = time.time()
    store = subprocess.Popen([sys.executable, "-m", "hpf", "store", "--port", "0"], stdout=subprocess.PIPE, text=True)
    env = {**os.environ, "HPF_ELASTIC_STORE": "127.0.0.1:" + re.search(r":(\d+);", store.stdout.readline()).group(1)}
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
                                "--max-restarts", str(restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                "127.0.0.1:0", "--rdzv-id", f"member{m}", "-m", "hpf", *cmd[3:]],
                               env={**env, "HPF_ELASTIC_MEMBER": str(m)}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for m in range(WORLD)]
    worker = lambda m: int(Path(f"/proc/{agents[m].pid}/task/{agents[m].pid}/children").read_text().split()[0])
    killed_at, done_at_kill = _kill_at(out, kill, lambda: all(a.poll() is None for a in agents), worker)
    texts = [a.communicate()[0] for a in agents]
    try:
        store.wait(timeout=30)  # (it exits once the job finished)
    except subprocess.TimeoutExpired:
        store.kill()
        raise SystemExit("hpf store did not exit: the job did not finish\n" + "\n".join(t[-1500:] for t in texts))
    if killed_at is None:
        raise SystemExit(f"the run ended before step {kill[0]}:\n{texts[0][-2000:]}")
    codes = [a.returncode for m, a in enumerate(agents) if restarts or m != kill[1]]
    return {"rc": max(codes, key=abs), "killed_rc": agents[kill[1]].returncode, "wall_s": time.time() - started,
            "killed_at": killed_at, "done_at_kill": done_at_kill, "text": "\n".join(texts)}


def _params(out: Path, steps: int) -> list:
    from hpf import checkpoint, tree

    return tree.flatten(checkpoint.load_params(out / "checkpoints" / f"step_{steps:06d}"))[1]


def params_sha(out: Path, steps: int) -> str:
    import torch

    leaves = _params(out, steps)
    h = hashlib.sha256()
    for x in leaves:
        h.update(x.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def elastic_kill(args, root: Path, k: int, rank: int, grow: bool, reference: str) -> dict:
    out = root / f"elastic-{k}-{rank}-{int(grow)}"
    if args.torchrun:
        r = run_torchrun(_train(out, args, "--elastic"), out, (k, rank), restarts=int(grow))
    else:
        r = run(_train(out, args, "--elastic", *(["--replacements", "1"] if grow else [])), out, (k, rank))
    if r["rc"]:
        raise SystemExit(f"elastic run failed (rc {r['rc']}):\n{r['text'][-3000:]}")
    run_json = json.loads((out / "run.json").read_text())
    lost = [e for e in run_json["elastic"]["events"] if e["event"] == "lost"][0]
    after = [x["time"] for x in _records(out) if x["time"] > lost["time"]]
    return {"k": k, "rank": rank, "rc": r["rc"], "wall_s": r["wall_s"], "redone": lost["at_step"] - lost["back_to"],
            "kill_to_step_s": min(after) - r["killed_at"], "rebuild_s": lost["seconds"],
            "world_at_end": run_json["elastic"]["world_size"], "same_bits": params_sha(out, args.steps) == reference,
            "mib_received": lost["bytes_received"] / 2**20, "killed_rc": r.get("killed_rc", "-")}


def restart_kill(args, root: Path, k: int, rank: int, reference: str) -> dict:
    out = root / f"restart-{k}-{rank}"
    first = run(_train(out, args, "--save-every", "10"), out, (k, rank))
    if first["rc"] == 0:
        raise SystemExit(f"the kill did not end the plain run:\n{first['text'][-2000:]}")
    second = run(_train(out, args, "--resume"), out)
    if second["rc"]:
        raise SystemExit(f"--resume failed (rc {second['rc']}):\n{second['text'][-3000:]}")
    found = re.search(r"resuming from \S*step_(\d+)", second["text"])
    resumed_from = int(found.group(1)) if found else 0  # (killed before the first checkpoint: from the start)
    return {"k": k, "rank": rank, "wall_s": first["wall_s"] + second["wall_s"], "first_rc": first["rc"],
            "recomputed": first["done_at_kill"] - resumed_from, "same_bits": params_sha(out, args.steps) == reference}


def default_mode(args, root: Path, kills: list[tuple[int, int]]) -> list[dict]:
    """Without --invariant: each kill's elastic run against an uninterrupted run that changes mesh
    (4 -> 3 ranks) at the step the elastic one went back to (a 4-rank run saving every step, resumed
    from that step's checkpoint on 3 ranks)."""
    full = root / "default-4"
    if run(_train(full, args, "--save-every", "1", "--keep-last", str(args.steps + 1), invariant=False), full)["rc"]:
        raise SystemExit("the default-mode 4-rank run failed")
    rows = []
    for k, rank in kills:
        out = root / f"default-elastic-{k}-{rank}"
        if run(_train(out, args, "--elastic", invariant=False), out, (k, rank))["rc"]:
            raise SystemExit("a default-mode elastic run failed")
        back = json.loads((out / "run.json").read_text())["elastic"]["events"][0]["back_to"]
        ref = root / f"default-3-from-{back}"
        if run(_train(ref, args, "--resume", str(full / "checkpoints" / f"step_{back:06d}"), invariant=False,
                      world=WORLD - 1), ref)["rc"]:
            raise SystemExit("the resumed 3-rank reference failed")
        diff = max(float((a - b).abs().max()) for a, b in zip(_params(out, args.steps), _params(ref, args.steps)))
        rows.append({"k": k, "rank": rank, "back_to": back, "max_abs_diff": diff})
    return rows


def cost(args, root: Path) -> dict:
    """Per-step time with the copies and without (plain hpf train), interleaved over rounds."""
    times: dict[str, list[float]] = {"elastic": [], "plain": []}
    copy_bytes = None
    for i in range(args.rounds):
        for name in (["elastic", "plain"] if i % 2 == 0 else ["plain", "elastic"]):
            out = root / f"cost-{name}-{i}"
            r = run(_train(out, args, *(["--elastic"] if name == "elastic" else [])), out)
            if r["rc"]:
                raise SystemExit(f"{name} run failed:\n{r['text'][-3000:]}")
            recs = _records(out)[2:]  # the first steps warm up
            times[name].append(statistics.median(x["step_s"] + x.get("copy_s", 0.0) for x in recs))
            if name == "elastic":
                copy_bytes = json.loads((out / "run.json").read_text())["elastic"]["copy_bytes"]
    params = sum(x.numel() * x.element_size() for x in _params(root / "cost-elastic-0", args.steps))
    state_bytes = 3 * params / (WORLD // 2 if args.hsdp else WORLD)  # a rank's shard of the params and AdamW's moments
    return {"elastic_ms": 1e3 * statistics.median(times["elastic"]), "plain_ms": 1e3 * statistics.median(times["plain"]),
            "copy_mib_per_rank": copy_bytes / 2**20, "shard_state_mib": state_bytes / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="small")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--grow", type=int, default=2, help="kills with a replacement that joins (elastic only)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--default-kills", type=int, default=2, help="kills rerun without --invariant, against a run "
                    "that changes mesh at the same step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hsdp", action="store_true", help="every run HSDP on 2 x 2 (the replicas are the copies; "
                    "3 ranks after a loss run FSDP)")
    ap.add_argument("--torchrun", action="store_true", help="only the elastic kills, each member under a torchrun "
                    "of its own around hpf store (a grow: --max-restarts 1)")
    ap.add_argument("--quick", action="store_true", help="tiny config, 30 steps, 2 kills, 1 grow, 1 round")
    args = ap.parse_args()
    if args.quick:
        args.config, args.steps, args.kills, args.grow, args.rounds, args.default_kills = "tiny", 30, 2, 1, 1, 1
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    root = Path(tempfile.mkdtemp(prefix="hpf-elastic-bench-"))
    ref_out = root / "reference"
    ref = run(_train(ref_out, args, "--elastic"), ref_out)
    if ref["rc"]:
        raise SystemExit(ref["text"][-3000:])
    reference = params_sha(ref_out, args.steps)
    rng = random.Random(args.seed)
    kills = [(rng.randrange(2, args.steps - 2), rng.randrange(WORLD)) for _ in range(args.kills + args.grow)]
    rows, elastic_rows, restart_rows = [], [], []
    for i, (k, rank) in enumerate(kills):
        grow = i >= args.kills
        e = elastic_kill(args, root, k, rank, grow, reference)
        elastic_rows.append(e)
        rs = restart_kill(args, root, k, rank, reference) if not (grow or args.torchrun) else None
        if rs:
            restart_rows.append(rs)
        rows.append([f"{k + 1}", rank, "3->4" if grow else "4->3", e["rc"], e["killed_rc"], e["redone"], f"{e['kill_to_step_s']:.2f}",
                     f"{e['rebuild_s']:.2f}", e["world_at_end"], e["same_bits"], f"{e['wall_s']:.1f}",
                     f"{rs['wall_s']:.1f}" if rs else "-", rs["recomputed"] if rs else "-", rs["same_bits"] if rs else "-"])
    print(f"reference (no failure): params sha256 {reference}, wall {ref['wall_s']:.1f} s")
    if rows:  # (--kills 0 --grow 0: the cost alone)
        print_table(["killed in step", "rank", "world", "rc", "killed member's rc", "finished steps redone",
                     "kill->next step s", "rebuild s", "ranks at end", "same bits", "elastic wall s", "restart wall s",
                     "restart recomputed", "restart same bits"], rows)
        report_ratio("worst_kill_to_next_step_s", max(e["kill_to_step_s"] for e in elastic_rows), "<=10")
    if args.torchrun:  # (the restarts, the default mode and the cost do not depend on the launcher)
        return print(f"load average at end: {os.getloadavg()[0]:.2f}")
    if args.default_kills:
        d = default_mode(args, root, kills[:args.default_kills])
        print_table(["default mode: killed in step", "rank", "went back to", "max |params - mesh change at that step|"],
                    [[r["k"] + 1, r["rank"], r["back_to"], f"{r['max_abs_diff']:.3g}"] for r in d])
    c = cost(args, root)
    print(f"step time without failures: elastic {c['elastic_ms']:.1f} ms, plain {c['plain_ms']:.1f} ms (median of "
          f"{args.rounds} rounds' medians); copies {c['copy_mib_per_rank']:.2f} MiB per rank "
          f"at most, {c['copy_mib_per_rank'] / c['shard_state_mib']:.1f} shard states of {c['shard_state_mib']:.2f} MiB")
    report_ratio("elastic/plain_step", c["elastic_ms"] / c["plain_ms"], "<=1.05")
    if restart_rows:
        report_ratio("elastic/restart_wall", statistics.median(e["wall_s"] for e in elastic_rows[:args.kills])
                     / statistics.median(r["wall_s"] for r in restart_rows), "<=1")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
