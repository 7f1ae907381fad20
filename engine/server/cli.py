"""`llmpool serve [MODEL]`: vLLM-named flags (each also an LLMPOOL_* variable), load, serve, drain."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import shlex
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from llmpool import names, pinning
from llmpool.engine.config import QUANTIZATIONS, EngineConfig
from llmpool.engine.engine_core import EngineCore
from llmpool.engine.lora.adapter import AdapterError
from llmpool.engine.model_source import ADAPTER_FILES, RevisionMismatchError, adapter_digest
from llmpool.engine.server.app import ServerSettings, build_app
from llmpool.engine.server.response_store import StoreLimits
from llmpool.engine.server.tool_calls import TOOL_CALL_PARSERS
from llmpool.protocol.limits import DEFAULT_MAX_RESPONSE_TOKENS, STREAMED_RESPONSE_FACTOR

logger = logging.getLogger("llmpool.serve")

EXIT_BAD_ARGUMENTS = 2
EXIT_REVISION_MISMATCH = 3
TERMINATION_LOG = "/dev/termination-log"  # where Kubernetes reads a container's last words
# After the drain, how long uvicorn waits for the last responses to be written.
RESPONSE_FLUSH_SECONDS = 5.0
# ServerSettings fields that are the flags of the same name.
SETTINGS_FLAGS = (
    "api_key",
    "max_queue",
    "stats_interval",
    "tool_call_parser",
    "max_response_tokens",
)

# Engine settings that only some engine builds have: passed on when EngineConfig has the field,
# otherwise only their defaults are accepted. (flag dest -> default)
OPTIONAL_ENGINE_SETTINGS: dict[str, Any] = {
    "enable_prefix_caching": True,
    "quantization": "none",
    "kv_cache_dtype": "auto",
    "priority_class": "interactive",
    "max_request_priority": None,
    "compile": False,
    "compile_cache_dir": None,
    "speculative_config": None,
}


def _env_name(dest: str) -> str:
    return "LLMPOOL_" + dest.upper()


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class _Flags:
    """Adds flags whose default comes from ``LLMPOOL_<NAME>`` when that variable is set."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def add(self, flag: str, help: str, **kwargs: Any) -> None:
        dest = flag.lstrip("-").replace("-", "_")
        env = _env_name(dest)
        if env in os.environ:
            value = os.environ[env]
            # argparse converts string defaults with `type`; boolean actions have no type.
            is_bool = kwargs.get("action") is argparse.BooleanOptionalAction
            kwargs["default"] = _parse_bool(value) if is_bool else value
        self.parser.add_argument(flag, help=f"{help} [env {env}]", **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmpool serve",
        description="Serve a model over an OpenAI-compatible HTTP API.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "model",
        nargs="?",
        default=os.environ.get(_env_name("model")),
        help="model folder (Hugging Face format) or builtin://smollm2-135m-instruct;"
        f" default: the built-in model [env {_env_name('model')}]",
    )
    flags = _Flags(parser)
    flags.add("--host", "address to listen on", default="0.0.0.0")
    flags.add("--port", "port to listen on", type=int, default=8000)
    flags.add("--revision", "pinned content digest (sha256:...); refuse other files", default=None)
    flags.add(
        "--served-model-name", "the model name clients use; default: from the source", default=None
    )
    flags.add(
        "--dtype",
        "auto, float32, bfloat16 or float16; auto: bfloat16 on CUDA and on CPUs with native"
        " bfloat16 (avx512_bf16 or amx_bf16 in /proc/cpuinfo), float32 on other CPUs",
        default="auto",
    )
    flags.add("--device", "auto, cpu or cuda[:N]", default="auto")
    flags.add("--max-model-len", "context length; default: the model's", type=int, default=None)
    flags.add("--max-num-seqs", "most sequences in one batch", type=int, default=128)
    flags.add("--max-num-batched-tokens", "token budget of one step", type=int, default=2048)
    flags.add("--block-size", "tokens per KV-cache block", type=int, default=16)
    flags.add(
        "--kv-cache-memory",
        "bytes for the KV cache (e.g. 2GiB); default: from the device",
        default=None,
    )
    flags.add("--gpu-memory-utilization", "fraction of GPU memory to use", type=float, default=0.9)
    flags.add(
        "--chat-template", "file with a Jinja chat template; default: the model's", default=None
    )
    flags.add(
        "--tool-call-parser",
        "how tool calls are read from the model's text under tool_choice auto: hermes"
        " (<tool_call>), llama3_json or mistral ([TOOL_CALLS]); default: from the chat template",
        choices=list(TOOL_CALL_PARSERS), default=None,
    )  # fmt: skip
    flags.add("--api-key", "require `Authorization: Bearer KEY` on /v1 routes", default=None)
    flags.add(
        "--max-queue", "waiting requests beyond which new ones get 429", type=int, default=1000
    )
    flags.add(
        "--enable-prefix-caching", "share KV blocks of identical prompt prefixes",
        action=argparse.BooleanOptionalAction, default=True,
    )  # fmt: skip
    flags.add(
        "--quantization",
        "weight-only quantization: none, int8 (per output channel) or int4 (groups of 32)",
        choices=list(QUANTIZATIONS), default="none",
    )  # fmt: skip
    flags.add(
        "--kv-cache-dtype", "KV-cache dtype: auto (the model's) or fp8 (e4m3)",
        choices=["auto", "fp8"], default="auto",
    )  # fmt: skip
    flags.add(
        "--compile",
        "compile the decoder with inductor (CPU, needs g++): fused per-layer ops, every batch"
        " size compiled in the background while the engine serves eager, then switched to",
        action=argparse.BooleanOptionalAction, default=False,
    )  # fmt: skip
    flags.add(
        "--compile-cache-dir",
        "where --compile keeps its artifacts between starts (one entry per model, settings,"
        " torch and CPU) and the GEMM choice they were compiled for; '' or none keeps none;"
        " default: $XDG_CACHE_HOME/llmpool/compile, else ~/.cache/llmpool/compile",
        default=None,
    )
    flags.add(
        "--gemm-probe-patience",
        "seconds the start-up GEMM probes (on CPU) may wait for other processes to leave the"
        " CPUs before the least disturbed run's choice stands; 0: one run; default: 15",
        type=float, default=None,
    )  # fmt: skip
    flags.add(
        "--speculative-config",
        'speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens":'
        ' 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1, "disable_by_batch_size":'
        " N} (drafts looked up in the request's own tokens; outputs unchanged); default: off",
        default=None,
    )
    flags.add(
        "--grammar-compile-fuel",
        "llguidance's lexer fuel for compiling one output grammar (1M is ~20 ms); a grammar"
        " needing more is refused with 400",
        type=int, default=1_000_000,
    )  # fmt: skip
    flags.add(
        "--grammar-step-budget-ms",
        "how long a step waits for a row's grammar mask, from when it started; a row not ready"
        " skips the step (the others go on) and is sampled in a later one",
        type=float, default=20.0,
    )  # fmt: skip
    flags.add(
        "--grammar-request-budget-s",
        "mask time one request's grammar may spend in all; beyond it the request ends with 400"
        " grammar_budget_exceeded (an error event on a stream)",
        type=float, default=5.0,
    )  # fmt: skip
    flags.add(
        "--priority-class",
        "interactive or batch",
        choices=["interactive", "batch"],
        default="interactive",
    )
    flags.add(
        "--max-request-priority",
        "the most urgent class a request may ask for (interactive or batch); a request's"
        " `priority` beyond it is refused with 400; default: --priority-class",
        choices=["interactive", "batch"],
        default=None,
    )
    flags.add(
        "--max-response-tokens",
        "most token entries one response not streamed may hold: n choices x max_tokens x (1 +"
        " top logprobs), over its prompts; streamed ones may hold"
        f" {STREAMED_RESPONSE_FACTOR}x as many; beyond it a request is refused with 400",
        type=int, default=DEFAULT_MAX_RESPONSE_TOKENS,
    )  # fmt: skip
    store = StoreLimits()
    flags.add(
        "--response-store-max-count",
        "responses kept for previous_response_id and GET /v1/responses/{id} on this replica;"
        " past it the oldest go; 0 keeps none",
        type=int, default=store.max_count,
    )  # fmt: skip
    flags.add(
        "--response-store-max-bytes",
        "bytes of JSON the kept responses and their conversations may hold on this replica",
        type=int, default=store.max_bytes,
    )  # fmt: skip
    flags.add(
        "--response-store-max-age",
        "seconds a kept response lives", type=float, default=store.max_age_s,
    )  # fmt: skip
    flags.add(
        "--response-store-per-key",
        "responses one API key (one gateway tenant) may have kept on this replica",
        type=int, default=store.max_per_owner,
    )  # fmt: skip
    flags.add(
        "--replica-name",
        "this replica's name in the ids of its stored responses, by which the gateway finds it;"
        " default: the host name (the pod's name)",
        default=None,
    )
    flags.add(
        "--stats-interval", "seconds between engine stats log lines", type=float, default=10.0
    )
    flags.add(
        "--shutdown-timeout",
        "seconds to let requests in flight finish after SIGTERM (the drain; new requests get a"
        " retryable 503 meanwhile); streams still open then end with an error event",
        type=float,
        default=30.0,
    )
    flags.add(
        "--access-log", "log one line per HTTP request (never bodies)",
        action=argparse.BooleanOptionalAction, default=True,
    )  # fmt: skip
    flags.add("--log-level", "debug, info, warning or error", default="info")
    flags.add(
        "--enable-lora", "serve LoRA adapters beside the base model (`model` names one)",
        action=argparse.BooleanOptionalAction, default=False,
    )  # fmt: skip
    flags.add("--max-loras", "adapters resident at once (LoRA slots)", type=int, default=1)
    flags.add("--max-lora-rank", "the largest adapter rank a slot holds", type=int, default=16)
    flags.add(
        "--lora-modules",
        "adapters loaded at start: name=path, or JSON {\"name\", \"path\", \"revision\"}"
        " (revision: sha256:... of the adapter's files, refused if they differ); needs"
        " --enable-lora; the variable holds them separated by spaces",
        nargs="+", default=None,
    )  # fmt: skip
    return parser


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the flags; optional settings this engine lacks must keep their default."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    optional = {}
    for name, default in OPTIONAL_ENGINE_SETTINGS.items():
        value = getattr(args, name)
        if name in fields:
            optional[name] = value
        elif value != default:
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"{flag} {value} is not supported by this engine build (only {default})"
            )
    if args.served_model_name is not None:
        names.check_name(args.served_model_name, "--served-model-name")
    return EngineConfig(
        model=args.model,
        revision=args.revision,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        gemm_probe_patience_s=args.gemm_probe_patience,
        grammar_compile_fuel=args.grammar_compile_fuel,
        grammar_step_budget_ms=args.grammar_step_budget_ms,
        grammar_request_budget_s=args.grammar_request_budget_s,
        **optional,
    )


@dataclasses.dataclass(frozen=True)
class LoraModule:
    name: str
    path: str
    revision: str | None = None


def lora_modules(args: argparse.Namespace) -> list[LoraModule]:
    """``--lora-modules`` as vLLM takes them: ``name=path`` or a JSON object per entry (vLLM's
    ``base_model_name`` key is accepted and ignored: the served model is the base)."""
    entries = args.lora_modules or []
    if isinstance(entries, str):  # from LLMPOOL_LORA_MODULES
        entries = shlex.split(entries)
    if entries and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    modules = [_lora_module(entry) for entry in entries]
    for module in modules:
        names.check_name(module.name, "--lora-modules: name")
    adapter_names = [module.name for module in modules]
    if len({names.normalize(name) for name in adapter_names}) != len(adapter_names):
        raise ValueError(f"--lora-modules names an adapter twice (in any case): {adapter_names}")
    return modules


def _lora_module(entry: str) -> LoraModule:
    if not entry.lstrip().startswith("{"):
        named, equals, folder = entry.partition("=")
        if not equals or not named or not folder:
            raise ValueError(f"--lora-modules: expected name=path or JSON, got {entry!r}")
        return LoraModule(named, folder)
    try:
        document = json.loads(entry)
    except json.JSONDecodeError as error:
        raise ValueError(f"--lora-modules: {entry!r} is not JSON ({error})") from None
    known = {"name", "path", "revision", "base_model_name"}
    if not isinstance(document, dict) or not known >= set(document):
        raise ValueError(f"--lora-modules: {entry!r} may only have the keys {sorted(known)}")
    name, path, revision = document.get("name"), document.get("path"), document.get("revision")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise ValueError(f"--lora-modules: {entry!r} needs a name and a path")
    if revision is not None and not isinstance(revision, str):
        raise ValueError(f"--lora-modules: {entry!r} has a revision that is not a string")
    return LoraModule(name, path, revision)


def _write_termination_log(message: str) -> None:
    """Kubernetes mounts this file; elsewhere it does not exist and nothing is written."""
    path = Path(os.environ.get("LLMPOOL_TERMINATION_LOG", TERMINATION_LOG))
    if path.is_file() and os.access(path, os.W_OK):
        path.write_text(message + "\n")


def _keep_exit_status_zero() -> None:
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, with the handlers that were
    installed before it started; these make that re-raise harmless, so a drained server exits 0."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM or SIGINT drains the app before uvicorn's own
    shutdown: the port stays open meanwhile, so a late request is answered with a retryable 503
    rather than refused by a closed socket. A second signal exits as uvicorn does."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._draining: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining is not None or not self.started:
            super().handle_exit(sig, frame)
            return
        loop = asyncio.get_running_loop()
        loop.call_soon_threadsafe(self._start_drain, loop)

    def _start_drain(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._draining is None:
            self._draining = loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        finally:
            self.should_exit = True


def check_pinned_adapters(modules: list[LoraModule]) -> None:
    """Refuse pinned adapters whose files differ before the model loads, so that a wrong pin
    stops the start in a second rather than after the load (the load checks again; missing
    files are left to it, which names them)."""
    for module in modules:
        folder = Path(module.path)
        if module.revision is None or not all((folder / f).is_file() for f in ADAPTER_FILES):
            continue
        digest = adapter_digest(folder)
        if digest != module.revision:
            raise AdapterError(
                "revision_mismatch",
                f"adapter {module.name!r}: the files at {module.path} are {digest}, not the"
                f" pinned {module.revision}",
                digest,
            )


def _load_engine(
    config: EngineConfig, modules: list[LoraModule], served_name: str | None
) -> tuple[EngineCore, str]:
    """The core with its ``--lora-modules`` loaded, and the served model name.

    Loads in a thread that ends before the engine thread starts, so that the OpenMP worker
    threads the load spawned end with it and the engine thread's team is the process's only one
    (see ``async_engine``)."""

    def load() -> tuple[EngineCore, str]:
        core = EngineCore(config)
        name = served_name or pinning.default_served_name(core.resolved.source)
        for module in modules:
            if names.normalize(module.name) == names.normalize(name):
                raise AdapterError(
                    "invalid_adapter", f"--lora-modules: {module.name!r} is the served model's name"
                )
            core.load_adapter(module.name, module.path, module.revision)
            logger.info("LoRA adapter %s loaded from %s", module.name, module.path)
        return core, name

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-load") as loader:
        return loader.submit(load).result()


def _read_arguments(
    args: argparse.Namespace,
) -> tuple[EngineConfig, list[LoraModule], bytes | None]:
    """The engine's config, the ``--lora-modules`` and the ``--chat-template`` file's bytes; a
    ValueError or OSError names what is wrong."""
    config = engine_config(args)
    modules = lora_modules(args)
    chat_template = Path(args.chat_template).read_bytes() if args.chat_template else None
    if args.max_response_tokens < 1:
        raise ValueError(f"--max-response-tokens must be positive, got {args.max_response_tokens}")
    for flag in ("response_store_max_count", "response_store_max_bytes", "response_store_max_age",
                 "response_store_per_key"):  # fmt: skip
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be non-negative")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be non-negative, got {args.max_queue}")
    return config, modules, chat_template


def _start_engine(
    config: EngineConfig, modules: list[LoraModule], served_name: str | None
) -> tuple[EngineCore, str] | int:
    """The loaded core and the served model name, or the exit status of a start that failed
    (said in the termination log, which the operator reads)."""
    try:
        check_pinned_adapters(modules)
        return _load_engine(config, modules, served_name)
    except RevisionMismatchError as error:
        logger.error("%s", error)
        _write_termination_log(str(error))
        return EXIT_REVISION_MISMATCH
    except AdapterError as error:
        if error.code == "revision_mismatch":
            logger.error("RevisionMismatch: %s", error)
            _write_termination_log(f"RevisionMismatch: {error}")
            return EXIT_REVISION_MISMATCH
        logger.error("cannot start: %s", error)
        _write_termination_log(str(error))
        return EXIT_BAD_ARGUMENTS


def _serve(args: argparse.Namespace, core: EngineCore, settings: ServerSettings) -> int:
    """Serve until a signal has drained the app; 1 if the server never started (say, the port
    is taken)."""
    app = build_app(core, settings)
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            access_log=args.access_log,
            timeout_graceful_shutdown=RESPONSE_FLUSH_SECONDS,
        ),
        drain=lambda: app.state.server.drain(args.shutdown_timeout),
    )
    _keep_exit_status_zero()
    server.run()
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config, modules, chat_template = _read_arguments(args)
    except (ValueError, OSError) as error:
        logger.error("cannot start: %s", error)
        return EXIT_BAD_ARGUMENTS
    started = _start_engine(config, modules, args.served_model_name)
    if isinstance(started, int):
        return started
    core, served_model_name = started
    settings = ServerSettings(
        served_model_name=served_model_name,
        chat_template=chat_template,
        response_store=StoreLimits(
            args.response_store_max_count,
            args.response_store_max_bytes,
            args.response_store_max_age,
            args.response_store_per_key,
        ),  # fmt: skip
        **{flag: getattr(args, flag) for flag in SETTINGS_FLAGS},
        **({"replica_name": args.replica_name} if args.replica_name else {}),
    )
    return _serve(args, core, settings)


if __name__ == "__main__":
    sys.exit(main())
