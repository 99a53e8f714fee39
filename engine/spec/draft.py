"""A draft model: a smaller model of the same tokenizer proposes k tokens, one step at a time.

Its paged KV is a second pool with the target's block ids: ``[num_blocks, draft layers, 2,
block_size, draft KV heads, draft head dim]``. A request's block table then addresses both, so the
draft needs no allocator of its own, prefix-cache hits, copy-on-write and freeing apply to both at
once, and a preempted request loses both. Both pools come out of one budget: the draft's weights are
on the device before the target's pool is sized, and each block costs the bytes of both (the
runner's ``extra_block_bytes``), so a model that is its own draft gets half the blocks. An explicit
``--num-kv-blocks`` is the number of blocks of each pool.

Per verification step, `propose` runs the draft over the request's tokens it has not seen yet (its
prompt on the first step, then the tokens the last verification accepted: ``Request.draft_kv_len``
counts what its KV holds), then ``k - 1`` one-token steps, all speculating rows batched in each. A
greedy request's drafts are the draft's argmax, taken on the device (only the ids come back); a random
one draws them from the draft's filtered distribution ``q`` with the request's own generator, on the
host (its logits row copied there), and ``q`` goes to the rejection sampler.
The draft runs eagerly on rank 0 (no CUDA graphs, no tensor parallelism).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvmesh import kernels
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.core.sched_output import ScheduledRequest, SchedulerOutput
from kvmesh.engine.models import model_class
from kvmesh.engine.models.loader import LoadedModel, load_model
from kvmesh.engine.runner.inputs import EagerStager, Staging, eager_layout_size, plan_step
from kvmesh.engine.runner.memory import torch_dtype
from kvmesh.engine.runner.sampling_filter import filter_row
from kvmesh.engine.spec.config import SpeculativeConfig
from kvmesh.engine.spec.rejection import host_generator

if TYPE_CHECKING:
    from kvmesh.engine.core.request import Request


class DraftModel:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        """The draft's weights on the device; its KV pool comes with `allocate` (once the runner has
        sized the shared budget)."""
        m = loaded.config
        if m.vocab_size != config.model.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({m.vocab_size} tokens) differs from the model's "
                f"({config.model.vocab_size}): a draft must share the tokenizer"
            )
        self.device = torch.device(config.device)
        self.dtype = torch_dtype(config.dtype)
        self.block_size = config.cache.block_size
        max_len = max(config.scheduler.max_model_len, 1)
        self.model = model_class(m)(m, loaded.state_dict, self.dtype, self.device, max_positions=max_len)
        self.block_shape = (m.num_layers, 2, self.block_size, m.num_kv_heads, m.head_dim)
        self.kv_cache = torch.zeros((0, *self.block_shape), dtype=self.dtype, device=self.device)
        sc = config.scheduler
        self.eager = EagerStager(
            Staging(eager_layout_size(sc.max_num_batched_tokens, sc.max_num_seqs, 64), self.device)
        )
        self.generator = torch.Generator(device="cpu").manual_seed(config.seed)  # unseeded requests' draws
        self.source = loaded.source

    @classmethod
    def load(cls, spec: SpeculativeConfig, config: EngineConfig) -> DraftModel:
        return cls(config, load_model(spec.model, load_tokenizer=False))

    @property
    def bytes_per_block(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * self.kv_cache.element_size()

    def allocate(self, num_blocks: int) -> None:
        """The draft's KV pool: as many blocks as the model's, the same ids."""
        self.kv_cache = torch.zeros((num_blocks, *self.block_shape), dtype=self.dtype, device=self.device)

    def _forward(self, entries: list[ScheduledRequest]) -> torch.Tensor:
        """The draft's logits after each entry's last token (float32, on the device)."""
        p = plan_step(SchedulerOutput(scheduled=entries), self.block_size)
        v, meta = self.eager.stage(p)
        with torch.inference_mode():
            out = self.model(v.ids, v.positions, self.kv_cache, meta, v.logits_idx)
        return out.float()

    def propose(
        self,
        rows: list[ScheduledRequest],
        ks: list[int],
        copies: list[tuple[int, int]],
        requests: dict[str, Request],
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Drafts (``ks[i]`` for ``rows[i]``, whose blocks hold their slots) and, for random rows,
        the distributions they were drawn from (``[k, V]``; None for greedy rows)."""
        if copies:  # the step's copy-on-write copies hold the draft's KV too
            cp = torch.tensor(copies, dtype=torch.int64).T.contiguous().to(self.device)
            kernels.copy_blocks(self.kv_cache, cp[0], cp[1])
        reqs = [requests[s.request_id] for s in rows]
        gens = [host_generator(s.generator, self.generator) if not s.params.greedy else None for s in rows]
        drafts: list[list[int]] = [[] for _ in rows]
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        # catch up over the tokens the draft has not seen, ending with the request's last token
        entries = []
        for s, r in zip(rows, reqs):
            toks = r.all_token_ids
            start = min(r.draft_kv_len, len(toks) - 1)
            entries.append(
                ScheduledRequest(s.request_id, toks, start, len(toks) - start, s.params, block_ids=s.block_ids)
            )
        logits = self._forward(entries)
        active = list(range(len(rows)))
        for _ in range(max(ks)):
            self._draw(logits, active, rows, gens, drafts, qs)
            active = [i for i in active if len(drafts[i]) < ks[i]]
            if not active:
                break
            entries = []
            for i in active:
                toks = reqs[i].all_token_ids + drafts[i]
                entries.append(
                    ScheduledRequest(
                        rows[i].request_id, toks, len(toks) - 1, 1, rows[i].params, block_ids=rows[i].block_ids
                    )
                )
            logits = self._forward(entries)
        for r, d in zip(reqs, drafts):
            r.draft_kv_len = r.num_tokens + len(d) - 1  # its KV holds the tokens and every draft but the last
        return drafts, [torch.stack(q) if q else None for q in qs]

    @staticmethod
    def _draw(
        logits: torch.Tensor,
        active: list[int],
        rows: list[ScheduledRequest],
        gens: list[torch.Generator | None],
        drafts: list[list[int]],
        qs: list[list[torch.Tensor]],
    ) -> None:
        """One more draft for each of the ``active`` rows (``logits[n]``, on the device, is
        ``rows[active[n]]``'s). Greedy rows take the draft's argmax on the device and only their ids
        come to the host (the verification compares them with the target's); random rows' logits come
        to the host, where each draws from its filtered distribution ``q`` with its own generator, in
        row order."""
        greedy = [n for n, i in enumerate(active) if gens[i] is None]
        rand = [n for n, i in enumerate(active) if gens[i] is not None]
        if greedy:
            sel = logits if len(greedy) == len(active) else logits[greedy]
            for n, t in zip(greedy, sel.argmax(-1).tolist()):
                drafts[active[n]].append(t)
        if rand:
            host = logits[rand].cpu()
            for m, n in enumerate(rand):
                i = active[n]
                gen = gens[i]
                assert gen is not None
                q = filter_row(host[m], rows[i].params).softmax(-1)
                drafts[i].append(int(torch.multinomial(q, 1, generator=gen)))
                qs[i].append(q)

    def verified(self, req: Request, entry: ScheduledRequest, accepted: int) -> None:
        """The draft's KV is right up to the tokens the verification kept (the rejected drafts' is not)."""
        req.draft_kv_len = min(req.draft_kv_len, req.num_computed_tokens)
