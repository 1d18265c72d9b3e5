"""The low-bit wire formats of hpf's slow tier: what a quantized message holds, and its size.

A message is rows of n values; each row becomes one uint8 payload that carries its own scales,
so a receiver needs nothing else (no extra collective for the scales):

    [codes: n values, ``bits`` each][scales: n / block float32, one per block]

- ``bf16``: the values cast to bfloat16 (no scales).
- ``fp8``: float8 e4m3fn codes of ``x / s``, ``s = amax / 448`` per block.
- ``int8``: ``round(x / s)`` in [-127, 127], ``s = amax / 127`` per block (symmetric).
- ``int4``: ``round(x / s)`` in [-7, 7], ``s = amax / 7``, two codes per byte (low nibble
  first, stored + 8).

A block's scale is floored at 2**-126 (float32's smallest normal), so ``s = max(amax / qmax,
2**-126)``: its reciprocal stays finite for every finite block (1e-38 included), and values
below about 6e-39 (subnormals) come back as 0.

Error bounds per element (``s``: its block's scale), each tested against the reference in
tests/test_quant.py, for every finite block:

- int8, int4: ``|x - x'| <= s / 2 * (1 + 2**-12)`` (round to nearest; the fp32 products);
- fp8: ``|x - x'| <= max(2**-4 * |x|, 2**-10 * s) * (1 + 2**-12)`` (3 mantissa bits; the
  subnormal spacing near zero);
- bf16: ``|x - x'| <= 2**-8 * |x|`` (round to nearest, 8 significant bits).

A block holding inf or nan dequantizes to non-finite values (its scale carries them), so a
step's finiteness check still sees a non-finite grad.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Format", "FORMATS", "WEIGHT_FORMATS", "GRAD_FORMATS", "check_format", "check_block", "payload_bytes"]


@dataclass(frozen=True)
class Format:
    name: str
    bits: int  # per value on the wire
    qmax: float = 0.0  # the largest code magnitude; 0: no scales (bf16)

    @property
    def scaled(self) -> bool:
        return self.qmax > 0


FORMATS = {f.name: f for f in (Format("bf16", 16), Format("fp8", 8, 448.0), Format("int8", 8, 127.0),
                               Format("int4", 4, 7.0))}
#: What each side of the slow tier accepts: 4-bit weights lose too much to gather.
WEIGHT_FORMATS = ("bf16", "fp8", "int8")
GRAD_FORMATS = ("bf16", "fp8", "int8", "int4")
SCALE_BYTES = 4  # one float32 per block


def check_format(fmt: str, allowed=tuple(FORMATS), what: str = "format") -> Format:
    """The Format named ``fmt``, or a ValueError that lists what ``what`` allows."""
    if fmt not in allowed:
        extra = (" (int4 is for grads only: 4-bit weights lose too much precision to gather; use 'int8' or 'fp8')"
                 if fmt == "int4" else "")
        raise ValueError(f"{what}={fmt!r}: use one of {list(allowed)}{extra}")
    return FORMATS[fmt]


def check_block(block: int, fmt: str, what: str = "block") -> None:
    """A block is a positive int; int4 packs two codes per byte, so its blocks are even."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{what}={block!r}: give the number of values per scale, an int >= 1 (e.g. 256)")
    if fmt == "int4" and block % 2:
        raise ValueError(f"{what}={block}: int4 packs two values per byte, so its block must be even")


def payload_bytes(n: int, fmt: str, block: int) -> int:
    """Bytes of one row of ``n`` values in ``fmt`` (codes and scales)."""
    f = FORMATS[fmt]
    return n * f.bits // 8 + (n // block * SCALE_BYTES if f.scaled else 0)
