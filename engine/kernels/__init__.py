"""Triton kernels of the CUDA path: paged attention, KV-cache write, RMSNorm and rotary embedding."""
