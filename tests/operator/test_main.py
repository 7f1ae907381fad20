"""`llmpool operator` flags."""

from __future__ import annotations

import pytest

from llmpool.operator.admission import Policy
from llmpool.operator.main import build_parser, policy_from_args


def test_namespaces_repeat():
    args = build_parser().parse_args(["-n", "a", "--namespace", "b"])
    assert args.namespaces == ["a", "b"] and not args.all_namespaces
    assert (args.liveness_port, args.metrics_port, args.peering) == (8080, 9090, "llmpool-operator")


def test_all_namespaces():
    args = build_parser().parse_args(["--all-namespaces", "--standalone", "--metrics-port", "0"])
    assert args.all_namespaces and args.standalone and args.metrics_port == 0


@pytest.mark.parametrize("argv", [[], ["-A", "-n", "x"], ["-A", "--standalone", "--peering", "p"]])
def test_invalid_combinations(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)


def test_the_cli_dispatches_here():
    from llmpool import cli

    assert cli.SUBCOMMANDS["operator"][0] == "llmpool.operator.main"


def test_handlers_register_with_kopf():
    import kopf

    from llmpool.operator import handlers

    registry = kopf.get_default_registry()
    ids = {h.id for h in registry._changing.get_all_handlers()}
    assert {"reconcile", "forget"} <= ids
    assert handlers.observe in {h.fn for h in registry._spawning.get_all_handlers()}
    assert {h.id for h in registry._indexing.get_all_handlers()} == {
        "engine_pods",
        "engine_deployments",
        "child_deployments",
        "child_services",
        "child_configmaps",
        "child_disruption_budgets",
        "child_secrets",
        "child_demands",
        "gateway_demands",
        "pools_by_served_name",
    }
    events = {h.id for h in registry._watching.get_all_handlers()}
    assert "demand_changed" in events


def policy(argv: list[str]) -> Policy:
    parser = build_parser()
    return policy_from_args(parser, parser.parse_args(["-A", *argv]))


def test_admission_defaults(monkeypatch):
    for name in ("LLMPOOL_ALLOWED_IMAGES", "LLMPOOL_ALLOWED_HOST_PATH_PREFIXES"):
        monkeypatch.delenv(name, raising=False)
    found = policy(["--engine-image", "ghcr.io/llmpool/llmpool:0.1.0"])
    assert found.allowed_images == ("ghcr.io/llmpool/llmpool",)
    assert not found.allow_host_path_models and found.allowed_host_path_prefixes == ()
    assert found.max_drift_recreations == 3
    assert found.engine_gemm_probe_patience_s is None


def test_admission_flags_and_environment(monkeypatch):
    monkeypatch.setenv("LLMPOOL_ALLOWED_IMAGES", "a/b, c/")
    assert policy([]).allowed_images == ("a/b", "c/")
    assert policy(["--allowed-image", "x/y"]).allowed_images == ("x/y",)  # flags replace env
    found = policy(
        [
            "--allow-host-path-models",
            "--allowed-host-path-prefix",
            "/models",
            "--max-drift-recreations",
            "1",
        ]
    )
    assert found.allow_host_path_models and found.allowed_host_path_prefixes == ("/models",)
    assert found.max_drift_recreations == 1
    monkeypatch.setenv("LLMPOOL_ENGINE_GEMM_PROBE_PATIENCE", "3")
    assert policy([]).engine_gemm_probe_patience_s == 3.0
    assert policy(["--engine-gemm-probe-patience", "0"]).engine_gemm_probe_patience_s == 0.0


@pytest.mark.parametrize(
    "argv",
    [
        ["--allow-host-path-models"],
        ["--allow-host-path-models", "--allowed-host-path-prefix", "models"],
        ["--max-drift-recreations", "-1"],
        ["--engine-gemm-probe-patience", "-1"],
    ],
)
def test_contradictory_admission_flags(argv, capsys):
    with pytest.raises(SystemExit):
        policy(argv)


async def test_every_watch_and_request_of_kopf_is_bounded(monkeypatch):
    import kopf

    from llmpool.operator import handlers, kube

    monkeypatch.setattr(kube, "load_credentials", lambda: None)
    settings = kopf.OperatorSettings()
    await handlers.configure(settings=settings, memo=kopf.Memo())
    watching = settings.watching
    assert watching.server_timeout and watching.client_timeout and watching.connect_timeout
    assert watching.client_timeout > watching.server_timeout  # the server ends a live watch first
    assert settings.networking.request_timeout and settings.networking.connect_timeout
