"""torch.compile'd blocks: hpf vs FSDP2, each compiled and eager, against the no-communication limit.

2 ranks, gloo, interleaved rounds (order rotated), medians. Every contender runs the same math
from the same params on the same batches (step-0 losses must agree):
  hpf           hpf.shard_step on hpf.models' pure loss (``loss_for(config)``)
  hpf-compiled  the same with ``loss_for(config, compile=True)``: each block torch.compile'd
  fsdp2         fully_shard on each block (an nn.Module calling the same block function) and the root
  fsdp2-compiled  the same, each block ``.compile()``d before fully_shard (torchtitan's recipe)
  limit         the same model unsharded on the local batch, no communication, torch AdamW
  limit-compiled  the limit with each block ``.compile()``d
Prints the ratios the compile issue sets, and the first step's extra time (compiling).
``--memory``: peak per rank with compiled blocks vs eager (benchmarks/memory_model.py's
measurement: the profiler's live total of tensor allocations), GPT small and medium.

    python benchmarks/compile_step.py [--model gpt|moe] [--config small] [--memory]
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hpf  # noqa: E402
from common import median_ms, print_table, report_ratio, step_bench_parser, time_steps  # noqa: E402
from hpf.launcher import launch  # noqa: E402
from hpf.models import gpt, moe  # noqa: E402
from step_vs_fsdp2 import adamw_step  # noqa: E402

WORLD = 2
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
LOCAL_LOSS = ("limit", "limit-compiled")  # their loss is the rank's own, not the global mean


class Tree(nn.Module):
    """A pytree of tensors as parameters (paths with '/' become '__')."""

    def __init__(self, tree):
        super().__init__()
        paths, leaves, self.treedef = hpf.tree.flatten(tree)
        self.names = [p.replace("/", "__") for p in paths]
        for n, t in zip(self.names, leaves):
            self.register_parameter(n, nn.Parameter(t.detach().clone()))

    def tree(self):
        return hpf.tree.unflatten(self.treedef, [getattr(self, n) for n in self.names])


class Block(Tree):
    """One block: ``fn(params, x) -> (x, extra loss)`` on its own params (FSDP2 gathers them in its hooks)."""

    def __init__(self, tree, fn):
        super().__init__(tree)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.tree(), x)


class Model(nn.Module):
    """The pure model as modules: root params, blocks, ``embed(root, tokens)`` and ``head(root, x, targets)``."""

    def __init__(self, params, block_fn, embed, head):
        super().__init__()
        self.root = Tree({k: v for k, v in params.items() if k != "blocks"})
        self.blocks = nn.ModuleList(Block(b, block_fn) for b in params["blocks"])
        self.embed, self.head = embed, head

    def forward(self, batch):
        r = self.root.tree()
        x, extra = self.embed(r, batch[:, :-1]), 0.0
        for b in self.blocks:
            x, e = b(x)
            extra = extra + e
        return self.head(r, x, batch[:, 1:]) + extra


def model_of(name: str, config, params) -> Model:
    """hpf.models' math as modules (step-0 losses check that it is the same function)."""
    if name == "gpt":
        return Model(params, lambda p, x: (gpt.block(p, x, config.n_heads), 0.0),
                     lambda r, t: F.embedding(t, r["embed"]) + r["pos"][:t.shape[1]],
                     lambda r, x, y: F.cross_entropy((gpt.rms_norm(x, r["norm_f"]) @ r["head"]).flatten(0, 1),
                                                     y.flatten()))

    def block(p, x):
        x, _, balance = moe.block(p, x, None, config)
        return x, config.aux_loss_coeff * balance
    return Model(params, block, lambda r, t: F.embedding(t, r["embed"]), lambda r, x, y: moe.head_loss(r, x, y))


def make_torch(name, config, params, shard: bool, compiled: bool):
    model = model_of(name, config, params)
    for b in model.blocks:
        if compiled:
            b.compile()
    if shard:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (WORLD,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return adamw_step(model, ADAMW) if shard else adamw_step(model, ADAMW, loss_value=lambda loss: float(loss.detach()))


def make_hpf(name, config, params, compiled: bool):
    module = gpt if name == "gpt" else moe
    step = hpf.shard_step(module.loss_for(config, compile=compiled), mesh=hpf.Mesh({"dp": WORLD}),
                          optimizer=hpf.optim.adamw(**ADAMW))
    box = [step.init(params)]

    def run(batch):
        box[0], m = step(box[0], batch)
        run.compile_s.append(m["compile_s"])
        return m["loss"]
    run.compile_s = []
    return run


def rank_main(rank, args):
    torch.manual_seed(0)
    module = gpt if args.model == "gpt" else moe
    config = module.CONFIGS[args.config]
    params = module.init(config, hpf.random.key(0))
    local = args.batch // WORLD
    batches = [module.global_batch(config, args.batch, 0, s)[rank * local:(rank + 1) * local] for s in range(8)]
    impls = {"hpf": make_hpf(args.model, config, params, False), "hpf-compiled": make_hpf(args.model, config, params, True),
             "fsdp2": make_torch(args.model, config, params, True, False),
             "fsdp2-compiled": make_torch(args.model, config, params, True, True),
             "limit": make_torch(args.model, config, params, False, False),
             "limit-compiled": make_torch(args.model, config, params, False, True)}
    first_s = {}
    for n, impl in impls.items():  # the first step of each, timed alone: compiling happens here
        dist.barrier()
        t = time.perf_counter()
        impl(batches[0])
        first_s[n] = time.perf_counter() - t
    args.warmup = max(args.warmup - 1, 1)

    def check(losses):
        first = [ls[0] for n, ls in losses.items() if n not in LOCAL_LOSS]
        if max(first) - min(first) > 1e-4:
            raise RuntimeError(f"losses differ after warm-up: the contenders do not compute the same thing: {losses}")
    times, losses, _ = time_steps(impls, batches[1:], args, after_warmup=check)
    return {"times": times, "first_s": first_s, "hpf_compile_s": impls["hpf-compiled"].compile_s}


def memory(configs=("small", "medium")):
    from memory_model import measured_peak
    for config, local in zip(configs, (4, 1)):
        peaks = {compiled: measured_peak(config, WORLD, local, compile=compiled) for compiled in (False, True)}
        ratio = peaks[True] / peaks[False]
        print(f"GPT {config}, {WORLD} ranks, {local} sequences per rank: peak per rank eager {peaks[False] / 2**20:.1f} "
              f"MiB, compiled blocks {peaks[True] / 2**20:.1f} MiB, ratio {ratio:.3f} (target <= 1.10)", flush=True)
        report_ratio(f"compile_memory/{config}", ratio, "<=1.10")


def main():
    ap = step_bench_parser(__doc__, config=None, warmup=2, rounds=6, calls=2)
    ap.add_argument("--model", choices=("gpt", "moe"), default="gpt")
    ap.add_argument("--memory", action="store_true", help="also measure peak memory, compiled vs eager")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.calls, args.warmup = 2, 1, 1
    if args.config is None:
        args.config = "small" if args.model == "gpt" else "tiny"
    print(f"{args.model} {args.config}, global batch {args.batch}, {WORLD} ranks, gloo, {torch.get_num_threads()} "
          "threads; first steps compile (seconds to minutes on CPU)", flush=True)
    out = launch(rank_main, WORLD, args, timeout=3600)[0]
    med = {n: median_ms(t) for n, t in out["times"].items()}
    print(f"\nmedian step time over {len(out['times']['hpf'])} interleaved steps each:")
    print_table(["impl", "ms/step", "min ms", "max ms", "first step s"],
                [[n, med[n], min(t) * 1e3, max(t) * 1e3, out["first_s"][n]] for n, t in out["times"].items()])
    tag = f"{args.model}-{args.config}"
    hf = med["hpf-compiled"] / med["fsdp2-compiled"]
    print(f"hpf-compiled/fsdp2-compiled = {hf:.3f}   (target <= 0.75)")
    report_ratio(f"compile/{tag}/hpf_vs_fsdp2", hf, "<=0.75")
    gain, limit_gain = med["hpf-compiled"] / med["hpf"], med["limit-compiled"] / med["limit"]
    print(f"hpf-compiled/hpf = {gain:.3f}; limit-compiled/limit = {limit_gain:.3f}: compile gives hpf "
          f"{gain / limit_gain:.3f}x of what it gives the model without communication (target within 5%)")
    report_ratio(f"compile/{tag}/gain_vs_limit_gain", gain / limit_gain, "<=1.05")
    cost_c, cost_e = med["hpf-compiled"] / med["limit-compiled"], med["hpf"] / med["limit"]
    print(f"hpf-compiled/limit-compiled = {cost_c:.3f}; hpf/limit = {cost_e:.3f}: framework cost compiled vs eager "
          f"{cost_c / cost_e:.3f} (target <= 1.05)")
    report_ratio(f"compile/{tag}/framework_cost_compiled_vs_eager", cost_c / cost_e, "<=1.05")
    extra = out["first_s"]["hpf-compiled"] - statistics.median(out["times"]["hpf-compiled"])
    compile_s = out["hpf_compile_s"]
    later = [i + 1 for i, s in enumerate(compile_s) if s > 0 and i > 0]
    print(f"first step of hpf-compiled: {out['first_s']['hpf-compiled']:.1f} s, {extra:.1f} s more than a later step "
          f"(torch.compile's own timers: {compile_s[0]:.1f} s); "
          + (f"steps {later} compiled again ({sum(compile_s[1:]):.1f} s)" if later else
             f"the {len(compile_s) - 1} later steps compiled nothing"))
    if args.memory:
        memory()


if __name__ == "__main__":
    main()
