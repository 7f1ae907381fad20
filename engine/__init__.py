"""llmpool.engine: a PagedAttention, continuous-batching engine for Llama-family models.

The exports load on first use, so that importing one light module of the engine does not load the
model code, torch and transformers with it (seconds, and hundreds of MB): ``llmpool digest``
imports ``model_source`` alone, the test fixtures a few such modules. The gateway imports no
engine module at all: the OpenAI protocol it shares with the engine server is
``llmpool.protocol``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmpool.engine.config import EngineConfig
    from llmpool.engine.llm import LLM
    from llmpool.engine.outputs import CompletionOutput, RequestOutput
    from llmpool.engine.sampling_params import SamplingParams
    from llmpool.engine.structured_outputs import StructuredOutputsParams

_EXPORTS = {
    "EngineConfig": "llmpool.engine.config",
    "LLM": "llmpool.engine.llm",
    "CompletionOutput": "llmpool.engine.outputs",
    "RequestOutput": "llmpool.engine.outputs",
    "SamplingParams": "llmpool.engine.sampling_params",
    "StructuredOutputsParams": "llmpool.engine.structured_outputs",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llmpool.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
