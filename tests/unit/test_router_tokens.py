"""The router must hash exactly the ids the pod's API server tokenizes (its fast path included)."""
from __future__ import annotations

import random

import pytest


@pytest.fixture(scope="module")
def rt():
    from kvmesh.services.router.tokens import RouterTokenizer

    return RouterTokenizer(None)


def test_fast_encode_equals_the_hf_tokenizer(rt):
    rng = random.Random(7)
    words = ["alpha", " beta", "γ", "漢字", "🎉", "\n", "\t", "  ", "12345", "!!", "<|im_start|>", "don't"]
    texts = ["", "Hello world", "  leading spaces\nand newlines"] + [
        "".join(rng.choice(words) for _ in range(rng.randrange(1, 200))) for _ in range(40)]
    assert rt._fast is not None  # the embedded model's tokenizer is a fast one: the fast path is what runs
    for t in texts:
        assert rt._encode(t) == list(rt.tokenizer(t, add_special_tokens=True).input_ids), t


def test_prompt_forms(rt):
    ids = rt.prompt_ids("/v1/completions", {"prompt": "The capital of France is"})
    assert ids == list(rt.tokenizer("The capital of France is", add_special_tokens=True).input_ids)
    assert rt.prompt_ids("/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert rt.prompt_ids("/v1/completions", {"prompt": ["The capital", "x"]}) == rt._encode("The capital")
    assert rt.prompt_ids("/v1/completions", {"prompt": {"not": "valid"}}) is None
