"""The `hpf` command: train writes sane metrics and learns, plan reports any mesh, the benchmark
runner tabulates ratios, and bad arguments cost one line of stderr."""
import dataclasses
import io
import json
import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hpf
from hpf import cli
from hpf.cli.job import run_keys
from hpf.models import gpt, llama
from hpf.progress import Progress
from cli_helpers import hpf_cmd
from references import functional_training

REPO = Path(__file__).resolve().parent.parent
FIELDS = {"step", "loss", "grad_norm", "skipped", "step_s", "comm_wait_s", "optimizer_s", "compile_s", "tokens_per_s",
          "lr", "peak_memory_bytes"}  # and "mfu" where this machine has a calibration


def run_main(argv, capsys):
    """(exit code, stdout, stderr) of `hpf <argv>` run in this process."""
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_train_writes_metrics_plots_and_the_loss_falls(tmp_path):
    steps, batch, seed = 25, 16, 3
    out = tmp_path / "run"
    proc = hpf_cmd("train", "--world-size", 2, "--steps", steps, "--batch-size", batch, "--seed", seed, "--out", out,
                   "--plot", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(set(r) - {"mfu"} == FIELDS for r in records)

    # Step 1's loss is the loss of the seeded init on step 0's global batch, computed here in one
    # process with plain torch: the CLI trains the model, data and seed it says, and reports the
    # global mean. 1e-5 relative: the same fp32 math, summed over 2 half-batches in another order.
    config = gpt.CONFIGS["tiny"]
    reference = gpt.loss_for(config)(gpt.init(config, run_keys(seed)[0]),
                                     gpt.global_batch(config, batch, seed, 0))
    assert records[0]["loss"] == pytest.approx(reference.item(), rel=1e-5)
    # It learns: from ln(vocab) ~ 4.2 (a uniform guess) to well below it in 25 steps.
    assert records[0]["loss"] == pytest.approx(math.log(config.vocab_size), rel=0.01)
    assert sum(r["loss"] for r in records[-5:]) / 5 < 0.75 * records[0]["loss"]

    for r in records:
        assert r["tokens_per_s"] == pytest.approx(batch * config.seq_len / r["step_s"], rel=1e-9)
        assert 0 <= r["comm_wait_s"] <= r["step_s"] and 0 <= r["optimizer_s"] <= r["step_s"]
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
    run = json.loads((out / "run.json").read_text())
    assert (run["config"], run["steps"], run["seed"], run["axes"]) == ("tiny", steps, seed, {"dp": 2})
    for png in ("loss.png", "step_breakdown.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert str(out / png) in proc.stdout
    assert f"done: {steps} steps" in proc.stdout
    assert f"{records[0]['loss']:.4f} (step 1) -> {records[-1]['loss']:.4f} (step {steps})" in proc.stdout


def _mib(text: str, label: str) -> float:
    return float(re.search(rf"{label}\s+([\d.]+) MiB", text)[1])


def _slow_and_fast_totals(text: str, row: str = "total") -> tuple[float, float]:
    fast, slow = re.search(rf"{row}\s+([\d.]+) MiB\s+([\d.]+) MiB", text).groups()
    return float(slow), float(fast)


def test_plan_at_768_ranks_reports_shards_and_totals(capsys):
    mesh = ["--config", "1b", "--mesh", "node=96,local=8"]
    code, out, err = run_main(["plan", *mesh], capsys)
    assert code == 0, err
    assert "768 ranks" in out
    # fp32 shards: the parameter count (from the config, not the plan) over 768 ranks, plus at
    # most 767 padding elements per flat bucket (one bucket per unit: 18 blocks + the root).
    exact = gpt.num_params(gpt.CONFIGS["1b"]) * 4 / 768 / 2**20
    assert exact - 0.01 <= _mib(out, r"params \(shards\)") <= exact + 19 * 767 * 4 / 2**20 + 0.01

    # Flat collectives send each shard to the 760 peers on other nodes over the slow tier;
    # two-tier ones only to the 95 with the same local index: 8x fewer slow-tier bytes, per
    # reduce-scatter (once a step on both; a two-tier unit of CPU ranks stays gathered in shared
    # memory through backward, so it is gathered once a step too, where flat gathers blocks again).
    code, flat, _ = run_main(["plan", *mesh, "--topology", "flat"], capsys)
    assert code == 0
    slow_two_tier, _ = _slow_and_fast_totals(out, "reduce_scatter")
    slow_flat, fast_flat = _slow_and_fast_totals(flat, "reduce_scatter")
    if not torch.accelerator.is_available():  # (CPU ranks: the shared-memory fast tier)
        assert _slow_and_fast_totals(out, "all_gather") == _slow_and_fast_totals(out, "reduce_scatter")
    assert slow_flat / slow_two_tier == pytest.approx(760 / 95, rel=1e-3)
    assert slow_flat / fast_flat == pytest.approx(760 / 7, rel=1e-3)

    code, bf16, _ = run_main(["plan", *mesh, "--mixed-precision", "bf16"], capsys)
    assert code == 0
    # bf16 compute halves what is gathered; the fp32 master shards stay as they were.
    assert _mib(bf16, "peak gathered units") == pytest.approx(_mib(out, "peak gathered units") / 2, abs=0.01)
    assert _mib(bf16, r"params \(shards\)") == _mib(out, r"params \(shards\)")


def test_plan_check_validates_the_whole_step_at_768_ranks(capsys):
    code, out, err = run_main(["plan", "--config", "tiny", "--mesh", "node=96,local=8", "--check"], capsys)
    assert code == 0, err
    n_tensors = len(hpf.tree.flatten(gpt.init(gpt.CONFIGS["tiny"], device="meta"))[1])
    assert re.search(rf"plan check OK on .*'node': 96, 'local': 8.*: {n_tensors} params, [1-9]\d* ops checked", out)


@pytest.mark.slow
def test_validate_mode_trains_the_same_model(tmp_path, capsys):
    code, out, err = run_main(["train", "--world-size", "1", "--steps", "2", "--mode", "validate",
                               "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert "validate mode" in out
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    config = gpt.CONFIGS["tiny"]
    reference = gpt.loss_for(config)(gpt.init(config, run_keys(0)[0]),
                                     gpt.global_batch(config, 32, 0, 0))
    assert first["loss"] == pytest.approx(reference.item(), rel=1e-6)  # same fp32 math, one process


@pytest.mark.slow
def test_dropout_option_draws_the_masks_of_the_runs_keys(tmp_path, capsys):
    code, out, err = run_main(["train", "--world-size", "1", "--steps", "2", "--dropout", "0.1",
                               "--out", str(tmp_path)], capsys)
    assert code == 0, err
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    config = gpt.CONFIGS["tiny"]
    init_key, dropout_key = run_keys(0)
    tokens = gpt.global_batch(config, 32, 0, 0)
    batch = {"tokens": tokens, "keys": hpf.random.example_keys(hpf.random.fold_in(dropout_key, 1), 0, 32)}
    params = gpt.init(config, init_key)
    with_dropout = gpt.loss_for(dataclasses.replace(config, dropout=0.1))(params, batch).item()
    assert first["loss"] == pytest.approx(with_dropout, rel=1e-6)
    assert first["loss"] != pytest.approx(gpt.loss_for(config)(params, tokens).item(), rel=1e-6)


def test_dropout_option_is_refused_where_it_cannot_act(tmp_path, capsys):
    for argv, says in ((["--dropout", "1.5"], "lies in [0, 1)"), (["--model", "moe", "--dropout", "0.1"], "no dropout")):
        code, _, err = run_main(["train", "--world-size", "1", "--steps", "1", *argv, "--out", str(tmp_path / "x")],
                                capsys)
        assert code == 2 and says in err


@pytest.mark.slow
def test_compile_option_compiles_once_reports_it_and_trains_the_same_model(tmp_path, capsys):
    code, out, err = run_main(["train", "--world-size", "2", "--steps", "3", "--compile", "--out", str(tmp_path)],
                              capsys)
    assert code == 0, err
    assert "compiled blocks" in out and "  compile " in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["compile_s"] > 0 and [r["compile_s"] for r in rows[1:]] == [0.0, 0.0]
    config = gpt.CONFIGS["tiny"]
    reference = gpt.loss_for(config)(gpt.init(config, run_keys(0)[0]),
                                     gpt.global_batch(config, 32, 0, 0))
    assert rows[0]["loss"] == pytest.approx(reference.item(), rel=1e-5)  # 2 ranks: the same terms, summed apart


@pytest.mark.slow
def test_model_option_trains_llama(tmp_path, capsys):
    code, out, err = run_main(["train", "--model", "llama", "--world-size", "1", "--steps", "1",
                               "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert "llama 'tiny'" in out
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    config = llama.CONFIGS["tiny"]
    reference = llama.loss_for(config)(llama.init(config, run_keys(0)[0]),
                                       gpt.global_batch(config, 32, 0, 0))
    assert first["loss"] == pytest.approx(reference.item(), rel=1e-6)


@pytest.mark.slow
def test_muon_option_trains_with_muon(tmp_path, capsys):
    code, _, err = run_main(["train", "--world-size", "1", "--steps", "2", "--optimizer", "muon",
                             "--out", str(tmp_path)], capsys)
    assert code == 0, err
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # Reference: one step of hpf.optim.muon on the full params with plain autograd, in this process.
    config = gpt.CONFIGS["tiny"]
    loss_fn, params = gpt.loss_for(config), gpt.init(config, run_keys(0)[0])
    adamw_lr, muon_lr, warmup = cli.TRAIN_DEFAULTS["tiny"]
    assert warmup == 0  # else step 1's lr is not the lr below
    optimizer = hpf.optim.muon(lr=muon_lr, adamw_lr=adamw_lr)
    ref_losses, _ = functional_training(loss_fn, params, lambda s: gpt.global_batch(config, 32, 0, s), optimizer, 2)
    assert losses[1] == pytest.approx(ref_losses[1], rel=1e-5)  # fp32; flat shards vs full tensors


@pytest.mark.parametrize("argv, names", [
    ([], "required"),
    (["train", "--steps", "0"], "--steps"),
    (["train", "--lr", "fast"], "--lr"),
    (["train", "--config", "huge"], "--config"),
    (["train", "--mesh", "node=2,local=x"], "--mesh"),
    (["plan", "--mesh", "node=0"], "--mesh"),
    (["train", "--world-size", "3", "--mesh", "node=2,local=2"], "--world-size"),
    (["train", "--batch-size", "6"], "--batch-size"),
    (["plan", "--fsdp-axes", "bogus"], "bogus"),  # raised by hpf.plan as a SpecError
    (["calibrate"], "--out FILE"),
    (["plan", "--model", "llama", "--config", "medium"], "not a llama config"),
    (["simulate", "--ep-axis", "local"], "--ep-axis local"),  # gpt has no experts
])
def test_bad_arguments_get_one_line_errors(argv, names, capsys):
    code, out, err = run_main(argv, capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("hpf") and "error:" in err and names in err and "Traceback" not in err


def test_a_finished_run_folder_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.jsonl").write_text("")
    (tmp_path / "b" / "run.json").write_text('{"status": "done"}')
    code, _, err = run_main(["train", "--out", str(tmp_path / "b")], capsys)
    assert code == 2 and err.count("\n") == 1 and "--out" in err and "finished run" in err


def test_mesh_argument_parses_outer_to_inner():
    assert list(cli.parse_mesh("node=96, local=8").items()) == [("node", 96), ("local", 8)]


@pytest.mark.slow
def test_benchmark_runner_tabulates_ratio_lines_writes_results_and_reports_failures(tmp_path):
    # report_ratio from the repository's benchmarks/common.py prints the lines run.py parses.
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "a_fast.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO / "benchmarks")!r})
        from common import report_ratio
        print("a free-form table line")
        report_ratio("hpf/fsdp2", 0.62, "<=0.70")
        report_ratio("pearson", 0.99999971, ">=0.999999")
        report_ratio("ns_batched/loop", 2.5, ">=3")
        report_ratio("quick_flag_seen", float("--quick" in sys.argv))
        """))
    (bench / "b_broken.py").write_text("raise SystemExit(3)  # report_ratio( is never reached\n")
    (bench / "c_tool.py").write_text("raise SystemExit('a tool that reports no ratio is not a benchmark')\n")
    runner = [sys.executable, str(REPO / "benchmarks" / "run.py"), "--dir", str(bench)]
    (bench / "d_figures.py").write_text(textwrap.dedent(f"""
        import argparse, sys
        sys.path.insert(0, {str(REPO / "benchmarks")!r})
        from common import report_ratio, write_results
        ap = argparse.ArgumentParser()
        ap.add_argument("--json")
        ap.add_argument("--quick", action="store_true")
        args = ap.parse_args()
        report_ratio("d/ratio", 0.5, "<=1")
        if args.json:
            write_results(args.json, {{"steps": [1, 2]}}, quick=args.quick)
        """))
    out = tmp_path / "results"
    proc = subprocess.run(runner + ["--quick", "--json", str(out)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # from any folder: it finds its siblings itself
    assert proc.returncode == 1 and "b_broken.py" in proc.stderr and "c_tool" not in proc.stdout
    table = proc.stdout[proc.stdout.index("benchmark  "):].splitlines()
    rows = {line.split()[1]: line.split()[2:] for line in table[2:] if len(line.split()) > 2}
    # --quick is a smoke run: its ratios are shown, not judged against their targets
    assert rows == {"hpf/fsdp2": ["0.620", "<=0.70", "smoke"], "pearson": ["0.9999997", ">=0.999999", "smoke"],
                    "ns_batched/loop": ["2.5", ">=3", "smoke"], "quick_flag_seen": ["1", "-"],
                    "d/ratio": ["0.5", "<=1", "smoke"]}
    # one results file per benchmark that finished, in one schema: the runner's from the ratios, or the script's own
    assert sorted(p.name for p in out.iterdir()) == ["a_fast.json", "d_figures.json"]
    a, d = (json.loads((out / name).read_text()) for name in ("a_fast.json", "d_figures.json"))
    for r, script in ((a, "a_fast.py"), (d, "d_figures.py")):
        assert r["schema"] == "hpf-benchmark/1" and r["benchmark"] == script and r["environment"]["quick"]
        assert r["command"].startswith(f"python benchmarks/{script} --quick")
        assert {"cores", "torch", "commit", "load_average_at_start"} <= r["environment"].keys()
    assert a["figures"] == {} and [(x["name"], x["target"]) for x in a["ratios"]][:3] == [
        ("hpf/fsdp2", "<=0.70"), ("pearson", ">=0.999999"), ("ns_batched/loop", ">=3")]
    assert d["figures"] == {"steps": [1, 2]} and d["ratios"] == [{"name": "d/ratio", "value": 0.5, "target": "<=1"}]
    assert "--json" in d["command"] and "--json" not in a["command"]
    proc = subprocess.run(runner + ["--json", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "give a folder" in proc.stderr

    proc = subprocess.run(runner + ["--only", "fast"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "b_broken" not in proc.stdout and "quick_flag_seen  0" in proc.stdout
    table = proc.stdout[proc.stdout.index("benchmark  "):].splitlines()
    rows = {line.split()[1]: line.split()[2:] for line in table[2:] if len(line.split()) > 2}
    assert rows["hpf/fsdp2"][-1] == "ok" and rows["pearson"][-1] == "ok" and rows["ns_batched/loop"][-1] == "MISS"


def test_progress_prints_about_ten_plain_lines_when_not_a_terminal():
    stream = io.StringIO()
    bar = Progress(25, label="train", stream=stream)
    for i in range(1, 26):
        bar.update(i, {"loss": f"{1 / i:.3f}"})
    bar.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert [int(re.search(r"(\d+)/25", line)[1]) for line in lines] == [1, *range(2, 25, 2), 25]
    assert "loss 0.040" in lines[-1]


def test_progress_redraws_one_line_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    bar = Progress(3, stream=stream)
    for i in range(1, 4):
        bar.update(i, {"loss": "1.0"})
    assert stream.getvalue().count("\r") == 3 and "\n" not in stream.getvalue()
    bar.close()
    assert stream.getvalue().endswith("\n") and "[" + "#" * 24 + "]" in stream.getvalue()


@pytest.mark.slow
def test_train_trace_writes_one_trace_per_rank_and_a_merged_one_with_hpf_ranges(tmp_path):
    out = tmp_path / "run"
    proc = hpf_cmd("train", "--world-size", 2, "--steps", 4, "--batch-size", 4, "--out", out, "--trace", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    folder = out / "trace"
    assert str(folder / "trace.json") in proc.stdout
    expected = {"hpf/step", "hpf/gather", "hpf/forward", "hpf/backward", "hpf/reduce-scatter bucket",
                "hpf/optimizer", "hpf/wait all-gather", "hpf/all-reduce the step's totals"}
    for r in range(2):
        events = json.loads((folder / f"rank{r}.json").read_text())["traceEvents"]
        names = {e["name"] for e in events if e.get("cat") == "hpf"}
        kinds = {n if n.startswith("hpf/wait") or n.startswith("hpf/all-reduce") else n.rsplit(" ", 1)[0]
                 for n in names}
        assert expected <= kinds, f"rank {r} lacks {expected - kinds}"
        assert sum(n == "hpf/step" for n in names) == 1 and \
            sum(e["name"] == "hpf/step" for e in events) == 2, "steps 3 and 4 only (2 warm-up steps skipped)"
        assert any(e.get("cat") == "cpu_op" for e in events), "torch's own ops are missing"
    merged = json.loads((folder / "trace.json").read_text())["traceEvents"]
    steps = [e for e in merged if e.get("name") == "hpf/step"]
    assert sorted(e["pid"] for e in steps) == [0, 0, 1, 1]
    # one clock: each rank's step 3 starts within a step of the other's
    s0, s1 = (min(e["ts"] for e in steps if e["pid"] == r) for r in (0, 1))
    assert abs(s0 - s1) < max(e["dur"] for e in steps)


@pytest.mark.slow
def test_sigterm_to_hpf_train_stops_the_ranks_and_leaves_nothing_behind(tmp_path):
    """What a scheduler sends: rc 143, one line, run.json "terminated", and no rendezvous folder or
    shared memory left (the ranks died silently, rc was -15 and run.json said "running")."""
    import os
    import signal
    import time

    temp = tmp_path / "tmp"
    temp.mkdir()
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    proc = subprocess.Popen([sys.executable, "-m", "hpf", "train", "--mesh", "dp=2", "--steps", "100000",
                             "--batch-size", "8", "--out", str(tmp_path / "run")], env={**os.environ, "TMPDIR": str(temp)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "run" / "metrics.jsonl").is_file() or not (tmp_path / "run" / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    assert os.listdir(temp)  # the ranks' rendezvous folder, while they run
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and err.strip().splitlines()[-1] == "hpf: terminated (SIGTERM): the ranks were stopped"
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "terminated"
    assert os.listdir(temp) == []

    def dead_hpf_segment(name):  # hpf_<pid>_...: a segment of a process that is gone
        parts = name.split("_")
        return parts[0] == "hpf" and len(parts) > 2 and parts[1].isdigit() and not os.path.exists(f"/proc/{parts[1]}")
    assert not [n for n in (set(os.listdir("/dev/shm")) if shm or os.path.isdir("/dev/shm") else set()) - shm
                if dead_hpf_segment(n)]
