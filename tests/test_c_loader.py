"""The one loader of the engine's C kernels: what names a build, and kernels without a build."""

from __future__ import annotations

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
