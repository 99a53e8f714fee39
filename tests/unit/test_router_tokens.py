"""Router details SREs and the index depend on: tokenization identical to the pod's, metric series of departed pods."""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def rt():
    from kvmesh.services.router.tokens import RouterTokenizer

    return RouterTokenizer(None)


def test_chat_is_rendered_by_the_engine_and_non_text_parts_are_refused(rt):
    """The router's chat ids are the engine's `render_chat` ids (what the pod computes); a non-text
    content part is refused as the API server refuses it, not dropped."""
    from kvmesh.common.chat import ChatContentError, render_chat

    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    body = {"messages": [{"role": "user", "content": parts}], "continue_final_message": False}
    assert rt.prompt_ids("/v1/chat/completions", body) == render_chat(rt.tokenizer, body["messages"])
    assert render_chat(rt.tokenizer, body["messages"]) == render_chat(
        rt.tokenizer, [{"role": "user", "content": "Hello\nthere"}]
    )
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    with pytest.raises(ChatContentError, match="image_url"):
        rt.prompt_ids("/v1/chat/completions", image)


def test_fast_encode_equals_the_hf_tokenizer(rt):
    rng = random.Random(7)
    words = ["alpha", " beta", "γ", "漢字", "🎉", "\n", "\t", "  ", "12345", "!!", "<|im_start|>", "don't"]
    texts = ["", "Hello world", "  leading spaces\nand newlines"] + [
        "".join(rng.choice(words) for _ in range(rng.randrange(1, 200))) for _ in range(40)
    ]
    assert rt._fast is not None  # the embedded model's tokenizer is a fast one: the fast path is what runs
    for t in texts:
        assert rt._encode(t) == list(rt.tokenizer(t, add_special_tokens=True).input_ids), t


def test_prompt_forms(rt):
    ids = rt.prompt_ids("/v1/completions", {"prompt": "The capital of France is"})
    assert ids == list(rt.tokenizer("The capital of France is", add_special_tokens=True).input_ids)
    assert rt.prompt_ids("/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert rt.prompt_ids("/v1/completions", {"prompt": ["The capital", "x"]}) == rt._encode("The capital")
    assert rt.prompt_ids("/v1/completions", {"prompt": {"not": "valid"}}) is None


def test_long_prompts_tokenize_off_the_event_loop(rt, monkeypatch):
    """Above OFFLOAD_CHARS the prompt is tokenized on a worker thread (the Rust tokenizer releases the
    GIL there), with the same ids as inline; short prompts stay on the loop's thread."""
    import asyncio
    import threading

    from kvmesh.services.router import tokens

    threads = []
    inline = rt.prompt_ids

    def spy(path, body):
        threads.append(threading.current_thread().name)
        return inline(path, body)

    long_text = " ".join(f"word{i} γ 漢字 don't" for i in range(tokens.OFFLOAD_CHARS // 10))
    assert len(long_text) > tokens.OFFLOAD_CHARS
    chat = {"messages": [{"role": "system", "content": long_text}, {"role": "user", "content": "hi"}]}
    expect = [
        inline("/v1/completions", {"prompt": long_text}),
        inline("/v1/chat/completions", chat),
        inline("/v1/completions", {"prompt": "short"}),
    ]
    monkeypatch.setattr(rt, "prompt_ids", spy)

    async def go():
        return [
            await rt.prompt_ids_async("/v1/completions", {"prompt": long_text}),
            await rt.prompt_ids_async("/v1/chat/completions", chat),
            await rt.prompt_ids_async("/v1/completions", {"prompt": "short"}),
        ]

    try:
        got = asyncio.run(go())
    finally:
        rt.close()
    assert got == expect and len(got[0]) > 1000
    assert [t.startswith("router-tokenize") for t in threads] == [True, True, False]


def test_piece_cache_is_exact_and_skips_repeated_prefixes(rt):
    """Long prompts tokenized in cached pieces give exactly the whole-text ids (cuts land next to
    spaces, newlines, digits, punctuation, contractions, CJK, emoji and special-token text), and a
    follow-up that repeats a prompt only sends its new pieces to the tokenizer."""
    from kvmesh.services.router.token_cache import PieceCache

    pc = rt.pieces
    assert pc is not None  # the embedded tokenizer is byte-level BPE with the GPT-2 regex
    small = PieceCache(rt._fast, piece_chars=24, max_pieces=64)  # many cuts, and evictions
    rng = random.Random(11)
    words = [
        "alpha",
        " beta",
        " Gamma",
        "γ",
        " δέλτα",
        "漢字",
        " 漢字",
        "🎉",
        "\n",
        "\n\n",
        "\t",
        "  ",
        "   x",
        " 12345",
        "7",
        "!!",
        " ?!",
        "<|im_start|>",
        "<|im_end|>",
        " don't",
        "'s",
        " 's",
        "\u00a0",
        " \u3000y",
        " ÉCOLE",
        " x" * 3,
    ]
    whole = rt._fast.encode_batch_fast
    for _ in range(300):
        text = "".join(rng.choice(words) for _ in range(rng.randrange(1, 400)))
        expect = whole([text], add_special_tokens=True)[0].ids
        assert small.encode(text) == expect, repr(text)
        cuts = small.cut_points(text)
        assert all(text[i] == " " and text[i + 1].isalpha() and not text[i - 1].isspace() for i in cuts)

    turn1 = " ".join(f"turn one word{i} δέλτα, don't!" for i in range(400))
    turn2 = turn1 + "\n" + " ".join(f"turn two w{i}" for i in range(200))
    assert rt._encode(turn1) == whole([turn1], add_special_tokens=True)[0].ids
    misses = pc.misses
    assert rt._encode(turn2) == whole([turn2], add_special_tokens=True)[0].ids
    new_pieces = pc.misses - misses
    assert 0 < new_pieces <= len(pc.cut_points(turn2)) + 1 - len(pc.cut_points(turn1))

    # chat: the rendered conversation in pieces == the template's own tokenization
    chat = {
        "messages": [
            {"role": "system", "content": turn1},
            {"role": "user", "content": "Summarise."},
            {"role": "assistant", "content": turn2[:3000]},
            {"role": "user", "content": "And now?"},
        ]
    }
    msgs = [dict(m) for m in chat["messages"]]
    want = rt.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "input_ids") else want
    assert rt.prompt_ids("/v1/chat/completions", chat) == list(want)


def test_piece_cache_refuses_tokenizers_it_cannot_cut():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from kvmesh.services.router.token_cache import PieceCache

    def bpe(pre, norm=None):
        t = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, " ": 2, "Ġ": 3}, merges=[]))
        t.pre_tokenizer = pre
        if norm is not None:
            t.normalizer = norm
        return t

    assert PieceCache.for_tokenizer(bpe(pre_tokenizers.ByteLevel(add_prefix_space=False))) is not None
    assert PieceCache.for_tokenizer(bpe(pre_tokenizers.ByteLevel(add_prefix_space=True))) is None
    assert PieceCache.for_tokenizer(bpe(pre_tokenizers.Metaspace())) is None  # sentencepiece-style
    assert PieceCache.for_tokenizer(bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), normalizers.NFKC())) is None
    assert PieceCache.for_tokenizer(None) is None


def test_removed_pod_leaves_no_health_series():
    """A pod that left (EndpointSlice update) must not keep reporting healthy: alerts count healthy pods."""
    from kvmesh.services.router.config import PodSpec, RouterConfig
    from kvmesh.services.router.router import Router
    from kvmesh.testing.pods import IdTokenizer

    r = Router(RouterConfig(block_size=16), tokenizer=IdTokenizer())

    def healthy_series():
        return {
            s.labels["pod"]
            for fam in r.metrics.registry.collect()
            for s in fam.samples
            if s.name == "kvmesh:router_pod_healthy"
        }

    r.add_pod(PodSpec("http://a:1"))
    r.add_pod(PodSpec("http://b:1"))
    assert healthy_series() == {"http://a:1", "http://b:1"}
    r.remove_pod("http://a:1")
    assert healthy_series() == {"http://b:1"}
    r.remove_pod("http://a:1")  # twice: no error
