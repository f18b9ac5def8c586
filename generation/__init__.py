"""Our own LLM generator: load a local Llama-family model and generate, chat or stream.

The public names load lazily, so the torch-free engine core (scheduler, block manager,
prefix cache) imports without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from generation.llm import LLM
    from generation.outputs import RequestOutput
    from generation.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]

_HOMES = {"LLM": "generation.llm", "RequestOutput": "generation.outputs",
          "SamplingParams": "generation.sampling_params"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'generation' has no attribute {name!r}")
