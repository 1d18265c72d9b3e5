"""Token files for real text: ``prepare`` writes them, ``TokenData`` reads training windows.

A prepared folder is nanoGPT's layout plus a header::

    train.bin  val.bin   raw token ids, uint16 when the vocab fits (< 65536), else uint32
    meta.json            {"format": "hpf-tokens", "version": 1, "vocab_size", "tokenizer",
                          "dtype", "eot_token", "tokens": {"train", "val"}, "sources": [...]}

The .bin files are read through ``np.memmap``, so a rank touches only the pages of the windows
it trains on. Batches are a pure function of (seed, step): rank r of W takes rows
[r*B/W, (r+1)*B/W) of the global batch, so ranks never overlap, the data seen does not depend
on the world size, and a run resumes from ``{"seed", "step"}`` alone.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from .comm import world

__all__ = ["prepare", "text_files", "read_meta", "TokenData", "Batches", "HeldOut", "BYTE_VOCAB", "EOT_BYTE"]

FORMAT, VERSION = "hpf-tokens", 1
EOT_BYTE = 256  # the byte tokenizer's end-of-document token, after the 256 byte values
BYTE_VOCAB = 257
SPLITS = ("train", "val")
EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")  # tried in order for tokenizer.json


def _byte_encoder():
    def encode(data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)
    return encode, BYTE_VOCAB, EOT_BYTE, "bytes"


def _hf_encoder(path: Path):
    try:
        from tokenizers import Tokenizer
    except ModuleNotFoundError:
        raise ModuleNotFoundError("prepare(tokenizer=<tokenizer.json>) needs the tokenizers package: "
                                  "pip install tokenizers (or use tokenizer='bytes')") from None
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {path} is not a file; give a local tokenizer.json or 'bytes'")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 -- the tokenizers package raises a bare Exception
        raise ValueError(f"tokenizer {path} is not a tokenizer.json the tokenizers package can read ({e}); give a "
                         "Hugging Face tokenizer.json, or 'bytes'") from None
    eot = next((i for i in map(tok.token_to_id, EOT_NAMES) if i is not None), None)

    def encode(data: bytes) -> np.ndarray:
        return np.asarray(tok.encode(data.decode("utf-8", errors="replace"), add_special_tokens=False).ids)
    return encode, tok.get_vocab_size(), eot, str(path.resolve())


def text_files(inputs: Sequence[str | os.PathLike], glob: str = "*") -> list[Path]:
    """Files in the order given; a folder stands for its files matching ``glob``, recursively, sorted."""
    files = []
    for item in map(Path, inputs):
        if item.is_dir():
            found = sorted(p for p in item.rglob(glob) if p.is_file())
            if not found:
                raise FileNotFoundError(f"folder {item} has no files matching {glob!r}")
            files += found
        elif item.is_file():
            files.append(item)
        else:
            raise FileNotFoundError(f"{item} is neither a file nor a folder")
    if not files:
        raise ValueError("prepare: no text files given")
    return files


def _text(path: Path) -> bytes:
    """The bytes of a text file; a binary file (a NUL byte, or not UTF-8) is an error naming it,
    since its bytes would train a model on noise."""
    data = path.read_bytes()
    try:
        if b"\0" in data:
            raise UnicodeDecodeError("utf-8", data, data.index(b"\0"), data.index(b"\0") + 1, "a NUL byte")
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not a text file ({e.reason} at byte {e.start}); give text files, or pick a "
                         "folder's text files with --glob (glob= in Python), e.g. '*.py'") from None
    return data


def prepare(inputs: Sequence[str | os.PathLike], out_dir: str | os.PathLike, tokenizer: str = "bytes",
            val_fraction: float = 0.05, glob: str = "*", overwrite: bool = False) -> dict:
    """Tokenize the ``text_files(inputs, glob)`` (in that order, each followed by the
    end-of-document token when the tokenizer has one) into ``out_dir``; the last ``val_fraction``
    of the token stream is the held-out split (nanoGPT's convention). ``tokenizer``: "bytes"
    (vocab 257: 256 byte values + end-of-document) or a local HF ``tokenizer.json``. Returns the
    header it wrote.

    Raises:
        ValueError: a file that is not UTF-8 text, too little text for both splits, or an
            ``out_dir`` that already holds token files (unless ``overwrite``).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file, not a folder; give the folder to write the token files to (a new path)")
    held = [p.name for p in (out / n for n in ("meta.json", "train.bin", "val.bin")) if p.exists()]
    if held and not overwrite:
        raise ValueError(f"{out} already holds token files ({', '.join(held)}); pick another folder, or overwrite "
                         "them with --overwrite (overwrite=True in Python)")
    files = text_files(inputs, glob)
    encode, vocab, eot, name = _byte_encoder() if tokenizer == "bytes" else _hf_encoder(Path(tokenizer))
    dtype = np.uint16 if vocab < 2 ** 16 else np.uint32
    parts, text_bytes = [], 0
    for f in files:  # the whole corpus is held once in memory, as compact token ids
        data = _text(f)
        text_bytes += len(data)
        parts.append(encode(data).astype(dtype))
        if eot is not None:
            parts.append(np.array([eot], dtype=dtype))
    if not text_bytes:
        raise ValueError(f"the {len(files)} input file(s) hold no text (0 bytes); give files with text in them")
    tokens = np.concatenate(parts)
    n_val = int(round(len(tokens) * val_fraction))
    if n_val < 2 or len(tokens) - n_val < 2:
        need = math.ceil(2 / min(val_fraction, 1 - val_fraction))
        raise ValueError(f"{len(tokens)} tokens ({text_bytes} bytes of text) are too few: holding out "
                         f"{val_fraction:g} of them for validation needs at least {need}; give more text")
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, chunk in zip(SPLITS, (tokens[:-n_val], tokens[-n_val:])):
        chunk.tofile(out / f"{split}.bin")
        counts[split] = int(len(chunk))
    meta = {"format": FORMAT, "version": VERSION, "vocab_size": int(vocab), "tokenizer": name,
            "dtype": np.dtype(dtype).name, "eot_token": eot, "tokens": counts,
            "sources": [str(f) for f in files]}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def read_meta(data_dir: str | os.PathLike) -> dict:
    """The checked header of a prepared folder."""
    d = Path(data_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"data folder {d} does not exist; make it with `hpf prepare TEXT_FILES... --out {d}`")
    path = d / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"{d} has no meta.json; it is not a folder `hpf prepare` wrote")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); prepare the data again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{path} is not an {FORMAT} v{VERSION} header; prepare the data again with `hpf prepare`")
    for key in ("vocab_size", "dtype", "tokens"):
        if key not in meta:
            raise ValueError(f"{path} lacks {key!r}; prepare the data again with `hpf prepare`")
    if meta["dtype"] not in ("uint16", "uint32"):
        raise ValueError(f"{path}: dtype {meta['dtype']!r} is not uint16 or uint32")
    return meta


class TokenData:
    """One split of a prepared folder, memory-mapped (the file is never written)."""

    def __init__(self, data_dir: str | os.PathLike, split: str = "train"):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.meta = read_meta(data_dir)
        self.vocab_size = int(self.meta["vocab_size"])
        path = Path(data_dir) / f"{split}.bin"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; prepare the data again with `hpf prepare`")
        dtype = np.dtype(self.meta["dtype"])
        want = int(self.meta["tokens"].get(split, -1))
        if path.stat().st_size != want * dtype.itemsize:
            raise ValueError(f"{path} holds {path.stat().st_size} bytes but meta.json says {want} {dtype.name} "
                             f"tokens; the folder is truncated or mixed, prepare it again")
        self.path, self.split = path, split
        # copy-on-write: torch.from_numpy wants a writable array; reads stay zero-copy, and no
        # write ever reaches the file
        self.tokens = np.memmap(path, dtype=dtype, mode="c")
        top = int(self.tokens.max()) if len(self.tokens) else -1  # one pass (GB/s): an id past the vocab
        if top >= self.vocab_size:  # would be an IndexError inside some rank's embedding lookup
            at = int(np.argmax(self.tokens >= self.vocab_size))
            raise ValueError(f"{path}: token id {top} (first bad id at position {at}) is outside the vocab of "
                             f"{self.vocab_size} that {Path(data_dir) / 'meta.json'} states; the folder is mixed or "
                             "was changed after hpf prepare wrote it: prepare it again")

    def __len__(self) -> int:
        return len(self.tokens)

    def window(self, start: int, length: int) -> torch.Tensor:
        """Tokens [start, start+length) as a tensor viewing the memmap (no copy, file dtype)."""
        return torch.from_numpy(self.tokens[start:start + length])

    def batches(self, batch_size: int, seq_len: int, seed: int = 0, *, rank: int = 0, world_size: int = 1,
                state: dict | None = None, device=None) -> "Batches":
        """Endless local batches [batch_size/world_size, seq_len+1] (int64) of random windows;
        ``batch_size`` is the global batch. ``state`` (from ``Batches.state()``) resumes."""
        return Batches(self, batch_size, seq_len, seed, rank, world_size, state, device)


class Batches:
    """The iterator ``TokenData.batches`` returns; ``state()`` is the position to save."""

    def __init__(self, data: TokenData, batch_size: int, seq_len: int, seed: int, rank: int, world_size: int,
                 state: dict | None, device):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if batch_size < 1 or batch_size % world_size:
            raise ValueError(f"batch_size={batch_size} (the global batch) must be a positive multiple of "
                             f"world_size={world_size}")
        if seq_len < 1 or seq_len + 1 > len(data):
            raise ValueError(f"a window of seq_len+1={seq_len + 1} tokens does not fit in {data.path} "
                             f"({len(data)} tokens); use a shorter seq_len or more text")
        if state is not None:
            if set(state) != {"seed", "step"} or state["seed"] != seed:
                raise ValueError(f"data state {state!r} does not belong to this stream (seed={seed}); "
                                 "pass the dict Batches.state() returned for the same seed")
        self.data, self.batch_size, self.seq_len, self.seed = data, batch_size, seq_len, seed
        self.local = batch_size // world_size
        self.rows = slice(rank * self.local, (rank + 1) * self.local)
        self.step = 0 if state is None else int(state["step"])
        self.device = device

    def state(self) -> dict:
        """{"seed", "step"}: the next batch's position; ``batches(..., state=...)`` resumes there."""
        return {"seed": self.seed, "step": self.step}

    def offsets(self, step: int) -> np.ndarray:
        """Start of every window of the global batch of ``step`` (all ranks agree on it)."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.data) - self.seq_len, size=self.batch_size)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        out = torch.empty(self.local, self.seq_len + 1, dtype=torch.int64)
        for row, start in zip(out, self.offsets(self.step)[self.rows]):
            row.copy_(self.data.window(start, self.seq_len + 1))  # the one copy: to int64
        self.step += 1
        return out if self.device is None else out.to(self.device)


class HeldOut:
    """``HeldOut(loss_fn, batches)(step, state) -> float``: the mean loss of the gathered params
    (``step.full_params``) over this rank's rows of fixed held-out batches, averaged over ranks.
    Collective: every rank calls it at the same step."""

    def __init__(self, loss_fn, batches: list[torch.Tensor]):
        self.loss_fn, self.batches = loss_fn, batches

    def __call__(self, step, state) -> float:
        params = step.full_params(state)
        with torch.no_grad():
            total = torch.stack([self.loss_fn(params, b).float() for b in self.batches]).mean()
        world.all_reduce(total)
        total /= world.world_size()
        return float(total)
