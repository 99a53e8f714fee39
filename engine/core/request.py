"""A request's state inside the engine: tokens, progress, block hashes, status."""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvmesh.common.hashing import KVMESH, BlockHash, LoraId, block_hashes_for
from kvmesh.engine.frontend.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 10
    FINISHED_LENGTH_CAPPED = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    ``num_computed_tokens`` counts tokens whose KV is in the cache; the scheduler's
    only job is to make it catch up with ``num_tokens``. That one rule covers
    prefill, chunked prefill, prefix hits, decode and recompute after preemption.
    Block hashes are extended as blocks fill, so prefix lookup never rehashes.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_size: int
    model_identity: str
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    kv_transfer_params: dict[str, Any] | None = None
    parent_id: str | None = None  # set on forks of an n > 1 request
    index: int = 0  # which of the n completions this sequence is
    max_model_len: int = 1 << 30
    prefix_hash: str = KVMESH  # the block-hash scheme (kvmesh.common.hashing), the engine's --prefix-hash
    lora: LoraId | None = None  # the LoRA adapter it runs under (None: the base model)

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Any] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache (or external) hit at first schedule; -1 = not yet scheduled
    num_external_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    # when its blocks loaded from outside (a P/D pull) arrived, and their tokens (a trace's KV transfer)
    kv_loaded_time: float | None = None
    kv_loaded_tokens: int = 0
    generator: Any = None  # seeded sampling: device_draw.NoiseStream on a GPU, a CPU torch.Generator else
    grammar: Any = None  # a structured output's structured.RequestGrammar (its matcher)
    forked: bool = False  # an n > 1 parent whose children have been created
    # speculative decoding with a draft model: its KV holds this many of the sequence's tokens (engine/spec/draft.py)
    draft_kv_len: int = 0
    # the output as an int64 array for the sampler's penalties, filled up to _out_n (see output_array)
    _out_buf: np.ndarray | None = field(default=None, init=False, repr=False)
    _out_n: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self._all: list[int] = list(self.prompt_token_ids)
        self.block_hashes = block_hashes_for(
            self._all, self.block_size, self.model_identity, self.cache_salt, scheme=self.prefix_hash, lora=self.lora
        )

    @property
    def lora_name(self) -> str | None:
        return self.lora.name if self.lora is not None else None

    @property
    def lora_key(self) -> str | None:
        """The adapter's identity (engine/lora/adapter.py `LoraAdapter.key`): what slots and pins go by."""
        return self.lora.key if self.lora is not None else None

    # ---- tokens -------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        return self._all

    @functools.cached_property
    def prompt_array(self) -> np.ndarray:
        """The prompt as an int64 array, built once: a penalized request's sampler reads it every step."""
        return np.asarray(self.prompt_token_ids, dtype=np.int64)

    def output_array(self) -> np.ndarray:
        """The output so far as an int64 array (a view), extended by only the tokens added since the
        last call: a penalized request's sampler reads it every step, so converting the whole list
        each time would cost O(output) per step."""
        buf, n = self._out_buf, self._out_n
        new = self.output_token_ids[n:]
        if new:
            if buf is None or len(buf) < n + len(new):
                grown = np.empty(max(16, 2 * (n + len(new))), dtype=np.int64)
                if n:
                    assert buf is not None  # n tokens were copied into it before
                    grown[:n] = buf[:n]
                buf = self._out_buf = grown
            buf[n : n + len(new)] = new
            n = self._out_n = n + len(new)
        return buf[:n] if buf is not None else np.zeros(0, dtype=np.int64)

    def penalty_history(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(prompt, output so far) as arrays when the request's penalties need them, else None:
        the ``histories`` entry of `logit_adjustment.LogitAdjustment.build`."""
        return (self.prompt_array, self.output_array()) if self.params.penalized else None

    @property
    def num_tokens(self) -> int:
        return len(self._all)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int, logprob: Any = None) -> None:
        self.output_token_ids.append(token_id)
        self._all.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        n_full = len(self._all) // self.block_size
        if n_full > len(self.block_hashes):
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.extend(
                block_hashes_for(
                    self._all,
                    self.block_size,
                    self.model_identity,
                    self.cache_salt,
                    start=len(self.block_hashes),
                    parent=parent,
                    scheme=self.prefix_hash,
                    lora=self.lora,
                )
            )

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
