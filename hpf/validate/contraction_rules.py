"""Op rules of the ops that contract dims or need them whole: products, einsum, norms, losses, attention."""
from __future__ import annotations

import torch

from .layout import LOCAL, SUM, WHOLE
from .op_rule import Call, align, broadcast_map, rule

__all__ = []  # its rules register themselves when hpf.validate.rules loads it


@rule("matmul mm bmm mv dot vdot rmatmul", linear="product")
def _matmul(call, operands):
    a, b = call.args[0], call.args[1]
    if call.op == "rmatmul":
        a, b = b, a
    na, nb = a.dim(), b.dim()
    if na == 1 and nb == 1:
        return align(operands, [(a, [SUM]), (b, [SUM])])
    if nb == 1:
        return align(operands, [(a, list(range(na - 1)) + [SUM]), (b, [SUM])])
    if na == 1:
        return align(operands, [(a, [SUM]), (b, list(range(nb - 2)) + [SUM, nb - 2])])
    batch = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    ob = len(batch)
    return align(operands, [(a, broadcast_map(a[..., 0, 0], batch) + [ob, SUM]),
                             (b, broadcast_map(b[..., 0, 0], batch) + [SUM, ob + 1])])


@rule("linear", linear="product")
def _linear(call, operands):
    x, w, bias = call.args[0], call.arg(1, "weight"), call.arg(2, "bias")
    n = x.dim()
    pairs = [(x, list(range(n - 1)) + [SUM]), (w, [n - 1, SUM] if w.dim() == 2 else [SUM])]
    if isinstance(bias, torch.Tensor):
        pairs.append((bias, [n - 1] if bias.dim() == 1 else [LOCAL] * bias.dim()))
    return align(operands, pairs)


@rule("addmm baddbmm addmv addbmm")
def _addmm(call, operands):
    """addmm / baddbmm / addmv / addbmm: input + product, the input broadcast to the output."""
    inp, m1, m2 = call.args[0], call.args[1], call.args[2]
    if call.op == "addmm":
        p1, p2 = [0, SUM], [SUM, 1]
    elif call.op == "baddbmm":
        p1, p2 = [0, 1, SUM], [0, SUM, 2]
    elif call.op == "addbmm":
        p1, p2 = [SUM - 1, 0, SUM], [SUM - 1, SUM, 1]
    else:  # addmv
        p1, p2 = [0, SUM], [SUM]
    return align(operands, [(m1, p1), (m2, p2), (inp, broadcast_map(inp, call.out.shape) if call.out is not None
                                                  else list(range(inp.dim())))])


@rule("outer ger", linear="product")
def _outer(call, operands):
    return align(operands, [(call.args[0], [0]), (call.args[1], [1])])


@rule("einsum", linear="product")
def _einsum(call, operands):
    eq = call.args[0].replace(" ", "")
    packed = len(call.args) == 2 and isinstance(call.args[1], (list, tuple))
    tensors = list(call.args[1]) if packed else list(call.args[1:])
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    ell = max((t.dim() - len(term.replace("...", "")) for term, t in zip(terms, tensors) if "..." in term), default=0)
    ell_tokens = [f"...{i}" for i in range(ell)]

    def tokens(term: str, nd: int) -> list:
        if "..." not in term:
            return list(term)
        head, tail = term.split("...")
        k = nd - len(head) - len(tail)
        return list(head) + ell_tokens[ell - k:] + list(tail)

    ins = [tokens(term, t.dim()) for term, t in zip(terms, tensors)]
    if arrow:
        out = tokens(rhs, ell + len(rhs.replace("...", "")))
    else:
        letters = [c for term in ins for c in term if not c.startswith("...")]
        out = ell_tokens + sorted(c for c in set(letters) if letters.count(c) == 1)
    where = {c: i for i, c in enumerate(out)}
    ids = {c: i for i, c in enumerate(sorted({c for term in ins for c in term}))}
    return align(operands, [(t, [where.get(c, SUM - ids[c]) for c in term]) for t, term in zip(tensors, ins)])


@rule("embedding", linear="product")
def _embedding(call, operands):
    a, b = call.args[0], call.args[1]
    ids, weight = (a, b) if not a.is_floating_point() else (b, a)
    n = ids.dim()
    rows = [LOCAL, n] if weight.dim() == 2 else [LOCAL] * weight.dim()  # looked-up rows are local parts
    return align(operands, [(ids, list(range(n))), (weight, rows)])


@rule("layer_norm rms_norm")
def _norm(call, operands):  # layer_norm / rms_norm: the normalized trailing dims must be whole
    x, shape = call.args[0], call.arg(1, "normalized_shape")
    k = 1 if isinstance(shape, int) else len(shape)
    pairs = [(x, list(range(x.dim() - k)) + [WHOLE] * k)]
    pairs += [(t, [WHOLE] * t.dim()) for t in operands if t is not x]
    return align(operands, pairs)


def _reduction_arg(call: Call, pos: int) -> str:
    red = call.arg(pos, "reduction", "mean")
    if call.kwargs.get("size_average") is not None or call.kwargs.get("reduce") is not None:
        return "mean"  # legacy arguments: be conservative
    return red


def _reduce_keys(m: list, red: str) -> list:
    if red == "none":
        return m
    return [k if k < 0 else (SUM - k if red == "sum" else WHOLE) for k in m]


@rule("cross_entropy nll_loss")
def _cross_entropy(call, operands):
    """cross_entropy / nll_loss: the class dim must be whole; 'sum' over a sharded batch dim is
    a partial sum, 'mean' over one is an error (the count is global)."""
    x, target = call.args[0], call.arg(1, "target")
    red = _reduction_arg(call, 6)
    cdim = 1 if x.dim() >= 2 else 0
    batch = [d for d in range(x.dim()) if d != cdim]
    keys = _reduce_keys(list(range(len(batch))), red)
    mx = [WHOLE] * x.dim()
    for j, d in enumerate(batch):
        mx[d] = keys[j]
    if target.is_floating_point() and target.dim() == x.dim():
        mt = mx
    else:
        mt = keys[:target.dim()]
    pairs = [(x, mx), (target, mt)] + [(t, [WHOLE] * t.dim()) for t in operands if t is not x and t is not target]
    return align(operands, pairs)


@rule("mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy binary_cross_entropy_with_logits kl_div "
      "soft_margin_loss")
def _pointwise_loss(call, operands):  # mse_loss, l1_loss, binary_cross_entropy(_with_logits), ...
    red = call.kwargs.get("reduction", "mean")
    shape = tuple(torch.broadcast_shapes(*(t.shape for t in operands)))
    return [_reduce_keys(broadcast_map(t, shape), red) for t in operands]


@rule("scaled_dot_product_attention")
def _sdpa(call, operands):
    """Attention: batch/head dims align (heads may be sharded); the key length and the head dim
    must be whole; queries may be split unless the mask is causal (it assumes aligned positions)."""
    q, k, v = call.args[0], call.arg(1, "key"), call.arg(2, "value")
    mask, causal = call.arg(3, "attn_mask"), call.arg(5, "is_causal", False)
    batch = tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    nb = len(batch)
    rows = WHOLE if causal else nb

    def lead(t):
        return broadcast_map(t[..., 0, 0], batch) if t.dim() >= 2 else []

    pairs = [(q, lead(q) + [rows, WHOLE]), (k, lead(k) + [WHOLE, WHOLE]), (v, lead(v) + [WHOLE, nb + 1])]
    if isinstance(mask, torch.Tensor):
        tail = [rows if mask.dim() >= 2 and mask.shape[-2] != 1 else LOCAL, WHOLE][-min(mask.dim(), 2):]
        pairs.append((mask, (lead(mask) if mask.dim() > 2 else []) + tail))
    return align(operands, pairs)
