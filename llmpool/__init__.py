"""llmpool: a PagedAttention serving engine and a Kubernetes operator that pins its replicas."""

__version__ = "0.1.0"
