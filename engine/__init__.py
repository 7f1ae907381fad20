"""llmpool.engine: a PagedAttention, continuous-batching engine for Llama-family models."""

from llmpool.engine.config import EngineConfig
from llmpool.engine.llm import LLM
from llmpool.engine.outputs import CompletionOutput, RequestOutput
from llmpool.engine.sampling_params import SamplingParams
from llmpool.engine.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
