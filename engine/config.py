"""EngineConfig: every engine setting in one dataclass that checks itself (vLLM's names)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from llmpool.engine.cpu_features import NATIVE_BFLOAT16_FLAGS, native_bfloat16_flags
from llmpool.engine.spec_decode.config import SpeculativeConfig
from llmpool.protocol.priority import PRIORITY_CLASSES

_SIZE_UNITS = {
    "": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
}


def parse_bytes(value: int | str) -> int:
    """``2GiB``, ``512MB``, ``1e9`` or an int; the memory flags accept all of these."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgG]i?)?[bB]?\s*", value)
    if not match:
        raise ValueError(f"cannot read {value!r} as a size in bytes (e.g. 2GiB, 512MB, 1000000)")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[(unit or "").lower()])


QUANTIZATIONS = ("none", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "fp8")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ResolvedDtype:
    """The dtype the engine runs in, and why: the start-up log and /fingerprint say both."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def resolve_dtype(dtype: str, device: torch.device, cpuinfo: str | None = None) -> ResolvedDtype:
    """``auto`` is bfloat16 on CUDA and on CPUs that multiply bfloat16 natively, else float32.

    ``cpuinfo`` is the text of /proc/cpuinfo (default: this machine's). With native bfloat16 a
    CPU served 1.6-2x the tokens per second of float32 (issue 16); without, torch emulates it
    and batched steps run 2-3x slower than in float32.
    """
    if dtype != "auto":
        return ResolvedDtype(DTYPES[dtype], "set explicitly")
    if device.type == "cuda":
        return ResolvedDtype(torch.bfloat16, "auto: bfloat16 on CUDA")
    if device.type != "cpu":
        return ResolvedDtype(torch.float32, f"auto: float32 on {device.type}")
    flags = native_bfloat16_flags(cpuinfo)
    if flags:
        return ResolvedDtype(
            torch.bfloat16, f"auto: this CPU has native bfloat16 arithmetic ({', '.join(flags)})"
        )
    return ResolvedDtype(
        torch.float32,
        "auto: this CPU has no native bfloat16 arithmetic"
        f" (none of {', '.join(NATIVE_BFLOAT16_FLAGS)} in /proc/cpuinfo)",
    )


@dataclass
class EngineConfig:
    model: str | None = None  # None: the built-in model
    revision: str | None = None  # pinned content digest; the engine refuses other files
    served_model_name: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA and on CPUs with native bfloat16, else float32
    device: str = "auto"
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | str | None = None  # bytes for the KV pool; default from device memory
    gpu_memory_utilization: float = 0.9
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    # The class of requests that name none (llmpool/protocol/priority.py).
    priority_class: str = "interactive"
    # The most urgent class a request may ask for; None: priority_class, so that no client of a
    # batch pool can jump ahead of the pool's own class.
    max_request_priority: str | None = None
    quantization: str = "none"  # none | int8 | int4 (weight-only; engine/models/quantization.py)
    kv_cache_dtype: str = (
        "auto"  # auto: the model's dtype; fp8: e4m3 (per-layer scales calibrated at load)
    )
    # Compile the decoder with inductor (CPU; needs a C++ compiler): fused per-layer ops, every
    # batch size compiled while the engine serves eager (engine/background_compile.py).
    compile: bool = False
    # Where compiled artifacts are kept between starts (engine/compile_cache.py): None is
    # $XDG_CACHE_HOME/llmpool/compile (else ~/.cache/llmpool/compile); '' or 'none' keeps none.
    compile_cache_dir: str | None = None
    # How long the start-up GEMM probes wait for other processes to leave the CPUs before the
    # least disturbed run's choice stands (kernels/capabilities.py); None: PROBE_PATIENCE_S.
    gemm_probe_patience_s: float | None = None
    # LoRA adapters (engine/lora): slots resident beside the base model, and their largest rank.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # Prompt-lookup speculative decoding (engine/spec_decode): None (off), or vLLM's
    # --speculative-config as a SpeculativeConfig, a dict or its JSON text.
    speculative_config: SpeculativeConfig | dict | str | None = None
    # What one request's output grammar may cost (structured_outputs.GrammarBudget): lexer fuel
    # per compile, how long a step waits for a row's mask, the mask time a request may spend.
    grammar_compile_fuel: int = 1_000_000
    grammar_step_budget_ms: float = 20.0
    grammar_request_budget_s: float = 5.0

    def __post_init__(self) -> None:
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        for ok, message in self._checks():
            if not ok:
                raise ValueError(message)

    def _checks(self) -> list[tuple[bool, str]]:
        """(holds, what to say if not) for every setting."""
        return [
            (self.max_num_seqs >= 1, f"max_num_seqs must be at least 1, got {self.max_num_seqs}"),
            (
                self.max_num_batched_tokens >= 1,
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}",
            ),
            (1 <= self.block_size <= 256, f"block_size must be in 1..256, got {self.block_size}"),
            (
                self.num_kv_blocks is None or self.num_kv_blocks >= 1,
                f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}",
            ),
            (
                self.num_kv_blocks is None or self.kv_cache_memory is None,
                "give num_kv_blocks or kv_cache_memory, not both",
            ),
            (
                0.0 < self.gpu_memory_utilization <= 1.0,
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
            ),
            (
                self.max_model_len is None or self.max_model_len >= 1,
                f"max_model_len must be at least 1, got {self.max_model_len}",
            ),
            (
                self.dtype == "auto" or self.dtype in DTYPES,
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}",
            ),
            (
                self.priority_class in PRIORITY_CLASSES,
                f"priority_class must be one of {', '.join(PRIORITY_CLASSES)}, got {self.priority_class!r}",
            ),
            (
                self.max_request_priority is None or self.max_request_priority in PRIORITY_CLASSES,
                f"max_request_priority must be one of {', '.join(PRIORITY_CLASSES)},"
                f" got {self.max_request_priority!r}",
            ),
            (
                self.quantization in QUANTIZATIONS,
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}",
            ),
            (
                self.kv_cache_dtype in KV_CACHE_DTYPES,
                f"kv_cache_dtype must be auto or fp8, got {self.kv_cache_dtype!r}",
            ),
            (
                self.gemm_probe_patience_s is None or self.gemm_probe_patience_s >= 0,
                f"gemm_probe_patience_s must be 0 or more, got {self.gemm_probe_patience_s}",
            ),
            (1 <= self.max_loras <= 64, f"max_loras must be in 1..64, got {self.max_loras}"),
            (
                1 <= self.max_lora_rank <= 256,
                f"max_lora_rank must be in 1..256, got {self.max_lora_rank}",
            ),
            (
                self.grammar_compile_fuel >= 1
                and self.grammar_step_budget_ms >= 0
                and self.grammar_request_budget_s > 0,
                "grammar budgets: compile fuel at least 1, step budget at least 0 ms, request"
                f" budget above 0 s; got {self.grammar_compile_fuel},"
                f" {self.grammar_step_budget_ms}, {self.grammar_request_budget_s}",
            ),
            (
                not (self.compile and self.enable_lora),
                "compile and enable_lora cannot be combined yet: LoRA steps run eager",
            ),
        ]

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` as the SpeculativeConfig that ``__post_init__`` made of it."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def request_priority_floor(self) -> int:
        """The lowest (most urgent) request priority this engine accepts."""
        return PRIORITY_CLASSES[self.max_request_priority or self.priority_class]

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device) -> ResolvedDtype:
        """The dtype to load the model in, and why (the engine asks once, at start)."""
        return resolve_dtype(self.dtype, device)
