"""`llmpool digest`: the revision an LLMPool pins is the one the engine checks."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig

from llmpool.digest import main
from llmpool.engine import model_source
from llmpool.engine.lora.adapter import random_adapter
from llmpool.engine.models.llama import LlamaShape


def test_digest_of_an_adapter_and_a_model_folder(
    builtin_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shape = LlamaShape.from_hf_config(AutoConfig.from_pretrained(builtin_folder))
    adapter = random_adapter(tmp_path / "a", shape, ["q_proj"], rank=4, alpha=8, seed=0)
    assert main([str(tmp_path / "a"), str(builtin_folder)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{adapter}  {tmp_path / 'a'}"
    assert lines[1].split()[0] == model_source.resolve(str(builtin_folder)).revision
    assert main([str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err
