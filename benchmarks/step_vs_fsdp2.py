"""hpf production vs PyTorch FSDP2 vs a hand-written floor: one GPT training step, 2 ranks, gloo.

All three start from the same params, see the same batches and use the same AdamW
hyper-parameters; they run interleaved in one job (order rotated every round).
  hpf    hpf.shard_step on the pure-function GPT (hpf.models.gpt).
  fsdp2  fully_shard on each block and on the root of an nn.Module doing the same math,
         torch.optim.AdamW(foreach=True).
  limit  the physical limit: the same model unsharded on the local batch, no communication.
  limit+gloo  the limit while hpf's step's collectives run on gloo, never waited on until the
         end: the floor for a gloo FSDP step on CPU ranks, whose loopback copies take core time.
  floor  no framework: per unit one flat buffer, an autograd Function that all-gathers it
         forward and reduce-scatters its grads backward (params are views), re-gather in
         backward (not of the last block, still gathered), prefetch of the next unit,
         torch.optim.AdamW(foreach=True) on the flat shards.
Also printed: hpf's bytes sent per step vs the FSDP minimum, and torch.func.grad vs
torch.autograd.grad on the same pure loss in one process (the path hpf took).
Usage: python benchmarks/step_vs_fsdp2.py [--config small] [--batch 8] [--rounds 6] [--calls 3]
"""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

import hpf
from hpf.launcher import launch
from hpf.models import gpt, layers
from hpf import Topology
from hpf.comm.handles import reduce_scatter_async
from hpf.planning import ROOT
from hpf.report import PlanReport

from common import config_of, interleaved, median_ms, mib, parse_step_args, print_table, report_ratio, step_bench_parser, time_steps

WORLD = 2
LOCAL_LOSS = ("limit", "limit+gloo")  # contenders whose loss is this rank's own (no all-reduce), not the global mean
ROOT_KEYS = ("embed", "pos", "norm_f", "head")
BLOCK_KEYS = ("norm1", "w_qkv", "w_o", "norm2", "w_up", "w_down")


# -- the GPT math for FSDP2 and the floor, written per block (hpf runs gpt.loss itself; the
#    step-0 loss check below shows the three compute the same function) -------------------
def _rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + layers.NORM_EPS) * w


def block(p: dict, x: torch.Tensor, n_heads: int) -> torch.Tensor:
    q, k, v = rearrange(_rms_norm(x, p["norm1"]) @ p["w_qkv"], "b t (h three e) -> three b h t e",
                        three=3, h=n_heads)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + rearrange(attn, "b h t e -> b t (h e)") @ p["w_o"]
    return x + F.gelu(_rms_norm(x, p["norm2"]) @ p["w_up"], approximate="tanh") @ p["w_down"]


def embed_in(r: dict, tokens: torch.Tensor) -> torch.Tensor:
    return F.embedding(tokens, r["embed"]) + r["pos"][:tokens.shape[1]]


def head_loss(r: dict, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = _rms_norm(x, r["norm_f"]) @ r["head"]
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def global_mean(loss: torch.Tensor) -> float:
    t = loss.detach().reshape(1).clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


# -- FSDP2 ---------------------------------------------------------------------------------
class Params(nn.Module):
    """Registers a dict of tensors as parameters with the same names."""

    def __init__(self, tensors: dict):
        super().__init__()
        for name, t in tensors.items():
            self.register_parameter(name, nn.Parameter(t.clone()))

    def tensors(self, keys) -> dict:
        return {k: getattr(self, k) for k in keys}


class Block(Params):
    def __init__(self, tensors: dict, n_heads: int):
        super().__init__(tensors)
        self.n_heads = n_heads

    def forward(self, x):
        return block(self.tensors(BLOCK_KEYS), x, self.n_heads)


class GPTModule(Params):
    def __init__(self, params: dict, n_heads: int):
        super().__init__({k: params[k] for k in ROOT_KEYS})
        self.blocks = nn.ModuleList(Block(b, n_heads) for b in params["blocks"])

    def forward(self, batch):
        r = self.tensors(ROOT_KEYS)
        x = embed_in(r, batch[:, :-1])
        for b in self.blocks:
            x = b(x)
        return head_loss(r, x, batch[:, 1:])


def fsdp2_gpt(params, config, shape: tuple, names: tuple | None = None) -> GPTModule:
    """The GPT as an nn.Module with ``fully_shard`` on each block and on the root, over a CPU
    DeviceMesh of ``shape`` (2-D: HSDP, replicated over dim 0 and sharded over dim 1)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = GPTModule(params, config.n_heads)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def adamw_step(model, adamw: dict, loss_value=global_mean, params=None):
    """A plain PyTorch training step with foreach AdamW: ``step(batch) -> loss_value(model(batch))``
    (by default the global mean loss). ``model``: an nn.Module, or a loss of the batch over
    plain tensors ``params`` (the leaves it trains)."""
    opt = torch.optim.AdamW(model.parameters() if params is None else params, foreach=True, **adamw)

    def step(batch):
        loss = model(batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss_value(loss)
    return step


def make_limit(params, config, adamw):
    """The physical limit no sharded step can beat: the same model, unsharded, on this rank's
    local batch, plain autograd and torch AdamW, and no communication at all (so its loss is
    this rank's own, not the global mean)."""
    return adamw_step(GPTModule(params, config.n_heads), adamw, loss_value=lambda loss: float(loss.detach()))


def make_limit_gloo(params, config, adamw, plan):
    """The limit plus the collectives of hpf's step on gloo, all issued as the step starts and
    waited at its end, with nothing waiting on them: a step that overlapped communication
    perfectly. On CPU ranks the loopback TCP copies of gloo still take core time from the
    compute, so this is the floor for any gloo FSDP step here (each block gathered twice but
    the last, the root once, everything reduce-scattered once, as hpf does)."""
    limit = make_limit(params, config, adamw)
    last = list(plan.units)[-1]
    calls = []
    for b in plan.buckets:
        full = torch.zeros(b.padded_numel)
        shard, out = full[:b.padded_numel // WORLD].clone(), torch.empty(b.padded_numel // WORLD)
        gathers = 1 if b.unit in (ROOT, last) else 2
        calls += [lambda full=full, shard=shard: dist.all_gather_single(full, shard, async_op=True)] * gathers
        calls.append(lambda out=out, full=full: reduce_scatter_async(out, full))

    def step(batch):
        handles = [call() for call in calls]
        loss = limit(batch)
        for h in handles:
            h.wait()
        return loss
    return step


def make_fsdp2(params, config, adamw):
    return adamw_step(fsdp2_gpt(params, config, (WORLD,)), adamw)


# -- the hand-written floor ----------------------------------------------------------------
class Unit:
    """One flat buffer: this rank's shard (the optimizer's param), the full buffer whose
    storage exists only while gathered, and the params as views into it."""

    def __init__(self, tensors: dict):
        rank = dist.get_rank()
        self.names = list(tensors)
        self.shapes = [t.shape for t in tensors.values()]
        self.numel = sum(t.numel() for t in tensors.values())
        shard = -(-self.numel // WORLD)
        flat = torch.zeros(shard * WORLD)
        flat[:self.numel] = torch.cat([t.reshape(-1) for t in tensors.values()])
        self.shard = flat[rank * shard:(rank + 1) * shard].clone().requires_grad_()
        self.shard.grad = torch.zeros_like(self.shard)
        self.full = torch.empty(shard * WORLD)
        self.nbytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)
        self.gathering = None

    def gather(self):  # async; wait() before use
        if self.full.untyped_storage().nbytes() == 0:
            self.full.untyped_storage().resize_(self.nbytes)
            # .data: autograd must not see the refill as an in-place change of the saved views
            self.gathering = dist.all_gather_single(self.full.data, self.shard.detach(), async_op=True)

    def wait(self):
        if self.gathering is not None:
            self.gathering.wait()
            self.gathering = None

    def free(self):
        self.wait()
        self.full.untyped_storage().resize_(0)

    def views(self, flat=None):
        """The params as views of ``flat`` (default: the gathered buffer)."""
        flat = self.full if flat is None else flat
        return [v.view(s) for v, s in zip(flat[:self.numel].split([math.prod(s) for s in self.shapes]),
                                          self.shapes)]


class GatheredParams(torch.autograd.Function):
    """Forward: the unit's params as views of its gathered buffer. Backward: their grads into
    one flat buffer, free the unit, one async reduce-scatter into the shard's grad."""

    @staticmethod
    def forward(ctx, anchor, unit, pending):
        ctx.unit, ctx.pending = unit, pending
        unit.wait()
        return tuple(unit.views())

    @staticmethod
    def backward(ctx, *grads):
        unit = ctx.unit
        flat = torch.empty(unit.full.numel())
        flat[unit.numel:].zero_()
        torch._foreach_copy_(unit.views(flat), list(grads))
        unit.free()
        ctx.pending.append((dist.reduce_scatter_single(unit.shard.grad, flat, async_op=True), flat))
        return None, None, None


class FreeAfterForward(torch.autograd.Function):
    """Identity on a block's output: frees the unit in forward; when backward reaches the
    block, re-gathers it (its saved tensors are views of the buffer) and prefetches the one before."""

    @staticmethod
    def forward(ctx, x, unit, before):
        unit.free()
        ctx.unit, ctx.before = unit, before
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.unit.gather()
        ctx.unit.wait()
        if ctx.before is not None:
            ctx.before.gather()
        return g, None, None


def make_floor(params, config, adamw):
    root = Unit({k: params[k] for k in ROOT_KEYS})
    blocks = [Unit(b) for b in params["blocks"]]
    units = [root, *blocks]
    opt = torch.optim.AdamW([u.shard for u in units], foreach=True, **adamw)
    grads = [u.shard.grad for u in units]

    def step(batch):
        pending = []
        anchor = torch.empty(0, requires_grad=True)
        root.gather()
        blocks[0].gather()
        r = dict(zip(root.names, GatheredParams.apply(anchor, root, pending)))
        x = embed_in(r, batch[:, :-1])
        for i, u in enumerate(blocks):
            p = dict(zip(u.names, GatheredParams.apply(anchor, u, pending)))
            if i + 1 < len(blocks):
                blocks[i + 1].gather()
            x = block(p, x, config.n_heads)
            if i + 1 < len(blocks):  # the last block stays gathered: backward starts with it
                x = FreeAfterForward.apply(x, u, blocks[i - 1] if i else None)
            elif i:
                blocks[i - 1].gather()  # backward needs it next
        loss = head_loss(r, x, batch[:, 1:])
        loss.backward()
        for handle, _ in pending:
            handle.wait()
        torch._foreach_div_(grads, float(WORLD))
        opt.step()
        return global_mean(loss)
    return step


# -- hpf -----------------------------------------------------------------------------------
def make_hpf(params, config, adamw, topology=None):
    step = hpf.shard_step(gpt.loss_for(config), mesh=hpf.Mesh({"dp": WORLD}), optimizer=hpf.optim.adamw(**adamw),
                          topology=topology)
    box = [step.init(params)]

    def run(batch):
        box[0], metrics = step(box[0], batch)
        return metrics["loss"]
    run.step = step
    return run


def fsdp_min_bytes(params) -> int:
    """The FSDP minimum per rank and step: all-gather blocks twice and the root once, reduce-
    scatter everything once; each moves (n-1)/n of the unit's buffer padded to n ranks."""
    def padded(tensors):
        return -(-sum(t.numel() for t in tensors) // WORLD) * WORLD * 4
    root = padded([params[k] for k in ROOT_KEYS])
    blocks = sum(padded(b.values()) for b in params["blocks"])
    return (2 * blocks + root + (blocks + root)) * (WORLD - 1) // WORLD


# -- the job -------------------------------------------------------------------------------
def rank_main(rank, args):
    config = config_of(args)
    params = gpt.init(config, hpf.random.key(0))
    adamw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    local = args.batch // WORLD
    batches = [gpt.global_batch(config, args.batch, 0, s)[rank * local:(rank + 1) * local] for s in range(8)]
    impls = {"hpf": make_hpf(params, config, adamw), "fsdp2": make_fsdp2(params, config, adamw),
             "floor": make_floor(params, config, adamw), "limit": make_limit(params, config, adamw)}
    impls["limit+gloo"] = make_limit_gloo(params, config, adamw, impls["hpf"].step.plan)
    if args.shm:  # hpf's own fast tier for ranks of one host: shared memory instead of gloo
        impls["hpf-shm"] = make_hpf(params, config, adamw, Topology(fast_transport="shm"))
    hpf_step, warm = impls["hpf"].step, []  # its stats after the warm-up: bytes counted by the engine

    def check_and_reset(losses):
        first = [l[0] for n, l in losses.items() if n not in LOCAL_LOSS]
        if max(first) - min(first) > 1e-5:
            raise RuntimeError(f"step-0 losses differ, so the implementations do not compute the same thing: {losses}")
        warm.append(hpf_step.stats())
    times, losses, cpu = time_steps(impls, batches, args, after_warmup=check_and_reset)
    per_step = Counter()
    for (op, _tier), n in (hpf_step.stats() - warm[0]).bytes.items():
        per_step[op] += n / (args.rounds * args.calls)
    report = PlanReport.of(impls["hpf"].step.plan)
    return {"times": times, "cpu": cpu, "losses": losses, "sent": dict(per_step), "min_bytes": fsdp_min_bytes(params),
            "report_bytes": sum(report.comm_total.values())}


def func_grad_cost(config, batch, reps: int = 10) -> dict[str, float]:
    """torch.func.grad vs torch.autograd.grad on the same pure loss, one process, one thread."""
    loss_fn = gpt.loss_for(config)
    params = gpt.init(config, hpf.random.key(0))
    leaves = [p.requires_grad_() for p in hpf.tree.flatten(params)[1]]
    func_grad = torch.func.grad(loss_fn)
    contenders = {"torch.func.grad": lambda: func_grad(params, batch),
                  "torch.autograd.grad": lambda: torch.autograd.grad(loss_fn(params, batch), leaves)}
    for c in contenders.values():
        c()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = interleaved(contenders, rounds=reps, calls=3)
    finally:
        torch.set_num_threads(before)
    return {k: median_ms(v) for k, v in times.items()}


def main():
    ap = step_bench_parser(__doc__, warmup=3, rounds=6, calls=3)
    ap.add_argument("--no-shm", dest="shm", action="store_false",
                    help="skip hpf with its shared-memory fast tier (the hpf train default)")
    args = parse_step_args(ap)
    config = config_of(args)
    print(f"GPT {args.config}, {config.n_layers} layers of d_model {config.d_model} ({gpt.num_params(config) / 1e6:.2f}M params), global batch {args.batch}, "
          f"{WORLD} ranks, gloo, {torch.get_num_threads()} cores")
    out = launch(rank_main, WORLD, args, timeout=1800)[0]

    first = {n: l[0] for n, l in out["losses"].items() if n not in LOCAL_LOSS}
    print("step-0 loss (sanity):  " + "  ".join(f"{n} {v:.7f}" for n, v in first.items()))
    spread = max(abs(a - b) for a in first.values() for b in first.values())
    drift = max(np.max(np.abs(np.array(out["losses"]["hpf"]) - np.array(out["losses"][n]))) for n in first)
    print(f"  max difference at step 0: {spread:.2e}; over all {len(out['losses']['hpf'])} steps: {drift:.2e}")
    if spread > 1e-5 or drift > 1e-3:
        raise SystemExit("the three implementations disagree: the comparison is meaningless")

    med = {n: median_ms(t) for n, t in out["times"].items()}
    print(f"\nmedian step time over {len(out['times']['hpf'])} interleaved steps each:")
    cpu = {n: median_ms(t) for n, t in out["cpu"].items()}
    print_table(["impl", "ms/step", "min ms", "max ms", "CPU ms/step (rank 0)"],
                [[n, med[n], min(t) * 1e3, max(t) * 1e3, cpu[n]] for n, t in out["times"].items()])
    for mine in [n for n in med if n.startswith("hpf")]:
        for other, target in (("fsdp2", 0.70), ("floor", 1.10), ("limit", 1.15 if mine == "hpf-shm" else None),
                              ("limit+gloo", None)):
            print(f"{mine}/{other} = {med[mine] / med[other]:.3f}   (target {f'<= {target:.2f}' if target else 'none'}; "
                  f"CPU time {cpu[mine] / cpu[other]:.3f})")
            report_ratio(f"{mine}/{other}", med[mine] / med[other], f"<={target:.2f}" if target else "")

    floor = med["limit+gloo"] / med["fsdp2"]
    print(f"limit+gloo/fsdp2 = {floor:.3f}   (a gloo FSDP step whose communication overlaps perfectly, vs FSDP2: "
          "about the best a flat-gloo step can do here)")
    report_ratio("limit+gloo/fsdp2", floor)

    sent = out["sent"]
    total = sum(sent.values())
    print(f"\nbytes sent per rank per step by hpf (counted in the engine): {mib(total)} "
          + ", ".join(f"{k} {mib(v)}" for k, v in sorted(sent.items())))
    print(f"FSDP minimum (2 AG of blocks + 1 AG of root + 1 RS of all, (n-1)/n, padded): {mib(out['min_bytes'])}"
          f"   ratio {total / out['min_bytes']:.3f}   (plan report: {mib(out['report_bytes'])})")
    if total < out["min_bytes"]:
        print("  (below it: the last block is still gathered when backward starts, so it is not re-gathered)")

    batch = gpt.global_batch(config, args.batch // WORLD, 0, 0)
    cost = func_grad_cost(config, batch)
    fg, ag = cost["torch.func.grad"], cost["torch.autograd.grad"]
    print(f"\ngrad of the pure loss, one process, 1 thread, local batch {args.batch // WORLD}: "
          f"torch.func.grad {fg:.2f} ms, torch.autograd.grad {ag:.2f} ms -> func.grad costs {fg / ag:.2f}x "
          "(hpf uses plain autograd)")
    report_ratio("func.grad/autograd.grad", fg / ag)


if __name__ == "__main__":
    main()
