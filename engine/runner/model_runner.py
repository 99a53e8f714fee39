"""Turns a scheduler step into flat model inputs, runs the model, returns last-token logits.

It owns the KV tensor ``[num_blocks, num_layers, 2, block_size, Hkv, D]`` (block
first, so a block of all layers is one contiguous range for the connectors). The
inputs are planned and staged as engine/runner/inputs.py says: one host-to-device
copy per step on a GPU.

GPU only:

* the KV pool is sized from free device memory after a profiling forward pass of
  ``max_num_batched_tokens`` tokens (the activation peak), minus a reserve for the
  CUDA graphs and the sampler's logits (engine/runner/memory.py);
* pure decode steps replay a CUDA graph (engine/runner/graphs.py), and so do speculative decoding's
  steps in which every sequence verifies exactly k drafts; prefill, mixed steps and other verification
  steps run eagerly. ``KVMESH_ENFORCE_EAGER=1`` turns graphs off (debugging, comparisons);
* every Triton kernel variant is compiled at start-up (engine/runner/warmup.py).

Decode rounds (several steps per host round trip) are engine/runner/rounds.py.

LoRA (engine/lora/): the runner holds its rank's share of every registered adapter on the host and
the model's device slot pool; the engine says which adapter a slot holds (`load_lora_slot`) and each
step's plan carries every token's slot. A tensor-parallel rank 0 forwards all three to the others.
"""

from __future__ import annotations

import torch

from kvmesh import kernels
from kvmesh.common.env import env
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.connectors.common import LocalBlocks
from kvmesh.engine.core.sched_output import SchedulerOutput
from kvmesh.engine.lora.adapter import LoraAdapter, LoraWeights
from kvmesh.engine.lora.pool import LoraPool
from kvmesh.engine.models import model_class
from kvmesh.engine.models.kv_scales import kv_cache_scales, scales_fingerprint
from kvmesh.engine.models.quantization import LayerQuantizer, fp8_before_split
from kvmesh.engine.parallel import messages
from kvmesh.engine.parallel.group import TPGroup
from kvmesh.engine.parallel.kv_shards import RankBlocks, ShardedBlocks, whole_block_shape
from kvmesh.engine.parallel.ranks import Ranks
from kvmesh.engine.parallel.sharding import Shard, TensorParallel, local_config
from kvmesh.engine.runner.graphs import DecodeGraphs
from kvmesh.engine.runner.host_kv import HostKV, disk_tier
from kvmesh.engine.runner.inputs import EagerStager, Staging, StepPlan, cdiv, eager_layout_size, plan_step
from kvmesh.engine.runner.memory import (
    configure_cpu_threads,
    kv_cache_dtype,
    num_blocks_for,
    profile_reserve,
    torch_dtype,
)
from kvmesh.engine.runner.rounds import DecodeRoundRunner
from kvmesh.engine.runner.warmup import attention_launch_configs, warm_up_attention, warm_up_sampler


class ModelRunner(DecodeRoundRunner):
    def __init__(
        self,
        config: EngineConfig,
        state_dict: dict[str, torch.Tensor],
        tp: TPGroup | None = None,
        extra_block_bytes: int = 0,
    ) -> None:
        """``tp``: this rank's group when the runner is another rank's (engine/parallel/worker.py); rank
        0 of a tensor-parallel engine (``config.parallel.tensor_parallel_size > 1``, no ``tp``) starts
        the other ranks itself and sends them every step it runs. ``extra_block_bytes``: bytes per block
        of a second pool with the same block ids (a draft model's KV), sized out of the same budget."""
        self.config = config
        self.extra_block_bytes = extra_block_bytes
        world = config.parallel.tensor_parallel_size
        self.ranks: Ranks | None = None
        if world > 1 and tp is None:
            self.ranks = Ranks(config)
            tp = self.ranks.group
        try:
            self._build(config, state_dict, tp)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise

    def _build(self, config: EngineConfig, state_dict: dict[str, torch.Tensor], tp: TPGroup | None) -> None:
        if config.device == "cpu":
            configure_cpu_threads(config.parallel.ranks_per_node)  # the ranks on this host share its cores
        self.device = torch.device(config.device)
        self.cuda = self.device.type == "cuda"
        # Random rows (seeded ones from their NoiseStreams) may be drawn inside decode rounds
        # (engine/core/decode_rounds.py): on a GPU, where the one-step path draws on the device the same way.
        # The CPU keeps its per-row multinomial draws and the one-step path.
        self.sample_on_device = self.cuda
        self.dtype = torch_dtype(config.dtype)
        self.block_size = config.cache.block_size
        self.max_model_len = max(config.scheduler.max_model_len, 1)
        self.max_blocks_per_seq = cdiv(self.max_model_len, self.block_size)
        m = config.model
        self.kv_dtype = kv_cache_dtype(config)
        fp8 = self.kv_dtype == torch.float8_e4m3fn
        scales = kv_cache_scales(state_dict, m, self.device) if fp8 else None
        # Part of the KV layout the connectors compare: the whole model's scales (a connector moves whole
        # blocks at any TP size, engine/parallel/kv_shards.py), taken before a rank keeps its heads' share.
        self.kv_scales_id = scales_fingerprint(scales)
        whole_cfg = m
        parallel: TensorParallel | None = None
        if tp is not None:  # this rank's slices of the weights, heads and MLP (engine/parallel/sharding.py)
            shard = Shard(tp.rank, tp.world, m)
            if config.quantization == "fp8" and config.model.quantization is None:
                # Quantize the whole projections first, then slice weights and scales: a scale per output
                # channel over the whole row, as one rank computes it (o and down split their rows'
                # columns across ranks), so every rank holds exactly one rank's e4m3 values.
                state_dict = fp8_before_split(state_dict, m.num_layers)
            state_dict = {k: shard(k, v) for k, v in state_dict.items()}
            if scales is not None:
                heads = shard.kv_heads()
                scales = [(k[heads], v[heads]) for k, v in scales]
            parallel = TensorParallel(tp, shard.vocab_rows, m.vocab_size)
            m = local_config(m, tp.world)
        quantizer = None
        if config.quantization == "fp8":
            quantizer = LayerQuantizer(state_dict, online=config.model.quantization is None)
        self.model = model_class(config.model)(
            m,
            state_dict,
            self.dtype,
            self.device,
            max_positions=self.max_model_len,
            kv_scales=scales,
            on_layer=quantizer,
            kernel_choices=config.kernels,
            tp=parallel,
        )
        if quantizer is not None:
            quantizer.log()
        # LoRA: the slot pool before profiling and graph capture (both run the LoRA path)
        self.lora_enabled = config.lora.enabled
        self.lora_weights: dict[str, LoraWeights] = {}  # adapter key -> this rank's (A, B) on the host
        self.lora_shard = Shard(tp.rank, tp.world, whole_cfg) if tp is not None else None
        if self.lora_enabled:
            self.model.lora = LoraPool(m, config.lora.max_loras, config.lora.max_lora_rank, self.dtype, self.device)
            if self.model.stack_lora() and self.cuda:  # the base weights moved: their old memory goes back
                torch.cuda.empty_cache()
        self.sched_cfg = config.scheduler
        n_stage = eager_layout_size(
            config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs, self.max_blocks_per_seq
        )
        self.staging = Staging(n_stage, self.device)
        self.eager = EagerStager(self.staging)
        reserve = 0
        if self.cuda:
            reserve = profile_reserve(self.model, config, self.max_model_len, self.dtype, self.device)
        self.num_blocks = num_blocks_for(
            config, reserve_bytes=reserve, kv_heads=m.num_kv_heads, extra_bytes_per_block=self.extra_block_bytes
        )
        if tp is not None:  # every rank's pool holds the same block ids: the smallest pool for all
            self.num_blocks = tp.min_int(self.num_blocks)
        self.kv_cache = torch.zeros(
            (self.num_blocks, m.num_layers, 2, self.block_size, m.num_kv_heads, m.head_dim),
            dtype=self.kv_dtype,
            device=self.device,
        )
        # The host-memory tier (--kv-offload-gb, engine/runner/host_kv.py): every rank keeps its own heads'
        # copy, as many slots on every rank (the scheduler's slot ids address them all).
        cc = config.cache
        self.num_host_blocks = HostKV.num_slots(cc.kv_offload_gb, self.kv_cache, cc.kv_offload_blocks)
        if tp is not None and (cc.kv_offload_gb > 0 or cc.kv_offload_blocks > 0):
            self.num_host_blocks = tp.min_int(self.num_host_blocks)
        self.num_disk_blocks, disk = disk_tier(config, self.kv_cache, self.num_host_blocks, tp)
        self.host_kv = HostKV(self.num_host_blocks, self.kv_cache, disk) if self.num_host_blocks else None
        # How connectors move whole blocks: this pool's, or (rank 0 of a TP engine) every rank's heads.
        self.kv_blocks: LocalBlocks | ShardedBlocks = LocalBlocks(self.kv_cache, self.kv_scales_id)
        self.rank_blocks: RankBlocks | None = None
        if tp is not None:
            if tp.rank == 0:
                assert self.ranks is not None
                self.kv_blocks = ShardedBlocks(self.kv_cache, whole_cfg, self.ranks, self.kv_scales_id)
            shard = Shard(tp.rank, tp.world, whole_cfg)
            self.rank_blocks = RankBlocks(self.kv_cache, shard.kv_heads(), whole_block_shape(self.kv_cache, whole_cfg))
        self.tp_group = tp
        self.graphs: DecodeGraphs | None = None
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        # steps verifying drafts (engine/spec/), part of the two above: replayed from a verification graph,
        # or eager (rows with different numbers of drafts, or none, beside them; no graphs)
        self.num_verify_graph_steps = 0
        self.num_verify_eager_steps = 0
        # CUDA graphs hold one rank's launches; under tensor parallelism steps run eagerly for now.
        if self.cuda and not env().enforce_eager and tp is None:
            spec = config.speculative
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_cache,
                self.staging,
                self.sched_cfg.max_num_seqs,
                self.max_blocks_per_seq,
                self.max_model_len,
                self.device,
                num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
                max_num_batched_tokens=self.sched_cfg.max_num_batched_tokens,
            )
            self.graphs.capture()
        self.warm_up_s = 0.0
        self.warm_up_configs = 0
        if self.cuda:
            configs = self.attention_launch_configs()
            self.warm_up_s = warm_up_attention(self.model, self.kv_cache, configs, self.dtype, self.device)
            self.warm_up_configs = len(configs)
            warm_up_sampler(self.config.model.vocab_size, self.device)

    @property
    def graph_sizes(self) -> list[int]:
        """Padded batch sizes with a captured decode graph (none when eager)."""
        return self.graphs.sizes if self.graphs is not None else []

    @property
    def verify_graph_sizes(self) -> list[int]:
        """Padded batch sizes with a captured verification graph (none without speculation, or when eager)."""
        return self.graphs.verify_sizes if self.graphs is not None else []

    @property
    def graph_capture_s(self) -> float:
        return self.graphs.capture_s if self.graphs is not None else 0.0

    def attention_launch_configs(self) -> list[dict]:
        """Every attention launch configuration this engine's steps can ask for (engine/runner/warmup.py)."""
        return attention_launch_configs(
            self.model.cfg, self.sched_cfg, self.max_model_len, self.device, self.dtype, self.config.kernels
        )

    # ---- execution ------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """Run one step. Returns ``(logits, rows)``: ``logits[j]`` belongs to ``sched.scheduled[rows[j]]``."""
        if self.ranks is None:
            return self._execute(sched)
        try:
            return self._execute(sched)
        except Exception as e:
            self.ranks.check(e)  # a dead rank: RankFailure, which stops the engine
            raise

    def _execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        p = plan_step(sched, self.block_size, self.lora_enabled) if sched.scheduled else None
        gather: list[int] = []
        if self.ranks is not None:  # the other ranks run the same step from its plan
            assert isinstance(self.kv_blocks, ShardedBlocks)
            writes = self.kv_blocks.take_writes()
            gather = self.kv_blocks.take_wanted() if p is not None else []
            self.ranks.send_step(sched.block_copies, p, writes, gather)
        self._apply_copies(sched.block_copies)
        if p is None:
            return torch.empty(0, self.config.model.vocab_size), []
        rows = p.rows.tolist()
        verifying = len(p.logits_idx) > len(p.rows)  # some row keeps the logits of 1 + k positions
        if gather:  # a connector saves blocks this step: after the forward, every rank's heads of them
            logits = self._run_eager(p)
            self.num_eager_steps += 1
            self.num_verify_eager_steps += int(verifying)
            assert self.ranks is not None and isinstance(self.kv_blocks, ShardedBlocks)
            self.kv_blocks.assemble(self.ranks.group, gather)
            return logits, rows
        if self._uses_graph(p):
            assert self.graphs is not None
            logits = self.graphs.run(p)  # every token's
            self.num_graph_steps += 1
            self.num_verify_graph_steps += int(verifying)
            if len(p.logits_idx) != p.T:
                logits = logits.index_select(0, torch.as_tensor(p.logits_idx, device=self.device))
            return logits, rows
        self.num_eager_steps += 1
        self.num_verify_eager_steps += int(verifying)
        return self._run_eager(p), rows

    def move_kv(self, moves: list[tuple[int, int, int]], wait: bool = False) -> None:
        """Apply the host tier's planned copies (engine/core/host_pool.py) before anything else writes
        the device blocks; under tensor parallelism every rank applies them to its heads. ``wait``: done
        when this returns (a connector is about to write blocks outside the compute stream)."""
        if not moves or self.host_kv is None:
            return
        if self.ranks is not None:
            self.ranks.send(messages.encode(messages.KvMoves(moves, wait)))
        self.host_kv.apply(moves, wait)

    def flush_kv_writes(self) -> None:
        """Send the other ranks the blocks a connector loaded when no forward follows (a step of only
        async loads), so they hold them before any forward reads them."""
        if self.ranks is not None and isinstance(self.kv_blocks, ShardedBlocks):
            writes = self.kv_blocks.take_writes()
            if writes:
                self.ranks.send_step([], None, writes)

    def run_step(self, step: messages.Step) -> None:
        """Another rank's step: rank 0's block copies, loaded blocks and plan, the same forward (its
        logits unused), then its heads of the blocks rank 0 saves."""
        assert self.rank_blocks is not None and self.tp_group is not None
        for b, data in step.kv_writes:
            self.rank_blocks.write_whole(b, data)
        self._apply_copies(step.copies)
        p = messages.plan_of(step)
        if p is not None:
            self.num_eager_steps += 1
            self._run_eager(p)
        if step.kv_gather:
            self.rank_blocks.send(self.tp_group, step.kv_gather)

    # ---- LoRA adapters (engine/lora/) -----------------------------------------------------------
    def add_lora(self, adapter: LoraAdapter) -> None:
        """Keep this rank's share of a registered adapter's weights on the host (every rank's)."""
        if self.ranks is not None:
            arrays = {
                f"{li}.{m}.{ab}": messages.Array.of(t.float().numpy())
                for (li, m), pair in adapter.weights.items()
                for ab, t in zip("AB", pair)
            }
            self.ranks.send(messages.encode(messages.LoraAdd(adapter.key, arrays)))
        self._keep_lora(adapter.key, adapter.weights)

    def load_lora_slot(self, slot: int, key: str) -> None:
        """Device slot ``slot`` holds adapter ``key`` (registered) from the next step on."""
        if self.ranks is not None:
            self.ranks.send(messages.encode(messages.LoraSlot(slot, key)))
        assert self.model.lora is not None
        self.model.lora.load(slot, self.lora_weights[key])

    def drop_lora(self, key: str) -> None:
        if self.ranks is not None:
            self.ranks.send(messages.encode(messages.LoraDrop(key)))
        self.lora_weights.pop(key, None)

    def lora_message(self, msg: messages.LoraAdd | messages.LoraSlot | messages.LoraDrop) -> None:
        """Another rank's side of `add_lora`, `load_lora_slot` and `drop_lora`."""
        if isinstance(msg, messages.LoraAdd):
            weights: LoraWeights = {}
            for name, arr in msg.arrays.items():
                li, module, ab = name.split(".")
                a, b = weights.get((int(li), module), (None, None))
                t = torch.from_numpy(arr.array()).to(self.dtype)
                weights[(int(li), module)] = (t, b) if ab == "A" else (a, t)  # type: ignore[assignment]
            self._keep_lora(msg.key, weights)
        elif isinstance(msg, messages.LoraSlot):
            self.load_lora_slot(msg.slot, msg.key)
        else:
            self.drop_lora(msg.key)

    def _keep_lora(self, key: str, weights: LoraWeights) -> None:
        self.lora_weights[key] = self.lora_shard.lora(weights) if self.lora_shard is not None else weights

    def close(self) -> None:
        """Stop the other ranks (rank 0 of a tensor-parallel engine); close the disk tier's file."""
        if self.ranks is not None:
            self.ranks.close()
        if self.host_kv is not None:
            self.host_kv.close()

    def _apply_copies(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            cp = torch.tensor(copies, dtype=torch.int64).T.contiguous().to(self.device)
            kernels.copy_blocks(self.kv_cache, cp[0], cp[1])

    def _uses_graph(self, p: StepPlan) -> bool:
        return self.graphs is not None and self.graphs.fits(p)

    def _run_eager(self, p: StepPlan) -> torch.Tensor:
        v, meta = self.eager.stage(p)
        return self.model(v.ids, v.positions, self.kv_cache, meta, v.logits_idx)
