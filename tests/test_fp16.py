"""fp16 training: finite grads at init, a per-term loss scale for weighted losses, skipped steps
recorded, and a run as fp32 trains."""
import json

import optree
import pytest
import torch

import hpf
from hpf.models import gpt, llama, moe

from references import adamw_training
from cli_helpers import records, hpf_cmd


@pytest.mark.parametrize("module", [gpt, llama, moe], ids=["gpt", "llama", "moe"])
def test_the_models_give_finite_grads_in_fp16_at_init(module):
    """An RMSNorm computed in fp16 overflows in backward (the rsqrt's cube) for inputs of rms
    below 0.025, so every fp16 step of the CLI was skipped whatever the loss scale."""
    config = module.CONFIGS["tiny"]
    params = optree.tree_map(lambda x: x.half().requires_grad_(), module.init(config, hpf.random.key(0)))
    module.loss_for(config)(params, gpt.global_batch(config, 4, 0, 0)).backward()
    bad = [p for p, x in zip(hpf.tree.paths(params), optree.tree_leaves(params)) if not torch.isfinite(x.grad).all()]
    assert not bad, f"non-finite fp16 grads at init: {bad}"


def test_fp16_loss_scale_is_per_term_for_a_weighted_loss_so_no_step_is_skipped():
    """hpf.weighted(sum, count): a sum of 64 x 16 token losses seeded with 2^16 overflows fp16 at
    once; the scale is per term, so the first steps train, as plain torch in fp16 does."""
    config = gpt.CONFIGS["tiny"]
    step = hpf.shard_step(gpt.loss_for(config, weighted=True), mesh=hpf.Mesh({"dp": 1}),
                          optimizer=hpf.optim.adamw(lr=1e-2), mixed_precision="fp16")
    state = step.init(gpt.init(config, hpf.random.key(0)))
    got, skipped = [], []
    for s in range(5):
        state, m = step(state, gpt.global_batch(config, 64, 0, s))
        got.append(m["loss"])
        skipped.append(m["skipped"])
    assert skipped == [False] * 5 and m["loss_scale"] == 2.0 ** 16
    want, _, _ = adamw_training(gpt.loss_for(config), gpt.init(config, hpf.random.key(0)),
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
    from hpf.errors import NonFiniteError
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
    state = step.init(gpt.init(config, hpf.random.key(0)))
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


# -- issue 45 item 9: a diverged fp16 run ends with a named error; the summary and run.json say so ----------
def test_the_loss_scale_has_a_floor_and_overflows_in_a_row_stop_with_a_named_error():
    """The scale halved to 0 after about 1,090 overflows (then a ZeroDivisionError); nothing stopped a
    run that skipped every step."""
    from hpf.errors import NonFiniteError

    scale = hpf.LossScale()
    state = scale.init()
    for _ in range(3):  # clean steps do not count towards the limit ...
        scale.update(state, finite=True)
    for _ in range(scale.max_skipped - 1):
        scale.update(state, finite=False)
    assert float(state.scale) == scale.min_scale == 1.0  # 2^16 halved 49 times, held at the floor
    scale.update(state, finite=True)  # ... and one clean step starts the count again
    for _ in range(scale.max_skipped - 1):
        scale.update(state, finite=False)
    with pytest.raises(NonFiniteError, match=r"fp16: 50 steps in a row .* skipped .*floor 1\b.*--mixed-precision bf16"
                                             r".*LossScale\(max_skipped=\.\.\.\)"):
        scale.update(state, finite=False)


def test_the_summary_of_a_run_whose_last_steps_had_a_non_finite_loss_does_not_crash():
    from hpf.cli.train import summary

    row = dict(grad_norm=None, step_s=0.1, comm_wait_s=0.0, optimizer_s=0.0, compile_s=0.0, tokens_per_s=1.0,
               loss_scale=1.0)
    rows = [dict(row, step=1, loss=4.2, skipped=False), dict(row, step=2, loss=None, skipped=True)]
    text = summary(rows, 1.0, [])
    assert "loss        4.2000 (step 1) -> non-finite (step 2), mean of last 2: 4.2000" in text
    assert "non-finite (step 2), mean of last 1: non-finite" in summary(rows[1:], 1.0, [])


@pytest.mark.slow
def test_hpf_train_fp16_that_diverges_stops_with_a_named_error_and_run_json_says_failed(tmp_path):
    """The issue's run: a summary TypeError on None, rc 1, and run.json "done"."""
    out = tmp_path / "run"
    proc = hpf_cmd("train", "--world-size", 1, "--steps", 60, "--mixed-precision", "fp16", "--lr", 1e4, "--out", out)
    assert proc.returncode == 1, proc.stderr
    assert "fp16: 50 steps in a row had non-finite grads and were skipped" in proc.stderr, proc.stderr
    assert json.loads((out / "run.json").read_text())["status"] == "failed: NonFiniteError"
    assert all(r["loss_scale"] >= 1.0 for r in records(out))
