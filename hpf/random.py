"""JAX-style random numbers on PyTorch: keys, ``split``, ``fold_in``, and draws that are pure
functions of (key, shape, position).

A key is an int64 tensor ``[2]`` holding two uint32 words, as ``jax.random.key_data``. Every
value is computed from its own position by a counter-based generator (Threefry-2x32-20, the
one jax.random uses, in ``hpf_kernels.threefry2x32``): element ``i`` of a draw of shape ``S``
is a function of the key and ``i`` alone, not of what was drawn before it. That is what lets
``step.init(init_fn, key=...)`` draw each rank's shards where they live (any slice can be drawn
alone), and what makes randomness inside a loss replay exactly under recompute.

The bits are the same on every device, thread count and world size: the generator uses integer
ops only, and the distributions are built from ops that IEEE rounds exactly (add, multiply,
divide, sqrt, comparisons; no library ``log``/``erfinv``, whose vector and scalar paths may
differ in the last bit). Floating draws are computed in float32 and cast to ``dtype``.

A batch of keys ``[..., 2]`` draws one independent sample per key: the result has shape
``key.shape[:-1] + shape`` (dropout with one key per example, say).

Each draw is one op, ``torch.ops.hpf.draw``, and each key derivation one ``torch.ops.hpf.fold_in``,
so tracing (``step.init``, ``torch.compile``, ``make_fx``) sees them and not their arithmetic.
"""
from __future__ import annotations

import itertools
import math
from typing import Sequence

import torch

import hpf_kernels
from hpf_kernels.backends import native

__all__ = ["key", "split", "fold_in", "example_keys", "check_key", "bits", "uniform", "normal", "truncated_normal", "bernoulli", "randint",
           "values_at"]

_WORD = 0xFFFFFFFF
_CHUNK = 1 << 16  # counters per Threefry call: its 5 int32 temporaries stay in cache (24 ns/value here, vs 36 at 2^20)
DISTRIBUTIONS = ("bits", "uniform", "normal", "truncated_normal", "bernoulli", "randint")


# -- keys -----------------------------------------------------------------------------------------------
def key(seed: int) -> torch.Tensor:
    """A key from an int seed (up to 64 bits): ``[seed >> 32, seed & 0xFFFFFFFF]``."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < 1 << 64:
        raise ValueError(f"hpf.random.key takes an int seed of at most 64 bits, got {seed!r}")
    seed &= (1 << 64) - 1
    return torch.tensor([seed >> 32, seed & _WORD], dtype=torch.int64)


def split(key: torch.Tensor, num: int = 2) -> torch.Tensor:
    """``num`` new keys ``[..., num, 2]``; ``split(k, n)[i]`` equals ``fold_in(k, i)``."""
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise ValueError(f"hpf.random.split: num must be a positive int, got {num!r}")
    return fold_in(key.unsqueeze(-2), torch.arange(num))


def fold_in(key: torch.Tensor, data) -> torch.Tensor:
    """A new key from ``key`` and an int (or an int tensor, one key each, broadcast against the
    key's batch dims): the Threefry of the counter ``data`` under ``key``."""
    k = check_key(key, "fold_in")
    data = torch.as_tensor(data)
    if data.is_floating_point() or data.is_complex() or data.dtype == torch.bool:
        raise TypeError(f"hpf.random.fold_in: data must be an int or an int tensor, got {data.dtype}")
    return torch.ops.hpf.fold_in(k, data.to(device=k.device, dtype=torch.int64))


def _fold_in(key: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    x0, x1 = hpf_kernels.threefry2x32(_words(key[..., 0]), _words(key[..., 1]), _words(data >> 32), _words(data))
    return _key_of(x0, x1)


_fold_in_op = torch.library.custom_op("hpf::fold_in", _fold_in, mutates_args=())


@_fold_in_op.register_fake
def _(key, data):
    return key.new_empty((*broadcast_shape(key.shape[:-1], data.shape), 2))


def broadcast_shape(*shapes: Sequence[int]) -> tuple[int, ...]:
    """The shapes broadcast together, as torch.broadcast_shapes (which imports sympy on its first
    call, 0.4 s: this runs in ``step.init``'s trace)."""
    out = []
    for sizes in itertools.zip_longest(*(reversed(tuple(s)) for s in shapes), fillvalue=1):
        sizes = {int(n) for n in sizes} - {1}
        if len(sizes) > 1:
            raise RuntimeError(f"shapes {[tuple(s) for s in shapes]} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(reversed(out))


def example_keys(key: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """One key per example, ``[count, 2]``: ``fold_in(key, first + i)`` for the examples
    ``first .. first + count - 1`` of the global batch. Randomness drawn from these (dropout) does
    not depend on how the examples are split over ranks or micro-batches: rank r of W holding
    rows [r * B / W, (r + 1) * B / W) passes ``first = r * B / W``. Fold the step in first
    (``fold_in(key, step)``) for new masks each step."""
    if not (isinstance(first, int) and isinstance(count, int) and first >= 0 and count >= 0):
        raise ValueError(f"hpf.random.example_keys needs ints first >= 0 and count >= 0, got {first!r}, {count!r}")
    return fold_in(key, torch.arange(first, first + count, device=key.device))


def check_key(key, what: str) -> torch.Tensor:
    if not isinstance(key, torch.Tensor) or key.dtype != torch.int64 or key.dim() == 0 or key.shape[-1] != 2:
        got = f"{key.dtype} {tuple(key.shape)}" if isinstance(key, torch.Tensor) else type(key).__name__
        raise TypeError(f"hpf.random.{what} takes a key (an int64 tensor [..., 2] from hpf.random.key), got {got}")
    return key


def _words(x: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of int64 values as int32 words (the same bits)."""
    return (x & _WORD).to(torch.int32) if x.dtype != torch.int32 else x


def _key_of(x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
    return torch.stack([x0.to(torch.int64) & _WORD, x1.to(torch.int64) & _WORD], dim=-1)


# -- draws ----------------------------------------------------------------------------------------------
def bits(key: torch.Tensor, shape: Sequence[int] = ()) -> torch.Tensor:
    """Uniform uint32 values (as int64)."""
    return _draw(key, shape, "bits", 0.0, 0.0, torch.int64)


def uniform(key: torch.Tensor, shape: Sequence[int] = (), dtype: torch.dtype = torch.float32,
            minval: float = 0.0, maxval: float = 1.0) -> torch.Tensor:
    """Uniform in [minval, maxval), at float32's resolution (23 bits)."""
    return _draw(key, shape, "uniform", float(minval), float(maxval), _float(dtype, "uniform"))


def normal(key: torch.Tensor, shape: Sequence[int] = (), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal: the inverse normal CDF (Wichura's AS 241, PPND7, float32-accurate) of a
    24-bit uniform in (0, 1), so every value lies within about 5.3 standard deviations."""
    return _draw(key, shape, "normal", 0.0, 0.0, _float(dtype, "normal"))


def truncated_normal(key: torch.Tensor, lower: float, upper: float, shape: Sequence[int] = (),
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal conditioned on [lower, upper], by the inverse CDF (as jax.random), of
    the tail nearer zero's mirror: an interval above zero is drawn as the negation of its mirror
    below, where the CDF's small values keep float32's relative precision (near 1 they had none)."""
    if not float(lower) < float(upper):
        raise ValueError(f"hpf.random.truncated_normal needs lower < upper, got {lower} and {upper}")
    lo, hi = _tail_cdfs(float(lower), float(upper))
    if not torch.tensor(lo, dtype=torch.float32) < torch.tensor(hi, dtype=torch.float32):
        raise ValueError(f"hpf.random.truncated_normal: [{lower}, {upper}] lies too far in the tail for float32 "
                         f"draws (its CDF values {lo:.3g} and {hi:.3g} are one float32); shift a narrower interval "
                         "nearer zero, or draw it another way")
    return _draw(key, shape, "truncated_normal", float(lower), float(upper), _float(dtype, "truncated_normal"))


def bernoulli(key: torch.Tensor, p: float = 0.5, shape: Sequence[int] | None = None) -> torch.Tensor:
    """True with probability ``p`` (a float), as a bool tensor."""
    if not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"hpf.random.bernoulli: p must lie in [0, 1], got {p}")
    return _draw(key, () if shape is None else shape, "bernoulli", float(p), 0.0, torch.bool)


def randint(key: torch.Tensor, shape: Sequence[int], minval: int, maxval: int,
            dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Ints in [minval, maxval), by multiply-shift of 32 random bits (bias below span / 2^32):
    the offset in [0, span) is drawn, and ``minval`` added in int64, exact at any magnitude."""
    if not (isinstance(minval, int) and isinstance(maxval, int) and 0 < maxval - minval <= 1 << 31):
        raise ValueError(f"hpf.random.randint needs int bounds with 0 < maxval - minval <= 2^31, got "
                         f"[{minval}, {maxval})")
    if not isinstance(dtype, torch.dtype) or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"hpf.random.randint: dtype must be an integer dtype, got {dtype}")
    if not torch.iinfo(dtype).min <= minval <= maxval - 1 <= torch.iinfo(dtype).max:
        raise ValueError(f"hpf.random.randint: [{minval}, {maxval}) does not fit {dtype} "
                         f"([{torch.iinfo(dtype).min}, {torch.iinfo(dtype).max}])")
    offset = _draw(key, shape, "randint", 0.0, float(maxval - minval), torch.int64)
    return (offset + minval if minval else offset).to(dtype)


def _float(dtype, what: str) -> torch.dtype:
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"hpf.random.{what}: dtype must be a floating dtype, got {dtype!r}")
    return dtype


def _draw(key, shape, dist: str, a: float, b: float, dtype: torch.dtype) -> torch.Tensor:
    check_key(key, dist)
    if isinstance(shape, int):
        shape = (shape,)
    shape = [int(n) for n in shape]
    if any(n < 0 for n in shape):
        raise ValueError(f"hpf.random.{dist}: a shape has no negative sizes, got {tuple(shape)}")
    return torch.ops.hpf.draw(key, shape, dist, a, b, dtype)


def _draw_whole(key: torch.Tensor, shape: Sequence[int], dist: str, a: float, b: float,
                dtype: torch.dtype) -> torch.Tensor:
    n = math.prod(key.shape[:-1]) * math.prod(shape)
    return values_at(key, shape, dist, a, b, dtype, 0, n).reshape((*key.shape[:-1], *shape))


_draw_op = torch.library.custom_op("hpf::draw", _draw_whole, mutates_args=())


@_draw_op.register_fake
def _(key, shape, dist, a, b, dtype):
    return key.new_empty((*key.shape[:-1], *shape), dtype=dtype)


#: each op's own function, for a caller that computes its values without the dispatcher (a custom
#: op's first call through it imports dynamo, about 1 s; ``step.init``'s evaluator needs none of it)
EAGER = {torch.ops.hpf.fold_in.default: _fold_in, torch.ops.hpf.draw.default: _draw_whole}


def values_at(key: torch.Tensor, shape: Sequence[int], dist: str, a: float, b: float, dtype: torch.dtype,
              start: int | torch.Tensor, stop: int | None = None) -> torch.Tensor:
    """Elements of the draw ``torch.ops.hpf.draw(key, shape, dist, a, b, dtype)`` at flat
    positions [start, stop), or at the int64 positions ``start`` (a tensor), as a 1-D tensor:
    the same bits as the whole draw's, at a cost proportional to the positions asked for."""
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {dist!r}; one of {DISTRIBUTIONS}")
    keys = key.reshape(-1, 2)
    n = math.prod(shape)
    out = torch.empty(stop - start if stop is not None else start.numel(), dtype=dtype, device=key.device)
    for lo in range(0, out.numel(), 2 * _CHUNK):
        hi = min(lo + 2 * _CHUNK, out.numel())
        if dist == "normal" and stop is not None and _normal_in(keys, n, start + lo, start + hi, out[lo:hi]):
            continue
        words = (_words_in(keys, n, start + lo, start + hi) if stop is not None
                 else _words_at(keys, n, start[lo:hi].to(key.device)))
        out[lo:hi] = _transform(words, dist, a, b).to(dtype)
    return out


def _normal_in(keys: torch.Tensor, n: int, start: int, stop: int, out: torch.Tensor) -> bool:
    """The normal's values at flat positions [start, stop) into ``out`` in one C pass (Threefry, the
    open unit, PPND7: hpf_kernels.backends.native.normal_range), where one key covers them on a
    CPU: the bits of ``_transform(_words_in(...), "normal")`` (tests/test_native_draws.py). False: not done."""
    k = _key_over(keys, n, start, stop)
    if k is None or k.device.type != "cpu":
        return False
    values = out if out.dtype == torch.float32 else torch.empty(stop - start)
    if not native.normal_range(int(k[0]), int(k[1]), (start % n) >> 1, start % n & 1, _PPND7_CONSTANTS, values):
        return False
    if values is not out:
        out.copy_(values)  # (float32's bits, cast as .to(dtype) casts them)
    return True


def _words_in(keys: torch.Tensor, n: int, start: int, stop: int) -> torch.Tensor:
    """The 32-bit words of flat positions [start, stop): two per counter when one key covers them."""
    k = _key_over(keys, n, start, stop)
    if k is None:
        return _words_at(keys, n, torch.arange(start, stop, device=keys.device))
    first = (start % n) >> 1
    count = ((stop - 1 - start + start % n) >> 1) + 1 - first
    both = hpf_kernels.threefry2x32_range(int(k[0]), int(k[1]), first, count, keys.device).reshape(-1)
    skip = start % n & 1
    return both[skip:skip + stop - start]


def _key_over(keys: torch.Tensor, n: int, start: int, stop: int) -> torch.Tensor | None:
    """The one key of ``keys`` (each drawing ``n`` values) whose draw holds the flat positions
    [start, stop), or None where they span several."""
    if keys.shape[0] != 1 and start // n != (stop - 1) // n:
        return None
    return keys[min(start // n, keys.shape[0] - 1)]


def _words_at(keys: torch.Tensor, n: int, index: torch.Tensor) -> torch.Tensor:
    """The 32-bit words of the flat positions ``index`` (int64): position p of key p // n is word
    p % 2 of the counter (p % n) // 2."""
    row, pos = index // n, index % n
    counters = pos >> 1
    k = keys[row]
    x0, x1 = hpf_kernels.threefry2x32(_words(k[:, 0]), _words(k[:, 1]), _words(counters >> 32), _words(counters))
    return torch.where((pos & 1).bool(), x1, x0)


# -- from 32 random bits to a distribution, with exactly rounded ops only --------------------------------
def _transform(w: torch.Tensor, dist: str, a: float, b: float) -> torch.Tensor:
    if dist == "bits":
        return w.to(torch.int64) & _WORD
    if dist == "randint":
        return ((w.to(torch.int64) & _WORD) * int(b - a) >> 32) + int(a)
    if dist == "uniform":
        u = _unit(w)
        return torch.maximum(u * (b - a) + a, torch.tensor(a, dtype=torch.float32, device=u.device))
    if dist == "bernoulli":
        return _unit(w) < a
    u = _open_unit(w)
    if dist == "truncated_normal":
        lo, hi = _tail_cdfs(a, b)
        x = _ppnd7(u * (hi - lo) + lo)
        return x.clamp(-b, -a).neg_() if a + b > 0 else x.clamp(a, b)  # (above zero: the mirror, negated)
    return _ppnd7(u)


def _unit(w: torch.Tensor) -> torch.Tensor:
    """[0, 1) from the top 23 bits: 1.m as a float's bits, minus 1 (exact)."""
    return (((w >> 9) & 0x7FFFFF) | 0x3F800000).view(torch.float32) - 1.0


def _open_unit(w: torch.Tensor) -> torch.Tensor:
    """(0, 1) from the top 24 bits, on the grid (k + 1/2) / 2^24 (exact)."""
    return (((w >> 8) & 0xFFFFFF).to(torch.float32) + 0.5) * 2.0 ** -24


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))  # (erfc: the lower tail keeps its relative precision)


def _tail_cdfs(a: float, b: float) -> tuple[float, float]:
    """The CDF values the draw of a normal on [a, b] lies between (of its mirror, above zero)."""
    return (_normal_cdf(-b), _normal_cdf(-a)) if a + b > 0 else (_normal_cdf(a), _normal_cdf(b))


def _poly(x: torch.Tensor, coefficients: Sequence[float]) -> torch.Tensor:
    """Horner's rule, highest power first, one rounded multiply and add at a time (no fused ops)."""
    out = torch.full_like(x, coefficients[0])
    for c in coefficients[1:]:
        out.mul_(x).add_(c)
    return out


_A = (59.10937472, 159.29113202, 50.434271938, 3.3871327179)
_B = (67.1875636, 78.757757664, 17.895169469, 1.0)
_C = (0.17023821103, 1.3067284816, 2.75681539, 1.4234372777)
_D = (0.12021132975, 0.7370016425, 1.0)
_E = (0.017337203997, 0.42868294337, 3.0812263860, 6.657905115)
_F = (0.012258202635, 0.24197894225, 1.0)


def _ppnd7(p: torch.Tensor) -> torch.Tensor:
    """The inverse standard normal CDF of p in (0, 1): on a CPU the C loop
    (hpf_kernels.backends.native), elsewhere the torch code that is its spec (the same bits)."""
    fast = native.ppnd7(p, _PPND7_CONSTANTS)
    return fast if fast is not None else _ppnd7_reference(p)


def _ppnd7_reference(p: torch.Tensor) -> torch.Tensor:
    """The inverse standard normal CDF of p in (0, 1) (Wichura 1988, AS 241 PPND7), in torch ops."""
    q = p - 0.5
    r = torch.mul(q, q).neg_().add_(0.180625)
    out = _poly(r, _A).mul_(q).div_(_poly(r, _B))
    tail = torch.nonzero(q.abs() > 0.425).squeeze(1)  # about 15% of draws: log and sqrt for those alone
    if tail.numel():
        qt, pt = q[tail], p[tail]
        r = torch.sqrt(-_log(torch.where(qt < 0, pt, 1.0 - pt)))
        near = r <= 5.0
        value = torch.where(near, _poly(r - 1.6, _C) / _poly(r - 1.6, _D), _poly(r - 5.0, _E) / _poly(r - 5.0, _F))
        out[tail] = torch.where(qt < 0, -value, value)
    return out


_LN2 = math.log(2.0)
_LOG_SERIES = [1.0 / k for k in (13, 11, 9, 7, 5, 3, 1)]
# every constant of _ppnd7 and _log as the float32 their torch ops round it to (native.ppnd7's table)
_PPND7_CONSTANTS = torch.tensor([math.sqrt(0.5), _LN2, *_LOG_SERIES, 0.180625, 0.425, 1.6, *_A, *_B, *_C, *_D, *_E, *_F],
                                dtype=torch.float32)


def _log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive x with exact ops: x = m 2^e (frexp), m in [sqrt(1/2), sqrt(2)),
    log m = 2 atanh(s), s = (m-1)/(m+1), by its series (|s| < 0.172: 7 terms reach float32)."""
    m, e = torch.frexp(x)
    low = m < math.sqrt(0.5)
    m = torch.where(low, m * 2.0, m)
    e = (e - low.to(e.dtype)).to(x.dtype)
    s = (m - 1.0) / (m + 1.0)
    series = _poly(s * s, _LOG_SERIES)
    return 2.0 * s * series + e * _LN2
