"""The CPU engine's weights and KV cache in transparent huge pages.

A decode step of few rows streams every weight once: 268 MB for SmolLM2 in bfloat16, 65,000
4 KiB pages, nearly each a TLB miss (a Zen 4 core's L2 TLB covers 12 MB of them), and in a VM a
miss is a two-level page walk. In 2 MiB pages the same bytes are 134 pages. torch's CPU allocator
takes its memory from glibc's malloc, which never asks for huge pages, and with THP in
``madvise`` mode (the kernel's default, and most distributions') the kernel gives them only to
memory advised ``MADV_HUGEPAGE``. So the engine copies its weights into one
:class:`HugePageArena` (an anonymous private mapping aligned to 2 MiB, its whole huge pages
advised) and allocates each KV-cache tensor in one of its own: a compiled graph takes the caches
as inputs it writes, and inputs that share a storage are aliases to it (a compiled int8 decoder
computed garbage over caches in one arena). ``benchmarks/huge_pages.py`` measures the gain.

Where the kernel has THP off (``never``) an arena is ordinary memory and nothing else changes;
``/fingerprint`` reports how many bytes the kernel did back with huge pages (:func:`observed`).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import mmap
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

HUGE_PAGE = 2 * 1024 * 1024
PAGE = mmap.PAGESIZE
ALIGN = 64  # each tensor starts on a cache line
SMAPS = "/proc/self/smaps"


def _aligned(nbytes: int, to: int) -> int:
    return (nbytes + to - 1) // to * to


class HugePageArena:
    """``capacity`` bytes of zeroed memory starting on a 2 MiB boundary, handed out as tensors.

    The whole huge pages in it are advised ``MADV_HUGEPAGE``; a tail shorter than one stays in
    small pages, so an arena never makes the process hold more memory than it uses. The mapping
    lives as long as any tensor taken from it (each holds the ``mmap`` object)."""

    def __init__(self, capacity: int) -> None:
        size = _aligned(max(capacity, 1), PAGE)
        self._map = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        skip = -whole.data_ptr() % HUGE_PAGE
        if size >= HUGE_PAGE:
            with contextlib.suppress(AttributeError, OSError):  # no THP here: small pages
                self._map.madvise(mmap.MADV_HUGEPAGE, skip, size // HUGE_PAGE * HUGE_PAGE)
        self._bytes = whole[skip : skip + size]
        self._used = 0

    @property
    def address(self) -> int:
        return self._bytes.data_ptr()

    @property
    def capacity(self) -> int:
        return self._bytes.numel()

    @property
    def used(self) -> int:
        """Bytes handed out so far, each tensor's rounded up to a cache line."""
        return self._used

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A new zeroed tensor of ``shape`` and ``dtype`` in the arena."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        start = self._used
        if start + nbytes > self.capacity:
            raise MemoryError(f"the arena holds {self.capacity} bytes, {start} taken")
        self._used = start + _aligned(nbytes, ALIGN)
        return self._bytes[start : start + nbytes].view(dtype).view(shape)

    def holds(self, tensor: torch.Tensor) -> bool:
        return self.address <= tensor.data_ptr() < self.address + self.capacity


def arena_for(tensors: Iterable[tuple[Sequence[int], torch.dtype]]) -> HugePageArena:
    """An arena just large enough for tensors of these shapes and dtypes."""
    return HugePageArena(
        sum(_aligned(torch.Size(shape).numel() * dtype.itemsize, ALIGN) for shape, dtype in tensors)
    )


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor with a storage of its own, in huge pages where it spans one or more;
    every page written once, as ``torch.zeros`` does, so that the memory is the process's now."""
    if torch.Size(shape).numel() * dtype.itemsize < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    return arena_for([(shape, dtype)]).take(shape, dtype).zero_()


def move_to_huge_pages(module: nn.Module) -> HugePageArena:
    """Copy every parameter and buffer of ``module`` (on the CPU) into one new arena, each
    tensor once: weights tied between modules (an embedding and its LM head, as parameters or
    quantized buffers) stay one tensor. Returns the arena."""
    tensors = {_identity(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    arena = arena_for((t.shape, t.dtype) for t in tensors.values())
    placed: dict[tuple[object, ...], torch.Tensor] = {}

    def place(tensor: torch.Tensor) -> torch.Tensor:
        if arena.holds(tensor):  # a tied parameter, moved already under another name
            return tensor
        key = _identity(tensor)
        if key not in placed:
            placed[key] = arena.take(tensor.shape, tensor.dtype).copy_(tensor)
        return placed[key]

    # What ``module.to()`` runs: each parameter keeps its identity (its data replaced), buffers
    # are replaced, and modules that derive state from theirs refresh it (Int8Linear).
    module._apply(place)
    return arena


def _identity(tensor: torch.Tensor) -> tuple[object, ...]:
    """What makes two tensors one: the same bytes seen the same way."""
    return (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())


def observed(tensors: Iterable[torch.Tensor]) -> dict[str, int | None]:
    """What ``/fingerprint`` says of ``tensors`` (the weights and the KV cache): their bytes, and
    the ``AnonHugePages`` of the distinct mappings that hold them (None where
    ``/proc/self/smaps`` cannot be read)."""
    tensors = list({t.data_ptr(): t for t in tensors}.values())
    total = sum(t.numel() * t.element_size() for t in tensors)
    try:
        mappings = sorted(_smaps_mappings())
    except OSError:
        return {"bytes": total, "hugePageBytes": None}
    starts = [start for start, _, _ in mappings]
    holding = set()
    for t in tensors:
        index = bisect.bisect_right(starts, t.data_ptr()) - 1
        if index >= 0 and t.data_ptr() < mappings[index][1]:
            holding.add(index)
    return {"bytes": total, "hugePageBytes": sum(mappings[i][2] for i in holding)}


def _smaps_mappings() -> Iterator[tuple[int, int, int]]:
    """``(start, end, AnonHugePages bytes)`` of each mapping of this process."""
    with open(SMAPS) as smaps:
        start = end = 0
        for line in smaps:
            head, _, rest = line.partition(" ")
            if "-" in head and not head.endswith(":"):
                low, _, high = head.partition("-")
                start, end = int(low, 16), int(high, 16)
            elif head == "AnonHugePages:":
                yield start, end, int(rest.split()[0]) * 1024
