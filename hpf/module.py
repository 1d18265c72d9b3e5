"""The ``nn.Module`` bridge: a Module's parameters as a params pytree, and a pure loss over them.

``params, loss_fn = hpf.from_module(model, loss)`` gives what ``hpf.shard_step`` takes, where
``loss(model, batch)`` is ordinary PyTorch that calls the model. During ``loss_fn(params, batch)``
the model computes with ``params`` (``torch.func.functional_call``'s swap of its tensors), not its
own weights. Each child of a top-level ``nn.ModuleList`` (e.g. the blocks of a transformer) is one
list element of the tree, so one FSDP unit, read (gathered) only when that child's ``forward``
runs: FSDP's memory, one block gathered at a time. ``hpf.to_module(model, step.full_params(state))``
copies trained params back.

Buffers (running statistics, rotary caches) stay on the model as constants. A child's params are
swapped in only during its own ``forward``; outside it they are meta tensors, so code that reads a
block's weight from outside the block fails loudly instead of using stale weights.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["from_module", "to_module"]


def from_module(model: nn.Module, loss: Callable[[nn.Module, Any], Any]) -> tuple[dict, Callable]:
    """``(params, loss_fn)`` for ``hpf.shard_step`` from a Module and ``loss(model, batch)``.

    ``params`` nests dicts by submodule name (``"layers/0/attn/weight"``); each top-level
    ``nn.ModuleList`` becomes a list, one FSDP unit per child. Its leaves are the model's own
    ``nn.Parameter`` objects (``step.init`` copies them; ``requires_grad=False`` ones are frozen;
    a tied weight is one leaf at both paths).

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``loss`` is not callable.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"hpf.from_module(model, loss): model is a {type(model).__name__}, not a torch.nn.Module")
    if not callable(loss):
        raise TypeError("hpf.from_module(model, loss): loss must be a function loss(model, batch) -> scalar")
    params = _tree(model, top=True)

    def loss_fn(params: Any, batch: Any) -> Any:
        with _swapped(model, params, top=True):
            return loss(model, batch)
    loss_fn.__name__ = f"from_module({type(model).__name__})"
    return params, loss_fn


def to_module(model: nn.Module, params: Any) -> nn.Module:
    """Copy a full params tree (``step.full_params(state)``) into ``model``'s parameters, in place.

    Raises:
        ValueError: a path of ``model`` missing from ``params``, or a shape that differs."""
    for name, p in model.named_parameters(remove_duplicate=False):
        node = params
        for key in _path(model, name):
            if not (isinstance(node, dict) and key in node) and not (isinstance(node, list) and isinstance(key, int)
                                                                    and key < len(node)):
                raise ValueError(f"hpf.to_module: params has no {name!r} ('/'-path "
                                 f"{'/'.join(map(str, _path(model, name)))}); pass the tree of step.full_params for "
                                 "a step built by hpf.from_module(model, ...)")
            node = node[key]
        if node.shape != p.shape:
            raise ValueError(f"hpf.to_module: {name} is {tuple(node.shape)} in params but {tuple(p.shape)} in the "
                             "model")
        with torch.no_grad():
            p.copy_(node)
    return model


def _units(module: nn.Module, top: bool) -> bool:
    """Whether ``module``'s children are FSDP units: a ModuleList not inside another unit."""
    return top and isinstance(module, nn.ModuleList)


def _tree(module: nn.Module, top: bool) -> Any:
    if _units(module, top):
        return [_tree(child, top=False) for child in module]
    node: dict = {name: p for name, p in module._parameters.items() if p is not None}
    for name, child in module.named_children():
        sub = _tree(child, top)
        if sub:
            node[name] = sub
    return node


def _path(model: nn.Module, dotted: str) -> list:
    """A dotted parameter name -> its keys in the params tree (list indices as ints)."""
    keys, module, top = [], model, True
    for part in dotted.split("."):
        is_list = _units(module, top)
        keys.append(int(part) if is_list else part)
        if part in module._modules:
            top = top and not is_list
            module = module._modules[part]
    return keys


@contextlib.contextmanager
def _swapped(module: nn.Module, params: Any, top: bool):
    """``module`` computes with ``params`` for the duration; a unit list's children get theirs
    only while their forward runs (a lazy read: the gather happens then)."""
    saved, hooks = [], []
    try:
        _swap_in(module, params, top, saved, hooks)
        yield
    finally:
        for h in hooks:
            h.remove()
        for owner, name, value in reversed(saved):
            owner._parameters[name] = value


def _swap_in(module: nn.Module, params: Any, top: bool, saved: list, hooks: list) -> None:
    if _units(module, top):
        for i, child in enumerate(module):
            _park(child, saved)
            hooks.append(child.register_forward_pre_hook(_enter(params, i, saved)))
            hooks.append(child.register_forward_hook(_leave(saved), always_call=True))
        return
    for name, p in list(module._parameters.items()):
        if p is not None:
            saved.append((module, name, p))
            module._parameters[name] = params[name]
    for name, child in module.named_children():
        if name in params:
            _swap_in(child, params[name], top, saved, hooks)


def _park(child: nn.Module, saved: list) -> None:
    """A unit's params outside its forward: meta tensors of the same shape (a read fails loudly)."""
    for m in child.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                saved.append((m, name, p))
                m._parameters[name] = torch.empty_like(p, device="meta")


def _enter(units: Any, i: int, saved: list):
    def hook(child: nn.Module, args):
        _swap_in(child, units[i], False, [], [])  # (the originals are already in ``saved``)
    return hook


def _leave(saved: list):
    def hook(child: nn.Module, args, out):
        _park(child, [])
    return hook
