"""`llmpool gateway` flags: defaults, the environment's API key, and bad values refused by name."""

from __future__ import annotations

import pytest

from llmpool import cli
from llmpool.gateway import cli as gateway_cli
from llmpool.gateway import routing


def test_the_console_script_has_the_subcommand() -> None:
    assert cli.SUBCOMMANDS["gateway"][0] == "llmpool.gateway.cli"


def test_defaults_and_the_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMPOOL_GATEWAY_API_KEY", "s3cret")
    monkeypatch.delenv("LLMPOOL_FLEET_KEY_FILE", raising=False)
    args = gateway_cli.build_parser().parse_args(["--namespace", "a", "--namespace", "b"])
    settings = gateway_cli.settings_from(args)
    assert (args.port, args.namespace) == (8080, ["a", "b"])
    assert settings.api_key == "s3cret"
    assert settings.prefix_chars == routing.DEFAULT_PREFIX_CHARS
    assert settings.load_factor == routing.DEFAULT_LOAD_FACTOR
    assert (settings.max_requests, settings.max_body_bytes) == (1024, 128 * 1024 * 1024)
    assert settings.fleet_key.path is None  # no LLMPOOL_FLEET_KEY_FILE: open engines


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--load-factor", "0.5"], "--load-factor"),
        (["--prefix-chars", "0"], "--prefix-chars"),
        (["--scrape-interval", "0"], "--scrape-interval"),
        (["--max-table-age", "0"], "--max-table-age"),
        (["--max-requests", "0"], "--max-requests"),
        (["--replicas", "0"], "--replicas"),
        (["--max-buffered-body-mib", "8"], "--max-buffered-body-mib"),
    ],
)
def test_bad_values_exit_2_naming_the_flag(
    flags: list[str], named: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert gateway_cli.main(flags) == 2
    assert named in caplog.text
