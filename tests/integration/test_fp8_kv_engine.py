"""Greedy decoding through the engine with an FP8 KV cache on SmolLM2 (real weights, CPU reference path).

FP8 KV changes what attention reads (each cached key and value rounded to 3 mantissa bits), so its
greedy tokens are not the float32 cache's: once one token differs, the continuations part. Measured
here (14 prompts of 20-30 tokens, 16 new tokens each, one batch with chunked prefills; float32
model, scale 1.0): 0.78 of the token positions agree with the float32 cache, and 12 of the 14
continuations agree on their first 4 tokens (a bfloat16 model, FP8 against a bf16 cache: 0.80 and
12 of 14). The bounds below (0.70 of the positions, the first 4
tokens of at least 10 prompts) fail when the cache is read wrongly (agreement then drops to near
zero) while leaving room for FP8's own divergence. An FP8 engine is also deterministic: the same
prompts again, now partly from its prefix cache (FP8 blocks read back), give the same tokens.
"""

from __future__ import annotations

import os

import pytest

from kvmesh import LLM, SamplingParams

pytestmark = pytest.mark.integration

MAX_NEW = 16
PREFACE = "Continue the following text in plain English, briefly and without repeating it.\n\n"
PROMPTS = [
    PREFACE + p
    for p in (
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time",
        "1, 2, 3, 4, 5,",
        "Translate to French: Good morning, how are you?",
        "The three primary colors are",
        "import numpy as np\nimport torch\n\n",
        "Q: What is the boiling point of water?\nA:",
        "Roses are red,",
        "A haiku about the sea:",
        "The quick brown fox",
        "SELECT name FROM users WHERE",
        "In 1969, astronauts",
        "Dear Sir or Madam,",
    )
]
POSITION_AGREEMENT_BOUND = 0.70
FIRST_TOKENS, MIN_PROMPTS_FIRST_TOKENS = 4, 10


@pytest.fixture(scope="module")
def engines(smol):
    os.environ.setdefault("KVMESH_CPU_THREADS", "1")
    # a small step budget: the batch's prefills are chunked and mixed with decodes
    auto = LLM(loaded=smol, num_kv_blocks=128, max_num_batched_tokens=96)
    fp8 = LLM(loaded=smol, num_kv_blocks=128, max_num_batched_tokens=96, kv_cache_dtype="fp8")
    return auto, fp8


def test_fp8_kv_greedy_agrees_with_float_kv(engines):
    auto, fp8 = engines
    assert fp8.engine.runner.kv_cache.dtype.itemsize == 1 and auto.engine.runner.kv_cache.dtype.itemsize == 4
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in auto.generate(PROMPTS, sp)]
    got = [o.outputs[0].token_ids for o in fp8.generate(PROMPTS, sp)]
    agree = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g)) / (len(PROMPTS) * MAX_NEW)
    heads = sum(w[:FIRST_TOKENS] == g[:FIRST_TOKENS] for w, g in zip(want, got))
    print(f"fp8 KV: {agree:.3f} of positions agree; {heads}/{len(PROMPTS)} agree on the first {FIRST_TOKENS}")
    assert agree >= POSITION_AGREEMENT_BOUND
    assert heads >= MIN_PROMPTS_FIRST_TOKENS
    # again, from the FP8 prefix cache: the same tokens
    hits = fp8.stats()["prefix_cache_hits"]
    again = [o.outputs[0].token_ids for o in fp8.generate(PROMPTS, sp)]
    assert again == got and fp8.stats()["prefix_cache_hits"] > hits
    s = fp8.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]
