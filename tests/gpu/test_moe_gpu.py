"""Qwen3-MoE on the GPU: the compiled fused-MoE kernel against its torch reference (eager and
replayed from a CUDA graph with new routing), and a small Qwen3-MoE through the engine (CUDA-graph
decode) giving HF transformers' greedy tokens on the same float32 tensors."""

from __future__ import annotations

import pytest
import torch

import kvmesh.kernels as K

BOUND = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


def _case(gen, T, H, inter, E, k, dtype):
    x = torch.randn(T, H, generator=gen, device="cuda").to(dtype)
    w1 = (torch.randn(E, 2 * inter, H, generator=gen, device="cuda") * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=gen, device="cuda") * inter**-0.5).to(dtype)
    weights, ids = K.moe_routing(torch.randn(T, E, generator=gen, device="cuda").to(dtype), k, True)
    return x, w1, w2, weights, ids


def _err(out, x, w1, w2, weights, ids):
    ref = K.fused_moe_reference(x.float(), w1.float(), w2.float(), weights.float(), ids)
    assert torch.isfinite(out).all()
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("T", [1, 32, 128, 256])
def test_routing_and_align_kernels_equal_the_torch_ops(gen, T):
    """bf16 logits over 128 experts (ties are common): the routing kernel picks the reference's experts
    in its order (ties to the lower expert id) and the align kernel gives the torch path's outputs."""
    from kvmesh.kernels import moe as kmoe

    logits = torch.randn(T, 128, generator=gen, device="cuda").bfloat16()
    w, ids = K.moe_routing(logits, 8, True)
    rw, rids = K.moe_routing_reference(logits, 8, True)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w.float(), rw.float(), rtol=8e-3, atol=1e-7)
    for a, b in zip(kmoe.moe_align(ids, 128, 16), kmoe.moe_align_torch(rids, 128, 16)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 7, 128, 1000])
def test_fused_moe_matches_reference(gen, T, dtype):
    args = _case(gen, T, 256, 96, 16, 4, dtype)
    out = K.fused_moe(*args)
    assert K.backend(out) == "triton" and out.shape == (T, 256)
    assert _err(out, *args) < BOUND[dtype]


@pytest.mark.parametrize("T,k", [(1, 8), (2, 8), (3, 4)])
def test_moe_gemv_path_matches_grouped_gemm_and_reference(gen, T, k):
    """A few pairs through the matrix-vector kernels (``moe_gemv``); the grouped GEMM (the default) on the
    same inputs and the fp32 reference agree with them."""
    args = _case(gen, T, 2048, 768, 128, k, torch.bfloat16)
    out = K.fused_moe(*args, choices=K.KernelChoices(moe_gemv=True))
    grouped = K.fused_moe(*args)
    assert _err(out, *args) < BOUND[torch.bfloat16]
    assert ((out.float() - grouped.float()).norm() / grouped.float().norm()).item() < 1e-2


@pytest.mark.parametrize("gemv", [True, False])  # the matrix-vector kernels, the grouped GEMM
def test_fused_moe_in_a_cuda_graph_follows_new_routing(gen, gemv):
    T = 2
    x, w1, w2, weights, ids = _case(gen, T, 256, 96, 16, 4, torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        K.fused_moe(x, w1, w2, weights, ids, choices=K.KernelChoices(moe_gemv=gemv))
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = K.fused_moe(x, w1, w2, weights, ids, choices=K.KernelChoices(moe_gemv=gemv))
    for _ in range(3):  # new tokens and new routing in the same buffers: no host sync, no stale sizes
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        w, i = K.moe_routing(torch.randn(T, 16, generator=gen, device="cuda").bfloat16(), 4, True)
        weights.copy_(w)
        ids.copy_(i)
        g.replay()
        torch.cuda.synchronize()
        assert _err(out, x, w1, w2, weights, ids) < BOUND[torch.bfloat16]


def _small_moe():
    from kvmesh.engine.models.random_init import QWEN3_30B_A3B, hf_model_from_state_dict, random_model, scaled_config

    cfg = scaled_config(
        QWEN3_30B_A3B,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=4,
        mlp_only_layers=[2],
        vocab_size=32000,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    loaded = random_model(cfg, name="small-moe", dtype=torch.float32, device="cuda", seed=5)
    return loaded, hf_model_from_state_dict(cfg, loaded.state_dict, "cuda", torch.float32)


def _greedy(loaded, prompts, max_tokens=16, **choices):
    from kvmesh.engine.args import EngineArgs
    from kvmesh.engine.core.engine_core import EngineCore
    from kvmesh.engine.core.messages import EngineCoreRequest
    from kvmesh.engine.frontend.sampling_params import SamplingParams

    eng, _ = EngineCore.from_model(
        EngineArgs(device="cuda", dtype="float32", max_model_len=512, num_kv_blocks=256, max_num_seqs=16, **choices),
        loaded=loaded,
    )
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        eng.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=p, params=params))
    outs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
    graph_steps = eng.runner.num_graph_steps
    eng.shutdown()
    return [outs[str(i)] for i in range(len(prompts))], graph_steps


def _hf_greedy(hf, p, max_tokens=16):
    with torch.no_grad():
        ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return ref[0, len(p) :].tolist()


def test_small_qwen3_moe_engine_matches_hf():
    loaded, hf = _small_moe()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32000, (n,), generator=g).tolist() for n in (9, 40, 120, 17, 64, 33)]
    outs, graph_steps = _greedy(loaded, prompts)
    assert graph_steps > 0  # decode ran in CUDA graphs, the fused kernel inside them
    for i, p in enumerate(prompts):
        assert outs[i] == _hf_greedy(hf, p), f"prompt {i}"


def test_batch_one_decode_with_the_norms_inside_the_gemvs_matches_hf():
    """Batch 1: the input norm formed inside q|k|v's GEMV and the post-attention norm inside the router's
    (``fused_norm_gemv``), with the decode inputs advanced by one launch (``advance_kernel``), give HF's
    tokens, as the separate launches do."""
    loaded, hf = _small_moe()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 32000, (n,), generator=g).tolist() for n in (23, 77)]
    for p in prompts:
        ref = _hf_greedy(hf, p, 24)
        fused, graph_steps = _greedy(loaded, [p], 24, fused_norm_gemv=True, advance_kernel=True)
        plain, _ = _greedy(loaded, [p], 24, fused_norm_gemv=False)
        assert graph_steps > 0
        assert fused == [ref] and plain == [ref]
