"""dtype="auto": bfloat16 on CUDA and on CPUs with native bfloat16 arithmetic, else float32."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from llmpool.engine import cpu_features
from llmpool.engine.config import EngineConfig, resolve_dtype
from llmpool.engine.engine_core import EngineCore
from llmpool.engine.kernels.capabilities import KernelCapabilities
from llmpool.engine.models import linear
from llmpool.engine.models.linear import GemmChoice
from llmpool.engine.server import fingerprint

CPU = torch.device("cpu")
AVX2_FLAGS = "fpu vme de pse tsc msr sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2"
ZEN4_FLAGS = AVX2_FLAGS + " avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni"
SAPPHIRE_RAPIDS_FLAGS = ZEN4_FLAGS + " amx_bf16 amx_tile amx_int8"


def cpuinfo(flags: str, processors: int = 2) -> str:
    """/proc/cpuinfo as Linux writes it on x86: one block of ``name\\t: value`` per processor."""
    block = "processor\t: {}\nvendor_id\t: AuthenticAMD\nmodel name\t: a CPU\nflags\t\t: {}\n"
    return "\n".join(block.format(n, flags) for n in range(processors))


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (AVX2_FLAGS, []),
        (ZEN4_FLAGS, ["avx512_bf16"]),
        (SAPPHIRE_RAPIDS_FLAGS, ["avx512_bf16", "amx_bf16"]),
        (AVX2_FLAGS + " amx_bf16", ["amx_bf16"]),
        (AVX2_FLAGS + " avx512_bf16_extra", []),  # whole flags only
    ],
    ids=["avx2", "avx512-bf16", "amx", "amx-only", "prefix"],
)
def test_native_bfloat16_flags(flags: str, expected: list[str]) -> None:
    assert cpu_features.native_bfloat16_flags(cpuinfo(flags)) == expected


def test_cpuinfo_without_x86_flags_has_no_native_bfloat16() -> None:
    arm = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 bf16\n"
    assert cpu_features.cpu_flags(arm) == frozenset()
    assert cpu_features.native_bfloat16_flags("") == []


def test_missing_proc_cpuinfo_reads_as_no_flags(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(cpu_features, "CPUINFO", tmp_path / "no-such-file")
    assert cpu_features.cpu_flags() == frozenset()
    assert resolve_dtype("auto", CPU).dtype == torch.float32


def test_default_reads_this_machines_proc_cpuinfo(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    fake = tmp_path / "cpuinfo"
    fake.write_text(cpuinfo(ZEN4_FLAGS))
    monkeypatch.setattr(cpu_features, "CPUINFO", fake)
    assert resolve_dtype("auto", CPU).dtype == torch.bfloat16
    assert EngineConfig().resolved_dtype(CPU).dtype == torch.bfloat16
    fake.write_text(cpuinfo(AVX2_FLAGS))
    assert EngineConfig().resolved_dtype(CPU).dtype == torch.float32


def test_auto_on_a_cpu_with_native_bfloat16_is_bfloat16() -> None:
    resolved = resolve_dtype("auto", CPU, cpuinfo(SAPPHIRE_RAPIDS_FLAGS))
    assert resolved.dtype == torch.bfloat16 and resolved.name == "bfloat16"
    assert "avx512_bf16, amx_bf16" in resolved.reason and resolved.reason.startswith("auto")


def test_auto_on_an_avx2_cpu_is_float32() -> None:
    resolved = resolve_dtype("auto", CPU, cpuinfo(AVX2_FLAGS))
    assert resolved.dtype == torch.float32 and resolved.name == "float32"
    assert "no native bfloat16" in resolved.reason


@pytest.mark.parametrize("flags", [AVX2_FLAGS, ZEN4_FLAGS])
def test_auto_on_cuda_is_bfloat16_whatever_the_cpu(flags: str) -> None:
    resolved = resolve_dtype("auto", torch.device("cuda", 0), cpuinfo(flags))
    assert resolved.dtype == torch.bfloat16 and "CUDA" in resolved.reason


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("flags", [AVX2_FLAGS, SAPPHIRE_RAPIDS_FLAGS])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_explicit_dtype_wins(dtype: str, flags: str, device: str) -> None:
    resolved = resolve_dtype(dtype, torch.device(device), cpuinfo(flags))
    assert resolved.name == dtype and resolved.reason == "set explicitly"


def test_fingerprint_says_the_dtype_and_why_outside_the_pin(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The resolved dtype and the GEMMs the probes chose are observed, not pinned: one pin fits
    nodes with and without bf16."""
    monkeypatch.setattr(fingerprint.model_source, "weights_digest", lambda folder: "sha256:w")
    monkeypatch.setattr(fingerprint.model_source, "tokenizer_digest", lambda folder: "sha256:t")
    cpuinfo_path = tmp_path / "cpuinfo"
    monkeypatch.setattr(cpu_features, "CPUINFO", cpuinfo_path)

    def served_on(flags: str, gemm: GemmChoice) -> dict[str, Any]:
        cpuinfo_path.write_text(cpuinfo(flags))
        config = EngineConfig()
        resolved = config.resolved_dtype(CPU)
        core = SimpleNamespace(
            config=config,
            resolved=SimpleNamespace(source="builtin://m", revision="sha256:r", folder=tmp_path),
            max_model_len=512,
            device=CPU,
            dtype=resolved.dtype,
            resolved_dtype=resolved,
            kv_dtype_name=resolved.name,
            backend=SimpleNamespace(name="torch"),
            kernels=KernelCapabilities(gemm=gemm),
            model=SimpleNamespace(cpu_decoder=None, parameters=list, buffers=list),
            kv_caches=[],
        )
        return fingerprint.build_fingerprint(core, "m", None, None)  # type: ignore[arg-type]

    bfloat16_gemm = GemmChoice(bfloat16_kernel_max_rows=linear.BFLOAT16_KERNEL_MAX_ROWS)
    float32_gemm = GemmChoice(float32_kernel_max_rows=linear.FLOAT32_KERNEL_MAX_ROWS)
    native, emulated = served_on(ZEN4_FLAGS, bfloat16_gemm), served_on(AVX2_FLAGS, float32_gemm)
    assert native["observed"]["dtype"] == "bfloat16"
    assert "avx512_bf16" in native["observed"]["dtypeReason"]
    assert emulated["observed"]["dtype"] == "float32"
    assert "no native bfloat16" in emulated["observed"]["dtypeReason"]
    assert native["observed"]["gemm"]["bfloat16Kernel"] == "bf16_gemm"
    assert emulated["observed"]["gemm"]["float32KernelMaxRows"] == linear.FLOAT32_KERNEL_MAX_ROWS
    assert native["pinned"] == emulated["pinned"] and native["digest"] == emulated["digest"]


def test_the_start_up_line_says_the_dtype_and_why(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="llmpool.engine.engine_core"):
        core = EngineCore(EngineConfig(dtype="float32", max_model_len=128, kv_cache_memory="8MiB"))
    assert core.resolved_dtype.name == "float32"
    (line,) = [r.getMessage() for r in caplog.records if "engine ready" in r.getMessage()]
    assert "on cpu/float32 (set explicitly)" in line
