"""The one loader of the engine's C kernels: built with the machine's C compiler the first time
they are needed, then loaded with ctypes.

Each kernel is one C source file in this package, described by a :class:`CKernel`. It is
compiled with instruction-set flags read from /proc/cpuinfo (never ``-march=native``, which
fails on some VMs) and cached under ``LLMPOOL_KERNEL_CACHE`` (default:
``$TMPDIR/llmpool-kernels-<uid>``, the pod's writable /tmp), keyed by everything that changes
the binary: the source, the flags, the compiler and its version, and the CPU's features.
Without a compiler, or where the cache cannot hold code (a ``noexec`` mount), the kernel is
unavailable and the caller keeps its torch path. Kernels parallelize with OpenMP: torch loads
libgomp under the same soname, so they share torch's thread teams and its thread count.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from llmpool.engine.cpu_features import cpu_flags

logger = logging.getLogger(__name__)

AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
AVX2_FLAGS = frozenset({"avx2", "fma", "f16c", "bmi2"})
AVX512_BUILD = ["-march=x86-64-v4", "-mprefer-vector-width=512"]
AVX2_BUILD = ["-march=x86-64-v3"]
BASE_FLAGS = ["-O3", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]


def arch_flags() -> list[str]:
    """The widest x86-64 level this CPU has; none (portable code) elsewhere."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_flags()
    if flags >= AVX512_FLAGS:
        return AVX512_BUILD
    if flags >= AVX2_FLAGS:
        return AVX2_BUILD
    return []


def _compiler() -> str | None:
    return shutil.which("gcc") or shutil.which("cc")


@functools.cache
def _compiler_version(compiler: str) -> str:
    """The compiler's own description of itself (``gcc --version``'s first line)."""
    try:
        described = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    except OSError:
        return ""
    return described.stdout.partition("\n")[0]


def _cache_dir() -> Path:
    default = Path(tempfile.gettempdir()) / f"llmpool-kernels-{os.getuid()}"
    return Path(os.environ.get("LLMPOOL_KERNEL_CACHE", default))


def cache_key(source: bytes, flags: Sequence[str], compiler: str, cpu: frozenset[str]) -> str:
    """What names a build in the cache: a change to any input that changes the binary (the
    source, the flags, the compiler or its version, the CPU's features) is a new build."""
    parts = [
        source,
        " ".join(flags).encode(),
        compiler.encode(),
        _compiler_version(compiler).encode(),
    ]
    parts.append(" ".join(sorted(cpu)).encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


class DeclaredLibrary(ctypes.CDLL):
    """A kernel library whose symbols are only those its signatures declare.

    ctypes calls an undeclared symbol anyway, converting every Python int to a 32-bit C int: a
    pointer passed so is cut in half and the call crashes the process. Here it is an
    AttributeError instead (declared symbols are set up when the library loads)."""

    declared: frozenset[str] = frozenset()

    def __getattr__(self, name: str) -> ctypes._NamedFuncPointer:
        if not name.startswith("__") and name not in self.declared:
            raise AttributeError(f"{name} is not among the symbols declared for {self._name}")
        return super().__getattr__(name)


def included_headers(text: bytes) -> list[str]:
    """The headers a kernel's source includes from its own folder (``#include "name.h"``), in
    order."""
    return [name.decode() for name in re.findall(rb'^#include "([^"]+)"', text, flags=re.MULTILINE)]


def source_bytes(source: Path) -> bytes:
    """``source`` and each header it includes from its own folder, in order: what a build
    compiles, so a change to a shared header is a new build."""
    text = source.read_bytes()
    headers = included_headers(text)
    return b"\0".join([text, *((source.parent / name).read_bytes() for name in headers)])


def build(
    source: Path, arch: Sequence[str], signatures: Mapping[str, Sequence[type]]
) -> ctypes.CDLL | None:
    """Build ``source`` (once per :func:`cache_key`) and load it with ``signatures`` (symbol ->
    argument types; every kernel returns void); None where that fails (logged)."""
    compiler = _compiler()
    if compiler is None:
        return None
    flags = [*BASE_FLAGS, *arch]
    key = cache_key(source_bytes(source), flags, compiler, cpu_flags())
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
        library = DeclaredLibrary(str(path))
    except OSError as error:  # e.g. a cache on a noexec mount
        logger.warning("cannot load %s from %s: %s", source.name, path.parent, error)
        return None
    library.declared = frozenset(signatures)
    for name, argtypes in signatures.items():
        function = getattr(library, name)
        function.restype = None
        function.argtypes = list(argtypes)
    return library


class CKernel:
    """One C source of this package and its symbols, built and loaded once per process.

    ``arch`` gives the build flags for this CPU, or None where the kernel has no build for it
    (the AVX-512-only kernels). The loaded library is kept: a process loads a ``.so`` once.
    """

    def __init__(
        self,
        source_name: str,
        signatures: Mapping[str, Sequence[type]],
        arch: Callable[[], list[str] | None] = arch_flags,
    ) -> None:
        self.source = Path(__file__).with_name(source_name)
        self.signatures = signatures
        self.arch = arch
        self._library: ctypes.CDLL | None = None
        self._tried = False

    def build(self, arch: Sequence[str]) -> ctypes.CDLL | None:
        """A fresh build with ``arch`` (``[]``: the portable build), not kept."""
        return build(self.source, arch, self.signatures)

    def narrower_build(self, arch: Sequence[str] | None) -> ctypes.CDLL | None:
        """A fresh build with ``arch``, a build this CPU runs that leaves out some of its own
        build's paths, so that tests and benchmarks check and time those here too; None where
        ``arch`` is None (the CPU cannot run it) or is this CPU's build already."""
        if arch is None or list(arch) == self.arch():
            return None
        return self.build(arch)

    def library(self) -> ctypes.CDLL | None:
        """The kernel built for this CPU, or None where it cannot be."""
        if not self._tried:
            arch = self.arch()
            self._library = None if arch is None else self.build(arch)
            self._tried = True
        return self._library

    @property
    def available(self) -> bool:
        return self.library() is not None

    def built(self) -> ctypes.CDLL:
        """The library, for callers that were told it is available."""
        library = self.library()
        if library is None:
            raise RuntimeError(f"the C kernel {self.source.name} is not built")
        return library


def avx512_only() -> list[str] | None:
    """:attr:`CKernel.arch` of kernels written for AVX-512 alone."""
    return AVX512_BUILD if arch_flags() == AVX512_BUILD else None


def with_avx512_bf16(build: list[str] | None) -> list[str] | None:
    """An AVX-512 ``build`` (``AVX512_BUILD``, with or without more extensions) with AVX-512
    BF16's instructions (``vdpbf16ps``) where the CPU has them (x86-64-v4 does not include them);
    any other build as it is."""
    if (
        build is not None
        and build[: len(AVX512_BUILD)] == AVX512_BUILD
        and "avx512_bf16" in cpu_flags()
    ):
        return [*build, "-mavx512bf16"]
    return build


def with_amx(build: list[str] | None) -> list[str] | None:
    """An AVX-512 BF16 ``build`` with AMX's bfloat16 tiles (``tdpbf16ps``) where the CPU has
    them; any other build as it is. Whether the kernel may use them is asked of Linux at run
    time (``arch_prctl``), so a build with them still runs where that is refused."""
    amx = {"amx_tile", "amx_bf16"}
    if build is not None and "-mavx512bf16" in build and amx <= cpu_flags():
        return [*build, "-mamx-tile", "-mamx-bf16"]
    return build


def avx2_or_wider() -> list[str] | None:
    """:attr:`CKernel.arch` of kernels written for AVX2: this CPU's widest level (AVX-512 CPUs
    have AVX2 too), None where it has no AVX2."""
    return arch_flags() or None
