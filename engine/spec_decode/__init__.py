"""Speculative decoding: draft tokens proposed without a model, verified by the target's step."""
