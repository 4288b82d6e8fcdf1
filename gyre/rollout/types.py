"""The model-call API shared by the harness (caller) and the proxy/engine (server)."""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

# How live requests of a cell leaving rollout are handed over (gyre/rollout/proxy.py).
HANDOVERS = ("migrate", "retry")
# rollout.cpu_vector_width: -1 auto, 0 XLA's default, else bits (gyre/rollout/programs.py).
CPU_VECTOR_WIDTHS = (-1, 0, 128, 256, 512)


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """One model call. prompt: int32[P]. Sampling is keyed by (execution_id, call_id, position)."""

    execution_id: str
    call_id: int
    prompt: np.ndarray
    max_new_tokens: int
    stop_tokens: tuple[int, ...] = ()
    temperature: float | None = None  # None: the engine's configured temperature

    @property
    def sample_key(self) -> tuple[int, int]:
        """Stable integers for keying the sampler (never Python's salted hash)."""
        return zlib.crc32(self.execution_id.encode()), int(self.call_id)


@dataclasses.dataclass(frozen=True)
class GenerateResponse:
    """tokens/logprobs/versions: [C]; finish_reason 'stop' (a stop token, included) or 'length'."""

    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str
