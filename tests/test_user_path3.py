"""What a new user ran into (issue 31, "the user's path, third pass"): one test per item, each run
the way a user runs it (a subprocess of `hpf`) where it can be. The README's own checks (set-up,
contract, option table, notebooks, the real run's figures) are in test_docs.py."""
import inspect
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

import hpf
from test_user_path import NO_MATPLOTLIB, hpf_cmd, one_error_line

ROOT = Path(__file__).resolve().parent.parent
CALIBRATION = ROOT / "docs" / "simulate" / "validation" / "calib_small_0.json"  # small/2 on 2 and 4 ranks


def losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


# 1 -- `hpf: command not found` -------------------------------------------------------------------
@pytest.mark.slow
def test_the_hpf_command_is_installed_beside_the_environments_python():
    """The README's set-up puts `hpf` in .venv/bin and says to activate it (test_docs checks the text)."""
    proc = subprocess.run([str(Path(sys.executable).parent / "hpf"), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "{train,prepare,plan,simulate,calibrate,eval,export,generate}" in proc.stdout


# 2 -- submodules after `import hpf`; a fast `hpf --help` -----------------------------------------
@pytest.mark.slow
def test_import_hpf_reaches_every_submodule_without_importing_torch_up_front():
    code = ("import sys, hpf; assert 'torch' not in sys.modules, 'import hpf imported torch'; "
            "print(hpf.checkpoint.load_params.__name__, hpf.data.TokenData.__name__, sorted(hpf.models.MODELS), "
            "'checkpoint' in dir(hpf))")
    proc = hpf_cmd(code=code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["load_params", "TokenData", "['gpt',", "'llama',", "'moe']", "True"]


@pytest.mark.slow
def test_hpf_help_imports_no_torch_and_answers_fast():
    code = ("import sys, time; t = time.perf_counter(); from hpf.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, time.perf_counter() - t, file=sys.stderr)")
    proc = hpf_cmd(code=code)
    imported, seconds = proc.stderr.split()
    assert imported == "False" and "train" in proc.stdout and "calibrate" in proc.stdout
    assert float(seconds) < 0.5  # without torch it is tens of ms; importing torch alone takes over 1 s here


# 3 -- no default ends a healthy long run; a hung collective does end ------------------------------
def test_launch_and_train_have_no_default_wall_clock_limit():
    assert inspect.signature(hpf.launch).parameters["timeout"].default is None
    from hpf.cli import build_parser
    train = next(a for a in build_parser("train")._actions if a.dest == "command").choices["train"]
    assert train.get_default("timeout") is None
    assert hpf.launcher.COLLECTIVE_TIMEOUT_S > 0


def _late_peer(rank: int) -> None:
    if rank == 1:
        time.sleep(60)  # hangs, as far as rank 0 can tell
    dist.barrier()


@pytest.mark.slow
def test_a_collective_that_waits_too_long_for_a_peer_ends_the_run():
    started = time.perf_counter()
    with pytest.raises(hpf.launch.RankError) as info:
        hpf.launch(_late_peer, 2, collective_timeout=3)
    assert info.value.rank == 0 and time.perf_counter() - started < 40
    assert "timed out" in info.value.child_traceback.lower() or "timeout" in info.value.child_traceback.lower()


# 4 -- a failed run no longer locks its --out folder ------------------------------------------------
@pytest.mark.slow
def test_a_run_that_stopped_before_its_first_checkpoint_starts_again_in_the_same_folder(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"status": "failed: RankError"}))
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 4.2}\n' * 3)
    proc = hpf_cmd("train", "--world-size", 1, "--steps", 2, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert "stopped at step 3 (failed: RankError) before its first checkpoint; it starts again from step 1" in proc.stdout
    assert len(losses(out)) == 2 and json.loads((out / "run.json").read_text())["status"] == "done"


# 5 and 10 -- resume from run.json alone; checkpoints are announced and listed ---------------------
@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 4-step run on 2 ranks with a checkpoint every 2 steps: its folder and its stdout."""
    out = tmp_path_factory.mktemp("finished") / "run"
    proc = hpf_cmd("train", "--world-size", 2, "--steps", 4, "--save-every", 2, "--batch-size", 8, "--out", out)
    assert proc.returncode == 0, proc.stderr
    return out, proc.stdout


@pytest.fixture()
def interrupted(finished, tmp_path):
    """A copy of the finished run as if it had been stopped after step 3: the newest checkpoint is step 2."""
    out = tmp_path / "run"
    shutil.copytree(finished[0], out)
    shutil.rmtree(out / "checkpoints" / "step_000004")
    run = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**run, "status": "interrupted"}))
    (out / "metrics.jsonl").write_text("".join((finished[0] / "metrics.jsonl").read_text().splitlines(True)[:3]))
    return out


@pytest.mark.slow
def test_resume_needs_only_the_folder_and_repeats_the_uninterrupted_run(finished, interrupted):
    proc = hpf_cmd("train", "--out", interrupted, "--resume")
    assert proc.returncode == 0, proc.stderr
    assert f"resuming from {interrupted / 'checkpoints' / 'step_000002'}" in proc.stdout
    assert "mesh dp=2" in proc.stdout.splitlines()[0]  # the mesh, like every option, came from run.json
    assert "done: 2 steps" in proc.stdout and "(steps 3-4, resumed)" in proc.stdout
    assert losses(interrupted) == losses(finished[0])  # bitwise, on the same mesh


@pytest.mark.slow
@pytest.mark.parametrize("flag, value", [("--optimizer", "muon"), ("--model", "llama"), ("--schedule", "cosine"),
                                         ("--lr", "0.5")])
def test_resume_names_an_option_that_would_change_the_run(interrupted, flag, value):
    proc = hpf_cmd("train", "--out", interrupted, "--resume", flag, value)
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert f"{flag} {value} differs from the run's" in line, line


@pytest.mark.slow
def test_resuming_a_finished_run_with_a_changed_option_is_refused(finished):
    """Issue 38 item 7: "complete; nothing to do" must not hide a changed --lr."""
    proc = hpf_cmd("train", "--out", finished[0], "--resume", "--lr", "0.5")
    assert proc.returncode == 2 and "--lr 0.5 differs from the run's 0.01" in one_error_line(proc)


@pytest.mark.slow
def test_resuming_a_finished_run_says_so_and_does_nothing(finished):
    before = (finished[0] / "metrics.jsonl").read_text()
    proc = hpf_cmd("train", "--out", finished[0], "--resume")
    assert proc.returncode == 0 and proc.stdout.strip() == f"hpf train: the run in {finished[0]} is complete (4 steps); nothing to do"
    assert (finished[0] / "metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_resume_may_train_a_finished_run_further_and_says_so(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished[0], out)
    proc = hpf_cmd("train", "--out", out, "--resume", "--steps", 6)
    assert proc.returncode == 0, proc.stderr
    assert "--steps 6 changes the run's 4 steps" in proc.stdout and len(losses(out)) == 6
    assert losses(out)[:4] == losses(finished[0])


@pytest.mark.slow
def test_each_checkpoint_is_announced_and_the_summary_lists_the_newest(finished):
    out, stdout = finished
    for step in (2, 4):
        assert f"checkpoint  step {step} -> {out / 'checkpoints' / f'step_{step:06d}'}" in stdout
    files = stdout.split("  files ", 1)[1]
    assert f"{out / 'checkpoints' / 'step_000004'} (the newest checkpoint)" in files


# 6 -- an error inside a rank is one line; the traceback goes to the run folder ------------------------
@pytest.mark.slow
def test_an_error_inside_a_rank_is_one_line_and_its_traceback_is_kept(tmp_path):
    (tmp_path / "not-a-checkpoint").mkdir()
    out = tmp_path / "run"
    proc = hpf_cmd("train", "--world-size", 1, "--steps", 2, "--resume", tmp_path / "not-a-checkpoint", "--out", out)
    assert proc.returncode == 1
    line = one_error_line(proc)
    assert "rank 0 failed: hpf.checkpoint.CheckpointError" in line and f"(traceback: {out / 'error.log'})" in line
    assert "Traceback" in (out / "error.log").read_text()
    assert json.loads((out / "run.json").read_text())["status"] == "failed: CheckpointError"  # the rank's, by type
    debug = hpf_cmd("train", "--world-size", 1, "--steps", 2, "--resume", tmp_path / "not-a-checkpoint",
                    "--out", tmp_path / "run2", "--debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr


@pytest.mark.slow
@pytest.mark.parametrize("argv, names", [(["--lr", "nan"], "--lr: 'nan' is not a finite number"),
                                         (["--trace", "/proc/hpf-cannot/trace"], "--trace /proc/hpf-cannot/trace cannot be made")])
def test_arguments_that_would_fail_inside_a_rank_are_one_line_before_it_starts(argv, names, tmp_path):
    proc = hpf_cmd("train", "--world-size", 1, "--steps", 1, "--out", tmp_path / "run", *argv)
    assert proc.returncode == 2
    assert names in one_error_line(proc)


# 7 -- hpf simulate warns when it extrapolates, and says how far --------------------------------------
@pytest.mark.slow
def test_simulate_warns_when_a_shape_was_not_calibrated_and_by_how_far():
    far = hpf_cmd("simulate", "--hardware", CALIBRATION, "--config", "small", "--local-batch", 8, "--world-size", 2)
    assert far.returncode == 0, far.stderr
    (warning,) = far.stderr.strip().splitlines()
    assert warning.startswith("hpf: warning: compute of small at 8 sequences per rank on 2 ranks is not calibrated")
    assert "4.0x those of the nearest calibrated shape (small/2)" in warning
    assert "hpf calibrate --shapes small/8 --world-sizes 2" in warning
    near = hpf_cmd("simulate", "--hardware", CALIBRATION, "--config", "small", "--local-batch", 2, "--world-size", 2)
    assert near.returncode == 0 and near.stderr == ""


def test_compute_is_calibrated_per_model_and_precision_and_a_bf16_run_on_fp32_figures_is_named():
    """A GPT's calibrated block does not stand in for a MoE's of the same config name, and a bf16
    run takes its own figures (CPU bf16 is faster for a GPT block, slower for a tiny MoE)."""
    hw = hpf.sim.load_calibration(CALIBRATION)
    gpt_fp32 = hw.compute["small/2/2"]
    assert hpf.sim.calibrated_compute(hw, "gpt", "small", 2, 2) is gpt_fp32
    assert hpf.sim.calibrated_compute(hw, "moe", "small", 2, 2) is None  # another model: FLOPs, with a warning
    assert any("compute of moe:small at 2 sequences" in w and "--shapes moe:small/2" in w
               for w in hpf.sim.extrapolation("small", 2, 2, hw, "moe"))
    # fp32 only: a bf16 run falls back to the fp32 figures and says so
    assert hpf.sim.calibrated_compute(hw, "gpt", "small", 2, 2, "bf16") is gpt_fp32
    (note,) = hpf.sim.extrapolation("small", 2, 2, hw, "gpt", "bf16")
    assert "calibrated in fp32 only" in note
    bf16 = {"block_s": gpt_fp32["block_s"] / 2, "root_s": gpt_fp32["root_s"], "skew": 0.0}
    hw = hw.replace(compute={**hw.compute, "small/2/2/bf16": bf16})
    assert hpf.sim.extrapolation("small", 2, 2, hw, "gpt", "bf16") == []
    fp32, half = (hpf.sim.simulate("small", {"dp": 2}, hw, local_batch=2, topology="flat", mixed_precision=p)
                  for p in (None, "bf16"))
    assert half.compute_s < 0.8 * fp32.compute_s  # the bf16 figures, not fp32's


def test_extrapolation_names_uncalibrated_rank_counts():
    warnings = hpf.sim.extrapolation("small", 2, 8, hpf.sim.load_calibration(CALIBRATION))
    assert any("small/2 was measured on 2, 4 ranks only" in w for w in warnings), warnings
    assert any("links were calibrated on 2, 4 ranks; 8 ranks (2.0x the largest)" in w for w in warnings), warnings
    assert hpf.sim.extrapolation("1b", 1, 768, hpf.sim.hardware("cloudmatrix384")) == []  # published: no calibration


# 8 -- what the docs say is what the output shows ------------------------------------------------------
@pytest.mark.slow
def test_simulates_hpf_vs_column_is_hpfs_step_against_that_rows():
    proc = hpf_cmd("simulate", "--config", "1b", "--mesh", "node=48,local=16", "--hardware", "cloudmatrix384",
                   "--mixed-precision", "bf16", "--local-batch", 1)
    rows = {r[1]: r for r in (line.split() for line in proc.stdout.splitlines()) if r[:1] == ["768"]}
    assert rows["hpf"][6] == "-"
    for name in ("fsdp2", "ddp"):
        want = float(rows["hpf"][2]) / float(rows[name][2]) - 1
        assert float(rows[name][6].rstrip("%")) / 100 == pytest.approx(want, abs=6e-4) and want < 0


@pytest.mark.slow
def test_simulate_plot_without_matplotlib_warns_and_goes_on(tmp_path):
    proc = hpf_cmd("simulate", "--config", "tiny", "--sweep", "16,32", "--hardware", "h100", "--plot", tmp_path / "p",
                   code=NO_MATPLOTLIB)
    assert proc.returncode == 0, proc.stderr
    (warning,) = proc.stderr.strip().splitlines()
    assert "--plot skipped" in warning and "matplotlib" in warning
    assert "hpf vs" in proc.stdout and not (tmp_path / "p").exists()


@pytest.mark.slow
def test_attribution_reads_a_trace_that_train_wrote(tmp_path):
    """hpf train --trace writes rank<r>.json; attribution.py --read splits its steps by category."""
    step = {"ph": "X", "cat": "hpf", "name": "hpf/step", "pid": 0, "tid": 1, "ts": 0.0, "dur": 1000.0}
    events = [step, {**step, "name": "hpf/forward blocks/0", "ts": 100.0, "dur": 400.0},
              {**step, "name": "hpf/wait all-gather", "ts": 600.0, "dur": 200.0},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 0, "tid": 1, "ts": 100.0, "dur": 300.0}]
    (tmp_path / "rank0.json").write_text(json.dumps({"traceEvents": events}))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attribution.py"), "--read",
                           str(tmp_path / "rank0.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ms = {line.split()[0]: line.split()[-1] for line in proc.stdout.splitlines()[2:] if line.split()}
    assert float(ms["step"]) == 1.0 and float(ms["compute"]) == pytest.approx(0.3, abs=0.01)


@pytest.mark.slow
def test_trace_prints_no_profiler_log_lines(tmp_path):
    proc = hpf_cmd("train", "--world-size", 1, "--steps", 4, "--trace", "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    assert "USDT" not in proc.stdout + proc.stderr
    assert (tmp_path / "run" / "trace" / "trace.json").is_file()


def test_the_banner_names_gradient_accumulation():
    from hpf.cli.job import TrainJob
    from hpf.cli.train import _banner

    job = TrainJob(config="tiny", axes={"dp": 2}, fsdp_axes=None, optimizer="adamw", lr=0.01, steps=2, batch_size=8,
                   mode="production", seed=0, mixed_precision=None, topology="flat", hsdp=False, metrics_path="m",
                   accumulate=2)
    assert "2 micro-batches per step" in _banner(job, 4)
    assert "micro-batches" not in _banner(TrainJob(**{**job.__dict__, "accumulate": 1}), 4)


# 9 -- hpf prepare refuses what it used to accept silently ---------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("case, names", [("binary", "is not a text file (a NUL byte at byte"),
                                         ("empty", "hold no text (0 bytes)"),
                                         ("tiny", "are too few: holding out 0.05 of them for validation needs at least 40")])
def test_prepare_refuses_binary_empty_and_too_little_text(case, names, tmp_path):
    source = tmp_path / "input"
    source.write_bytes({"binary": b"\x7fELF\x02\x01\x01\x00" * 64, "empty": b"", "tiny": b"hello"}[case])
    proc = hpf_cmd("prepare", source, "--out", tmp_path / "data")
    assert proc.returncode == 2
    assert names in one_error_line(proc)
    assert not (tmp_path / "data").exists()


@pytest.mark.slow
def test_prepare_does_not_overwrite_a_token_folder_unless_asked(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("some text to tokenize, long enough for both splits. " * 20)
    assert hpf_cmd("prepare", text, "--out", tmp_path / "data").returncode == 0
    again = hpf_cmd("prepare", text, "--out", tmp_path / "data")
    assert again.returncode == 2 and "already holds token files" in one_error_line(again)
    assert hpf_cmd("prepare", text, "--out", tmp_path / "data", "--overwrite").returncode == 0


# 11 -- a warmup longer than the run is refused ---------------------------------------------------------
@pytest.mark.slow
def test_a_warmup_that_outlasts_the_run_is_refused():
    proc = hpf_cmd("train", "--warmup", 500, "--steps", 5)
    assert proc.returncode == 2
    assert "--warmup 500 is not below --steps 5" in one_error_line(proc)


# 12 -- --tensorboard writes the scalars of metrics.jsonl ------------------------------------------------
@pytest.mark.slow
def test_tensorboard_gets_the_same_scalars_as_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    proc = hpf_cmd("train", "--world-size", 1, "--steps", 3, "--tensorboard", "--out", out)
    assert proc.returncode == 0, proc.stderr
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert set(events.Tags()["scalars"]) == set(records[0]) - {"step"}
    for key in ("loss", "grad_norm", "tokens_per_s"):
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        assert logged == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in records], key


@pytest.mark.slow
def test_tensorboard_without_its_package_is_one_line_before_the_run(tmp_path):
    code = ("import sys; sys.modules['tensorboard'] = None; from hpf.cli import main; "
            "raise SystemExit(main())")
    proc = hpf_cmd("train", "--world-size", 1, "--steps", 1, "--tensorboard", "--out", tmp_path / "run", code=code)
    assert proc.returncode == 2
    assert "--tensorboard needs the tensorboard package" in one_error_line(proc)
    assert not (tmp_path / "run").exists()


# calibration and the benchmarks --------------------------------------------------------------------------
@pytest.mark.slow
def test_calibrate_is_a_command_that_says_each_stage(tmp_path):
    out = tmp_path / "calib.json"
    proc = hpf_cmd("calibrate", "--out", out, "--world-sizes", 2, "--shapes", "tiny/1", "moe:tiny/1", "--reps", 1,
                   "--launches", 1)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    stages = [line for line in lines if line.startswith("calibrate  [")]
    assert [re.match(r"calibrate  \[(\d+)/8\]", s)[1] for s in stages] == [str(i) for i in range(1, 9)]
    assert len(lines) == len(stages) + 2 and lines[-2].startswith(f"wrote {out}")  # no JSON dump
    # each model and compute precision measured on its own (a GPT's and fp32's keys carry no tag)
    assert hpf.sim.load_calibration(out).compute.keys() == {"tiny/1/2", "tiny/1/2/bf16", "moe:tiny/1/2",
                                                            "moe:tiny/1/2/bf16"}


@pytest.mark.slow
def test_bench_is_a_repository_tool_not_an_hpf_command():
    assert hpf_cmd("bench").returncode == 2
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--help"], capture_output=True,
                          text=True, cwd="/")
    assert proc.returncode == 0 and "--json" in proc.stdout


def test_no_history_narratives_in_the_simulator_and_cli_sources():
    stale = ("earlier protocol", "the old model", "made before the term existed", "were predicted at",
             "(then)", "started above ln V")
    for path in [*(ROOT / "hpf" / "sim").glob("*.py"), *(ROOT / "hpf" / "cli").glob("*.py")]:
        text = path.read_text()
        assert not re.search(r"\b20\d\d-\d\d\b", text), path
        assert not [s for s in stale if s in text], path
