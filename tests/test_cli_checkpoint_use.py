"""A checkpoint of `hpf train` holds its model and config, and `hpf eval`, `export` and
`generate` use it in one process."""
import optree
import pytest
import torch

import hpf
from cli_helpers import REPO, hpf_cmd, one_error_line


V, D = 23, 12


def tokens(step, rank=0, world=1):
    full = torch.randint(0, V, (8, 9), generator=torch.Generator().manual_seed(step))
    return full.chunk(world)[rank]


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """A 3-step llama run on a byte token folder, saved at its end."""
    root = tmp_path_factory.mktemp("llama_run")
    (root / "text").mkdir()
    (root / "text" / "a.txt").write_text((REPO / "README.md").read_text() * 2)
    assert hpf_cmd("prepare", root / "text", "--out", root / "data").returncode == 0
    proc = hpf_cmd("train", "--model", "llama", "--data", root / "data", "--world-size", 1, "--steps", 3,
                   "--save-every", 3, "--eval-every", 3, "--seed", 5, "--out", root / "run")
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
    batches = data.TokenData(llama_run / "data", "val").batches(4, config.seq_len, 5, state={"seed": 5, "step": 0},
                                                                rank=0, world_size=1)  # the run's seed
    with torch.no_grad():
        want = sum(float(llama.loss_for(config)(params, next(batches))) for _ in range(2)) / 2
    assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.slow
def test_hpf_eval_of_a_run_is_its_own_held_out_loss_at_that_step(llama_run):
    # the run evaluated its held-out loss at step 3 (batch 32, seed 5) and saved step 3: hpf eval,
    # given only the data, takes the run's settings and gets the same loss, and says which it used
    import json
    records = [json.loads(line) for line in (llama_run / "run" / "metrics.jsonl").read_text().splitlines()]
    proc = hpf_cmd("eval", llama_run / "run", "--data", llama_run / "data")
    assert proc.returncode == 0, proc.stderr
    got = float(proc.stdout.split("held-out loss ")[1].split()[0])
    assert got == pytest.approx(records[-1]["eval_loss"], abs=1e-4)
    assert "4 batches of 32 x" in proc.stdout and "seed 5" in proc.stdout and "the run's held-out settings" in proc.stdout
    assert float(hpf_cmd("eval", llama_run / "run").stdout.split("held-out loss ")[1].split()[0]) == got  # its data too


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
    assert proc.stdout.strip() == ",".join(map(str, tokens[0].tolist()))  # the prompt first, as it was given
    text = hpf_cmd("generate", llama_run / "run", "--prompt", "AB", "--tokens", 4)
    assert text.returncode == 0 and text.stdout == bytes(t for t in tokens[0].tolist() if t < 256).decode(
        errors="replace") + "\n"


@pytest.mark.slow
def test_hpf_export_of_a_model_without_a_transformers_twin_is_refused(tmp_path):
    proc = hpf_cmd("train", "--world-size", 1, "--steps", 1, "--save-every", 1, "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    refused = hpf_cmd("export", tmp_path / "run", "--to", "hf", tmp_path / "hf")
    assert refused.returncode == 2 and "holds a gpt model" in one_error_line(refused)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["eval", "generate", "export"])
def test_a_crafted_header_is_one_line_naming_the_file_and_field(llama_run, tmp_path, command):
    """Issue 55 item 18, through the commands: a dtype string naming a torch function (valid JSON,
    CRC re-sealed) ended in a traceback; now exit 2 and one line naming hpf.json and the field."""
    import json
    import shutil

    from hpf.checkpoint import latest
    from hpf.checkpoint_files import seal

    ckpt = tmp_path / "step_3"
    shutil.copytree(latest(llama_run / "run" / "checkpoints"), ckpt)
    header = json.loads((ckpt / "hpf.json").read_text())
    key = next(iter(header["tensors"]))
    header["tensors"][key][1] = "torch.zeros"
    (ckpt / "hpf.json").write_text(json.dumps(seal(header)))
    args = {"eval": ["--data", llama_run / "data", "--batches", 1], "generate": ["--prompt-ids", "65,66", "--tokens", 2],
            "export": ["--to", "hf", tmp_path / "hf"]}[command]
    proc = hpf_cmd(command, ckpt, *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert f"hpf.json: field 'tensors/{key}' names the dtype 'torch.zeros'" in one_error_line(proc)
