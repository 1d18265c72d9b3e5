"""Which device a rank computes on: one decision, read by the step, the CLI and user scripts."""
from __future__ import annotations

import torch

from .comm import world

__all__ = ["default_device"]


def default_device() -> torch.device:
    """The accelerator the process group drives, else the CPU (gloo)."""
    if world.backend() not in (None, "gloo") and torch.accelerator.is_available():
        return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())
    return torch.device("cpu")
