"""Layout-driven distributed Muon vs naive distributed Muon: one optimizer step, 4 ranks, gloo.

Both run on the same flat FSDP shards (hpf.plan of the GPT "small" params) with the same grads
and the same math (hpf.optim.muon's momentum, batched Newton-Schulz, update and AdamW fallback):
  dist       hpf.optim.muon(...).for_plan: each matrix orthogonalized once, by one owner; only
             matrices split across shards move, point-to-point, between their holders.
  dist-bf16  the same, pieces sent in bf16.
  dist-gram  the same with ns_variant="auto": Gram Newton-Schulz on the rectangular matrices.
  naive      every rank all-gathers every bucket's momentum-updated grads and orthogonalizes
             every matrix, then updates its own shard (the gather-everything pattern).
Contenders run interleaved in one job (order rotated each round); the time of a step is the
slowest rank's, and the figure is the median over steps. Also printed: bytes sent per step.
Usage: python benchmarks/muon_dist.py [--config small] [--rounds 5] [--calls 2] [--quick]
"""
from __future__ import annotations


import torch
import torch.distributed as dist

import hpf
from hpf.launcher import launch
from hpf.models import gpt
from hpf.optim.adamw_optimizer import schedule_value
from hpf.optim.muon_math import MuonState, apply_muon_updates_, muon_momentum_, orthogonalize, update_scale
from hpf.optim.muon_optimizer import muon
from hpf.optim.transforms import Hyper, run

from common import interleaved, median_ms, mib, print_table, report_ratio, parse_step_args, step_bench_parser

WORLD = 4


class GatherAllMuon:
    """Naive distributed Muon on a plan's flat shards (init/update as DistMuon)."""

    def __init__(self, muon, plan, rank):
        self.muon, self.plan = muon, plan
        self.adamw, self.pieces, self.buckets = [], [], []  # pieces: (bucket, in shard, slot, in matrix)
        self.bytes_sent = 0
        for b in plan.buckets:
            position = plan.shard_index(b, rank)
            matrices = []
            for s in b.slots:
                piece = b.local_piece(s, position)
                is_muon = muon.on_muon(s.path, torch.empty(s.global_shape, device="meta"))
                matrices += [s] if is_muon else []
                if piece.numel:
                    if is_muon:
                        self.pieces.append((b.index, piece.held, s, piece.param))
                    else:
                        self.adamw.append((b.index, piece.held))
            if matrices:
                self.buckets.append((b, matrices, plan.mesh.group(b.shard_axes) if b.shard_size > 1 else None))

    def init(self, shards):
        return MuonState(torch.zeros((), dtype=torch.int64), [torch.zeros_like(s) for s in shards],
                         [torch.zeros_like(s) for s in shards])

    def update(self, grads, state, params):
        m = self.muon
        state.count.add_(1)
        step = int(state.count)
        ups = muon_momentum_([grads[b][s] for b, s, _, _ in self.pieces],
                             [state.exp_avg[b][s] for b, s, _, _ in self.pieces], m.momentum, m.nesterov)
        sendbuf = [torch.zeros_like(g) for g in grads]
        for (b, s, _, _), u in zip(self.pieces, ups):
            sendbuf[b][s] = u
        full, handles = {}, []
        for b, _, group in self.buckets:
            full[b.index] = torch.empty(b.padded_numel, dtype=sendbuf[b.index].dtype)
            if group is None:
                full[b.index].copy_(sendbuf[b.index])
                continue
            self.bytes_sent += (b.shard_size - 1) * sendbuf[b.index].nbytes
            handles.append(dist.all_gather_single(full[b.index], sendbuf[b.index], group=group, async_op=True))
        p, g, avg, avg_sq = ([t[b][s] for b, s in self.adamw] for t in (params, grads, state.exp_avg, state.exp_avg_sq))
        run(m.transform.transforms["adamw"], g, {"exp_avg": avg, "exp_avg_sq": avg_sq}, p, Hyper(step))
        for h in handles:
            h.wait()
        slots = [s for b, matrices, _ in self.buckets for s in matrices]
        matrices = [full[s.bucket][s.offset:s.offset + s.numel].view(s.local_shape) for s in slots]
        directions = dict(zip((s.path for s in slots), orthogonalize(
            matrices, ns_steps=m.ns_steps, coefficients=m.coefficients, compute_dtype=m.ns_compute_dtype)))
        lr = schedule_value(m.lr, step)
        for b, mine, s, part in self.pieces:
            scale = update_scale(s.local_shape[-2], s.local_shape[-1], m.scale)
            apply_muon_updates_([params[b][mine].view(1, -1)], [directions[s.path].reshape(-1)[part].view(1, -1)],
                                lr=lr, weight_decay=m.weight_decay, scale=scale)
        return params, state


def rank_main(rank, args):
    params = gpt.init(gpt.CONFIGS[args.config], hpf.random.key(0))
    plan = hpf.plan(params, hpf.Mesh({"dp": WORLD}))
    g = torch.Generator().manual_seed(1 + rank)
    grads = [torch.randn(b.shard_numel, generator=g) * 1e-3 for b in plan.buckets]
    make = {"dist": lambda: muon(adamw_lr=1e-3).for_plan(plan, rank),
            "dist-bf16": lambda: muon(adamw_lr=1e-3, comm_dtype=torch.bfloat16).for_plan(plan, rank),
            "dist-gram": lambda: muon(adamw_lr=1e-3, ns_variant="auto").for_plan(plan, rank),
            "naive": lambda: GatherAllMuon(muon(adamw_lr=1e-3), plan, rank)}
    runs = {}
    for name, new in make.items():
        opt = new()
        shards = plan.shards(params, rank)
        runs[name] = [opt, shards, opt.init(shards)]

    def contender(name):
        def call():
            opt, shards, state = runs[name]
            runs[name][1:] = opt.update(grads, state, shards)
        return call
    contenders = {n: contender(n) for n in runs}
    for c in contenders.values():  # warm-up
        c()
    # Same params, grads and math: one step of each from the same start must agree.
    first = {n: r[1] for n, r in runs.items()}
    for n in ("dist", "naive"):
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(first["dist"], first[n])), n
    sent_before = {n: r[0].bytes_sent for n, r in runs.items()}
    times = interleaved(contenders, rounds=args.rounds, calls=args.calls, before_each=dist.barrier)
    n_calls = args.rounds * args.calls
    sent = {n: (r[0].bytes_sent - sent_before[n]) / n_calls for n, r in runs.items()}
    load = runs["dist"][0].ns_load
    return {"times": times, "sent": sent, "ns_load": [load[r] for r in range(WORLD)]}


def main():
    args = parse_step_args(step_bench_parser(__doc__))
    config = gpt.CONFIGS[args.config]
    print(f"Muon optimizer step, GPT {args.config} params ({gpt.num_params(config) / 1e6:.2f}M), {WORLD} ranks, gloo")
    out = launch(rank_main, WORLD, args, timeout=1800)
    names = list(out[0]["times"])
    slowest = {n: [max(r["times"][n][i] for r in out) for i in range(len(out[0]["times"][n]))] for n in names}
    med = {n: median_ms(t) for n, t in slowest.items()}
    total_sent = {n: sum(r["sent"][n] for r in out) for n in names}
    print_table(["impl", "ms/step (slowest rank, median)", "min ms", "bytes sent/step (all ranks)"],
                [[n, med[n], min(slowest[n]) * 1e3, mib(total_sent[n])] for n in names])
    load = out[0]["ns_load"]
    print(f"NS GFLOP per rank, dist: {[round(x / 1e9, 2) for x in load]} "
          f"(busiest {max(load) / (sum(load) / WORLD):.2f}x the mean; naive: every rank {sum(load) / 1e9:.2f})")
    report_ratio("muon-dist/naive-time", med["dist"] / med["naive"], "<=0.4")
    report_ratio("muon-dist-bf16/naive-time", med["dist-bf16"] / med["naive"], "<=0.4")
    report_ratio("muon-dist-gram/naive-time", med["dist-gram"] / med["naive"], "<=0.15")
    report_ratio("muon-dist/naive-bytes", total_sent["dist"] / total_sent["naive"])
    report_ratio("muon-dist-bf16/naive-bytes", total_sent["dist-bf16"] / total_sent["naive"])


if __name__ == "__main__":
    main()
