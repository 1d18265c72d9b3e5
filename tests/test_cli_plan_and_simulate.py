"""`hpf plan`, `hpf simulate` and `hpf calibrate` as a user runs them: what they count, what they
assume, and what they warn of."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import hpf
from hpf import plots
from hpf.models import gpt
from hpf.sim.hardware import compute_key
from hpf.optim.dist_muon import DistMuon
from hpf.optim.muon_owners import muon_plan_state
from cli_helpers import REPO, CALIBRATION, hpf_cmd, NO_MATPLOTLIB


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


@pytest.mark.slow
def test_the_fast_tier_passes_where_matplotlib_never_built_its_font_cache(tmp_path):
    # A fresh MPLCONFIGDIR: matplotlib's first use runs fc-list, which the fast tier's guard refuses
    # inside a test; the conftest builds the cache at session start instead.
    env = {**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider",
                           f"{__file__}::test_the_breakdown_plot_labels_the_steps_its_axis_cuts_off"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert (tmp_path / "mpl").is_dir()  # the cache was built there, fresh


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


@pytest.mark.slow
def test_simulate_refuses_a_shape_its_calibration_never_measured_and_names_the_one_to_calibrate():
    """small/8 on a calibration of small/2: a guess from FLOPs (issue 60: 18x off), so refused with the
    command that measures it; --estimate gives the guess, with the warning that says how far it reaches."""
    refused = hpf_cmd("simulate", "--hardware", CALIBRATION, "--config", "small", "--local-batch", 8, "--world-size", 2)
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr
    assert "measured the compute of small/2/2, small/2/4 (config/local batch/ranks), not small/8" in refused.stderr
    assert f"hpf calibrate --shapes small/8 --world-sizes 2 --update {CALIBRATION}" in refused.stderr
    far = hpf_cmd("simulate", "--hardware", CALIBRATION, "--config", "small", "--local-batch", 8, "--world-size", 2,
                  "--estimate")
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
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "attribution.py"), "--read",
                           str(tmp_path / "rank0.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ms = {line.split()[0]: line.split()[-1] for line in proc.stdout.splitlines()[2:] if line.split()}
    assert float(ms["step"]) == 1.0 and float(ms["compute"]) == pytest.approx(0.3, abs=0.01)


@pytest.mark.slow
def test_calibrate_is_a_command_that_says_each_stage(tmp_path):
    out = tmp_path / "calib.json"
    proc = hpf_cmd("calibrate", "--out", out, "--world-sizes", 2, "--shapes", "tiny/1", "moe:tiny/1", "--reps", 1,
                   "--launches", 1)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    stages = [line for line in lines if line.startswith("calibrate  [")]
    assert [re.match(r"calibrate  \[(\d+)/8\]", s)[1] for s in stages] == [str(i) for i in range(1, 9)]
    assert len(lines) == len(stages) + 3 and lines[-2].startswith(f"wrote {out}")  # no JSON dump
    assert lines[-3].startswith("calibrate  other processes used ")  # the load while it ran, also in the file
    assert json.loads(out.read_text())["load"]["all"]["cores"] == len(os.sched_getaffinity(0))
    # each model and compute precision measured on its own (a GPT's and fp32's keys carry no tag)
    assert hpf.sim.load_calibration(out).compute.keys() == {"tiny/1/2", "tiny/1/2/bf16", "moe:tiny/1/2",
                                                            "moe:tiny/1/2/bf16"}


def _quick_fake(monkeypatch, tmp_path, others_cores=(0.0,)):
    """hpf.sim.calibrate's quick calibration faked (no process): each call records its job and returns the
    committed calibration's figures for that shape; the load of each call from ``others_cores`` in turn."""
    from hpf.sim import calibrate as cal
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls, loads = [], list(others_cores)

    def fake(world_sizes, shapes, **kw):
        calls.append((world_sizes, shapes, kw["reps"], kw["launches"], kw["quick"], kw["precisions"]))
        made = json.loads(CALIBRATION.read_text())
        (w,), ((model, config, batch),) = world_sizes, shapes
        made["links"] = {t: {str(w): per["2"]} for t, per in made["links"].items()}
        made["compute"] = {compute_key(model, config, batch, w): made["compute"]["small/2/2"]}
        return made

    def with_load(fn):
        return fn(), {"others_cores": loads.pop(0) if len(loads) > 1 else loads[0], "own_cores": 2.0, "cores": 2,
                      "loadavg": [0.0, 0.0, 0.0]}
    monkeypatch.setattr(cal, "calibrate", fake)
    monkeypatch.setattr(cal, "with_load", with_load, raising=False)
    return calls


def test_the_hardware_rule_measures_each_jobs_shape_once_and_then_reuses_the_cache(tmp_path, monkeypatch, capsys):
    import argparse

    from hpf.cli import machine
    calls = _quick_fake(monkeypatch, tmp_path)
    args = argparse.Namespace(hardware=None, model="gpt", config="small")
    for _ in range(2):  # the job's own shape and world, fp32 only: measured once, then cached
        hw, where = machine.hardware_of(args, 4, 8)
        assert hw.name == "local-cpu" and "this machine's calibration" in where and "a job this machine runs" in where
        assert hpf.sim.extrapolation("small", 8, 4, hw) == []  # its shape was measured: nothing extrapolated
    assert calls == [((4,), (("gpt", "small", 8),), machine.QUICK_REPS, 1, True, (None,))]
    hw, _ = machine.hardware_of(args, 2, 16)  # another shape: added to the same cache
    assert len(calls) == 2 and {"small/8/4", "small/16/2"} <= hw.compute.keys()
    assert machine.calibration_cache().is_relative_to(tmp_path)
    assert json.loads(machine.calibration_cache().read_text())["load"]["small/16/2"]["others_cores"] == 0.0
    args.hardware = "h100"
    assert machine.hardware_of(args, 2, 8)[0].name == "h100"


def test_a_quick_calibration_taken_under_load_is_measured_again_then_refused(tmp_path, monkeypatch, capsys):
    import argparse

    from hpf.cli import machine
    from hpf.cli.common import CliError
    args = argparse.Namespace(hardware=None, model="gpt", config="small")
    calls = _quick_fake(monkeypatch, tmp_path, others_cores=(1.0, 0.1))  # a second job, then quiet
    assert machine.hardware_of(args, 2, 16)[0].name == "local-cpu" and len(calls) == 2
    out = capsys.readouterr().out
    assert "other processes used 1.00 of 2 cores" in out and "taken under load" in out and "measuring again" in out
    calls = _quick_fake(monkeypatch, tmp_path / "busy", others_cores=(1.0,))  # busy throughout: refused
    with pytest.raises(CliError, match="busy while it was calibrated, twice.*none is cached.*--hardware"):
        machine.hardware_of(args, 2, 16)
    assert len(calls) == 2 and not machine.calibration_cache().exists()


def test_every_command_that_predicts_has_one_default_and_says_it(tmp_path, monkeypatch, capsys):
    # a job this machine runs: its calibration, for simulate as for plan --search; any other: the
    # paper's machine, with the reason, for the 505B MoE's search (issue 44's target) as for simulate
    from hpf import cli
    _quick_fake(monkeypatch, tmp_path)
    assert cli.main(["simulate", "--config", "small", "--world-size", "2", "--local-batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "hardware local-cpu" in out and "assumed: this machine's calibration" in out
    assert cli.main(["plan", "--search", "--config", "small", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "hardware local-cpu" in next(x for x in out.splitlines() if x.startswith("hpf plan --search"))
    assert "cloudmatrix" not in out
    assert out.splitlines()[-1].startswith("assumed: this machine's calibration (") and \
        "global batch 2 sequences (one per rank" in out.splitlines()[-1]
    assert cli.main(["plan", "--model", "moe", "--config", "505b", "--mesh", "node=48,local=16", "--search",
                     "--memory-per-rank", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "hardware cloudmatrix384" in out and "the default for a job this machine does not run (768 ranks" in out
    assert cli.main(["simulate", "--model", "moe", "--config", "505b", "--world-size", "4", "--local-batch", "1"]) == 0
    assert "hardware cloudmatrix384, the default for a job this machine does not run (one block of moe '505b'" in \
        capsys.readouterr().out



def test_plan_prints_a_tiny_models_sizes_at_a_precision_that_shows_them(capsys):
    # gpt tiny's 17k params on 4 ranks: each printed size reads back within 1% of the plan's own
    # figure (0.0M params and 0.000 GiB read back as zero)
    from hpf import cli
    from hpf.cli.plan import plan_of, report_of

    assert cli.main(["plan", "--config", "tiny"]) == 0
    out = capsys.readouterr().out
    number = lambda pattern: float(re.search(pattern, out)[1].replace(",", ""))  # noqa: E731
    assert number(r"'tiny': ([\d.,]+)M params") * 1e6 == pytest.approx(gpt.num_params(gpt.CONFIGS["tiny"]), rel=0.01)
    mesh = hpf.Mesh({"node": 2, "local": 2})
    args = cli.build_parser("plan").parse_args(["plan", "--config", "tiny"])
    report = report_of(args, plan_of(args, mesh))[0]
    for label, value in (("params \\(shards\\)", report.params_bytes), ("optimizer state", report.optimizer_bytes),
                         ("padded total, all ranks", report.padded_total_bytes)):
        assert number(rf"{label}\s+([\d.]+) MiB") * 2**20 == pytest.approx(value, rel=0.01), label
    assert number(r"all_gather\s+([\d.]+) MiB") > 0


def test_plan_auto_checks_its_prediction_against_the_measured_steps():
    import argparse

    from hpf.cli.search import TRUSTED, check_prediction
    rows = [{"step_s": s} for s in (0.7, 0.8, 0.75)]  # median 0.75 s
    near = check_prediction(argparse.Namespace(predicted_step_s=0.9), rows)
    assert "900 ms a step predicted, 750 ms measured (1.20x)" in near and "off by" not in near
    far = check_prediction(argparse.Namespace(predicted_step_s=16.879), rows)
    assert f"off by more than {TRUSTED}x" in far and "hpf calibrate --out FILE" in far
    assert check_prediction(argparse.Namespace(), rows) is None  # no --plan auto: nothing to check


def _bytes_of_a_steady_step(rank, argvs):
    """Each ``hpf plan`` argv's job as hpf train builds its step (the CLI's plan arguments) on 4
    local ranks: what step.stats() counts in the second of two steps (each step gathers the
    next one's first units)."""
    from hpf import cli
    from hpf.cli.plan import plan_arguments
    config, out = gpt.CONFIGS["tiny"], []
    for argv in argvs:
        args = cli.build_parser("plan").parse_args(argv)
        mesh = hpf.Mesh({"node": 2, "local": 2})
        with hpf.shard_step(gpt.loss_for(config), mesh=mesh, optimizer=hpf.optim.adamw(lr=1e-2),
                            **plan_arguments(args, mesh, config)) as step:
            state = step.init(gpt.init(config, hpf.random.key(0)))
            batches = gpt.synthetic_batches(config, 8, 0, rank=rank, world_size=mesh.size)
            state, _ = step(state, next(batches))
            before = step.stats()
            step(state, next(batches))
            out.append({k: n for k, n in (step.stats() - before).bytes.items() if n})
    return out


@pytest.mark.slow
def test_plan_prints_the_bytes_a_step_of_hpf_train_counts():
    """hpf plan's bytes per step are the step's own counters, two-tier (whose shared-memory fast
    tier keeps every unit gathered: no backward re-gathers, where the report once counted them,
    1.46x the counters for gpt small) and flat."""
    from hpf import cli
    from hpf.cli.plan import plan_of, report_of
    from hpf.launcher import launch
    argvs = [["plan", "--config", "tiny"], ["plan", "--config", "tiny", "--topology", "flat"]]
    mesh = hpf.Mesh({"node": 2, "local": 2})
    ranks = launch(_bytes_of_a_steady_step, 4, argvs, timeout=240)
    for i, argv in enumerate(argvs):
        args = cli.build_parser("plan").parse_args(argv)
        comm = report_of(args, plan_of(args, mesh))[0].comm
        want = {(op, tier): n for op, tiers in comm.items() for tier, n in tiers.items() if n}
        assert want and all(got[i] == want for got in ranks), (argv, want, [got[i] for got in ranks])
