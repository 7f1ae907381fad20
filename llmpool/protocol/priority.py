"""Priority classes: the names clients and operators use, and the request priority each maps to."""

from __future__ import annotations

# Lower runs first and is preempted last (vLLM's convention for Request.priority).
PRIORITY_CLASSES = {"interactive": 0, "batch": 1}
