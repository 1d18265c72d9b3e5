"""`hpf train --ns-variant` and `--qk-clip` reach hpf.optim.muon, and are refused where they cannot act."""
import json

import pytest
import torch

import hpf
from hpf import checkpoint, cli
from hpf.cli import train as cli_train
from hpf.cli.job import run_keys
from hpf.models import gpt
from test_cli import run_main

STEPS = 2
TINY = gpt.CONFIGS["tiny"]


def reference(**muon_options):
    """(losses, params, each step's max attention logit per head) of STEPS steps of hpf.optim.muon on the
    full GPT tiny, plain autograd, this process.
    QK-Clip reads the step's max attention logits (an aux), which the loop passes to update."""
    adamw_lr, muon_lr, _ = cli.TRAIN_DEFAULTS["tiny"]
    if muon_options.get("qk_clip") is not None:
        muon_options["qk_heads"] = gpt.qk_heads(TINY)
    optimizer = hpf.optim.muon(lr=muon_lr, adamw_lr=adamw_lr, **muon_options)
    params, losses, logits = gpt.init(TINY, run_keys(0)[0]), [], []
    treedef, state = hpf.tree.structure(params), optimizer.init(params)
    loss_fn = gpt.loss_for(TINY, max_logits=True)
    for s in range(STEPS):
        leaves = [p.detach().requires_grad_() for p in hpf.tree.flatten(params)[1]]
        loss, aux = loss_fn(hpf.tree.unflatten(treedef, leaves), gpt.global_batch(TINY, 32, 0, s))
        grads = torch.autograd.grad(loss, leaves)
        with torch.no_grad():
            params, state = optimizer.update(hpf.tree.unflatten(treedef, list(grads)), state,
                                             hpf.tree.unflatten(treedef, [p.detach() for p in leaves]), aux=aux)
        losses.append(loss.item())
        logits.append(aux["max_attn_logit"].reshape(-1))
    return losses, hpf.tree.flatten(params)[1], logits


@pytest.mark.slow
def test_ns_variant_and_qk_clip_reach_muon(tmp_path, capsys, monkeypatch):
    made = []  # the driver builds the job's step once before any rank starts (the ranks build their own alike)
    make_step = cli_train.make_step
    monkeypatch.setattr(cli_train, "make_step", lambda job, mesh: made.append(make_step(job, mesh)) or made[-1])
    code, out, err = run_main(["train", "--world-size", "1", "--steps", str(STEPS), "--optimizer", "muon",
                             "--ns-variant", "gram", "--qk-clip", "0.05", "--save-every", str(STEPS),
                             "--out", str(tmp_path)], capsys)
    assert code == 0, err
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    got = hpf.tree.flatten(checkpoint.load_params(checkpoint.latest(tmp_path / "checkpoints")))[1]
    want_losses, want, logits = reference(ns_variant="gram", qk_clip=0.05)
    assert losses == pytest.approx(want_losses, rel=1e-5)
    # each step says how QK-Clip acted: the heads whose max logit passed tau, and the largest logit
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["qk_heads_clipped"] for r in records] == [int((s > 0.05).sum()) for s in logits]
    assert [r["qk_max_logit"] for r in records] == pytest.approx([float(s.max()) for s in logits], rel=1e-5)
    assert all(r["qk_heads_clipped"] > 0 for r in records)  # tau 0.05: it fires
    assert f"qk-clip     fired in {STEPS} of {STEPS} steps" in out
    optimizer = made[0].optimizer
    assert (optimizer.ns_variant, optimizer.qk_clip, optimizer.qk_heads.keys()) == ("gram", 0.05, gpt.qk_heads(TINY).keys())
    # fp32, flat shards vs full tensors (as test_cli's muon test). QK-Clip moves the q/k weights by far more;
    # Gram agrees with the standard iteration to ~4e-7 here, so its choice shows only in the optimizer above
    assert max(float((a - b).abs().max()) for a, b in zip(want, reference(ns_variant="gram")[1])) > 1e-4
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
    options = json.loads((tmp_path / "run.json").read_text())["options"]
    assert (options["ns_variant"], options["qk_clip"]) == ("gram", 0.05)


@pytest.mark.parametrize("argv, said", [
    (["--qk-clip", "1"], "--optimizer is adamw"),
    (["--ns-variant", "auto"], "--optimizer is adamw"),
    (["--optimizer", "muon", "--model", "moe", "--qk-clip", "1"], "--model moe"),
    (["--optimizer", "muon", "--qk-clip", "0"], "--qk-clip"),
    (["--optimizer", "muon", "--ns-variant", "fast"], "--ns-variant"),
])
def test_muon_options_that_cannot_act_are_refused(tmp_path, capsys, argv, said):
    code, _, err = run_main(["train", "--world-size", "1", "--steps", "2", "--out", str(tmp_path / "r")] + argv,
                            capsys)
    assert code != 0 and said in err, err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
