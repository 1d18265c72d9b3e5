"""CPU fast paths for hpf.random's draws, in C: Threefry-2x32-20 over a run of counters, the
inverse normal CDF (PPND7), and the normal draw whole (Threefry, the open unit and PPND7 in one
pass over a block of counters). A fused loop each, instead of one torch op per round (120 ops for
Threefry) over temporaries: 2.1 ns a normal value on one core here, against 10 for the torch
ops around the C Threefry and PPND7 (and 4.1 for torch's own ``normal_``).

The torch code is the spec (hpf_kernels.backends.reference.threefry2x32, hpf.random._ppnd7): the
C does the same IEEE float32 operations in the same order (no fused multiply-add, no fast
math; constants rounded from the same doubles), so its bits are the reference's, which
tests/test_native_draws.py checks over every 24-bit input of the normal. Compiled on first use with
the system's C compiler (``CC``, else cc) into a cache folder (``HPF_CACHE``, else ~/.cache/hpf), keyed by the
source; with no compiler, or on another device, callers get None and use the reference.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["threefry2x32_range", "ppnd7", "normal_range"]

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__x86_64__)  /* each hot loop also built for AVX-512 and AVX2, picked at load time (the same IEEE ops: the same bits) */
#define HOT __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define HOT
#endif

static inline uint32_t rotl(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

/* words[2i], words[2i+1] = Threefry-2x32-20 of the counter (first + i) (high, low words) under (k0, k1) */
static inline void threefry_range(uint32_t k0, uint32_t k1, uint64_t first, int64_t n, uint32_t *words) {
    static const int R[8] = {13, 15, 26, 6, 17, 29, 16, 24};
    const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
    for (int64_t i = 0; i < n; i++) {
        uint64_t c = first + (uint64_t)i;
        uint32_t x0 = (uint32_t)(c >> 32) + ks[0], x1 = (uint32_t)c + ks[1];
        for (int j = 0; j < 5; j++) {
            for (int r = 0; r < 4; r++) {
                x0 += x1;
                x1 = rotl(x1, R[(j % 2) * 4 + r]) ^ x0;
            }
            x0 += ks[(j + 1) % 3];
            x1 += ks[(j + 2) % 3] + (uint32_t)(j + 1);
        }
        words[2 * i] = x0;
        words[2 * i + 1] = x1;
    }
}

HOT
void hpf_threefry_range(uint32_t k0, uint32_t k1, uint64_t first, int64_t n, uint32_t *words) {
    threefry_range(k0, k1, first, n, words);
}

/* c ? a : b on the bits: a select the vectorizer takes (a float ?: is control flow to it under
   -ftrapping-math); each side is computed before, so the bits are a branch's */
static inline float pick(int c, float a, float b) {
    uint32_t ab, bb, mask = -(uint32_t)c, r;
    memcpy(&ab, &a, 4);
    memcpy(&bb, &b, 4);
    r = (ab & mask) | (bb & ~mask);
    float out;
    memcpy(&out, &r, 4);
    return out;
}

/* Horner's rule as hpf.random._poly: highest power first, one rounded multiply and add at a time */
static inline float poly(float x, const float *c, int n) {
    float out = c[0];
    for (int k = 1; k < n; k++) { out = out * x; out = out + c[k]; }
    return out;
}

/* hpf.random._log: frexp, m in [sqrt(1/2), sqrt(2)), 2 atanh(s) by its series. frexp is read off the
   bits (a positive normal x: exponent field e + 126, m the mantissa under exponent -1), as frexpf gives */
static inline float exact_log_of(float m, int e, const float *k) {
    int low = m < k[0];
    m = pick(low, m * 2.0f, m);
    float fe = (float)(e - low);
    float s = (m - 1.0f) / (m + 1.0f);
    float series = poly(s * s, k + 2, 7);
    return (2.0f * s) * series + fe * k[1];
}

static inline float exact_log(float x, const float *k) {
    uint32_t b, mb;
    memcpy(&b, &x, 4);
    mb = (b & 0x807FFFFFu) | 0x3F000000u;
    float m;
    memcpy(&m, &mb, 4);
    return exact_log_of(m, (int)(b >> 23 & 0xFF) - 126, k);
}

/* the same through frexpf, for what the bits do not cover (zero, subnormal, inf, nan: not a normal's input) */
static float exact_log_frexp(float x, const float *k) {
    int e;
    float m = frexpf(x, &e);
    return exact_log_of(m, e, k);
}

/* hpf.random._ppnd7 of p in (0, 1), in two passes around torch.sqrt (the reference's own: on a CPU it is
   not always correctly rounded, so no C sqrt can stand in for it). k: its constants as float32
   (hpf.random._PPND7_CONSTANTS): sqrt(1/2), ln 2, the log series' 7, 0.180625, 0.425, 1.6, then the
   coefficients A, B, C (4 each), D (3), E (4), F (3).
   The first pass: the central formula for every p; for the tail (|p - 1/2| > 0.425) in order, its
   positions (plus base), p, and -log of the nearer tail's p; returns how many. Each loop is a plain
   vector loop: the tail is gathered without branches, then its logs taken together. */
static inline int64_t ppnd7_central(const float *p, int64_t n, const float *k, float *out, int64_t base,
                                    int64_t *tail, float *ptail, float *neglog) {
    const float *A = k + 12, *B = k + 16;
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        float q = p[i] - 0.5f;
        float r = -(q * q) + k[9];
        out[i] = (poly(r, A, 4) * q) / poly(r, B, 4);
    }
    for (int64_t i = 0; i < n; i++) {
        tail[m] = base + i;
        ptail[m] = p[i];
        m += fabsf(p[i] - 0.5f) > k[10];
    }
    for (int64_t j = 0; j < m; j++) {
        float x = pick(ptail[j] - 0.5f < 0, ptail[j], 1.0f - ptail[j]);
        neglog[j] = -exact_log(x, k);
    }
    for (int64_t j = 0; j < m; j++) {
        float x = pick(ptail[j] - 0.5f < 0, ptail[j], 1.0f - ptail[j]);
        uint32_t b;
        memcpy(&b, &x, 4);
        if ((b >> 23 & 0xFF) == 0 || (b >> 23 & 0xFF) == 0xFF)
            neglog[j] = -exact_log_frexp(x, k);
    }
    return m;
}

HOT
int64_t hpf_ppnd7_central(const float *p, int64_t n, const float *k, float *out, int64_t *tail, float *ptail,
                          float *neglog) {
    return ppnd7_central(p, n, k, out, 0, tail, ptail, neglog);
}

/* hpf.random.normal's first pass on the words of a run of counters: the n words from word `skip` of
   counter `first` on (Threefry-2x32-20 under (k0, k1)), each made a uniform on (0, 1) as
   hpf.random._open_unit does (exact), then hpf_ppnd7_central's pass; a block of counters at a time. */
HOT
int64_t hpf_normal_central(uint32_t k0, uint32_t k1, uint64_t first, int64_t skip, int64_t n, const float *k,
                           float *out, int64_t *tail, float *ptail, float *neglog) {
    enum { BLOCK = 1024 };
    uint32_t words[2 * BLOCK];
    float p[2 * BLOCK];
    int64_t m = 0;
    for (int64_t done = 0; done < n;) {
        int64_t word = skip + done, at = word & 1;
        int64_t len = n - done < 2 * BLOCK - at ? n - done : 2 * BLOCK - at;
        threefry_range(k0, k1, first + (uint64_t)(word >> 1), (at + len + 1) >> 1, words);
        for (int64_t i = 0; i < len; i++)
            p[i] = ((float)(words[at + i] >> 8 & 0xFFFFFFu) + 0.5f) * 0x1p-24f;
        m += ppnd7_central(p, len, k, out + done, done, tail + m, ptail + m, neglog + m);
        done += len;
    }
    return m;
}

/* The second pass: the tail's values from r = sqrt(-log) (torch's), into out at their positions
   (both rational forms computed, one picked). */
HOT
void hpf_ppnd7_tail(const float *ptail, const int64_t *tail, float *r, int64_t m, const float *k, float *out) {
    const float *C = k + 20, *D = k + 24, *E = k + 27, *F = k + 31;
    for (int64_t j = 0; j < m; j++) {
        float x = r[j];
        float near = poly(x - k[11], C, 4) / poly(x - k[11], D, 3);
        float far = poly(x - 5.0f, E, 4) / poly(x - 5.0f, F, 3);
        float v = pick(x <= 5.0f, near, far);
        r[j] = pick(ptail[j] - 0.5f < 0, -v, v);
    }
    for (int64_t j = 0; j < m; j++)
        out[tail[j]] = r[j];
}
"""
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]
_lib = None  # the loaded library, False when it cannot be built


def _load():
    global _lib
    if _lib is None:
        try:
            _lib = _build()
        except (OSError, subprocess.SubprocessError):
            _lib = False
    return _lib or None


def _build():
    tag = hashlib.sha256((_SOURCE + " ".join(_FLAGS)).encode()).hexdigest()[:16]
    folder = Path(os.environ.get("HPF_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpf")
    path = folder / f"draws-{tag}.so"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:  # (ranks build at once: each renames its own)
            src, so = Path(tmp) / "draws.c", Path(tmp) / "draws.so"
            src.write_text(_SOURCE)
            subprocess.run([os.environ.get("CC", "cc"), *_FLAGS, str(src), "-o", str(so), "-lm"],
                           check=True, capture_output=True, timeout=120)
            os.replace(so, path)
    lib = ctypes.CDLL(str(path))
    lib.hpf_threefry_range.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p]
    ptr = ctypes.c_void_p
    lib.hpf_ppnd7_central.argtypes = [ptr, ctypes.c_int64, ptr, ptr, ptr, ptr, ptr]
    lib.hpf_ppnd7_central.restype = ctypes.c_int64
    lib.hpf_normal_central.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int64,
                                       ptr, ptr, ptr, ptr, ptr]
    lib.hpf_normal_central.restype = ctypes.c_int64
    lib.hpf_ppnd7_tail.argtypes = [ptr, ptr, ptr, ctypes.c_int64, ptr, ptr]
    return lib


def threefry2x32_range(k0: int, k1: int, first: int, count: int, device: torch.device) -> torch.Tensor | None:
    """The words of counters first .. first + count - 1 under the key (k0, k1) (uint32 ints), as
    int32 [count, 2] (high word's output, low word's), or None where the reference must run."""
    lib = _load() if device.type == "cpu" else None
    if lib is None:
        return None
    out = torch.empty(count, 2, dtype=torch.int32)
    lib.hpf_threefry_range(k0, k1, first, count, out.data_ptr())
    return out


def ppnd7(p: torch.Tensor, constants: torch.Tensor) -> torch.Tensor | None:
    """hpf.random._ppnd7 of float32 ``p`` (CPU), ``constants`` its float32 table; None where the
    reference must run."""
    lib = _load() if p.device.type == "cpu" and p.dtype == torch.float32 else None
    if lib is None:
        return None
    p = p.contiguous()
    out, scratch = torch.empty_like(p), _scratch(p.numel())
    m = lib.hpf_ppnd7_central(p.data_ptr(), p.numel(), constants.data_ptr(), out.data_ptr(), *_pointers(scratch))
    _tail(lib, scratch, m, constants, out)
    return out


def normal_range(k0: int, k1: int, first: int, skip: int, constants: torch.Tensor, out: torch.Tensor) -> bool:
    """hpf.random.normal's values of the words from word ``skip`` of counter ``first`` on, under
    the key (k0, k1) (uint32 ints), into ``out`` (float32, contiguous, CPU): Threefry, the open
    unit and PPND7's first pass in one C loop. False where the reference must run (no compiler)."""
    lib = _load()
    if lib is None:
        return False
    scratch = _scratch(out.numel())
    m = lib.hpf_normal_central(k0, k1, first, skip, out.numel(), constants.data_ptr(), out.data_ptr(), *_pointers(scratch))
    _tail(lib, scratch, m, constants, out)
    return True


def _tail(lib, scratch, m: int, constants: torch.Tensor, out: torch.Tensor) -> None:
    """PPND7's second pass over the ``m`` tail values the first one found, around torch.sqrt."""
    tail, p, neglog = scratch
    r = torch.sqrt(neglog[:m])
    lib.hpf_ppnd7_tail(p.data_ptr(), tail.data_ptr(), r.data_ptr(), m, constants.data_ptr(), out.data_ptr())


#: the PPND7 tail's buffers (positions, p, -log p) for up to this many values are kept, one set a thread
#: (hpf.random's chunk: made afresh, they were 2 MiB of malloc churn per chunk, its pages faulted each time)
SCRATCH_KEPT = 1 << 17
_KEPT = threading.local()


def _scratch(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if n > SCRATCH_KEPT:
        return torch.empty(n, dtype=torch.int64), torch.empty(n), torch.empty(n)
    if getattr(_KEPT, "buffers", None) is None:
        _KEPT.buffers = torch.empty(SCRATCH_KEPT, dtype=torch.int64), torch.empty(SCRATCH_KEPT), torch.empty(SCRATCH_KEPT)
    return _KEPT.buffers


def _pointers(scratch) -> tuple[int, ...]:
    return tuple(x.data_ptr() for x in scratch)
