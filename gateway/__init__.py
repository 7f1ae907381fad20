"""llmpool.gateway: one OpenAI endpoint in front of every LLMPool, routing by model, cache and load."""
