"""The OpenAI-compatible HTTP server of an engine pod (`llmpool serve`)."""
