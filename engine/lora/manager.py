"""Adapter slots: ``max_loras`` preallocated, zero-filled stacks per layer and module.

A resident adapter owns one slot, so any mix of adapters and base-model rows runs in one batch
and the scheduler needs no LoRA rule. Slots are written only by the engine thread between
steps; other threads read :attr:`LoraManager.registry` and :attr:`LoraManager.failures`, dicts
that are replaced whole on every change, never mutated.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from llmpool.engine.admission import InvalidRequestError
from llmpool.engine.lora import LORA_TARGETS, NUM_MODULES
from llmpool.engine.lora.adapter import AdapterError, AdapterInfo, AdapterWeights, module_dims

if TYPE_CHECKING:
    from llmpool.engine.models.llama import LlamaShape
    from llmpool.engine.request import Request

# The record of failed loads that /fingerprint serves: the last names' failures, texts capped.
MAX_FAILURES = 64
MAX_FAILURE_TEXT = 1024


class AdapterConflictError(AdapterError):
    """A load that the slot table cannot take: the name holds other files, or no slot is free."""


class UnknownAdapterError(InvalidRequestError):
    """A request or an unload names an adapter that is not loaded."""

    def __init__(self, name: str) -> None:
        super().__init__(f"The model `{name}` does not exist.")
        self.name = name


@dataclass(frozen=True)
class LoadedAdapter(AdapterInfo):
    """A resident adapter: what it was read as, and the slot its weights were copied into."""

    slot: int

    def describe(self) -> dict[str, Any]:
        """The adapter as ``/fingerprint`` lists it."""
        return {
            "name": self.name,
            "source": self.path,
            "revision": self.revision,
            "digest": self.digest,
            "rank": self.rank,
            "alpha": self.alpha,
            "targetModules": list(self.target_modules),
            "slot": self.slot,
        }


@dataclass
class LoraStacks:
    """Per layer and fused module: ``a [S, parts · R, in]`` (the parts' A, each padded to rank
    R) and one ``b [S, out_j, R]`` per part; ``offsets[module]`` are the parts' columns in the
    fused output; ``scaling [S]`` float32."""

    a: list[list[torch.Tensor]]
    b: list[list[list[torch.Tensor]]]
    offsets: list[list[int]]
    scaling: torch.Tensor


def _module_parts(shape: LlamaShape) -> list[list[str]]:
    parts: list[list[str]] = [[] for _ in range(NUM_MODULES)]
    for name, (module, _) in LORA_TARGETS.items():
        parts[module].append(name)
    return parts


def _capped(text: str) -> str:
    """``text``, or its first ``MAX_FAILURE_TEXT`` characters and a note of what was cut."""
    if len(text) <= MAX_FAILURE_TEXT:
        return text
    return f"{text[:MAX_FAILURE_TEXT]}... ({len(text) - MAX_FAILURE_TEXT} more characters)"


def allocate_stacks(
    shape: LlamaShape, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
) -> LoraStacks:
    parts = _module_parts(shape)
    a, b = [], []
    for _ in range(shape.num_layers):
        a.append(
            [
                torch.zeros(
                    max_loras,
                    len(names) * max_rank,
                    module_dims(shape, names[0])[0],
                    dtype=dtype,
                    device=device,
                )
                for names in parts
            ]
        )
        # Each part's B is [S, out_j, R] with [out_j, S, R] memory: see ops.torch_lora_add.
        b.append(
            [
                [
                    torch.zeros(
                        module_dims(shape, name)[1], max_loras, max_rank, dtype=dtype, device=device
                    ).permute(1, 0, 2)
                    for name in names
                ]
                for names in parts
            ]
        )
    offsets = []
    for names in parts:
        columns, start = [], 0
        for name in names:
            columns.append(start)
            start += module_dims(shape, name)[1]
        offsets.append(columns)
    scaling = torch.zeros(max_loras, dtype=torch.float32, device=device)
    return LoraStacks(a, b, offsets, scaling)


class LoraManager:
    def __init__(
        self,
        shape: LlamaShape,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shape = shape
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.stacks = allocate_stacks(shape, max_loras, max_rank, dtype, device)
        self.registry: dict[str, LoadedAdapter] = {}
        self.failures: dict[str, dict[str, Any]] = {}
        # Slots of unloaded adapters that running requests still use: freed at their last release.
        self._users: dict[int, int] = {}
        self._retired: set[int] = set()

    @property
    def nbytes(self) -> int:
        tensors = [t for layer in self.stacks.a for t in layer]
        tensors += [t for layer in self.stacks.b for parts in layer for t in parts]
        return sum(t.numel() * t.element_size() for t in tensors)

    def install(self, weights: AdapterWeights, replace: bool = False) -> LoadedAdapter:
        """Copy an adapter into a free slot (engine thread, between steps).

        The same name with the same files is a no-op; other files under a loaded name need
        ``replace`` (the new files take a new slot, and requests running on the old one finish
        on it)."""
        current = self.registry.get(weights.name)
        if current is not None and current.digest == weights.digest:
            return current
        if current is not None and not replace:
            raise AdapterConflictError(
                "adapter_exists",
                f"adapter {weights.name!r} is loaded with other files ({current.digest});"
                " unload it first, or load in place",
                weights.digest,
            )
        slot = self._free_slot()
        if slot is None:
            raise AdapterConflictError(
                "lora_slots_full",
                f"all {self.max_loras} LoRA slots are in use (--max-loras); unload an adapter"
                " first",
                weights.digest,
            )
        self._write_slot(slot, weights)
        info = {f.name: getattr(weights, f.name) for f in fields(AdapterInfo)}
        loaded = LoadedAdapter(**info, slot=slot)
        if current is not None:
            self._retire(current.slot)
        self.registry = {**self.registry, weights.name: loaded}
        self.failures = {k: v for k, v in self.failures.items() if k != weights.name}
        return loaded

    def unload(self, name: str) -> None:
        current = self.registry.get(name)
        if current is None:
            raise UnknownAdapterError(name)
        self.registry = {k: v for k, v in self.registry.items() if k != name}
        self._retire(current.slot)

    def record_failure(
        self, name: str, path: str, revision: str | None, error: AdapterError
    ) -> None:
        """Keep the failure for ``/fingerprint``: the last ``MAX_FAILURES`` names' only, each
        text capped at ``MAX_FAILURE_TEXT`` characters, so that a client loading bad adapters in
        a loop cannot grow the record (or every ``/fingerprint`` answer) without bound. The name
        stays whole: the operator matches failures to adapters by it (names are bounded where
        they are admitted)."""
        failure = {
            "name": name,
            "source": _capped(path),
            "revision": None if revision is None else _capped(revision),
            "digest": error.digest,
            "code": error.code,
            "error": _capped(str(error)),
        }
        kept = [(k, v) for k, v in self.failures.items() if k != name][-(MAX_FAILURES - 1) :]
        self.failures = {**dict(kept), name: failure}

    def acquire(self, name: str) -> LoadedAdapter:
        """The adapter a new request uses; its slot stays until :meth:`release`."""
        loaded = self.registry.get(name)
        if loaded is None:
            raise UnknownAdapterError(name)
        self._users[loaded.slot] = self._users.get(loaded.slot, 0) + 1
        return loaded

    def finished(self, request: Request) -> None:
        """A request left the engine: the slot of its adapter, if it had one, has one user less."""
        if request.lora is not None:
            self.release(request.lora.slot)

    def release(self, slot: int) -> None:
        users = self._users[slot] - 1
        if users:
            self._users[slot] = users
            return
        del self._users[slot]
        if slot in self._retired:
            self._retired.discard(slot)
            self._clear_slot(slot)

    def describe(self) -> list[dict[str, Any]]:
        return [
            adapter.describe() for adapter in sorted(self.registry.values(), key=lambda a: a.name)
        ]

    def _free_slot(self) -> int | None:
        used = (
            {adapter.slot for adapter in self.registry.values()} | set(self._users) | self._retired
        )
        return next((slot for slot in range(self.max_loras) if slot not in used), None)

    def _retire(self, slot: int) -> None:
        if slot in self._users:
            self._retired.add(slot)
        else:
            self._clear_slot(slot)

    def _clear_slot(self, slot: int) -> None:
        stacks = self.stacks
        for layer in range(self.shape.num_layers):
            for module in range(NUM_MODULES):
                stacks.a[layer][module][slot].zero_()
                for b in stacks.b[layer][module]:
                    b[slot].zero_()
        stacks.scaling[slot] = 0.0

    def _write_slot(self, slot: int, weights: AdapterWeights) -> None:
        self._clear_slot(slot)
        stacks, rank = self.stacks, self.max_rank
        for (layer, name), (a, b) in weights.tensors.items():
            module, part = LORA_TARGETS[name]
            r = a.shape[0]
            stacks.a[layer][module][slot, part * rank : part * rank + r].copy_(a)
            stacks.b[layer][module][part][slot, :, :r].copy_(b)
        stacks.scaling[slot] = weights.scaling
