"""Turns a scheduler step into flat model inputs, runs the model, returns last-token logits.

It owns the KV tensor ``[num_blocks, num_layers, 2, block_size, Hkv, D]`` (block
first, so a block of all layers is one contiguous range for the connectors).

One code path builds the inputs on both devices: numpy over per-request scalars
(no per-token Python), written into one int32 buffer. On the CPU the model reads
that buffer directly. On a GPU the buffer is pinned host memory and reaches the
device in ONE host-to-device copy per step; the two staging buffers alternate and
each is fenced by an event, so the host never overwrites inputs the device has not
read yet (a chunked-prefill step returns without any sync).

GPU only:

* the KV pool is sized from free device memory after a profiling forward pass of
  ``max_num_batched_tokens`` tokens (the activation peak), minus a reserve for the
  CUDA graphs and the sampler's logits;
* pure decode steps (one token per sequence, at most the largest graph size) replay a
  CUDA graph captured for the next padded batch size in ``GRAPH_SIZES``; the graphs
  read static buffers at fixed offsets (padding tokens have slot -1, padding
  sequences have no query tokens and length 0, so every kernel skips them) and the
  attention launch is fixed at capture for ``max_model_len`` (split-KV only where
  the batch is too small to fill the SMs). Prefill and mixed steps run eagerly.
  ``KVMESH_ENFORCE_EAGER=1`` turns graphs off (debugging, comparisons).
"""
from __future__ import annotations

import itertools
import logging
import os
import time

import numpy as np
import torch

from kvmesh import kernels

from .config import EngineConfig
from .models.llama import AttentionMetadata, LlamaForCausalLM
from .host_copy import to_device
from .sampling_params import SamplingParams
from .device_draw import draw_on_device
from .logit_adjustment import LogitAdjustment
from .logprobs import SampleResult, device_logprobs, logprob_width, results_with_logprobs
from .scheduler import SchedulerOutput

log = logging.getLogger("kvmesh.engine")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# Padded decode batch sizes that get a CUDA graph (capped at max_num_seqs).
GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


def kv_bytes_per_block(config: EngineConfig) -> int:
    m = config.model
    return m.num_layers * 2 * config.cache.block_size * m.num_kv_heads * m.head_dim * torch_dtype(config.dtype).itemsize


def num_blocks_for(config: EngineConfig, weight_bytes: int = 0, reserve_bytes: int = 0) -> int:
    """Pool size: explicit, else a memory budget (CPU) or a share of free device memory (GPU).

    On a GPU, ``reserve_bytes`` is what the step still needs beyond what is allocated
    now (activation peak, graphs, logits); weights are already on the device, so the
    free memory reported by the driver has them subtracted."""
    if config.cache.num_kv_blocks is not None:
        return config.cache.num_kv_blocks
    per_block = kv_bytes_per_block(config)
    if config.device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(config.device))
        budget = int(total * config.cache.gpu_memory_utilization) - (total - free) - reserve_bytes - (1 << 30)
    else:
        budget = int(config.cache.kv_cache_memory_gb * (1 << 30))
    n = budget // per_block
    if n < 2:
        raise ValueError("not enough memory for the KV cache; lower the model size or raise the memory budget")
    return int(n)


def configure_cpu_threads() -> None:
    """Honour KVMESH_CPU_THREADS: OpenMP with more threads than idle cores slows matmuls by 10-30x."""
    n = os.environ.get("KVMESH_CPU_THREADS")
    if n:
        torch.set_num_threads(max(1, int(n)))


def _align4(n: int) -> int:
    """``n`` int32s rounded up to a multiple of 16 bytes."""
    return (n + 3) & ~3


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Staging:
    """Host int32 buffer(s) for one step's inputs and, on a GPU, their device twin.

    CPU: one plain numpy buffer that the model reads in place. GPU: two pinned
    buffers used in turn; ``upload`` issues the step's single H2D copy and records an
    event that the next ``acquire`` of the same buffer waits on."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._alloc(n)

    def _alloc(self, n: int) -> None:
        self.n = n
        if self.cuda:
            self.host = [torch.zeros(n, dtype=torch.int32, pin_memory=True) for _ in range(2)]
            self.events: list[torch.cuda.Event | None] = [None, None]
        else:
            self.host = [torch.zeros(n, dtype=torch.int32)]
        self.np = [h.numpy() for h in self.host]
        self.i = 0

    def acquire(self, n: int) -> np.ndarray:
        if n > self.n:  # rare (forks past max_num_seqs, long block tables): grow, after the device is done
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self._alloc(max(n, 2 * self.n))
        if self.cuda:
            self.i ^= 1
            ev = self.events[self.i]
            if ev is not None:
                ev.synchronize()
        return self.np[self.i]

    def upload(self, dst: torch.Tensor | None, n: int) -> torch.Tensor:
        """The step's inputs as a tensor on the model's device (``dst[:n]`` on a GPU)."""
        if not self.cuda:
            return self.host[self.i][:n]
        dst[:n].copy_(self.host[self.i][:n], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.events[self.i] = ev
        return dst[:n]


class _Round:
    """A multi-step round queued on the device: its inputs (graph buffers or eager tensors, advanced
    in place from step to step), its tokens on the device and, once copied, on the host."""

    __slots__ = ("B", "params", "rand", "gens", "adjust", "lp_k", "graph", "inputs", "toks", "host", "event")

    def __init__(self, B: int, params: list, rand: list[int], gens: list,
                 adjust: LogitAdjustment | None = None) -> None:
        self.B, self.params, self.rand = B, params, rand
        self.gens = gens  # per row: a seeded request's NoiseStream, else None
        self.adjust = adjust  # logit bias / penalties, extended on the device by each step's tokens
        self.lp_k = logprob_width(params)  # top logprobs per row and step; None: nobody asked
        self.graph = 0  # padded batch size of the CUDA graph it replays; 0: eager
        self.inputs: tuple = ()
        self.toks: torch.Tensor | None = None
        self.host: tuple[torch.Tensor, ...] = ()  # tokens (+ chosen logprobs, top values, top ids)
        self.event: torch.cuda.Event | None = None


class _StepPlan:
    """Host-side arrays of one step, built with numpy from per-request scalars."""

    __slots__ = ("B", "T", "ids", "pos", "slots", "qsl", "seq_lens", "bt", "rows", "logits_idx",
                 "max_query_len", "max_seq_len")


class ModelRunner:
    def __init__(self, config: EngineConfig, state_dict: dict[str, torch.Tensor]) -> None:
        self.config = config
        if config.device == "cpu":
            configure_cpu_threads()
        self.device = torch.device(config.device)
        self.cuda = self.device.type == "cuda"
        # Random rows (seeded ones from their NoiseStreams) may be drawn inside multi-step rounds
        # (engine/multi_step.py): on a GPU, where the one-step path draws on the device the same way.
        # The CPU keeps its per-row multinomial draws and the one-step path.
        self.sample_on_device = self.cuda
        self.dtype = torch_dtype(config.dtype)
        self.block_size = config.cache.block_size
        self.max_model_len = max(config.scheduler.max_model_len, 1)
        self.max_blocks_per_seq = _cdiv(self.max_model_len, self.block_size)
        m = config.model
        self.model = LlamaForCausalLM(config.model, state_dict, self.dtype, self.device,
                                      max_positions=self.max_model_len)
        self.sched_cfg = config.scheduler
        n_stage = self._eager_layout_size(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs,
                                          self.max_blocks_per_seq)
        self.staging = _Staging(n_stage, self.device)
        self.eager_buf = torch.zeros(n_stage, dtype=torch.int32, device=self.device) if self.cuda else None
        reserve = 0
        if self.cuda:
            reserve = self._profile_reserve()
        self.num_blocks = num_blocks_for(config, reserve_bytes=reserve)
        self.kv_cache = torch.zeros(
            (self.num_blocks, m.num_layers, 2, self.block_size, m.num_kv_heads, m.head_dim),
            dtype=self.dtype, device=self.device,
        )
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_sizes: list[int] = []
        self.graph_capture_s = 0.0
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        if self.cuda and os.environ.get("KVMESH_ENFORCE_EAGER", "0") in ("", "0"):
            self._capture_graphs()
        self.warm_up_s = 0.0
        self.warm_up_configs = 0
        if self.cuda:
            self._warm_up_attention()
            self._warm_up_sampler()

    # ---- memory ---------------------------------------------------------------------------
    def _profile_reserve(self) -> int:
        """Run the largest eager step once on a scratch cache; return the bytes a step needs on top
        of what is allocated now (activation peak, graph pool estimate, sampler logits)."""
        cfg, sc = self.config.model, self.sched_cfg
        T = max(1, min(sc.max_num_batched_tokens, self.max_model_len))
        nb = _cdiv(T, self.block_size) + 1
        scratch = torch.zeros((nb, cfg.num_layers, 2, self.block_size, cfg.num_kv_heads, cfg.head_dim),
                              dtype=self.dtype, device=self.device)
        dev = self.device
        i32 = dict(dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(T, **i32), block_tables=torch.arange(nb, **i32)[None],
            query_start_loc=torch.tensor([0, T], **i32), seq_lens=torch.tensor([T], **i32),
            max_query_len=T, max_seq_len=T)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        self.model(torch.zeros(T, **i32), torch.arange(T, **i32), scratch, meta,
                   torch.arange(min(T, sc.max_num_seqs), **i32))
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del scratch, meta
        torch.cuda.empty_cache()
        # Graph outputs (bf16 + fp32 logits per captured size) and the sampler's copies.
        bmax = min(GRAPH_SIZES[-1], sc.max_num_seqs)
        logits = 4 * sc.max_num_seqs * cfg.vocab_size * 4
        graphs = 2 * (sum(s for s in GRAPH_SIZES if s <= bmax) * cfg.vocab_size * 6) + (256 << 20)
        return peak + logits + graphs

    # ---- inputs ---------------------------------------------------------------------------
    @staticmethod
    def _eager_layout_size(T: int, B: int, W: int) -> int:
        return 3 * T + 3 * B + 1 + B * W + 7 * 3  # + alignment padding of the 7 inputs

    def _plan(self, sched: SchedulerOutput) -> _StepPlan:
        bs = self.block_size
        scheduled = sched.scheduled
        B = len(scheduled)
        reqs = [s.request for s in scheduled]
        n_tok = np.fromiter((s.num_tokens for s in scheduled), np.int64, B)
        starts = np.fromiter((r.num_computed_tokens for r in reqs), np.int64, B)
        totals = np.fromiter((r.num_tokens for r in reqs), np.int64, B)
        ends = starts + n_tok
        qsl = np.zeros(B + 1, np.int64)
        np.cumsum(n_tok, out=qsl[1:])
        T = int(qsl[-1])
        p = _StepPlan()
        p.B, p.T = B, T
        if T == B:  # pure decode: one token per request
            p.ids = np.fromiter((r.all_token_ids[s] for r, s in zip(reqs, starts.tolist())), np.int64, B)
        else:
            p.ids = np.fromiter(itertools.chain.from_iterable(
                r.all_token_ids[a:b] for r, a, b in zip(reqs, starts.tolist(), ends.tolist())), np.int64, T)
        bt = self._block_table([s.block_ids for s in scheduled])
        trow = np.repeat(np.arange(B), n_tok)
        pos = np.arange(T) - qsl[:-1][trow] + starts[trow]
        p.pos = pos
        p.slots = bt[trow, pos // bs] * bs + pos % bs
        p.qsl = qsl
        p.seq_lens = ends
        p.bt = bt
        p.rows = np.nonzero(ends >= totals)[0]
        p.logits_idx = qsl[p.rows + 1] - 1
        p.max_query_len = int(n_tok.max()) if B else 0
        p.max_seq_len = int(ends.max()) if B else 0
        return p

    @staticmethod
    def _block_table(block_ids: list[list[int]]) -> np.ndarray:
        """``[B, max blocks]`` int64, rows left-aligned, zero-padded (padding is never read: seq_lens)."""
        B = len(block_ids)
        blens = np.fromiter((len(b) for b in block_ids), np.int64, B)
        W = int(blens.max()) if B else 0
        nblk = int(blens.sum())
        flat = np.fromiter(itertools.chain.from_iterable(block_ids), np.int64, nblk)
        brow = np.repeat(np.arange(B), blens)
        bstart = np.zeros(B, np.int64)
        np.cumsum(blens[:-1], out=bstart[1:])
        bt = np.zeros((B, max(W, 1)), np.int64)
        bt[brow, np.arange(nblk) - bstart[brow]] = flat
        return bt

    # ---- execution ------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """Run one step. Returns ``(logits, rows)``: ``logits[j]`` belongs to ``sched.scheduled[rows[j]]``."""
        self._apply_copies(sched)
        if not sched.scheduled:
            return torch.empty(0, self.config.model.vocab_size), []
        p = self._plan(sched)
        rows = p.rows.tolist()
        if self._uses_graph(p):
            logits = self._run_graph(p)
            self.num_graph_steps += 1
            if len(rows) != p.B:
                logits = logits.index_select(0, torch.as_tensor(p.rows, device=self.device))
            return logits, rows
        self.num_eager_steps += 1
        return self._run_eager(p), rows

    def _apply_copies(self, sched: SchedulerOutput) -> None:
        if sched.block_copies:
            cp = torch.tensor(sched.block_copies, dtype=torch.int64).T.contiguous().to(self.device)
            kernels.copy_blocks(self.kv_cache, cp[0], cp[1])

    def _uses_graph(self, p: _StepPlan) -> bool:
        return bool(self.graphs) and p.T == p.B and p.B <= self.graph_sizes[-1] \
            and p.bt.shape[1] <= self.max_blocks_per_seq

    def launch_multi(self, sched: SchedulerOutput, k: int) -> "_Round":
        """Queue ``k`` decode steps on the device (engine/multi_step.py decides when); no host wait.

        Every scheduled request decodes one token and its blocks already cover ``k`` more
        positions. Step ``i + 1`` reads step ``i``'s token from the device (argmax, or a
        random draw, seeded or not: `sampler.draw_on_device`), so the host builds inputs once;
        `collect` reads all ``k x B`` tokens in one copy, and `continue_multi` may queue the
        next round behind this one before that (async scheduling)."""
        self._apply_copies(sched)
        p = self._plan(sched)
        if p.T != p.B or len(p.rows) != p.B:
            raise ValueError("a decode round needs a pure decode step")
        params = [s.request.params for s in sched.scheduled]
        rand = [j for j, sp in enumerate(params) if not sp.greedy]
        rnd = _Round(p.B, params, rand, [s.request.generator for s in sched.scheduled])
        adjusted = any(sp.adjusts_logits for sp in params)
        hist = [s.request.penalty_history() for s in sched.scheduled] if adjusted else None
        if self._uses_graph(p):
            rnd.graph = next(s for s in self.graph_sizes if s >= p.B)
            ids, pos, m = self._graph_views(rnd.graph)
            B = p.B  # the real rows of the padded graph inputs: only these advance
            rnd.inputs = (ids[:B], pos[:B], AttentionMetadata(
                slot_mapping=m.slot_mapping[:B], block_tables=m.block_tables[:B], query_start_loc=m.query_start_loc,
                seq_lens=m.seq_lens[:B], max_query_len=1, max_seq_len=m.max_seq_len))
            first = self._run_graph(p)
        else:
            def up(a):  # queued copies: the host does not wait for a round in flight
                return to_device(a, self.device, torch.int32)

            meta = AttentionMetadata(slot_mapping=up(p.slots), block_tables=up(p.bt), query_start_loc=up(p.qsl),
                                     seq_lens=up(p.seq_lens), max_query_len=1, max_seq_len=p.max_seq_len)
            rnd.inputs = (up(p.ids), up(p.pos), meta)
            first = self.model(rnd.inputs[0], rnd.inputs[1], self.kv_cache, meta, None)
        if adjusted:
            rnd.adjust = LogitAdjustment.build(params, hist, first.shape[-1], first.device)
        self._run_steps(rnd, k, first)
        return rnd

    def continue_multi(self, prev: "_Round", k: int, block_ids: list[list[int]]) -> "_Round":
        """Queue ``k`` more decode steps for the same sequences behind ``prev``, before its tokens
        reach the host: the first step's inputs are ``prev``'s last tokens, on the device.
        ``block_ids``: each sequence's blocks, now covering ``k`` more positions."""
        rnd = _Round(prev.B, prev.params, prev.rand, prev.gens, prev.adjust)  # histories run on from prev's
        rnd.graph, rnd.inputs = prev.graph, prev.inputs
        bt = self._block_table(block_ids)
        if rnd.graph:
            o, W = self._graph_layout(), self.max_blocks_per_seq
            if bt.shape[1] > W:
                raise ValueError(f"block table of {bt.shape[1]} blocks exceeds the graphs' {W}")
            buf = self.staging.acquire(rnd.B * W)
            buf[:rnd.B * W].reshape(rnd.B, W)[:, :bt.shape[1]] = bt
            self.staging.upload(self.graph_buf[o[5]:], rnd.B * W)  # stream-ordered after prev's reads
        else:
            rnd.inputs[2].block_tables = to_device(bt, self.device, torch.int32)
        self._step_inputs(rnd, prev.toks[-1])
        self._run_steps(rnd, k, self._forward_again(rnd))
        return rnd

    def collect(self, rnd: "_Round") -> list[list[SampleResult]]:
        """Wait for a round's tokens: ``results[i][j]``, step ``i``, sequence ``j`` (with logprobs
        for the sequences that asked for them)."""
        if rnd.event is not None:
            rnd.event.synchronize()
        host = [h.tolist() for h in rnd.host]
        if rnd.lp_k is None:
            return [[SampleResult(t) for t in step] for step in host[0]]
        return [results_with_logprobs(*step) for step in zip(host[0], [rnd.params] * len(host[0]), *host[1:])]

    def _run_steps(self, rnd: "_Round", k: int, logits: torch.Tensor) -> None:
        """Draw from the first step's ``logits``, then run the other ``k - 1`` steps; tokens to the host."""
        toks = torch.empty((k, rnd.B), dtype=torch.int64, device=self.device)
        lps = []  # per step, with logprobs: (chosen, top values, top ids) of the raw distribution
        for i in range(k):
            if i:
                self._step_inputs(rnd, toks[i - 1])
                logits = self._forward_again(rnd)
            raw = logits
            if rnd.adjust is not None:
                logits = rnd.adjust.apply(logits)
            toks[i] = (draw_on_device(logits, rnd.params, rnd.rand, generators=rnd.gens) if rnd.rand
                       else logits.argmax(-1))
            if rnd.adjust is not None:
                rnd.adjust.extend(toks[i])
            if rnd.lp_k is not None:
                lps.append(device_logprobs(raw, toks[i], rnd.lp_k))
        if rnd.graph:
            self.num_graph_steps += k
        else:
            self.num_eager_steps += k
        rnd.toks = toks
        out = (toks,) + tuple(torch.stack(a) for a in zip(*lps))
        if self.cuda:
            rnd.host = tuple(t.to("cpu", non_blocking=True) for t in out)
            rnd.event = torch.cuda.Event()
            rnd.event.record()
        else:
            rnd.host = out

    def _step_inputs(self, rnd: "_Round", tok: torch.Tensor) -> None:
        ids, pos, meta = rnd.inputs
        self._advance(tok, ids, pos, meta.slot_mapping, meta.seq_lens, meta.block_tables)
        if not rnd.graph:
            meta.max_seq_len += 1

    def _forward_again(self, rnd: "_Round") -> torch.Tensor:
        """One more step on a round's (already advanced) inputs."""
        if rnd.graph:
            g, out = self.graphs[rnd.graph]
            g.replay()
            return out[:rnd.B]
        ids, pos, meta = rnd.inputs
        return self.model(ids, pos, self.kv_cache, meta, None)

    def _advance(self, tok, ids, pos, slots, seq_lens, bt) -> None:
        """Turn one decode step's inputs into the next one's, on the device, in place."""
        ids.copy_(tok)
        pos.add_(1)
        seq_lens.add_(1)
        blk = bt.gather(1, torch.div(pos, self.block_size, rounding_mode="floor").long()[:, None])[:, 0]
        slots.copy_(blk * self.block_size + pos % self.block_size)

    def _run_eager(self, p: _StepPlan) -> torch.Tensor:
        B, T, R, W = p.B, p.T, len(p.rows), p.bt.shape[1]
        # Each input starts 16-byte aligned: Triton specialises pointer arguments on alignment, and
        # offsets that moved with T and B made a new compile of the attention kernel for some batches.
        sizes = (T, T, T, B + 1, B, R, B * W)
        offs = np.cumsum([0] + [_align4(n) for n in sizes]).tolist()
        buf = self.staging.acquire(offs[-1])
        for k, arr in enumerate((p.ids, p.pos, p.slots, p.qsl, p.seq_lens, p.logits_idx, p.bt.reshape(-1))):
            buf[offs[k]:offs[k] + sizes[k]] = arr
        if self.cuda and offs[-1] > self.eager_buf.numel():
            self.eager_buf = torch.zeros(self.staging.n, dtype=torch.int32, device=self.device)
        t = self.staging.upload(self.eager_buf, offs[-1])
        v = [t[offs[k]:offs[k] + sizes[k]] for k in range(7)]
        meta = AttentionMetadata(slot_mapping=v[2], block_tables=v[6].view(B, W), query_start_loc=v[3],
                                 seq_lens=v[4], max_query_len=p.max_query_len, max_seq_len=p.max_seq_len)
        return self.model(v[0], v[1], self.kv_cache, meta, v[5])

    # ---- Triton warm-up -------------------------------------------------------------------
    def attention_launch_configs(self) -> list[dict]:
        """Every attention launch configuration this engine's steps can ask for: `attention_config`
        over a grid of batch shapes covering its limits (sequences, query lengths, contexts)."""
        m, sc = self.model.cfg, self.sched_cfg
        seqs = sorted({b for b in (1, 2, 3, 4, 6, 8, 12, 16, 17, 24, 32, 33, 48, 64, 96, 128, 192, 256, 512)
                       if b <= sc.max_num_seqs} | {sc.max_num_seqs})
        qlens = sorted({q for q in (1, 2, 3, 4, 5, 8, 16, 17, 32, 64, 128, 512, 2048, sc.max_num_batched_tokens)
                        if q <= sc.max_num_batched_tokens})
        ctxs = sorted({c for c in (1, 16, 64, 65, 128, 256, 512, 1024, 2048, 2049, 4096, 8192, 16384, 32768)
                       if c <= self.max_model_len} | {self.max_model_len})
        seen: dict[tuple, dict] = {}
        for b in seqs:
            for q in qlens:
                for c in ctxs:
                    if c < q or b * q > max(sc.max_num_batched_tokens, b):
                        continue
                    cfg = kernels.attention_config(b * q, b, m.num_heads, m.num_kv_heads, m.head_dim, q, c,
                                                   self.device, self.dtype)
                    seen.setdefault(tuple(sorted(cfg.items())), cfg)
        return list(seen.values())

    def _warm_up_attention(self) -> None:
        """Compile every attention launch configuration now, on dummy decode launches.

        Triton compiles a kernel variant on its first launch (seconds each). Graph capture
        compiles the decode variants; the eager ones (prefill chunks, mixed batches, split-KV for
        few sequences) would otherwise compile during a fresh pod's first requests. Integer
        arguments that vary per batch are not specialised on and eager inputs are 16-byte
        aligned, so the configuration alone decides which variant runs. Each configuration is
        launched for one token and for two: one-token calls run with programmatic dependent
        launch on Hopper (`kernels.ops._pdl`), a variant of its own."""
        t0 = time.perf_counter()
        m = self.model.cfg
        dev, D = self.device, m.head_dim
        k_cache, v_cache = self.model.layer_caches(self.kv_cache)[0]
        configs = self.attention_launch_configs()
        for n in (1, 2):  # n one-token sequences
            q = torch.zeros((n, m.num_heads, D), dtype=self.dtype, device=dev)
            bt = torch.zeros((n, 16), dtype=torch.int32, device=dev)
            qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
            seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
            for cfg in configs:
                kernels.paged_attention(q, k_cache, v_cache, bt, qsl, seq_lens, 1.0, max_query_len=1,
                                        max_seq_len=1, **cfg)
        torch.cuda.synchronize(dev)
        self.warm_up_s = time.perf_counter() - t0
        self.warm_up_configs = len(configs)
        log.info("compiled %d attention launch configurations in %.1fs", len(configs), self.warm_up_s)

    def _warm_up_sampler(self) -> None:
        """Compile the device sampler's Triton kernels (the top-p search and the race) on one dummy
        draw, so a pod's first sampled batch does not wait for the JIT either. Their variants depend only on the vocabulary (a row stride)."""
        V = self.config.model.vocab_size
        logits = torch.zeros((2, V), dtype=torch.float32, device=self.device)
        params = [SamplingParams(temperature=0.8, top_p=0.9, min_p=0.01)] * 2
        draw_on_device(logits, params, [0, 1])
        torch.cuda.synchronize(self.device)

    # ---- CUDA graphs ----------------------------------------------------------------------
    def _graph_layout(self) -> tuple[int, ...]:
        bmax, W = self.graph_sizes[-1], self.max_blocks_per_seq
        # ids | positions | slots | query_start_loc | seq_lens | block tables
        return tuple(np.cumsum([0, bmax, bmax, bmax, bmax + 1, bmax, bmax * W]).tolist())

    def _graph_views(self, b: int):
        o = self._graph_layout()
        g = self.graph_buf
        W = self.max_blocks_per_seq
        bt = g[o[5]:o[6]].view(self.graph_sizes[-1], W)[:b]
        meta = AttentionMetadata(slot_mapping=g[o[2]:o[2] + b], block_tables=bt, query_start_loc=g[o[3]:o[3] + b + 1],
                                 seq_lens=g[o[4]:o[4] + b], max_query_len=1, max_seq_len=self.max_model_len)
        return g[o[0]:o[0] + b], g[o[1]:o[1] + b], meta

    def _capture_graphs(self) -> None:
        """Capture one graph per padded decode batch size, largest first, sharing one memory pool."""
        t0 = time.perf_counter()
        self.graph_sizes = [s for s in GRAPH_SIZES if s <= self.sched_cfg.max_num_seqs] or [1]
        o = self._graph_layout()
        self.graph_buf = torch.zeros(o[-1], dtype=torch.int32, device=self.device)
        self.graph_buf[o[2]:o[3]] = -1  # padding slots: write_kv skips them
        need = o[-1]
        if need > self.staging.n:
            self.staging = _Staging(max(need, self.staging.n), self.device)
        pool = None
        for b in reversed(self.graph_sizes):
            ids, pos, meta = self._graph_views(b)
            self.model(ids, pos, self.kv_cache, meta, None)  # warm-up: Triton compiles, cuBLAS picks kernels
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self.model(ids, pos, self.kv_cache, meta, None)
            pool = g.pool()
            self.graphs[b] = (g, out)
        torch.cuda.synchronize(self.device)
        self.graph_capture_s = time.perf_counter() - t0
        log.info("captured %d decode CUDA graphs (sizes %s) in %.1fs", len(self.graphs), self.graph_sizes,
                 self.graph_capture_s)

    def _run_graph(self, p: _StepPlan) -> torch.Tensor:
        b = p.B
        size = next(s for s in self.graph_sizes if s >= b)
        o = self._graph_layout()
        W = self.max_blocks_per_seq
        n = o[5] + size * W
        buf = self.staging.acquire(n)
        buf[o[0]:o[0] + b] = p.ids
        buf[o[0] + b:o[0] + size] = 0
        buf[o[1]:o[1] + b] = p.pos
        buf[o[1] + b:o[1] + size] = 0
        buf[o[2]:o[2] + b] = p.slots
        buf[o[2] + b:o[2] + size] = -1
        buf[o[3]:o[3] + b + 1] = p.qsl
        buf[o[3] + b + 1:o[3] + size + 1] = b
        buf[o[4]:o[4] + b] = p.seq_lens
        buf[o[4] + b:o[4] + size] = 0
        w = p.bt.shape[1]
        buf[o[5]:o[5] + size * W].reshape(size, W)[:b, :w] = p.bt  # stale tails are never read (seq_lens)
        self.staging.upload(self.graph_buf, n)
        g, out = self.graphs[size]
        g.replay()
        return out[:b]
