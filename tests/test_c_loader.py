"""The one loader of the engine's C kernels: what names a build, and kernels without a build."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from llmpool.engine.kernels import c_loader
from llmpool.engine.kernels.c_loader import CKernel, cache_key


def test_the_cache_key_follows_everything_that_changes_the_binary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(c_loader, "_compiler_version", lambda compiler: f"{compiler} 13.2")
    avx2 = frozenset({"avx2", "fma"})
    key = cache_key(b"void f(void) {}", ["-O3"], "gcc", avx2)
    assert key == cache_key(b"void f(void) {}", ["-O3"], "gcc", avx2)
    others = {
        cache_key(b"void g(void) {}", ["-O3"], "gcc", avx2),
        cache_key(b"void f(void) {}", ["-O2"], "gcc", avx2),
        cache_key(b"void f(void) {}", ["-O3"], "cc", avx2),
        cache_key(b"void f(void) {}", ["-O3"], "gcc", avx2 | {"avx512f"}),
    }
    monkeypatch.setattr(c_loader, "_compiler_version", lambda compiler: f"{compiler} 14.1")
    others.add(cache_key(b"void f(void) {}", ["-O3"], "gcc", avx2))
    assert key not in others and len(others) == 5


def test_a_kernel_without_a_build_for_this_cpu_is_unavailable_and_never_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(c_loader, "build", pytest.fail)
    kernel = CKernel("cpu_decode.c", {}, lambda: None)
    assert not kernel.available
    with pytest.raises(RuntimeError, match="cpu_decode.c is not built"):
        kernel.built()


def test_only_declared_symbols_are_callable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An undeclared symbol would be called with 32-bit ints for pointers: refused instead."""
    monkeypatch.setenv("LLMPOOL_KERNEL_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "two.c"
    source.write_text(
        "#include <stdint.h>\n"
        "void fill(int64_t *out, int64_t n) { for (int64_t i = 0; i < n; i++) out[i] = i; }\n"
        "void undeclared(int64_t *out) { out[0] = 1; }\n"
    )
    library = c_loader.build(source, [], {"fill": [ctypes.c_void_p, ctypes.c_int64]})
    if library is None:
        pytest.skip("no C compiler here")
    out = (ctypes.c_int64 * 3)()
    library.fill(ctypes.addressof(out), 3)
    assert list(out) == [0, 1, 2]
    with pytest.raises(AttributeError, match="undeclared is not among the symbols declared"):
        library.undeclared  # noqa: B018


def test_a_change_to_an_included_header_is_a_new_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kernels share headers from their folder: editing one must not load a stale build."""
    monkeypatch.setenv("LLMPOOL_KERNEL_CACHE", str(tmp_path / "cache"))
    source, header = tmp_path / "uses.c", tmp_path / "value.h"
    source.write_text(
        '#include <stdint.h>\n#include "value.h"\nvoid value(int64_t *out) { out[0] = VALUE; }\n'
    )
    out = (ctypes.c_int64 * 1)()
    for expected in (1, 2):
        header.write_text(f"#define VALUE {expected}\n")
        library = c_loader.build(source, [], {"value": [ctypes.c_void_p]})
        if library is None:
            pytest.skip("no C compiler here")
        library.value(ctypes.addressof(out))
        assert out[0] == expected
    assert len(list((tmp_path / "cache").glob("uses-*.so"))) == 2
