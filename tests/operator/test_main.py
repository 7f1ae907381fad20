"""`llmpool operator` flags."""

from __future__ import annotations

import pytest

from llmpool.operator.main import build_parser


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
    }
