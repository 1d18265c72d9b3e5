"""`hpf prepare` and `hpf train --model llama --data --eval-every`: the CLI trains the model on
the data it says, and its held-out loss is the loss of those params on the val split."""
import dataclasses
import json

import numpy as np
import pytest
import torch

import hpf
from hpf import data
from hpf.cli.train import EVAL_BATCHES
from hpf.cli.job import run_keys
from hpf.models import llama
from test_cli import run_main

LINES = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(400))


@pytest.fixture()
def token_dir(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text(LINES)
    (tmp_path / "src" / "skip.txt").write_text("not python")
    (tmp_path / "b.txt").write_text(LINES[::-1])
    code, out, err = run_main(["prepare", str(tmp_path / "src"), str(tmp_path / "b.txt"), "--glob", "*.py",
                               "--out", str(tmp_path / "tok"), "--val-fraction", "0.2"], capsys)
    assert code == 0, err
    assert "2 files" in out
    return tmp_path / "tok"


def test_prepare_takes_files_and_folders_by_glob(token_dir):
    meta = data.read_meta(token_dir)
    total = len(LINES) + 1 + len(LINES) + 1  # two documents, each + end-of-document
    assert meta["tokens"]["train"] + meta["tokens"]["val"] == total
    assert [p.rsplit("/", 1)[-1] for p in meta["sources"]] == ["a.py", "b.txt"]


@pytest.mark.slow
def test_train_llama_on_data_reports_held_out_loss(tmp_path, token_dir, capsys):
    steps, batch, seed = 4, 8, 2
    # lr 1e-30: the params stay the seeded init to fp32 precision, so both losses have a
    # one-process reference computed here with plain torch.
    code, out, err = run_main(["train", "--model", "llama", "--data", str(token_dir), "--world-size", "2",
                               "--steps", str(steps), "--batch-size", str(batch), "--eval-every", "3",
                               "--seed", str(seed), "--lr", "1e-30", "--schedule", "cosine", "--warmup", "1",
                               "--out", str(tmp_path / "run"), "--plot"], capsys)
    assert code == 0, err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 4]  # every 3rd and the last
    config = dataclasses.replace(llama.CONFIGS["tiny"], vocab_size=257)  # from meta.json, not the config's 67
    params = llama.init(config, run_keys(seed)[0])
    loss_fn = llama.loss_for(config)
    train0 = next(data.TokenData(token_dir, "train").batches(batch, config.seq_len, seed))
    assert records[0]["loss"] == pytest.approx(loss_fn(params, train0).item(), rel=1e-5)
    val = data.TokenData(token_dir, "val").batches(batch, config.seq_len, seed)
    held_out = sum(loss_fn(params, next(val)).item() for _ in range(EVAL_BATCHES)) / EVAL_BATCHES
    assert records[-1]["eval_loss"] == pytest.approx(held_out, rel=1e-5)
    assert "eval" in out and "held-out" in out and "llama 'tiny'" in out
    assert (tmp_path / "run" / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "run" / "run.json").read_text())["vocab_size"] == 257


@pytest.mark.slow
def test_accumulate_gives_the_losses_of_the_whole_batch(tmp_path, capsys):
    common = ["train", "--mesh", "dp=2", "--batch-size", "8", "--steps", "3", "--seed", "1"]
    runs = {}
    for k in (1, 2):
        code, out, err = run_main([*common, "--accumulate", str(k), "--out", str(tmp_path / f"k{k}")], capsys)
        assert code == 0, err
        runs[k] = [r["loss"] for r in map(json.loads, (tmp_path / f"k{k}" / "metrics.jsonl").read_text().splitlines())]
    assert "in 2 micro-batches" in out
    np.testing.assert_allclose(runs[2], runs[1], rtol=1e-5)  # fp32 rounding: the sums run in another order


@pytest.mark.parametrize("argv, names", [
    (["train", "--eval-every", "5"], "--data"),
    (["train", "--data", "/no/such/dir"], "hpf prepare"),
    (["train", "--model", "llama", "--config", "medium"], "llama"),
    (["train", "--schedule", "cosine", "--warmup", "100", "--steps", "100"], "--warmup"),
    (["prepare", "/no/such/file", "--out", "/tmp/x"], "neither"),
    (["train", "--resume", "--out", "/tmp/hpf-no-such-run"], "holds no run"),
    (["train", "--resume", "/no/such/checkpoint"], "no such checkpoint"),
    (["train", "--resume"], "--out"),
    (["train", "--world-size", "2", "--batch-size", "6", "--accumulate", "2"], "2 ranks x 2 micro-batches"),
])
def test_bad_data_arguments_get_one_line_errors(argv, names, capsys):
    code, _, err = run_main(argv, capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and names in err and "Traceback" not in err, err


@pytest.mark.parametrize("command", [["eval", "--data", "nowhere"], ["generate", "--prompt", "ab"]])
def test_a_missing_checkpoint_is_one_line_that_names_it_once(command, capsys):
    """In-process (no ranks): the commands that read a trained run name the folder that is not there."""
    from hpf.cli import main
    assert main([command[0], "/no/such/run", *command[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("/no/such/run") == 1 and "no such checkpoint directory" in err and "\n" not in err, err
