"""hpf's explicit collectives: values and exact adjoints against single-process math, and the
grads of a tensor-parallel step against plain autograd on the unsharded model.

The two-rank checks run in one launched job per module fixture; the tests compare numbers.
"""
import functools
import time

import numpy as np
import optree
import pytest
import torch

import hpf
from hpf.comm.collectives import SPMD, all_gather, all_to_all, axis_index, psum, spmd
from hpf.launcher import launch
from hpf.mesh import MeshError
from references import autograd_grads
from toy_models import TP_MLP_SPECS, psum_with_identity_backward, tp_mlp_batch, tp_mlp_loss, tp_mlp_params

TP = hpf.Mesh({"tp": 2})
SHAPE = (4, 6)  # every collective below splits or gathers dims of this shape over 2 ranks
OPS = {  # name -> (hpf call, what rank r receives, from the list of every rank's input)
    "psum": (lambda x: psum(x, "tp"), lambda xs, r: xs[0] + xs[1]),
    "all_gather_dim1": (lambda x: all_gather(x, "tp", dim=1), lambda xs, r: torch.cat(xs, 1)),
    "all_to_all": (lambda x: all_to_all(x, "tp", 0, 1),
                   lambda xs, r: torch.cat([x.chunk(2, 0)[r] for x in xs], 1)),
}


def _input(rank):
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(10 + rank))


def _weights(rank, shape):  # a different cotangent on each rank: catches a backward that ignores peers
    return torch.randn(shape, generator=torch.Generator().manual_seed(20 + rank))


def _collectives_run(rank):
    with spmd(SPMD(TP, rank, ())):
        out = {"axis_index": int(axis_index("tp"))}
        for name, (op, _) in OPS.items():
            x = _input(rank).requires_grad_()
            y = op(x)
            (y * _weights(rank, y.shape)).sum().backward()
            out[name] = (y.detach().numpy(), x.grad.numpy())
        out["refused"] = {}
        for name, (op, _) in OPS.items():  # a rank-dependent shape, then dtype (gloo aborted the process)
            for x in (torch.zeros(4, 6 + 2 * rank), torch.zeros(SHAPE, dtype=(torch.float32, torch.float64)[rank])):
                t = time.monotonic()
                with pytest.raises(ValueError, match="the ranks pass different tensors") as e:
                    op(x)
                out["refused"].setdefault(name, []).append((str(e.value), time.monotonic() - t))
        out["after"] = psum(torch.ones(2), "tp").tolist()  # (the ranks are still in step)
    return out


@pytest.fixture(scope="module")
def collectives_run():
    return launch(_collectives_run, 2, timeout=120)


@pytest.mark.slow
def test_axis_index_is_the_rank_position(collectives_run):
    assert [r["axis_index"] for r in collectives_run] == [0, 1]


@pytest.mark.slow
def test_ranks_that_pass_different_shapes_or_dtypes_get_one_named_error_and_stay_in_step(collectives_run):
    for rank, run in enumerate(collectives_run):
        assert set(run["refused"]) == set(OPS) and run["after"] == [2.0, 2.0]
        for name, ((shapes, shapes_s), (dtypes, dtypes_s)) in run["refused"].items():
            assert "rank 0: [4, 6] torch.float32, rank 1: [4, 8] torch.float32" in shapes, shapes
            assert "rank 0: [4, 6] torch.float32, rank 1: [4, 6] torch.float64" in dtypes, dtypes
            assert shapes_s < 5 and dtypes_s < 5


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPS))
def test_values_and_grads_are_the_exact_adjoint(collectives_run, name):
    """Rank r's output is the function ``receives(xs, r)`` of all inputs; the backward of
    sum_r <w_r, y_r> must give every rank the grad of that global function w.r.t. its input."""
    _, receives = OPS[name]
    xs = [_input(r).requires_grad_() for r in range(2)]
    ys = [receives(xs, r) for r in range(2)]
    sum((y * _weights(r, y.shape)).sum() for r, y in enumerate(ys)).backward()
    for r in range(2):
        y, grad = collectives_run[r][name]
        # Only sums of 2 terms are reordered: float32 ulp level.
        np.testing.assert_allclose(y, ys[r].detach().numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(grad, xs[r].grad.numpy(), rtol=1e-6, atol=1e-6)


def test_outside_a_step_they_act_as_one_rank():
    x = torch.randn(SHAPE)
    for op in (lambda t: psum(t, "tp"), lambda t: all_gather(t, "tp", dim=1), lambda t: all_to_all(t, "tp", 0, 1)):
        y = op(x)
        assert y is not x and torch.equal(y, x)
    assert int(axis_index("tp")) == 0


def test_virtual_mesh_gives_shapes_and_coordinates():
    mesh = hpf.Mesh({"dp": 3, "tp": 4})
    with spmd(SPMD(mesh, mesh.rank_of((2, 3)), ("dp",), virtual=True)):
        x = torch.empty(8, 6, device="meta")
        assert psum(x, "tp").shape == (8, 6)
        assert all_gather(x, "tp", dim=1).shape == (8, 24)
        assert all_to_all(x, "tp", 0, 1).shape == (2, 24)
        assert int(axis_index("tp")) == 3
        with pytest.raises(MeshError, match="'dp'.*FSDP axis"):
            psum(x, "dp")
        with pytest.raises(MeshError, match="'ep' is not an axis"):
            all_gather(x, "ep")
        with pytest.raises(ValueError, match="split_dim 1 has size 6.*4 ranks"):
            all_to_all(x, "tp", 1, 0)


# -- a tensor-parallel step: the grads the adjoint convention gives are the true grads -------------
def _tp_grads(rank, identity_psum_backward):
    # identity_psum_backward: shard_map's transpose without its implicit pvary casts
    loss_fn = functools.partial(tp_mlp_loss, psum=psum_with_identity_backward) if identity_psum_backward else tp_mlp_loss
    step = hpf.shard_step(loss_fn, mesh=TP, optimizer=hpf.optim.adamw(lr=0.0), param_specs=TP_MLP_SPECS, fsdp_axes=())
    state = step.init(tp_mlp_params())
    step(state, tp_mlp_batch())
    grads = step.full_params(hpf.TrainState(step.grad_shards, None))
    return optree.tree_map(lambda t: t.numpy(), grads)


def _rank_dependent_shape(rank, mode, bad_at):
    """A loss whose psum on rank 1 has an extra row at step ``bad_at``: (steps done, the error, seconds)."""
    at = [0]

    def loss_fn(params, batch):
        h = torch.tanh(params["embed"][batch[:, :-1]] @ params["blocks"][0]["w_up"])  # (this rank's columns)
        extra = at[0] == bad_at and rank == 1
        return tp_mlp_loss(params, batch) + psum(torch.cat([h] + [h[:1]] * extra), "tp").mean()

    step = hpf.shard_step(loss_fn, mesh=TP, optimizer=hpf.optim.adamw(lr=0.0), param_specs=TP_MLP_SPECS, fsdp_axes=(),
                          mode=mode)
    state, t = step.init(tp_mlp_params()), time.monotonic()
    for done in range(bad_at + 1):
        at[0] = done
        try:
            state, _ = step(state, tp_mlp_batch())
        except ValueError as e:
            return done, str(e), time.monotonic() - t
    return bad_at + 1, None, time.monotonic() - t


@pytest.mark.slow
@pytest.mark.parametrize("mode, bad_at", [("production", 0), ("validate", 2)])
def test_a_rank_dependent_psum_shape_in_a_step_is_one_named_error_on_every_rank(mode, bad_at):
    """Production mode checks the first step's collectives, validation mode every one (gloo aborted
    rank 0 with SIGABRT)."""
    for done, error, seconds in launch(_rank_dependent_shape, 2, mode, bad_at, timeout=120):
        assert done == bad_at and error is not None and seconds < 30
        assert "hpf.psum over 'tp'" in error and "rank 0: [3, 4," in error and "rank 1: [4, 4," in error, error


@pytest.fixture(scope="module")
def tp_grads():
    return {flag: launch(_tp_grads, 2, flag, timeout=120)[0] for flag in (False, True)}


def reference_grads():
    return {p: g.numpy() for p, g in autograd_grads(tp_mlp_loss, tp_mlp_params(), tp_mlp_batch()).items()}


@pytest.mark.slow
def test_tensor_parallel_grads_match_plain_autograd(tp_grads):
    paths, got, _ = hpf.tree.flatten(tp_grads[False])
    want = reference_grads()
    assert paths == list(want)
    for path, g in zip(paths, got):
        # fp32: the TP ranks sum half-width matmuls, a reordering at ulp level.
        np.testing.assert_allclose(g, want[path], rtol=1e-5, atol=1e-6, err_msg=path)


@pytest.mark.slow
def test_identity_psum_backward_would_lose_the_other_ranks_contributions(tp_grads):
    """Why psum's backward all-reduces: with an identity transpose the embedding (replicated,
    feeding sharded blocks) and the sharded weights get wrong grads."""
    paths, got, _ = hpf.tree.flatten(tp_grads[True])
    want = reference_grads()
    wrong = [p for p, g in zip(paths, got) if not np.allclose(g, want[p], rtol=1e-3, atol=1e-5)]
    assert "embed" in wrong and "blocks/0/w_up" in wrong
