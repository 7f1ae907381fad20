"""The gateway in front of two real `llmpool serve` replicas, driven by the official openai client."""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

import httpx
import openai
import pytest

from llmpool.gateway import routing
from llmpool.gateway.app import GatewaySettings
from llmpool.gateway.pools import Pool, PoolTable, Replica
from llmpool.protocol.response_ids import replica_token, token_of

MODEL = "smollm2-135m-instruct"  # the served name of `llmpool serve` without --served-model-name
NAMESPACE = "team-a"
CHAT_POOL = "smollm2-chat"
PROMPT = "The capital of France is"
SYSTEM = "You answer questions about the history of computing, briefly and precisely. " * 16
QUIET = GatewaySettings(scrape_interval=3600)  # one scrape at start: loads stay what we count


def replica_name(index: int) -> str:
    return f"replica-{index}"


def pool(name: str = CHAT_POOL, **fields: Any) -> Pool:
    values: dict[str, Any] = {
        "namespace": NAMESPACE, "name": name, "served_name": MODEL,
        "priority_class": "interactive", "ready": True, "pinned_digest": None,
        "drifted": frozenset(),
    }  # fmt: skip
    return Pool(**{**values, **fields})


def table_with(make_slice, pools_and_ports: list[tuple[Pool, list[tuple[str, int]]]]) -> PoolTable:
    """A table of pools, each with its replicas as (pod name, port on 127.0.0.1)."""
    table = PoolTable()
    for entry, replicas in pools_and_ports:
        table.set_pool(entry)
        for name, port in replicas:
            endpoints = [(name, "127.0.0.1", True)]
            table.set_slice(make_slice(entry.name, name, endpoints, namespace=NAMESPACE, port=port))
    return table


@pytest.fixture
def chat_table(make_slice, replicas) -> PoolTable:
    return table_with(
        make_slice, [(pool(), [(replica_name(i), s.port) for i, s in enumerate(replicas)])]
    )


def client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=120)


def sent(metrics: dict[str, float], replica: str, decision: str | None = None) -> float:
    """Requests the gateway sent to ``replica`` (with ``decision``, or any)."""
    return sum(
        value
        for key, value in metrics.items()
        if key.startswith("llmpool_gateway:requests_total{")
        and f'replica="{replica}"' in key
        and (decision is None or f'decision="{decision}"' in key)
    )


def prompts_ranked_first(replica: str, names: list[str], count: int) -> list[str]:
    """Prompts whose prefix key ranks ``replica`` first among ``names`` (computed, not guessed)."""
    candidates = [routing.Candidate(Replica(n, f"http://{n}"), 0.0, None) for n in names]

    def ranks_first(text: str) -> bool:
        key = routing.prefix_key(routing.prompt_text({"prompt": text}))
        return routing.rank(key, candidates)[0].replica.name == replica

    texts = (f"Tenant {tenant}: {SYSTEM}" for tenant in range(1000))
    found = list(itertools.islice(filter(ranks_first, texts), count))
    assert len(found) == count, f"no {count} prompts rank {replica} first"
    return found


# --- the OpenAI surface -----------------------------------------------------------------------


def test_completions_and_chat_equal_a_direct_call(replicas, chat_table, start_gateway) -> None:
    gateway = start_gateway(chat_table, QUIET)
    direct = client(replicas[0].url)
    through = client(gateway.url)
    asked: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    expected = direct.completions.create(prompt=PROMPT, **asked).choices[0].text
    assert through.completions.create(prompt=PROMPT, **asked).choices[0].text == expected
    messages = [{"role": "user", "content": "Name a colour."}]
    expected_chat = direct.chat.completions.create(messages=messages, **asked)
    chat = through.chat.completions.create(messages=messages, **asked)
    assert chat.choices[0].message.content == expected_chat.choices[0].message.content
    assert chat.usage == expected_chat.usage
    assert [m.id for m in through.models.list().data] == [MODEL]


def test_responses_continue_on_the_replica_that_stored_them(
    replicas, chat_table, start_gateway
) -> None:
    """First turns spread over both replicas (their instructions differ); each second turn,
    retrieve and delete through the gateway reach the replica that holds the first."""
    gateway = start_gateway(chat_table, QUIET)
    through = client(gateway.url)
    asked: dict[str, Any] = {"model": MODEL, "max_output_tokens": 6, "temperature": 0}
    holders = {replica_token(replica_name(i)): i for i in range(len(replicas))}
    seen: set[int] = set()
    for topic in range(12):
        instructions = f"You are assistant number {topic}."
        first = through.responses.create(
            instructions=instructions, input="My name is Ada.", **asked
        )
        seen.add(holders[token_of(first.id)])
        second = through.responses.create(
            instructions=instructions, input="What is my name?", previous_response_id=first.id,
            **asked,
        )  # fmt: skip
        history = [
            {"role": "system", "content": instructions},
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ]
        chat = through.chat.completions.create(
            model=MODEL, messages=history, max_tokens=6, temperature=0
        )
        assert second.output_text == chat.choices[0].message.content
        assert through.responses.retrieve(second.id).output_text == second.output_text
        through.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError) as gone:
            through.responses.retrieve(first.id)
        assert first.id in gone.value.message
        if len(seen) == len(replicas):
            break
    assert seen == set(range(len(replicas)))
    with pytest.raises(openai.NotFoundError):
        through.responses.retrieve("resp_000000000000_" + "0" * 32)


def test_streaming_passes_chunks_through(replicas, chat_table, start_gateway) -> None:
    gateway = start_gateway(chat_table, QUIET)
    asked: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    whole = client(replicas[1].url).completions.create(**asked).choices[0].text
    chunks = [
        c.choices[0].text for c in client(gateway.url).completions.create(stream=True, **asked)
    ]
    assert len(chunks) > 1
    assert "".join(chunks) == whole


def test_an_unknown_model_is_an_openai_404(chat_table, start_gateway) -> None:
    gateway = start_gateway(chat_table, QUIET)
    with pytest.raises(openai.NotFoundError) as error:
        client(gateway.url).completions.create(model="gpt-nonexistent", prompt=PROMPT)
    assert error.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert MODEL in error.value.body["message"]  # type: ignore[index]
    metrics = gateway.metrics()
    assert metrics['llmpool_gateway:rejected_requests_total{reason="model_not_found"}'] == 1


def test_the_gateway_api_key_is_checked(chat_table, start_gateway) -> None:
    gateway = start_gateway(chat_table, GatewaySettings(api_key="s3cret", scrape_interval=3600))
    with pytest.raises(openai.AuthenticationError):
        client(gateway.url, api_key="wrong").completions.create(model=MODEL, prompt=PROMPT)
    answer = client(gateway.url, api_key="s3cret").completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2
    )
    assert answer.choices[0].text


# --- routing ----------------------------------------------------------------------------------


def test_one_prefix_stays_on_one_replica_and_hits_its_cache(
    replicas, chat_table, start_gateway
) -> None:
    gateway = start_gateway(chat_table, QUIET)
    names = [replica_name(i) for i in range(len(replicas))]
    through = client(gateway.url)
    for target in (0, 1):
        (text,) = prompts_ranked_first(names[target], names, 1)
        hits_before = replicas[target].metrics()["llmpool:prefix_cache_hits_total"]
        for question in ("Why?", "When?", "Who?", "How?"):
            through.completions.create(model=MODEL, prompt=f"{text}\n{question}", max_tokens=2)
        metrics = gateway.metrics()
        assert sent(metrics, names[target], routing.AFFINITY) == 4
        assert sent(metrics, names[1 - target]) == 4 * target  # only the first round's
        hits = replicas[target].metrics()["llmpool:prefix_cache_hits_total"] - hits_before
        assert hits >= 3 * (len(text) // 8)  # three repeats of a prefix of hundreds of tokens


def test_a_connect_error_is_retried_on_another_replica(
    make_slice, replicas, start_gateway, unused_port: int
) -> None:
    """A replica that is down (nothing listens on its port) costs a retry, not an error."""
    ports = [("down", unused_port), (replica_name(0), replicas[0].port)]
    gateway = start_gateway(table_with(make_slice, [(pool(), ports)]), QUIET)
    through = client(gateway.url)
    for text in prompts_ranked_first("down", ["down", replica_name(0)], 3):
        answer = through.completions.create(model=MODEL, prompt=text, max_tokens=2, stream=True)
        assert "".join(c.choices[0].text for c in answer)
    metrics = gateway.metrics()
    assert sent(metrics, replica_name(0), routing.RETRY) == 3
    connect_errors = 'llmpool_gateway:upstream_errors_total{kind="connect",pool="team-a/smollm2-chat",replica="down"}'
    assert metrics[connect_errors] == 3


def test_drifted_replicas_get_no_traffic_until_none_is_left(
    make_slice, replicas, start_gateway
) -> None:
    ports = [(replica_name(i), s.port) for i, s in enumerate(replicas)]
    drifted = pool(drifted=frozenset({replica_name(0)}))
    gateway = start_gateway(table_with(make_slice, [(drifted, ports)]), QUIET)
    through = client(gateway.url)
    for tenant in range(6):
        through.completions.create(model=MODEL, prompt=f"Tenant {tenant} asks", max_tokens=1)
    metrics = gateway.metrics()
    assert (sent(metrics, replica_name(0)), sent(metrics, replica_name(1))) == (0, 6)


def test_a_wrong_fingerprint_digest_is_drift_too(make_slice, replicas, start_gateway) -> None:
    ports = [(replica_name(i), s.port) for i, s in enumerate(replicas)]
    digest = httpx.get(f"{replicas[0].url}/fingerprint", timeout=60).json()["digest"]
    wrong = pool(pinned_digest="sha256:" + "0" * 64)
    settings = GatewaySettings(scrape_interval=0.2)
    gateway = start_gateway(table_with(make_slice, [(wrong, ports)]), settings)
    wait_for_digests(gateway, len(replicas))
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        answer = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT})
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "1"
    assert answer.json()["error"]["code"] == routing.REPLICAS_DRIFTED
    # The same replicas under their true pin take traffic again.
    gateway.gateway.table.set_pool(pool(pinned_digest=digest))
    text = client(gateway.url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert text.choices[0].text


def wait_for_digests(gateway: Any, count: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        digests = [load.digest for load in gateway.gateway.tracker.replicas().values()]
        if len(digests) == count and None not in digests:
            return
        assert time.monotonic() < deadline, f"replica digests not scraped: {digests}"
        time.sleep(0.2)


def test_priority_picks_the_pool_of_its_class(make_slice, replicas, start_gateway) -> None:
    chat, batch = pool(), pool("smollm2-batch", priority_class="batch")
    table = table_with(
        make_slice,
        [(chat, [(replica_name(0), replicas[0].port)]), (batch, [("batch-0", replicas[1].port)])],
    )
    gateway = start_gateway(table, QUIET)
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
        http.post("/v1/completions", json=body).raise_for_status()
        http.post("/v1/completions", json={**body, "priority": "batch"}).raise_for_status()
        headers = {"X-LLMPool-Priority": "batch"}
        http.post("/v1/completions", json=body, headers=headers).raise_for_status()
    metrics = gateway.metrics()
    assert (sent(metrics, replica_name(0)), sent(metrics, "batch-0")) == (1, 2)


# --- the upstream connection ------------------------------------------------------------------


def test_a_client_disconnect_aborts_the_engine_request(replicas, chat_table, start_gateway) -> None:
    gateway = start_gateway(chat_table, QUIET)
    (text,) = prompts_ranked_first(replica_name(0), [replica_name(0), replica_name(1)], 1)
    before = replicas[0].wait_idle()
    body = {"model": MODEL, "prompt": text, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=gateway.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["choices"]
    after = replicas[0].wait_idle()
    aborted = 'llmpool:request_success_total{finished_reason="abort"}'
    assert after[aborted] - before[aborted] == 1
    assert (
        after["llmpool:generation_tokens_total"] - before["llmpool:generation_tokens_total"] < 500
    )
