"""hpf.data: token files from text, and the deterministic, rank-split, resumable windows."""
import json
import sys

import numpy as np
import pytest
import torch

from hpf import data

TEXTS = ["héllo wörld\n" * 40, "def f(x):\n    return x * 2\n" * 30, "tail"]


@pytest.fixture()
def corpus(tmp_path):
    files = []
    for i, text in enumerate(TEXTS):
        f = tmp_path / f"doc{i}.txt"
        f.write_text(text, encoding="utf-8")
        files.append(f)
    return files


@pytest.fixture()
def prepared(tmp_path, corpus):
    data.prepare(corpus, tmp_path / "tok", val_fraction=0.1)
    return tmp_path / "tok"


def test_bytes_prepare_writes_the_byte_stream_with_document_ends(tmp_path, corpus):
    meta = data.prepare(corpus, tmp_path / "tok", val_fraction=0.1)
    stream = []
    for text in TEXTS:  # independent: the utf-8 bytes, then the end-of-document token 256
        stream += list(text.encode("utf-8")) + [256]
    train = np.fromfile(tmp_path / "tok" / "train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "tok" / "val.bin", dtype=np.uint16)
    assert train.tolist() + val.tolist() == stream
    assert len(val) == round(0.1 * len(stream))
    on_disk = json.loads((tmp_path / "tok" / "meta.json").read_text())
    assert on_disk == meta
    assert meta["vocab_size"] == 257 and meta["dtype"] == "uint16" and meta["eot_token"] == 256
    assert meta["tokens"] == {"train": len(train), "val": len(val)}
    assert meta["sources"] == [str(f) for f in corpus]


def _word_tokenizer(path, n_words):
    import tokenizers  # the test extra; hpf.data imports it only for a tokenizer.json
    vocab = {"<unk>": 0, "<|endoftext|>": 1, **{f"w{i}": i + 2 for i in range(n_words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path))
    return vocab


@pytest.mark.parametrize("n_words,dtype", [(50, np.uint16), (70000, np.uint32)])
def test_tokenizer_json_prepare(tmp_path, n_words, dtype):
    vocab = _word_tokenizer(tmp_path / "tokenizer.json", n_words)
    docs = ["w1 w2 w3 nope w4", f"w{n_words - 1} w0"]
    files = []
    for i, text in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(text)
        files.append(tmp_path / f"{i}.txt")
    meta = data.prepare(files, tmp_path / "tok", tokenizer=str(tmp_path / "tokenizer.json"), val_fraction=0.25)
    want = [vocab.get(w, 0) for w in docs[0].split()] + [1] + [vocab[w] for w in docs[1].split()] + [1]
    got = np.concatenate([np.fromfile(tmp_path / "tok" / f"{s}.bin", dtype=dtype) for s in ("train", "val")])
    assert got.tolist() == want
    assert meta["vocab_size"] == n_words + 2 and meta["dtype"] == np.dtype(dtype).name and meta["eot_token"] == 1
    assert data.TokenData(tmp_path / "tok", "val").tokens.dtype == dtype


def test_windows_are_deterministic_rank_split_and_from_the_file(prepared):
    train = data.TokenData(prepared)
    raw = np.fromfile(prepared / "train.bin", dtype=np.uint16)
    whole = [next(train.batches(8, 16, seed=3, state={"seed": 3, "step": s})) for s in range(3)]
    again = train.batches(8, 16, seed=3)
    assert all(torch.equal(w, next(again)) for w in whole)
    assert not torch.equal(whole[0], next(train.batches(8, 16, seed=4)))
    assert not torch.equal(whole[0], whole[1])
    for batch in whole:  # every row is a contiguous window of the file
        assert batch.dtype == torch.int64 and batch.shape == (8, 17)
        for row in batch.numpy():
            starts = [i for i in range(len(raw) - 16) if raw[i] == row[0] and np.array_equal(raw[i:i + 17], row)]
            assert starts, row
    for world in (2, 4):  # ranks take disjoint row slices that reassemble the global batch
        streams = [train.batches(8, 16, seed=3, rank=r, world_size=world) for r in range(world)]
        for step in range(3):
            local = [next(s) for s in streams]
            assert all(x.shape == (8 // world, 17) for x in local)
            assert torch.equal(torch.cat(local), whole[step])


def test_windows_cover_the_data(prepared):
    train = data.TokenData(prepared)
    it = train.batches(64, 8, seed=0)
    starts = np.concatenate([it.offsets(s) for s in range(20)])
    assert starts.min() >= 0 and starts.max() <= len(train) - 9
    assert starts.max() > 0.9 * (len(train) - 9) and starts.min() < 0.1 * len(train)


def test_resume_from_state_continues_the_stream(prepared):
    train = data.TokenData(prepared)
    it = train.batches(4, 8, seed=1, rank=1, world_size=2)
    for _ in range(3):
        next(it)
    saved = it.state()
    assert saved == {"seed": 1, "step": 3}
    expected = [next(it) for _ in range(2)]
    resumed = train.batches(4, 8, seed=1, rank=1, world_size=2, state=json.loads(json.dumps(saved)))
    assert all(torch.equal(e, next(resumed)) for e in expected)
    with pytest.raises(ValueError, match="seed"):
        train.batches(4, 8, seed=2, state=saved)


def test_window_is_a_view_of_the_memmap(prepared):
    train = data.TokenData(prepared)
    view = train.window(5, 10)
    base = train.tokens.ctypes.data
    assert base + 5 * 2 == view.data_ptr() and view.dtype == torch.uint16
    assert view.tolist() == np.fromfile(prepared / "train.bin", dtype=np.uint16)[5:15].tolist()


def test_errors_name_the_problem(tmp_path, prepared, corpus):
    with pytest.raises(FileNotFoundError, match="hpf prepare"):
        data.TokenData(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="meta.json"):
        data.TokenData(tmp_path)
    with pytest.raises(ValueError, match="window of seq_len"):
        data.TokenData(prepared, "val").batches(2, 10_000)
    with pytest.raises(ValueError, match="multiple of world_size"):
        data.TokenData(prepared).batches(6, 8, world_size=4)
    with pytest.raises(FileNotFoundError, match="neither a file nor a folder"):
        data.prepare([tmp_path / "missing.txt"], tmp_path / "x")
    with pytest.raises(ValueError, match="val_fraction"):
        data.prepare(corpus, tmp_path / "x", val_fraction=1.5)
    with open(prepared / "train.bin", "r+b") as f:  # truncated
        f.truncate(10)
    with pytest.raises(ValueError, match="truncated"):
        data.TokenData(prepared)
    (prepared / "meta.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        data.TokenData(prepared)
    (prepared / "meta.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="hpf-tokens"):
        data.TokenData(prepared)


def test_missing_tokenizers_is_a_clear_error(tmp_path, corpus, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ModuleNotFoundError, match="pip install tokenizers"):
        data.prepare(corpus, tmp_path / "tok", tokenizer=str(tmp_path / "tokenizer.json"))


def test_token_ids_past_the_vocab_are_refused_when_the_folder_is_opened(prepared):
    """meta.json's vocab smaller than the largest id: an error naming the file and the id at open,
    not an IndexError in some rank's embedding."""
    meta = json.loads((prepared / "meta.json").read_text())
    top = int(np.fromfile(prepared / "train.bin", dtype=meta["dtype"]).max())
    data.TokenData(prepared)  # as prepared: fine
    (prepared / "meta.json").write_text(json.dumps({**meta, "vocab_size": top}))
    with pytest.raises(ValueError, match=rf"train\.bin: token id {top} .* outside the vocab of {top}"):
        data.TokenData(prepared)


def test_hpf_prepare_says_what_is_wrong_with_a_tokenizer_or_an_out_file(tmp_path, corpus, capsys):
    """A text file as --tokenizer and an existing file as --out: one line each that names the path
    and the fix (they were "Exception: expected value at line 1 column 1" and "[Errno 17] File exists")."""
    from hpf import cli

    pytest.importorskip("tokenizers", reason="the tokenizer case needs the tokenizers package (an extra)")
    cases = [(["--tokenizer", str(corpus[0]), "--out", str(tmp_path / "a")], [str(corpus[0]), "tokenizer.json"]),
             (["--out", str(corpus[1])], [str(corpus[1]), "is a file, not a folder"])]
    for argv, words in cases:
        assert cli.main(["prepare", str(corpus[2]), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and all(w in err for w in words), err
