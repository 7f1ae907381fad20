"""`llmpool operator`: run the LLMPool operator (kopf) against the current cluster."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random

import kopf

DEFAULT_PEERING_NAME = "llmpool-operator"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmpool operator",
        description=(
            "Reconcile LLMPool resources into pinned engine Deployments and check every "
            "replica's fingerprint. Credentials: the in-cluster service account, else kubeconfig."
        ),
    )
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        dest="namespaces",
        metavar="NAMESPACE",
        help="serve pools in this namespace (repeat for several); needs a Role in each",
    )
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="serve pools in every namespace"
    )
    parser.add_argument(
        "--engine-image",
        default=os.environ.get("LLMPOOL_ENGINE_IMAGE", "llmpool:latest"),
        help="engine image for pools that name none (env LLMPOOL_ENGINE_IMAGE)",
    )
    parser.add_argument(
        "--liveness-port",
        type=int,
        default=8080,
        help="serve GET /healthz on this port (0: off)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=9090,
        help="serve Prometheus metrics on this port (0: off)",
    )
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument(
        "--peering",
        default=DEFAULT_PEERING_NAME,
        metavar="NAME",
        help=(
            "kopf peering object shared by the operator's replicas: only the one with the "
            "highest --priority acts, the others wait (needs crds/kopf-peering.yaml; without "
            "those CRDs the operator runs alone)"
        ),
    )
    peering.add_argument(
        "--standalone", action="store_true", help="run without peering (a single replica)"
    )
    parser.add_argument(
        "--no-create-peering",
        action="store_true",
        help=(
            "the peering object is managed elsewhere (the Helm chart owns it): do not create it;"
            " kopf keeps touching it and starts peering once it exists"
        ),
    )
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority; default: random, so that exactly one replica acts",
    )
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("-v", "--verbose", action="store_true")
    verbosity.add_argument("--debug", action="store_true")
    verbosity.add_argument("-q", "--quiet", action="store_true")
    return parser


class TimerSuccessFilter(logging.Filter):
    """Drop kopf's "Timer 'observe' succeeded." line: it would repeat every few seconds."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timer 'observe' succeeded")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from llmpool.operator import handlers  # noqa: F401  (registers the handlers with kopf)

    kopf.configure(verbose=args.verbose, debug=args.debug, quiet=args.quiet)
    if not args.debug:
        logging.getLogger("kopf.objects").addFilter(TimerSuccessFilter())
    settings = kopf.OperatorSettings()
    # Named but not mandatory: without the peering CRDs kopf falls back to running alone.
    settings.peering.name = args.peering
    settings.peering.priority = (
        args.priority if args.priority is not None else random.SystemRandom().randint(1, 2**31 - 1)
    )
    memo = kopf.Memo(
        engine_image=args.engine_image,
        metrics_port=args.metrics_port,
        peering_to_create=None if args.standalone or args.no_create_peering else args.peering,
        namespaces=args.namespaces or [],
    )
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    asyncio.run(
        kopf.operator(
            settings=settings,
            clusterwide=args.all_namespaces,
            namespaces=args.namespaces or [],
            standalone=args.standalone,
            liveness_endpoint=liveness,
            memo=memo,
        )
    )
    return 0
