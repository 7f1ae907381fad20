"""Renderers: the ConfigMap, Service and Deployment of a pool as pure functions of its spec."""

from __future__ import annotations

import base64
import json

import pytest

from llmpool import pinning
from llmpool.engine.spec_decode.config import SpeculativeConfig
from llmpool.fleet_key import ENGINE_KEY_ENV, ENGINE_KEY_FIELD, pool_engine_key
from llmpool.operator import naming
from llmpool.operator.engine_args import engine_args
from llmpool.operator.render import (
    render_configmap,
    render_deployment,
    render_disruption_budget,
    render_engine_key_secret,
    render_service,
)
from llmpool.operator.sizing import default_memory_limit
from llmpool.operator.spec import PoolSpec

IMAGE = "registry.example/llmpool:1"
DIGEST = "sha256:" + "d" * 64


def render(spec: dict, template: str | None) -> dict:
    pinned = pinning.pinned_from_spec(spec, template)
    return render_deployment("chat", PoolSpec.from_dict(spec), pinning.pinned_digest(pinned), IMAGE)


def engine_container(deployment: dict) -> dict:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return container


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_engine_args_carry_the_spec(chat_spec):
    args = engine_args(PoolSpec.from_dict(chat_spec))
    assert args[0] == "builtin://smollm2-135m-instruct"
    assert flag(args, "--served-model-name") == "smollm2"
    assert flag(args, "--revision") == chat_spec["model"]["revision"]
    assert flag(args, "--max-model-len") == "2048"
    assert flag(args, "--max-num-seqs") == "32"
    assert flag(args, "--max-num-batched-tokens") == "512"
    assert flag(args, "--block-size") == "16"
    assert flag(args, "--gpu-memory-utilization") == "0.9"
    assert flag(args, "--kv-cache-dtype") == "auto"
    assert flag(args, "--kv-cache-memory") == str(256 * 1024**2)
    assert flag(args, "--chat-template") == "/etc/llmpool/chat-template/template"
    assert flag(args, "--priority-class") == "interactive"
    assert flag(args, "--max-request-priority") == "interactive"  # the pool's own class
    assert flag(args, "--port") == "8000" and flag(args, "--host") == "0.0.0.0"
    assert "--enable-prefix-caching" in args
    assert "--quantization" not in args  # none is the engine's default
    assert "--compile" not in args  # eager unless the pool asks


def test_engine_args_optional_flags(batch_spec):
    spec = {
        **batch_spec,
        "quantization": "int8",
        "engine": {
            **batch_spec["engine"],
            "enablePrefixCaching": False,
            "maxQueue": 100,
            "compile": True,
        },
    }
    args = engine_args(PoolSpec.from_dict(spec))
    assert flag(args, "--quantization") == "int8"
    assert args.count("--compile") == 1
    assert flag(args, "--compile-cache-dir") == naming.COMPILE_CACHE_DIR
    assert "--no-enable-prefix-caching" in args and "--enable-prefix-caching" not in args
    assert flag(args, "--max-queue") == "100"
    assert flag(args, "--priority-class") == "batch"
    assert flag(args, "--max-request-priority") == "batch"
    assert "--chat-template" not in args


def test_max_request_priority_is_rendered_when_set(batch_spec):
    args = engine_args(PoolSpec.from_dict({**batch_spec, "maxRequestPriority": "interactive"}))
    assert flag(args, "--priority-class") == "batch"
    assert flag(args, "--max-request-priority") == "interactive"


def test_deployment_shape(chat_spec, chat_template):
    deployment = render(chat_spec, chat_template)
    digest = pinning.pinned_digest(pinning.pinned_from_spec(chat_spec, chat_template))
    assert deployment["metadata"]["name"] == "chat"
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "llmpool-engine",
        "llmpool.dev/pool": "chat",
    }
    template = deployment["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "llmpool-engine"
    assert labels["app.kubernetes.io/instance"] == "chat"
    assert labels["llmpool.dev/pool"] == "chat"
    assert template["metadata"]["annotations"] == {"llmpool.dev/pinned-digest": digest}
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 1}

    container = engine_container(deployment)
    assert container["image"] == IMAGE
    assert "command" not in container  # the image's ENTRYPOINT is `llmpool`
    assert container["args"] == ["serve", *engine_args(PoolSpec.from_dict(chat_spec))]
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert container["resources"] == chat_spec["resources"]


def test_the_grace_period_outlasts_the_prestop_sleep_and_the_drain(chat_spec, chat_template):
    for drain, spec in [(120, chat_spec), (600, {**chat_spec, "rollout": {"drainSeconds": 600}})]:
        deployment = render(spec, chat_template)
        container = engine_container(deployment)
        assert flag(container["args"], "--shutdown-timeout") == str(drain)
        sleep = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert sleep >= 5 and grace >= sleep + drain + 10


def test_security_context(chat_spec, chat_template):
    deployment = render(chat_spec, chat_template)
    pod = deployment["spec"]["template"]["spec"]
    security = engine_container(deployment)["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 10001
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    mounts = {m["mountPath"]: m["name"] for m in engine_container(deployment)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/tmp"]] == {"name": "tmp", "emptyDir": {}}


def test_chat_template_is_mounted_from_the_pools_configmap(chat_spec, chat_template):
    deployment = render(chat_spec, chat_template)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["chat-template"]["configMap"]["name"] == naming.configmap_name("chat")
    mount = next(
        m for m in engine_container(deployment)["volumeMounts"] if m["name"] == "chat-template"
    )
    assert mount == {
        "name": "chat-template",
        "mountPath": "/etc/llmpool/chat-template",
        "readOnly": True,
    }


def test_no_template_no_mount(batch_spec):
    deployment = render(batch_spec, None)
    names = [v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]]
    assert names == ["tmp"]


@pytest.mark.parametrize(
    ("compile_cache", "source"),
    [
        (None, {"emptyDir": {}}),
        (
            {"persistentVolumeClaim": {"claimName": "cc"}},
            {"persistentVolumeClaim": {"claimName": "cc"}},
        ),
    ],
)
def test_a_compiling_pool_mounts_its_compile_cache_where_the_engine_keeps_it(
    batch_spec, compile_cache, source
):
    engine = {**batch_spec["engine"], "compile": True}
    if compile_cache is not None:
        engine["compileCache"] = compile_cache
    deployment = render({**batch_spec, "engine": engine}, None)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["compile-cache"] == {"name": "compile-cache", **source}
    container = engine_container(deployment)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[naming.COMPILE_CACHE_DIR] == "compile-cache"
    assert flag(container["args"], "--compile-cache-dir") == naming.COMPILE_CACHE_DIR


def test_pvc_source_is_mounted_read_only(batch_spec):
    spec = {
        **batch_spec,
        "model": {"source": "pvc://weights/llama", "revision": "sha256:" + "1" * 64},
    }
    deployment = render(spec, None)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    mount = next(m for m in engine_container(deployment)["volumeMounts"] if m["name"] == "model")
    assert mount["mountPath"] == "/models/pvc/weights" and mount["readOnly"]
    assert engine_container(deployment)["args"][1] == "/models/pvc/weights/llama"


def test_scaling_keeps_the_pod_template(chat_spec, chat_template):
    before = render(chat_spec, chat_template)
    after = render({**chat_spec, "replicas": 5}, chat_template)
    assert after["spec"]["replicas"] == 5
    assert after["spec"]["template"] == before["spec"]["template"]


@pytest.mark.parametrize(
    "change",
    [{"maxModelLen": 4096}, {"quantization": "int8"}, {"engine": {"blockSize": 32}}],
)
def test_pinned_change_changes_the_digest_annotation(chat_spec, chat_template, change):
    before = render(chat_spec, chat_template)["spec"]["template"]["metadata"]["annotations"]
    after = render({**chat_spec, **change}, chat_template)["spec"]["template"]["metadata"]
    assert after["annotations"][naming.DIGEST_ANNOTATION] != before[naming.DIGEST_ANNOTATION]


def test_template_edit_changes_the_digest_annotation(chat_spec, chat_template):
    before = render(chat_spec, chat_template)["spec"]["template"]["metadata"]["annotations"]
    after = render(chat_spec, chat_template + "\n")["spec"]["template"]["metadata"]["annotations"]
    assert before != after


def test_rendering_is_deterministic(chat_spec, chat_template):
    assert render(chat_spec, chat_template) == render(dict(chat_spec), chat_template)


def test_configmap_holds_the_exact_template_and_the_pin(chat_spec, chat_template):
    pinned = pinning.pinned_from_spec(chat_spec, chat_template)
    configmap = render_configmap("chat", pinned, chat_template)
    assert configmap["metadata"]["name"] == "chat-engine"
    assert configmap["data"]["template"] == chat_template
    assert configmap["data"]["pinned.json"] == pinning.canonical_json(pinned)
    assert render_configmap("chat", pinned, None)["data"].keys() == {"pinned.json"}


def test_service_selects_the_engine_pods():
    service = render_service("chat")
    assert service["metadata"]["name"] == "chat"
    assert service["spec"]["selector"] == naming.selector_labels("chat")
    assert service["spec"]["ports"][0]["port"] == 8000
    assert naming.endpoint("chat", "team") == "http://chat.team.svc:8000/v1"


def test_the_disruption_budget_bounds_evictions_as_a_rollout_is_bounded(chat_spec):
    budget = render_disruption_budget("chat", PoolSpec.from_dict(chat_spec))
    assert budget["kind"] == "PodDisruptionBudget" and budget["metadata"]["name"] == "chat"
    assert budget["spec"]["selector"] == {"matchLabels": naming.selector_labels("chat")}
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    strict = PoolSpec.from_dict({**chat_spec, "rollout": {"maxUnavailable": 0, "maxSurge": 1}})
    assert render_disruption_budget("chat", strict)["spec"]["maxUnavailable"] == 0


def test_children_carry_the_pool_labels(chat_spec, chat_template):
    pinned = pinning.pinned_from_spec(chat_spec, chat_template)
    for child in (
        render_configmap("chat", pinned, chat_template),
        render_service("chat"),
        render_disruption_budget("chat", PoolSpec.from_dict(chat_spec)),
        render(chat_spec, chat_template),
    ):
        assert child["metadata"]["labels"]["llmpool.dev/pool"] == "chat"
        assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "llmpool-operator"


def test_the_engine_key_comes_from_the_pools_secret_never_from_the_template(chat_spec):
    key = pool_engine_key(b"fleet", "team", "chat")
    spec = PoolSpec.from_dict(chat_spec)
    secret = render_engine_key_secret("chat", key)
    assert secret["metadata"]["name"] == "chat-engine-key"
    assert secret["metadata"]["labels"] == naming.object_labels("chat")
    assert base64.b64decode(secret["data"][ENGINE_KEY_FIELD]).decode() == key
    deployment = render_deployment("chat", spec, DIGEST, IMAGE, engine_key=key)
    assert engine_container(deployment)["env"] == [
        {
            "name": ENGINE_KEY_ENV,
            "valueFrom": {"secretKeyRef": {"name": "chat-engine-key", "key": ENGINE_KEY_FIELD}},
        }
    ]
    assert key not in json.dumps(deployment)
    # A new fleet key rolls the pods (the engine reads its key at start); the same one does not.
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    rotated = render_deployment(
        "chat", spec, DIGEST, IMAGE, engine_key=pool_engine_key(b"rotated", "team", "chat")
    )
    assert (
        annotations[naming.ENGINE_KEY_HASH_ANNOTATION]
        != (
            rotated["spec"]["template"]["metadata"]["annotations"][
                naming.ENGINE_KEY_HASH_ANNOTATION
            ]
        )
    )
    assert render_deployment("chat", spec, DIGEST, IMAGE, engine_key=key) == deployment
    # Open mode: no key, no env, no annotation.
    open_mode = render_deployment("chat", spec, DIGEST, IMAGE)
    assert "env" not in engine_container(open_mode)
    assert naming.ENGINE_KEY_HASH_ANNOTATION not in json.dumps(open_mode)


def test_the_operators_gemm_probe_patience_reaches_every_engine_unpinned(chat_spec):
    from llmpool.engine.server.cli import build_parser, engine_config

    spec = PoolSpec.from_dict(chat_spec)
    default = engine_container(render_deployment("chat", spec, DIGEST, IMAGE))["args"]
    assert "--gemm-probe-patience" not in default
    impatient = render_deployment("chat", spec, DIGEST, IMAGE, gemm_probe_patience_s=0)
    args = engine_container(impatient)["args"]
    assert engine_config(build_parser().parse_args(args[1:])).gemm_probe_patience_s == 0.0
    # The engine's answers do not depend on it: the pin (and so the digest) stays as it is.
    assert pinning.pinned_from_engine_args(
        build_parser().parse_args(args[1:]), None
    ) == pinning.pinned_from_engine_args(build_parser().parse_args(default[1:]), None)


def test_the_engine_reads_its_key_from_the_env_the_deployment_sets(monkeypatch):
    from llmpool.engine.server.cli import build_parser

    monkeypatch.setenv(ENGINE_KEY_ENV, "from-the-secret")
    assert build_parser().parse_args(["builtin://x"]).api_key == "from-the-secret"


def test_engine_pods_get_a_default_memory_limit_the_spec_overrides(chat_spec):
    spec = {**chat_spec, "resources": {"requests": {"cpu": "1"}}}
    limits = engine_container(render(spec, None))["resources"]["limits"]
    assert limits == {"memory": default_memory_limit(PoolSpec.from_dict(spec))}
    assert engine_container(render(spec, None))["resources"]["requests"] == {"cpu": "1"}
    # The spec's own limit wins; a limit is never below the spec's request.
    assert engine_container(render(chat_spec, None))["resources"] == chat_spec["resources"]
    big = {**chat_spec, "resources": {"requests": {"memory": "64Gi"}}}
    assert engine_container(render(big, None))["resources"]["limits"] == {"memory": "64Gi"}
    # Unknown memory plan (a model without a known shape): no limit is guessed.
    hf = {**spec, "model": {"source": "hf://org/model", "revision": "a" * 40}}
    assert "limits" not in engine_container(render(hf, None))["resources"]


def adapter(name: str, source: str, digit: str = "a") -> dict:
    return {"name": name, "source": source, "revision": "sha256:" + digit * 64}


def test_lora_args_are_slots_only_and_adapters_turn_them_on(batch_spec):
    assert "--enable-lora" not in engine_args(PoolSpec.from_dict(batch_spec))
    with_adapter = {**batch_spec, "adapters": [adapter("sql", "/adapters/sql")]}
    args = engine_args(PoolSpec.from_dict(with_adapter))
    assert args.count("--enable-lora") == 1
    assert (flag(args, "--max-loras"), flag(args, "--max-lora-rank")) == ("4", "16")
    assert not any("lora-modules" in a or "/adapters/sql" in a for a in args)
    slots_only = {**batch_spec, "lora": {"maxLoras": 8, "maxLoraRank": 64}}
    args = engine_args(PoolSpec.from_dict(slots_only))
    assert (flag(args, "--max-loras"), flag(args, "--max-lora-rank")) == ("8", "64")


def adapter_mounts(deployment: dict) -> dict[str, dict]:
    """The adapters' volumes by mount path."""
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    return {
        m["mountPath"]: {k: v for k, v in volumes[m["name"]].items() if k != "name"}
        for m in engine_container(deployment)["volumeMounts"]
        if m["name"].startswith("adapters-")
    }


def roots_annotation(deployment: dict) -> list[str]:
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    return json.loads(annotations[naming.ADAPTER_ROOTS_ANNOTATION])


def test_adapter_roots_are_mounted_once_each(batch_spec):
    spec = {
        **batch_spec,
        "model": {"source": "pvc://weights/llama", "revision": "sha256:" + "1" * 64},
        "adapters": [
            adapter("a", "file:///var/lib/adapters/a"),
            adapter("b", "file:///var/lib/adapters/b/"),
            adapter("c", "file:///var/lib/adapters/deeper/c"),  # inside /var/lib/adapters
            adapter("d", "pvc://weights/adapters/d"),  # on the model's claim, already mounted
            adapter("e", "pvc://tuned/e"),
            adapter("f", "/opt/adapters/f"),  # in the image
        ],
    }
    deployment = render(spec, None)
    assert adapter_mounts(deployment) == {
        "/models/pvc/tuned": {"persistentVolumeClaim": {"claimName": "tuned", "readOnly": True}},
        "/var/lib/adapters": {"hostPath": {"path": "/var/lib/adapters"}},
    }
    assert all(m["readOnly"] for m in engine_container(deployment)["volumeMounts"][1:])
    assert roots_annotation(deployment) == [
        "/models/pvc/tuned",
        "/models/pvc/weights",
        "/var/lib/adapters",
    ]
    names = [v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]]
    assert len(names) == len(set(names))


def test_adding_an_adapter_under_a_mounted_root_keeps_the_pod_template(batch_spec):
    one = {**batch_spec, "adapters": [adapter("a", "file:///var/lib/adapters/a")]}
    two = {**one, "adapters": [*one["adapters"], adapter("b", "file:///var/lib/adapters/b", "b")]}
    reordered = {**two, "adapters": two["adapters"][::-1]}
    template = render(one, None)["spec"]["template"]
    assert render(two, None)["spec"]["template"] == template
    assert render(reordered, None)["spec"]["template"] == template
    # Another revision of an adapter is loaded in place: the template stays too.
    swapped = {**one, "adapters": [adapter("a", "file:///var/lib/adapters/a", "c")]}
    assert render(swapped, None)["spec"]["template"] == template
    # A new root needs a volume: the template changes, the pin does not.
    elsewhere = {**two, "adapters": [*two["adapters"], adapter("c", "file:///srv/lora/c")]}
    changed = render(elsewhere, None)["spec"]["template"]
    assert changed != template
    assert "/srv/lora" in adapter_mounts(render(elsewhere, None))
    digest = naming.DIGEST_ANNOTATION
    assert changed["metadata"]["annotations"][digest] == template["metadata"]["annotations"][digest]


def test_a_pool_without_lora_keeps_its_template(batch_spec):
    template = render(batch_spec, None)["spec"]["template"]
    assert naming.ADAPTER_ROOTS_ANNOTATION not in template["metadata"]["annotations"]
    assert render({**batch_spec, "adapters": []}, None)["spec"]["template"] == template


def test_speculative_decoding_is_rendered_as_the_engine_json(batch_spec):
    assert "--speculative-config" not in engine_args(PoolSpec.from_dict(batch_spec))
    speculative = {"method": "ngram", "numSpeculativeTokens": 3, "disableByBatchSize": 8}
    spec = {**batch_spec, "engine": {**batch_spec["engine"], "speculative": speculative}}
    rendered = flag(engine_args(PoolSpec.from_dict(spec)), "--speculative-config")
    assert json.loads(rendered) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "disable_by_batch_size": 8,
    }
    # What the engine parses: the keys and bounds of the CRD are the engine's.
    assert SpeculativeConfig.parse(rendered) == SpeculativeConfig(
        num_speculative_tokens=3, disable_by_batch_size=8
    )
    # Not pinned: the pool's pin, and so its fingerprint, is the same with or without it.
    assert PoolSpec.from_dict(spec).pin == PoolSpec.from_dict(batch_spec).pin
