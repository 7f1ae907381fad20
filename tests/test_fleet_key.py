import os

import pytest

from llmpool.fleet_key import FleetKey, pool_engine_key


def test_keys_differ_per_pool_and_fleet():
    key = pool_engine_key(b"fleet", "team-a", "chat")
    assert key.startswith("llmpool-") and len(key) == len("llmpool-") + 64
    assert key == pool_engine_key(b"fleet", "team-a", "chat")
    assert key != pool_engine_key(b"fleet", "team-b", "chat")
    assert key != pool_engine_key(b"fleet", "team-a", "chat2")
    assert key != pool_engine_key(b"other", "team-a", "chat")
    # "namespace/pool" is unambiguous: names cannot contain "/".
    assert pool_engine_key(b"fleet", "a", "b-c") != pool_engine_key(b"fleet", "a-b", "c")


def test_open_mode_has_no_key():
    assert FleetKey(None).engine_key("ns", "pool") is None


def test_file_is_reread_when_rotated(tmp_path):
    path = tmp_path / "fleet-key"
    path.write_text("first\n")
    fleet = FleetKey(path)
    first = fleet.engine_key("ns", "pool")
    assert first == pool_engine_key(b"first", "ns", "pool")
    replacement = tmp_path / "new"
    replacement.write_text("second")
    os.replace(replacement, path)  # how the kubelet swaps a Secret volume's files
    assert fleet.engine_key("ns", "pool") == pool_engine_key(b"second", "ns", "pool")


def test_missing_or_empty_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        FleetKey(tmp_path / "absent").current()
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        FleetKey(tmp_path / "empty").current()
