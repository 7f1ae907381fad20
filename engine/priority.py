"""The priority classes, as the engine's modules (config, admission, the core), its tests and
benchmarks import them. They are part of the request protocol, so they are defined in
``llmpool.protocol.priority``, which the gateway reads without importing the engine."""

from __future__ import annotations

from llmpool.protocol.priority import PRIORITY_CLASSES

__all__ = ["PRIORITY_CLASSES"]
