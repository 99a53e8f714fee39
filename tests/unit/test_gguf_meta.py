"""The GGUF header reader that configures workers which do not load weights (``--simulate``, the
API process): it must read what gguf's own reader reads, and hand a file it cannot read back to it."""

from __future__ import annotations

import pytest

from kvmesh.common.model_files import (
    ModelLoadError,
    embedded_model_path,
    gguf_meta_from_reader,
    load_model_files,
    open_gguf,
    read_gguf_meta,
)

pytestmark = pytest.mark.unit


def test_header_reader_matches_gguf_reader_on_the_embedded_model():
    path = embedded_model_path()
    fast = read_gguf_meta(path)
    ref = gguf_meta_from_reader(open_gguf(path))
    assert fast.fields == {k: v for k, v in ref.fields.items() if not k.startswith("GGUF.")}
    assert fast.array_len == ref.array_len and fast.array_len["tokenizer.ggml.tokens"] == 49152
    assert fast.tensor_names == ref.tensor_names and "blk.29.ffn_down.weight" in fast.tensor_names
    cfg = load_model_files(path, load_tokenizer=False).config
    assert (cfg.vocab_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (49152, 30, 9, 3)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)


def test_truncated_header_is_refused_and_falls_back_to_a_clear_error(tmp_path):
    whole = open(embedded_model_path(), "rb").read(2 << 20)  # header (metadata + tensor infos) is ~1.8 MB
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:5000])  # inside the vocabulary array
    with pytest.raises(ValueError, match="corrupt|past the end"):
        read_gguf_meta(str(cut))
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model_files(str(cut), load_tokenizer=False)


def test_gguf_tokenizer_is_converted_once_into_the_cache_and_read_back_from_it(tmp_path, monkeypatch):
    """A damaged cache is converted again; the converting process returns the tokenizer as saved (the
    one every later process reads), equal to transformers' own; no temporary folder is left."""
    import os

    from transformers import AutoTokenizer

    from kvmesh.common.model_files import gguf_tokenizer, gguf_tokenizer_cache

    monkeypatch.setenv("KVMESH_CACHE", str(tmp_path))
    path = embedded_model_path()
    cache = gguf_tokenizer_cache(path)
    assert cache.startswith(str(tmp_path))
    os.makedirs(cache)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(cache, name), "w") as f:
            f.write("{not json")
    first = gguf_tokenizer(path)
    assert os.listdir(os.path.dirname(cache)) == [os.path.basename(cache)]
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True)
    text = "Hello world, γ 漢字 🎉 don't <|im_start|>user\nhi<|im_end|>"
    assert type(first) is type(ref) and first(text).input_ids == ref(text).input_ids
    assert gguf_tokenizer(path)(text).input_ids == ref(text).input_ids  # read from the cache
