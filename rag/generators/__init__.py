"""Generators behind the `rag.generator.Generator` protocol: the local engine and remote OpenAI-compatible servers.

Names load lazily: the remote generator needs only httpx, the local one torch and the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rag.generators.remote import RemoteGenerator, make_remote_generator

__all__ = ["LocalGenerator", "RemoteGenerator", "make_remote_generator"]

_HOMES = {"LocalGenerator": "rag.generators.local", "RemoteGenerator": "rag.generators.remote",
          "make_remote_generator": "rag.generators.remote"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'rag.generators' has no attribute {name!r}")
