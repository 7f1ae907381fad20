"""The starlette app of an engine pod: OpenAI routes, health, readiness, metrics and fingerprint."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmpool import names
from llmpool.engine.admission import InvalidRequestError, PromptTooLongError
from llmpool.engine.engine_core import EngineCore
from llmpool.engine.lora.manager import UnknownAdapterError
from llmpool.engine.sampling_params import SamplingParams
from llmpool.engine.server.async_engine import (
    AsyncEngine,
    ChildRequest,
    EngineStoppedError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from llmpool.engine.server.constraints import Constraint, OutputSpec, parse_output_spec
from llmpool.engine.server.fingerprint import build_fingerprint, live_fields
from llmpool.engine.server.lora_routes import LoraRoutes, model_not_found
from llmpool.engine.server.metrics import EngineMetrics
from llmpool.engine.server.prompts import PromptBuilder
from llmpool.engine.server.response_store import ResponseStore, StoreLimits
from llmpool.engine.server.responses import SSE_DONE, Choice, ResponseBuilder, sse_event
from llmpool.engine.server.responses_routes import ResponsesRoutes
from llmpool.engine.server.sse import SSEResponse
from llmpool.engine.server.stats_log import log_stats_forever
from llmpool.engine.server.tool_calls import ToolCallShaper, detect_parser
from llmpool.engine.structured_outputs import GrammarError, StructuredOutputsParams
from llmpool.protocol.disconnect import ClientGone, disconnect_watcher, unless_gone
from llmpool.protocol.errors import APIError, bad_request, parse_json_body
from llmpool.protocol.http import ROUTE_ERROR_HANDLERS, openai_endpoint, read_body
from llmpool.protocol.limits import DEFAULT_MAX_RESPONSE_TOKENS
from llmpool.protocol.requests import (
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    parse_chat_request,
    parse_completion_request,
)

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = "1"
T = TypeVar("T")


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    chat_template: bytes | None = None  # the --chat-template file; None: the model's own
    max_queue: int = 1000
    stats_interval: float = 10.0
    tool_call_parser: str | None = None  # hermes, llama3_json or mistral; None: from the template
    # Token entries a non-streamed response may hold (limits.DEFAULT_MAX_RESPONSE_TOKENS).
    max_response_tokens: int = DEFAULT_MAX_RESPONSE_TOKENS
    # Stored responses (/v1/responses): this replica's name in their ids, and their bounds.
    replica_name: str = field(default_factory=socket.gethostname)
    response_store: StoreLimits = StoreLimits()


def _engine_error(error: Exception) -> APIError:
    """Map what the engine raised on submit to the status a client should see."""
    if isinstance(error, UnknownAdapterError):  # unloaded since the request's model was checked
        return model_not_found(error)
    if isinstance(error, PromptTooLongError):
        return bad_request(str(error), param="prompt", code="context_length_exceeded")
    if isinstance(error, InvalidRequestError):
        return bad_request(str(error), param=error.param)
    if isinstance(error, RequestFailedError) and error.code is not None:
        return bad_request(str(error), param="structured_outputs", code=error.code)
    if isinstance(error, RequestFailedError):
        return APIError(
            500, f"the engine failed this request: {error}", type="internal_error",
            code="internal_error",
        )  # fmt: skip
    if isinstance(error, QueueFullError):
        return APIError(
            429, f"too many requests are waiting: {error}", type="rate_limit_exceeded",
            code="rate_limit_exceeded", headers={"Retry-After": RETRY_AFTER_SECONDS},
        )  # fmt: skip
    if isinstance(error, EngineStoppedError):
        return APIError(
            503, str(error), type="service_unavailable", code="service_unavailable",
            headers={"Retry-After": RETRY_AFTER_SECONDS},
        )  # fmt: skip
    return bad_request(str(error))


def _sampling_params(
    parsed: GenerationRequest,
    max_tokens: int | None,
    structured_outputs: StructuredOutputsParams | None,
) -> SamplingParams:
    """The engine's params for one prompt of ``parsed``; what they refuse is a 400."""
    try:
        return SamplingParams(
            n=parsed.n,
            max_tokens=max_tokens,
            logprobs=parsed.logprobs,
            structured_outputs=structured_outputs,
            **parsed.sampling,
        )
    except ValueError as error:
        message = str(error)
        # SamplingParams messages start with the field's name; name it as the param too.
        name = message.split(" ", 1)[0]
        raise bad_request(message, param=name if name in parsed.sampling else None) from None


class OpenAIServer:
    """Holds the engine, metrics and settings; one method per route."""

    def __init__(self, core: EngineCore, settings: ServerSettings) -> None:
        self.core = core
        self.settings = settings
        self.model_name = settings.served_model_name
        self.metrics = EngineMetrics(
            self.model_name, None if core.lora is None else core.lora.max_loras
        )
        core.structured_outputs.on_compile = self.metrics.on_grammar_compiled
        core.structured_outputs.on_mask = self.metrics.on_grammar_mask
        self.metrics.set_grammar_budget(core.structured_outputs.budget)
        self.engine = AsyncEngine(core, settings.max_queue, self.metrics)
        self.lora = LoraRoutes(core, self.engine, self.model_name)
        self.responses = ResponsesRoutes(
            self, ResponseStore(settings.replica_name, settings.response_store)
        )
        chat_template = settings.chat_template.decode("utf-8") if settings.chat_template else None
        self.prompts = PromptBuilder(core.tokenizer, chat_template, core.max_model_len)
        # Parsing, checking and tokenizing a body grow with its size (seconds for 16 MiB of
        # text), so they run here rather than on the event loop, which must keep answering
        # /health and streaming tokens. One thread, as in vLLM: it holds the GIL only in
        # Python (the tokenizer releases it), and the engine thread keeps the CPU otherwise.
        self._prepare_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prepare")
        self.tool_call_parser = settings.tool_call_parser or detect_parser(
            self.prompts.chat_template
        )
        self._fingerprint: asyncio.Task[dict[str, Any]] | None = None
        self._created = int(time.time())

    # --- plumbing -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        # Before the port opens: /ready must mean "a forward pass has run", so that a request
        # held for a replica (a gateway scaling a pool from zero) never meets kernels that
        # still compile or memory that is still untouched.
        await self.engine.start(prepare=lambda: warm_up(self.core))
        # Digests of the loaded files take seconds; start now so /fingerprint answers fast.
        self._fingerprint = asyncio.create_task(
            asyncio.to_thread(
                build_fingerprint,
                self.core,
                self.model_name,
                self.settings.chat_template,
                self.prompts.chat_template,
            )
        )
        stats_task = asyncio.create_task(
            log_stats_forever(self.metrics, self.settings.stats_interval)
        )
        logger.info("serving %s; engine loop running", self.model_name)
        try:
            yield
        finally:
            stats_task.cancel()
            await self.engine.shutdown()
            self._prepare_pool.shutdown(wait=False, cancel_futures=True)
            logger.info("engine loop stopped")

    async def drain(self, timeout: float) -> None:
        """On SIGTERM: ``/ready`` turns 503 and new requests get a 503 with Retry-After at once,
        before any byte of a response; requests in flight run to their end for up to
        ``timeout`` seconds, and those still open then end with an error (a stream's last event
        before ``[DONE]``), never a silent cut."""
        logger.info(
            "draining: refusing new requests, %d in flight, up to %.0f s",
            self.engine.num_open_requests, timeout,
        )  # fmt: skip
        left = await self.engine.drain(timeout)
        if left:
            logger.warning(
                "%d request(s) still open after %.0f s of drain: ending them", left, timeout
            )
            await self.engine.shutdown()
        logger.info("drained")

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self._openai(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._openai(self.chat_completions), methods=["POST"]),
            Route("/v1/responses", self._openai(self.responses.create), methods=["POST"]),
            Route(
                "/v1/responses/{response_id}",
                self._openai(self.responses.retrieve),
                methods=["GET"],
            ),
            Route(
                "/v1/responses/{response_id}",
                self._openai(self.responses.delete),
                methods=["DELETE"],
            ),
            Route("/v1/models", self._openai(self.models), methods=["GET"]),
            Route("/v1/models/{model_id:path}", self._openai(self.model), methods=["GET"]),
            Route(
                "/v1/load_lora_adapter",
                self._openai(self._stopped(self.lora.load)),
                methods=["POST"],
            ),
            Route(
                "/v1/unload_lora_adapter",
                self._openai(self._stopped(self.lora.unload)),
                methods=["POST"],
            ),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/fingerprint", self.fingerprint, methods=["GET"]),
        ]

    def _openai(
        self, handler: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        return openai_endpoint(handler, self.settings.api_key)

    @staticmethod
    def _stopped(
        handler: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        """``handler`` with an engine that stops under it answered 503 with Retry-After."""

        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except EngineStoppedError as error:
                raise _engine_error(error) from None

        return endpoint

    def _check_model(self, model: str | None) -> str | None:
        """The LoRA adapter the request's ``model`` names, None for the served model itself
        (names compared in their normal form); any other name is a 404."""
        if model is None or names.normalize(model) == names.normalize(self.model_name):
            return None
        adapter = self.lora.adapter_for(model)
        if adapter is None:
            raise APIError(
                404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model", code="model_not_found",
            )  # fmt: skip
        return adapter

    # --- generation ---------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        raw = await read_body(request)
        parsed, output, prompts, adapter = await self.off_loop(self._prepare_completion, raw)
        structured_outputs = await self.compile_constraint(output.constraint)
        stream, builder = await self.submit(
            "completion", f"cmpl-{uuid.uuid4().hex}", parsed, prompts, arrival,
            structured_outputs, adapter=adapter,
        )  # fmt: skip
        return await self._answer(request, parsed, prompts, stream, builder)

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        raw = await read_body(request)
        parsed, output, prompt, adapter = await self.off_loop(self._prepare_chat, raw)
        structured_outputs = await self.compile_constraint(output.constraint)
        stream, builder = await self.submit(
            "chat", f"chatcmpl-{uuid.uuid4().hex}", parsed, [prompt], arrival,
            structured_outputs, self.tool_call_shaper(output), adapter,
        )  # fmt: skip
        return await self._answer(request, parsed, [prompt], stream, builder)

    async def off_loop(self, prepare: Callable[[bytes], T], raw: bytes) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, prepare, raw)

    def _prepare_completion(
        self, raw: bytes
    ) -> tuple[CompletionRequest, OutputSpec, list[list[int]], str | None]:
        body = parse_json_body(raw)
        parsed = parse_completion_request(body)
        output = parse_output_spec(body, chat=False)
        adapter = self._check_model(parsed.model)
        return parsed, output, [self.prompts.completion_ids(p) for p in parsed.prompts], adapter

    def _prepare_chat(self, raw: bytes) -> tuple[ChatRequest, OutputSpec, list[int], str | None]:
        return self.prepare_chat_body(parse_json_body(raw))

    def prepare_chat_body(
        self, body: dict[str, Any]
    ) -> tuple[ChatRequest, OutputSpec, list[int], str | None]:
        """A chat body checked and templated: the request, its output spec, its prompt's token
        ids and the adapter its model names."""
        parsed = parse_chat_request(body)
        output = parse_output_spec(body, chat=True)
        adapter = self._check_model(parsed.model)
        offers_tools = output.tool_choice.mode != "none"
        prompt = self.prompts.chat_ids(
            parsed.messages,
            parsed.add_generation_prompt,
            output.functions if offers_tools else None,
        )
        return parsed, output, prompt, adapter

    async def compile_constraint(
        self, constraint: Constraint | None
    ) -> StructuredOutputsParams | None:
        """Compile the request's grammar off the event loop (it may take milliseconds), so that
        the engine thread only copies it; what does not compile is a 400 naming its field."""
        if constraint is None:
            return None
        try:
            await asyncio.to_thread(
                self.core.structured_outputs.compile, constraint.params, constraint.kind
            )
        except GrammarError as error:
            raise bad_request(str(error), param=constraint.param) from None
        return constraint.params

    def tool_call_shaper(self, output: OutputSpec) -> ToolCallShaper | None:
        """None when the answer cannot be calls: no tools offered, or the output is held to a
        response_format or structured_outputs grammar (whose JSON might look like a call)."""
        constrained = output.constraint is not None and output.constraint.kind != "tool_call"
        if output.tool_choice.mode == "none" or constrained:
            return None
        return ToolCallShaper(output.tool_choice, self.tool_call_parser)

    def _children(
        self,
        parsed: GenerationRequest,
        prompts: list[list[int]],
        structured_outputs: StructuredOutputsParams | None,
        adapter: str | None,
    ) -> list[ChildRequest]:
        """``n`` children per prompt; with a seed, choice ``i`` uses ``seed + i`` as LLM does.

        The params are checked once per prompt and shared by its choices (``for_choice``).
        """
        max_tokens = [self._max_tokens(parsed, len(prompt)) for prompt in prompts]
        parsed.check_response_size(
            [
                self._most_tokens(tokens, len(prompt))
                for tokens, prompt in zip(max_tokens, prompts, strict=True)
            ],
            self.settings.max_response_tokens,
        )
        children = []
        for prompt, tokens in zip(prompts, max_tokens, strict=True):
            params = _sampling_params(parsed, tokens, structured_outputs)
            children += [
                ChildRequest(
                    prompt, params.for_choice(index), parsed.priority, parsed.cache_salt, adapter
                )
                for index in range(parsed.n)
            ]
        return children

    def _most_tokens(self, max_tokens: int | None, num_prompt_tokens: int) -> int:
        """What a choice may generate at most: its max_tokens, or else up to the context's end
        (0 for a prompt that leaves no room: the engine refuses it, naming its length)."""
        room = max(self.core.max_model_len - num_prompt_tokens, 0)
        return room if max_tokens is None else min(max_tokens, room)

    def _max_tokens(self, parsed: GenerationRequest, num_prompt_tokens: int) -> int | None:
        """An explicit max_tokens must fit beside the prompt; a default one is clipped to fit."""
        room = self.core.max_model_len - num_prompt_tokens
        if room <= 0:
            return parsed.max_tokens  # the engine refuses this prompt, naming both numbers
        if parsed.max_tokens is None:
            default = parsed.default_max_tokens
            return None if default is None else min(default, room)
        if parsed.max_tokens <= room:
            return parsed.max_tokens
        raise bad_request(
            f"this model's maximum context length is {self.core.max_model_len:,} tokens; the prompt"
            f" has {num_prompt_tokens:,} tokens and {parsed.max_tokens:,} were requested for the"
            " completion",
            param=parsed.max_tokens_param,
            code="context_length_exceeded",
        )

    async def _answer(
        self,
        request: Request,
        parsed: GenerationRequest,
        prompts: list[list[int]],
        stream: RequestStream,
        builder: ResponseBuilder,
    ) -> Response:
        """The submitted request's answer: streamed, or collected whole."""
        prompt_tokens = sum(len(p) for p in prompts)
        if parsed.stream:
            return SSEResponse(self._stream_events(stream, builder, parsed, prompt_tokens))
        try:
            choices = await self.collect(request, stream, len(stream.child_ids))
        finally:
            stream.abort()
        if choices is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        # Up to --max-response-tokens entries, each decoded and serialized: seconds of Python
        # at the bound, so built in a thread while the loop keeps answering.
        return await asyncio.to_thread(
            lambda: JSONResponse(builder.response(choices, prompt_tokens))
        )

    async def submit(
        self,
        kind: str,
        request_id: str,
        parsed: CompletionRequest | ChatRequest,
        prompts: list[list[int]],
        arrival: float,
        structured_outputs: StructuredOutputsParams | None,
        tool_calls: ToolCallShaper | None = None,
        adapter: str | None = None,
    ) -> tuple[RequestStream, ResponseBuilder]:
        """The request in the engine, and the builder that shapes its answer; ``adapter`` is the
        LoRA adapter its ``model`` named (None: the base model)."""
        sequences = parsed.n * len(prompts)
        if sequences > self.engine.max_queue:  # a 429 would have it retried forever
            raise bad_request(
                f"this request runs {sequences:,} sequences (n × prompts); this server queues"
                f" at most {self.engine.max_queue:,}",
                param="n",
            )
        children = self._children(parsed, prompts, structured_outputs, adapter)
        try:
            stream = await self.engine.submit(request_id, children, arrival)
        except (PromptTooLongError, QueueFullError, EngineStoppedError, ValueError) as error:
            raise _engine_error(error) from None
        builder = ResponseBuilder(
            kind, request_id, adapter or self.model_name, self.core.tokenizer, parsed.logprobs,
            tool_calls,
        )  # fmt: skip
        return stream, builder

    async def collect(
        self, request: Request, stream: RequestStream, count: int
    ) -> list[Choice] | None:
        """All choices, or None if the client disconnected first (its work is then aborted)."""
        choices = [Choice(index) for index in range(count)]

        async def consume() -> None:
            async for index, delta in stream:
                choices[index].add(delta)

        async with disconnect_watcher(request.receive) as gone:
            try:
                await unless_gone(consume(), gone)
            except ClientGone:
                return None
            except (EngineStoppedError, RequestFailedError) as error:
                raise _engine_error(error) from None
        return choices

    async def _stream_events(
        self,
        stream: RequestStream,
        builder: ResponseBuilder,
        parsed: GenerationRequest,
        prompt_tokens: int,
    ) -> AsyncIterator[bytes]:
        completion_tokens = 0
        try:
            if builder.kind == "chat":
                yield b"".join(builder.role_event(i) for i in range(len(stream.child_ids)))
            async for index, delta in stream:
                completion_tokens += len(delta.new_token_ids)
                yield builder.delta_event(index, delta)
            if parsed.include_usage:
                yield builder.usage_event(prompt_tokens, completion_tokens)
        except (EngineStoppedError, RequestFailedError) as error:
            yield sse_event(_engine_error(error).body())
        finally:
            stream.abort()
        yield SSE_DONE

    # --- the rest -----------------------------------------------------------------------------

    def _model_cards(self) -> list[dict[str, Any]]:
        """The served model, then its loaded LoRA adapters, as OpenAI's model objects."""
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "llmpool",
            "root": self.core.resolved.source,
            "parent": None,
            "max_model_len": self.core.max_model_len,
        }
        return [model, *self.lora.model_cards(self._created)]

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": self._model_cards()})

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        for card in self._model_cards():
            if card["id"] == model_id:
                return JSONResponse(card)
        raise APIError(
            404, f"the model {model_id!r} does not exist; this server serves {self.model_name!r}",
            param="model", code="model_not_found",
        )  # fmt: skip

    async def health(self, request: Request) -> Response:
        """Alive unless the engine loop died, which only a restart cures."""
        if self.engine.error is not None:
            return JSONResponse(
                {"status": "engine failed", "error": repr(self.engine.error)}, status_code=503
            )
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        if not self.engine.accepting:
            return JSONResponse({"status": "not ready"}, status_code=503)
        return JSONResponse({"status": "ready", "model": self.model_name})

    async def prometheus(self, request: Request) -> Response:
        return Response(
            self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    async def fingerprint(self, request: Request) -> Response:
        assert self._fingerprint is not None, "the lifespan starts the fingerprint task"
        cached = await asyncio.shield(self._fingerprint)
        return JSONResponse(live_fields(cached, self.core))


def warm_up(core: EngineCore) -> None:
    """One short generation through the whole step: schedule, forward, sample, detokenize."""
    prompt = core.tokenizer.encode("Hello", add_special_tokens=False) or [0]
    core.add_request("warm-up", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while core.has_unfinished_requests():
        core.step()


def build_app(core: EngineCore, settings: ServerSettings) -> Starlette:
    server = OpenAIServer(core, settings)
    app = Starlette(
        routes=server.routes(), lifespan=server.lifespan, exception_handlers=ROUTE_ERROR_HANDLERS
    )
    app.state.server = server
    return app
