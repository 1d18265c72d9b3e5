"""Newton-Schulz coefficients: names, tuples and per-step lists resolved to one (a, b, c) per step.

(hpf.optim's lr "schedules" are another thing: a learning rate as a function of the step.)

Each step applies the odd quintic p(x) = a x + b x^3 + c x^5 to every singular value.
"""
from __future__ import annotations

import math
from typing import Sequence, Union

Coefficients = tuple[float, float, float]
CoefficientSpec = Union[str, Coefficients, Sequence[Coefficients]]

# Keller Jordan's Muon quintic, one tuple for every step; the same numbers torch.optim.Muon uses.
KELLER = ((3.4445, -4.7750, 2.0315),)

# Polar Express, degree 5: Amsel, Persson, Musco, Gower, "The Polar Express: Optimal Matrix Sign
# Methods and Their Application to the Muon Algorithm" (arXiv 2505.16932), Algorithm 1;
# code at github.com/NoahAmsel/PolarExpress. The published safety scaling is kept as published:
# every polynomial but the last is divided by (1.01, 1.01**3, 1.01**5), and the input is
# normalized by 1.01 * ||X||_F (POLAR_EXPRESS_NORM_SCALE). Steps past the list reuse the last.
_POLAR_EXPRESS_UNSCALED = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),  # the paper: subsequent coefficients equal this numerically
)
_SAFETY = 1.01
POLAR_EXPRESS = tuple(
    (a / _SAFETY, b / _SAFETY**3, c / _SAFETY**5) for a, b, c in _POLAR_EXPRESS_UNSCALED[:-1]
) + (_POLAR_EXPRESS_UNSCALED[-1],)
POLAR_EXPRESS_NORM_SCALE = _SAFETY

# name -> (per-step coefficients, factor on the Frobenius norm used to normalize the input)
NAMED_COEFFICIENTS: dict[str, tuple[tuple[Coefficients, ...], float]] = {
    "keller": (KELLER, 1.0),
    "polar_express": (POLAR_EXPRESS, POLAR_EXPRESS_NORM_SCALE),
}


def _check_triple(value, what: str) -> Coefficients:
    if (
        not isinstance(value, (tuple, list))
        or len(value) != 3
        or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in value)
    ):
        raise ValueError(
            f"{what} must be three finite numbers (a, b, c) for p(x) = a x + b x^3 + c x^5, "
            f"got {value!r}"
        )
    return tuple(float(v) for v in value)


def resolve_coefficients(coefficients: CoefficientSpec, steps: int) -> tuple[list[Coefficients], float]:
    """Return (one (a, b, c) per step, norm scale) for a coefficients name, one tuple, or a per-step list."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if isinstance(coefficients, str):
        if coefficients not in NAMED_COEFFICIENTS:
            raise ValueError(
                f"unknown coefficients name {coefficients!r}; use one of {sorted(NAMED_COEFFICIENTS)}, "
                f"one (a, b, c) tuple, or a list of {steps} tuples"
            )
        per_step, norm_scale = NAMED_COEFFICIENTS[coefficients]
        return [per_step[min(i, len(per_step) - 1)] for i in range(steps)], norm_scale
    if isinstance(coefficients, (tuple, list)) and coefficients and all(
        isinstance(v, (int, float)) for v in coefficients
    ):  # a flat sequence of numbers is one (a, b, c) used at every step
        return [_check_triple(coefficients, "coefficients")] * steps, 1.0
    if not isinstance(coefficients, (tuple, list)) or len(coefficients) == 0:
        raise ValueError(
            f"coefficients must be a name {sorted(NAMED_COEFFICIENTS)}, one (a, b, c) tuple, "
            f"or a list of (a, b, c) tuples, got {coefficients!r}"
        )
    if len(coefficients) != steps:
        raise ValueError(
            f"coefficients lists {len(coefficients)} per-step tuples but steps={steps}; "
            f"pass exactly one (a, b, c) per step, or steps={len(coefficients)}"
        )
    return [_check_triple(c, f"coefficients[{i}]") for i, c in enumerate(coefficients)], 1.0
