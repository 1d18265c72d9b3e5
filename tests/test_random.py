"""hpf.random: Threefry against its published answers, the distributions against their laws, and
the promise the sharded init rests on: any slice of a draw, drawn alone, has the whole draw's bits."""
import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hpf_kernels
from hpf import random as R

N = 1 << 20


def _u32(x: torch.Tensor) -> int:
    return int(x) & 0xFFFFFFFF


@pytest.mark.parametrize("key, counter, want", [
    # Random123's known-answer tests for threefry2x32_20 (kat_vectors), as jax.random checks them
    ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
])
def test_threefry_gives_random123s_known_answers(key, counter, want):
    as_i32 = [torch.tensor([c - (1 << 32) if c >= 1 << 31 else c], dtype=torch.int32) for c in counter]
    x0, x1 = hpf_kernels.threefry2x32(*key, *as_i32)
    assert (_u32(x0), _u32(x1)) == want


def _normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(x.double() / math.sqrt(2)))


def _ks(sample: torch.Tensor, cdf) -> float:
    """The Kolmogorov-Smirnov statistic of a sample against a CDF."""
    x, _ = sample.double().sort()
    f = cdf(x)
    n = x.numel()
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(i / n - f, f - (i - 1) / n).max())


KS_1PCT = 1.63 / math.sqrt(N)  # the KS critical value at the 1% level


def test_normal_has_the_moments_and_the_distribution_of_a_standard_normal():
    x = R.normal(R.key(11), (N,)).double()
    assert abs(float(x.mean())) < 5 / math.sqrt(N)
    assert abs(float(x.var()) - 1) < 5 * math.sqrt(2 / N)
    assert abs(float((x ** 3).mean())) < 5 * math.sqrt(15 / N)  # skewness 0
    assert abs(float((x ** 4).mean()) - 3) < 5 * math.sqrt(96 / N)  # kurtosis 3
    assert _ks(x, _normal_cdf) < KS_1PCT


def test_uniform_truncated_normal_bernoulli_and_randint_follow_their_laws():
    k = R.split(R.key(5), 4)
    u = R.uniform(k[0], (N,), minval=-2.0, maxval=3.0)
    assert float(u.min()) >= -2.0 and float(u.max()) < 3.0
    assert _ks(u, lambda x: (x + 2) / 5) < KS_1PCT
    t = R.truncated_normal(k[1], -1.0, 2.0, (N,))
    assert float(t.min()) >= -1.0 and float(t.max()) <= 2.0
    lo, hi = _normal_cdf(torch.tensor(-1.0)), _normal_cdf(torch.tensor(2.0))
    assert _ks(t, lambda x: (_normal_cdf(x) - lo) / (hi - lo)) < KS_1PCT
    b = R.bernoulli(k[2], 0.3, (N,))
    assert b.dtype == torch.bool and abs(float(b.double().mean()) - 0.3) < 5 * math.sqrt(0.21 / N)
    r = R.randint(k[3], (N,), -3, 4)
    counts = torch.bincount(r + 3, minlength=7).double()
    assert int(r.min()) == -3 and int(r.max()) == 3
    chi2 = float(((counts - N / 7) ** 2 / (N / 7)).sum())
    assert chi2 < 16.8  # chi-square, 6 degrees of freedom, 1% level


def test_split_keys_draw_independent_streams():
    keys = R.split(R.key(0), 3)
    assert len({tuple(k.tolist()) for k in keys}) == 3
    a, b, c = (R.normal(k, (N,)).double() for k in keys)
    for x, y in ((a, b), (a, c), (b, c)):
        assert abs(float((x * y).mean())) < 5 / math.sqrt(N)  # uncorrelated
    # ... and a key's stream is not its neighbour's shifted by one
    assert abs(float((a[1:] * a[:-1]).mean())) < 5 / math.sqrt(N)


def test_split_is_fold_in_and_keys_are_checked():
    k = R.key(3)
    assert torch.equal(R.split(k, 5)[3], R.fold_in(k, 3))
    assert torch.equal(R.fold_in(k, torch.tensor([1, 2])), torch.stack([R.fold_in(k, 1), R.fold_in(k, 2)]))
    assert torch.equal(R.key(2**40 + 7), torch.tensor([256, 7]))
    with pytest.raises(TypeError, match="takes a key"):
        R.normal(torch.tensor([1.0, 2.0]), (3,))
    with pytest.raises(ValueError, match="int seed"):
        R.key(1.5)
    with pytest.raises(TypeError, match="floating dtype"):
        R.normal(k, (2,), dtype=torch.int32)
    with pytest.raises(ValueError, match="lower < upper"):
        R.truncated_normal(k, 1.0, 1.0, (2,))


@pytest.mark.parametrize("dist, a, b, dtype", [
    ("normal", 0.0, 0.0, torch.float32), ("uniform", -1.0, 2.0, torch.bfloat16), ("bits", 0.0, 0.0, torch.int64),
    ("truncated_normal", -2.0, 2.0, torch.float16), ("bernoulli", 0.4, 0.0, torch.bool),
    ("randint", 0.0, 9.0, torch.int64)])
def test_any_slice_drawn_alone_has_the_whole_draws_bits(dist, a, b, dtype):
    k, shape = R.key(9), (7, 31, 1001)  # odd sizes: slices start and end at odd positions
    whole = torch.ops.hpf.draw(k, list(shape), dist, a, b, dtype).reshape(-1)
    n = whole.numel()
    for lo, hi in ((0, n), (1, 2), (3, 70_001), (n - 5, n), (12_345, 12_346), (2 * 65_536 - 1, 2 * 65_536 + 3)):
        assert torch.equal(R.values_at(k, shape, dist, a, b, dtype, lo, hi), whole[lo:hi]), (lo, hi)
    index = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:5000]
    assert torch.equal(R.values_at(k, shape, dist, a, b, dtype, index), whole[index])


def test_a_batch_of_keys_draws_each_keys_own_sample():
    keys = R.example_keys(R.key(4), 10, 6)
    batched = R.normal(keys, (3, 5))
    assert batched.shape == (6, 3, 5)
    for i in range(6):
        assert torch.equal(batched[i], R.normal(R.fold_in(R.key(4), 10 + i), (3, 5)))


def test_the_bits_do_not_depend_on_the_thread_count():
    k, shape = R.key(1), (N // 2 + 17,)  # chunks past torch's grain size: the ops split across threads
    before = torch.get_num_threads()
    try:
        one = R.normal(k, shape)
        torch.set_num_threads(2)
        two = R.normal(k, shape)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one.view(torch.int32), two.view(torch.int32))


def test_a_draw_and_a_fold_in_are_one_op_each_when_traced():
    def f(key):
        return R.normal(R.fold_in(key, 3), (4, 4)) * 2
    graph = make_fx(f, tracing_mode="fake")(R.key(0))
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.hpf.draw.default) == 1 and targets.count(torch.ops.hpf.fold_in.default) == 1
    assert torch.equal(graph(R.key(0)), f(R.key(0)))


def test_broadcast_shape_is_torchs():
    """(hpf.random.broadcast_shape stands in for torch.broadcast_shapes in step.init's trace.)"""
    import random

    rng = random.Random(0)
    for _ in range(500):
        shapes = [tuple(rng.choice([0, 1, 1, 2, 3]) for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(1, 3))]
        try:
            want = tuple(torch.broadcast_shapes(*shapes))
        except RuntimeError:
            with pytest.raises(RuntimeError, match="do not broadcast"):
                R.broadcast_shape(*shapes)
            continue
        assert R.broadcast_shape(*shapes) == want, shapes


# -- issue 55 ---------------------------------------------------------------------------------------------
def test_randint_is_exact_beyond_2_to_the_53():
    """(Item 7: the bounds went through a float; [2^60 + 100, 2^60 + 110) gave one value below it.)"""
    r = R.randint(R.key(0), (1000,), 2**60 + 100, 2**60 + 110)
    assert (r - 2**60).unique().tolist() == list(range(100, 110))
    assert torch.equal(R.randint(R.key(0), (1000,), 100, 110), r - 2**60)  # the same offsets as small bounds
    assert torch.equal(R.randint(R.key(0), (9,), -3, -2, torch.int8), torch.full((9,), -3, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"does not fit torch.int32"):
        R.randint(R.key(0), (3,), 2**40, 2**40 + 5, torch.int32)


@pytest.mark.parametrize("lower, upper", [(5.5, 6.0), (6.0, 7.0), (4.0, 5.0), (-1.0, 6.0), (-6.0, -5.5)])
def test_truncated_normal_keeps_its_precision_in_either_tail(lower, upper):
    """(Item 8: on (5.5, 6) it was the constant 5.5, and [4, 5] had 528 distinct values in 1e5.)"""
    n = 100_000
    t = R.truncated_normal(R.key(1), lower, upper, (n,)).double()
    assert float(t.min()) >= lower and float(t.max()) <= upper
    assert t.unique().numel() > 0.8 * n
    cdf = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    mass = cdf(upper) - cdf(lower)
    mean = (pdf(lower) - pdf(upper)) / mass
    var = 1 + (lower * pdf(lower) - upper * pdf(upper)) / mass - mean ** 2
    assert abs(float(t.mean()) - mean) < 5 * math.sqrt(var / n)
    assert _ks(t, lambda x: (torch.special.ndtr(x) - cdf(lower)) / mass) < 1.63 / math.sqrt(n)
    mirror = R.truncated_normal(R.key(1), -upper, -lower, (n,))
    assert torch.equal(mirror, -t.float()) or lower + upper <= 0


def test_a_truncated_normal_float32_cannot_resolve_is_refused():
    with pytest.raises(ValueError, match=r"\[30, 31\] lies too far in the tail"):
        R.truncated_normal(R.key(0), 30, 31)


@pytest.mark.parametrize("draw", ["bits", "uniform", "normal", "truncated_normal", "bernoulli"])
def test_a_draw_without_a_shape_is_a_scalar(draw):
    """(Item 17: the default shape () raised TypeError in reshape; jax.random's default is a scalar.)"""
    args = (-1.0, 1.0) if draw == "truncated_normal" else ()
    x = getattr(R, draw)(R.key(3), *args)
    assert x.shape == () and torch.equal(x.reshape(1), getattr(R, draw)(R.key(3), *args, shape=(1,)))
    assert getattr(R, draw)(R.split(R.key(3), 4), *args).shape == (4,)
