"""LoRA adapters through a real `llmpool serve`: by name, loaded and unloaded live, bad loads refused.

One server with two adapters loaded at start (one pinned to its revision) and four slots; the
others take adapters loaded over HTTP (a load in place takes a free slot while the old one
drains). That an adapter's tokens equal PEFT's is tested in
tests/test_lora_vs_peft.py; here, that the server routes the right adapter to the engine.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoConfig

from llmpool.engine import model_source
from llmpool.engine.lora.adapter import random_adapter, write_adapter
from llmpool.engine.lora.manager import MAX_FAILURE_TEXT, MAX_FAILURES
from llmpool.engine.models.llama import LlamaShape

MODEL = "smollm2-135m-instruct"
API_KEY = "lora-test-key"
PROMPT = "The capital of France is"
TOKENS = 8


@dataclasses.dataclass
class Adapters:
    root: Path
    digests: dict[str, str]  # name -> digest, of the good adapters

    def path(self, name: str) -> str:
        return str(self.root / name)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    shape = LlamaShape.from_hf_config(AutoConfig.from_pretrained(model_source.resolve(None).folder))
    root = tmp_path_factory.mktemp("adapters")
    digests = {
        "alpha": random_adapter(root / "alpha", shape, ["q_proj", "v_proj"], rank=8, alpha=16, seed=1),
        "beta": random_adapter(root / "beta", shape, ["o_proj", "down_proj"], rank=16, alpha=32, seed=2),
        "gamma": random_adapter(root / "gamma", shape, ["gate_proj", "up_proj"], rank=8, alpha=32, seed=3),
        "delta": random_adapter(root / "delta", shape, ["k_proj", "o_proj"], rank=4, alpha=16, seed=4),
    }  # fmt: skip
    random_adapter(root / "rank32", shape, ["q_proj"], rank=32, alpha=32, seed=5)
    narrow = dataclasses.replace(shape, hidden_size=shape.hidden_size // 2)
    random_adapter(root / "narrow", narrow, ["o_proj"], rank=8, alpha=8, seed=6)
    write_adapter(
        root / "lm_head", {(0, "lm_head"): (torch.zeros(8, 4), torch.zeros(4, 8))}, rank=8, alpha=8
    )
    random_adapter(root / "malformed", shape, ["q_proj"], rank=8, alpha=8, seed=7)
    (root / "malformed" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": ')
    return Adapters(root, digests)


@pytest.fixture(scope="module")
def server(
    serve_process: Callable[..., Any],
    adapters: Adapters,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Any]:
    beta = {"name": "beta", "path": adapters.path("beta"), "revision": adapters.digests["beta"]}
    process = serve_process(
        ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16",
         "--lora-modules", f"alpha={adapters.path('alpha')}", json.dumps(beta),
         "--max-model-len", "256", "--kv-cache-memory", "32MiB", "--dtype", "float32",
         "--api-key", API_KEY, "--no-access-log"],
        tmp_path_factory.mktemp("serve") / "server.log",
    )  # fmt: skip
    yield process
    assert process.terminate() == 0, process.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def post(server: Any, path: str, body: dict[str, Any], key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def load(server: Any, name: str, path: str, **extra: Any) -> httpx.Response:
    return post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, **extra})


def unload(server: Any, name: str) -> httpx.Response:
    return post(server, "/v1/unload_lora_adapter", {"lora_name": name})


def fingerprint(server: Any) -> dict[str, Any]:
    return httpx.get(f"{server.url}/fingerprint", timeout=60).raise_for_status().json()


def complete(client: openai.OpenAI, model: str) -> str:
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
    assert result.model == model and result.usage.completion_tokens == TOKENS
    return result.choices[0].text


@pytest.fixture(scope="module")
def texts(client: openai.OpenAI) -> dict[str, str]:
    """The greedy completion of PROMPT by the base model and by each adapter loaded at start."""
    return {model: complete(client, model) for model in (MODEL, "alpha", "beta")}


def test_each_adapter_answers_by_name_stream_and_not(
    client: openai.OpenAI, texts: dict[str, str]
) -> None:
    assert len(set(texts.values())) == 3, texts  # base, alpha and beta each change the output
    chunks = client.completions.create(
        model="beta", prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in chunks) == texts["beta"]
    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(
        model="alpha", messages=messages, max_tokens=4, temperature=0
    )
    assert chat.model == "alpha" and chat.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    ("spelling", "name"),
    [("ALPHA", "alpha"), ("ａｌｐｈａ", "alpha"), (MODEL.upper(), MODEL), ("Beta", "beta")],
)
def test_a_model_is_named_in_any_case_or_unicode_form(
    client: openai.OpenAI, texts: dict[str, str], spelling: str, name: str
) -> None:
    """Names compare in their normal form (llmpool.names); the answer names the model as
    loaded."""
    result = client.completions.create(
        model=spelling, prompt=PROMPT, max_tokens=TOKENS, temperature=0
    )
    assert result.model == name and result.choices[0].text == texts[name]


def test_an_adapter_loaded_under_another_spelling_is_the_same_adapter(
    server: Any, adapters: Adapters
) -> None:
    assert load(server, "ALPHA", adapters.path("alpha")).status_code == 200  # same files: no-op
    assert [a["name"] for a in fingerprint(server)["adapters"]] == ["alpha", "beta"]
    assert load(server, "Gamma", adapters.path("gamma")).status_code == 200
    assert unload(server, "GAMMA").status_code == 200
    assert [a["name"] for a in fingerprint(server)["adapters"]] == ["alpha", "beta"]


def test_models_lists_adapters_under_the_served_model(
    client: openai.OpenAI, adapters: Adapters
) -> None:
    cards = {card.id: card.model_dump() for card in client.models.list().data}
    assert list(cards) == [MODEL, "alpha", "beta"]
    assert cards[MODEL]["parent"] is None
    for name in ("alpha", "beta"):
        assert cards[name]["parent"] == MODEL and cards[name]["root"] == adapters.path(name)
        assert cards[name]["max_model_len"] == 256


def test_fingerprint_shows_adapters_outside_the_pin(server: Any, adapters: Adapters) -> None:
    document = fingerprint(server)
    assert document["lora"] == {"maxLoras": 4, "maxLoraRank": 16}
    listed = {adapter["name"]: adapter for adapter in document["adapters"]}
    assert list(listed) == ["alpha", "beta"]
    assert listed["beta"]["revision"] == listed["beta"]["digest"] == adapters.digests["beta"]
    assert listed["alpha"]["revision"] is None
    assert listed["alpha"]["digest"] == adapters.digests["alpha"]
    assert listed["alpha"]["rank"] == 8 and listed["alpha"]["targetModules"] == ["q_proj", "v_proj"]
    assert {listed["alpha"]["slot"], listed["beta"]["slot"]} == {0, 1}
    assert not any("lora" in key.lower() or "adapter" in key.lower() for key in document["pinned"])


def test_load_use_unload(
    server: Any, client: openai.OpenAI, adapters: Adapters, texts: dict[str, str]
) -> None:
    with pytest.raises(openai.NotFoundError):
        complete(client, "gamma")
    response = load(server, "gamma", adapters.path("gamma"))
    assert response.status_code == 200
    assert response.text == "Success: LoRA adapter 'gamma' added successfully."
    # The same name with the same files again is a no-op.
    assert load(server, "gamma", adapters.path("gamma")).status_code == 200
    assert complete(client, "gamma") not in texts.values()
    assert "gamma" in [card.id for card in client.models.list().data]
    response = unload(server, "gamma")
    assert response.status_code == 200
    assert response.text == "Success: LoRA adapter 'gamma' removed successfully."
    with pytest.raises(openai.NotFoundError) as raised:
        complete(client, "gamma")
    assert raised.value.body["code"] == "model_not_found"
    response = unload(server, "gamma")
    assert response.status_code == 404 and response.json()["error"]["code"] == "adapter_not_found"
    assert [a["name"] for a in fingerprint(server)["adapters"]] == ["alpha", "beta"]


def test_an_unload_lets_running_requests_finish_and_refuses_new_ones(
    server: Any, client: openai.OpenAI, adapters: Adapters
) -> None:
    assert load(server, "gamma", adapters.path("gamma")).status_code == 200
    stream = client.completions.create(
        model="gamma", prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    next(chunks)
    assert unload(server, "gamma").status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "gamma")
    assert [chunk.choices[0].finish_reason for chunk in chunks][-1] == "length"
    assert server.wait_idle()["llmpool:kv_cache_usage_perc"] == 0


def test_load_inplace_swaps_the_files_under_a_name(
    server: Any, client: openai.OpenAI, adapters: Adapters, texts: dict[str, str]
) -> None:
    assert load(server, "swap", adapters.path("gamma")).status_code == 200
    gamma = complete(client, "swap")
    response = load(server, "swap", adapters.path("delta"))
    assert response.status_code == 409 and response.json()["error"]["code"] == "adapter_exists"
    assert complete(client, "swap") == gamma
    assert load(server, "swap", adapters.path("delta"), load_inplace=True).status_code == 200
    assert complete(client, "swap") != gamma
    swapped = {a["name"]: a for a in fingerprint(server)["adapters"]}["swap"]
    assert swapped["digest"] == adapters.digests["delta"]
    assert unload(server, "swap").status_code == 200
    assert complete(client, "alpha") == texts["alpha"]


@pytest.mark.parametrize(
    ("name", "folder", "extra", "status", "code"),
    [
        ("bad", "malformed", {}, 400, "invalid_adapter"),
        ("bad", "missing", {}, 400, "invalid_adapter"),
        ("bad", "rank32", {}, 400, "lora_rank_exceeded"),
        ("bad", "lm_head", {}, 400, "unsupported_target_module"),
        ("bad", "narrow", {}, 400, "base_model_mismatch"),
        ("pinned", "gamma", {"revision": "sha256:" + "0" * 64}, 400, "revision_mismatch"),
        ("alpha", "gamma", {}, 409, "adapter_exists"),
        ("-dash", "gamma", {}, 400, "invalid_lora_name"),
        ("team-a/sql", "gamma", {}, 400, "invalid_lora_name"),
        ("x" * 129, "gamma", {}, 400, "invalid_lora_name"),
        (MODEL, "gamma", {}, 400, "invalid_lora_name"),
        (MODEL.upper(), "gamma", {}, 400, "invalid_lora_name"),  # names compare in any case
        ("ALPHA", "gamma", {}, 409, "adapter_exists"),  # alpha, with other files
    ],
)
def test_a_bad_load_is_refused_and_changes_nothing(
    server: Any,
    client: openai.OpenAI,
    adapters: Adapters,
    name: str,
    folder: str,
    extra: dict[str, Any],
    status: int,
    code: str,
) -> None:
    before = fingerprint(server)["adapters"]
    response = load(server, name, adapters.path(folder), **extra)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    if code == "invalid_lora_name":
        assert response.json()["error"]["param"] == "lora_name"
    assert fingerprint(server)["adapters"] == before
    assert httpx.get(f"{server.url}/health").status_code == 200
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
    assert base.usage.completion_tokens == 1


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/load_lora_adapter", {"lora_name": "x"}, "lora_path"),
        ("/v1/load_lora_adapter", {"lora_name": 5, "lora_path": "/x"}, "lora_name"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x", "revision": 1}, "revision"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x", "load_inplace": "yes"}, "load_inplace"),
        ("/v1/unload_lora_adapter", {}, "lora_name"),
    ],
)  # fmt: skip
def test_a_malformed_adapter_body_is_a_400_naming_the_field(
    server: Any, path: str, body: dict[str, Any], param: str
) -> None:
    response = post(server, path, body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_a_full_slot_table_refuses_another_adapter(server: Any, adapters: Adapters) -> None:
    assert load(server, "gamma", adapters.path("gamma")).status_code == 200
    assert load(server, "delta", adapters.path("delta")).status_code == 200
    before = fingerprint(server)["adapters"]
    response = load(server, "epsilon", adapters.path("gamma"))
    assert response.status_code == 409 and response.json()["error"]["code"] == "lora_slots_full"
    assert fingerprint(server)["adapters"] == before
    assert unload(server, "gamma").status_code == 200
    assert load(server, "epsilon", adapters.path("gamma")).status_code == 200
    for name in ("delta", "epsilon"):
        assert unload(server, name).status_code == 200


def test_failures_are_shown_until_a_good_load(server: Any, adapters: Adapters) -> None:
    wrong = "sha256:" + "1" * 64
    assert load(server, "pinned", adapters.path("gamma"), revision=wrong).status_code == 400
    failures = {f["name"]: f for f in fingerprint(server)["adapterFailures"]}
    assert failures["pinned"]["code"] == "revision_mismatch"
    assert failures["pinned"]["revision"] == wrong
    assert failures["pinned"]["digest"] == adapters.digests["gamma"]
    assert failures["pinned"]["source"] == adapters.path("gamma")
    right = adapters.digests["gamma"]
    assert load(server, "pinned", adapters.path("gamma"), revision=right).status_code == 200
    assert "pinned" not in {f["name"] for f in fingerprint(server)["adapterFailures"]}
    assert unload(server, "pinned").status_code == 200


def test_the_failure_record_keeps_the_last_loads_with_their_texts_capped(
    server: Any, tmp_path: Path
) -> None:
    """Failed loads in a loop cannot grow the record /fingerprint serves: the last MAX_FAILURES
    names are kept, oldest first gone, each text capped (2,000 failures once took 12 MB)."""
    missing = str(tmp_path / ("x" * 200) / ("y" * 200) / ("z" * 200) / "adapter")
    names = [f"bad-{index}" for index in range(MAX_FAILURES + 40)]
    with httpx.Client(timeout=60) as http:
        for name in names:
            response = http.post(
                f"{server.url}/v1/load_lora_adapter",
                json={"lora_name": name, "lora_path": missing, "revision": "r" * 5000},
                headers={"Authorization": f"Bearer {API_KEY}"},
            )
            assert response.status_code == 400, response.text
    failures = fingerprint(server)["adapterFailures"]
    bad = sorted(f["name"] for f in failures if f["name"].startswith("bad-"))
    assert bad == sorted(names[-MAX_FAILURES:])
    assert len(failures) == MAX_FAILURES
    cap = MAX_FAILURE_TEXT + len("... (99999 more characters)")
    assert all(len(f["revision"]) <= cap and len(f["error"]) <= cap for f in failures)
    assert failures[0]["revision"].endswith(f"({5000 - MAX_FAILURE_TEXT} more characters)")


def test_adapter_routes_need_the_api_key(server: Any, adapters: Adapters) -> None:
    response = post(
        server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": adapters.path("gamma")},
        key=None,
    )  # fmt: skip
    assert response.status_code == 401
    assert (
        post(server, "/v1/unload_lora_adapter", {"lora_name": "alpha"}, key="wrong").status_code
        == 401
    )
    assert [a["name"] for a in fingerprint(server)["adapters"]] == ["alpha", "beta"]


def test_metrics_count_per_adapter_and_name_the_running_ones(
    server: Any, client: openai.OpenAI
) -> None:
    before = server.wait_idle()
    idle_info = (
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""}'
    )
    assert idle_info in before and idle_info.replace("vllm:", "llmpool:") in before
    result = client.completions.create(
        model="beta", prompt=PROMPT, max_tokens=TOKENS, temperature=0
    )
    after = server.wait_idle()
    key = '{lora_name="beta"}'
    assert (
        after[f"llmpool:lora_requests_total{key}"] - before[f"llmpool:lora_requests_total{key}"]
        == 1
    )
    for name, tokens in (
        ("lora_prompt_tokens_total", result.usage.prompt_tokens),
        ("lora_generation_tokens_total", TOKENS),
    ):
        assert after[f"llmpool:{name}{key}"] - before[f"llmpool:{name}{key}"] == tokens

    # While a long stream runs on alpha, the info series names it.
    stream = client.completions.create(
        model="alpha", prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))
    running = server.metrics()
    stream.close()
    assert (
        running[
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="alpha",waiting_lora_adapters=""}'
        ]
        > 0
    )
    assert idle_info in server.wait_idle()


def test_a_pinned_adapter_of_other_files_stops_the_start_with_exit_3(
    serve_process: Callable[..., Any], adapters: Adapters, tmp_path: Path
) -> None:
    termination_log = tmp_path / "termination-log"
    termination_log.touch()
    module = {"name": "beta", "path": adapters.path("beta"), "revision": adapters.digests["alpha"]}
    with pytest.raises(RuntimeError, match="exited with 3"):
        serve_process(
            ["--enable-lora", "--lora-modules", json.dumps(module), "--max-model-len", "256",
             "--kv-cache-memory", "32MiB"],
            tmp_path / "server.log",
            {"LLMPOOL_TERMINATION_LOG": str(termination_log)},
        )  # fmt: skip
    assert termination_log.read_text().startswith("RevisionMismatch:")
    assert adapters.digests["alpha"] in termination_log.read_text()
