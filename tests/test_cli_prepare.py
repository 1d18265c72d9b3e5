"""`hpf prepare`: it refuses text it cannot use and keeps a token folder unless asked."""
import pytest
from cli_helpers import hpf_cmd, one_error_line


@pytest.mark.slow
@pytest.mark.parametrize("case, names", [("binary", "is not a text file (a NUL byte at byte"),
                                         ("empty", "hold no text (0 bytes)"),
                                         ("tiny", "are too few: holding out 0.05 of them for validation needs at least 40")])
def test_prepare_refuses_binary_empty_and_too_little_text(case, names, tmp_path):
    source = tmp_path / "input"
    source.write_bytes({"binary": b"\x7fELF\x02\x01\x01\x00" * 64, "empty": b"", "tiny": b"hello"}[case])
    proc = hpf_cmd("prepare", source, "--out", tmp_path / "data")
    assert proc.returncode == 2
    assert names in one_error_line(proc)
    assert not (tmp_path / "data").exists()


@pytest.mark.slow
def test_prepare_does_not_overwrite_a_token_folder_unless_asked(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("some text to tokenize, long enough for both splits. " * 20)
    assert hpf_cmd("prepare", text, "--out", tmp_path / "data").returncode == 0
    again = hpf_cmd("prepare", text, "--out", tmp_path / "data")
    assert again.returncode == 2 and "already holds token files" in one_error_line(again)
    assert hpf_cmd("prepare", text, "--out", tmp_path / "data", "--overwrite").returncode == 0
