"""The installed package: the `hpf` command beside the environment's python, an import that is
cheap until used, a fast `--help`, and sources without history narratives."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import REPO, hpf_cmd


@pytest.mark.slow
def test_the_hpf_command_is_installed_beside_the_environments_python():
    """The README's set-up puts `hpf` in .venv/bin and says to activate it (test_docs checks the text)."""
    proc = subprocess.run([str(Path(sys.executable).parent / "hpf"), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "{train,prepare,plan,simulate,calibrate,eval,export,generate,store}" in proc.stdout


@pytest.mark.slow
def test_import_hpf_reaches_every_submodule_without_importing_torch_up_front():
    code = ("import sys, hpf; assert 'torch' not in sys.modules, 'import hpf imported torch'; "
            "print(hpf.checkpoint.load_params.__name__, hpf.data.TokenData.__name__, sorted(hpf.models.MODELS), "
            "'checkpoint' in dir(hpf))")
    proc = hpf_cmd(code=code, fresh=True)  # (what start-up imports)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["load_params", "TokenData", "['gpt',", "'llama',", "'moe']", "True"]


@pytest.mark.slow
def test_hpf_help_imports_no_torch_and_answers_fast():
    code = ("import sys, time; t = time.perf_counter(); from hpf.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, time.perf_counter() - t, file=sys.stderr)")
    proc = hpf_cmd(code=code, fresh=True)  # (what start-up imports)
    imported, seconds = proc.stderr.split()
    assert imported == "False" and "train" in proc.stdout and "calibrate" in proc.stdout
    assert float(seconds) < 0.5  # without torch it is tens of ms; importing torch alone takes over 1 s here


@pytest.mark.slow
def test_bench_is_a_repository_tool_not_an_hpf_command():
    assert hpf_cmd("bench").returncode == 2
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "run.py"), "--help"], capture_output=True,
                          text=True, cwd="/")
    assert proc.returncode == 0 and "--json" in proc.stdout


def test_no_history_narratives_in_the_simulator_and_cli_sources():
    stale = ("earlier protocol", "the old model", "made before the term existed", "were predicted at",
             "(then)", "started above ln V")
    for path in [*(REPO / "hpf" / "sim").glob("*.py"), *(REPO / "hpf" / "cli").glob("*.py")]:
        text = path.read_text()
        assert not re.search(r"\b20\d\d-\d\d\b", text), path
        assert not [s for s in stale if s in text], path


