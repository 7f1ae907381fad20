"""A typed view of an LLMPool spec, with the CRD's defaults for fields the API server left out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmpool import pinning
from llmpool.operator import naming

# The API server fills these from the CRD's `default:`s; a test keeps the two in step.
# `replicas` has no CRD default (a pool sets it or `autoscaling`, not both): 1 when neither.
DEFAULT_REPLICAS = 1
DEFAULT_PRIORITY_CLASS = "interactive"
DEFAULT_DRIFT_POLICY = "Report"
DEFAULT_DRIFT_INTERVAL_SECONDS = 30
DEFAULT_MAX_UNAVAILABLE = 1
DEFAULT_MAX_SURGE = 1
DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 16
# Long enough for a CPU replica to finish generations of a few thousand tokens after SIGTERM.
DEFAULT_DRAIN_SECONDS = 120


@dataclass(frozen=True)
class AutoscalingSpec:
    """``spec.autoscaling``: the operator sets the replica count from the pool's load."""

    max_replicas: int
    min_replicas: int = 1
    target_in_flight_per_replica: float = 8.0
    window_seconds: int = 60
    scale_up_stabilization_seconds: int = 30
    scale_down_delay_seconds: int = 300

    @classmethod
    def from_dict(cls, autoscaling: Mapping[str, Any]) -> AutoscalingSpec:
        defaults = cls(max_replicas=autoscaling["maxReplicas"])
        return cls(
            max_replicas=autoscaling["maxReplicas"],
            min_replicas=autoscaling.get("minReplicas", defaults.min_replicas),
            target_in_flight_per_replica=autoscaling.get(
                "targetInFlightPerReplica", defaults.target_in_flight_per_replica
            ),
            window_seconds=autoscaling.get("windowSeconds", defaults.window_seconds),
            scale_up_stabilization_seconds=autoscaling.get(
                "scaleUpStabilizationSeconds", defaults.scale_up_stabilization_seconds
            ),
            scale_down_delay_seconds=autoscaling.get(
                "scaleDownDelaySeconds", defaults.scale_down_delay_seconds
            ),
        )


@dataclass(frozen=True)
class EngineSettings:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | str | None = None
    enable_prefix_caching: bool = True
    max_queue: int | None = None
    compile: bool = False
    # The volume source (persistentVolumeClaim or emptyDir) of the compiled artifacts' cache;
    # None: an emptyDir, which a container restart keeps.
    compile_cache: Mapping[str, Any] | None = None
    # spec.engine.speculative as the engine's --speculative-config keys (vLLM's), or None.
    speculative: tuple[tuple[str, Any], ...] | None = None

    @classmethod
    def from_dict(cls, engine: Mapping[str, Any]) -> EngineSettings:
        defaults = cls()
        return cls(
            max_num_seqs=engine.get("maxNumSeqs", defaults.max_num_seqs),
            max_num_batched_tokens=engine.get(
                "maxNumBatchedTokens", defaults.max_num_batched_tokens
            ),
            gpu_memory_utilization=engine.get(
                "gpuMemoryUtilization", defaults.gpu_memory_utilization
            ),
            kv_cache_memory=engine.get("kvCacheMemory"),
            enable_prefix_caching=engine.get("enablePrefixCaching", defaults.enable_prefix_caching),
            max_queue=engine.get("maxQueue"),
            compile=engine.get("compile", defaults.compile),
            compile_cache=engine.get("compileCache"),
            speculative=_speculative(engine.get("speculative")),
        )


# spec.engine.speculative's keys -> the engine's --speculative-config keys.
SPECULATIVE_KEYS = {
    "method": "method",
    "numSpeculativeTokens": "num_speculative_tokens",
    "promptLookupMax": "prompt_lookup_max",
    "promptLookupMin": "prompt_lookup_min",
    "disableByBatchSize": "disable_by_batch_size",
}


def _speculative(speculative: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    """Sorted (key, value) pairs, so that the rendered flag and the pod template are stable."""
    if speculative is None:
        return None
    return tuple(
        sorted(
            (key, speculative[field])
            for field, key in SPECULATIVE_KEYS.items()
            if field in speculative
        )
    )


@dataclass(frozen=True)
class ChatTemplateRef:
    """The user's ConfigMap holding a chat template (the operator copies it)."""

    name: str
    key: str = naming.CHAT_TEMPLATE_KEY


@dataclass(frozen=True)
class LoraSettings:
    """``spec.lora``: the adapter slots every replica preallocates (``--max-loras``,
    ``--max-lora-rank``)."""

    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK

    @classmethod
    def from_dict(cls, lora: Mapping[str, Any]) -> LoraSettings:
        return cls(
            max_loras=lora.get("maxLoras", DEFAULT_MAX_LORAS),
            max_lora_rank=lora.get("maxLoraRank", DEFAULT_MAX_LORA_RANK),
        )


@dataclass(frozen=True)
class AdapterSpec:
    """One of ``spec.adapters``: a LoRA adapter folder pinned by the sha256 of its files.

    Outside the pin: the operator loads and unloads adapters on running replicas over HTTP.
    """

    name: str
    source: str
    revision: str

    @classmethod
    def from_dict(cls, adapter: Mapping[str, Any]) -> AdapterSpec:
        return cls(name=adapter["name"], source=adapter["source"], revision=adapter["revision"])


@dataclass(frozen=True)
class PoolSpec:
    pin: pinning.PinnedSettings  # the model and the settings every replica must agree on
    replicas: int = DEFAULT_REPLICAS  # ignored when autoscaling is set
    autoscaling: AutoscalingSpec | None = None
    chat_template: ChatTemplateRef | None = None
    engine: EngineSettings = field(default_factory=EngineSettings)
    priority_class: str = DEFAULT_PRIORITY_CLASS
    max_request_priority: str | None = None  # None: priority_class
    drift_policy: str = DEFAULT_DRIFT_POLICY
    drift_interval_seconds: int = DEFAULT_DRIFT_INTERVAL_SECONDS
    max_unavailable: int = DEFAULT_MAX_UNAVAILABLE
    max_surge: int = DEFAULT_MAX_SURGE
    drain_seconds: int = DEFAULT_DRAIN_SECONDS
    image: str | None = None
    image_pull_policy: str | None = None
    resources: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: list[Mapping[str, Any]] = field(default_factory=list)
    lora: LoraSettings | None = None
    adapters: tuple[AdapterSpec, ...] = ()

    @property
    def source(self) -> str:
        return self.pin.source

    @property
    def revision(self) -> str:
        return self.pin.revision

    @property
    def served_name(self) -> str:
        return self.pin.served_name

    @property
    def quantization(self) -> str:
        return self.pin.quantization

    @property
    def kv_cache_dtype(self) -> str:
        return self.pin.kv_cache_dtype

    @property
    def max_model_len(self) -> int:
        return self.pin.max_model_len

    @property
    def lora_settings(self) -> LoraSettings | None:
        """The slots the replicas run with: ``spec.lora``, its defaults when only adapters are
        given, None when LoRA is off (neither)."""
        if self.lora is None and not self.adapters:
            return None
        return self.lora or LoraSettings()

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> PoolSpec:
        template = (spec.get("chatTemplate") or {}).get("configMapRef")
        drift = spec.get("drift") or {}
        rollout = spec.get("rollout") or {}
        return cls(
            pin=pinning.PinnedSettings.from_spec(spec),
            replicas=spec.get("replicas", DEFAULT_REPLICAS),
            autoscaling=(
                AutoscalingSpec.from_dict(spec["autoscaling"]) if spec.get("autoscaling") else None
            ),
            chat_template=(
                ChatTemplateRef(template["name"], template.get("key", naming.CHAT_TEMPLATE_KEY))
                if template
                else None
            ),
            engine=EngineSettings.from_dict(spec.get("engine") or {}),
            priority_class=spec.get("priorityClass", DEFAULT_PRIORITY_CLASS),
            max_request_priority=spec.get("maxRequestPriority"),
            drift_policy=drift.get("policy", DEFAULT_DRIFT_POLICY),
            drift_interval_seconds=drift.get("intervalSeconds", DEFAULT_DRIFT_INTERVAL_SECONDS),
            max_unavailable=rollout.get("maxUnavailable", DEFAULT_MAX_UNAVAILABLE),
            max_surge=rollout.get("maxSurge", DEFAULT_MAX_SURGE),
            drain_seconds=rollout.get("drainSeconds", DEFAULT_DRAIN_SECONDS),
            image=spec.get("image"),
            image_pull_policy=spec.get("imagePullPolicy"),
            resources=spec.get("resources") or {},
            node_selector=spec.get("nodeSelector") or {},
            tolerations=list(spec.get("tolerations") or []),
            lora=LoraSettings.from_dict(spec["lora"]) if spec.get("lora") is not None else None,
            adapters=tuple(AdapterSpec.from_dict(a) for a in spec.get("adapters") or []),
        )
