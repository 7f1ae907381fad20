"""The LLMPool operator: renders engine Deployments from LLMPools and checks that replicas stay pinned."""
