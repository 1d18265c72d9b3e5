"""What a new user runs into (issue 17): each case runs `hpf` as a subprocess, the way a user
does, and checks the exit code and the one line it prints."""
import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hpf
from hpf import plots
from hpf.models import gpt
from hpf.optim.dist_muon import DistMuon, muon_plan_state

REPO = Path(__file__).resolve().parent.parent
NO_MATPLOTLIB = ("import sys; sys.modules['matplotlib'] = None; from hpf.cli import main; "
                 "raise SystemExit(main())")  # what an install without the plot extra sees


def hpf_cmd(*args, env=None, code=None, timeout=240):
    """subprocess.run of `python -m hpf <args>` (or `python -c <code> <args>`) with this checkout first."""
    rendezvous = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    env = {**{k: v for k, v in os.environ.items() if k not in rendezvous},
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    argv = [sys.executable, "-c", code] if code else [sys.executable, "-m", "hpf"]
    return subprocess.run(argv + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def one_error_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("hpf") and "error:" in lines[0] and "Traceback" not in proc.stderr
    return lines[0]


# 1 -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_plot_without_matplotlib_trains_and_the_run_folder_says_so(tmp_path):
    out = tmp_path / "run"
    proc = hpf_cmd("train", "--world-size", 1, "--steps", 2, "--plot", "--out", out, code=NO_MATPLOTLIB)
    assert proc.returncode == 0, proc.stderr
    (warning,) = proc.stderr.strip().splitlines()
    assert "--plot skipped" in warning and "matplotlib" in warning
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert json.loads((out / "run.json").read_text())["plots"].startswith("skipped: matplotlib")
    assert not (out / "loss.png").exists() and "done: 2 steps" in proc.stdout


# 2 -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_first_step_is_announced_before_it_ends(tmp_path):
    proc = hpf_cmd("train", "--world-size", 1, "--steps", 2, "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    begun = next(i for i, line in enumerate(lines) if "step 1 of 2" in line)
    ended = next(i for i, line in enumerate(lines) if re.search(r"train\s+1/2", line))
    assert begun < ended


def test_a_long_step_is_reported_while_it_runs():
    import io
    import time

    from hpf.progress import Progress

    stream = io.StringIO()
    bar = Progress(3, label="train", stream=stream, heartbeat_s=0.1)
    bar.start("step 1 of 3")
    time.sleep(0.35)  # a slow first step: about three heartbeats
    bar.update(1, {"loss": "1.0"})
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "train  step 1 of 3 ..."
    running = [line for line in lines if "1/3 still running" in line]
    assert 2 <= len(running) <= 4 and lines[-1].startswith("train  1/3")


# 3 -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_config_too_big_for_this_machine_is_refused_before_allocating(tmp_path):
    # 256 ranks of the 1B GPT each build the full fp32 params once (4.2 GB): over 1 TB, which
    # no machine running these tests has, before any shard, grad or activation is counted.
    proc = hpf_cmd("train", "--config", "1b", "--world-size", 256, "--batch-size", 256, "--out", tmp_path / "r")
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert "hpf plan --search --config 1b" in line and "over 256 rank(s)" in line

    def gib(pattern):
        number, unit = re.search(pattern + r" ([\d.]+) (GiB|MiB)", line).groups()
        return float(number) / (1024 if unit == "MiB" else 1)
    init_copy = gpt.num_params(gpt.CONFIGS["1b"]) * 4 / 2**30  # per rank
    assert gib("needs about") > init_copy > gib("over 256 rank\\(s\\) is")
    assert not (tmp_path / "r").exists()  # refused before the run folder, before any rank


# 4 -------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_banner_names_the_precision_under_torchrun_and_launch_alike(tmp_path):
    torchrun_env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    banners = []
    for name, env in (("torchrun", torchrun_env), ("launch", None)):
        proc = hpf_cmd("train", "--steps", 1, "--world-size", 1, "--mixed-precision", "bf16",
                       "--out", tmp_path / name, env=env)
        assert proc.returncode == 0, proc.stderr
        banners.append(proc.stdout.splitlines()[0])
        assert json.loads((tmp_path / name / "run.json").read_text())["mixed_precision"] == "bf16"
    assert banners[0] == banners[1] and "bf16 compute" in banners[0], banners


# 5 -------------------------------------------------------------------------------------------
def test_the_breakdown_plot_labels_the_steps_its_axis_cuts_off():
    records = [{"step": i + 1, "loss": 4.0 - 0.1 * i, "step_s": s, "comm_wait_s": s / 4, "optimizer_s": s / 10}
               for i, s in enumerate([0.110, 0.012, 0.010, 0.011, 0.010, 0.045, 0.010, 0.012, 0.011, 0.010])]
    fig = plots.breakdown_figure(records)
    ax = fig.axes[0]
    median_ms = 11.0  # the median of the ten step times above, in ms
    assert ax.get_ylim()[1] == pytest.approx(2 * median_ms)
    labels = sorted(t.get_text() for t in ax.texts)
    assert labels == ["step 1: 110 ms", "step 6: 45 ms"]  # both steps above 22 ms, with their values
    assert "2 steps above 22 ms cut off" in ax.get_title()
    # no cut, no labels
    calm = [dict(r, step_s=0.010) for r in records]
    assert not plots.breakdown_figure(calm).axes[0].texts

    title = "loss: GPT 'tiny', mesh node=2,local=2, muon"
    assert plots.loss_figure(records, title).axes[0].get_title() == title


# 6 -------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("where", ["a file", "under a file", "under /proc"])
def test_an_out_folder_that_cannot_be_written_is_one_line(where, tmp_path):
    (tmp_path / "f").write_text("not a folder")
    out = {"a file": tmp_path / "f", "under a file": tmp_path / "f" / "run",
           "under /proc": Path("/proc/hpf-cannot-write-here/run")}[where]  # root may not write there either
    proc = hpf_cmd("train", "--world-size", 1, "--steps", 1, "--out", out)
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert f"--out {out}" in line and ("is a file" in line or "cannot be written" in line)


# 7 -------------------------------------------------------------------------------------------
# --timeout is a clean stop that saves (issue 38): tests/test_user_path4.py


# 8 -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_mesh_axis_of_size_zero_says_sizes_must_be_positive():
    proc = hpf_cmd("train", "--mesh", "node=0,local=4")
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert "'node' size 0" in line and "sizes must be >= 1" in line


# 9 -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_small_falls_steadily_over_its_first_ten_steps_at_the_default_lr(tmp_path):
    out = tmp_path / "run"
    proc = hpf_cmd("train", "--config", "small", "--world-size", 2, "--batch-size", 8, "--steps", 10, "--out", out)
    assert proc.returncode == 0, proc.stderr
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    # From a uniform guess over the 512-token vocab (the init's logits are near zero) ...
    assert losses[0] == pytest.approx(math.log(512), rel=0.02)
    # ... every step below the first, and the tenth well below.
    assert all(x < losses[0] for x in losses[1:]), losses
    assert losses[9] < losses[0] - 0.5, losses
    assert "warmup" in hpf_cmd("train", "--help").stdout


# 10 ------------------------------------------------------------------------------------------
def _mib(text: str, label: str) -> float:
    return float(re.search(rf"{label}\s+([\d.]+) MiB", text)[1])


@pytest.mark.slow
def test_plan_counts_muon_state_and_reports_owner_balance():
    c = gpt.CONFIGS["small"]
    d, f, v, t, n = c.d_model, c.d_ff, c.vocab_size, c.seq_len, c.n_layers
    matrices = n * (d * 3 * d + d * d + d * f + f * d)  # qkv, o, up, down: Muon
    others = v * d + t * d + d * v + (2 * n + 1) * d  # embeddings, head, norms: the AdamW fallback
    mib = 4 / 2**20  # fp32 bytes, in MiB
    adamw = hpf_cmd("plan", "--config", "small", "--world-size", 1)
    muon = hpf_cmd("plan", "--config", "small", "--world-size", 1, "--optimizer", "muon")
    assert adamw.returncode == muon.returncode == 0, adamw.stderr + muon.stderr
    assert _mib(adamw.stdout, "optimizer state") == pytest.approx(2 * (matrices + others) * mib, abs=0.006)
    # Muon: one momentum per matrix element; AdamW's two moments for the rest.
    assert _mib(muon.stdout, "optimizer state") == pytest.approx((matrices + 2 * others) * mib, abs=0.006)
    assert f"its {4 * n} matrices" in muon.stdout and "max/mean 1.00" in muon.stdout  # one rank owns all


def test_plan_muon_state_is_what_each_rank_allocates():
    """The count hpf plan prints is the largest state DistMuon.init allocates on any rank."""
    config, muon = gpt.CONFIGS["tiny"], hpf.optim.muon()
    for axes in ({"dp": 3}, {"node": 2, "local": 2}):
        plan = hpf.plan(gpt.init(config, device="meta"), hpf.Mesh(axes))
        sizes = []
        for r in range(plan.mesh.size):
            shards = [torch.empty(b.shard_numel, device="meta") for b in plan.buckets]
            state = DistMuon(muon, plan, r).init(shards)
            sizes.append(sum(x.numel() for x in [*state.exp_avg, *state.exp_avg_sq]))
        most, load, _ = muon_plan_state(muon, plan)
        assert most == max(sizes) and len(set(sizes)) > 1  # AdamW elements differ by rank here
        assert sum(load.values()) > 0
