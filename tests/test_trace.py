"""hpf.trace: spans from every thread land in torch's Chrome trace; off, they record nothing."""
import json
import threading
import pytest

import torch

from hpf import trace


def _names(path):
    with open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("cat") == "hpf"]


def test_spans_from_all_threads_in_the_traced_steps_only(tmp_path):
    out = tmp_path / "t.json"

    def worker():
        with trace.span("hpf/worker"):
            torch.ones(8).sum()
    with trace.tracing(out, skip_steps=1, steps=2) as advance:
        for i in range(5):
            with trace.span(f"hpf/step{i}"):
                torch.ones(8).sum()
                t = threading.Thread(target=worker)
                t.start()
                t.join()
            advance()
    events = _names(out)
    assert sorted({e["name"] for e in events}) == ["hpf/step1", "hpf/step2", "hpf/worker"]
    assert len({e["tid"] for e in events}) == 3  # the main thread and two workers
    torch_ops = [e for e in json.load(open(out))["traceEvents"] if e.get("cat") == "cpu_op"]
    assert torch_ops, "torch's own ops are missing from the trace"
    step1 = next(e for e in events if e["name"] == "hpf/step1")
    assert any(step1["ts"] <= o["ts"] <= step1["ts"] + step1["dur"] for o in torch_ops), \
        "hpf's spans and torch's ops are not on one clock"


def test_off_records_nothing():
    assert trace.span("hpf/x") is trace.span("hpf/y")  # the shared no-op
    with trace.span("hpf/x"):
        pass
    assert trace._events == []


def test_merge_gives_one_process_per_rank(tmp_path):
    paths = []
    for r in range(2):
        p = tmp_path / f"r{r}.json"
        with trace.tracing(p, skip_steps=0, steps=1) as advance:
            with trace.span(f"hpf/rank{r}"):
                torch.ones(4).sum()
            advance()
        paths.append(p)
    merged = json.load(open(trace.merge_traces(paths, tmp_path / "all.json")))["traceEvents"]
    spans = {e["name"]: e["pid"] for e in merged if e.get("cat") == "hpf"}
    assert spans == {"hpf/rank0": 0, "hpf/rank1": 1}
    names = {e["pid"]: e["args"]["name"] for e in merged if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}


def test_ranges_are_back_to_back_and_details_join_the_name(tmp_path):
    out = tmp_path / "r.json"
    phases = trace.Ranges()
    phases.switch("hpf/off")  # tracing is off: nothing is opened
    with trace.tracing(out, skip_steps=0, steps=1) as advance:
        with trace.span("hpf/gather", "blocks/0"):
            phases.switch("hpf/forward", "blocks/0")
            phases.switch("hpf/forward", "blocks/1")
            phases.end()
        advance()
    events = sorted(_names(out), key=lambda e: (e["ts"], e["name"]))
    assert [e["name"] for e in events] == ["hpf/gather blocks/0", "hpf/forward blocks/0", "hpf/forward blocks/1"]
    first, second = events[1], events[2]
    assert abs(first["ts"] + first["dur"] - second["ts"]) < 1e-3, "the ranges are not back to back"


def _profiled_steps(rank):
    """60 steps of tiny GPT under torch's profiler (the engine's saved-tensor hooks on: tiny's
    blocks are freed between reads), each reduction polled during backward."""
    from torch.profiler import ProfilerActivity, profile

    import hpf
    from hpf.models import gpt

    cfg = gpt.CONFIGS["tiny"]
    step = hpf.shard_step(gpt.loss_for(cfg), mesh=hpf.Mesh({"dp": 2}), optimizer=hpf.optim.adamw(lr=1e-3))
    state = step.init(gpt.init(cfg))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        for i in range(60):
            state, metrics = step(state, gpt.global_batch(cfg, 16, 0, i)[rank * 8:(rank + 1) * 8])
    return float(metrics["loss"])


@pytest.mark.slow
def test_profiled_steps_do_not_deadlock_on_polled_collectives():
    """Under torch's profiler, gloo finishes a Work holding the lock Work.is_completed() takes
    and then needs the GIL: polling a collective issued inside saved-tensor hooks that way hung
    a rank in about one of 25 steps (seen in benchmarks/memory_model.py). The engine polls the
    Work's future instead."""
    from hpf.launcher import launch

    losses = launch(_profiled_steps, 2, timeout=120)
    assert losses[0] == losses[1] and losses[0] == losses[0]  # the same on both ranks, not nan
