"""Validation mode's op rules (hpf/validate/rules.py and the rule modules it loads): the layout each op gives its output,
and the errors on layouts no op can mean. Expected layouts are written down by hand."""
import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

import hpf
from hpf import all_gather, all_to_all, axis_index, psum
from hpf.comm.collectives import SPMD, spmd
from hpf.validate import (PARTIAL, VARYING, CollectiveError, PartialSumError, ShardedContractionError,
                          ShardingMismatchError, Tracker, make_info)


# ============================================================================ layout rules
AXES = ("tp",)
S0, S1, S2, R = (0, 0), (1, 0), (2, 0), None


@pytest.fixture
def track():
    """Run ops under a tracker on a virtual 2-rank "tp" mesh; ``track.put(t, entry)`` sets a layout."""
    mesh = hpf.Mesh({"tp": 2})
    tracker = Tracker(mesh, ())

    def put(t, entry):
        tracker.set(t, make_info((entry,), ("test",), ("parameter", "x")))
        return t

    tracker.put = put
    tracker.entry = lambda t: tracker.info(t).layout[0]
    with spmd(SPMD(mesh, 0, (), virtual=True)):
        yield tracker


def t(*shape):
    return torch.randn(*shape)


LAYOUT_CASES = {  # name -> (inputs as (shape, entry), fn, expected entry of the output)
    "add broadcasts a size-1 replicated dim": ([((4, 6), S1), ((4, 1), R)], lambda x, y: x + y, S1),
    "matmul keeps a free sharded dim": ([((4, 6), R), ((6, 3), S1)], lambda x, w: x @ w, S1),
    "matmul over a shared sharded dim is partial": ([((4, 6), S1), ((6, 3), S0)], lambda x, w: x @ w, PARTIAL),
    "einsum contraction is partial": ([((2, 4, 6), S2), ((6, 3), S0)], lambda x, w: torch.einsum("bij,jk->bik", x, w),
                                      PARTIAL),
    "linear maps the weight's out dim": ([((4, 6), R), ((3, 6), S0)], lambda x, w: F.linear(x, w), S1),
    "partial times a number stays partial": ([((4, 6), PARTIAL)], lambda x: x * 0.5 - x, PARTIAL),
    "psum completes a partial sum": ([((4, 6), PARTIAL)], lambda x: psum(x, "tp"), R),
    "split heads keeps the shard on heads": ([((2, 3, 8), S2)],
                                             lambda x: rearrange(x, "b t (h e) -> b h t e", e=2), S1),
    "merge heads keeps it on the merged dim": ([((2, 4, 3, 2), S1)],
                                               lambda x: rearrange(x, "b h t e -> b t (h e)"), S2),
    "merging a minor sharded dim is varying": ([((2, 3, 4), S1)], lambda x: x.flatten(0, 1), VARYING),
    "transpose moves the shard": ([((4, 6), S0)], lambda x: x.T, S1),
    "full slice keeps the shard": ([((4, 6), S0)], lambda x: x[:, 1:3, None], S0),
    "partial slice of a sharded dim is varying": ([((4, 6), S0)], lambda x: x[1:3], VARYING),
    "sum over a sharded dim is partial": ([((4, 6), S1)], lambda x: x.sum(-1), PARTIAL),
    "sum over another dim keeps it": ([((4, 6), S1)], lambda x: x.sum(0), S0),
    "cat along another dim keeps it": ([((4, 6), S1), ((2, 6), S1)], lambda x, y: torch.cat([x, y]), S1),
    "cat along the sharded dim is varying": ([((4, 6), S1), ((4, 2), S1)], lambda x, y: torch.cat([x, y], 1), VARYING),
    "split along another dim keeps it": ([((4, 6), S1)], lambda x: x.split(2)[1], S1),
    "embedding of a column-split table": ([((2, 3), R), ((9, 4), S1)],
                                          lambda i, w: F.embedding(i.long().abs() % 9, w), S2),
    "embedding of a row-split table is varying": ([((2, 3), R), ((9, 4), S0)],
                                                  lambda i, w: F.embedding(i.long().abs() % 9, w), VARYING),
    "softmax over another dim keeps it": ([((4, 6), S0)], lambda x: x.softmax(-1), S0),
    "attention keeps sharded heads": ([((2, 4, 3, 2), S1)] * 3, lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                                      S1),
    "a cast keeps it": ([((4, 6), S1)], lambda x: x.to(torch.float64), S1),
    "zeros_like keeps the local shape": ([((4, 6), S1)], lambda x: torch.zeros_like(x), S1),
    "an op without a rule is varying": ([((4, 6), S1)], lambda x: torch.diff(x, dim=0), VARYING),
    "all_gather the sharded dim replicates": ([((4, 6), S1)], lambda x: all_gather(x, "tp", dim=1), R),
    "all_to_all moves the shard": ([((4, 6), S1)], lambda x: all_to_all(x, "tp", 0, 1), S0),
    "axis_index is varying": ([], lambda: axis_index("tp") + 1, VARYING),
}


@pytest.mark.parametrize("name", list(LAYOUT_CASES))
def test_layout_rules(track, name):
    inputs, fn, expected = LAYOUT_CASES[name]
    args = [track.put(t(*shape), entry) for shape, entry in inputs]
    with track:
        out = fn(*args)
    assert track.entry(out) == expected


LAYOUT_ERRORS = {  # name -> (inputs, fn, error type, words the message must hold)
    "nonlinear op on a partial sum": ([((4, 6), PARTIAL)], lambda x: x.exp(), PartialSumError, ["exp", "hpf.psum"]),
    "partial plus complete": ([((4, 6), PARTIAL), ((4, 6), R)], lambda x, y: x + y, PartialSumError, ["add"]),
    "partial plus a number": ([((4, 6), PARTIAL)], lambda x: x + 1.0, PartialSumError, ["the number 1.0"]),
    "product of two partials": ([((4, 6), PARTIAL)] * 2, lambda x, y: x * y, PartialSumError, ["two partial"]),
    "op without a rule on a partial": ([((4, 6), PARTIAL)], lambda x: torch.diff(x), PartialSumError,
                                       ["no layout rule"]),
    "elementwise with a misaligned shard": ([((4, 6), S1), ((4, 6), R)], lambda x, y: x * y, ShardingMismatchError,
                                            ["mul", "replicated"]),
    "contraction with a replicated operand": ([((4, 6), S1), ((6, 3), R)], lambda x, w: x @ w,
                                              ShardedContractionError, ["matmul", "contracts dim 1"]),
    "mean over a sharded dim": ([((4, 6), S1)], lambda x: x.mean(-1), ShardedContractionError, ["mean", ".sum()"]),
    "softmax over a sharded dim": ([((4, 6), S1)], lambda x: x.softmax(-1), ShardedContractionError,
                                   ["softmax", "all_gather"]),
    "cross-entropy over split classes": ([((4, 6), S1)], lambda x: F.cross_entropy(x, torch.zeros(4, dtype=torch.long)),
                                         ShardedContractionError, ["cross_entropy", "dim 1"]),
    "psum of a replicated value": ([((4, 6), R)], lambda x: psum(x, "tp"), CollectiveError, ["psum", "already"]),
}


@pytest.mark.parametrize("name", list(LAYOUT_ERRORS))
def test_layout_errors(track, name):
    inputs, fn, error, words = LAYOUT_ERRORS[name]
    args = [track.put(t(*shape), entry) for shape, entry in inputs]
    with pytest.raises(error) as info, track:
        fn(*args)
    for w in words + ["parameter 'x'", "'tp'"]:
        assert w in str(info.value)
