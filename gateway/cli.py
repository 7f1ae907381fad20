"""`llmpool gateway`: serve one OpenAI endpoint for the LLMPools of the watched namespaces."""

from __future__ import annotations

import argparse
import logging
import os
import socket

import uvicorn

from llmpool.fleet_key import FleetKey
from llmpool.gateway import routing
from llmpool.gateway.app import MIB, GatewaySettings, build_app
from llmpool.gateway.demand import demand_recorder
from llmpool.gateway.pools import PoolTable
from llmpool.gateway.tenants import KeyRing
from llmpool.gateway.watch import TableWatcher, key_secrets, resources
from llmpool.operator.kube import load_credentials
from llmpool.protocol.http import MAX_BODY_BYTES

DEFAULT_PORT = 8080

# The gateway's limits and routing knobs: flag, type, default (GatewaySettings' own), help.
_TUNING: tuple[tuple[str, type, float, str], ...] = (
    ("--max-requests", int, GatewaySettings.max_requests, "requests in progress at once, gateway-wide; beyond, a 503 with Retry-After"),
    ("--max-buffered-body-mib", int, GatewaySettings.max_body_bytes // MIB, "request-body MiB held at once, gateway-wide, until each response begins; beyond, a 503 with Retry-After (at least 16: one body of the largest size)"),
    ("--prefix-chars", int, routing.DEFAULT_PREFIX_CHARS, "prompt characters hashed for prefix affinity"),
    ("--load-factor", float, routing.DEFAULT_LOAD_FACTOR, "a replica above this times the mean load loses its affinity traffic"),
    ("--hold-timeout", float, GatewaySettings.hold_timeout, "seconds a request waits for a pool without ready replicas before a 503"),
    ("--max-held", int, GatewaySettings.max_held, "requests held per pool at most while it has no ready replica; beyond, a 503"),
    ("--scrape-interval", float, GatewaySettings.scrape_interval, "seconds between scrapes of each replica's /metrics and /fingerprint"),
    ("--replicas", int, GatewaySettings.replicas, "gateway replicas behind the Service (the chart sets it): tenant limits hold per replica, so this many times a limit is exported as its effective bound"),
    ("--max-table-age", float, GatewaySettings.max_table_age, "seconds without word from the API server after which /ready is 503 (the routing table may no longer follow the pools)"),
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmpool gateway",
        description="One OpenAI endpoint for every LLMPool: routes by model, priority, prefix"
        " cache, load and drift.",
    )
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="a namespace whose pools to serve (repeat for more); none: every namespace",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("LLMPOOL_GATEWAY_API_KEY"),
        help="accept 'Authorization: Bearer KEY' for every watched pool [env"
        " LLMPOOL_GATEWAY_API_KEY]; without it and --api-key-namespace, anyone may call (open)",
    )
    parser.add_argument(
        "--api-key-namespace",
        help="accept the keys of the Secrets labelled llmpool.dev/api-key=true in this"
        " namespace, each for its tenant's scope and limits (watched: rotation needs no restart)",
    )
    parser.add_argument(
        "--no-record-demand",
        dest="record_demand",
        action="store_false",
        help="do not record held requests in the pool's LLMPoolDemand status for the operator's"
        " autoscaler; needs no patch permission on llmpooldemands/status",
    )
    for flag, kind, default, help in _TUNING:
        parser.add_argument(flag, type=kind, default=default, help=help)
    parser.add_argument("--log-level", default="info", help="debug, info, warning or error")
    return parser


def settings_from(args: argparse.Namespace) -> GatewaySettings:
    if args.prefix_chars < 1:
        raise ValueError(f"--prefix-chars must be at least 1, got {args.prefix_chars}")
    if args.load_factor < 1:
        raise ValueError(f"--load-factor must be at least 1.0, got {args.load_factor}")
    if args.hold_timeout < 0 or args.scrape_interval <= 0 or args.max_held < 0:
        raise ValueError("--hold-timeout and --max-held must be >= 0 and --scrape-interval > 0")
    if args.max_table_age <= 0:
        raise ValueError(f"--max-table-age must be positive, got {args.max_table_age}")
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if args.max_requests < 1:
        raise ValueError(f"--max-requests must be at least 1, got {args.max_requests}")
    if args.max_buffered_body_mib * MIB < MAX_BODY_BYTES:
        raise ValueError(
            f"--max-buffered-body-mib must be at least {MAX_BODY_BYTES // MIB} (one body of the"
            f" largest size), got {args.max_buffered_body_mib}"
        )
    return GatewaySettings(
        api_key=args.api_key,
        fleet_key=FleetKey.from_env(),
        max_requests=args.max_requests,
        max_body_bytes=args.max_buffered_body_mib * MIB,
        prefix_chars=args.prefix_chars,
        load_factor=args.load_factor,
        hold_timeout=args.hold_timeout,
        max_held=args.max_held,
        scrape_interval=args.scrape_interval,
        max_table_age=args.max_table_age,
        replicas=args.replicas,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logger = logging.getLogger("llmpool.gateway")
    try:
        settings = settings_from(args)
    except ValueError as error:
        logger.error("cannot start: %s", error)
        return 2
    load_credentials()
    table = PoolTable()
    watched = resources(args.namespace)
    keys = KeyRing(settings.api_key, from_secrets=args.api_key_namespace is not None)
    if args.api_key_namespace is not None:
        watched.append(key_secrets(args.api_key_namespace))
    logger.info(
        "callers: %s",
        "open (no API key)" if keys.open
        else f"tenants of namespace {args.api_key_namespace}" if args.api_key_namespace
        else "one API key",
    )  # fmt: skip
    watcher = TableWatcher(table, watched, keys)
    app = build_app(
        table,
        settings,
        background=[watcher.run],
        demand_writer=demand_recorder(socket.gethostname()) if args.record_demand else None,
        keys=keys,
    )
    # No access log: request lines are fine, but this gateway never logs anything of a body.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0
