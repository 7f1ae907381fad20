"""`llmpool operator`: run the LLMPool operator (kopf) against the current cluster."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random

import kopf

from llmpool.fleet_key import FleetKey
from llmpool.operator import admission

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
        "--allowed-image",
        action="append",
        dest="allowed_images",
        metavar="PREFIX",
        help=(
            "an engine image pools may name in spec.image: a repository (any tag or digest) or a "
            "prefix ending in '/'; repeat for several (env LLMPOOL_ALLOWED_IMAGES, "
            "comma-separated); default: the repository of --engine-image"
        ),
    )
    parser.add_argument(
        "--allow-host-path-models",
        action="store_true",
        default=os.environ.get("LLMPOOL_ALLOW_HOST_PATH_MODELS", "").lower() in ("1", "true"),
        help=(
            "let file:// model sources mount node paths under an --allowed-host-path-prefix "
            "(env LLMPOOL_ALLOW_HOST_PATH_MODELS=true); refused otherwise"
        ),
    )
    parser.add_argument(
        "--allowed-host-path-prefix",
        action="append",
        dest="allowed_host_path_prefixes",
        metavar="PATH",
        help=(
            "a node directory file:// sources may lie under; repeat for several (env "
            "LLMPOOL_ALLOWED_HOST_PATH_PREFIXES, comma-separated)"
        ),
    )
    parser.add_argument(
        "--max-drift-recreations",
        type=int,
        default=int(
            os.environ.get(
                "LLMPOOL_MAX_DRIFT_RECREATIONS", str(admission.DEFAULT_MAX_DRIFT_RECREATIONS)
            )
        ),
        metavar="N",
        help=(
            "policy Recreate deletes at most N drifted pods until a check finds the pool "
            "drift-free, then sets Degraded/DriftPersists (env LLMPOOL_MAX_DRIFT_RECREATIONS)"
        ),
    )
    parser.add_argument(
        "--engine-gemm-probe-patience",
        type=float,
        default=os.environ.get("LLMPOOL_ENGINE_GEMM_PROBE_PATIENCE"),
        metavar="SECONDS",
        help=(
            "every engine's --gemm-probe-patience: how long its start-up GEMM probes wait for "
            "quiet CPUs (0: one run, for nodes always busy); changing it rolls every pool; "
            "default: the engine's (env LLMPOOL_ENGINE_GEMM_PROBE_PATIENCE)"
        ),
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


def _env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def policy_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> admission.Policy:
    """The admission policy of the flags; contradictory flags end the program with a usage error."""
    # Flags replace the environment's lists (argparse would append to a list default).
    prefixes = tuple(
        args.allowed_host_path_prefixes or _env_list("LLMPOOL_ALLOWED_HOST_PATH_PREFIXES")
    )
    images = tuple(args.allowed_images or _env_list("LLMPOOL_ALLOWED_IMAGES"))
    if args.allow_host_path_models and not prefixes:
        parser.error("--allow-host-path-models needs at least one --allowed-host-path-prefix")
    relative = [prefix for prefix in prefixes if not prefix.startswith("/")]
    if relative:
        parser.error(f"--allowed-host-path-prefix must be absolute, got {', '.join(relative)}")
    patience = args.engine_gemm_probe_patience
    if patience is not None and patience < 0:
        parser.error(f"--engine-gemm-probe-patience must be 0 or more, got {patience}")
    if args.max_drift_recreations < 0:
        parser.error(f"--max-drift-recreations must be 0 or more, got {args.max_drift_recreations}")
    default = admission.Policy.default(args.engine_image)
    return admission.Policy(
        engine_image=args.engine_image,
        allowed_images=images or default.allowed_images,
        allow_host_path_models=args.allow_host_path_models,
        allowed_host_path_prefixes=prefixes,
        max_drift_recreations=args.max_drift_recreations,
        engine_gemm_probe_patience_s=patience,
    )


class TimerSuccessFilter(logging.Filter):
    """Drop kopf's "Timer 'observe' succeeded." line: it would repeat every few seconds."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timer 'observe' succeeded")


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    policy = policy_from_args(parser, args)
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
        policy=policy,
        metrics_port=args.metrics_port,
        peering_to_create=None if args.standalone or args.no_create_peering else args.peering,
        namespaces=args.namespaces or [],
        fleet_key=FleetKey.from_env(),
        # Shared by every object's memo (kopf copies this one shallowly): how a change of an
        # LLMPoolDemand finds its pool's lock and memo.
        pool_handles={},
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
