"""The HF oracle as the engine's greedy runs compare with it: tokens per prompt, cut where the engine stops."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def hf_greedy(hf_model, smol):
    """``hf_greedy(prompts, max_new_tokens, **generate_kw)``: HF's greedy tokens for each prompt (token ids),
    each list cut after its first EOS, as the engine stops there unless told to ignore it."""
    import torch

    eos = set(smol.config.eos_token_ids)

    def generate(prompts: list[list[int]], max_new_tokens: int, **kw) -> list[list[int]]:
        out = []
        with torch.inference_mode():
            for ids in prompts:
                x = torch.tensor([ids])
                g = hf_model.generate(
                    x,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    attention_mask=torch.ones_like(x),
                    pad_token_id=2,
                    **kw,
                )[0, len(ids) :].tolist()
                out.append(g[: next((i + 1 for i, t in enumerate(g) if t in eos), len(g))])
        return out

    return generate
