"""SimulatedRunner: the ModelRunner's ``execute()`` contract without a model.

`kvmesh serve --simulate` keeps everything around the forward pass real (scheduler,
block pool, prefix cache, KV events, API, metrics) and replaces the forward with a
latency model, so 8-32 instances fit on a 2-core box and routers can be compared on
prefix hits and queueing rather than on this machine's matmul speed.

Latency of one step (sleep, so an idle core is left to the other instances)::

    step_ms = decode_base_ms + decode_per_seq_ms * B + prefill_ms_per_token * prefill_tokens
              + kv_move_ms_per_token * moved_tokens

``B`` = sequences in the step, ``prefill_tokens`` = tokens of sequences that run more
than one token this step (prompt chunks; device prefix-cache hits are never scheduled,
so such a hit saves exactly its tokens' cost), ``moved_tokens`` = tokens of the KV tiers'
block copies planned since the last step (offloads to the host tier, loads back from it,
and the disk tier's): on a GPU the step's forward waits for them (engine/runner/host_kv.py
queues them on a copy stream the compute stream waits on), so a host-tier hit costs its
copy, not nothing. Defaults: the Llama-3-8B shape on one H200, from docs/gpu.md:

* decode: GPU ms/step 4.744 (batch 1), 5.357 (32), 6.555 (128) -> a line through
  batch 1 and 128 gives 4.73 ms + 0.0143 ms/seq (batch 32 lands at 5.19, within 3 %).
* prefill: the offline run prefilled 1,000 x 1,024 prompt tokens (+128 decode steps per
  request) in 40.2 s: <= 0.039 ms/token if all of it were prefill; taking out ~4 s of
  decode (4 waves of 256 seqs x 128 steps at ~8.4 ms) leaves ~0.035 ms/token.
* KV tier copies: bench/gpu_kv_offload.py (BENCHMARKS.md, host-memory tier, H100) loaded a
  16,384-token prompt's 1,023 blocks back from the host tier with TTFT 97.7 ms against 17.4 ms
  for the device hit: 80.3 ms for 16,368 tokens, ~0.0049 ms/token (a fifth of a token's
  prefill). The host link is PCIe Gen5 on the H200 as on the H100. Offloads are charged the
  same per token (one block copy each way), and so are disk moves: a lower bound for a disk.

Tokens are deterministic: the next token of a sequence is a hash of its last
``CONTEXT`` tokens (and its length) mapped into ``[vocab_lo, vocab_lo + vocab)``, a
range of the real tokenizer's ordinary tokens, so detokenization, stop strings and
the prefix cache of later turns behave as with a model. The logits returned are
``[rows, vocab_lo + vocab]`` float32 with ``PEAK`` at that token and 0 elsewhere:
greedy argmax picks it and random sampling picks it with probability ~1 - V·e^-PEAK.
The KV pool is a placeholder tensor in the real block layout with one layer, head and
element (connectors move its blocks as with a model, so P/D runs; the bytes carry nothing).
"""

from __future__ import annotations

import hashlib
import struct
import tempfile
import time

import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.connectors.common import LocalBlocks
from kvmesh.engine.core.sched_output import SchedulerOutput
from kvmesh.engine.runner.host_kv import DiskKV, HostKV
from kvmesh.engine.runner.memory import kv_bytes_per_block

# Calibration (see the module docstring).
DEFAULT_PREFILL_MS_PER_TOKEN = 0.035
DEFAULT_DECODE_BASE_MS = 4.73
DEFAULT_DECODE_PER_SEQ_MS = 0.0143
DEFAULT_KV_MOVE_MS_PER_TOKEN = 0.0049
DEFAULT_VOCAB = 4096
DEFAULT_VOCAB_LO = 1000  # above every special/control token of the bundled tokenizers
DEFAULT_NUM_KV_BLOCKS = 2048  # per instance: 32k tokens at block size 16
CONTEXT = 8
PEAK = 50.0


def next_token(tokens: list[int], vocab_lo: int, vocab: int) -> int:
    """The simulated model's deterministic next token for a sequence."""
    tail = tokens[-CONTEXT:]
    h = hashlib.blake2b(struct.pack(f"<{len(tail) + 1}q", len(tokens), *tail), digest_size=8).digest()
    return vocab_lo + int.from_bytes(h, "little") % vocab


class SimulatedRunner:
    def __init__(
        self,
        config: EngineConfig,
        prefill_ms_per_token: float = DEFAULT_PREFILL_MS_PER_TOKEN,
        decode_base_ms: float = DEFAULT_DECODE_BASE_MS,
        decode_per_seq_ms: float = DEFAULT_DECODE_PER_SEQ_MS,
        kv_move_ms_per_token: float = DEFAULT_KV_MOVE_MS_PER_TOKEN,
        vocab: int = DEFAULT_VOCAB,
        vocab_lo: int = DEFAULT_VOCAB_LO,
        sleep=time.sleep,
        clock=time.perf_counter,
    ) -> None:
        self.config = config
        vsize = config.model.vocab_size
        if vocab_lo >= vsize:
            vocab_lo = 0
        self.vocab_lo = vocab_lo
        self.vocab = max(1, min(vocab, vsize - vocab_lo))
        self.width = self.vocab_lo + self.vocab
        self.prefill_ms_per_token = prefill_ms_per_token
        self.decode_base_ms = decode_base_ms
        self.decode_per_seq_ms = decode_per_seq_ms
        self.kv_move_ms_per_token = kv_move_ms_per_token
        self.moved_tokens = 0  # KV tier copies planned since the last step, charged to the next (`step_ms`)
        self.sleep = sleep
        self.clock = clock  # with ``sleep``, injectable so a test checks the model without timing the host
        self.num_blocks = config.cache.num_kv_blocks or DEFAULT_NUM_KV_BLOCKS
        # Placeholder pool in the real layout [blocks, layers, 2, block_size, heads, dim] with one
        # layer, head and element: connectors address and move blocks as with a model (P/D over
        # NIXL or Redis works), at 8 bytes per token.
        bs = config.cache.block_size
        self.kv_cache = torch.zeros(self.num_blocks, 1, 2, bs, 1, 1, dtype=torch.float32)
        self.kv_blocks = LocalBlocks(self.kv_cache)
        # the host tier holds as many blocks as it would for the real model (its bytes per block)
        gb = config.cache.kv_offload_gb
        self.num_host_blocks = int(gb * (1 << 30)) // kv_bytes_per_block(config) if gb > 0 else 0
        if config.cache.kv_offload_blocks > 0:
            self.num_host_blocks = config.cache.kv_offload_blocks
        disk_gb = config.cache.kv_offload_disk_gb if self.num_host_blocks else 0.0
        self.num_disk_blocks = int(disk_gb * (1 << 30)) // kv_bytes_per_block(config) if disk_gb > 0 else 0
        disk = (
            DiskKV(self.num_disk_blocks, self.kv_cache[0], config.cache.kv_offload_disk_path or tempfile.gettempdir())
            if self.num_disk_blocks
            else None
        )
        self.host_kv = HostKV(self.num_host_blocks, self.kv_cache, disk) if self.num_host_blocks else None
        self.device = torch.device("cpu")
        self.num_steps = 0
        self.simulated_s = 0.0  # total latency slept
        self.num_graph_steps = 0
        self.num_eager_steps = 0

    def step_ms(self, sched: SchedulerOutput) -> float:
        b = len(sched.scheduled)
        prefill = sum(s.num_tokens for s in sched.scheduled if s.num_tokens > 1)
        return (
            self.decode_base_ms
            + self.decode_per_seq_ms * b
            + self.prefill_ms_per_token * prefill
            + self.kv_move_ms_per_token * self.moved_tokens
        )

    # LoRA adapters are registered and given slots as with a model; the simulated tokens ignore them.
    def add_lora(self, adapter) -> None:
        pass

    def load_lora_slot(self, slot: int, key: str) -> None:
        pass

    def drop_lora(self, key: str) -> None:
        pass

    def flush_kv_writes(self) -> None:
        """One rank: loaded blocks are in place already."""

    def move_kv(self, moves: list[tuple[int, int, int]], wait: bool = False) -> None:
        """Apply the copies to the placeholder pool and charge their time to the next step (the forward
        that waits for them)."""
        if self.host_kv is not None:
            self.host_kv.apply(moves, wait)
            self.moved_tokens += len(moves) * self.config.cache.block_size

    def close(self) -> None:
        """Close the disk tier's file (its name is gone already)."""
        if self.host_kv is not None:
            self.host_kv.close()

    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """Sleep for the step's modelled latency; ``logits[j]`` belongs to ``sched.scheduled[rows[j]]``."""
        if not sched.scheduled:
            return torch.empty(0, self.width), []
        t0 = self.clock()
        rows, toks = [], []
        for j, s in enumerate(sched.scheduled):
            end = s.num_computed_tokens + s.num_tokens
            if end >= len(s.all_token_ids):  # this step reaches the sequence's last token: it samples
                rows.append(j)
                toks.append(next_token(s.all_token_ids[:end], self.vocab_lo, self.vocab))
        logits = torch.zeros(len(rows), self.width)
        if rows:
            logits[torch.arange(len(rows)), torch.tensor(toks)] = PEAK
        self.num_steps += 1
        self.num_eager_steps += 1
        ms = self.step_ms(sched)
        self.moved_tokens = 0
        self.simulated_s += ms / 1000
        left = ms / 1000 - (self.clock() - t0)
        if left > 0:
            self.sleep(left)
        return logits, rows
