"""Revision pins: the engine refuses files that are not the pinned revision."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmpool.engine import model_source

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_folder(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model.safetensors").write_bytes(b"weights")
    (root / "tokenizer.json").write_text("{}")
    return root


def test_content_digest_pin(tmp_path: Path) -> None:
    resolved = model_source.resolve(str(make_folder(tmp_path / "m")))
    model_source.verify_revision(resolved, resolved.revision)
    model_source.verify_revision(resolved, None)
    (resolved.folder / "model.safetensors").write_bytes(b"other weights")
    changed = model_source.resolve(str(resolved.folder))
    with pytest.raises(model_source.RevisionMismatchError, match="RevisionMismatch: .* was pinned"):
        model_source.verify_revision(changed, resolved.revision)


def test_commit_pin_names_the_snapshot(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "models--org--name" / "snapshots" / COMMIT)
    model_source.verify_revision(model_source.resolve(f"file://{folder}"), COMMIT)
    with pytest.raises(model_source.RevisionMismatchError, match=COMMIT[::-1]):
        model_source.verify_revision(model_source.resolve(str(folder)), COMMIT[::-1])
    plain = model_source.resolve(str(make_folder(tmp_path / "plain")))
    with pytest.raises(model_source.RevisionMismatchError, match="no snapshot commit"):
        model_source.verify_revision(plain, COMMIT)


def test_builtin_revision_is_the_gguf_digest() -> None:
    resolved = model_source.resolve(None)
    assert resolved.revision == model_source.file_digest(model_source.builtin_model.gguf_path())
    with pytest.raises(model_source.RevisionMismatchError):
        model_source.verify_revision(resolved, "sha256:" + "0" * 64)
