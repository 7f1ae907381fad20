"""C kernels for the CPU, built with the machine's C compiler the first time they are needed.

Each kernel is one C source file beside the Python module that calls it. It is compiled with
instruction-set flags read from /proc/cpuinfo (never ``-march=native``, which fails on some
VMs) and cached under ``LLMPOOL_KERNEL_CACHE`` (default: ``$TMPDIR/llmpool-kernels-<uid>``, the
pod's writable /tmp), keyed by the source and the flags. Without a compiler, or where the cache
cannot hold code (a ``noexec`` mount), ``build`` returns None and the caller keeps its torch
path. Kernels parallelize with OpenMP: torch loads libgomp under the same soname, so they share
torch's thread teams and its thread count.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from llmpool.engine.cpu_features import cpu_flags

logger = logging.getLogger(__name__)

AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
AVX512_BUILD = ["-march=x86-64-v4", "-mprefer-vector-width=512"]
AVX2_BUILD = ["-march=x86-64-v3"]


def arch_flags() -> list[str]:
    """The widest x86-64 level this CPU has; none (portable code) elsewhere."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_flags()
    if flags >= AVX512_FLAGS:
        return AVX512_BUILD
    if {"avx2", "fma", "f16c", "bmi2"} <= flags:
        return AVX2_BUILD
    return []


def _compiler() -> str | None:
    return shutil.which("gcc") or shutil.which("cc")


def _cache_dir() -> Path:
    default = Path(tempfile.gettempdir()) / f"llmpool-kernels-{os.getuid()}"
    return Path(os.environ.get("LLMPOOL_KERNEL_CACHE", default))


def build(
    source: Path, arch: Sequence[str], signatures: Mapping[str, Sequence[type]]
) -> ctypes.CDLL | None:
    """Build ``source`` (once per source and flags) and load it with ``signatures`` (symbol ->
    argument types; every kernel returns void); None where that fails (logged)."""
    compiler = _compiler()
    if compiler is None:
        return None
    flags = ["-O3", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared", *arch]
    key = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    path = _cache_dir() / f"{source.stem}-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        built = subprocess.run(
            [compiler, *flags, str(source), "-o", str(partial), "-lm"],
            capture_output=True,
            text=True,
        )
        if built.returncode != 0:
            logger.warning("cannot build %s: %s", source.name, built.stderr.strip()[-2000:])
            return None
        partial.replace(path)  # atomic: concurrent builders each leave a whole file
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:  # e.g. a cache on a noexec mount
        logger.warning("cannot load %s from %s: %s", source.name, path.parent, error)
        return None
    for name, argtypes in signatures.items():
        function = getattr(library, name)
        function.restype = None
        function.argtypes = list(argtypes)
    return library
