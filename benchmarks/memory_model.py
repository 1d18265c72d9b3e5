"""hpf.memory's predicted peak per rank against the measured one, on CPU ranks.

Measured: torch.profiler's memory profiling (every tensor allocation and free of the rank's
own thread) from before ``step.init`` to the end of the last step; the peak is the highest
live total during the steps. The flat collectives keep every allocation on that thread (the
two-tier ones allocate on their worker threads, which the profiler does not see), so the
cases run ``topology=None``. Not a timing: the machine need not be quiet.

Tensor-parallel cases (a ``tp`` axis: gpt.param_specs, FSDP over the other axes) count one TP
rank's share of each block's activations and its local blocks of the split params, as ``hpf plan
--mesh dp=2,tp=2`` predicts them (hpf.memory.predict).

    python benchmarks/memory_model.py [--quick] [--tp-only] [--json docs/results/memory_model.json]

Prints one line per case and ``RATIO memory/<case> <max(predicted/measured, measured/predicted)>
<=1.15``: the target is within 15% either way.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import hpf
from hpf.memory import step_memory
from hpf.models import TP_AXIS, data_axes, gpt, layout
from hpf.planning import step_plan
from hpf.report import PlanReport

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import report_ratio, write_results  # noqa: E402

# (config, ranks, sequences per rank); each with recompute "none" and "all". Medium with recompute at
# 1 sequence peaks while its reductions are held (the end of backward), its other cases while activations are.
# A mesh of its own ({axis: size}) for the tensor-parallel cases: sequences per tp group.
TP = [("small", {"tp": 2}, 4), ("small", {"dp": 2, "tp": 2}, 4), ("medium", {"tp": 2}, 1),
      ("medium", {"dp": 2, "tp": 2}, 1)]
CASES = [("tiny", 2, 8), ("tiny", 4, 8), ("small", 2, 4), ("small", 4, 4), ("medium", 2, 1), ("medium", 4, 1),
         ("medium", 2, 2)] + TP
QUICK = [("tiny", 2, 8), ("small", 2, 4), ("small", {"dp": 2, "tp": 2}, 4)]


def _axes(ranks) -> dict[str, int]:
    """A case's mesh: ``ranks`` ranks on one dp axis, or the axes given."""
    return dict(ranks) if isinstance(ranks, dict) else {"dp": ranks}


def _step(cfg, ranks, recompute: str, compile: bool = False, grad: str = "autograd"):
    """The case's shard_step: FSDP over the data axes, tensor parallel over a tp axis."""
    mesh = hpf.Mesh(_axes(ranks))
    specs, data = layout(gpt, cfg, mesh.axis_names)
    tp = {"tp_axis": TP_AXIS} if TP_AXIS in mesh.axis_names else {}
    return hpf.shard_step(gpt.loss_for(cfg, recompute, compile=compile, **tp), mesh=mesh, param_specs=specs,
                          fsdp_axes=data, optimizer=hpf.optim.adamw(lr=1e-3), grad=grad)


def predicted(config: str, ranks, local_batch: int, recompute: str, reduce_copies: int = 2
              ) -> hpf.memory.StepMemory:
    """The model's peak, as hpf plan predicts it (``ranks``: a count, or a mesh's axes; ``local_batch``:
    sequences per rank, per tp group with a tp axis); ``reduce_copies=0``: as if each reduction
    landed the moment it was issued."""
    cfg = gpt.CONFIGS[config]
    mesh = hpf.Mesh(_axes(ranks))
    specs, data = layout(gpt, cfg, mesh.axis_names)
    plan = step_plan(gpt.init(cfg, device="meta"), mesh, specs, data)
    tp = {"tp": plan.compute_size} if plan.compute_size > 1 else {}
    return step_memory(PlanReport.of(plan), plan, gpt.activations(cfg, local_batch, **tp), recompute=recompute,
                       comm="flat", reduce_copies=reduce_copies)


def _peak(prof, steps_range: str) -> int:
    """The highest live total of this thread's tensor allocations inside the range ``steps_range``."""
    from torch._C._profiler import _EventType

    allocs, span = [], None

    def walk(e):
        nonlocal span
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            allocs.append((e.start_time_ns, e.extra_fields.alloc_size))
        elif e.name == steps_range:
            span = (e.start_time_ns, e.end_time_ns)
        for child in e.children:
            walk(child)
    for e in prof.profiler.kineto_results.experimental_event_tree():
        walk(e)
    live = peak = 0
    for t, n in sorted(allocs):
        live += n
        if span[0] <= t <= span[1]:
            peak = max(peak, live)
    return peak


def measure(rank: int, config: str, ranks, local_batch: int, recompute: str, steps: int, out: str,
            compile: bool = False, grad: str = "autograd") -> None:
    """Write this rank's measured peak during ``steps`` steps to ``out``/rank<r>.json (``compile``:
    blocks torch.compile'd, compiled by an unprofiled step first; ``grad``: shard_step's)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from hpf import train_state

    # the profiler sees torch's allocator only: state buffers made as fresh pages (train_state.zeros)
    # would hold the same bytes unseen, so here they come from the allocator too
    train_state.FRESH_PAGES_BYTES = float("inf")
    cfg = gpt.CONFIGS[config]
    step = _step(cfg, ranks, recompute, compile, grad)
    params = gpt.init(cfg)
    mesh = hpf.Mesh(_axes(ranks))
    data = data_axes(mesh.axis_names)  # (a tp group reads one share)
    reader, readers = mesh.group_index(data, rank), mesh.axis_size(data)
    batches = [gpt.global_batch(cfg, local_batch * readers, 0, i)[reader * local_batch:(reader + 1) * local_batch]
               for i in range(steps)]
    if compile:  # (compiling allocates, and is not a step's memory)
        state = step.init(params)
        state, _ = step(state, batches[0])
        params = step.full_params(state)
        step = _step(cfg, ranks, recompute, True, grad)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        state = step.init(params)  # (its transient: every unit's buffer made, then freed, before the steps)
        del params
        with record_function("memory_model/steps"):
            for b in batches:
                state, _ = step(state, b)
    Path(out, f"rank{rank}.json").write_text(json.dumps(_peak(prof, "memory_model/steps")))


def measured_peak(config: str, ranks, local_batch: int, recompute: str = "none", steps: int = 2, *,
                  compile: bool = False, grad: str = "autograd") -> int:
    """The largest of the ranks' measured peaks (``measure``'s options)."""
    import tempfile

    world = hpf.Mesh(_axes(ranks)).size
    with tempfile.TemporaryDirectory() as tmp:
        hpf.launch(measure, world, config, ranks, local_batch, recompute, steps, tmp, compile, grad)
        return max(json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny and small on 2 ranks, small on dp=2,tp=2")
    ap.add_argument("--tp-only", action="store_true", help="the tensor-parallel cases only")
    ap.add_argument("--json", type=Path, help="write the results here (docs/results/memory_model.json)")
    args = ap.parse_args()
    rows = []
    for config, ranks, local in (QUICK if args.quick else TP if args.tp_only else CASES):
        for recompute in ("none", "all"):
            meas = measured_peak(config, ranks, local, recompute, steps=3)
            pred = predicted(config, ranks, local, recompute)
            landed = predicted(config, ranks, local, recompute, reduce_copies=0).total
            mesh = ",".join(f"{a}={n}" for a, n in ranks.items()) if isinstance(ranks, dict) else f"{ranks}r"
            case = f"{config}/{mesh}/b{local}/{recompute}"
            print(f"{case:<24} predicted {pred.total / 2**20:9.2f} MiB  measured {meas / 2**20:9.2f} MiB  "
                  f"ratio {pred.total / meas:.3f}  (every reduction landed at once: {landed / 2**20:.2f} MiB)  "
                  f"peak at {pred.format()}", flush=True)
            report_ratio(f"memory/{case.replace('/', '-').replace(',', '-').replace('=', '')}",
                         max(pred.total / meas, meas / pred.total), "<=1.15")
            rows.append({"case": case, "config": config, "ranks": ranks, "local_batch": local, "recompute": recompute,
                         "predicted": pred.total, "landed": landed, "measured": meas, "when": pred.when,
                         "parts": pred.parts})
    if args.json:
        write_results(args.json, {"cases": rows}, quick=args.quick)


if __name__ == "__main__":
    main()
