"""Prompts of very different lengths (5 to 500+ tokens) shared by the correctness tests."""

from __future__ import annotations

_PARAGRAPH = (
    "The history of computing is a story of abstraction layered on abstraction. Early machines "
    "were programmed by rewiring panels; later, stored programs let the same hardware run any "
    "procedure written as numbers in memory. Assemblers named those numbers, compilers turned "
    "formulas into instructions, and operating systems shared one machine among many users by "
    "slicing time and paging memory. "
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a short poem about the sea and the wind and the stars at night.",
    "Question: What are three benefits of regular exercise for older adults? Answer:",
    _PARAGRAPH + "Summarize the paragraph above in one sentence:",
    "Translate to French: " + " ".join(["The cat sat on the mat near the door."] * 6),
    _PARAGRAPH * 3 + "What idea connects all of these steps?",
    _PARAGRAPH * 8 + "In conclusion,",
]
