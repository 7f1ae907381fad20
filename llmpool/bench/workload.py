"""The portable workload of `llmpool bench serve`: text prompts of words, output lengths in tokens.

Text rather than token ids, so that servers with different tokenizers (or none exposed as ids,
as llama.cpp's) get the same requests. Words come from a fixed list of common English words, each
one or two tokens in the usual BPE vocabularies, so a prompt of N words is roughly N to 1.3 N
tokens; the servers' own ``usage.prompt_tokens`` says exactly how many.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

COMMON_WORDS = """
    the of and to in is was for that with as on by at from his an were are which this be has had
    not first one their its new after but who they have her she two been other when there all
    during into school time may years more most only over city some world would where later up
    such used many can state about national out known university united then made also team
    people game river town season film group life water family early house north music south
    small great large part government between under record album while long three around
    park station village second local built found line name main court public series work
    church east west road power history place green light number system order market garden
"""
WORDS = tuple(COMMON_WORDS.split())


@dataclass(frozen=True)
class LengthRange:
    """``N`` or ``LOW-HIGH`` (inclusive): each request draws its length uniformly from it."""

    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


def parse_length_range(text: str) -> LengthRange:
    low, _, high = text.partition("-")
    try:
        bounds = LengthRange(int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LOW-HIGH, got {text!r}") from None
    if not 1 <= bounds.low <= bounds.high:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return bounds


@dataclass(frozen=True)
class WorkItem:
    prompt: str
    output_len: int  # exact, with ignore_eos


def make_levels(
    sizes: list[int],
    input_words: LengthRange,
    output_len: LengthRange,
    shared_prefix_words: int,
    seed: int,
) -> tuple[WorkItem, list[list[WorkItem]]]:
    """A warm-up item and one list per level: every target gets these same requests.

    Each level's prompts are fresh, so that a prefix cache carries nothing from one level into the
    next; only the first ``shared_prefix_words`` words are common to all prompts.
    """
    rng = random.Random(seed)
    prefix = [rng.choice(WORDS) for _ in range(min(shared_prefix_words, input_words.low))]

    def item() -> WorkItem:
        words = prefix + [rng.choice(WORDS) for _ in range(input_words.draw(rng) - len(prefix))]
        return WorkItem(" ".join(words), output_len.draw(rng))

    warmup = WorkItem(item().prompt, 2)
    return warmup, [[item() for _ in range(size)] for size in sizes]
