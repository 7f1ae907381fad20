"""One step's attention, reachable from inside a compiled forward.

A compiled forward (``EngineConfig.compile``) traces everything of a layer but its attention:
the attention plan is Python built per step (``Backend.plan``), and the KV write mutates the
cache. So the model enters ``step_attention`` once per step, outside the compiled region, and
each layer calls what :func:`layer_attention` gives: inside a compiled region the opaque op
``torch.ops.llmpool.attention`` (declared to mutate the caches), in eager mode
:func:`attention` itself. vLLM's ``unified_attention`` op does the same.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from llmpool.engine.attention.metadata import AttentionMetadata
from llmpool.engine.kv_cache import LayerKVCache

if TYPE_CHECKING:
    from llmpool.engine.attention import Backend


@dataclass(frozen=True)
class _Step:
    backend: Backend
    plan: Any
    slot_mapping: torch.Tensor


class _Current(threading.local):
    """The step each thread runs: the serving thread's and a background compile's
    (``engine/background_compile.py``) forwards run at once, each on its own caches."""

    step: _Step | None = None


_current = _Current()


@contextlib.contextmanager
def step_attention(backend: Backend, meta: AttentionMetadata) -> Iterator[None]:
    """Plan the step's attention once; every :func:`attention` call inside uses that plan."""
    previous = _current.step
    _current.step = _Step(backend, backend.plan(meta), meta.slot_mapping)
    try:
        yield
    finally:
        _current.step = previous


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:
    """Write ``key``/``value`` at the step's slots and attend ``query`` over the paged cache.

    The op's schema takes tensors and floats only, so the layer's cache is passed in pieces
    and joined here into the :class:`LayerKVCache` the backends take."""
    step = _current.step
    if step is None:
        raise RuntimeError("attention() runs only inside step_attention()")
    cache = LayerKVCache(key_cache, value_cache, k_scale, v_scale)
    step.backend.write_kv(key, value, cache, step.slot_mapping)
    return step.backend.paged_attention(query, cache, step.plan, scale)


# Defined with the low-level Library API: ``torch.library.custom_op``'s wrapper costs ~15 us a
# call in eager mode and far more inside a compiled graph; this one ~3 us.
_library = torch.library.Library("llmpool", "DEF")
_library.define(
    "attention(Tensor query, Tensor key, Tensor value, Tensor(a!) key_cache,"
    " Tensor(b!) value_cache, float scale, float k_scale, float v_scale) -> Tensor"
)
_library.impl("attention", attention, "CompositeExplicitAutograd")


@torch.library.register_fake("llmpool::attention")
def _(query: torch.Tensor, *rest: object) -> torch.Tensor:
    return torch.empty_like(query)


def layer_attention() -> Callable[..., torch.Tensor]:
    """What a layer calls: the opaque op inside a compiled region, :func:`attention` outside."""
    return torch.ops.llmpool.attention if torch.compiler.is_compiling() else attention
