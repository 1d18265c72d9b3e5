"""The README and the docs site: the site builds with warnings as errors (executing the
notebooks), the README stays short and current, and its examples print what it says."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
sys.path.insert(0, str(ROOT / "docs"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


@pytest.mark.slow
def test_the_docs_build_with_warnings_as_errors_and_run_the_notebooks(tmp_path):
    # (one compute thread, as in this process (conftest.py): the notebooks' one-process references
    # ran 3-10x slower on two threads with the other test worker on the second core)
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", "docs", str(tmp_path / "html")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    for page in ("contract", "topology", "validation", "muon", "moe", "checkpoints", "simulate", "plan_search", "benchmarks",
                 "architecture", "cli", "api", "modules", "notebooks/quickstart", "notebooks/muon",
                 "notebooks/tensor_parallel", "notebooks/hessian"):
        assert (tmp_path / "html" / f"{page}.html").is_file(), page
    quickstart = (tmp_path / "html" / "notebooks" / "quickstart.html").read_text()
    assert "plan check OK" in quickstart  # an executed cell's output, not just its source
    check_built_site(tmp_path / "html")


def check_built_site(html: Path) -> None:
    """Every public name renders on the API page; option text renders as typed; the plan search's
    page is its own (issue 38)."""
    import hpf
    import hpf.checkpoint
    ids = set(re.findall(r'id="([^"]+)"', (html / "api.html").read_text()))
    names = [f"hpf.{n}" for n in hpf.__all__] + [f"hpf.checkpoint.{n}" for n in hpf.checkpoint.__all__]
    names += [f"hpf.Mesh.{m}" for m in ("axis_size", "coords", "rank_of")]
    names += [f"hpf.ShardStep.{m}" for m in ("init", "__call__", "full_params", "save", "restore")]
    assert [n for n in names if n not in ids and f"module-{n}" not in ids] == []
    cli = (html / "cli.html").read_text()
    assert "\u2013" not in cli and "--out" in cli and "&lt;out&gt;/metrics.jsonl" in cli
    assert "Plan search" in (html / "plan_search.html").read_text()


def test_no_page_is_shadowed_by_one_sphinx_makes():
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    assert not pages & {"search", "genindex", "py-modindex"}, "Sphinx writes its own page under that name"


def test_the_readme_is_short_present_tense_and_dateless():
    lines = README.splitlines()
    assert len(lines) <= 300, len(lines)
    assert not re.search(r"\b20\d\d-\d\d", README), re.search(r".{40}\b20\d\d-\d\d.{20}", README)[0]
    for stale in ("Status as of", "not yet detected", "does not cast the batch", "hpf bench", "python -m hpf.sim.calibrate"):
        assert stale not in README, stale


def test_the_readme_says_how_to_get_the_hpf_command_and_its_test_command_is_ci():
    setup = README.split("## Set up", 1)[1].split("\n## ", 1)[0]
    assert "source .venv/bin/activate" in setup and "hpf: command not found" in setup
    test_command = next(line for line in blocks("bash")[0].splitlines() if "pytest" in line)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command.replace("pip install ", "pip install -q ") in ci


def test_the_readme_contract_matches_what_the_step_does():
    contract = README.split("<!-- contract: start -->", 1)[1].split("<!-- contract: end -->", 1)[0]
    assert "hpf.DonatedStateError" in contract  # reusing a donated state is detected
    assert "floating leaf of the batch is cast" in contract  # and the batch is cast under mixed precision
    assert "hpf.weighted(sum, count)" in contract and "batch_axes" in contract  # the loss's meaning, the opt-out
    assert "hpf.ScheduleMismatchError" in contract


def test_the_readme_option_table_names_real_options_and_every_model():
    from hpf.cli import build_parser
    from hpf.models import MODELS

    parser = build_parser("train")
    train = next(a for a in parser._actions if a.dest == "command").choices["train"]
    known = {s for a in train._actions for s in a.option_strings}
    table = README.split("| option | default | meaning |", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`(--[a-z-]+)", table))
    assert named <= known, named - known
    assert "--ep-axis" in named
    model_row = next(line for line in table.splitlines() if "`--model`" in line)
    assert all(f"`{m}`" in model_row for m in MODELS), model_row


def test_the_readme_real_run_is_the_one_the_docs_measure():
    from real_run import COMMANDS

    for command in COMMANDS:
        assert command.replace('\\"', '"') in README, command
    measured = json.loads((ROOT / "docs" / "results" / "real_run.json").read_text())["figures"]
    assert measured["commands"] == COMMANDS and len(measured["losses"]) == 300


@pytest.mark.slow
def test_the_real_runs_warmup_gives_the_pages_losses(tmp_path):
    """The page's real run is this code's: the README's commands for 21 steps (the 20 warmup steps'
    learning rates do not depend on --steps, so losses 1-21 are the 300-step run's) give its first 21
    losses. Within rtol 1e-5, not bit for bit: a loss is an fp32 mean, and another CPU's kernels (or
    MKL_CBWR's code paths) round differently, about an ulp (6e-8) a step, which the steps carry on:
    against the page, at most 1.2e-6 relative over these 21 (this Xeon as it is, under MKL_CBWR=AVX2
    or COMPATIBLE, ATEN_CPU_CAPABILITY=avx2, and both). A changed default moves them by far more:
    --warmup 10 for the config's 20 moves the second loss by 3e-2."""
    import platform
    from real_run import COMMANDS

    page = json.loads((ROOT / "docs" / "results" / "real_run.json").read_text())
    if platform.python_version() != page["environment"]["python"]:
        pytest.skip(f"the text is Python's standard library: this is {platform.python_version()}, the page's "
                    f"{page['environment']['python']}")
    short = COMMANDS[2].replace("--steps 300", "--steps 21")
    assert short != COMMANDS[2]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(" && ".join(COMMANDS[:2] + [short]), shell=True, cwd=tmp_path, env=env, executable="/bin/bash",
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "runs" / "stdlib" / "metrics.jsonl") as f:
        losses = [json.loads(line)["loss"] for line in f if line.strip()]
    np.testing.assert_allclose(losses, page["figures"]["losses"][:21], rtol=1e-5, atol=0)


def test_the_committed_notebooks_carry_no_outputs():
    """The docs build executes them, so outputs committed here could only go stale."""
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        stale = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
        assert not stale, f"{path.name}: cells {stale} carry outputs; clear them (the docs build runs the notebook)"


def test_the_readme_says_how_to_run_a_notebook_by_hand():
    notebooks = README.split("## Notebooks", 1)[1].split("\n## ", 1)[0]
    command = re.search(r"\.venv/bin/(\S+) notebooks/quickstart\.ipynb", notebooks)
    assert command and (Path(sys.executable).parent / command[1]).exists(), command
    shipped = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert sorted(set(re.findall(r"notebooks/(\w+\.ipynb)", notebooks))) == shipped  # (it said three of four)
    assert f"runs all {['one', 'two', 'three', 'four', 'five'][len(shipped) - 1]}" in " ".join(notebooks.split())


@pytest.mark.slow
def test_the_readme_example_prints_what_the_readme_says(tmp_path):
    code = blocks("python")[0]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    said = re.search(r"the same number four times:\n`(\[.*?\])`", README)[1]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == pytest.approx(json.loads(said), rel=1e-5)


@pytest.mark.slow
def test_the_main_job_prints_the_losses_the_readme_shows(tmp_path):
    shown = README.split("$ hpf train --out runs/first", 1)[1].split("```", 1)[0]
    proc = subprocess.run([sys.executable, "-m", "hpf", "train", "--out", "runs/first"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    loss_line = lambda text: re.search(r"loss\s+([\d.]+) \(step 1\) -> ([\d.]+) .*last 10: ([\d.]+)", text).groups()  # noqa: E731
    assert [float(x) for x in loss_line(proc.stdout)] == pytest.approx([float(x) for x in loss_line(shown)], abs=2e-4)
    assert proc.stdout.splitlines()[0] == shown.strip().splitlines()[0]  # the banner


def test_the_error_table_covers_every_error_class_the_tests_raise():
    import gen
    from test_bad_inputs import CASES

    table = gen.errors()
    for kind in {kind.__name__ for _, kind, _ in CASES.values()}:
        assert f"`{kind}`" in table, kind


def test_every_step_option_is_documented_where_shard_step_points():
    """shard_step's options are StepConfig's fields, documented in StepConfig's docstring (one
    home: shard_step's own docstring points there instead of keeping a list that drifts)."""
    import dataclasses

    import hpf
    doc = hpf.StepConfig.__doc__
    missing = [f.name for f in dataclasses.fields(hpf.StepConfig) if not re.search(rf"^\s+{f.name}[:,]", doc, re.M)]
    assert missing == [], f"StepConfig fields missing from its docstring: {missing}"
    assert "StepConfig" in hpf.shard_step.__doc__
