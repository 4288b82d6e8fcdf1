"""A small tool-call grammar parsed directly from token ids (never from re-tokenised text).

A pattern is a tuple of items: a token id (must appear literally) or ``NUM`` (one or more
digit tokens, read as a decimal number). A completion matches a pattern when its tokens,
without the final stop token, are exactly the pattern.
"""

from __future__ import annotations

import numpy as np

from gyre.envs import vocab

NUM = -1  # placeholder for a decimal number in a pattern
MAX_DIGITS = 9  # longer digit runs are rejected (no giant ints from a babbling model)


def match(tokens, pattern: tuple[int, ...]) -> tuple[int, ...] | None:
    """The numbers captured by NUM items, or None when tokens do not match the pattern."""
    toks = tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens)
    pos, nums = 0, []
    for item in pattern:
        if item != NUM:
            if pos >= len(toks) or toks[pos] != item:
                return None
            pos += 1
            continue
        start = pos
        while pos < len(toks) and vocab.is_digit(toks[pos]):
            pos += 1
        if pos == start or pos - start > MAX_DIGITS:
            return None
        nums.append(int("".join(str(t - vocab.DIGIT0) for t in toks[start:pos])))
    return tuple(nums) if pos == len(toks) else None


def strip_stop(completion, stop: int) -> np.ndarray | None:
    """The completion without its final stop token, or None if it did not stop."""
    completion = np.asarray(completion)
    if completion.size == 0 or completion[-1] != stop:
        return None
    return completion[:-1]


def parse_first(completion, stop: int, patterns: dict[str, tuple]) -> tuple[str, tuple] | None:
    """(name, numbers) of the first pattern matching the stopped completion, else None."""
    body = strip_stop(completion, stop)
    if body is None:
        return None
    for name, pattern in patterns.items():
        nums = match(body, pattern)
        if nums is not None:
            return name, nums
    return None
