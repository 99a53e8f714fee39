"""Random-weight Llama models (no download) give the same greedy tokens as HF transformers
built from the same config and tensors, llama3 rope scaling and GQA included (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")


def test_random_model_matches_hf_greedy():
    from kvmesh.engine.args import EngineArgs
    from kvmesh.engine.core.engine_core import EngineCore
    from kvmesh.engine.core.messages import EngineCoreRequest
    from kvmesh.engine.frontend.sampling_params import SamplingParams
    from kvmesh.engine.models.random_init import hf_model_from_state_dict, random_model, scaled_config

    cfg = scaled_config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=500,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    lm = random_model(cfg, dtype=torch.float32, seed=1)
    assert lm.config.rope_scaling_dict["rope_type"] == "llama3"
    hf = hf_model_from_state_dict(cfg, lm.state_dict, "cpu", torch.float32)
    eng, _ = EngineCore.from_model(
        EngineArgs(device="cpu", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=40, max_model_len=256),
        loaded=lm,
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 17, 33, 60)]
    for i, p in enumerate(prompts):
        eng.add_request(
            EngineCoreRequest(
                request_id=str(i),
                prompt_token_ids=p,
                params=SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0),
            )
        )
    outs = {str(i): [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert outs[str(i)] == ref[0, len(p) :].tolist()
