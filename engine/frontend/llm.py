"""Offline generation: ``LLM(...).generate(prompts, params)`` on an in-process engine."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import cast

from kvmesh.common.chat import render_chat
from kvmesh.engine.args import EngineArgs
from kvmesh.engine.core.engine_core import EngineCore
from kvmesh.engine.core.messages import EngineCoreRequest
from kvmesh.engine.frontend.output_processor import RequestOutput, RequestState
from kvmesh.engine.frontend.sampling_params import SamplingParams

PromptType = str | Sequence[int]


class LLM:
    def __init__(self, model: str | None = None, *, args: EngineArgs | None = None, loaded=None, **engine_args) -> None:
        """``args``, or the `EngineArgs` fields as keywords (``LLM(max_num_seqs=4)``); ``loaded``: an
        already loaded model (engine/models/loader.py), reused across engines."""
        if args is None:
            args = EngineArgs(model=model, **engine_args)
        elif model is not None or engine_args:
            raise TypeError("give either args or EngineArgs fields as keywords, not both")
        self.engine, self.tokenizer = EngineCore.from_model(args, loaded=loaded)
        self._ids = itertools.count()

    # ---- tokenization -------------------------------------------------------
    def encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt, add_special_tokens=True).input_ids)
        ids = list(prompt)
        if not all(isinstance(t, int) for t in ids):
            raise ValueError("a token-id prompt must be a list of integers")
        return None, ids

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """The conversation's prompt ids, rendered as the API server renders them (`render_chat`)."""
        if not messages:
            raise ValueError("messages is empty")
        return render_chat(self.tokenizer, messages)

    # ---- generation ---------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
        lora_name: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """``lora_name``: the LoRA adapter (an engine's `list_loras` name) of every prompt, or one per
        prompt (None: the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [cast(PromptType, prompts)]  # one prompt
        else:
            batch = list(cast(Sequence[PromptType], prompts))
        encoded = [self.encode(p) for p in batch]
        return self._run(encoded, params, cache_salt, lora_name)

    def chat(
        self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run([(None, self.apply_chat_template(c)) for c in convs], params, None)  # type: ignore[arg-type]

    def _run(self, encoded, params, cache_salt, lora_name=None) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(encoded)
        if len(plist) != len(encoded):
            raise ValueError("need one SamplingParams per prompt")
        loras = [lora_name] * len(encoded) if lora_name is None or isinstance(lora_name, str) else list(lora_name)
        if len(loras) != len(encoded):
            raise ValueError("need one lora_name per prompt (or one for all)")
        # Validate everything first so a bad prompt in a batch leaves no request behind.
        reqs = []
        for (text, ids), p, lora in zip(encoded, plist, loras):
            req = EngineCoreRequest(
                request_id=f"offline-{next(self._ids)}",
                prompt_token_ids=ids,
                params=p,
                cache_salt=cache_salt,
                lora_name=lora,
            )
            self.engine.validate(req)
            reqs.append((req, text))
        states: dict[str, RequestState] = {}
        order = []
        for req, text in reqs:
            self.engine.add_request(req)
            states[req.request_id] = RequestState(
                req.request_id, text, req.prompt_token_ids, req.params, self.tokenizer
            )
            order.append(req.request_id)
        while self.engine.has_unfinished():
            for eo in self.engine.step():
                st = states.get(eo.request_id)
                if st is None:
                    continue
                _, stopped = st.process(eo)
                if stopped:
                    self.engine.abort_sequence(eo.request_id, eo.index)
        return [states[rid].result for rid in order]

    def stats(self) -> dict:
        s = self.engine.stats()
        return {
            "num_free_blocks": s.num_free_blocks,
            "num_total_blocks": s.num_total_blocks,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "num_preemptions": s.num_preemptions,
            "kv_cache_usage": s.kv_cache_usage,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
        }
