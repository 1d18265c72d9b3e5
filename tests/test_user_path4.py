"""What a new user ran into (issue 38, "the user's path, fourth pass"): one test per item, each run
the way a user runs it (a subprocess of `hpf`) where it can be."""
import json
from pathlib import Path

import optree
import pytest
import torch

import hpf
from hpf.models import gpt, llama, moe
from references import adamw_training
from test_user_path import hpf_cmd, one_error_line

ROOT = Path(__file__).resolve().parent.parent


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


# 1 -- fp16 trains: from the CLI, with its weighted losses; a skipped step is counted ----------------
@pytest.mark.parametrize("module", [gpt, llama, moe], ids=["gpt", "llama", "moe"])
def test_the_models_give_finite_grads_in_fp16_at_init(module):
    """An RMSNorm computed in fp16 overflows in backward (the rsqrt's cube) for inputs of rms
    below 0.025, so every fp16 step of the CLI was skipped whatever the loss scale."""
    config = module.CONFIGS["tiny"]
    params = optree.tree_map(lambda x: x.half().requires_grad_(), module.init(config, torch.Generator().manual_seed(0)))
    module.loss_for(config)(params, gpt.global_batch(config, 4, 0, 0)).backward()
    bad = [p for p, x in zip(hpf.tree.paths(params), optree.tree_leaves(params)) if not torch.isfinite(x.grad).all()]
    assert not bad, f"non-finite fp16 grads at init: {bad}"


def test_fp16_loss_scale_is_per_term_for_a_weighted_loss_so_no_step_is_skipped():
    """hpf.weighted(sum, count): a sum of 64 x 16 token losses seeded with 2^16 overflows fp16 at
    once; the scale is per term, so the first steps train, as plain torch in fp16 does."""
    config = gpt.CONFIGS["tiny"]
    step = hpf.shard_step(gpt.loss_for(config, weighted=True), mesh=hpf.Mesh({"dp": 1}),
                          optimizer=hpf.optim.adamw(lr=1e-2), mixed_precision="fp16")
    state = step.init(gpt.init(config, torch.Generator().manual_seed(0)))
    got, skipped = [], []
    for s in range(5):
        state, m = step(state, gpt.global_batch(config, 64, 0, s))
        got.append(m["loss"])
        skipped.append(m["skipped"])
    assert skipped == [False] * 5 and m["loss_scale"] == 2.0 ** 16
    want, _, _ = adamw_training(gpt.loss_for(config), gpt.init(config, torch.Generator().manual_seed(0)),
                                lambda s: gpt.global_batch(config, 64, 0, s), 5, compute_dtype=torch.float16,
                                lr=1e-2)
    # fp16 compute on both sides (hpf: scaled grads, fp32 reduction); the losses fall ~0.1 a step
    torch.testing.assert_close(got, want, rtol=2e-3, atol=0)


@pytest.mark.slow
def test_hpf_train_fp16_trains_as_fp32_does_and_records_skipped_steps(tmp_path):
    runs = {}
    for mp in ("fp16", None):
        out = tmp_path / str(mp)
        proc = hpf_cmd("train", "--world-size", 1, "--steps", 30, "--out", out,
                       *(("--mixed-precision", mp) if mp else ()))
        assert proc.returncode == 0, proc.stderr
        runs[mp] = records(out)
    fp16, fp32 = runs["fp16"], runs[None]
    assert all("skipped" in r for r in fp16) and sum(r["skipped"] for r in fp16) <= 1
    assert all(r["loss_scale"] > 0 for r in fp16)
    tail = lambda rs: sum(r["loss"] for r in rs[-10:]) / 10  # noqa: E731
    assert tail(fp16) < fp16[0]["loss"] - 1.0, "fp16 did not train"
    assert abs(tail(fp16) - tail(fp32)) < 0.03 * tail(fp32)


def test_skipped_steps_are_in_the_summary_and_a_run_of_only_skipped_steps_is_an_error():
    from hpf.checks import NonFiniteError
    from hpf.cli.train import check_trained, summary

    row = dict(grad_norm=None, step_s=0.1, comm_wait_s=0.0, optimizer_s=0.0, compile_s=0.0, tokens_per_s=1.0,
               loss_scale=1.0)
    rows = [dict(row, step=i, loss=4.2, skipped=i != 3) for i in (1, 2, 3)]
    assert "skipped     2 of 3 steps (non-finite grads, no update): steps 1, 2" in summary(rows, 1.0, [])
    check_trained(rows)  # one step trained
    with pytest.raises(NonFiniteError, match="every one of the 2 steps was skipped.*loss scale down to 1"):
        check_trained([r for r in rows if r["skipped"]])


def test_an_fp16_weighted_run_resumes_bitwise(tmp_path):
    """A fresh step does not yet know the terms per micro-batch: its first step after a restore
    must not be skipped (nor differ) for it."""
    config = gpt.CONFIGS["tiny"]

    def make():
        return hpf.shard_step(gpt.loss_for(config, weighted=True), mesh=hpf.Mesh({"dp": 1}),
                              optimizer=hpf.optim.adamw(lr=1e-2), mixed_precision="fp16")
    step = make()
    state = step.init(gpt.init(config, torch.Generator().manual_seed(0)))
    for s in range(2):
        state, _ = step(state, gpt.global_batch(config, 32, 0, s))
    step.save(state, tmp_path / "ck")
    want = []
    for s in range(2, 4):
        state, m = step(state, gpt.global_batch(config, 32, 0, s))
        want.append((m["loss"], m["skipped"], m["loss_scale"]))
    again = make()
    again.init(gpt.init(config, device="meta"))
    state, _ = again.restore(tmp_path / "ck")
    got = []
    for s in range(2, 4):
        state, m = again(state, gpt.global_batch(config, 32, 0, s))
        got.append((m["loss"], m["skipped"], m["loss_scale"]))
    assert got == want and not any(s for _, s, _ in got)


# 2 -- an nn.Module: a loss that ignores the params is an error; hpf.from_module bridges ------------
V, D = 23, 12


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(D), torch.nn.Linear(D, 3 * D), torch.nn.Linear(3 * D, D)

    def forward(self, h):
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


class Net(torch.nn.Module):
    def __init__(self, tied=False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(V, D)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])
        self.norm = torch.nn.LayerNorm(D)
        self.head = torch.nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def lm(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())


def tokens(step, rank=0, world=1):
    full = torch.randint(0, V, (8, 9), generator=torch.Generator().manual_seed(step))
    return full.chunk(world)[rank]


def test_a_loss_that_ignores_its_params_is_an_error_at_the_first_step():
    model = Net()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = hpf.shard_step(lambda p, b: lm(model, b), mesh=hpf.Mesh({"dp": 1}), optimizer=hpf.optim.adamw())
    with pytest.raises(hpf.UnusedParamsError, match="reached none of the params.*nn.Module.*hpf.from_module"):
        step(step.init(params), tokens(0))


ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _train_module(rank, tied):
    model = Net(tied)
    params, loss_fn = hpf.from_module(model, lm)
    step = hpf.shard_step(loss_fn, mesh=hpf.Mesh({"dp": 2}), optimizer=hpf.optim.adamw(**ADAMW))
    state = step.init(params)
    losses = []
    for s in range(4):
        state, m = step(state, tokens(s, rank, 2))
        losses.append(m["loss"])
    before = {n: p.clone() for n, p in model.state_dict().items()}
    hpf.to_module(model, step.full_params(state))
    return losses, len(step.plan.units), {n: p for n, p in model.state_dict().items()}, before


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_from_module_trains_a_module_as_plain_torch_does(tied):
    from hpf.launcher import launch
    runs = launch(_train_module, 2, tied, timeout=120)
    model = Net(tied)
    assert all(torch.equal(runs[0][3][n], p) for n, p in model.state_dict().items()), "the loss changed the model"
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    want = []
    for s in range(4):
        loss = lm(model, tokens(s))
        opt.zero_grad()
        loss.backward()
        opt.step()
        want.append(loss.item())
    losses, units, trained, _ = runs[0]
    assert units == 4  # the three blocks and the root
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=0)
    for n, p in model.state_dict().items():  # fp32 AdamW over 4 steps: ~1e-7 apart
        torch.testing.assert_close(trained[n], p, rtol=0, atol=1e-5, msg=n)


def test_from_module_reads_each_block_when_it_runs_and_refuses_a_block_weight_read_outside_it():
    model = Net()
    params, loss_fn = hpf.from_module(model, lm)
    assert list(params) == ["embed", "blocks", "norm", "head"] and len(params["blocks"]) == 3
    assert set(params["blocks"][0]) == {"norm", "up", "down"}
    reads = []

    class Lazy(list):
        def __getitem__(self, i):
            reads.append(i)
            return super().__getitem__(i)
    loss_fn({**params, "blocks": Lazy(params["blocks"])}, tokens(0))
    assert reads == [0, 1, 2]
    outside = lambda m, b: m.blocks[0].up.weight.sum() + lm(m, b)  # noqa: E731
    _, bad = hpf.from_module(model, outside)
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
        bad(params, tokens(0)).item()


@pytest.mark.slow
def test_the_module_page_example_runs(tmp_path):
    import re
    code = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "modules.md").read_text(), flags=re.S)[1]
    (tmp_path / "ex.py").write_text(code)
    proc = hpf_cmd(code=f"import runpy; runpy.run_path({str(tmp_path / 'ex.py')!r}, run_name='__main__')")
    assert proc.returncode == 0, proc.stderr
    first, second = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first == second < 2.0  # trained from ln(32) = 3.47, the same on both ranks


# 3 -- no silent no-op options: an option that cannot act on the mesh is refused ------------------
@pytest.mark.slow
@pytest.mark.parametrize("args, says", [
    (["--world-size", 4, "--slow-precision", "int8"], "low-bit slow tier (int8,int8) has nothing to act on"),
    (["--world-size", 2, "--hsdp"], "HSDP would be plain FSDP"),
    (["--world-size", 2, "--topology", "flat", "--bucket-bytes", 1000], "--bucket-bytes 1000 needs --topology two-tier"),
], ids=["slow-tier-1d", "hsdp-1d", "bucket-bytes-flat"])
def test_an_option_that_cannot_act_on_the_mesh_is_refused(tmp_path, args, says):
    proc = hpf_cmd("train", *args, "--steps", 1, "--out", tmp_path / "run")
    assert proc.returncode == 2 and says in one_error_line(proc)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_library_refuses_a_slow_tier_on_a_mesh_without_one():
    from hpf.step import step_plan  # the plan shard_step makes (and hpf plan prints)

    params = gpt.init(gpt.CONFIGS["tiny"], device="meta")
    with pytest.raises(ValueError, match="nothing to act on.*A 1-D mesh is one fast tier"):
        step_plan(params, hpf.Mesh({"dp": 4}), topology=hpf.Topology(slow_weights="int8", slow_grads="int8"))
    assert step_plan(params, hpf.Mesh({"node": 2, "local": 2}), topology=hpf.Topology(slow_grads="int8")).slow_precision


# 4 -- hpf.launch under torchrun runs as torchrun's ranks, never a second job -------------------------
_UNDER_TORCHRUN = """
import os, sys, hpf
try:
    out = hpf.launch(lambda rank: (rank, os.getpid()), world_size=int(sys.argv[1]))
    print("result", out, os.getpid(), flush=True)
except RuntimeError as e:
    print("refused", e, flush=True)
"""


def _as_torchrun(n_launch: int) -> list[str]:
    """Two processes with torchrun's environment, each running a script that calls hpf.launch."""
    import os
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _UNDER_TORCHRUN, str(n_launch)], text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(2)]
    return [p.communicate(timeout=120)[0] for p in procs]


@pytest.mark.slow
def test_launch_under_torchrun_runs_as_its_ranks_without_forking():
    import ast
    outs = _as_torchrun(2)
    for r, out in enumerate(outs):
        line = next(x for x in out.splitlines() if x.startswith("result"))
        results, pid = line.removeprefix("result ").rsplit(" ", 1)
        results = ast.literal_eval(results)
        assert [rank for rank, _ in results] == [0, 1]
        assert results[r][1] == int(pid), "fn ran in a forked child, not in torchrun's process"
    assert len({pid for out in outs for line in out.splitlines() if line.startswith("result")
                for pid in [line.rsplit(" ", 1)[1]]}) == 2


@pytest.mark.slow
def test_launch_under_torchrun_with_another_world_size_is_refused():
    for out in _as_torchrun(4):
        assert "refused" in out and "torchrun, which started 2 rank(s)" in out and "--nproc-per-node 4" in out, out


# 6 -- a run ends with a checkpoint; --timeout is a clean stop that saves ---------------------------
@pytest.mark.slow
def test_save_every_also_saves_the_last_step(tmp_path):
    out = tmp_path / "run"
    proc = hpf_cmd("train", "--world-size", 1, "--steps", 5, "--save-every", 3, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000003", "step_000005"]
    assert "step_000005 (the newest checkpoint)" in proc.stdout


@pytest.mark.slow
def test_timeout_stops_after_a_step_saves_it_and_resumes(tmp_path):
    out = tmp_path / "run"
    proc = hpf_cmd("train", "--world-size", 2, "--steps", 10**6, "--timeout", 4, "--out", out)
    assert proc.returncode == 0, proc.stderr
    last = records(out)[-1]["step"]
    assert json.loads((out / "run.json").read_text())["status"] == "stopped"
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step_{last:06d}"]
    assert f"stopped: {last} steps" in proc.stdout and f"after step {last} of 1000000, which is saved" in proc.stdout
    again = hpf_cmd("train", "--out", out, "--resume", "--steps", last + 2)
    assert again.returncode == 0, again.stderr
    assert [r["step"] for r in records(out)] == list(range(1, last + 3))


# 5 -- the plan search states its assumptions; one rule for the hardware ------------------------------
CALIBRATION = ROOT / "docs" / "simulate" / "validation" / "calib_small_0.json"


def _cached(tmp_path) -> dict:
    """An environment whose user cache holds a calibration of this machine."""
    import socket
    cache = tmp_path / "cache" / "hpf" / f"calibration-{socket.gethostname()}.json"
    cache.parent.mkdir(parents=True)
    cache.write_text(CALIBRATION.read_text())
    return {"XDG_CACHE_HOME": str(tmp_path / "cache")}


@pytest.mark.slow
def test_plan_search_prices_on_this_machines_calibration_and_says_what_it_assumed(tmp_path):
    proc = hpf_cmd("plan", "--search", "--config", "tiny", "--world-size", 2, env=_cached(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assumed = proc.stdout.splitlines()[-1]
    assert "hardware local-cpu" in proc.stdout.splitlines()[0] and "cloudmatrix" not in proc.stdout
    assert assumed.startswith("assumed: this machine's calibration (") and "global batch 2 sequences (one per rank" \
        in assumed


def test_the_hardware_rule_calibrates_once_quickly_and_then_reuses_the_cache(tmp_path, monkeypatch):
    import argparse

    from hpf.cli import search as cli_search
    from hpf.sim import calibrate as cal
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def fake(world_sizes, shapes, **kw):
        calls.append((world_sizes, shapes, kw["reps"], kw["launches"], kw["quick"]))
        return json.loads(CALIBRATION.read_text())
    monkeypatch.setattr(cal, "calibrate", fake)
    args = argparse.Namespace(hardware=None, model="gpt", config="small")
    for _ in range(2):
        hw, where = cli_search.hardware_of(args, hpf.Mesh({"dp": 2}), batch_size=8)
        assert hw.name == "local-cpu" and "this machine's calibration" in where
    assert calls == [((2,), (("gpt", "small", 1),), cli_search.QUICK_REPS, 1, True)]
    assert cli_search.calibration_cache().is_relative_to(tmp_path)
    args.hardware = "h100"
    assert cli_search.hardware_of(args, hpf.Mesh({"dp": 2}), 8)[0].name == "h100"


@pytest.mark.slow
def test_train_plan_file_says_the_batch_and_precision_it_sets(tmp_path):
    saved = tmp_path / "plan.json"
    proc = hpf_cmd("plan", "--search", "--config", "tiny", "--world-size", 2, "--hardware", "h100",
                   "--mixed-precision", "bf16", "--save", saved)
    assert proc.returncode == 0, proc.stderr
    proc = hpf_cmd("train", "--plan", saved, "--steps", 1, "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("plan: "))
    assert "searched on h100" in line and "--batch-size 2 (the plan's; hpf train's default is 32" in line
    assert "--mixed-precision bf16 (on a CPU, bf16 is emulated" in line
    refused = hpf_cmd("train", "--plan", saved, "--batch-size", 32, "--out", tmp_path / "other")
    assert refused.returncode == 2 and "was searched for --batch-size 2, not 32" in one_error_line(refused)


# 9 -- a rank's error keeps its type across hpf.launch; Ctrl-C says how to go on ----------------------
def _bad_params(rank):
    if rank == 1:
        raise hpf.ParamsMismatchError("rank 1 was given other params")
    return rank


@pytest.mark.slow
def test_a_ranks_error_is_caught_by_its_own_type_across_launch():
    from hpf.launcher import RankError, launch
    with pytest.raises(hpf.ParamsMismatchError, match="rank 1 raised") as info:
        launch(_bad_params, 2, timeout=120)
    err = info.value
    assert isinstance(err, RankError) and err.rank == 1
    assert type(err.cause) is hpf.ParamsMismatchError and str(err.cause) == "rank 1 was given other params"


@pytest.mark.slow
def test_ctrl_c_ends_hpf_train_on_its_own_line_and_says_how_to_go_on(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hpf", "train", "--world-size", "1", "--steps", "1000000",
                             "--save-every", "5", "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 120
    while not (out / "checkpoints").is_dir() or not any(p.name.startswith("step_") and not p.name.endswith(".tmp")
                                                         for p in (out / "checkpoints").iterdir()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    line = err.strip().splitlines()[-1]
    assert line.startswith("hpf: interrupted; go on from step_") and f"with: hpf train --out {out} --resume" in line
    assert json.loads((out / "run.json").read_text())["status"] == "interrupted"


# 11 -- lr, peak memory and MFU against a stated peak, in metrics.jsonl ------------------------------
@pytest.mark.slow
def test_metrics_have_lr_peak_memory_and_mfu_against_a_stated_peak(tmp_path):
    out = tmp_path / "run"
    proc = hpf_cmd("train", "--world-size", 1, "--steps", 4, "--warmup", 2, "--schedule", "linear", "--out", out,
                   env=_cached(tmp_path))
    assert proc.returncode == 0, proc.stderr
    rows = records(out)
    assert [r["lr"] for r in rows] == pytest.approx([0.005, 0.01, 0.005, 0.0])  # warmup, then linear to 0
    assert all(r["peak_memory_bytes"] > 10 * 2**20 for r in rows)
    peak = json.loads(CALIBRATION.read_text())["peak_flops"]
    flops = 3 * sum(gpt.unit_flops(gpt.CONFIGS["tiny"], 32).values())
    assert [r["mfu"] for r in rows] == pytest.approx([flops / r["step_s"] / peak for r in rows])
    assert f"MFU against {peak / 1e12:.3g} TFLOP/s per rank (this machine's calibration" in proc.stdout
    assert "MFU" in proc.stdout.split("done:")[1] and "memory      peak" in proc.stdout


# 11 -- hpf eval, hpf export, hpf generate on a checkpoint that says which model it holds -------------
@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """A 3-step llama run on a byte token folder, saved at its end."""
    root = tmp_path_factory.mktemp("llama_run")
    (root / "text").mkdir()
    (root / "text" / "a.txt").write_text((ROOT / "README.md").read_text() * 2)
    assert hpf_cmd("prepare", root / "text", "--out", root / "data").returncode == 0
    proc = hpf_cmd("train", "--model", "llama", "--data", root / "data", "--world-size", 1, "--steps", 3,
                   "--save-every", 3, "--out", root / "run")
    assert proc.returncode == 0, proc.stderr
    return root


@pytest.mark.slow
def test_a_checkpoint_holds_its_model_and_config(llama_run):
    from hpf import checkpoint
    from hpf.models import llama
    meta = checkpoint.meta(llama_run / "run" / "checkpoints" / "step_000003")
    assert meta["model"] == "llama" and meta["step"] == 3
    assert llama.LlamaConfig(**meta["config"]) == llama.CONFIGS["tiny"].__class__(
        **{**vars(llama.CONFIGS["tiny"]), "vocab_size": 257})


@pytest.mark.slow
def test_hpf_eval_gives_the_held_out_loss_of_the_checkpoint(llama_run):
    from hpf import checkpoint, data
    from hpf.models import llama
    proc = hpf_cmd("eval", llama_run / "run", "--data", llama_run / "data", "--batches", 2, "--batch-size", 4)
    assert proc.returncode == 0, proc.stderr
    got = float(proc.stdout.split("held-out loss ")[1].split()[0])
    ckpt = llama_run / "run" / "checkpoints" / "step_000003"
    config = llama.LlamaConfig(**checkpoint.meta(ckpt)["config"])
    params = checkpoint.load_params(ckpt)
    batches = data.TokenData(llama_run / "data", "val").batches(4, config.seq_len, 0, state={"seed": 0, "step": 0},
                                                                rank=0, world_size=1)
    with torch.no_grad():
        want = sum(float(llama.loss_for(config)(params, next(batches))) for _ in range(2)) / 2
    assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.slow
def test_hpf_export_writes_a_transformers_llama_that_reads_back(llama_run, tmp_path):
    from hpf import checkpoint
    from hpf.models import llama
    proc = hpf_cmd("export", llama_run / "run", "--to", "hf", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    config, params = llama.from_hf(tmp_path / "hf")
    saved = checkpoint.load_params(llama_run / "run" / "checkpoints" / "step_000003")
    assert config.vocab_size == 257
    for (path, got), want in zip(zip(hpf.tree.paths(params), optree.tree_leaves(params)), optree.tree_leaves(saved)):
        assert torch.equal(got, want), path


@pytest.mark.slow
def test_hpf_generate_is_greedy_decoding_of_the_checkpoint(llama_run):
    from hpf import checkpoint
    from hpf.models import llama
    proc = hpf_cmd("generate", llama_run / "run", "--prompt-ids", "65,66", "--tokens", 4)
    assert proc.returncode == 0, proc.stderr
    ckpt = llama_run / "run" / "checkpoints" / "step_000003"
    config, params = llama.LlamaConfig(**checkpoint.meta(ckpt)["config"]), checkpoint.load_params(ckpt)
    tokens = torch.tensor([[65, 66]])
    for _ in range(4):
        tokens = torch.cat([tokens, llama.forward(params, tokens, config=config)[:, -1].argmax(-1, keepdim=True)], 1)
    assert proc.stdout.strip() == ",".join(map(str, tokens[0, 2:].tolist()))


@pytest.mark.slow
def test_hpf_export_of_a_model_without_a_transformers_twin_is_refused(tmp_path):
    proc = hpf_cmd("train", "--world-size", 1, "--steps", 1, "--save-every", 1, "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    refused = hpf_cmd("export", tmp_path / "run", "--to", "hf", tmp_path / "hf")
    assert refused.returncode == 2 and "holds a gpt model" in one_error_line(refused)
