"""The OpenAI surface of a real `llmpool serve`, driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from llmpool import pinning
from llmpool.engine import LLM, SamplingParams, model_source
from llmpool.engine.kernels import avx2_gemm
from llmpool.engine.models import linear

MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 512
SERVER_ARGS = [
    "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "32", "--kv-cache-memory", "128MiB",
    "--no-access-log", "--dtype", "float32",
]  # fmt: skip
PROMPT = "The capital of France is"

SUBJECTS = ["The ocean", "A good teacher", "My favourite city", "The history of Rome", "Python",
            "A healthy breakfast", "The moon", "Winter mornings"]  # fmt: skip
ENDINGS = [" is", " can be described as", " reminds me of", " was"]
CONCURRENT_PROMPTS = [subject + ending for subject in SUBJECTS for ending in ENDINGS]  # 32


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_health_ready_and_models(server, client: openai.OpenAI) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready").status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_models_retrieve_and_route_errors_are_openai_shaped(server, client: openai.OpenAI) -> None:
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.model_dump()["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("absent-model")
    assert missing.value.body["code"] == "model_not_found"
    assert "'absent-model'" in missing.value.message
    unknown = httpx.post(f"{server.url}/v1/responses-nowhere", json={}, timeout=30)
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"] == "there is no route /v1/responses-nowhere"
    wrong = httpx.delete(f"{server.url}/v1/completions", timeout=30)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["code"] == "method_not_allowed"


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 6 and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 6

    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


async def test_chat_async_stream_and_not(async_client: openai.AsyncOpenAI) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hello."},
    ]
    whole = await async_client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=6, temperature=0
    )
    assert whole.choices[0].message.role == "assistant"
    assert 1 <= whole.usage.completion_tokens <= 6
    stream = await async_client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_choices_with_seed(client: openai.OpenAI) -> None:
    """Choice i of a seeded request samples with seed + i, so choice 0 repeats a single request."""
    many = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=1234, n=3, logprobs=0
    )
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert many.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in many.choices)
    single = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=1234
    )
    assert single.choices[0].text == many.choices[0].text
    assert many.usage.prompt_tokens == single.usage.prompt_tokens  # once per prompt, not per choice
    again = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=1234
    )
    assert again.choices[0].text == single.choices[0].text

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=4,
        temperature=1.0, seed=7, n=2,
    )  # fmt: skip
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_priority_and_cache_salt_are_accepted(client: openai.OpenAI) -> None:
    for priority in ("batch", 0):
        result = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
            extra_body={"priority": priority, "cache_salt": "tenant-a"},
        )  # fmt: skip
        assert result.usage.completion_tokens == 2


def test_stop_string(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    text = full.choices[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    stopped = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == stopped.choices[0].text


def test_logprobs(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3
    )
    logprobs = result.choices[0].logprobs
    assert (
        len(logprobs.tokens) == len(logprobs.token_logprobs) == result.usage.completion_tokens == 4
    )
    assert "".join(logprobs.tokens) == result.choices[0].text
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3
        assert chosen <= 0 and chosen == pytest.approx(max(top.values()))  # greedy picks the best

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)


@pytest.mark.slow  # loads the offline engine beside the server: about 2 minutes on a busy CPU
async def test_concurrent_greedy_streams_equal_offline_engine(server) -> None:
    """32 streams at once, batched together, each equal to the offline engine's own output."""
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

    async def stream_text(prompt: str) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    served = await asyncio.gather(*(stream_text(p) for p in CONCURRENT_PROMPTS))
    llm = LLM(max_model_len=MAX_MODEL_LEN, kv_cache_memory="128MiB", dtype="float32")
    offline = llm.generate(CONCURRENT_PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    assert served == [output.outputs[0].text for output in offline]


def test_client_disconnect_aborts_within_a_step(server) -> None:
    before = server.wait_idle()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        streams = [http.stream("POST", "/v1/completions", json=body) for _ in range(3)]
        responses = [stream.__enter__() for stream in streams]
        for response in responses:
            lines = response.iter_lines()
            while not next(lines).startswith("data: "):
                pass
        assert server.metrics()["llmpool:kv_cache_usage_perc"] > 0
        for stream in streams:
            stream.__exit__(None, None, None)
    at_disconnect = server.metrics()["llmpool:generation_tokens_total"]
    after = server.wait_idle()
    assert after["llmpool:kv_cache_usage_perc"] == 0
    # At most the step that was running when the clients left adds a token to each.
    assert after["llmpool:generation_tokens_total"] - at_disconnect <= 2 * len(streams)
    aborted = 'llmpool:request_success_total{finished_reason="abort"}'
    assert after[aborted] - before[aborted] == len(streams)


def test_metrics_names_and_semantics(server) -> None:
    metrics = server.wait_idle()
    for name in (
        "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
        "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
        "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
        "prefix_cache_queries_total", "prefix_cache_hits_total",
    ):  # fmt: skip
        assert f"llmpool:{name}" in metrics, name
    finished = sum(v for k, v in metrics.items() if k.startswith("llmpool:request_success_total"))
    assert metrics["llmpool:e2e_request_latency_seconds_count"] == finished
    assert metrics["llmpool:time_to_first_token_seconds_count"] >= finished - 3  # aborted early
    mean_ttft = (
        metrics["llmpool:time_to_first_token_seconds_sum"]
        / metrics["llmpool:time_to_first_token_seconds_count"]
    )
    mean_e2e = metrics["llmpool:e2e_request_latency_seconds_sum"] / finished
    assert 0 < mean_ttft < mean_e2e
    # Every output token after a request's first is one inter-token gap.
    first_tokens = metrics["llmpool:time_to_first_token_seconds_count"]
    gaps = metrics["llmpool:inter_token_latency_seconds_count"]
    assert gaps + first_tokens == metrics["llmpool:generation_tokens_total"]


def test_fingerprint_matches_the_operator_digest(server) -> None:
    fingerprint = httpx.get(f"{server.url}/fingerprint", timeout=60).json()
    resolved = model_source.resolve(None)
    spec = {
        "model": {"source": "builtin://smollm2-135m-instruct", "revision": resolved.revision},
        "maxModelLen": MAX_MODEL_LEN,
    }
    expected = pinning.pinned_from_spec(spec, chat_template=None)
    assert fingerprint["pinned"] == expected
    assert fingerprint["digest"] == pinning.pinned_digest(expected)
    observed = fingerprint["observed"]
    assert observed["weightsDigest"] == model_source.weights_digest(resolved.folder)
    assert observed["tokenizerDigest"] == model_source.tokenizer_digest(resolved.folder)
    assert observed["device"] == "cpu" and observed["dtype"] == "float32"
    assert observed["dtypeReason"] == "set explicitly"
    gemm = observed["gemm"]  # a float32 engine: the float32 kernel or torch, per the probe
    assert gemm["float32KernelMaxRows"] in (linear.FLOAT32_KERNEL_MAX_ROWS, None)
    assert (gemm["bfloat16Kernel"], gemm["bfloat16KernelMaxRows"]) == (None, None)
    assert gemm["bfloat16UpcastMinRows"] is None
    # Decodes run in the C decoder exactly where their GEMMs run in a C kernel.
    assert observed["cDecoderMaxRows"] == gemm["float32KernelMaxRows"]
    probe = observed["gemmProbe"]  # the float32 kernel's probe ran where the kernel is built
    assert (probe is None) == (not avx2_gemm.KERNEL.available)
    assert probe is None or (probe["attempts"] >= 1 and 0 <= probe["neighbourShare"] <= 1)
    assert probe is None or probe["stored"] is False  # an eager engine keeps no GEMM store
    pages = observed["hugePages"]  # float32 weights and a KV cache of at most 128 MiB
    assert 4 * 134e6 < pages["bytes"] <= 4 * 135e6 + 128 * 2**20
    assert pages["hugePageBytes"] is not None
    assert observed["compile"] == {
        "enabled": False, "state": "off", "cache": "off", "key": None, "seconds": 0.0, "error": None,
    }  # fmt: skip
    assert (fingerprint["lora"], fingerprint["adapters"], fingerprint["adapterFailures"]) == (
        None, [], [],
    )  # fmt: skip


def test_bench_serve_writes_json_markdown_and_plot(server, tmp_path: Path) -> None:
    command = [
        server.executable, "bench", "serve", "--url", server.url, "--concurrency", "1,2", "--num-prompts", "2",
        "--input-len", "8", "--output-len", "3", "--output-dir", str(tmp_path),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    report = json.loads((tmp_path / "serve.json").read_text())
    assert [level["concurrency"] for level in report["levels"]] == [1, 2]
    assert all(level["completed"] == 2 and level["failed"] == 0 for level in report["levels"])
    assert report["levels"][0]["output_throughput_ratio"] == 1.0
    assert "| concurrency |" in (tmp_path / "serve.md").read_text()
    assert (tmp_path / "serve.png").read_bytes().startswith(b"\x89PNG")


def test_sigterm_finishes_in_flight_requests_and_exits_zero(server) -> None:
    """Last in this module: it stops the server."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        events = [next(line for line in lines if line.startswith("data: "))]
        server.process.send_signal(signal.SIGTERM)
        events += [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    finish = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finish[-1] == "length" and len(finish) == 6
    assert server.process.wait(120) == 0, server.log()[-3000:]
    assert "Traceback" not in server.log()
