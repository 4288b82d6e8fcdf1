"""Token vocabularies: a tiny fixed one for the ledger task and a byte-level one for code.

The ledger vocabulary is small enough for the default tiny model (``model.vocab_size =
64``). ``encode``/``decode`` map whitespace-separated text to ids and back, for debugging
and for writing tests readably; a run of digits such as ``"123"`` becomes one token per
digit, so numbers of any size use the ten digit tokens.
"""

from __future__ import annotations

import numpy as np

SPECIALS = (
    "PAD", "BOS", "EOS", "TASK", "START", "STEP", "COMMIT", "OK", "WRONG",
    "DELEGATE", "ANSWER", "SUMMARY", "SUB", "ERROR", "=",
)  # fmt: skip
OPS = ("+", "-", "*")
DIGITS = tuple(str(d) for d in range(10))
TOKENS = SPECIALS + OPS + DIGITS
VOCAB_SIZE = len(TOKENS)  # 28; fits the tiny model's 64
ID = {name: i for i, name in enumerate(TOKENS)}

PAD, BOS, EOS = ID["PAD"], ID["BOS"], ID["EOS"]
TASK, START, STEP, COMMIT = ID["TASK"], ID["START"], ID["STEP"], ID["COMMIT"]
OK, WRONG, DELEGATE, ANSWER = ID["OK"], ID["WRONG"], ID["DELEGATE"], ID["ANSWER"]
SUMMARY, SUB, ERROR, EQ = ID["SUMMARY"], ID["SUB"], ID["ERROR"], ID["="]
OP_IDS = tuple(ID[o] for o in OPS)
DIGIT0 = ID["0"]


def is_digit(tok: int) -> bool:
    return DIGIT0 <= tok < DIGIT0 + 10


def number(n: int) -> list[int]:
    """Token ids of the decimal digits of n >= 0, most significant first."""
    if n < 0:
        raise ValueError(f"number() takes a non-negative integer, got {n}")
    return [DIGIT0 + int(c) for c in str(n)]


def encode(text: str) -> np.ndarray:
    """int32[T] ids of whitespace-separated names; digit runs split into digit tokens."""
    ids = []
    for word in text.split():
        if word in ID:
            ids.append(ID[word])
        elif word.isdigit():
            ids.extend(DIGIT0 + int(c) for c in word)
        else:
            raise ValueError(f"encode: unknown ledger token {word!r}")
    return np.asarray(ids, np.int32)


def decode(ids) -> str:
    """Readable text of ids; consecutive digits are joined into one number."""
    out: list[str] = []
    prev_digit = False
    for tok in np.asarray(ids).tolist():
        name = TOKENS[tok] if 0 <= tok < VOCAB_SIZE else f"<{tok}>"
        digit = is_digit(tok)
        if digit and prev_digit:
            out[-1] += name
        else:
            out.append(name)
        prev_digit = digit
    return " ".join(out)


class ByteVocab:
    """Byte-level vocabulary for real-model tasks: ids 0-255 are bytes, then specials."""

    BOS = 256
    EOS = 257
    PAD = 258
    SUMMARY = 259
    SIZE = 260

    @staticmethod
    def encode(text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    @staticmethod
    def decode(ids) -> str | None:
        """UTF-8 text of the byte ids (specials dropped); None if the bytes are not UTF-8."""
        arr = np.asarray(ids)
        raw = bytes(arr[arr < 256].astype(np.uint8).tolist())
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return None
