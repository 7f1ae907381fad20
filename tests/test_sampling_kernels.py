"""``sampling.c`` in every build this CPU runs: the argmax against torch's (the first of equal
maxima, a NaN above any number, infinities, widths on both sides of a vector), the keep
thresholds against a sort of each row, and ``sample_rows``' draw against torch's softmax."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from llmpool.engine.cpu_features import cpu_flags
from llmpool.engine.kernels import c_loader, sampling
from llmpool.engine.kernels.sampling import greedy_tokens

BUILDS = {
    "this CPU": None,
    "avx2": c_loader.AVX2_BUILD,
    "avx512": c_loader.AVX512_BUILD,
    "portable": [],
}
NEEDS = {"avx2": c_loader.AVX2_FLAGS, "avx512": c_loader.AVX512_FLAGS}


def awkward_rows(width: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows, then rows with ties, a NaN, infinities, one value throughout."""
    logits = torch.randn(12, width, generator=torch.Generator().manual_seed(width))
    logits[1, [width - 1, width // 2, width // 3]] = 100.0  # the first of three ties
    logits[2, width - 1] = float("nan")  # after the maximum: still the argmax
    logits[3, [width // 2, width - 1]] = float("nan")  # the first of two NaNs
    logits[4, width // 2] = float("inf")
    logits[5] = float("-inf")
    logits[6] = 1.0
    logits[7, width - 1] = 50.0  # in the tail past the last whole vector
    logits[8, 0] = 50.0
    logits[9, :] = -0.0
    logits[9, width - 1] = 0.0  # equal to -0.0: the first zero wins
    return logits.to(dtype)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [1, 2, 7, 8, 9, 15, 16, 17, 64, 1000, 49152, 49155])
def test_the_kernel_chooses_what_torch_argmax_chooses(
    monkeypatch: pytest.MonkeyPatch, build: str, dtype: torch.dtype, width: int
) -> None:
    use_build(monkeypatch, build)
    assert sampling.KERNEL.available
    logits = awkward_rows(width, dtype)
    tokens = greedy_tokens(logits)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.float().argmax(dim=-1))
    assert torch.equal(greedy_tokens(logits[3:4]), logits[3:4].float().argmax(dim=-1))  # one row


def test_what_the_kernel_does_not_take_goes_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Columns apart in memory, float16, no rows, no compiler: torch's max, the same choice."""
    logits = awkward_rows(300, torch.float32)
    assert torch.equal(greedy_tokens(logits.t().contiguous().t()), logits.argmax(dim=-1))
    assert torch.equal(greedy_tokens(logits.half()), logits.half().argmax(dim=-1))
    assert greedy_tokens(logits[:0]).shape == (0,)
    monkeypatch.setattr(sampling.KERNEL, "library", lambda: None)
    assert torch.equal(greedy_tokens(logits.bfloat16()), logits.bfloat16().argmax(dim=-1))


def nucleus_rows(width: int) -> tuple[torch.Tensor, ...]:
    """Probabilities (powers of two, so that no mass lands on a boundary by rounding), with a row
    that min-p has thinned (summing below 1) and a row of ties; each row's top-k, top-p and min-p,
    every one of them on, off, or past the row's width."""
    generator = torch.Generator().manual_seed(width)
    probs = torch.softmax(3 * torch.randn(16, width, generator=generator), dim=-1)
    probs = torch.exp2(probs.log2().round())
    probs[3, width // 2 :] = 0.0  # thinned by min-p
    probs[4] = 1.0 / width  # all tied
    top_k = torch.tensor([0, 1, 2, 5, 3, width, width + 7, 0, 40, 1, 0, 3, 2, 0, 1, 9])
    top_p = torch.tensor(
        [1, 1, 0.5, 0.9, 0.3, 0.99, 0.2, 0.1, 1, 0.7, 0.95, 1, 0.6, 1e-6, 0.4, 0.8]
    )
    min_p = torch.tensor([0, 0, 0, 0.1, 0, 0, 0, 0, 0, 0, 0.5, 0.01, 0, 0, 0, 0.2])
    return probs, top_k, top_p, min_p


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("width", [1, 5, 16, 17, 300, 49152])
def test_keep_thresholds_are_the_sorted_rows_thresholds(
    monkeypatch: pytest.MonkeyPatch, build: str, width: int
) -> None:
    """The kernel's bisection against the thresholds read off each row sorted: min-p times the
    largest, the k-th largest probability, and the one at which the largest first add up to
    top_p; the tokens below zeroed in place."""
    use_build(monkeypatch, build)
    probs, top_k, top_p, min_p = nucleus_rows(width)
    kept = probs.clone()
    thresholds = sampling.keep_thresholds(kept, top_k, top_p, min_p)
    assert torch.equal(thresholds, sampling.thresholds_by_sort(probs, top_k, top_p, min_p))
    assert torch.equal(kept, torch.where(probs >= thresholds[:, None], probs, 0.0))
    off, ones = torch.zeros(16), torch.ones(16)
    by_k = sampling.keep_thresholds(probs.clone(), top_k, ones, off)
    by_p = sampling.keep_thresholds(probs.clone(), off.long(), top_p, off)
    by_min_p = sampling.keep_thresholds(probs.clone(), off.long(), ones, min_p)
    assert torch.equal(thresholds, torch.maximum(torch.maximum(by_k, by_p), by_min_p))
    on_k = (top_k > 0) & (top_k < width)
    counts = (probs >= by_k[:, None]).sum(dim=-1), (probs > by_k[:, None]).sum(dim=-1)
    assert bool((counts[0][on_k] >= top_k[on_k]).all() and (counts[1][on_k] < top_k[on_k]).all())
    on_p = (top_p < 1) & (probs.sum(dim=-1) >= top_p)  # a thinned row may not reach top_p
    masses = (probs * (probs >= by_p[:, None])).sum(-1), (probs * (probs > by_p[:, None])).sum(-1)
    assert bool((masses[0][on_p] >= top_p[on_p]).all() and (masses[1][on_p] < top_p[on_p]).all())
    assert torch.equal(by_min_p, min_p * probs.max(dim=-1).values)
    assert bool(((by_k == 0) == ~on_k).all() and ((by_p == 0) == ~on_p).all())
    assert bool((kept[4] > 0).all())  # ties at the threshold all stay


def test_keep_thresholds_without_a_compiler_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    probs, top_k, top_p, min_p = nucleus_rows(300)
    kept = probs.clone()
    expected = sampling.keep_thresholds(kept, top_k, top_p, min_p)
    monkeypatch.setattr(sampling.KERNEL, "library", lambda: None)
    fallback = probs.clone()
    assert torch.equal(sampling.keep_thresholds(fallback, top_k, top_p, min_p), expected)
    assert torch.equal(fallback, kept)


def use_build(monkeypatch: pytest.MonkeyPatch, build: str) -> None:
    flags = BUILDS[build]
    if flags is None:
        return
    if not cpu_flags() >= NEEDS.get(build, frozenset()):
        pytest.skip(f"this CPU cannot run the {build} build")
    library = sampling.KERNEL.build(flags)
    assert library is not None
    monkeypatch.setattr(sampling.KERNEL, "library", lambda: library)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("width", [1, 7, 16, 300, 49157])
def test_sample_rows_draws_from_the_kept_softmax(
    monkeypatch: pytest.MonkeyPatch, build: str, width: int
) -> None:
    """The kernel's probabilities against torch's softmax (its exp is a polynomial: ~2e-7
    relative), filtered as ``keep_thresholds`` filters them, and each token where the running
    sum (in float64) passes the row's uniform times the kept total; -inf and the skipped token
    never drawn, whatever the uniform."""
    use_build(monkeypatch, build)
    rows = 12
    generator = torch.Generator().manual_seed(width)
    logits = 4 * torch.randn(rows, width, generator=generator)
    logits[1, : width // 2] = float("-inf")  # masked by a grammar, before the rest
    temperature = torch.tensor([1.0, 0.7, 1.5, 0.3, 1.0, 2.0, 1.0, 0.9, 1.0, 1.0, 0.5, 1.0])
    top_k = torch.tensor([0, 0, 5, 0, 1, 0, 40, 0, 0, 3, 0, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9, 1.0, 0.5, 0.95, 1.0, 0.2, 1.0, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.0])
    uniform = torch.rand(rows, generator=generator)
    uniform[[0, 1]] = 0.0  # the very first token with any probability
    uniform[10] = 1.0 - 2.0**-24
    skip = torch.full((rows,), -1)
    skip[11] = int(logits[11].argmax())  # a draft: its replacement never is the draft
    off = (torch.zeros(rows, dtype=torch.int64), torch.ones(rows), torch.zeros(rows))
    drawn = sampling.sample_rows(logits, temperature, *off, uniform, skip, keep_probs=True)
    assert drawn is not None and drawn[1] is not None
    softmax = torch.softmax(logits / temperature[:, None], dim=-1)
    torch.testing.assert_close(drawn[1], softmax, rtol=1e-5, atol=1e-9)
    drawn = sampling.sample_rows(logits, temperature, top_k, top_p, min_p, uniform, skip, True)
    assert drawn is not None and drawn[1] is not None
    tokens, kept = drawn
    unfiltered = sampling.sample_rows(logits, temperature, *off, uniform, skip, True)
    assert unfiltered is not None and unfiltered[1] is not None
    expected = unfiltered[1].clone()
    sampling.keep_thresholds(expected, top_k, top_p, min_p)
    assert torch.equal(kept, expected)
    for row in range(rows):
        token = int(tokens[row])
        p = kept[row].double()
        if skip[row] >= 0:
            p[skip[row]] = 0.0
        if not p.any():
            continue  # all of it on the draft: accepted for sure, the replacement never used
        cumulative = p.cumsum(0)
        target = float(uniform[row]) * float(cumulative[-1])
        assert p[token] > 0 and token != skip[row], row
        assert float(cumulative[token]) >= target - 1e-6, row
        assert token == 0 or float(cumulative[token - 1]) <= target + 1e-6, row
    assert tokens[1] >= width // 2
    assert torch.equal(
        sampling.sample_rows(logits, temperature, top_k, top_p, min_p, uniform, skip, False)[0],
        tokens,
    )


def test_sample_rows_leaves_to_torch_what_it_does_not_take(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    logits, settings = torch.randn(2, 10), [torch.ones(2), torch.zeros(2), torch.ones(2)]
    rest = (torch.zeros(2), torch.rand(2), torch.full((2,), -1), False)
    assert sampling.sample_rows(logits.bfloat16(), *settings, *rest) is None
    assert sampling.sample_rows(logits.t().contiguous().t(), *settings, *rest) is None
    monkeypatch.setattr(sampling.KERNEL, "library", lambda: None)
    assert sampling.sample_rows(logits, *settings, *rest) is None


def test_sample_rows_without_memory_for_its_row_buffer_leaves_the_rows_to_torch() -> None:
    """A thread that cannot allocate its row buffer (the address space capped just above what
    the process holds, in a process of its own) draws nothing: None, for torch's ops, and no
    crash."""
    script = textwrap.dedent(
        """
        import resource
        import torch
        from llmpool.engine.kernels import sampling

        width = 1 << 24  # a 64 MiB row buffer
        ones, zeros = torch.ones(2), torch.zeros(2)
        args = (torch.zeros(2, width), ones, zeros.long(), ones, zeros, torch.full((2,), 0.5))
        rest = (torch.full((2,), -1), False)
        assert sampling.sample_rows(*args, *rest) is not None  # built, its threads started
        held = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (held + (16 << 20), resource.RLIM_INFINITY))
        print(sampling.sample_rows(*args, *rest))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"
