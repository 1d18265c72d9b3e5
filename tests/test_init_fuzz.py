"""The born-sharded init's differential fuzzer (issue 55): random ``init_fn`` programs over the
ops ``step.init(init_fn, key=)`` accepts, each rank's shards compared bit for bit with the ones
cut from the eager ``init_fn(key)`` (and the ties with eager's), on virtual meshes of 1 to 8 ranks
(two-tier numbering, HSDP, tp and experts over an axis), and on 2 launched ranks.

A program is a list of steps, each a function of the values before it, drawn with their shapes
known (the shapes do not depend on the key): draws and constants of any dtype and odd, empty and
0-d shapes; views and movements (slices with any start, stop and step, select, transpose,
permute, expand, diagonal, unfold, narrow, chunk, unbind, rearrange, flip, roll, repeat, cat,
stack); casts; pointwise ops, transcendental ones included; in-place writes into views; ties
(one value at several paths, its ``.detach()``, a same-shape ``.view()``). The evaluator's node
size bound (``SMALL``) and chunk are drawn small too, so tiny programs take the paths that
evaluate at positions. hypothesis draws each program's seed (derandomized: the same programs in
every run); the program is built from ``random.Random(seed)``, every choice uniform, and its
text is in the failure's message."""
from __future__ import annotations

import math
import random

import einops
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hpf
from hpf import random as R
from hpf import sharded_init
from hpf.errors import SpecError
from hpf.launcher import launch
from hpf.planning import step_plan
from references import born_mismatch

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
DTYPES = FLOATS + (torch.int64, torch.int32, torch.int8, torch.bool, torch.complex64)
MESHES = [({"dp": w}, {}) for w in range(1, 9)] + [
    ({"node": 2, "local": 2}, dict(topology=hpf.Topology())), ({"node": 2, "local": 2}, dict(hsdp=True)),
    ({"node": 2, "local": 3}, dict(topology=hpf.Topology())), ({"node": 4, "local": 2}, dict(hsdp=True)),
    ({"dp": 2, "tp": 2}, dict(fsdp_axes=("dp",), tp="tp")), ({"dp": 2, "ep": 2}, dict(fsdp_axes=("dp", "ep"), ep="ep"))]


def _shape(rng, max_dims=3):
    shape = [rng.choice([0, 1, 1, 2, 3, 4, 5, 7, 9, 16, 33]) for _ in range(rng.choice([0, 1, 1, 2, 2, 2, 3, 3]))]
    while math.prod(shape) > 1 << 12:
        shape.pop()
    return tuple(shape)


def _masked(shape):
    """A boolean mask's pick, of a fixed key: its size (which later steps were drawn for) stays."""
    return R.normal(R.key(0), shape)[R.uniform(R.key(1), shape) > 0.5]


def _source(rng, i):
    """A draw or a constant (or uninitialized memory, or a masked draw: those must be refused):
    (step, label)."""
    shape, kind = _shape(rng), rng.choice(["normal"] * 4 + ["uniform", "tn"] * 2 + [
        "bits", "bern", "randint", "zeros", "full", "bigint", "arange", "empty", "mask"])
    dtype = rng.choice(FLOATS)
    n = math.prod(shape)
    make = {"normal": lambda k: R.normal(k, shape, dtype) * 3, "uniform": lambda k: R.uniform(k, shape, dtype, -2, 5),
            "tn": lambda k: R.truncated_normal(k, -1.5, 2.5, shape, dtype), "bits": lambda k: R.bits(k, shape),
            "bern": lambda k: R.bernoulli(k, 0.3, shape), "randint": lambda k: R.randint(k, shape, -50, 50),
            "zeros": lambda k: torch.zeros(shape, dtype=dtype), "full": lambda k: torch.full(shape, 1.5, dtype=dtype),
            "bigint": lambda k: torch.full(shape, 2**60 + 1, dtype=torch.int64),
            "arange": lambda k: torch.arange(n, dtype=torch.float32).reshape(shape),
            "empty": lambda k: torch.empty(shape, dtype=dtype), "mask": lambda k: _masked(shape)}[kind]
    return (lambda vals, key: make(R.fold_in(key, i))), f"{kind}{shape}"


def _dim(rng, x):
    return rng.randint(-x.dim(), x.dim() - 1)


def _view(rng, x):
    """A view or movement op that applies to ``x``: (fn of x, label)."""
    ops = ["detach", "reshape", "unsqueeze", "flip", "roll", "repeat", "stack", "cat", "expand", "clone_t"]
    if x.dim():
        ops += ["slice", "slice", "slice", "transpose", "permute", "narrow", "chunk", "squeeze", "movedim"]
        ops += ["select", "unbind"] if x.shape[0] else []
    if x.dim() >= 2:
        ops += ["diagonal", "rearrange", "t"]
    if x.dim() and x.shape[-1] >= 2:
        ops += ["unfold"]
    op = rng.choice(ops)
    d = _dim(rng, x) if x.dim() else 0
    n = x.shape[d] if x.dim() else 1
    if op == "slice":
        lo, hi = (rng.choice([None, rng.randint(-2 * n - 2, 2 * n + 2)]) for _ in "ab")
        step = rng.randint(1, 4)
        return (lambda t: t[(slice(None),) * (d % t.dim()) + (slice(lo, hi, step),)]), f"[{d}: {lo}:{hi}:{step}]"
    if op == "select":
        i = rng.randint(-x.shape[0], x.shape[0] - 1)
        return (lambda t: t[i]), f"[{i}]"
    if op == "transpose":
        e = _dim(rng, x)
        return (lambda t: t.transpose(d, e)), f"transpose({d},{e})"
    if op == "permute":
        perm = rng.sample(range(x.dim()), x.dim())
        return (lambda t: t.permute(*perm)), f"permute{tuple(perm)}"
    if op == "narrow":
        start = rng.randint(-n, n) if n else 0
        length = rng.randint(0, n - (start % n if n and start < 0 else start))
        return (lambda t: t.narrow(d, start, length)), f"narrow({d},{start},{length})"
    if op == "chunk":
        k, j = rng.randint(1, 4), rng.randint(0, 3)
        return (lambda t: t.chunk(k, d)[j % len(t.chunk(k, d))] if n else t), f"chunk({k},{d})[{j}]"
    if op == "unbind":
        j = rng.randint(0, x.shape[0] - 1)
        return (lambda t: t.unbind(0)[j]), f"unbind[{j}]"
    if op == "diagonal":
        off, e = rng.randint(-3, 3), _dim(rng, x)
        e = e if e % x.dim() != d % x.dim() else (d + 1) % x.dim()
        return (lambda t: t.diagonal(off, d, e)), f"diagonal({off},{d},{e})"
    if op == "unfold":
        size = rng.randint(1, x.shape[-1])
        step = rng.randint(1, 3)
        return (lambda t: t.unfold(-1, size, step)), f"unfold(-1,{size},{step})"
    if op == "roll":
        s = rng.randint(-10, 10)
        flat = (rng.random() < 0.5) or not x.dim()
        return (lambda t: t.roll(s) if flat else t.roll(s, d)), f"roll({s},{None if flat else d})"
    if op == "repeat":
        reps = [rng.randint(1, 3) for _ in range(rng.randint(max(1, x.dim()), x.dim() + 1))]
        return (lambda t: t.repeat(*reps)), f"repeat{tuple(reps)}"
    if op == "expand":
        return (lambda t: t.unsqueeze(0).expand(2, *t.shape)), "expand(2, ...)"
    if op == "stack":
        return (lambda t: torch.stack([t, t.flip(list(range(t.dim())))], d if t.dim() else 0)), f"stack(.., {d})"
    if op == "cat":
        return (lambda t: torch.cat([t, t.flip(d), t.narrow(d, 0, min(1, t.shape[d]))], d) if t.dim() else
                torch.cat([t.reshape(1), t.reshape(1)])), f"cat(.., {d})"
    if op == "squeeze":
        return (lambda t: t.squeeze(d)), f"squeeze({d})"
    if op == "movedim":
        e = _dim(rng, x)
        return (lambda t: t.movedim(d, e)), f"movedim({d},{e})"
    if op == "rearrange":
        return (lambda t: einops.rearrange(t, "a b ... -> b (a ...)")), "rearrange(a b ... -> b (a ...))"
    simple = {"detach": lambda t: t.detach(), "reshape": lambda t: t.reshape(-1), "unsqueeze": lambda t: t.unsqueeze(d),
              "flip": lambda t: t.flip(d) if t.dim() else t, "t": lambda t: t.t() if t.dim() == 2 else t.mT,
              "clone_t": lambda t: t.mT.contiguous() if t.dim() >= 2 else t.clone()}
    return simple[op], op


def _pointwise(rng, x):
    """A cast or a pointwise op on ``x`` (a float, int, bool or complex tensor): (fn, label)."""
    floating, complex_ = x.dtype.is_floating_point, x.dtype.is_complex
    ops = ["cast", "cast", "mul_c", "add_c", "neg", "eq", "bin", "bin", "inplace_view", "empty_copy"]
    if floating:
        ops += ["div_c", "abs", "sqrt", "clamp", "floor", "round", "sign", "reciprocal", "pow", "sigmoid", "silu",
                "exp", "tanh", "sin", "log", "alpha", "max", "scalar_t", "rsub", "ceil", "trunc", "masked_fill",
                "clamp_max", "clamp_min", "cmp"]
    elif not complex_ and x.dtype != torch.bool:
        ops += ["mod", "floordiv", "bitand", "bigmul", "abs", "clamp", "rsub", "cmp"]
    elif x.dtype == torch.bool:
        ops += ["logical_not", "logical_and", "logical_or", "logical_xor"]
    op = rng.choice(ops)
    if op == "cast":
        to = rng.choice(DTYPES)
        safe = (lambda t: t.clamp(-100, 100)) if floating and not to.is_floating_point and not to.is_complex else (lambda t: t)
        return (lambda t: safe(t).to(to)), f"to({to})"
    if op == "pow":
        p = rng.choice([2, 3, 0.5, -0.5, -1, -2, 1.7, 2.5])
        return (lambda t: t.abs().add(0.5) ** p), f"(|x|+0.5)**{p}"
    if op == "bin":  # with a broadcast partner: x's own slices (a dim of 1, fewer dims) or a 0-d tensor
        kind = rng.choice(["add", "sub", "mul", "div", "maximum", "minimum", "where"])
        part = rng.choice(["row", "tail", "0d"])
        if part == "row":
            other = lambda t: t[..., :1] if t.dim() and t.shape[-1] else t  # noqa: E731
        elif part == "tail":
            other = lambda t: t[0] if t.dim() and t.shape[0] else t  # noqa: E731
        else:
            other = lambda t: t.reshape(-1)[0] if t.numel() else torch.tensor(2)  # noqa: E731
        if kind == "where":
            return (lambda t: torch.where(t.real > 0 if t.is_complex() else t > 0, t, other(t))), f"where(x > 0, x, {part})"
        if kind in ("maximum", "minimum") and complex_:
            kind = "add"
        if kind == "div" and not floating:
            kind = "mul"
        fn = getattr(torch, kind)
        return (lambda t: fn(t, other(t)) if t.dtype != torch.bool or kind in ("mul", "maximum", "minimum")
                else t & other(t)), \
            f"{kind}(x, {part})"
    if op == "inplace_view":  # a write through a view: functionalized into scatters
        def write(t):
            t = t.clone()
            if t.dim() and t.shape[0]:
                t[t.shape[0] // 2:].mul_(2 if t.dtype != torch.bool else True)
            return t
        return write, "x[n//2:] *= 2"
    if op == "empty_copy":
        return (lambda t: torch.empty(t.shape, dtype=t.dtype).copy_(t).t() if t.dim() == 2 else
                torch.empty(t.shape, dtype=t.dtype).copy_(t)), "empty().copy_(x)"
    c = 3 if not floating else 0.37
    fns = {"mul_c": lambda t: t * (c if t.dtype != torch.bool else True), "add_c": lambda t: t + (2**40 + 3 if t.dtype == torch.int64 else 1),
           "neg": lambda t: -t if t.dtype != torch.bool else ~t, "eq": lambda t: t == t.reshape(-1)[:1].reshape(()) if t.numel() else t == 0,
           "div_c": lambda t: t / 3.0, "abs": torch.abs, "sqrt": lambda t: t.abs().sqrt(), "clamp": lambda t: t.clamp(-1, 2),
           "floor": torch.floor, "round": torch.round, "sign": torch.sign, "reciprocal": lambda t: t.reciprocal(),
           "sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu, "exp": lambda t: t.clamp(max=20).exp(),
           "tanh": torch.tanh, "sin": torch.sin, "log": lambda t: t.abs().add(1).log(), "alpha": lambda t: t.add(t, alpha=0.3),
           "max": lambda t: torch.maximum(t, t.flip(-1) if t.dim() else t), "scalar_t": lambda t: t * torch.tensor(1.5, dtype=torch.float64),
           "mod": lambda t: t % 7, "floordiv": lambda t: t // 3, "bitand": lambda t: t & 0x5A,
           "bigmul": lambda t: (t.to(torch.int64) * (2**33 + 1)) % (2**61 - 1), "logical_not": torch.logical_not,
           "logical_and": lambda t: t & t.flip(-1) if t.dim() else t, "rsub": lambda t: 1 - t,
           "ceil": torch.ceil, "trunc": torch.trunc, "masked_fill": lambda t: t.masked_fill(t > 0.5, -0.25),
           "clamp_max": lambda t: t.clamp(max=0.75), "clamp_min": lambda t: t.clamp(min=-0.5),
           "cmp": lambda t: (t < 1) ^ (t >= -1) ^ (t != 0) ^ (t <= 2) ^ (t > t.flip(-1) if t.dim() else t > 0),
           "logical_or": lambda t: torch.logical_or(t, t.flip(-1) if t.dim() else t),
           "logical_xor": lambda t: torch.logical_xor(t, ~t)}
    return fns[op], op


def _program(rng):
    """Steps (fn(vals, key) -> tensor, label) and the outputs (a dict of paths to values)."""
    key, steps, vals, refused = R.key(0), [], [], []  # refused: "uninitialized memory", "data-dependent" or None
    for i in range(rng.randint(2, 8)):
        if not vals or rng.randint(0, 5) == 0:
            step, label = _source(rng, i)
            refused.append({"empty": "uninitialized memory", "mask": "data-dependent"}.get(label.split("(")[0]))
        else:
            src = rng.randint(0, len(vals) - 1)
            fn, label = (_view if (rng.random() < 0.5) else _pointwise)(rng, vals[src])
            step, label = (lambda vs, k, fn=fn, src=src: fn(vs[src])), f"v{src}.{label}"
            refused.append(refused[src])
        vals.append(step(vals, key))
        steps.append((step, label))
    # the last value (the most derived) and others, each once; now and then one of them again (a tie)
    others = rng.sample(range(len(vals) - 1), min(len(vals) - 1, rng.randint(0, 2)))
    outs = [(i, "") for i in [len(vals) - 1] + others]
    if rng.randint(0, 3) == 0:
        outs.append((rng.choice([i for i, _ in outs]), rng.choice(["", ".detach()", ".view"])))
    return steps, outs, refused


def _init_fn(steps, outs):
    def init_fn(key):
        vals = []
        for step, _ in steps:
            vals.append(step(vals, key))
        alias = {"": lambda t: t, ".detach()": lambda t: t.detach(), ".view": lambda t: t.view(t.shape)}
        return {f"p{j}": alias[how](vals[i]) for j, (i, how) in enumerate(outs)}
    return init_fn


def _specs(options, params):
    """tp: P("tp") on the leaves whose first dim it divides; experts: P("ep", fsdp=("dp",)) so."""
    options = dict(options)
    for axis, spec in (("tp", lambda a: hpf.P(a)), ("ep", lambda a: hpf.P(a, fsdp=("dp",)))):
        if axis in options:
            a = options.pop(axis)
            options["param_specs"] = {p: spec(a) if x.dim() and x.shape[0] % 2 == 0 and x.shape[0] else hpf.P()
                                      for p, x in zip(*hpf.tree.flatten(params)[:2])}
    return options


def _check(rng):
    steps, outs, refusals = _program(rng)
    init_fn, refused = _init_fn(steps, outs), next((refusals[i] for i, _ in outs if refusals[i]), None)
    axes, options = rng.choice(MESHES)
    sharded_init.SMALL = rng.choice([0, 3, 1 << 12])
    sharded_init.CHUNK = rng.choice([5, 64, 1 << 18])
    mesh, key = hpf.Mesh(axes), R.key(rng.randint(0, 2**64 - 1))
    described = "; ".join(f"v{i} = {label}" for i, (_, label) in enumerate(steps)) + f" -> {outs} on {axes} {options}"
    untraceable = "data-dependent" in refusals  # a masked step, read or not, may stop the trace
    if refused:  # the init must not be born from what eager leaves to chance
        with pytest.raises((ValueError, RuntimeError), match=refused + ("|could not trace" if untraceable else "")):
            sharded_init.trace_init(init_fn, key)
        return
    try:
        options = _specs(options, init_fn(key))
        step_plan(init_fn(key), mesh, **options)
        eager = None
    except (SpecError, ValueError) as err:  # eager's plan refuses it (overlapping leaves, an uneven tp dim)
        eager = err
    try:
        mismatch = born_mismatch(init_fn, key, mesh, **options)
    except Exception as err:
        if untraceable and isinstance(err, RuntimeError) and "could not trace" in str(err):
            return
        assert eager is not None and isinstance(err, type(eager)), f"{described}: {type(err).__name__}: {err}"
        return
    assert eager is None, f"{described}: eager's plan raised {eager!r}, the born one did not"
    assert mismatch is None, f"{described}: {mismatch}"


@pytest.fixture
def small_nodes():
    """The fuzzer draws SMALL and CHUNK; they are put back after."""
    saved = sharded_init.SMALL, sharded_init.CHUNK
    yield
    sharded_init.SMALL, sharded_init.CHUNK = saved


FUZZ = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@settings(max_examples=30, **FUZZ)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_init_programs_are_born_sharded_as_eager(small_nodes, seed):
    _check(random.Random(seed))


@pytest.mark.slow
@pytest.mark.timeout(1200)
@settings(max_examples=2000, **FUZZ)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_init_programs_are_born_sharded_as_eager_at_a_large_budget(small_nodes, seed):
    _check(random.Random(seed))


def _launched(rank):
    """A fixed program of every kind of step, born sharded on 2 launched ranks and gathered."""
    def init_fn(key):
        x = R.normal(key, (37, 11)) * 3
        y = x.t()[-20::3, 1:].sigmoid()
        z = torch.cat([x[-91:], x.flip(0)]).roll(5, 0)[:, ::2].to(torch.float64)
        w = (torch.full((9, 13), 2**60 + 1) % 7).float() + R.uniform(R.fold_in(key, 1), (9, 13))
        return {"x": x, "x_alias": x.detach(), "y": y.contiguous(), "z": z, "w": w.t()}
    step = hpf.shard_step(lambda p, b: sum(v.float().sum() for v in hpf.tree.flatten(p)[1]) * b.sum(),
                          mesh=hpf.Mesh({"dp": 2}), optimizer=hpf.optim.adamw(lr=1e-3))
    with step:
        full = step.full_params(step.init(init_fn, key=R.key(11)))
        return sharded_init.same_bits(full, init_fn(R.key(11))) and full["x_alias"] is full["x"]


@pytest.mark.slow
def test_a_program_born_sharded_on_two_launched_ranks_gathers_to_eager():
    assert launch(_launched, 2, timeout=120) == [True, True]
