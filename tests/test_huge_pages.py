"""The CPU engine's weights and KV cache in huge-page arenas (``engine/huge_pages.py``): what an
arena hands out, what moving a module into one keeps, and what the kernel says of the mapping."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from llmpool.engine import huge_pages
from llmpool.engine.config import EngineConfig
from llmpool.engine.engine_core import EngineCore
from llmpool.engine.huge_pages import HUGE_PAGE, SMAPS, HugePageArena, move_to_huge_pages
from llmpool.engine.kernels.capabilities import probe_kernels
from llmpool.engine.models.quantization import Int8Linear

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's THP mode (the bracketed word), None without THP."""
    if not THP.exists():
        return None
    return THP.read_text().split("[")[1].split("]")[0]


def vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping of this process that holds ``address``."""
    holds = False
    for line in Path(SMAPS).read_text().splitlines():
        head = line.split(" ")[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(bound, 16) for bound in head.split("-"))
            holds = low <= address < high
        elif holds and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_an_arena_hands_out_zeroed_aligned_disjoint_tensors() -> None:
    arena = HugePageArena(3 * 1024 * 1024)
    assert arena.address % HUGE_PAGE == 0 and arena.capacity == 3 * 1024 * 1024
    taken = [arena.take((5, 7), torch.bfloat16), arena.take((1000,), torch.float32)]
    taken.append(arena.take((3, 3), torch.int8))
    for tensor in taken:
        assert arena.holds(tensor) and tensor.data_ptr() % 64 == 0
        assert not tensor.any()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in taken)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    taken[0].fill_(1.5)  # the tensors write through to the one mapping
    assert not taken[1].any() and not taken[2].any()
    assert not arena.holds(torch.zeros(4))
    with pytest.raises(MemoryError):
        arena.take((2 * HUGE_PAGE,), torch.uint8)


@pytest.mark.skipif(thp_mode() in (None, "never"), reason="the kernel gives no huge pages")
def test_the_kernel_backs_whole_huge_pages_only() -> None:
    tensor = huge_pages.zeros((3 * HUGE_PAGE + 4096,), torch.uint8)
    assert tensor.data_ptr() % HUGE_PAGE == 0 and not tensor.any()
    assert "hg" in vm_flags(tensor.data_ptr())  # advised MADV_HUGEPAGE...
    assert "hg" not in vm_flags(tensor.data_ptr() + 3 * HUGE_PAGE)  # ...but not the tail
    report = huge_pages.observed([tensor[:HUGE_PAGE], tensor[HUGE_PAGE:]])  # one mapping, once
    assert report["bytes"] == 3 * HUGE_PAGE + 4096
    assert report["hugePageBytes"] is not None and 0 < report["hugePageBytes"] <= 3 * HUGE_PAGE
    small = huge_pages.zeros((100, 100), torch.float32)  # under a huge page: torch's memory
    assert "hg" not in vm_flags(small.data_ptr())


class Tied(nn.Module):
    """An embedding whose weight is also the head, a plain linear, a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.head = self.embed.weight
        self.proj = nn.Linear(16, 24)
        self.register_buffer("table", torch.arange(12.0))


def test_moving_a_module_keeps_its_values_parameters_and_ties() -> None:
    torch.manual_seed(0)
    module = Tied()
    before = {name: t.detach().clone() for name, t in module.state_dict().items()}
    parameters = dict(module.named_parameters())
    arena = move_to_huge_pages(module)
    assert dict(module.named_parameters()) == parameters  # the same Parameter objects
    assert module.head is module.embed.weight
    for name, tensor in module.state_dict().items():
        assert arena.holds(tensor), name
        assert torch.equal(tensor, before[name]), name
    # Each storage once, on its own cache lines: the tied weight is not placed twice.
    assert arena.used == 6400 + 1536 + 128 + 64  # embedding, linear weight, its bias, buffer


class TiedInt8(nn.Module):
    """An int8 head that shares its codes with another module's buffer, as a quantized model's
    tied embedding and LM head do."""

    def __init__(self) -> None:
        super().__init__()
        kernels = probe_kernels(torch.device("cpu"))
        self.head = Int8Linear.from_float(torch.randn(48, 64), torch.randn(48), kernels)
        self.codes = nn.Module()
        self.codes.register_buffer("weight", self.head.weight)


def test_an_int8_linear_computes_the_same_after_the_move_and_stays_tied() -> None:
    torch.manual_seed(0)
    module = TiedInt8()
    x = torch.randn(3, 64)
    expected = module.head(x)
    arena = move_to_huge_pages(module)
    assert all(arena.holds(t) for t in module.state_dict().values())
    assert module.codes.weight is module.head.weight
    assert torch.equal(module.head(x), expected)


@pytest.mark.skipif(thp_mode() in (None, "never"), reason="the kernel gives no huge pages")
def test_the_engine_keeps_its_weights_and_kv_cache_in_huge_pages() -> None:
    core = EngineCore(EngineConfig(dtype="float32", max_model_len=256, kv_cache_memory="256MiB"))
    model = core.model
    tensors = [*model.parameters(), *model.buffers()]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one arena
    assert "hg" in vm_flags(model.layers[0].qkv_proj.weight.data_ptr())
    caches = [t for pair in core.kv_caches for t in pair]
    # A storage each: a compiled decoder writes them, and must not see them as aliases.
    assert len({t.untyped_storage().data_ptr() for t in caches}) == len(caches)
    assert all("hg" in vm_flags(t.data_ptr()) for t in caches)
    report = huge_pages.observed([*tensors, *caches])
    assert report["bytes"] == sum(
        t.numel() * t.element_size()
        for t in {t.data_ptr(): t for t in [*tensors, *caches]}.values()
    )
    assert report["hugePageBytes"] is not None and report["hugePageBytes"] > 256 * 2**20
