"""Compiling the decoder: which sizes are compiled at start, and what is refused up front.

That the compiled decoder generates what transformers does, and compiles nothing after start,
is ``test_engine_vs_hf.py``'s "compiled" configuration.
"""

from __future__ import annotations

import pytest
import torch

from llmpool.engine import compilation


def test_sizes_cover_one_token_each_power_of_two_one_past_it_and_the_largest() -> None:
    assert compilation.compile_sizes(1) == [1]
    assert compilation.compile_sizes(10) == [1, 2, 3, 4, 5, 8, 9, 10]
    sizes = compilation.compile_sizes(2048)
    assert sizes[:5] == [1, 2, 3, 4, 5]
    assert {8, 9, 64, 65, 1024, 1025, 2048} <= set(sizes)
    assert max(sizes) == 2048


def test_compile_is_refused_off_cpu_and_without_a_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    compilation.check_can_compile(torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA graphs are not built yet"):
        compilation.check_can_compile(torch.device("cuda"))
    monkeypatch.setattr(compilation.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="C\\+\\+ compiler"):
        compilation.check_can_compile(torch.device("cpu"))
