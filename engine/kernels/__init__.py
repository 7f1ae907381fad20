"""The engine's kernels: Triton for the CUDA path (paged attention, KV-cache write, RMSNorm,
rotary embedding, LoRA), C for the CPU (decode and prefill attention, LoRA, layer ops, few-row
bfloat16 and VNNI GEMMs; built by ``c_loader``), and the capabilities an engine probes once (``capabilities``)."""
