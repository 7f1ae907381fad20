"""The CPU features the engine's default dtype depends on, read from /proc/cpuinfo."""

from __future__ import annotations

import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")

# Flags of x86 CPUs that multiply bfloat16 natively (AVX-512 BF16 on Cooper Lake, Zen 4 and
# later; AMX on Sapphire Rapids and later). Without them torch emulates bfloat16 arithmetic by
# converting to float32, and batched steps run 2-3x slower than in float32.
NATIVE_BFLOAT16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The first processor's ``flags`` in ``cpuinfo`` (default: this machine's /proc/cpuinfo).

    Empty where there is no /proc/cpuinfo (macOS, Windows) or it lists no x86 flags (Arm).
    """
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text(errors="replace")
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def native_bfloat16_flags(cpuinfo: str | None = None) -> list[str]:
    """Which of ``NATIVE_BFLOAT16_FLAGS`` the CPU has; empty: no native bfloat16 arithmetic."""
    flags = cpu_flags(cpuinfo)
    return [flag for flag in NATIVE_BFLOAT16_FLAGS if flag in flags]


def cpu_model(cpuinfo: str | None = None) -> str:
    """The first processor's ``model name`` in ``cpuinfo`` (default: this machine's), as lscpu
    prints it; ``platform.processor()`` where there is none (macOS, Windows, some Arm)."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "model name":
            return value.strip()
    return platform.processor() or "unknown CPU"
