"""Tensor parallelism, hpf's plain tensors against DTensor's, side by side: GPT on a dp x tp mesh.

  hpf        shard_step with gpt.param_specs(config, "tp", ("dp",)) and gpt.loss_for(tp_axis="tp"):
             heads and MLP columns split over tp by PartitionSpecs, the row-parallel products summed
             by hpf.psum, every weight stored FSDP-sharded over dp; plain tensors inside the loss.
  dtensor    torchtitan's recipe: an nn.Module GPT (nn.Linear layers, the same math and params),
             parallelize_module over tp (ColwiseParallel on qkv and up, RowwiseParallel on proj and
             down), then fully_shard over dp per block and on the root, foreach AdamW.
  limit      the same sharded math with no framework and no communication: each rank's tp-local
             block math on its local batch, plain autograd (the floor both frameworks pay above).

Interleaved rounds, the same global batch, the slowest rank's median step. The framework's CPU
per layer is (step - limit) / layers for each. Step 0's losses are checked equal first.
Usage: python benchmarks/tp_vs_dtensor.py [--config small] [--rounds 5] [--quick]
"""
from __future__ import annotations

import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

import hpf
from hpf.launcher import launch
from hpf.models import gpt

from common import config_of, parse_step_args, print_table, report_ratio, step_bench_parser, time_steps
from step_vs_fsdp2 import adamw_step

WORLD, DP, TP = 4, 2, 2


class _Block(nn.Module):
    def __init__(self, blk: dict, n_heads: int):
        super().__init__()
        d = blk["w_o"].shape[0]
        self.n_heads, self.e = n_heads, d // n_heads
        self.norm1, self.norm2 = nn.Parameter(blk["norm1"].clone()), nn.Parameter(blk["norm2"].clone())
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, blk["w_up"].shape[1], bias=False), nn.Linear(blk["w_up"].shape[1], d, bias=False)
        with torch.no_grad():
            for lin, w in ((self.qkv, "w_qkv"), (self.proj, "w_o"), (self.up, "w_up"), (self.down, "w_down")):
                lin.weight.copy_(blk[w].T)

    def forward(self, x):
        qkv = self.qkv(gpt.rms_norm(x, self.norm1))  # local heads under ColwiseParallel: head-major columns
        q, k, v = rearrange(qkv, "b t (h three e) -> three b h t e", three=3, e=self.e)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(rearrange(attn, "b h t e -> b t (h e)"))
        return x + self.down(F.gelu(self.up(gpt.rms_norm(x, self.norm2)), approximate="tanh"))


class _GPT(nn.Module):
    def __init__(self, params: dict, n_heads: int):
        super().__init__()
        self.embed, self.pos = nn.Parameter(params["embed"].clone()), nn.Parameter(params["pos"].clone())
        self.norm_f, self.head = nn.Parameter(params["norm_f"].clone()), nn.Parameter(params["head"].clone())
        self.blocks = nn.ModuleList(_Block(b, n_heads) for b in params["blocks"])

    def forward(self, batch):
        x = F.embedding(batch[:, :-1], self.embed) + self.pos[:batch.shape[1] - 1]
        for b in self.blocks:
            x = b(x)
        logits = gpt.rms_norm(x, self.norm_f) @ self.head
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def _dtensor(params, config, adamw):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = _GPT(params, config.n_heads)
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                           "up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return adamw_step(model, adamw)  # (the global mean: the tp ranks of a dp group hold the same loss)


def _hpf(params, config, adamw):
    step = hpf.shard_step(gpt.loss_for(config, tp_axis="tp"), mesh=hpf.Mesh({"dp": DP, "tp": TP}),
                          optimizer=hpf.optim.adamw(**adamw), param_specs=gpt.param_specs(config, "tp", ("dp",)),
                          fsdp_axes=("dp",))
    box = [step.init(params)]

    def run(batch):
        box[0], m = step(box[0], batch)
        return m["loss"]
    return run


def _limit(params, config, adamw, tp_index):
    """Each rank's tp-local blocks (its heads and MLP columns), unsharded over dp, no communication."""
    local = {k: v for k, v in params.items() if k != "blocks"}
    d, e = config.d_model, config.d_model // config.n_heads
    cols, rows = 3 * d // TP, config.d_ff // TP
    local["blocks"] = [{"norm1": b["norm1"], "norm2": b["norm2"],
                        "w_qkv": b["w_qkv"][:, tp_index * cols:(tp_index + 1) * cols].clone(),
                        "w_o": b["w_o"][tp_index * d // TP:(tp_index + 1) * d // TP].clone(),
                        "w_up": b["w_up"][:, tp_index * rows:(tp_index + 1) * rows].clone(),
                        "w_down": b["w_down"][tp_index * rows:(tp_index + 1) * rows].clone()} for b in params["blocks"]]
    leaves = [x.requires_grad_() for x in hpf.tree.flatten(local)[1]]
    loss_fn = gpt.loss_for(config)
    assert e * config.n_heads == d
    return adamw_step(lambda batch: loss_fn(local, batch), adamw, lambda loss: float(loss.detach()), leaves)


def rank_main(rank, args):
    torch.manual_seed(0)
    config = config_of(args)
    params = gpt.init(config, hpf.random.key(0))
    adamw = dict(lr=1e-3, weight_decay=0.0)
    dp_index, tp_index = divmod(rank, TP)
    rows = args.batch // DP
    batches = [gpt.global_batch(config, args.batch, 0, s)[dp_index * rows:(dp_index + 1) * rows]
               for s in range(args.warmup + args.rounds * args.calls)]
    impls = {"hpf": _hpf(params, config, adamw), "dtensor": _dtensor(params, config, adamw),
             "limit": _limit(params, config, adamw, tp_index)}

    def same_start(losses):
        assert abs(losses["hpf"][0] - losses["dtensor"][0]) < 1e-5 * abs(losses["hpf"][0]), losses
    wall, _, _ = time_steps(impls, batches, args, after_warmup=same_start)
    return {n: statistics.median(t) for n, t in wall.items()}


def main():
    args = parse_step_args(step_bench_parser(__doc__, batch=8))
    out = launch(rank_main, WORLD, args, timeout=1800)
    slowest = {n: max(r[n] for r in out) for n in out[0]}
    config = config_of(args)
    rows = [(n, 1e3 * s, 1e3 * (s - slowest["limit"]) / config.n_layers) for n, s in slowest.items()]
    print(f"GPT {args.config} ({config.n_layers} layers) on dp={DP} x tp={TP}, global batch {args.batch}; "
          f"median step of the slowest rank")
    print_table(("contender", "step ms", "framework ms per layer (step - limit)"), rows)
    report_ratio(f"tp_step/dtensor_fsdp2[{args.config},dp{DP}xtp{TP}]", slowest["hpf"] / slowest["dtensor"], "<=0.7")


if __name__ == "__main__":
    main()
