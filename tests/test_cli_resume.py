"""Resuming `hpf train` from its run folder: the same run as an uninterrupted one, and a changed
option named before anything runs."""
import json
import shutil

import pytest
from cli_helpers import losses, hpf_cmd, one_error_line


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


def test_every_train_option_is_a_flag_and_a_run_records_it():
    """hpf.jobspec declares each option once, with what --resume does with it: each is a flag of
    `hpf train`, and a run's run.json (options_of) records each, so a resume can keep or refuse it."""
    from hpf import jobspec
    from hpf.cli import build_parser, run_folder

    train = build_parser("train")
    args = train.parse_args(["train", "--mesh", "dp=2"])
    flags = {a.dest for a in train._subparsers._group_actions[0].choices["train"]._actions}
    options = set(jobspec.defaults("train"))
    assert options <= flags, options - flags
    assert set(jobspec.resumed(jobspec.FIXED)) | set(jobspec.resumed(jobspec.INHERITED)) == set(jobspec.resumed())
    assert set(jobspec.resumed()) == options
    assert {"lr", "steps", "data"} <= set(jobspec.resumed(jobspec.FIXED)) and "compile" in jobspec.resumed(jobspec.INHERITED)
    assert set(run_folder.options_of(args)) == {"mesh", *options}, run_folder.options_of(args)


def _damaged_run_folder(root, run_json: str):
    """A run folder with intact checkpoints (named as hpf train names them) and ``run_json`` as its run.json."""
    out = root / "run"
    (out / "checkpoints" / "step_000004").mkdir(parents=True)
    for name in ("hpf.json", ".metadata"):
        (out / "checkpoints" / "step_000004" / name).write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 4.2}\n' * 4)
    (out / "run.json").write_text(run_json)
    return out


@pytest.mark.parametrize("damage", ["truncated", "not an object", "options retyped"])
def test_a_damaged_run_json_is_refused_naming_it(tmp_path, damage):
    """Issue 55 item 12: `hpf train --out DIR --resume` with a truncated run.json went on with the
    defaults (lr 0.01, batch 32, constant, seed 0) instead of the run's, and exited 0."""
    from hpf.cli import run_folder
    from hpf.cli.command import build_parser
    from hpf.cli.common import CliError

    whole = json.dumps({"status": "interrupted", "options": {"lr": 0.002, "batch_size": 16, "schedule": "cosine",
                                                             "seed": 5, "steps": 8}})
    text = {"truncated": whole[:len(whole) // 2], "not an object": "[1, 2]",
            "options retyped": whole.replace('{"lr"', '["lr"').replace('"steps": 8}', '"steps", 8]')}[damage]
    out = _damaged_run_folder(tmp_path, text)
    args = build_parser("train").parse_args(["train", "--out", str(out), "--resume"])
    with pytest.raises(CliError, match=rf"{out / 'run.json'} is damaged .*restore it from a backup"):
        run_folder.resolve(args, out, args.fresh)


@pytest.mark.slow
def test_resume_with_a_truncated_run_json_exits_2_naming_it(interrupted):
    """Item 12, as a user runs it."""
    text = (interrupted / "run.json").read_text()
    (interrupted / "run.json").write_text(text[:len(text) // 2])
    proc = hpf_cmd("train", "--out", interrupted, "--resume")
    assert proc.returncode == 2, proc.stdout
    assert f"{interrupted / 'run.json'} is damaged" in one_error_line(proc)
