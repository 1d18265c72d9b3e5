"""Muon as a chain of stages over any pytree of tensors, with an AdamW fallback (plan form: DistMuon).

Matrices (ndim >= 2; ndim > 2 is a batch of matrices over the leading dims, e.g. MoE experts
[E, m, n]) step along the orthogonalized momentum; vectors, embeddings and the head use AdamW.
Muon is a chain of the stages AdamW is made of (hpf.optim.transforms): ``partition`` gives
matrices ``chain(add_decayed_weights, scale_by_muon)`` at Muon's lr and the rest AdamW's chain
at its own, then QK-Clip when on (``Muon.transform``), run as AdamW is (a TransformOptimizer).
On a plan's flat shards (``for_plan``) the partition runs as the distributed Muon
(hpf.optim.dist_muon), which calls the same stages on the pieces it holds.
This module is hpf/optim/muon_optimizer.py, not muon.py: ``hpf.optim.muon`` is the factory.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Union

import optree
import torch

from hpf_kernels import pick_variant, resolve_coefficients

from .lr_schedules import check_rate
from .adamw_optimizer import AdamW, adamw, schedule_value
from .dist_muon import DistMuon
from .muon_math import MuonState, QKClip, ScaleByMuon, scale_by_muon, update_scale
from .combinators import Chain, InjectHyperparams, Partition, chain, partition
from .stages import add_decayed_weights
from .transform_optimizer import Staged

__all__ = ["muon", "Muon", "MuonState", "default_use_adamw"]

Schedule = Union[float, Callable[[int], float]]
ADAMW_PATH = re.compile(r"(^|/)(embed|pos|head)($|/)")


def default_use_adamw(path: str, tensor: torch.Tensor) -> bool:
    """Embeddings, positions and the output head stay on AdamW, as in Keller's and Moonlight's Muon."""
    return ADAMW_PATH.search(path) is not None


@dataclass(frozen=True)
class Muon(Staged):
    """Muon for tensors with ndim >= 2, AdamW for the rest and for paths use_adamw(path, t) picks.

    update(grads, state, params) changes params and state in place (donated, as with
    hpf.optim.adamw: no copy of the model, FSDP shards stay views into their buffers) and
    returns them. Build it with :func:`muon`, which checks the hyper-parameters. Its math is
    ``transform``, a chain of stages (hpf.optim.transforms) run as AdamW's is; under
    hpf.shard_step, ``for_plan`` runs its partition as the layout-driven :class:`DistMuon`.

    Args:
        lr: Muon's learning rate, or a function of the 1-based step.
        momentum, nesterov: torch.optim.Muon's momentum (lerp form) and Nesterov flag.
        ns_steps, coefficients: Newton-Schulz steps and coefficients (hpf_kernels names or tuples).
        scale: the per-shape lr multiplier ("keller", "moonlight", ... or a number).
        weight_decay: decoupled weight decay on the Muon params.
        adamw: the AdamW run on the other params.
        use_adamw: ``(path, tensor) -> bool``, True routes a matrix to AdamW.
        ns_compute_dtype: Newton-Schulz dtype (None: the kernel's choice for the device).
        comm_dtype: the dtype split matrices travel in under hpf.shard_step (None: the grads').
        ns_variant: "standard", "gram" or "auto" (hpf_kernels.newton_schulz's variant).
        qk_clip, qk_heads: QK-Clip's threshold and the model's map of q/k weights to heads (see muon).
        overlap: under hpf.shard_step, start each matrix's momentum and Newton-Schulz during
            backward, as its unit's grads land (see muon).

    Raises:
        TypeError: ``init``/``update`` get a leaf that is not a floating-point tensor.
        ValueError: ``update`` gets grads or state whose structure or shapes differ from params'.
    """

    lr: Schedule = 0.02
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    coefficients: Any = "keller"
    scale: Union[str, float] = "keller"
    weight_decay: float = 0.0
    adamw: AdamW = AdamW(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    use_adamw: Callable[[str, torch.Tensor], bool] = default_use_adamw
    ns_compute_dtype: torch.dtype | None = None
    comm_dtype: torch.dtype | None = None  # what matrix pieces travel in under shard_step (None: grads' dtype)
    ns_variant: str = "standard"  # hpf_kernels.newton_schulz's variant: "standard", "gram", "auto"
    qk_clip: float | None = None  # QK-Clip's tau (None: off)
    qk_heads: Any = None  # path -> (dim, head per index, power): the model's qk_heads(config)
    overlap: bool = False  # under hpf.shard_step: start momentum and Newton-Schulz as units' grads land

    State = MuonState

    @property
    def muon_stage(self) -> ScaleByMuon:
        """Momentum, Newton-Schulz and the scaled step of the matrices, as a stage."""
        return scale_by_muon(self.momentum, self.nesterov, self.ns_steps, self.coefficients, self.scale,
                             self.ns_compute_dtype, self.ns_variant)

    @property
    def adamw_stages(self) -> Chain:
        """The AdamW fallback's math without its lr, its ``weight_decay_mask`` included."""
        return self.adamw.stages

    @property
    def transform(self) -> Chain:
        """Muon as stages: its partition, then QK-Clip when on (after the update, as MuonClip)."""
        return chain(self.partition, *([self.qk_stage] if self.qk_stage is not None else []))

    @property
    def qk_stage(self) -> QKClip | None:
        return None if self.qk_clip is None else QKClip(self.qk_clip, self.qk_heads)

    @property
    def partition(self) -> Partition:
        """Matrices (``on_muon``) take decoupled weight decay then ``scale_by_muon`` at ``lr``; the
        rest AdamW's chain at the fallback's lr."""
        return partition({"muon": InjectHyperparams(chain(add_decayed_weights(self.weight_decay), self.muon_stage),
                                                    self.lr, "muon: lr"),
                          "adamw": InjectHyperparams(self.adamw_stages, self.adamw.lr, "muon: adamw_lr")},
                         labels=self.label)

    def label(self, path: str, p: torch.Tensor) -> str:
        """The partition a param goes to: "muon" or "adamw"."""
        return "muon" if self.on_muon(path, p) else "adamw"

    def for_plan(self, plan, rank: int) -> DistMuon:
        """This optimizer on the flat shards of ``plan`` (hpf.shard_step calls it): distributed Muon."""
        return DistMuon(self, plan, rank, self.comm_dtype)

    def on_muon(self, path: str, p: torch.Tensor) -> bool:
        return p.ndim >= 2 and not self.use_adamw(path, p)

    def qk_gamma(self, aux: dict | None) -> torch.Tensor | None:
        """QK-Clip's per-head factors for this step (None when QK-Clip is off); raises before any update."""
        return None if self.qk_clip is None else self.qk_stage.gamma(aux)

    def check_rates(self, step: int) -> None:
        """Raise before a step changes anything if its lr or AdamW lr is not finite and >= 0."""
        schedule_value(self.lr, step, "muon: lr")
        schedule_value(self.adamw.lr, step, "muon: adamw_lr")

    def init(self, params: Any) -> MuonState:
        _flatten(params, "params")
        return super().init(params)  # momentum or first moment; the second moment, AdamW's only

    def update(self, grads: Any, state: MuonState, params: Any, aux: dict | None = None) -> tuple[Any, MuonState]:
        """One step in place (its chain's, after checking each leaf by path); ``aux``: the step's aux
        (hpf.losses), read only under QK-Clip."""
        paths, leaves, treedef = _flatten(params, "params")
        _leaves_like(grads, treedef, paths, leaves, "grads")
        _leaves_like(state.exp_avg, treedef, paths, leaves, "state.exp_avg")
        return super().update(grads, state, params, aux)


def muon(lr: Schedule = 0.02, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
         coefficients="keller", scale: Union[str, float] = "keller", weight_decay: float = 0.0,
         adamw_lr: Schedule = 3e-4, adamw_betas: tuple[float, float] = (0.9, 0.95),
         adamw_eps: float = 1e-8, adamw_weight_decay: float = 0.0, adamw_weight_decay_mask: Any = None,
         use_adamw: Callable[[str, torch.Tensor], bool] | None = None,
         ns_compute_dtype: torch.dtype | None = None, comm_dtype: torch.dtype | None = None,
         ns_variant: str = "standard", qk_clip: float | None = None, qk_heads: dict | None = None,
         overlap: bool = False) -> Muon:
    """hpf.optim.muon: an optax-style Muon (see Muon) with an AdamW fallback for non-matrices.

    Args:
        lr: Muon's learning rate, or a callable of the 1-based step (as in hpf.optim.adamw).
        momentum: in [0, 1); nesterov: Nesterov momentum, as torch.optim.Muon.
        ns_steps: Newton-Schulz steps; coefficients: "keller", "polar_express", one (a, b, c)
            tuple, or a list of ns_steps tuples.
        scale: "keller" (torch's "original"), "moonlight" (torch's "match_rms_adamw") or a number.
        weight_decay: decoupled weight decay of the Muon params, >= 0.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay, adamw_weight_decay_mask: the AdamW fallback's.
        use_adamw: ``(path, tensor) -> bool`` (default: embeddings, positions and the head).
        ns_compute_dtype: None = the kernel's choice for the device (fp32 on CPU, bf16 on accelerators).
        comm_dtype: the dtype split matrices travel in under hpf.shard_step, e.g. torch.bfloat16
            (None: the grads').
        ns_variant: "standard" (torch.optim.Muon's iteration, the default), "gram" (Gram
            Newton-Schulz: fewer FLOPs on rectangular matrices, not bitwise torch's) or "auto"
            (per shape, whichever has fewer FLOPs). docs/muon.md has its costs and errors.
        qk_clip: QK-Clip's tau (Kimi K2's MuonClip, arXiv 2507.20534; None, the default: off).
            After each update, every head whose max attention logit this step exceeded tau has
            its query and key weights scaled by sqrt(tau / max logit), so its logits shrink to
            tau. The loss must return the aux "max_attn_logit" (the models' ``loss_for(config,
            max_logits=True)``), which hpf.shard_step reduces by max and passes to the update.
        qk_heads: which elements of which params are whose q or k: the model's
            ``qk_heads(config)`` (hpf.models.gpt.qk_heads, hpf.models.llama.qk_heads).
        overlap: under hpf.shard_step, start a matrix's momentum and Newton-Schulz (and send its
            pieces to its owner) as soon as its unit's grads land, while backward goes on (off
            by default: on a CPU, where Newton-Schulz and backward share the cores, it gains
            nothing; docs/muon.md). Only computed: params and state change after the step's
            global decision, and the result is the same. A step whose clip fires drops the early
            work (it assumed the unclipped scale) and updates after the decision. Off under a
            low-bit slow tier and with non-FSDP compute axes.

    Raises:
        ValueError: unknown or malformed coefficients, an unknown scale, momentum outside
            [0, 1), a negative lr or weight_decay, or invalid AdamW hyper-parameters.
    """
    resolve_coefficients(coefficients, ns_steps)  # bad coefficients fail here, not at step 1
    pick_variant((1, 1), ns_steps, ns_variant)
    update_scale(1, 1, scale)
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"muon: momentum must be in [0, 1), got {momentum!r}")
    for name, rate in (("lr", lr), ("adamw_lr", adamw_lr)):
        if not callable(rate):
            check_rate(rate, f"muon: {name}")
    if not weight_decay >= 0:
        raise ValueError(f"muon: weight_decay must be >= 0, got {weight_decay}")
    _check_qk_clip(qk_clip, qk_heads)
    fallback = adamw(adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay, adamw_weight_decay_mask)
    return Muon(lr, momentum, nesterov, ns_steps, coefficients, scale, weight_decay, fallback,
                use_adamw or default_use_adamw, ns_compute_dtype, comm_dtype, ns_variant,
                None if qk_clip is None else float(qk_clip), qk_heads, bool(overlap))


def _check_qk_clip(qk_clip, qk_heads) -> None:
    if qk_clip is not None and not (isinstance(qk_clip, (int, float)) and 0 < qk_clip < float("inf")):
        raise ValueError(f"muon: qk_clip must be a positive finite threshold (e.g. 100.0) or None, got {qk_clip!r}")
    if (qk_clip is None) != (qk_heads is None) or (qk_heads is not None and not isinstance(qk_heads, dict)):
        raise ValueError("muon: qk_clip and qk_heads go together: pass qk_clip=tau with qk_heads=the model's "
                         "qk_heads(config) (e.g. hpf.models.gpt.qk_heads(config)), or neither")


def _flatten(tree, what: str):
    raw_paths, leaves, treedef = optree.tree_flatten_with_path(tree)
    paths = ["/".join(str(k) for k in path) for path in raw_paths]
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
            raise TypeError(f"{what} leaf {path!r} must be a floating-point torch.Tensor, "
                            f"got {type(leaf).__name__}")
    return paths, leaves, treedef


def _leaves_like(tree, treedef, paths, params, what: str) -> list[torch.Tensor]:
    """Leaves of `tree`, checked to have the params' structure and shapes (errors name the path)."""
    if optree.tree_structure(tree) != treedef:
        raise ValueError(f"{what} must have the same tree structure as params: got "
                         f"{optree.tree_structure(tree)}, expected {treedef}")
    leaves = optree.tree_leaves(tree)
    for path, leaf, p in zip(paths, leaves, params):
        if not isinstance(leaf, torch.Tensor) or leaf.shape != p.shape:
            got = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise ValueError(f"{what} at {path!r} has shape {got}, but the param has "
                             f"{tuple(p.shape)}")
    return leaves
