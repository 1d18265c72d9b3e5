"""Op rules: how each torch op maps the layouts of its inputs to the layout of its output.

Each rule is registered where it is written (hpf.validate.op_rule says how): the maps of
elementwise ops, reductions, views and indexing in hpf.validate.shape_rules, those of products,
einsum, norms, losses and attention in hpf.validate.contraction_rules, and here the ops whose
rule is a kind rather than a map (metadata reads, conversions to Python values, ``*_like``
constructors), registered by ``register`` next to their name lists. :func:`rule_for` finds
the rule of a torch function, reflected and in-place dunders included; an op without one gets
the conservative "fallback" the tracker documents.

To add a rule: write the map function in the module of its kind of op and decorate it with
``@rule("op names", linear=...)``; add a case to ``LAYOUT_CASES`` in tests/test_validate_rules.py.
"""
from __future__ import annotations

from ..comm import collectives
from . import contraction_rules, shape_rules  # noqa: F401  (loading them registers their rules)
from .op_rule import RULES, Rule, register

__all__ = ["rule_for"]


# ops that only read metadata, produce Python values, or make tensors of the same local shape
_PASS = """shape dtype device requires_grad is_leaf grad_fn ndim layout names is_cuda is_meta is_cpu is_sparse
is_quantized is_mkldnn is_nested itemsize nbytes size dim ndimension numel nelement stride is_contiguous
element_size data_ptr storage_offset is_floating_point is_complex is_signed get_device untyped_storage len repr
format hash _version output_nr is_inference has_names retain_grad register_hook reduce_ex setstate deepcopy
dim_order is_pinned is_shared storage grad retains_grad""".split()
_VALUE = {"item", "tolist", "int_", "float_", "bool_", "index", "complex", "numpy", "equal", "allclose", "array"}
_LIKE = """zeros_like ones_like empty_like full_like rand_like randn_like randint_like zero_ fill_ normal_ uniform_
random_ exponential_ geometric_ log_normal_ cauchy_""".split()
_NEW = "new_zeros new_ones new_empty new_full new_tensor".split()

register(_PASS, kind="pass")
register(_VALUE, kind="value")
register(_LIKE, kind="like")
register(_NEW, kind="new")
register("setitem", kind="setitem")


_COLLECTIVES = {collectives.psum: "psum", collectives.psum_scatter: "psum_scatter",
                collectives.all_gather: "all_gather", collectives.all_to_all: "all_to_all",
                collectives.axis_index: "axis_index"}
_REFLECTED = {"radd": "add", "rmul": "mul", "rsub": "rsub", "rtruediv": "rdiv", "rdiv": "rdiv", "rpow": "rpow",
              "rmatmul": "rmatmul", "rand": "and", "ror": "or", "rxor": "xor", "rfloordiv": "floor_divide",
              "rmod": "mod", "rlshift": "lshift", "rrshift": "rshift", "truediv": "true_divide",
              "floordiv": "floor_divide", "iadd": "add", "isub": "sub", "imul": "mul", "itruediv": "true_divide",
              "idiv": "div", "ipow": "pow", "imatmul": "matmul", "float": "float_", "bool": "bool_", "int": "int_",
              "pos": "positive"}


def rule_for(func) -> Rule:
    """The rule of a torch function (or hpf collective); "fallback" when none is registered."""
    if func in _COLLECTIVES:
        return Rule(_COLLECTIVES[func], "collective")
    name = getattr(func, "__name__", None) or type(func).__name__
    if name == "__get__":  # a property (x.shape, x.T, ...)
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    dunder = name.startswith("__") and name.endswith("__")
    base = name[2:-2] if dunder else name
    if dunder:
        base = _REFLECTED.get(base, base)
    if base in RULES:
        return RULES[base]._replace(name=name if not dunder else base)
    if base.endswith("_") and base[:-1] in RULES and RULES[base[:-1]].kind == "map":  # in-place x.add_(y)
        return RULES[base[:-1]]._replace(name=base)
    return Rule(base, "fallback")
