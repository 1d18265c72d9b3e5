"""Pure-function models: params are plain pytrees, ``loss(params, batch)`` is a pure function."""
from hpf.models import gpt, llama

__all__ = ["gpt", "llama"]
