"""The model-call API shared by the harness (caller) and the proxy/engine (server)."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Protocol

import numpy as np

# How live requests of a cell leaving rollout are handed over (gyre/rollout/proxy.py).
HANDOVERS = ("migrate", "retry")
# rollout.cpu_vector_width: -1 auto, 0 XLA's default, else bits (gyre/rollout/programs.py).
CPU_VECTOR_WIDTHS = (-1, 0, 128, 256, 512)
# rollout.admission: how the proxy admits calls (gyre/rollout/proxy.py).
ADMISSIONS = ("none", "resident")


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


class ServingEngine(Protocol):
    """What the proxy (gyre/rollout/proxy.py) needs of one rollout cell's engine: the
    in-process :class:`gyre.rollout.engine.Engine` and the Ray actor's mirror
    (gyre/cluster/remote.py ``RemoteEngine``) both implement it.

    Admission and pool reads (``can_admit``, ``capacity_contexts``, ``pool``, ``stats``,
    ``budget``) are host-side figures; ``begin_step`` starts one device step and returns
    the function that collects its finished calls.
    """

    cell: object  # gyre.mesh.Cell or a remote cell: ``index`` names it
    vocab_size: int
    max_len: int
    budget: int  # KV tokens
    stats: dict
    on_admit: object  # called with a request id when a waiting call gets a slot

    @property
    def num_live(self) -> int: ...

    def live_ids(self) -> list[int]: ...
    def free_slots(self) -> int: ...
    def room(self) -> int: ...
    def can_admit(self, request: GenerateRequest) -> bool: ...
    def capacity_contexts(self) -> float: ...
    def pool(self) -> dict: ...
    def submit(self, request: GenerateRequest, rid: int | None = None) -> int: ...
    def cancel(self, rid: int): ...
    def begin_step(self): ...
    def export(self, rid: int): ...
    def import_(self, exp) -> None: ...
    def suspend(self) -> None: ...
    def resume(self, state=None, version: int | None = None) -> None: ...
    def set_weights(self, state, version: int) -> None: ...
    def warmup(self) -> None: ...

    def wait_ready(self) -> None:
        """Blocks until the weights and KV cache the engine was last given are in place (a
        role switch is timed to here)."""

    def lost_calls(self) -> list[int] | None:
        """None while the cell lives; once its process is lost, the ids of the calls that were
        live there (the proxy retries them elsewhere)."""

    def lose(self) -> None:
        """Marks the cell lost (found so outside the engine, e.g. by a gradient call)."""
