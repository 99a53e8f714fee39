"""Router details SREs and the index depend on: tokenization identical to the pod's, metric series of departed pods."""
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


def test_removed_pod_leaves_no_health_series():
    """A pod that left (EndpointSlice update) must not keep reporting healthy: alerts count healthy pods."""
    from kvmesh.services.router.app import Router
    from kvmesh.services.router.config import PodSpec, RouterConfig
    from kvmesh.services.router.testing import IdTokenizer

    r = Router(RouterConfig(block_size=16), tokenizer=IdTokenizer())

    def healthy_series():
        return {s.labels["pod"] for fam in r.metrics.registry.collect() for s in fam.samples
                if s.name == "kvmesh:router_pod_healthy"}

    r.add_pod(PodSpec("http://a:1"))
    r.add_pod(PodSpec("http://b:1"))
    assert healthy_series() == {"http://a:1", "http://b:1"}
    r.remove_pod("http://a:1")
    assert healthy_series() == {"http://b:1"}
    r.remove_pod("http://a:1")  # twice: no error
